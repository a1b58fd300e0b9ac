# Sourced by the benches that run the gateway on one long seeded log (bench/history-memory,
# bench/delete-stall): set `port` first. Gives a temporary folder ($work, removed on exit, the
# gateway stopped), start_gateway [FLAGS...] (on $work/log.db, returns once /health answers),
# stop_gateway, and seed_log CHUNKS (a migrated database holding conversation "long").
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }; rm -rf "$work"' EXIT
python3 -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $port)) == 0)" ||
    { echo "something already listens on 127.0.0.1:$port" >&2; exit 1; }

start_gateway() {
    target/release/dispatch-gateway --listen "127.0.0.1:$port" --database "$work/log.db" "$@" >"$work/gateway.log" 2>&1 &
    pid=$!
    python3 - "$port" <<'WAIT'
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit("the gateway did not start")
WAIT
}

stop_gateway() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }

# A migrated database (a gateway's start migrates it), then the log written into it.
seed_log() {
    rm -f "$work"/log.db*
    start_gateway
    stop_gateway
    target/release/dispatch-bench seed --database "$work/log.db" --conversation long --chunks "$1" >/dev/null
}
