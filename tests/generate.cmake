# Sampler and generation loop (core/sampler, core/generate) and `fngen generate` end to end.
fn_add_test(NAME test_sampler SOURCES test_sampler.cpp LABEL cpu)
fn_add_test(NAME test_generate SOURCES test_generate.cpp LABEL cpu)
fn_add_test(NAME test_generate_device SOURCES test_generate_device.cpp LABEL cpu)
# `mpirun -np N fngen generate` end to end: reference ids at -np 1/2/4 and every bad-input case.
add_test(NAME generate_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/generate_cli.sh
                                   $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(generate_cli PROPERTIES LABELS mpi TIMEOUT 900)
# The generation loop at TP 2 and 4 in-process (MPI_Comm_split groups of a 4-rank run).
fn_add_test(NAME test_generate_tp SOURCES test_generate_tp.cpp LIBS fngen_comm LABEL mpi)
# The main job at -np 4 on the tp4 fixture; also labelled cpu so that the ASan+UBSan pass of
# scripts/test.sh (ctest -L cpu) runs it. Slow unwinding lets LeakSanitizer attribute Open MPI's
# exit-time allocations to its libraries (tests/lsan.supp); the script keeps its plugins loaded.
add_test(NAME generate_tiny COMMAND bash ${CMAKE_SOURCE_DIR}/tests/generate_tiny.sh
                                    $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(generate_tiny PROPERTIES LABELS "mpi;cpu" TIMEOUT 900 ENVIRONMENT
  "LSAN_OPTIONS=suppressions=${CMAKE_SOURCE_DIR}/tests/lsan.supp:fast_unwind_on_malloc=0;UBSAN_OPTIONS=print_stacktrace=1;ASAN_OPTIONS=detect_leaks=1")
# Continuous batching over the cpu backend's slots against generate() alone (bitwise).
fn_add_test(NAME test_batch_engine SOURCES test_batch_engine.cpp LABEL cpu)
