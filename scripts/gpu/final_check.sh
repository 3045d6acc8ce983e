#!/usr/bin/env bash
# A short GPU-machine check of the CUDA backend after loader/generate changes (2 GPUs): builds
# fngen + test_cuda_model, runs the fixture test at TP=1/TP=2, and `fngen generate --backend
# cuda` with sampling on the GPU vs --host-sampling (greedy ids must be equal). Logs to $OUT.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/final-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
b=${FN_BUILD_DIR:-build-gpu}
t=$SECONDS
FN_BUILD_DIR=$b timeout 200 bash scripts/gpu/build.sh fngen test_cuda_model >"$out/build.log" 2>&1 ||
  { grep error "$out/build.log" | head; exit 1; }
echo "== build ok ($((SECONDS - t)) s)"
mpi="mpirun --allow-run-as-root --oversubscribe --bind-to none"
timeout 90 $mpi -np 2 "$b/tests/test_cuda_model" >"$out/test.log" 2>&1
echo "== test_cuda_model rc=$?"
grep -E "test cases|ERROR|values:" "$out/test.log" | sort -u | head -8
for mode in device host; do
  flag=""
  [ $mode = host ] && flag=--host-sampling
  timeout 60 $mpi -np 2 "$b/fngen" generate --backend cuda -m tests/data/fixtures/tp4 \
    --prompt-ids 1,2,3,4,5,6,7,8 -n 40 --temp 0 --ignore-eos $flag --json \
    >"$out/gen_$mode.json" 2>"$out/gen_$mode.err"
  echo "== generate ($mode sampling) rc=$?"
  grep -E "sampling on|loading weights|loaded" "$out/gen_$mode.err" | head -3 | cut -c1-200
  /usr/bin/python3 -c "import json;d=json.load(open('$out/gen_$mode.json'));r=d.get('results',[d])[0] if isinstance(d,dict) else d;print(r.get('token_ids') or d.get('token_ids'), 'tpot', (r.get('tpot_ms') or d.get('tpot_ms')))" 2>&1 | cut -c1-400
done
