# `fngen bench` (apps/cmd_bench.cpp) end to end on the tp4 fixture with --backend cpu: formats,
# per-token record, roofline columns against `fngen inspect`, bad input (label cpu); the same
# lanes through mpirun -np 2, printed once (label mpi).
add_test(NAME bench_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/bench_cli.sh
                                $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR} cpu)
set_tests_properties(bench_cli PROPERTIES LABELS cpu TIMEOUT 600)
add_test(NAME bench_cli_mpi COMMAND bash ${CMAKE_SOURCE_DIR}/tests/bench_cli.sh
                                    $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR} mpi)
set_tests_properties(bench_cli_mpi PROPERTIES LABELS mpi TIMEOUT 600)
# scripts/step_timeline.py (the summary of `cuda_model_bench --trace`) on a hand-made trace with
# known launch costs, a late CTA and grid ids replayed as a CUDA graph replays them.
add_test(NAME step_timeline_script COMMAND /usr/bin/python3 ${CMAKE_SOURCE_DIR}/tests/step_timeline_test.py)
set_tests_properties(step_timeline_script PROPERTIES LABELS cpu TIMEOUT 60)
