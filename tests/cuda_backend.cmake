# CudaBackend (cuda/model/cuda_backend.h): CudaModel behind the Backend interface at TP = 1
# (label gpu, one process).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_backend SOURCES test_cuda_backend.cpp LIBS fngen_cuda LABEL gpu)
endif()
# The per-row logits reductions (cuda/kernels/logit_stats.h) against the host reference, and
# CudaBackend's prefill_rows, snapshot/restore and score_choices on the tp4 fixture (label gpu).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_logit_stats SOURCES test_cuda_logit_stats.cpp LIBS fngen_cuda LABEL gpu)
endif()
