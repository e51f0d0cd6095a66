#!/usr/bin/env bash
# Idle connections against a descriptor limit (docs/benchmarks.md, "bounds"): starts
# br-snapshot, then br-ingest under `ulimit -n NOFILE` (default 128), opens IDLE (default 300)
# TCP connections to ingest's gRPC port that never send a byte, and prints ingest's CPU use
# over 10 s, whether /livez answers, whether a new HTTP/2 client gets the server's SETTINGS,
# and ingest's balanceroute_ingest_accept_failures_total.
#
#   cargo build -p br-ingest -p br-snapshot --bins      (or --release, with PROFILE=release)
#   scripts/bench-accept.sh [INGEST FLAGS...]
#
# BIN_DIR runs other binaries (the ones before a change). Needs python3 (the idle clients).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/${PROFILE:-debug}}"
NOFILE="${NOFILE:-128}"
IDLE="${IDLE:-300}"
for b in br-snapshot br-ingest; do
  [ -x "$BIN/$b" ] || { echo "no $BIN/$b: build it first (see the top of this script)" >&2; exit 1; }
done
TMP="$(mktemp -d)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
ready() { # FILE KEY: waits for a ready file, prints the address under KEY
  for _ in $(seq 300); do [ -s "$1" ] && break; sleep 0.1; done
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"
}
"$BIN/br-snapshot" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --ready-file "$TMP/snap.json" \
  >"$TMP/snapshot.log" 2>&1 &
pids+=($!)
snap="$(ready "$TMP/snap.json" grpc)"
( ulimit -n "$NOFILE" && exec "$BIN/br-ingest" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --ready-file "$TMP/ing.json" --snapshot-addr "http://$snap" "$@" ) >"$TMP/ingest.log" 2>&1 &
ingest_pid=$!
pids+=("$ingest_pid")
grpc="$(ready "$TMP/ing.json" grpc)"
admin="$(ready "$TMP/ing.json" admin)"
echo "br-ingest ($BIN) under ulimit -n $NOFILE, $IDLE idle connections"
python3 -u - "$grpc" "$admin" "$ingest_pid" "$IDLE" <<'PY'
import socket, sys, time, urllib.request
grpc, admin, pid, idle = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
host, port = grpc.rsplit(':', 1)
conns, timed_out = [], 0
for _ in range(idle):
    try:
        conns.append(socket.create_connection((host, int(port)), timeout=1))
    except OSError:
        timed_out += 1  # the listen backlog is full: the kernel, not the service, refuses
print(f"idle connections open: {len(conns)} (connect timed out: {timed_out})")
def cpu_seconds():
    fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0
time.sleep(1)
c0, t0 = cpu_seconds(), time.time()
time.sleep(10)
print(f"ingest CPU over 10 s: {100 * (cpu_seconds() - c0) / (time.time() - t0):.1f}% of a core")
try:
    print('admin /livez:', urllib.request.urlopen(f'http://{admin}/livez', timeout=5).status)
except Exception as e:
    print('admin /livez: failed:', e)
try:
    # it queues behind the idle connections still in the backlog: up to a few rounds of
    # --first-byte-timeout with the defaults
    t = time.time()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.settimeout(60)
    s.sendall(b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    ok = len(s.recv(9)) > 0
    print(f'new HTTP/2 client answered: {ok} after {time.time() - t:.1f} s')
except Exception as e:
    print('new HTTP/2 client: no answer:', e)
try:
    text = urllib.request.urlopen(f'http://{admin}/metrics', timeout=5).read().decode()
    lines = [l for l in text.splitlines() if 'accept_failures' in l and not l.startswith('#')]
    print('\n'.join(lines) if lines else 'accept_failures_total: not exported')
except Exception as e:
    print('metrics: failed:', e)
PY
echo "ingest log lines: $(wc -l <"$TMP/ingest.log") ($(grep -c 'accept failed' "$TMP/ingest.log" || true) 'accept failed')"
