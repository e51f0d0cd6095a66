#!/usr/bin/env bash
# Issue 12, part 2 (docs/benchmarks.md, "issue 12, part 2"): the runs behind its tables.
#
#   cargo build --release -p br-decision --bins -p br-snapshot --bin br-snapshot -p br-ingest --bin br-ingest
#   scripts/bench-issue12.sh ab DECISION_A DECISION_B [ROUNDS]   Assign added latency, 5k/s + 100k events/s,
#                                                              two br-decision binaries alternated, with
#                                                              the CPU seconds each server spent
#   (br-all and both sides of the split deployment before/after: scripts/bench-all-in-one.sh
#    with BENCH_A/BENCH_B)
#   scripts/bench-issue12.sh telemetry [ARGS]                  shim report → decision's σ replica
#                                                              (ARGS go to telemetry-latency, e.g.
#                                                              --probe-via-reporter --flush-interval 2ms)
#   scripts/bench-issue12.sh groups                            64 groups × 8 ranks, 10k Assign/s, RSS
#
# Output on stdout; the servers' logs in target/bench-issue12/. Ports 51061-51063, 9161-9163
# (below the ephemeral range). Each run kills only the processes it started.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
LOGS="$ROOT/target/bench-issue12"
mkdir -p "$LOGS"
SNAP=(--listen 127.0.0.1:51061 --admin-listen 127.0.0.1:9161)
DEC=(--listen 127.0.0.1:51063 --admin-listen 127.0.0.1:9163 --snapshot-addr http://127.0.0.1:51061 --policy br0)
load() { cut -d' ' -f1-3 /proc/loadavg; }
rss() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
# CPU of a process: utime + stime in clock ticks, and the seconds between two readings.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
secs() { awk -v a="$1" -v b="$2" -v t="$(getconf CLK_TCK)" 'BEGIN{printf "%.2f", (b - a) / t}'; }
up() { # up ADMIN_PORT: wait (at most 10 s) until the admin port answers
    for _ in $(seq 1 100); do curl -fsS -o /dev/null "http://127.0.0.1:$1/livez" 2>/dev/null && return 0; sleep 0.1; done
    echo "admin port $1 never answered" >&2; return 1
}

case "${1:-}" in
ab)
    A="$2" B="$3" ROUNDS="${4:-2}"
    for round in $(seq 1 "$ROUNDS"); do
        for v in A B; do
            bin="$A"; [ "$v" = B ] && bin="$B"
            "$BIN/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
            "$bin" "${DEC[@]}" >"$LOGS/decision.log" 2>&1 & dp=$!
            up 9161 && up 9163
            echo "== round $round, br-decision $v ($bin), load average $(load)"
            s0=$(ticks "$sp") d0=$(ticks "$dp")
            "$BIN/assign-load" --decision-addr http://127.0.0.1:51063 --snapshot-addr http://127.0.0.1:51061 \
                --rate 5000 --duration 12s --warmup 2s --workers 8 --capacity 512 \
                --progress-events 100000 --hold 300ms
            echo "   load average after: $(load); CPU during the load: br-snapshot $(secs "$s0" "$(ticks "$sp")") s, br-decision $(secs "$d0" "$(ticks "$dp")") s"
            kill "$dp" "$sp"; wait "$dp" "$sp" 2>/dev/null
        done
    done
    ;;
telemetry)
    "$BIN/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
    "$BIN/br-ingest" --listen 127.0.0.1:51062 --admin-listen 127.0.0.1:9162 \
        --snapshot-addr http://127.0.0.1:51061 >"$LOGS/ingest.log" 2>&1 & ip=$!
    "$BIN/br-decision" "${DEC[@]}" >"$LOGS/decision.log" 2>&1 & dp=$!
    up 9161 && up 9162 && up 9163
    echo "== telemetry-latency, load average $(load)"
    "$BIN/telemetry-latency" --ingest-addr http://127.0.0.1:51062 --snapshot-addr http://127.0.0.1:51061 \
        --decision-admin 127.0.0.1:9163 --streams 64 --updates-per-message 64 --requests 64 \
        --messages-per-sec-per-stream 25 --probes-per-sec 50 --duration 15s --warmup 2s "${@:2}"
    echo "   load average after: $(load)"
    kill "$dp" "$ip" "$sp"; wait "$dp" "$ip" "$sp" 2>/dev/null
    ;;
groups)
    list=$(seq -s, -f 'g-%g' 0 63)
    "$BIN/br-snapshot" "${SNAP[@]}" >"$LOGS/snapshot.log" 2>&1 & sp=$!
    up 9161
    echo "br-snapshot RSS at start: $(rss $sp) kB"
    "$BIN/br-decision" "${DEC[@]}" --groups "$list" >"$LOGS/decision.log" 2>&1 & dp=$!
    up 9163
    echo "br-decision RSS with 64 groups, no σ yet: $(rss $dp) kB; br-snapshot $(rss $sp) kB"
    for hold in 300ms 3s; do
        echo "== 64 groups, 10000 Assign/s, hold $hold, load average $(load)"
        "$BIN/assign-load" --decision-addr http://127.0.0.1:51063 --snapshot-addr http://127.0.0.1:51061 \
            --group g --groups 64 --rate 10000 --duration 12s --warmup 3s --workers 8 --capacity 512 \
            --progress-events 100000 --hold "$hold" & lp=$!
        for i in $(seq 1 14); do
            sleep 1
            reqs=$(curl -s 127.0.0.1:9161/metrics | awk '/^balanceroute_snapshot_requests/{s+=$2} END{print s}')
            echo "t=$i br-snapshot RSS $(rss $sp) kB, br-decision RSS $(rss $dp) kB, requests in σ $reqs"
        done
        wait "$lp"
        echo "   load average after: $(load); CPU ticks so far: br-snapshot $(awk '{print $14+$15}' /proc/$sp/stat), br-decision $(awk '{print $14+$15}' /proc/$dp/stat)"
        curl -s 127.0.0.1:9161/metrics | awk '/^balanceroute_snapshot_batches_applied_total/{s+=$2} END{print "batches applied, all groups:", s}'
        echo "br-decision /metrics lines: $(curl -s 127.0.0.1:9163/metrics | wc -l)"
    done
    kill "$dp" "$sp"; wait "$dp" "$sp" 2>/dev/null
    ;;
*)
    sed -n '2,16p' "$0"; exit 2
    ;;
esac
