# cuda/ kernel tests (label gpu: the GPU machine only). Each compares a kernel with a host
# reference built from core/codecs.h and core/cpu_ops.h. The NVFP4 bit mappings are plain C++
# and are checked on every machine (label cpu, no CUDA needed).
fn_add_test(NAME test_cuda_nvfp4_bits SOURCES test_cuda_nvfp4_bits.cpp LABEL cpu)
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_gemv SOURCES test_cuda_gemv.cpp LIBS fngen_cuda LABEL gpu)
  # pdl_late_writer.cu: a predecessor that changes the expert ids after letting the down start.
  fn_add_test(NAME test_cuda_moe_nvfp4 SOURCES test_cuda_moe_nvfp4.cpp pdl_late_writer.cu
              LIBS fngen_cuda LABEL gpu)
  set_target_properties(test_cuda_moe_nvfp4 PROPERTIES CUDA_STANDARD 17)
  target_compile_options(test_cuda_moe_nvfp4 PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr>)
  fn_add_test(NAME test_cuda_hc SOURCES test_cuda_hc.cpp LIBS fngen_cuda LABEL gpu)
endif()
