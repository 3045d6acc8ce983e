# CUDA backend device-memory planning (core/memory_plan) and its table in fngen inspect.
fn_add_test(NAME test_memory_plan SOURCES test_memory_plan.cpp LABEL cpu)
# Where CUDA is built: the estimate of the QSA workspace against the launcher's own size (a host
# function, no GPU needed: label cpu).
if(TARGET fngen_cuda)
  fn_add_test(NAME test_memory_plan_cuda SOURCES test_memory_plan_cuda.cpp LIBS fngen_cuda
              LABEL cpu)
endif()
set_tests_properties(test_memory_plan PROPERTIES LABELS "cpu;heavy")  # see tests/model.cmake
# Where the n-gram table lives (--ngram-table): auto's rule, both placements' plans, the
# sequences that fit, the MemAvailable check, inspect's tables.
fn_add_test(NAME test_ngram_placement SOURCES test_ngram_placement.cpp LABEL cpu)
