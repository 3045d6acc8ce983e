# Batched-prefill PLE kernels (cuda/kernels/ple.h *_rows) against M successive decode launches of the
# decode kernels on an identical copy of the state. Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_ple_rows SOURCES test_cuda_ple_rows.cpp LIBS fngen_cuda LABEL gpu)
endif()
