#!/usr/bin/env bash
# `mpirun -np 4 fngen generate` on the tp4 reference fixture (greedy, --ignore-eos, 32 steps)
# must print exactly the reference's 32 decode ids. Labelled cpu as well as mpi so that
# scripts/test.sh's ASan+UBSan pass (ctest -L cpu) runs the whole multi-rank main job clean.
# Usage: generate_tiny.sh FNGEN MPIEXEC SOURCE_DIR
set -u
fngen=$1 mpiexec=$2 src=$3
fx=$src/tests/data/fixtures/tp4
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export LSAN_OPTIONS=${LSAN_OPTIONS:-} ASAN_OPTIONS=${ASAN_OPTIONS:-} UBSAN_OPTIONS=${UBSAN_OPTIONS:-}
# Open MPI unloads its plugins at exit, which leaves their allocations in "<unknown module>" where
# no suppression can name them; keeping them loaded lets tests/lsan.supp match (ASan builds only).
export OMPI_MCA_mca_base_component_disable_dlclose=1
ids=$(/usr/bin/python3 -c "import json;print(','.join(map(str,json.load(open('$fx/expected.json'))['prompt_ids'])))")
out=$(timeout 600 "$mpiexec" -np 4 --oversubscribe --allow-run-as-root --bind-to none \
  -x LSAN_OPTIONS -x ASAN_OPTIONS -x UBSAN_OPTIONS \
  -x OMPI_MCA_mca_base_component_disable_dlclose "$fngen" generate -m "$fx" \
  --prompt-ids "$ids" --temp 0 --ignore-eos -n 32 --json)
rc=$?
echo "$out"
[ "$rc" = 0 ] || { echo "generate_tiny: FAIL: exit $rc"; exit 1; }
echo "$out" | /usr/bin/python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
want = json.load(open('$fx/expected.json'))['generated_ids'][:32]
sys.exit(0 if j['token_ids'] == want and j['tp_size'] == 4 else 1)" ||
  { echo "generate_tiny: FAIL: ids differ from the reference"; exit 1; }
echo "generate_tiny: PASS"
