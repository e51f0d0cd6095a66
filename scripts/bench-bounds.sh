#!/usr/bin/env bash
# What a peer can make br-snapshot hold (docs/benchmarks.md, "bounds"): starts one
# br-snapshot per case with the given extra flags, runs snapshot-load against it, and prints the
# server's peak RSS (VmHWM), RSS at the end, CPU seconds used and the `/metrics` size.
#
#   cargo build -p br-snapshot -p br-bench --bins         (or --release, with PROFILE=release)
#   scripts/bench-bounds.sh groups   [SNAPSHOT FLAGS...]   # 100k group names
#   scripts/bench-bounds.sh watchers [SNAPSHOT FLAGS...]   # 2,000 watchers never reading, 40 s
#
# COUNT and DURATION override the load's size, SNAPSHOT another br-snapshot binary (the one
# before a change); logs go to target/bench-bounds/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CASE="${1:?usage: bench-bounds.sh groups|watchers [snapshot flags...]}"
shift
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/${PROFILE:-debug}"
LOGS="${CARGO_TARGET_DIR:-$ROOT/target}/bench-bounds"
mkdir -p "$LOGS"
READY="$LOGS/ready.json"
rm -f "$READY"

"${SNAPSHOT:-$BIN/br-snapshot}" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --ready-file "$READY" "$@" \
    >"$LOGS/snapshot-$CASE.log" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do [ -s "$READY" ] && break; sleep 0.1; done
[ -s "$READY" ] || { echo "br-snapshot wrote no ready file" >&2; exit 1; }
GRPC=$(sed -E 's/.*"grpc": *"([^"]+)".*/\1/' "$READY")
ADMIN=$(sed -E 's/.*"admin": *"([^"]+)".*/\1/' "$READY")

cpu_s() { # utime + stime of PID in seconds
    awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$PID/stat"
}
rss() { awk -v k="$1" '$1 == k":" {printf "%.1f MB", $2 / 1024}' "/proc/$PID/status"; }

echo "case $CASE, flags: ${*:-(defaults)}"
echo "before: RSS $(rss VmRSS), cpu $(cpu_s) s"
case "$CASE" in
groups)
    "$BIN/snapshot-load" --addr "http://$GRPC" groups --count "${COUNT:-100000}"
    ;;
watchers)
    "$BIN/snapshot-load" --addr "http://$GRPC" watchers --count "${COUNT:-2000}" \
        --duration "${DURATION:-40s}"
    ;;
*)
    echo "unknown case $CASE" >&2
    exit 2
    ;;
esac
echo "after load: RSS $(rss VmRSS), peak $(rss VmHWM), cpu $(cpu_s) s"
# Idle CPU: what the service burns with nobody connected (10 s).
c0=$(cpu_s)
sleep 10
c1=$(cpu_s)
echo "idle 10 s later: RSS $(rss VmRSS), cpu $(awk -v a="$c0" -v b="$c1" 'BEGIN {printf "%.0f%%", (b - a) * 10}')"
start=$(date +%s.%N)
bytes=$(curl -fsS "http://$ADMIN/metrics" | wc -c)
end=$(date +%s.%N)
echo "/metrics: $bytes bytes in $(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.2f s", b - a}')"
