# CudaModel (the CUDA decode backend) against the transformers reference fixtures: TP=1 on every
# rank and TP=2 across two ranks (label gpu; the GPU machine with 2 GPUs: mpirun -np 2).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_model SOURCES test_cuda_model.cpp LIBS fngen_cuda
              LABEL gpu MPI NP 2 TIMEOUT 600)
endif()
# The same check against the CPU model on a 4-layer synth checkpoint of the real widths (writes
# ~10 GB; $FN_REALWIDTH_DIR keeps it between runs).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_model_realwidth SOURCES test_cuda_model_realwidth.cpp LIBS fngen_cuda
              LABEL gpu MPI NP 2 TIMEOUT 1200)
  target_compile_definitions(test_cuda_model_realwidth PRIVATE
                             FN_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
endif()
# The n-gram table in pinned host memory against the device-resident one: bitwise the same logits
# on the fixtures (TP=1 and TP=2), with random weights (tiny and a 4-layer real-width slice with
# the 47.7 GiB table), and auto's decision under --gpu-memory-utilization.
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_ngram_host SOURCES test_cuda_ngram_host.cpp LIBS fngen_cuda
              LABEL gpu MPI NP 2 TIMEOUT 1200)
endif()
# Sequence slots and the batched step (CudaModel::forward_batch) against each sequence alone, and
# the batch engine on them (TP=1).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_cuda_batch SOURCES test_cuda_batch.cpp LIBS fngen_cuda
              LABEL gpu MPI NP 1 TIMEOUT 600)
endif()
