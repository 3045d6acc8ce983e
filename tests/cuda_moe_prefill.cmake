# Batched routed experts (cuda/kernels/moe_prefill.h): label gpu (the GPU machine only).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_moe_prefill SOURCES test_cuda_moe_prefill.cpp LIBS fngen_cuda LABEL gpu)
endif()
