# QSA decode kernels (cuda/kernels/qsa.h) against the CPU ops of core/cpu_ops.h (label gpu: GPU machine).
if(TARGET fngen_cuda)
  # qsa_select_probe.cu: launchers of the two block selects of cuda/kernels/qsa_device.cuh on given scores.
  fn_add_test(NAME test_cuda_qsa SOURCES test_cuda_qsa.cpp qsa_select_probe.cu LIBS fngen_cuda
              LABEL gpu)
  set_target_properties(test_cuda_qsa PROPERTIES CUDA_STANDARD 17)
  target_compile_options(test_cuda_qsa PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr>)
endif()
