# Backend selection of generate/eval (apps/backend.h): bad --backend/--allreduce values,
# --backend cuda without a usable GPU (forced with CUDA_VISIBLE_DEVICES=-1, so it holds on every
# machine), --backend auto falling back to cpu with the same results.
add_test(NAME backend_cli COMMAND bash ${CMAKE_SOURCE_DIR}/tests/backend_cli.sh
                                  $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR}
                                  ${FN_HAVE_CUDA})
set_tests_properties(backend_cli PROPERTIES LABELS cpu TIMEOUT 600)
# The same flags on the GPU machine (2 GPUs): --backend cuda at -np 1 and 2 reproduces the tp4
# reference's greedy ids up to the first low-margin step, graph == eager, auto picks cuda.
if(FN_HAVE_CUDA)
  add_test(NAME backend_gpu COMMAND bash ${CMAKE_SOURCE_DIR}/tests/backend_gpu.sh
                                    $<TARGET_FILE:fngen> ${MPIEXEC_EXECUTABLE} ${CMAKE_SOURCE_DIR})
  set_tests_properties(backend_gpu PROPERTIES LABELS gpu TIMEOUT 900)
endif()
