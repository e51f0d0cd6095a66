#!/usr/bin/env bash
# Cost per decision against the floor, in one run: `assign-load` offers the same load to
#   floor  floor-server: the same gRPC server (tonic, tokio, limits, TLS) as the services, whose
#          Assign answers at once and whose Apply stream decodes and drops (tools/bench)
#   all    br-all (one process: decision reserves and watches in-process)
#   split  br-snapshot + br-decision (decision -> snapshot Watch/Reserve over loopback gRPC)
# each set-up started fresh, alternated round by round (floor, all, split, then split, all,
# floor, ...) so a drift of the machine's load favours none. The load tool plays BENCH_WORKERS
# (8) workers of B = 512 per group on the snapshot service's Apply stream and finishes each
# request 300 ms after its answer, as ingest would after coalescing.
#
# Two phases per set-up and round: `calls`, Assign at BENCH_RATE with the least telemetry (one
# event per millisecond), and `load`, the same plus BENCH_EVENTS progress events/s. CPU per
# progress event is the difference of the two phases' CPU per call over the difference of their
# events per call; CPU per Assign is the `calls` phase's.
#
# Knobs (environment; `make bench-cost RATE=... EVENTS=... GROUPS=...` sets the first three):
#   BENCH_RATE (5000) Assign/s, BENCH_EVENTS (100000) progress events/s, BENCH_GROUPS (1)
#   groups the calls are spread over, BENCH_DURATION (10s) per phase after a 2 s warm-up,
#   BENCH_ROUNDS (2), BENCH_SETUPS ("floor all split"), BENCH_PHASES ("calls load"),
#   BENCH_PROFILE (release), BENCH_OUT (target/bench-cost), BENCH_SKIP_BUILD=1,
#   BENCH_NICE=N (servers and load tool under `nice -n N`); for many groups, BENCH_CONNECTIONS
#   (1) HTTP/2 connections the load tool spreads its calls over and BENCH_BATCH_INTERVAL (1ms)
#   how often it sends each group's telemetry batch (ingest coalesces every 2 ms).
#
# Before/after in one run: BENCH_A=DIR BENCH_B=DIR, each a directory holding br-all,
# br-snapshot and br-decision (a baseline's release binaries copied aside, and the candidate's
# target/release). Every round then runs br-all and the split deployment with A's and with B's
# binaries, A first in odd rounds and B first in even ones; the floor and assign-load are
# always $BIN's.
#
# What it measures, per run (one line each in $BENCH_OUT/summary.tsv): the load average before
# and after; assign-load's answered calls, errors and added latency p50/p99/p99.9 (client
# latency minus the answer's pool_wait_us); the CPU seconds (utime + stime from /proc/PID/stat)
# and context switches (voluntary + involuntary, every thread) of every server process during
# the load, per call sent; their resident memory at its end; the events the load tool sent;
# the load tool's own CPU. Then the
# summary: per set-up the median over rounds, and the ratios to the floor. Its last line reads
#   cost ratio: br-all CPU X.XXx p99 X.XXx, split CPU X.XXx p99 X.XXx
# (the `load` phase's CPU per call and added p99, each over the floor's) for a script to read.
# Nothing here judges a speed: the figures are for docs/benchmarks.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RATE="${BENCH_RATE:-5000}"
EVENTS="${BENCH_EVENTS:-100000}"
NGROUPS="${BENCH_GROUPS:-1}"
WORKERS="${BENCH_WORKERS:-8}"
CONNECTIONS="${BENCH_CONNECTIONS:-1}"
BATCH_INTERVAL="${BENCH_BATCH_INTERVAL:-1ms}"
DURATION="${BENCH_DURATION:-10s}"
ROUNDS="${BENCH_ROUNDS:-2}"
PROFILE="${BENCH_PROFILE:-release}"
OUT="${BENCH_OUT:-$ROOT/target/bench-cost}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"
SETUPS="${BENCH_SETUPS:-floor all split}"
PHASES="${BENCH_PHASES:-calls load}"
NICE=()
[ -n "${BENCH_NICE:-}" ] && NICE=(nice -n "$BENCH_NICE")
for n in "$RATE" "$EVENTS" "$NGROUPS" "$ROUNDS"; do
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "BENCH_RATE, BENCH_EVENTS, BENCH_GROUPS and BENCH_ROUNDS are whole numbers (got '$n')" >&2; exit 2; }
done
[ "$NGROUPS" -ge 1 ] && [ "$RATE" -ge 1 ] || { echo "BENCH_RATE and BENCH_GROUPS must be at least 1" >&2; exit 2; }
for s in $SETUPS; do
    case "$s" in floor | all | split) ;; *) echo "BENCH_SETUPS: unknown set-up '$s' (floor, all, split)" >&2; exit 2 ;; esac
done
for p in $PHASES; do
    case "$p" in calls | load) ;; *) echo "BENCH_PHASES: unknown phase '$p' (calls, load)" >&2; exit 2 ;; esac
done

# The groups: `default`, or default-0 ... default-(N-1) as assign-load names them.
GROUP=default
GROUP_LIST=$GROUP
[ "$NGROUPS" -gt 1 ] && GROUP_LIST=$(seq -s, -f "$GROUP-%g" 0 $((NGROUPS - 1)))

mkdir -p "$OUT"
OUT_LOGS="$OUT"
SUMMARY="$OUT/summary.tsv"
printf 'setup\tside\tphase\tround\tload_before\tload_after\tp50_us\tp99_us\tp999_us\tanswered\tskipped\terrors\tcalls_sent\tevents_sent\tcpu_s\tcpu_us_per_call\tcsw_per_call\tgenerator_cpu_s\trss_mib\n' >"$SUMMARY"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    flag=()
    [ "$PROFILE" = release ] && flag=(--release)
    cargo build ${flag[@]+"${flag[@]}"} -q --locked -p br-all -p br-snapshot -p br-decision -p br-bench --bins
fi

TCK=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Context switches (voluntary + involuntary) of every thread of process $1.
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {n += $2} END {print n + 0}'; }
load1() { cut -d' ' -f1 /proc/loadavg; }
# Resident memory of process $1 in KiB.
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

CPU_MODEL=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT (with uncommitted changes)"
echo "bench-cost: $(date -u +%Y-%m-%dT%H:%MZ), commit $COMMIT, $CPU_MODEL ($(nproc) CPUs), $(uptime | sed 's/.*load average/load average/')"
echo "offered: $RATE Assign/s over $NGROUPS group(s) of $WORKERS workers on $CONNECTIONS connection(s), $EVENTS progress events/s (load phase) in $BATCH_INTERVAL batches, $DURATION per phase, $ROUNDS round(s), $PROFILE build"

# run SETUP SIDE PHASE ROUND DECISION_URL SNAPSHOT_URL NAME=PID...: one assign-load run
# against running servers, with the CPU and context switches each named server spent during it.
run() {
    local setup=$1 side=$2 phase=$3 round=$4 decision=$5 snapshot=$6
    shift 6
    local procs=("$@") before=() csw_before=() p i events=$EVENTS
    [ "$phase" = calls ] && events=0
    for p in "${procs[@]}"; do
        before+=("$(ticks "${p#*=}")")
        csw_before+=("$(switches "${p#*=}")")
    done
    local lb la report
    lb=$(load1)
    echo "--- $setup $side $phase (round $round): $(uptime | sed 's/.*load average/load average/')"
    report=$("${NICE[@]}" "$BIN/assign-load" --decision-addr "$decision" --snapshot-addr "$snapshot" \
        --group "$GROUP" --groups "$NGROUPS" --rate "$RATE" --duration "$DURATION" --warmup 2s \
        --workers "$WORKERS" --capacity 512 --progress-events "$events" --hold 300ms \
        --connections "$CONNECTIONS" --batch-interval "$BATCH_INTERVAL")
    echo "$report"
    la=$(load1)
    local cpu="" ticks_total=0 csw_total=0 rss_total=0
    for i in "${!procs[@]}"; do
        p=${procs[$i]}
        local secs now_ticks now_csw
        now_ticks=$(ticks "${p#*=}")
        now_csw=$(switches "${p#*=}")
        secs=$(awk -v a="${before[$i]}" -v b="$now_ticks" -v t="$TCK" 'BEGIN{printf "%.2f", (b - a) / t}')
        cpu="$cpu${cpu:+ }${p%%=*} ${secs}s"
        ticks_total=$((ticks_total + now_ticks - before[i]))
        rss_total=$((rss_total + $(rss_kib "${p#*=}")))
        csw_total=$((csw_total + now_csw - csw_before[i]))
    done
    echo "--- $setup $side $phase done: $(uptime | sed 's/.*load average/load average/'); CPU during the load: $cpu; context switches: $csw_total"
    local line p50 p99 p999 n skipped errors sent ev gen
    line=$(echo "$report" | grep '^added latency') || line=""
    p50=$(echo "$line" | sed -n 's/.* p50 \([0-9]*\) µs.*/\1/p')
    p99=$(echo "$line" | sed -n 's/.* p99 \([0-9]*\) µs.*/\1/p')
    p999=$(echo "$line" | sed -n 's/.* p99.9 \([0-9]*\) µs.*/\1/p')
    n=$(echo "$line" | sed -n 's/.*(n = \([0-9]*\)).*/\1/p')
    errors=$(echo "$report" | sed -n 's/^sent .*, errors {\(.*\)}$/\1/p' | tr -d ' ')
    skipped=$(echo "$report" | sed -n 's/^sent .*, skipped \([0-9]*\) (in-flight limit).*/\1/p')
    # The CPU and switches are read around the whole load, warm-up included, so they are
    # divided by every call sent (assign-load's n counts only the answers after the warm-up).
    sent=$(echo "$report" | sed -n 's/^sent \([0-9]*\) calls in.*/\1/p')
    ev=$(echo "$report" | sed -n 's/^telemetry sent: \([0-9]*\) progress.*/\1/p')
    gen=$(echo "$report" | sed -n 's/^generator CPU while sending: \([0-9.]*\) s.*/\1/p')
    local per_cpu per_csw
    per_cpu=$(awk -v t="$ticks_total" -v hz="$TCK" -v n="${sent:-0}" 'BEGIN{if (n > 0) printf "%.1f", t / hz * 1e6 / n}')
    per_csw=$(awk -v c="$csw_total" -v n="${sent:-0}" 'BEGIN{if (n > 0) printf "%.2f", c / n}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$setup" "$side" "$phase" \
        "$round" "$lb" "$la" "${p50:--}" "${p99:--}" "${p999:--}" "${n:-0}" "${skipped:-0}" "${errors:--}" "${sent:-0}" \
        "${ev:-0}" "$(awk -v t="$ticks_total" -v hz="$TCK" 'BEGIN{printf "%.2f", t / hz}')" \
        "${per_cpu:--}" "${per_csw:--}" "${gen:--}" "$((rss_total / 1024))" >>"$SUMMARY"
}

stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}

# floor / all / split SIDE DIR PHASE ROUND: one fresh set-up from DIR's binaries, one load.
floor() {
    local side=$1 phase=$3 round=$4 F
    free_ports 2 F
    start "floor-$phase-$round" "${NICE[@]}" "$BIN/floor-server" --listen "127.0.0.1:$F" \
        --admin-listen "127.0.0.1:$((F + 1))" --workers "$WORKERS"
    wait_http "http://127.0.0.1:$((F + 1))/livez" floor-server
    run floor "$side" "$phase" "$round" "http://127.0.0.1:$F" "http://127.0.0.1:$F" "floor-server=$LAST_PID"
    stop_all
}

all() {
    local side=$1 dir=$2 phase=$3 round=$4 A
    free_ports 2 A
    start "all-$side-$phase-$round" "${NICE[@]}" "$dir/br-all" --listen "127.0.0.1:$A" \
        --admin-listen "127.0.0.1:$((A + 1))" --policy br0 --groups "$GROUP_LIST"
    wait_http "http://127.0.0.1:$((A + 1))/livez" br-all
    run br-all "$side" "$phase" "$round" "http://127.0.0.1:$A" "http://127.0.0.1:$A" "br-all=$LAST_PID"
    stop_all
}

split() {
    local side=$1 dir=$2 phase=$3 round=$4 P Q sp
    free_ports 2 P
    start "split-snapshot-$side-$phase-$round" "${NICE[@]}" "$dir/br-snapshot" --listen "127.0.0.1:$P" \
        --admin-listen "127.0.0.1:$((P + 1))"
    sp=$LAST_PID
    free_ports 2 Q
    start "split-decision-$side-$phase-$round" "${NICE[@]}" "$dir/br-decision" --listen "127.0.0.1:$Q" \
        --admin-listen "127.0.0.1:$((Q + 1))" --snapshot-addr "http://127.0.0.1:$P" --policy br0 \
        --groups "$GROUP_LIST"
    wait_http "http://127.0.0.1:$((P + 1))/readyz" br-snapshot
    wait_http "http://127.0.0.1:$((Q + 1))/livez" br-decision
    run split "$side" "$phase" "$round" "http://127.0.0.1:$Q" "http://127.0.0.1:$P" \
        "br-snapshot=$sp" "br-decision=$LAST_PID"
    stop_all
}

for round in $(seq 1 "$ROUNDS"); do
    # Odd rounds in the given order, even ones reversed.
    order=$SETUPS
    [ $((round % 2)) = 0 ] && order=$(echo "$SETUPS" | tr ' ' '\n' | tac | tr '\n' ' ')
    sides=(A B)
    [ $((round % 2)) = 0 ] && sides=(B A)
    for setup in $order; do
        for phase in $PHASES; do
            if [ -z "${BENCH_A:-}" ] || [ "$setup" = floor ]; then
                "$setup" - "$BIN" "$phase" "$round"
                continue
            fi
            for side in "${sides[@]}"; do
                dir="$BENCH_A"
                [ "$side" = B ] && dir="$BENCH_B"
                "$setup" "$side" "$dir" "$phase" "$round"
            done
        done
    done
done
echo
column -t -s $'\t' "$SUMMARY"
echo
python3 "$ROOT/scripts/lib/bench_cost_summary.py" "$SUMMARY"
