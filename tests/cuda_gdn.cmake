# Gated DeltaNet decode kernels (cuda/kernels/gdn.h) against the CPU ops (label gpu: the GPU machine only).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_gdn SOURCES test_cuda_gdn.cpp LIBS fngen_cuda LABEL gpu)
endif()
