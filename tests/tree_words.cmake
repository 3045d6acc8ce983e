# Every tracked file speaks of the product only (tests/tree_words.sh lists the words it refuses).
add_test(NAME tree_words COMMAND bash ${CMAKE_SOURCE_DIR}/tests/tree_words.sh ${CMAKE_SOURCE_DIR})
set_tests_properties(tree_words PROPERTIES LABELS cpu TIMEOUT 60 SKIP_RETURN_CODE 77)
