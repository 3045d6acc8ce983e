# QSA decode kernels (cuda/qsa.h) against the CPU ops of core/cpu_ops.h (label gpu: GPU machine).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_qsa SOURCES test_cuda_qsa.cpp LIBS fngen_cuda LABEL gpu)
endif()
