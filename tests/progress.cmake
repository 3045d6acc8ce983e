# core/progress: the rank-0 load progress line.
fn_add_test(NAME test_progress SOURCES test_progress.cpp LABEL cpu)
