# cuda/ kernel tests (label gpu: the GPU machine only). Each compares a kernel with a host
# reference built from core/codecs.h and core/cpu_ops.h. The NVFP4 bit mappings are plain C++
# and are checked on every machine (label cpu, no CUDA needed).
fn_add_test(NAME test_cuda_nvfp4_bits SOURCES test_cuda_nvfp4_bits.cpp LABEL cpu)
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_gemv SOURCES test_cuda_gemv.cpp LIBS fngen_cuda LABEL gpu)
  fn_add_test(NAME test_cuda_moe_nvfp4 SOURCES test_cuda_moe_nvfp4.cpp LIBS fngen_cuda LABEL gpu)
  fn_add_test(NAME test_cuda_hc SOURCES test_cuda_hc.cpp LIBS fngen_cuda LABEL gpu)
endif()
