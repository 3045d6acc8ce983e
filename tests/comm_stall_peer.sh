#!/usr/bin/env bash
# Runs comm_stall_peer under mpirun -np 4 and checks the stall watchdog of the MPI collectives:
# with one rank stopped (`stop`: SIGSTOP) or hung (`sleep`), the job must end with exit 5 within
# BOUND seconds of wall time (start-up included; the stall timeout is TIMEOUT seconds), and a
# surviving rank must name rank 3 as the one that went silent.
# Usage: comm_stall_peer.sh MPIEXEC BINARY stop|sleep TIMEOUT_S BOUND_S
set -u
mpiexec=$1 binary=$2 mode=$3 timeout_s=$4 bound=$5
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s%N)
out=$(timeout -s KILL 120 "$mpiexec" -np 4 --oversubscribe --allow-run-as-root --bind-to none \
  "$binary" "$mode" "$timeout_s" 2>&1)
rc=$?
end=$(date +%s%N)
elapsed_ms=$(((end - start) / 1000000))
elapsed="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
echo "$out"
echo "comm_stall_peer.sh: mode $mode exit $rc after $elapsed s (stall timeout $timeout_s s, bound $bound s)"
fail() {
  echo "comm_stall_peer.sh: FAIL: $*"
  exit 1
}
[ "$rc" -ne 137 ] || fail "the job hung (killed after 120 s)"
[ "$rc" -eq 5 ] || fail "exit $rc, not 5 (communication error)"
[ "$elapsed_ms" -lt $((bound * 1000)) ] || fail "took $elapsed s, more than $bound s"
echo "$out" | grep -qE "mpi error: rank 3 went silent: rank [012] waited more than $timeout_s s" ||
  fail "no message naming rank 3 as the silent one"
echo "comm_stall_peer.sh: PASS"
