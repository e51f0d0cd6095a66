#!/usr/bin/env bash
# Assign latency, all-in-one vs split, side by side in one run (issue 12): `assign-load` at
# BENCH_RATE Assign/s while it plays 8 workers on the snapshot service's Apply stream with
# BENCH_EVENTS progress events/s (what ingest sends after coalescing), against
#   split  br-snapshot + br-decision (decision -> snapshot Watch/Reserve over loopback gRPC)
#   all    br-all (one process: decision reserves and watches in-process; the load tool's
#          Apply stream and Assign calls go to its one port)
# alternated BENCH_ROUNDS times (split, all, split, all, ...), each set-up started fresh. Prints
# assign-load's report per run with the load average before and after.
#
# Knobs (environment): BENCH_RATE (5000), BENCH_EVENTS (100000), BENCH_DURATION (20s),
# BENCH_ROUNDS (2), BENCH_PROFILE (release), BENCH_OUT (target/bench-all-in-one),
# BENCH_SKIP_BUILD=1. Results are recorded in docs/benchmarks.md ("all-in-one vs split").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RATE="${BENCH_RATE:-5000}"
EVENTS="${BENCH_EVENTS:-100000}"
DURATION="${BENCH_DURATION:-20s}"
ROUNDS="${BENCH_ROUNDS:-2}"
PROFILE="${BENCH_PROFILE:-release}"
OUT="${BENCH_OUT:-$ROOT/target/bench-all-in-one}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"
GROUP=default

mkdir -p "$OUT"
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    flag=()
    [ "$PROFILE" = release ] && flag=(--release)
    cargo build ${flag[@]+"${flag[@]}"} -q -p br-all -p br-snapshot -p br-decision --bins
fi

load() {
    local what=$1 decision=$2 snapshot=$3
    echo "--- $what: $(uptime | sed 's/.*load average/load average/')"
    "$BIN/assign-load" --decision-addr "$decision" --snapshot-addr "$snapshot" --group "$GROUP" \
        --rate "$RATE" --duration "$DURATION" --warmup 2s --workers 8 --capacity 512 \
        --progress-events "$EVENTS" --hold 300ms
    echo "--- $what done: $(uptime | sed 's/.*load average/load average/')"
}

stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}

for round in $(seq 1 "$ROUNDS"); do
    free_ports 2 P
    start "split-snapshot-$round" "$BIN/br-snapshot" --listen "127.0.0.1:$P" --admin-listen "127.0.0.1:$((P + 1))"
    free_ports 2 Q
    start "split-decision-$round" "$BIN/br-decision" --listen "127.0.0.1:$Q" --admin-listen "127.0.0.1:$((Q + 1))" \
        --snapshot-addr "http://127.0.0.1:$P" --policy br0 --groups "$GROUP"
    wait_http "http://127.0.0.1:$((P + 1))/readyz" br-snapshot
    wait_http "http://127.0.0.1:$((Q + 1))/livez" br-decision
    load "split (round $round)" "http://127.0.0.1:$Q" "http://127.0.0.1:$P"
    stop_all

    free_ports 2 A
    start "all-$round" "$BIN/br-all" --listen "127.0.0.1:$A" --admin-listen "127.0.0.1:$((A + 1))" \
        --policy br0 --groups "$GROUP"
    wait_http "http://127.0.0.1:$((A + 1))/livez" br-all
    load "all-in-one (round $round)" "http://127.0.0.1:$A" "http://127.0.0.1:$A"
    stop_all
done
