#!/usr/bin/env bash
# `make serve`: a local, offline Prefect server with lowtide's deployments and a worker, plus the
# emulator so the sample job runs with no keys. Open the printed URL; Ctrl-C stops everything.
#
#   PREFECT_PORT (4200)    where the server and its UI listen, on 127.0.0.1
#   EMULATOR_PORT (8765)   where `lowtide emulator` listens
#   EMULATOR_TIME_SCALE    simulated seconds per real second for its batches (60)
#   NO_EMULATOR=1          leave the emulator out (real backends; set their keys first)
#   WORK_POOL (lowtide)    the process work pool named in deployments/prefect.yaml
#   WORKER_NAME            the worker's name in the UI (lowtide-<hostname>)
#   SERVE_LOGS             where the server, emulator and deploy logs go (.lowtide/serve/)
#   SERVE_LOG_LEVEL        Prefect's log level for the worker and the flow runs (INFO)
#
# The worker prints here. LOWTIDE_STATE / LOWTIDE_DB / LOWTIDE_WORK_DIR and provider keys set
# before `make serve` reach every flow run (the worker passes its environment on).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
BIN="${VENV_BIN:-$ROOT/.venv/bin}"
export PATH="$BIN:$PATH"

PREFECT_PORT="${PREFECT_PORT:-4200}"
EMULATOR_PORT="${EMULATOR_PORT:-8765}"
EMULATOR_TIME_SCALE="${EMULATOR_TIME_SCALE:-60}"
WORK_POOL="${WORK_POOL:-lowtide}"
LOGS="${SERVE_LOGS:-$ROOT/.lowtide/serve}"
WORKER_NAME="${WORKER_NAME:-lowtide-$(uname -n)}"

# Offline and inside the project: Prefect's SQLite, results and profiles under .lowtide/.
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.lowtide/prefect}"
export DO_NOT_TRACK=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export PREFECT_UI_URL="http://127.0.0.1:$PREFECT_PORT"
# INFO, not the Makefile's quiet WARNING: the worker's terminal log and each run's Logs tab in
# the UI are what an operator reads.
export PREFECT_LOGGING_LEVEL="${SERVE_LOG_LEVEL:-INFO}"
mkdir -p "$PREFECT_HOME" "$LOGS"

say() { printf '\033[1m%s\033[0m\n' "$*"; }
die() { printf 'serve: %s\n' "$*" >&2; exit 1; }

port_busy() {
  python - "$1" <<'PY'
import socket, sys
s = socket.socket()
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
}

# Wait until URL answers 200 with a body containing WANT, or PID dies, or TIMEOUT seconds pass.
wait_for() {
  local url="$1" want="$2" pid="$3" timeout="$4" log="$5"
  python - "$url" "$want" "$pid" "$timeout" <<'PY' || { tail -n 30 "$log" >&2; die "gave up waiting for $url (log: $log)"; }
import os, sys, time, urllib.request
url, want, pid, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"process {pid} exited")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200 and want in r.read().decode():
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.3)
sys.exit(1)
PY
}

SERVER_PID="" WORKER_PID="" EMULATOR_PID=""

# Stop what this script started, newest first. The worker needs two signals: the first asks it
# to stop taking work (it keeps running), the second ends it.
stopping=""
cleanup() {
  [ -n "$stopping" ] && return
  stopping=1
  trap '' INT TERM
  echo
  say "stopping…"
  if [ -n "$WORKER_PID" ] && kill -0 "$WORKER_PID" 2>/dev/null; then
    kill -TERM "$WORKER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$WORKER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -TERM "$WORKER_PID" 2>/dev/null || true
  fi
  for pid in "$WORKER_PID" "$EMULATOR_PID" "$SERVER_PID"; do
    [ -n "$pid" ] || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  say "stopped."
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_busy "$PREFECT_PORT" && die "127.0.0.1:$PREFECT_PORT is in use (another Prefect server?); stop it or set PREFECT_PORT"

say "Prefect server on 127.0.0.1:$PREFECT_PORT (PREFECT_HOME=$PREFECT_HOME)"
prefect server start --host 127.0.0.1 --port "$PREFECT_PORT" >"$LOGS/server.log" 2>&1 &
SERVER_PID=$!
wait_for "$PREFECT_API_URL/health" true "$SERVER_PID" 120 "$LOGS/server.log"

if [ -z "${NO_EMULATOR:-}" ]; then
  port_busy "$EMULATOR_PORT" && die "127.0.0.1:$EMULATOR_PORT is in use; set EMULATOR_PORT"
  say "emulator on 127.0.0.1:$EMULATOR_PORT (time x$EMULATOR_TIME_SCALE)"
  lowtide emulator --port "$EMULATOR_PORT" --time-scale "$EMULATOR_TIME_SCALE" >"$LOGS/emulator.log" 2>&1 &
  EMULATOR_PID=$!
  wait_for "http://127.0.0.1:$EMULATOR_PORT/_emulator/clock" "" "$EMULATOR_PID" 60 "$LOGS/emulator.log"
  # The worker hands its environment to every flow run it starts.
  export LOWTIDE_EMULATOR_URL="http://127.0.0.1:$EMULATOR_PORT"
fi

say "work pool '$WORK_POOL' and deployments (deployments/prefect.yaml)"
prefect work-pool inspect "$WORK_POOL" >/dev/null 2>&1 ||
  prefect work-pool create "$WORK_POOL" --type process >/dev/null
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml >"$LOGS/deploy.log" 2>&1 ||
  { cat "$LOGS/deploy.log" >&2; die "prefect deploy failed"; }
prefect deployment ls

say "worker on pool '$WORK_POOL'"
prefect worker start --pool "$WORK_POOL" --type process --name "$WORKER_NAME" &
WORKER_PID=$!

cat <<EOF

  Prefect UI:  $PREFECT_UI_URL
  Deployments: $PREFECT_UI_URL/deployments
  Run the nightly job now:
    PREFECT_API_URL=$PREFECT_API_URL $BIN/prefect deployment run 'enrich/nightly-support-intents'
  Logs: $LOGS/   Stop: Ctrl-C

EOF
wait "$WORKER_PID"
