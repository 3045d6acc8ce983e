# Gated DeltaNet prefill kernels (cuda/kernels/gdn_prefill.h) against M decode steps (label gpu: the GPU
# machine only).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_gdn_prefill SOURCES test_cuda_gdn_prefill.cpp LIBS fngen_cuda LABEL gpu)
endif()
