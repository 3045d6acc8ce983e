# Decode-step helper kernels (cuda/kernels/decode_ops.h) and on-device sampling (cuda/kernels/sample.h) against
# the CPU oracle (core/cpu_ops.h, core/sampler.h). Label gpu: the GPU machine only.
if(TARGET fngen_cuda)
  # router_topk_reference.cu: the earlier router top-k block, the bitwise reference of the current.
  fn_add_test(NAME test_cuda_decode_ops SOURCES test_cuda_decode_ops.cpp router_topk_reference.cu
              LIBS fngen_cuda LABEL gpu)
  set_target_properties(test_cuda_decode_ops PROPERTIES CUDA_STANDARD 17)
  target_compile_options(test_cuda_decode_ops PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr>)
  fn_add_test(NAME test_cuda_sample SOURCES test_cuda_sample.cpp LIBS fngen_cuda LABEL gpu)
endif()
