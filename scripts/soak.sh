#!/usr/bin/env bash
# The soak (`make soak`): the whole control plane for SOAK_MINUTES under steady load, with real
# processes: br-snapshot, br-ingest, br-decision (BR-0), G br-shims in front of `br-emu engine`
# with G ranks, and `br-emu load` sending Poisson arrivals of a paper-shaped workload through
# decision (Assign) and the shims.
#
# Sized to the machine: unless SOAK_RATE is given, a probe first sends SOAK_PROBE_RATE requests
# per second for SOAK_PROBE_SECONDS through the same processes and measures the CPU time all of
# them (load generator included) spend per request; the soak then runs at the rate that keeps
# SOAK_CPU_SHARE of the machine's cores busy. G defaults to 16 shims per core, at most 64.
#
# Every SOAK_INTERVAL seconds scripts/lib/soak_sample.py samples each service's RSS, file
# descriptors and CPU, the requests answered, decision's Assign p50/p99 over the window and the
# requests σ holds. The verdict (scripts/lib/soak_verdict.py) fits each series against the
# requests answered after the warm-up and fails any that rises beyond its noise: RSS per
# service and for the shims together, descriptors, σ's size, Assign p99 (the emulated engine is
# shown but not judged: it records every step for its report). Exit 0 only if all are flat and
# no request failed.
#
# Knobs (environment): SOAK_MINUTES (30), SOAK_G (16 per core, at most 64), SOAK_B (64 slots
# per rank), SOAK_RATE (requests per wall second; default: measured), SOAK_CPU_SHARE (0.5),
# SOAK_PROBE_RATE (20), SOAK_PROBE_SECONDS (20), SOAK_WARMUP (60 s), SOAK_INTERVAL (10 s),
# SOAK_TRACE (paper-azure), SOAK_TIME_SCALE (0.05: wall = model × this), SOAK_PROFILE
# (release | debug), SOAK_SKIP_BUILD=1, SOAK_OUT (target/soak). `make soak-smoke` is the
# two-minute form CI runs. Results are recorded in docs/benchmarks.md ("soak").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CORES=$(nproc)
MINUTES="${SOAK_MINUTES:-30}"
G="${SOAK_G:-$((CORES * 16 < 64 ? CORES * 16 : 64))}"
B="${SOAK_B:-64}"
RATE="${SOAK_RATE:-}"
CPU_SHARE="${SOAK_CPU_SHARE:-0.5}"
PROBE_RATE="${SOAK_PROBE_RATE:-20}"
PROBE_SECONDS="${SOAK_PROBE_SECONDS:-20}"
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

cpu_ticks() { # cpu_ticks PID...: user + system clock ticks of the processes so far
    local t=0 p v
    for p in "$@"; do
        v=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$p/stat" 2>/dev/null || echo 0)
        t=$((t + v))
    done
    echo "$t"
}

run_load() { # run_load LABEL RATE REQUESTS: br-emu load in the background (LOAD_PID)
    local model_rate
    model_rate=$(awk -v r="$2" -v s="$SCALE" 'BEGIN { printf "%.6f", r * s }')
    start "$1" "$BIN/br-emu" load --decision-addr "http://127.0.0.1:$DECISION" --group "$GROUP" \
        --rank-urls "$RANK_URLS" --engine-url "http://127.0.0.1:$ENGINE" --trace "$TRACE" \
        --limit "$3" --arrival poisson --rate "$model_rate" --label "$1" --json "$OUT/$1.json"
    LOAD_PID=$LAST_PID
}

children_ticks() { # clock ticks of this shell's reaped children so far (bash's `times`, which
    # must run in this shell: in a command substitution it would count the subshell's children)
    times >"$OUT/times"
    awk -v hz="$(getconf CLK_TCK)" 'NR == 2 {
        t = 0
        for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] }
        printf "%d\n", t * hz }' "$OUT/times"
}

json_count() { grep -o "\"$2\": *[0-9]*" "$1" | head -1 | grep -o '[0-9]*$' || echo "?"; }

if [ -z "$RATE" ]; then
    n=$((PROBE_RATE * PROBE_SECONDS))
    say "probe: $n requests at $PROBE_RATE/s to measure the CPU time per request of every process"
    before=$(cpu_ticks "${PIDS[@]}")
    children_ticks >"$OUT/reaped-before"
    run_load probe "$PROBE_RATE" "$n"
    wait "$LOAD_PID" || { echo "br-emu load (probe) failed (see $OUT/probe.log)" >&2; exit 1; }
    # the stack's processes from /proc; the load generator's, reaped by now, from the shell's
    # account of its children
    after=$(cpu_ticks "${PIDS[@]}")
    children_ticks >"$OUT/reaped-after"
    load_ticks=$(($(cat "$OUT/reaped-after") - $(cat "$OUT/reaped-before")))
    done_n=$(json_count "$OUT/probe.json" completed)
    [ "$done_n" -gt 0 ] 2>/dev/null || { echo "the probe completed no request (see $OUT/probe.log)" >&2; exit 1; }
    read -r per_req RATE < <(awk -v t="$((after - before + load_ticks))" -v hz="$(getconf CLK_TCK)" \
        -v n="$done_n" -v c="$CORES" -v share="$CPU_SHARE" \
        'BEGIN { per = t / hz / n; r = int(share * c / per); if (r < 1) r = 1; printf "%.2f %d\n", per * 1000, r }')
    say "probe: $done_n requests, $per_req CPU ms per request over every process; soak at $RATE/s ($CPU_SHARE of $CORES cores)"
fi

# Requests for the whole run: RATE per wall second; arrivals are in model time (wall / SCALE).
N=$(awk -v r="$RATE" -v m="$MINUTES" 'BEGIN { printf "%d", r * m * 60 }')
say "soak: $N requests of $TRACE at $RATE/s (Poisson) for $MINUTES min over G=$G ranks (B=$B); sampling every ${INTERVAL}s"
run_load soak "$RATE" "$N"
shims=$(IFS=,; echo "${SHIM_PIDS[*]}")
verdict=0
python3 "$ROOT/scripts/lib/soak_sample.py" "$OUT/samples.csv" "$INTERVAL" "$WARMUP" "$LOAD_PID" \
    "http://127.0.0.1:$((DECISION + 1))/metrics" "http://127.0.0.1:$((SNAP + 1))/metrics" \
    "snapshot=$SNAP_PID" "ingest=$INGEST_PID" \
    "decision=$DECISION_PID" "shims=$shims" "engine*=$ENGINE_PID" || verdict=$?
wait "$LOAD_PID" || { echo "br-emu load failed (see $OUT/soak.log)" >&2; exit 1; }
tail -n 20 "$OUT/soak.log"
failed=$(json_count "$OUT/soak.json" failed)
say "samples in $OUT/samples.csv; failed requests: $failed"
[ "$failed" = 0 ] || exit 1
exit "$verdict"
