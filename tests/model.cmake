# Model description layer: config, n-gram constants, expected tensors, TP shard plan.
fn_add_test(NAME test_config SOURCES test_config.cpp LABEL cpu)
fn_add_test(NAME test_ngram SOURCES test_ngram.cpp LABEL cpu)
fn_add_test(NAME test_model_tensors SOURCES test_model_tensors.cpp LABEL cpu)
fn_add_test(NAME test_shard_plan SOURCES test_shard_plan.cpp LABEL cpu)
# Exhaustive arithmetic over the real geometry: minutes under ASan for no memory-safety gain over
# the release run, so the sanitizer stage of scripts/test.sh leaves the "heavy" label out.
set_tests_properties(test_shard_plan PROPERTIES LABELS "cpu;heavy")
