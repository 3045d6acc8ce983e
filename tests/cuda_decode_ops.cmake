# Decode-step helper kernels (cuda/decode_ops.h) and on-device sampling (cuda/sample.h) against
# the CPU oracle (core/cpu_ops.h, core/sampler.h). Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_decode_ops SOURCES test_cuda_decode_ops.cpp LIBS fngen_cuda LABEL gpu)
  fn_add_test(NAME test_cuda_sample SOURCES test_cuda_sample.cpp LIBS fngen_cuda LABEL gpu)
endif()
