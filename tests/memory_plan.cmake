# CUDA backend device-memory planning (core/memory_plan) and its table in fngen inspect.
fn_add_test(NAME test_memory_plan SOURCES test_memory_plan.cpp LABEL cpu)
