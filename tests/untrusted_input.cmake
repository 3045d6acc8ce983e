# Hostile input on the CPU backend, end to end: checkpoint JSON files that are devices or FIFOs,
# impossible quantisation scales and non-finite weights, a tokenizer past the model's vocabulary,
# standard input without end, empty output paths, two runs writing one file, a stopped rank.
add_test(NAME untrusted_input_cli
         COMMAND bash ${CMAKE_SOURCE_DIR}/tests/untrusted_input_cli.sh $<TARGET_FILE:fngen>
                 ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(untrusted_input_cli PROPERTIES LABELS mpi TIMEOUT 900)
fn_add_test(NAME test_weight_checks SOURCES test_weight_checks.cpp LABEL cpu)
fn_add_test(NAME test_paths SOURCES test_paths.cpp LABEL cpu)
