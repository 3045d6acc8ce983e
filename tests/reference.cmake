# Reference fixtures (tests/data/fixtures, made by scripts/reference/make_fixtures.py on the GPU machine): an
# independent numpy reader decodes each checkpoint's NVFP4 / FP8 / BF16 tensors and checks them bit for bit against
# the values the transformers reference held, plus the index, inventory and logits files.
add_test(NAME reference_fixtures_decode_to_the_values_the_reference_ran_on
         COMMAND /usr/bin/python3 ${CMAKE_SOURCE_DIR}/scripts/reference/check_fixture.py
                 ${FN_TEST_DATA_DIR}/fixtures/g3_tiny ${FN_TEST_DATA_DIR}/fixtures/tp4
                 ${FN_TEST_DATA_DIR}/fixtures/ple2_long)
set_tests_properties(reference_fixtures_decode_to_the_values_the_reference_ran_on PROPERTIES LABELS cpu TIMEOUT 120)
