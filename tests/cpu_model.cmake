# CPU reference backend: the FP32 ops of MODEL.md §C (unit, hand-computed values).
fn_add_test(NAME test_cpu_ops SOURCES test_cpu_ops.cpp LABEL cpu)
