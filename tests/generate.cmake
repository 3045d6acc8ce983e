# Sampler and generation loop (core/sampler, core/generate) and `fngen generate` end to end.
fn_add_test(NAME test_sampler SOURCES test_sampler.cpp LABEL cpu)
fn_add_test(NAME test_generate SOURCES test_generate.cpp LABEL cpu)
# `mpirun -np N fngen generate` end to end: reference ids at -np 1/2/4 and every bad-input case.
add_test(NAME generate_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/generate_cli.sh
                                   $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(generate_cli PROPERTIES LABELS mpi TIMEOUT 900)
# The generation loop at TP 2 and 4 in-process (MPI_Comm_split groups of a 4-rank run).
fn_add_test(NAME test_generate_tp SOURCES test_generate_tp.cpp LIBS fngen_comm LABEL mpi)
