# fngen synth and fngen inspect (core/synth, core/inspect) and the CLI's error exits.
fn_add_test(NAME test_synth_inspect SOURCES test_synth_inspect.cpp LABEL cpu)
add_test(NAME cli_errors COMMAND bash ${CMAKE_SOURCE_DIR}/tests/cli_errors.sh $<TARGET_FILE:fngen>
         ${CMAKE_SOURCE_DIR})
set_tests_properties(cli_errors PROPERTIES LABELS cpu TIMEOUT 900)
