# PLE kernel tests (cuda/kernels/ple.h): n-gram gather, context shift and ple_apply against the CPU
# oracle (core/ngram.h, core/cpu_ops.h). Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_ple SOURCES test_cuda_ple.cpp LIBS fngen_cuda LABEL gpu)
endif()
