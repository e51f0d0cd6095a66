#!/usr/bin/env bash
# Assign latency, all-in-one vs split, side by side in one run: `assign-load` at
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
#
# Before/after in one run: BENCH_A=DIR BENCH_B=DIR, each a directory holding br-all,
# br-snapshot and br-decision (e.g. a baseline's release binaries copied aside, and the
# candidate's target/release). Every round then runs split and all-in-one with A's and with B's binaries,
# A first in odd rounds and B first in even ones (so a drift of the machine's load does not
# favour one side); assign-load is always $BIN's. BENCH_NICE=N runs the servers and the load
# tool under `nice -n N` (default: not niced).
#
# Per run it prints assign-load's report, the load average before and after, and the CPU
# seconds (utime + stime, /proc/PID/stat) each server process spent during the load (start-up
# excluded); one line per run goes to $BENCH_OUT/summary.tsv (set-up, side, round, load
# before/after, added p50/p99/p99.9 in µs, answered, CPU seconds per process, and per answered
# call: CPU µs and context switches of all server processes). The per-call figures are the
# load-independent ones: CPU and thread wake-ups per Assign do not depend on who else holds the
# cores, where the latency percentiles do. Context switches are voluntary + involuntary, summed
# over every thread of a process (/proc/PID/task/*/status).
#
# BENCH_SETUPS="split all" (default) or one of them: which set-ups each round runs.
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
SETUPS="${BENCH_SETUPS:-split all}"
NICE=()
[ -n "${BENCH_NICE:-}" ] && NICE=(nice -n "$BENCH_NICE")

mkdir -p "$OUT"
OUT_LOGS="$OUT"
SUMMARY="$OUT/summary.tsv"
printf 'setup\tside\tround\tload_before\tload_after\tp50_us\tp99_us\tp999_us\tanswered\tcpu_s\tcpu_us_per_call\tcsw_per_call\n' >"$SUMMARY"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    flag=()
    [ "$PROFILE" = release ] && flag=(--release)
    cargo build ${flag[@]+"${flag[@]}"} -q -p br-all -p br-snapshot -p br-decision -p br-bench --bins
fi

TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Context switches (voluntary + involuntary) of every thread of process $1.
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {n += $2} END {print n + 0}'; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# run SETUP SIDE ROUND DECISION_URL SNAPSHOT_URL NAME=PID...: one assign-load run against
# running servers, with the CPU each named server spent during it.
run() {
    local setup=$1 side=$2 round=$3 decision=$4 snapshot=$5
    shift 5
    local procs=("$@") before=() csw_before=() p i
    for p in "${procs[@]}"; do
        before+=("$(ticks "${p#*=}")")
        csw_before+=("$(switches "${p#*=}")")
    done
    local lb la report
    lb=$(load1)
    echo "--- $setup $side (round $round): $(uptime | sed 's/.*load average/load average/')"
    report=$("${NICE[@]}" "$BIN/assign-load" --decision-addr "$decision" --snapshot-addr "$snapshot" \
        --group "$GROUP" --rate "$RATE" --duration "$DURATION" --warmup 2s --workers 8 \
        --capacity 512 --progress-events "$EVENTS" --hold 300ms)
    echo "$report"
    la=$(load1)
    local cpu="" ticks_total=0 csw_total=0
    for i in "${!procs[@]}"; do
        p=${procs[$i]}
        local secs now_ticks now_csw
        now_ticks=$(ticks "${p#*=}")
        now_csw=$(switches "${p#*=}")
        secs=$(awk -v a="${before[$i]}" -v b="$now_ticks" -v t="$TCK" 'BEGIN{printf "%.2f", (b - a) / t}')
        cpu="$cpu${cpu:+ }${p%%=*} ${secs}s"
        ticks_total=$((ticks_total + now_ticks - before[i]))
        csw_total=$((csw_total + now_csw - csw_before[i]))
    done
    echo "--- $setup $side done: $(uptime | sed 's/.*load average/load average/'); CPU during the load: $cpu; context switches: $csw_total"
    local line
    line=$(echo "$report" | grep '^added latency') || line=""
    local p50 p99 p999 n
    p50=$(echo "$line" | sed -n 's/.* p50 \([0-9]*\) µs.*/\1/p')
    p99=$(echo "$line" | sed -n 's/.* p99 \([0-9]*\) µs.*/\1/p')
    p999=$(echo "$line" | sed -n 's/.* p99.9 \([0-9]*\) µs.*/\1/p')
    n=$(echo "$line" | sed -n 's/.*(n = \([0-9]*\)).*/\1/p')
    # Per call sent, over the whole run: the CPU and switches are read around the whole load,
    # warm-up included (assign-load's n counts only the answers after the warm-up).
    local total_calls per_cpu per_csw
    total_calls=$(echo "$report" | sed -n 's/^sent \([0-9]*\) calls in.*/\1/p')
    [ -n "$total_calls" ] || total_calls=$n
    per_cpu=$(awk -v t="$ticks_total" -v hz="$TCK" -v n="$total_calls" 'BEGIN{if (n > 0) printf "%.1f", t / hz * 1e6 / n}')
    per_csw=$(awk -v c="$csw_total" -v n="$total_calls" 'BEGIN{if (n > 0) printf "%.2f", c / n}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$setup" "$side" "$round" "$lb" "$la" \
        "$p50" "$p99" "$p999" "$n" "$cpu" "$per_cpu" "$per_csw" >>"$SUMMARY"
}

stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}

# split SIDE DIR ROUND / all SIDE DIR ROUND: one fresh set-up from DIR's binaries, one load.
split() {
    local side=$1 dir=$2 round=$3 P Q sp
    free_ports 2 P
    start "split-snapshot-$side-$round" "${NICE[@]}" "$dir/br-snapshot" --listen "127.0.0.1:$P" --admin-listen "127.0.0.1:$((P + 1))"
    sp=$LAST_PID
    free_ports 2 Q
    start "split-decision-$side-$round" "${NICE[@]}" "$dir/br-decision" --listen "127.0.0.1:$Q" --admin-listen "127.0.0.1:$((Q + 1))" \
        --snapshot-addr "http://127.0.0.1:$P" --policy br0 --groups "$GROUP"
    wait_http "http://127.0.0.1:$((P + 1))/readyz" br-snapshot
    wait_http "http://127.0.0.1:$((Q + 1))/livez" br-decision
    run split "$side" "$round" "http://127.0.0.1:$Q" "http://127.0.0.1:$P" "br-snapshot=$sp" "br-decision=$LAST_PID"
    stop_all
}

all() {
    local side=$1 dir=$2 round=$3 A
    free_ports 2 A
    start "all-$side-$round" "${NICE[@]}" "$dir/br-all" --listen "127.0.0.1:$A" --admin-listen "127.0.0.1:$((A + 1))" \
        --policy br0 --groups "$GROUP"
    wait_http "http://127.0.0.1:$((A + 1))/livez" br-all
    run all-in-one "$side" "$round" "http://127.0.0.1:$A" "http://127.0.0.1:$A" "br-all=$LAST_PID"
    stop_all
}

for round in $(seq 1 "$ROUNDS"); do
    if [ -z "${BENCH_A:-}" ]; then
        for setup in $SETUPS; do
            "$setup" - "$BIN" "$round"
        done
        continue
    fi
    sides=(A B)
    [ $((round % 2)) = 0 ] && sides=(B A)
    for setup in $SETUPS; do
        for side in "${sides[@]}"; do
            dir="$BENCH_A"
            [ "$side" = B ] && dir="$BENCH_B"
            "$setup" "$side" "$dir" "$round"
        done
    done
done
echo
column -t -s $'\t' "$SUMMARY"
