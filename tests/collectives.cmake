# core/collectives.h: agree_on_error, the cross-rank agreement on a rank-local failure.
fn_add_test(NAME test_agree_on_error SOURCES test_agree_on_error.cpp LIBS fngen_comm LABEL mpi)
# The stall watchdog of MpiCollectives: a stopped (SIGSTOP) or hung rank ends the job with exit 5
# naming it, within the stall timeout (3 s here) plus start-up.
add_executable(comm_stall_peer comm_stall_peer.cpp)
target_link_libraries(comm_stall_peer PRIVATE fngen_comm fn_warnings)
foreach(mode stop sleep)
  add_test(NAME comm_stall_peer_${mode}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/comm_stall_peer.sh ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:comm_stall_peer> ${mode} 3 40)
  set_tests_properties(comm_stall_peer_${mode} PROPERTIES LABELS mpi TIMEOUT 150)
endforeach()
