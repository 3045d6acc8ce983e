# fngen eval (core/eval): perplexity windows, KLD statistics, the reference-logits file.
fn_add_test(NAME test_eval SOURCES test_eval.cpp LABEL cpu)
# `fngen eval` end to end on the reference fixtures (KLD vs transformers' logits at -np 1, 2, 4; PPL
# against exp(mean NLL) of the reference; files written by scripts/reference/dump_reference_logits.py
# and read back both ways; score; bad input and exit codes).
add_test(NAME eval_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/eval_cli.sh
                               $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(eval_cli PROPERTIES LABELS mpi TIMEOUT 900)
# scripts/reference/dump_reference_logits.py's transformers half, checked without torch: the state dict it builds from
# each fixture checkpoint has the reference's names and shapes and the values the reference held.
add_test(NAME reference_logits_script_decodes_checkpoints_as_the_reference_held_them
         COMMAND /usr/bin/python3 ${CMAKE_SOURCE_DIR}/scripts/reference/dump_reference_logits.py
                 --check-load ${FN_TEST_DATA_DIR}/fixtures/g3_tiny ${FN_TEST_DATA_DIR}/fixtures/tp4
                 ${FN_TEST_DATA_DIR}/fixtures/ple2_long)
set_tests_properties(reference_logits_script_decodes_checkpoints_as_the_reference_held_them PROPERTIES LABELS cpu TIMEOUT 120)
# fngen eval kld against base files written by transformers on the GPU machine (tests/data/eval).
add_test(NAME eval_transformers_written_bases COMMAND bash ${CMAKE_SOURCE_DIR}/tests/eval_transformers_bases.sh
                                                       $<TARGET_FILE:fngen> ${CMAKE_SOURCE_DIR})
set_tests_properties(eval_transformers_written_bases PROPERTIES LABELS cpu TIMEOUT 300)
# Backend::prefill_rows, snapshot/restore, perplexity through the prefill and score_choices on the
# CPU reference backend against the fixture's transformers rows (tests/data/eval/loglik_tp4.*).
fn_add_test(NAME test_eval_loglik SOURCES test_eval_loglik.cpp LABEL cpu)
# `fngen eval loglik` on the tp4 items against transformers' log-probs, its error records, and
# eval's --random-weights flag mistakes (cpu backend, -np 1).
add_test(NAME eval_loglik_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/eval_loglik_cli.sh
                                       $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(eval_loglik_cli PROPERTIES LABELS cpu TIMEOUT 300)
