# Batch generation (apps/batch_records, apps/batch_generate): the record pieces in-process, and
# `mpirun -np N fngen generate -i` end to end (per-record sampling, data-parallel groups,
# --resume, ids echoed as written).
fn_add_test(NAME test_batch_records SOURCES test_batch_records.cpp
            ${CMAKE_SOURCE_DIR}/apps/batch_records.cpp LIBS fngen_tokenizer LABEL cpu)
add_test(NAME generate_batch COMMAND bash ${CMAKE_SOURCE_DIR}/tests/generate_batch.sh
                                     $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
set_tests_properties(generate_batch PROPERTIES LABELS mpi TIMEOUT 900)
