# fngen eval (core/eval): perplexity windows, KLD statistics, the reference-logits file.
fn_add_test(NAME test_eval SOURCES test_eval.cpp LABEL cpu)
# `fngen eval` end to end on the reference fixtures (KLD vs transformers' logits at -np 1, 2, 4; PPL
# against exp(mean NLL) of the reference; files written by scripts/reference/dump_reference_logits.py
# and read back both ways; score; bad input and exit codes).
add_test(NAME eval_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/eval_cli.sh
                               $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(eval_cli PROPERTIES LABELS mpi TIMEOUT 900)
