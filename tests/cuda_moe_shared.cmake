# Fused MoE shared-expert launches (cuda/kernels/moe_shared.h) against the separate launches of the same device code
# (bitwise) and an FP64 evaluation of the GEMV rows. Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_moe_shared SOURCES test_cuda_moe_shared.cpp LIBS fngen_cuda LABEL gpu)
endif()
