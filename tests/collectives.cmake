# core/collectives.h: agree_on_error, the cross-rank agreement on a rank-local failure.
fn_add_test(NAME test_agree_on_error SOURCES test_agree_on_error.cpp LIBS fngen_comm LABEL mpi)
