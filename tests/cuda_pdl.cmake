# Programmatic dependent launch (cuda/common/pdl.h): a chain of decode kernels gives the same bits with
# PDL on and off, eagerly and from a CUDA graph. Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_pdl SOURCES test_cuda_pdl.cpp LIBS fngen_cuda LABEL gpu)
endif()
