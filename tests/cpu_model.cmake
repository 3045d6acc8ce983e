# CPU reference backend: the FP32 ops of docs/model.md §C (unit, hand-computed values).
fn_add_test(NAME test_cpu_ops SOURCES test_cpu_ops.cpp LABEL cpu)
# CpuModel at TP=1 against the transformers FP32 reference fixtures.
fn_add_test(NAME test_cpu_model SOURCES test_cpu_model.cpp LABEL cpu)
# CpuBackend: CpuModel behind the Backend interface (facts, prefill = forward one by one, reset).
fn_add_test(NAME test_cpu_backend SOURCES test_cpu_backend.cpp LABEL cpu)
# CpuModel at TP=1, 2, 4 (MPI_Comm_split groups inside one 4-rank run) vs the fixtures and TP=1.
fn_add_test(NAME test_cpu_model_tp SOURCES test_cpu_model_tp.cpp LIBS fngen_comm LABEL mpi)
# CpuModel loading: bare layout, missing tensor, n-gram constant drift.
fn_add_test(NAME test_cpu_model_load SOURCES test_cpu_model_load.cpp LABEL cpu)
# CpuModel: fused BF16 experts + BF16 n-gram table == NVFP4 + FP8 with the same values (TP 1, 2).
fn_add_test(NAME test_cpu_model_bf16 SOURCES test_cpu_model_bf16.cpp LIBS fngen_comm LABEL mpi)
