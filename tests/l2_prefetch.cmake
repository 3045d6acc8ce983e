# The L2 prefetch lists of the decode kernels (cuda/common/l2_prefetch.h): host arithmetic only.
fn_add_test(NAME test_l2_prefetch SOURCES test_l2_prefetch.cpp LABEL cpu)
