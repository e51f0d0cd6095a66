#!/usr/bin/env bash
# TLS vs plaintext, side by side in one run (docs/benchmarks.md, "mutual TLS"): Assign added
# latency (assign-load at the decision section's loads) and ingest's maximum progress events/s
# (ingest-load 16 × 64), each plaintext and TLS alternated ROUNDS times.
#
#   cargo build --release -p br-snapshot -p br-decision -p br-ingest -p br-certs -p br-bench --bins
#   scripts/bench-tls.sh [ROUNDS]        (logs in target/bench-tls/)
#
# The servers run at `nice -n -10` when allowed (as in the decision section), the load tools at
# normal priority.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ROUNDS="${1:-2}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
OUT_LOGS="$ROOT/target/bench-tls"
mkdir -p "$OUT_LOGS"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"
NICE=(nice -n -10)
"${NICE[@]}" true 2>/dev/null || NICE=()

CERTS="$OUT_LOGS/certs"
"$BIN/br-certs" "$CERTS" bench 16 >/dev/null
tls_flags() { # tls_flags ROLE
    echo --tls-cert "$CERTS/$1.pem" --tls-key "$CERTS/$1-key.pem" --tls-ca "$CERTS/ca.pem"
}
ready() { # ready SCHEME://HOST:PORT/PATH WHAT
    for _ in $(seq 1 600); do
        if curl -fsS --cacert "$CERTS/ca.pem" -o /dev/null "$1" 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "timed out waiting for $2 ($1)" >&2
    return 1
}

assign_round() { # assign_round MODE (plain | tls)
    local mode=$1 scheme=http snap_tls=() dec_tls=() load_tls=() p
    if [ "$mode" = tls ]; then
        scheme=https
        read -ra snap_tls <<<"$(tls_flags snapshot)"
        read -ra dec_tls <<<"$(tls_flags decision)"
        read -ra load_tls <<<"$(tls_flags gateway) --tls-apply-cert $CERTS/ingest.pem --tls-apply-key $CERTS/ingest-key.pem"
    fi
    free_ports 2 SNAP
    free_ports 2 DEC
    start "snapshot-$mode" "${NICE[@]}" "$BIN/br-snapshot" --listen "127.0.0.1:$SNAP" \
        --admin-listen "127.0.0.1:$((SNAP + 1))" "${snap_tls[@]}"
    local snap_pid=$LAST_PID
    ready "$scheme://127.0.0.1:$((SNAP + 1))/livez" br-snapshot
    start "decision-$mode" "${NICE[@]}" "$BIN/br-decision" --listen "127.0.0.1:$DEC" \
        --admin-listen "127.0.0.1:$((DEC + 1))" --snapshot-addr "http://127.0.0.1:$SNAP" \
        --policy br0 "${dec_tls[@]}"
    local dec_pid=$LAST_PID
    # live, not ready: it is ready once it can place, after assign-load's workers say Hello
    ready "$scheme://127.0.0.1:$((DEC + 1))/livez" br-decision
    for p in "--rate 5000 --duration 20s --warmup 2s --workers 8 --capacity 512 --progress-events 100000 --hold 300ms" \
             "--rate 200 --duration 10s --warmup 1s --progress-events 0"; do
        say "assign-load $mode: $p (load average $(cut -d' ' -f1-3 /proc/loadavg))"
        # shellcheck disable=SC2086
        "$BIN/assign-load" --decision-addr "http://127.0.0.1:$DEC" \
            --snapshot-addr "http://127.0.0.1:$SNAP" $p "${load_tls[@]}"
    done
    kill -TERM "$dec_pid" "$snap_pid"
    wait "$dec_pid" "$snap_pid" 2>/dev/null || true
}

ingest_round() { # ingest_round MODE
    local mode=$1 tls=()
    [ "$mode" = tls ] && tls=(--tls-worker-dir "$CERTS")
    say "ingest-load $mode: 16 x 64 (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    "$BIN/ingest-load" --streams 16 --updates-per-message 64 --duration 8s --warmup 2s "${tls[@]}"
}

for r in $(seq 1 "$ROUNDS"); do
    say "round $r"
    ingest_round plain
    ingest_round tls
    assign_round plain
    assign_round tls
done
