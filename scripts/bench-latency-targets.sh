#!/usr/bin/env bash
# Latency and scale against the targets (docs/benchmarks.md): Assign added latency, telemetry
# delivery, and 64 groups × 8 ranks, split and all-in-one; the runs behind those tables.
#
#   cargo build --release -p br-bench --bins -p br-decision --bin br-decision -p br-snapshot --bin br-snapshot -p br-ingest --bin br-ingest
#   scripts/bench-latency-targets.sh ab DECISION_A DECISION_B [ROUNDS]   Assign added latency, 5k/s + 100k events/s,
#                                                              two br-decision binaries alternated, with
#                                                              the CPU seconds each server spent
#   (br-all and both sides of the split deployment before/after: scripts/bench-cost.sh
#    with BENCH_A/BENCH_B)
#   scripts/bench-latency-targets.sh telemetry [ARGS]                  shim report → decision's σ replica
#                                                              (ARGS go to telemetry-latency, e.g.
#                                                              --probe-via-reporter --flush-interval 2ms)
#   scripts/bench-latency-targets.sh telemetry-all [ARGS]              the same through one br-all
#   scripts/bench-latency-targets.sh telemetry-floor [ARGS]            the same load against floor-server
#                                                              (tools/bench), each probe timed to its
#                                                              ack: the transport alone, the floor the
#                                                              two above are read against
#                                                              (the three telemetry runs print each
#                                                              server's CPU seconds; BENCH_ALL_ARGS and
#                                                              BENCH_INGEST_ARGS add flags to br-all and
#                                                              br-ingest, e.g. "--batch-spacing 1ms")
#   scripts/bench-latency-targets.sh groups                            64 groups × 8 ranks, 10k Assign/s, RSS
#   scripts/bench-latency-targets.sh split-ab DIR_A DIR_B [ROUNDS]     the split deployment over 64 groups,
#                                                              br-snapshot + br-decision from DIR_A and
#                                                              DIR_B alternated (A first in odd rounds),
#                                                              with per-Assign costs: CPU, context
#                                                              switches, socket syscalls, Watch deltas
#                                                              (σ versions) and the delta messages
#                                                              that carried them (queued deltas merged)
#                                                              (SPLIT_RATE, default 2000/s; SPLIT_EVENTS,
#                                                              default 20000/s; SPLIT_DURATION 10s)
#
# Output on stdout; the servers' logs in target/bench-latency-targets/. The servers listen on free
# loopback ports picked at the start (scripts/lib/stack.sh). Each run kills only the processes it
# started.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${BENCH_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
LOGS="$ROOT/target/bench-latency-targets"
mkdir -p "$LOGS"
OUT_LOGS="$LOGS"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"
# gRPC and admin ports of br-all, br-snapshot, br-ingest, br-decision and floor-server, in
# that order; free now, and each run stops its servers before the next starts.
free_ports 5 GRPC || exit 1
free_ports 5 ADMIN || exit 1
G_ALL=$GRPC G_SNAP=$((GRPC + 1)) G_INGEST=$((GRPC + 2)) G_DEC=$((GRPC + 3)) G_FLOOR=$((GRPC + 4))
A_ALL=$ADMIN A_SNAP=$((ADMIN + 1)) A_INGEST=$((ADMIN + 2)) A_DEC=$((ADMIN + 3)) A_FLOOR=$((ADMIN + 4))
SNAP=(--listen 127.0.0.1:$G_SNAP --admin-listen 127.0.0.1:$A_SNAP)
DEC=(--listen 127.0.0.1:$G_DEC --admin-listen 127.0.0.1:$A_DEC --snapshot-addr http://127.0.0.1:$G_SNAP --policy br0)
load() { cut -d' ' -f1-3 /proc/loadavg; }
rss() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
# CPU of a process: utime + stime in clock ticks, and the seconds between two readings.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
secs() { awk -v a="$1" -v b="$2" -v t="$(getconf CLK_TCK)" 'BEGIN{printf "%.2f", (b - a) / t}'; }
up() { # up ADMIN_PORT: wait (at most 10 s) until the admin port answers
    for _ in $(seq 1 100); do curl -fsS -o /dev/null "http://127.0.0.1:$1/livez" 2>/dev/null && return 0; sleep 0.1; done
    echo "admin port $1 never answered" >&2; return 1
}
# telemetry_latency INGEST_PORT SNAPSHOT_PORT DECISION_ADMIN_PORT [ARGS]: the tool at 100k
# progress events/s (64 streams × 64 updates × 25/s) with 50 probes/s, split or all-in-one alike.
telemetry_latency() {
    "$BIN/telemetry-latency" --ingest-addr "http://127.0.0.1:$1" --snapshot-addr "http://127.0.0.1:$2" \
        --decision-admin "127.0.0.1:$3" --streams 64 --updates-per-message 64 --requests 64 \
        --messages-per-sec-per-stream 25 --probes-per-sec 50 --duration 15s --warmup 2s "${@:4}"
}

case "${1:-}" in
ab)
    A="$2" B="$3" ROUNDS="${4:-2}"
    for round in $(seq 1 "$ROUNDS"); do
        for v in A B; do
            bin="$A"; [ "$v" = B ] && bin="$B"
            "$BIN/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
            "$bin" "${DEC[@]}" >"$LOGS/decision.log" 2>&1 & dp=$!
            up "$A_SNAP" && up "$A_DEC"
            echo "== round $round, br-decision $v ($bin), load average $(load)"
            s0=$(ticks "$sp") d0=$(ticks "$dp")
            "$BIN/assign-load" --decision-addr http://127.0.0.1:$G_DEC --snapshot-addr http://127.0.0.1:$G_SNAP \
                --rate 5000 --duration 12s --warmup 2s --workers 8 --capacity 512 \
                --progress-events 100000 --hold 300ms
            echo "   load average after: $(load); CPU during the load: br-snapshot $(secs "$s0" "$(ticks "$sp")") s, br-decision $(secs "$d0" "$(ticks "$dp")") s"
            kill "$dp" "$sp"; wait "$dp" "$sp" 2>/dev/null
        done
    done
    ;;
split-ab)
    A="$2" B="$3" ROUNDS="${4:-2}"
    RATE="${SPLIT_RATE:-2000}" EVENTS="${SPLIT_EVENTS:-20000}" DUR="${SPLIT_DURATION:-10s}"
    # Per process over the load (start-up excluded), every thread: CPU (task-clock), context
    # switches and syscalls (the socket reads and writes that carry the gRPC frames), by
    # `perf stat -p` (root, or kernel.perf_event_paranoid <= -1 for the syscall tracepoint).
    deltas() { curl -s 127.0.0.1:$A_SNAP/metrics | awk '/^balanceroute_snapshot_version/{s+=$2} END{printf "%d", s}'; }
    # Delta messages sent to watchers (queued deltas are merged; "-" on a br-snapshot
    # without the counter, where each version is one message per watcher).
    messages() { curl -s 127.0.0.1:$A_SNAP/metrics | awk '/^balanceroute_snapshot_watch_delta_messages_total/{s+=$2; n=1} END{if (n) printf "%d", s; else printf "-"}'; }
    counted() { # counted NAME FILE: task-clock ms, context switches, syscalls from a perf stat file
        awk -v n="$1" -F, '$3=="task-clock"{c=$1} $3=="context-switches"{x=$1} $3=="raw_syscalls:sys_enter"{y=$1}
            END{printf "%s CPU %.0f ms, %d context switches, %d syscalls", n, c, x, y}' "$2"
    }
    for round in $(seq 1 "$ROUNDS"); do
        order="A B"; [ $((round % 2)) = 0 ] && order="B A"
        for v in $order; do
            dir="$A"; [ "$v" = B ] && dir="$B"
            "$dir/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
            "$dir/br-decision" "${DEC[@]}" --groups "$(seq -s, -f 'g-%g' 0 63)" >"$LOGS/decision.log" 2>&1 & dp=$!
            up "$A_SNAP" && up "$A_DEC"
            echo "== round $round, $v ($dir): 64 groups, $RATE Assign/s, $EVENTS events/s, load average $(load)"
            v0=$(deltas) m0=$(messages)
            perf stat -x, -e task-clock,context-switches,raw_syscalls:sys_enter -p "$sp" -o "$LOGS/perf-snapshot.csv" & ps_=$!
            perf stat -x, -e task-clock,context-switches,raw_syscalls:sys_enter -p "$dp" -o "$LOGS/perf-decision.csv" & pd_=$!
            "$BIN/assign-load" --decision-addr http://127.0.0.1:$G_DEC --snapshot-addr http://127.0.0.1:$G_SNAP \
                --group g --workers 8 --capacity 512 --connections 4 --batch-interval 2ms --groups 64 \
                --rate "$RATE" --duration "$DUR" --warmup 2s --progress-events "$EVENTS" --hold 300ms \
                >"$LOGS/split-ab.log" 2>&1
            grep -E "^sent|^telemetry sent|^added latency" "$LOGS/split-ab.log"
            v1=$(deltas) m1=$(messages)
            kill -INT "$ps_" "$pd_"; wait "$ps_" "$pd_" 2>/dev/null
            echo "   load average after: $(load); over the run: $(counted br-snapshot "$LOGS/perf-snapshot.csv");" \
                "$(counted br-decision "$LOGS/perf-decision.csv"); σ versions (Watch deltas) $((v1 - v0));" \
                "Watch delta messages $([ "$m0" = - ] && echo - || echo $((m1 - m0)))"
            kill "$dp" "$sp"; wait "$dp" "$sp" 2>/dev/null
        done
    done
    ;;
telemetry)
    "$BIN/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
    # shellcheck disable=SC2086 # BENCH_INGEST_ARGS: extra br-ingest flags, split on spaces
    "$BIN/br-ingest" --listen 127.0.0.1:$G_INGEST --admin-listen 127.0.0.1:$A_INGEST \
        --snapshot-addr http://127.0.0.1:$G_SNAP ${BENCH_INGEST_ARGS:-} >"$LOGS/ingest.log" 2>&1 & ip=$!
    "$BIN/br-decision" "${DEC[@]}" >"$LOGS/decision.log" 2>&1 & dp=$!
    up "$A_SNAP" && up "$A_INGEST" && up "$A_DEC"
    echo "== telemetry-latency ${BENCH_INGEST_ARGS:-}, load average $(load)"
    s0=$(ticks "$sp") i0=$(ticks "$ip") d0=$(ticks "$dp")
    telemetry_latency "$G_INGEST" "$G_SNAP" "$A_DEC" "${@:2}"
    echo "   load average after: $(load); CPU during the run (warm-up included): br-ingest $(secs "$i0" "$(ticks "$ip")") s, br-snapshot $(secs "$s0" "$(ticks "$sp")") s, br-decision $(secs "$d0" "$(ticks "$dp")") s"
    kill "$dp" "$ip" "$sp"; wait "$dp" "$ip" "$sp" 2>/dev/null
    ;;
telemetry-all)
    # The same path through br-all: ingest, snapshot and decision in one process (Apply, Watch
    # in-process), so the probe's report and the tool's Watch go to its one gRPC port, and the
    # decision replica's σ version is read on its one admin port.
    # shellcheck disable=SC2086 # BENCH_ALL_ARGS: extra br-all flags, split on spaces
    "$BIN/br-all" --listen 127.0.0.1:$G_ALL --admin-listen 127.0.0.1:$A_ALL --policy br0 \
        ${BENCH_ALL_ARGS:-} >"$LOGS/all.log" 2>&1 & ap=$!
    up "$A_ALL"
    echo "== telemetry-latency through br-all ${BENCH_ALL_ARGS:-}, load average $(load)"
    a0=$(ticks "$ap")
    telemetry_latency "$G_ALL" "$G_ALL" "$A_ALL" "${@:2}"
    echo "   load average after: $(load); CPU during the run (warm-up included): br-all $(secs "$a0" "$(ticks "$ap")") s"
    kill "$ap"; wait "$ap" 2>/dev/null
    ;;
telemetry-floor)
    "$BIN/floor-server" --listen 127.0.0.1:$G_FLOOR --admin-listen 127.0.0.1:$A_FLOOR \
        >"$LOGS/floor.log" 2>&1 & fp=$!
    up "$A_FLOOR"
    echo "== telemetry-latency against the floor, load average $(load)"
    f0=$(ticks "$fp")
    telemetry_latency "$G_FLOOR" "$G_FLOOR" "$A_FLOOR" --floor "${@:2}"
    echo "   load average after: $(load); CPU during the run (warm-up included): floor-server $(secs "$f0" "$(ticks "$fp")") s"
    kill "$fp"; wait "$fp" 2>/dev/null
    ;;
groups)
    # 64 groups × 8 ranks (the scale target), release binaries, in four parts:
    #  1. idle RSS per group: fresh br-snapshot + br-decision for 1, 16 and 64 groups whose 8
    #     workers said Hello (one Assign each), no requests held;
    #  2. σ per 1,000 requests: 64 groups, requests held (never finished) while RSS and σ's
    #     request count are sampled; --history 64 and --answered-ttl 1s so the delta history and
    #     decision's idempotency memory do not hide σ's own cost;
    #  3. Apply throughput: every group active, as many progress events as the writer takes;
    #  4. Assign added latency at GROUPS_RATE (default 10k/s) spread over 64 groups, split
    #     (br-snapshot + br-decision) and on one br-all, with GROUPS_EVENTS progress events/s.
    # GROUPS_PARTS (default "1 2 3 4") picks parts; GROUPS_CONNECTIONS (default 4) and
    # GROUPS_BATCH (default 2ms, ingest's own interval) go to assign-load. Part 4 needs
    # br-all built too (cargo build --release -p br-all --bin br-all).
    RATE="${GROUPS_RATE:-10000}" EVENTS="${GROUPS_EVENTS:-100000}"
    CONNS="${GROUPS_CONNECTIONS:-4}" BATCH="${GROUPS_BATCH:-2ms}"
    PARTS="${GROUPS_PARTS:-1 2 3 4}"
    list() { seq -s, -f 'g-%g' 0 $(($1 - 1)); }
    cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat"; }
    split_up() { # split_up N [extra snapshot flags] [-- extra decision flags]: start both
        local n=$1; shift
        local sflags=() dflags=() into=s
        for a in "$@"; do
            if [ "$a" = -- ]; then into=d; continue; fi
            if [ $into = s ]; then sflags+=("$a"); else dflags+=("$a"); fi
        done
        "$BIN/br-snapshot" "${SNAP[@]}" "${sflags[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
        "$BIN/br-decision" "${DEC[@]}" --groups "$(list "$n")" "${dflags[@]}" >"$LOGS/decision.log" 2>&1 & dp=$!
        up "$A_SNAP" && up "$A_DEC"
    }
    down() { kill "$@"; wait "$@" 2>/dev/null; }
    LOADARGS=(--group g --workers 8 --capacity 512 --connections "$CONNS" --batch-interval "$BATCH")
    for part in $PARTS; do case $part in
    1)
        for n in 1 16 64; do
            split_up "$n"
            s0=$(rss $sp) d0=$(rss $dp)
            "$BIN/assign-load" --decision-addr http://127.0.0.1:$G_DEC --snapshot-addr http://127.0.0.1:$G_SNAP \
                "${LOADARGS[@]}" --groups "$n" --rate "$n" --duration 1s --warmup 0s \
                --progress-events 0 --hold 100ms >"$LOGS/idle-$n.log" 2>&1
            echo "== idle, $n group(s) × 8 workers: br-snapshot RSS $s0 kB at start, $(rss $sp) kB with the workers; br-decision $d0 kB, $(rss $dp) kB"
            down "$dp" "$sp"
        done
        ;;
    2)
        split_up 64 --history 64 -- --answered-ttl 1s
        echo "== σ per 1,000 requests: 64 groups, 2,000 Assign/s held 60 s (none finish), load average $(load)"
        "$BIN/assign-load" --decision-addr http://127.0.0.1:$G_DEC --snapshot-addr http://127.0.0.1:$G_SNAP \
            "${LOADARGS[@]}" --groups 64 --rate 2000 --duration 16s --warmup 1s \
            --progress-events 0 --hold 60s >"$LOGS/sigma.log" 2>&1 & lp=$!
        for i in $(seq 1 17); do
            sleep 1
            reqs=$(curl -s 127.0.0.1:$A_SNAP/metrics | awk '/^balanceroute_snapshot_requests/{s+=$2} END{print s+0}')
            echo "t=$i requests in σ $reqs, br-snapshot RSS $(rss $sp) kB, br-decision RSS $(rss $dp) kB"
        done
        wait "$lp"; tail -n 12 "$LOGS/sigma.log"
        down "$dp" "$sp"
        ;;
    3)
        split_up 64
        ev="${GROUPS_APPLY_EVENTS:-1000000}"
        echo "== Apply throughput: 64 groups, 2,000 Assign/s, $ev progress events/s offered, load average $(load)"
        b0=0
        "$BIN/assign-load" --decision-addr http://127.0.0.1:$G_DEC --snapshot-addr http://127.0.0.1:$G_SNAP \
            "${LOADARGS[@]}" --groups 64 --rate 2000 --duration 15s --warmup 2s \
            --progress-events "$ev" --hold 3s >"$LOGS/apply.log" 2>&1 & lp=$!
        c0=$(cpu $sp)
        for i in $(seq 1 17); do
            sleep 1
            b=$(curl -s 127.0.0.1:$A_SNAP/metrics | awk '/^balanceroute_snapshot_batches_applied_total/{s+=$2} END{print s+0}')
            echo "t=$i batches applied $b (+$((b - b0))/s), br-snapshot CPU $(cpu $sp) s"; b0=$b
        done
        wait "$lp"; grep -E "^telemetry|^generator|^sent" "$LOGS/apply.log"
        echo "   br-snapshot CPU over the run: $(awk -v a="$c0" -v b="$(cpu $sp)" 'BEGIN{print b-a}') s; load average after: $(load)"
        down "$dp" "$sp"
        ;;
    4)
        for setup in split all; do
            if [ $setup = split ]; then
                split_up 64
                D=http://127.0.0.1:$G_DEC S=http://127.0.0.1:$G_SNAP pids="$dp $sp"
            else
                "$BIN/br-all" --listen 127.0.0.1:$G_ALL --admin-listen 127.0.0.1:$A_ALL --policy br0 \
                    --groups "$(list 64)" >"$LOGS/all.log" 2>&1 & ap=$!
                up "$A_ALL"
                D=http://127.0.0.1:$G_ALL S=http://127.0.0.1:$G_ALL pids="$ap"
            fi
            echo "== $setup: 64 groups, $RATE Assign/s, $EVENTS progress events/s, hold 300ms, load average $(load)"
            "$BIN/assign-load" --decision-addr $D --snapshot-addr $S "${LOADARGS[@]}" --groups 64 \
                --rate "$RATE" --duration 15s --warmup 3s --progress-events "$EVENTS" --hold 300ms
            echo "   load average after: $(load); RSS: $(for p in $pids; do echo -n "$(rss "$p") kB "; done); CPU s: $(for p in $pids; do echo -n "$(cpu "$p") "; done)"
            # shellcheck disable=SC2086
            down $pids
        done
        ;;
    esac; done
    ;;
*)
    sed -n '2,16p' "$0"; exit 2
    ;;
esac
