#!/usr/bin/env bash
# The soak (`make soak`): the whole control plane for SOAK_MINUTES under steady load,
# with real processes: br-snapshot, br-ingest, br-decision (BR-0), G br-shims in front of
# `br-emu engine` with G ranks, and `br-emu load` sending Poisson arrivals of a paper-shaped
# workload at SOAK_RATE requests per wall second through decision (Assign) and the shims.
# Every SOAK_INTERVAL seconds scripts/lib/soak_sample.py samples each service's RSS and CPU
# and decision's Assign latency over the window (p50/p99 of
# balanceroute_decision_assign_latency_seconds, interpolated inside buckets); at the end it
# says whether RSS stayed flat (within 10%, last third against first third after the warm-up;
# the emulated engine is shown but not judged: it records every step for its report) and p99
# steady (the last third's median within 1.5x of the first third's).
# Exit 0 only if both hold and no request failed.
#
# Knobs (environment): SOAK_MINUTES (10), SOAK_G (64 ranks and shims), SOAK_B (64 slots per
# rank), SOAK_RATE (2000 requests per wall second), SOAK_WARMUP (60 s), SOAK_INTERVAL (10 s),
# SOAK_TRACE (paper-azure), SOAK_TIME_SCALE (0.05: wall = model × this), SOAK_PROFILE
# (release | debug), SOAK_SKIP_BUILD=1, SOAK_OUT (target/soak). Results are recorded in
# docs/benchmarks.md ("soak").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MINUTES="${SOAK_MINUTES:-10}"
G="${SOAK_G:-64}"
B="${SOAK_B:-64}"
RATE="${SOAK_RATE:-2000}"
WARMUP="${SOAK_WARMUP:-60}"
INTERVAL="${SOAK_INTERVAL:-10}"
TRACE="${SOAK_TRACE:-paper-azure}"
SCALE="${SOAK_TIME_SCALE:-0.05}"
STEP_A=0.0002
STEP_B=30
PROFILE="${SOAK_PROFILE:-release}"
OUT="${SOAK_OUT:-${CARGO_TARGET_DIR:-$ROOT/target}/soak}"
GROUP="soak"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"

mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.csv
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${SOAK_SKIP_BUILD:-0}" != 1 ]; then
    say "building ($PROFILE): br-snapshot br-ingest br-decision br-shim br-emu"
    flag=()
    [ "$PROFILE" = release ] && flag=(--release)
    cargo build ${flag[@]+"${flag[@]}"} -q --bin br-snapshot --bin br-ingest --bin br-decision \
        --bin br-shim --bin br-emu
fi
ulimit -n 65536 2>/dev/null || true

start_stack
SNAP_PID=${PIDS[0]}
INGEST_PID=${PIDS[1]}
ENGINE_PID=${PIDS[2]}
start_shims "$B"
start_decision br0

# Requests for the whole run: RATE per wall second; arrivals are in model time (wall / SCALE).
N=$(awk -v r="$RATE" -v m="$MINUTES" 'BEGIN { printf "%d", r * m * 60 }')
MODEL_RATE=$(awk -v r="$RATE" -v s="$SCALE" 'BEGIN { printf "%.6f", r * s }')
say "soak: $N requests of $TRACE at $RATE/s (Poisson) for $MINUTES min over G=$G ranks (B=$B); sampling every ${INTERVAL}s"
start load "$BIN/br-emu" load --decision-addr "http://127.0.0.1:$DECISION" --group "$GROUP" \
    --rank-urls "$RANK_URLS" --engine-url "http://127.0.0.1:$ENGINE" --trace "$TRACE" \
    --limit "$N" --arrival poisson --rate "$MODEL_RATE" --label soak --json "$OUT/load.json"
LOAD_PID=$LAST_PID
shims=$(IFS=,; echo "${SHIM_PIDS[*]}")
verdict=0
python3 "$ROOT/scripts/lib/soak_sample.py" "$OUT/samples.csv" "$INTERVAL" "$WARMUP" "$LOAD_PID" \
    "http://127.0.0.1:$((DECISION + 1))/metrics" "snapshot=$SNAP_PID" "ingest=$INGEST_PID" \
    "decision=$DECISION_PID" "shims=$shims" "engine*=$ENGINE_PID" || verdict=$?
wait "$LOAD_PID" || { echo "br-emu load failed (see $OUT/load.log)" >&2; exit 1; }
tail -n 20 "$OUT/load.log"
failed=$(grep -o '"failed": *[0-9]*' "$OUT/load.json" | head -1 | grep -o '[0-9]*$' || echo "?")
say "samples in $OUT/samples.csv; failed requests: $failed"
[ "$failed" = 0 ] || exit 1
exit "$verdict"
