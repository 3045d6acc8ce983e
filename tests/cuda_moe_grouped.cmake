# Grouped routed experts for the batched decode step (cuda/kernels/moe_grouped.h): label gpu (the
# GPU machine only).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_moe_grouped SOURCES test_cuda_moe_grouped.cpp LIBS fngen_cuda LABEL gpu)
endif()
