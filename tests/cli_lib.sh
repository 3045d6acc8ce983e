# Shared helpers of the CLI test scripts (tests/*_cli.sh, tests/backend_gpu.sh): a temporary
# directory removed on exit, Open MPI allowed as root, failure counting, fngen under mpirun, an
# exit-code + stderr-pattern expectation (also with stdout on /dev/full) and JSON / JSONL checks.
# Source it after setting $fngen and $mpiexec; it defines $py, $tmp and $failures.
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
pass() { echo "ok: $*"; }

mpi_fngen() {  # mpi_fngen NP fngen-args... (300 s limit: a hang is a failure)
  local np=$1
  shift
  timeout 300 "$mpiexec" -np "$np" --oversubscribe --allow-run-as-root --bind-to none "$fngen" "$@"
}

expect() {  # expect CODE PATTERN -- command...
  expect_to "$tmp/out" "$@"
}

expect_full() {  # expect_full CODE PATTERN -- command...: stdout is /dev/full (every write fails)
  expect_to /dev/full "$@"
}

expect_to() {  # expect_to STDOUT-FILE CODE PATTERN -- command...
  local stdout=$1 code=$2 pattern=$3
  shift 4
  "$@" >"$stdout" 2>"$tmp/err"
  local got=$?
  if [ "$got" != "$code" ] || ! grep -q -- "$pattern" "$tmp/err"; then
    fail "'$*' exited $got (want $code, stderr matching '$pattern'), stderr: $(grep -v '^$' "$tmp/err" | head -n 5)"
  else
    pass "exit $got: $(grep -m1 -- "$pattern" "$tmp/err")"
  fi
}

expect_locked_output() {  # expect_locked_output FILE -- command... (writing -o FILE)
  # With FILE's lock held by another process, the command is refused (exit 3) before it
  # touches FILE.
  local file=$1
  shift 2
  printf '{"id": "keep"}\n' >"$file"
  if ! command -v flock >/dev/null 2>&1; then
    fail "no flock command (util-linux) to hold a lock"
    return
  fi
  flock "$file" sleep 20 &
  local locker=$!
  sleep 1
  expect 3 "another process is writing it" -- "$@"
  [ "$(cat "$file")" = '{"id": "keep"}' ] && pass "the locked -o is left as it was" ||
    fail "the locked -o changed: $(head -c 200 "$file")"
  kill "$locker" 2>/dev/null
  wait "$locker" 2>/dev/null
}

no_abort() {  # no_abort WHAT [KIND]: the last expect's stderr has one KIND (default "io error")
  # message and no MPI_Abort banner (an error every rank agreed on, not rank 0 aborting the job)
  if [ "$(grep -c "${2:-io error}" "$tmp/err")" = 1 ] && ! grep -qE "MPI_ABORT|ORTE_ERROR_LOG" "$tmp/err"; then
    pass "$1: one message, no MPI_Abort"
  else
    fail "$1: $(grep -v '^$' "$tmp/err" | head -n 8)"
  fi
}

check_json() {  # check_json FILE PYTHON-EXPRESSION-ON-j DESCRIPTION
  if $py -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; then
    pass "$3"
  else
    fail "$3: $(head -c 600 "$1")"
  fi
}

check_jsonl() {  # check_jsonl FILE PYTHON-EXPRESSION-ON-r (the file's records, a list) DESCRIPTION
  if $py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1], encoding='utf-8')]; \
    sys.exit(0 if ($2) else 1)" "$1"; then
    pass "$3"
  else
    fail "$3: $(head -c 600 "$1" | cat -v)"
  fi
}
