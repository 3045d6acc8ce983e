# Sampler and generation loop (core/sampler, core/generate) and `fngen generate` end to end.
fn_add_test(NAME test_sampler SOURCES test_sampler.cpp LABEL cpu)
fn_add_test(NAME test_generate SOURCES test_generate.cpp LABEL cpu)
