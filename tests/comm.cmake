# comm/ tests. cpu: error macros, --allreduce parsing, abort hooks (no GPU needed). gpu (the GPU
# machine; mpirun -np 2, one GPU per rank): bootstrap, custom vs NCCL, graphs, counter wrap,
# concurrency, fallbacks; and the dead-peer check (a stopped rank must not hang the others).
if(TARGET fngen_comm_cuda)
  fn_add_test(NAME test_comm_cuda_check SOURCES test_comm_cuda_check.cpp
              LIBS fngen_comm_cuda LABEL cpu)
  fn_add_test(NAME test_comm_gpu SOURCES test_comm_gpu.cpp comm_test_kernels.cu
              LIBS fngen_comm_cuda LABEL gpu MPI NP 2 TIMEOUT 600)
  set_target_properties(test_comm_gpu PROPERTIES CUDA_STANDARD 17)

  add_executable(comm_dead_peer comm_dead_peer.cpp)
  target_link_libraries(comm_dead_peer PRIVATE fngen_comm_cuda fn_warnings)
  foreach(mode stuck kill)
    add_test(NAME test_comm_dead_peer_${mode}
             COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/comm_dead_peer.sh ${MPIEXEC_EXECUTABLE}
                     $<TARGET_FILE:comm_dead_peer> ${mode} 30)
    set_tests_properties(test_comm_dead_peer_${mode} PROPERTIES LABELS gpu TIMEOUT 150)
  endforeach()
endif()
