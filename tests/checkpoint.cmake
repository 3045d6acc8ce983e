# Checkpoint I/O: codecs, safetensors reader/writer, sharded checkpoints, mutation test.
fn_add_test(NAME test_codecs SOURCES test_codecs.cpp LABEL cpu)
fn_add_test(NAME test_safetensors SOURCES test_safetensors.cpp LABEL cpu)
fn_add_test(NAME test_checkpoint SOURCES test_checkpoint.cpp LABEL cpu)
fn_add_test(NAME test_safetensors_fuzz SOURCES test_safetensors_fuzz.cpp LABEL cpu TIMEOUT 300)
