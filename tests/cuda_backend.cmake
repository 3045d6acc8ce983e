# CudaBackend (cuda/model/cuda_backend.h): CudaModel behind the Backend interface at TP = 1
# (label gpu, one process).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_backend SOURCES test_cuda_backend.cpp LIBS fngen_cuda LABEL gpu)
endif()
