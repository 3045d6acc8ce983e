# QSA prefill kernels (cuda/kernels/qsa_prefill.h) against successive QSA decode steps (label gpu).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_qsa_prefill SOURCES test_cuda_qsa_prefill.cpp LIBS fngen_cuda LABEL gpu)
endif()
