# The FLOP count of a prefill pass (core/flops.h) on the real geometry, against hand-computed
# values (label cpu).
fn_add_test(NAME test_flops SOURCES test_flops.cpp LABEL cpu)
