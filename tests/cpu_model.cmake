# CPU reference backend: the FP32 ops of MODEL.md §C (unit, hand-computed values).
fn_add_test(NAME test_cpu_ops SOURCES test_cpu_ops.cpp LABEL cpu)
# CpuModel at TP=1 against the transformers FP32 reference fixtures.
fn_add_test(NAME test_cpu_model SOURCES test_cpu_model.cpp LABEL cpu)
