#!/usr/bin/env bash
# What two decision pools cost the routing, live: the emulated demo's stack
# (br-snapshot, br-ingest, G br-shims in front of `br-emu engine`) replays one paper-shaped
# workload with BR-0 three times, side by side in one run:
#   1x          one br-decision replica (one pool)
#   2x-ordered  two active-active replicas, the gateway's default selection (the first
#               healthy replica: every call in one pool)
#   2x-rr       two active-active replicas, --decision-selection round-robin (two pools, each
#               seeing the other's admissions only through σ)
# then prints imbalance, TPOT and throughput next to br-sim's prediction for 1 and 2 deciders
# (--deciders K: round-robin arrivals, own pools, σ lag of one Reserve round trip).
#
# Each seed in BENCH_SEEDS is one round: a workload drawn with that seed, replayed by the three
# set-ups in turn (rotated: round i starts with set-up i mod 3), and br-sim on the same
# workload. The rounds show the spread; within a round the ratios are measured side by side on
# the same, possibly shared, machine.
#
# Knobs (environment): BENCH_TRACE (paper-azure), BENCH_REQUESTS (384), BENCH_G (8), BENCH_B
# (16), BENCH_STEP_A / BENCH_STEP_B (0.0002 / 30: T = a·max L + b model ms), BENCH_TIME_SCALE
# (0.25), BENCH_POLICY (br0), BENCH_SEEDS ("42": space-separated), BENCH_PROFILE (release |
# debug: which build's binaries), BENCH_OUT (target/bench-pools), BENCH_SKIP_BUILD=1. Needs
# curl and jq. Results are recorded in docs/benchmarks.md ("decision failover").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TRACE="${BENCH_TRACE:-paper-azure}"
N="${BENCH_REQUESTS:-384}"
G="${BENCH_G:-8}"
B="${BENCH_B:-16}"
STEP_A="${BENCH_STEP_A:-0.0002}"
STEP_B="${BENCH_STEP_B:-30}"
SCALE="${BENCH_TIME_SCALE:-0.25}"
POLICY="${BENCH_POLICY:-br0}"
SEEDS="${BENCH_SEEDS:-42}"
PROFILE="${BENCH_PROFILE:-release}"
OUT="${BENCH_OUT:-$ROOT/target/bench-pools}"
GROUP="pools"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"

mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    say "building ($PROFILE): br-snapshot br-ingest br-decision br-shim br-emu br-sim"
    flag=()
    [ "$PROFILE" = release ] && flag=(--release)
    cargo build ${flag[@]+"${flag[@]}"} -q --bin br-snapshot --bin br-ingest --bin br-decision \
        --bin br-shim --bin br-emu --bin br-sim
fi
for b in br-snapshot br-ingest br-decision br-shim br-emu br-sim; do
    [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }
done

T0=$(date +%s)
start_stack
free_ports 2 DECISION2

# start_replica PORT NAME: one br-decision for GROUP on PORT (admin PORT+1), waits until ready.
REPLICA_PIDS=()
start_replica() {
    start "$2" "$BIN/br-decision" --listen "127.0.0.1:$1" --admin-listen "127.0.0.1:$(($1 + 1))" \
        --snapshot-addr "http://127.0.0.1:$SNAP" --groups "$GROUP" --policy "$POLICY" --max-wait 600s
    REPLICA_PIDS+=("$LAST_PID")
    wait_http "http://127.0.0.1:$(($1 + 1))/readyz" "br-decision $2"
}
stop_replicas() {
    local pid
    for pid in "${REPLICA_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${REPLICA_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    REPLICA_PIDS=()
}

command -v jq >/dev/null || { echo "jq is needed for the tables" >&2; exit 1; }
SETUPS="1x 2x-ordered 2x-rr"
ORDER=(1x 2x-ordered 2x-rr)

# metric_sum PORT NAME: the sum of every series of counter NAME on decision admin PORT.
metric_sum() {
    curl -fsS "http://127.0.0.1:$1/metrics" 2>/dev/null \
        | awk -v m="$2" '$1 ~ "^"m"([{]|$)" { s += $2 } END { printf "%d", s }'
}

round=0
for seed in $SEEDS; do
    # Each round starts with the next set-up, so none is always first (or last) after a
    # change of workload.
    order=()
    for i in 0 1 2; do order+=("${ORDER[$(((i + round) % 3))]}"); done
    round=$((round + 1))
    for setup in "${order[@]}"; do
        say "seed $seed, $setup: $POLICY, replaying $N requests of $TRACE (saturated)"
        start_shims "$B"
        start_replica "$DECISION" "decision-$seed-$setup-a"
        addrs="http://127.0.0.1:$DECISION"
        ports=("$DECISION")
        selection=ordered
        if [ "$setup" != 1x ]; then
            start_replica "$DECISION2" "decision-$seed-$setup-b"
            addrs="$addrs,http://127.0.0.1:$DECISION2"
            ports+=("$DECISION2")
        fi
        [ "$setup" = 2x-rr ] && selection=round-robin
        "$BIN/br-emu" load --decision-addr "$addrs" --decision-selection "$selection" --group "$GROUP" \
            --rank-urls "$RANK_URLS" --engine-url "http://127.0.0.1:$ENGINE" --seed "$seed" \
            --trace "$TRACE" --limit "$N" --arrival saturated --label "$setup" \
            --json "$OUT/seed$seed-$setup.json"
        # What each replica did: Assigns answered, and reservations σ refused (two pools racing
        # for the same free slot; the refused one rejoins its pool).
        per=()
        for port in "${ports[@]}"; do
            per+=("$(metric_sum $((port + 1)) balanceroute_decision_assign_total)/$(metric_sum $((port + 1)) balanceroute_decision_reserve_failures_total)")
        done
        echo "  replicas (assigns/reserve failures): ${per[*]}"
        echo "${per[*]}" >"$OUT/seed$seed-$setup.replicas"
        stop_replicas
        stop_shims
    done

    say "seed $seed: br-sim's prediction for 1 and 2 deciders"
    for k in 1 2; do
        "$BIN/br-sim" run --trace "$TRACE" --limit "$N" --workers "$G" --slots "$B" --seed "$seed" \
            --policies "$POLICY" --arrival saturated --step-a "$STEP_A" --step-b "$STEP_B" \
            --deciders "$k" --json "$OUT/seed$seed-sim-k$k.json" >"$OUT/seed$seed-sim-k$k.log" 2>&1 || {
            cat "$OUT/seed$seed-sim-k$k.log" >&2
            echo "br-sim --deciders $k failed" >&2
            exit 1
        }
        grep -E "reservations refused" "$OUT/seed$seed-sim-k$k.log" | sed "s/^ */  K=$k: /" || true
    done
    # br-emu report pairs a run with the sim run of the same label: one decider stands for 1x and
    # 2x-ordered (one pool), two for 2x-rr (two pools).
    jq -s --arg p "$POLICY" '{runs: [
            (.[0].runs[] | select(.policy == $p) | .policy = "1x"),
            (.[0].runs[] | select(.policy == $p) | .policy = "2x-ordered"),
            (.[1].runs[] | select(.policy == $p) | .policy = "2x-rr")]}' \
        "$OUT/seed$seed-sim-k1.json" "$OUT/seed$seed-sim-k2.json" >"$OUT/seed$seed-sim.json"
    say "seed $seed: $TRACE, $N requests, G=$G, B=$B, $POLICY; model time (wall / $SCALE)"
    "$BIN/br-emu" report "$OUT/seed$seed-1x.json" "$OUT/seed$seed-2x-ordered.json" \
        "$OUT/seed$seed-2x-rr.json" --sim "$OUT/seed$seed-sim.json" | tee "$OUT/seed$seed-table.txt"
done

# Each set-up against 1x of the same round (ratios), emulated and br-sim.
say "every round, against 1x of the same round (emulated; br-sim in brackets)"
printf '%-6s %-11s %10s %8s %10s %8s %10s %8s %8s %s\n' seed setup imbalance "vs 1x" "TPOT p95" "vs 1x" "tok/s" "vs 1x" failed \
    "sim imbalance vs 1x"
for seed in $SEEDS; do
    for setup in $SETUPS; do
        jq -r -s --arg seed "$seed" --arg setup "$setup" '
            def pct(a; b): if b == 0 or b == null or a == null then "-" else ((a / b - 1) * 100 | round | tostring) + "%" end;
            .[0] as $one | .[1] as $run | .[2] as $sim
            | ($sim.runs[] | select(.policy == "1x") | .avg_imbalance) as $sim1
            | ($sim.runs[] | select(.policy == $setup) | .avg_imbalance) as $simk
            | [$seed, $setup,
               ($run.imbalance_tokens | round), pct($run.imbalance_tokens; $one.imbalance_tokens),
               ($run.tpot_ms.p95 * 10 | round / 10), pct($run.tpot_ms.p95; $one.tpot_ms.p95),
               ($run.throughput_tok_s | round), pct($run.throughput_tok_s; $one.throughput_tok_s),
               $run.failed, "\($simk | round) (\(pct($simk; $sim1)))"]
            | @tsv' "$OUT/seed$seed-1x.json" "$OUT/seed$seed-$setup.json" "$OUT/seed$seed-sim.json" \
            | awk -F'\t' '{ printf "%-6s %-11s %10s %8s %10s %8s %10s %8s %8s %s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10 }'
    done
done
echo
echo "imbalance = mean over engine steps of max_g L_g - min_g L_g (KV tokens, the paper's metric)"
echo "run took $(( $(date +%s) - T0 )) s after the build; JSON and logs in $OUT"
