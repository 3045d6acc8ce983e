# core/choice_check.h: the per-step router/indexer choice hash and its cross-rank compare.
fn_add_test(NAME test_choice_check SOURCES test_choice_check.cpp LIBS fngen_comm LABEL mpi)
