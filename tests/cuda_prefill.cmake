# CudaModel::prefill (the batched prefill) against token-by-token forward(): TP=1 on every
# rank and TP=2 across two ranks (label gpu; the GPU machine with 2 GPUs: mpirun -np 2).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_prefill SOURCES test_cuda_prefill.cpp LIBS fngen_cuda
              LABEL gpu MPI NP 2 TIMEOUT 900)
endif()
