#!/usr/bin/env bash
# Runs comm_dead_peer under mpirun and checks the "no hang" promise of the custom all-reduce:
# the job must end non-zero within BOUND seconds of wall time (start-up included), and in
# `stuck` mode the surviving rank must say which rank it waited for. The wait bound is the
# default (5 s) unless FN_ALLREDUCE_TIMEOUT_MS is set.
# Usage: comm_dead_peer.sh MPIEXEC BINARY stuck|kill BOUND_S
set -u
mpiexec=$1 binary=$2 mode=$3 bound=$4
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s%N)
out=$(timeout 120 "$mpiexec" -np 2 --oversubscribe --allow-run-as-root --bind-to none \
  "$binary" "$mode" 2>&1)
rc=$?
end=$(date +%s%N)
elapsed_ms=$(( (end - start) / 1000000 ))
elapsed="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
echo "$out"
echo "comm_dead_peer.sh: mode $mode exit $rc after $elapsed s (bound $bound s)"
fail() { echo "comm_dead_peer.sh: FAIL: $*"; exit 1; }
[ "$rc" -ne 124 ] || fail "the job hung (killed by timeout 120)"
[ "$rc" -ne 0 ] || fail "the job exited 0 although a peer stopped"
[ "$elapsed_ms" -lt $((bound * 1000)) ] || fail "took $elapsed s, more than $bound s"
if [ "$mode" = stuck ]; then
  echo "$out" | grep -q "waited more than" || fail "no timeout message naming the peer"
fi
echo "comm_dead_peer.sh: PASS"
