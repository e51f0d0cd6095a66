#!/usr/bin/env bash
# Several lockstep groups through one control plane, live, against the twin: one
# br-snapshot, one br-ingest and one br-decision serving LIVE_GROUPS groups at once, each group
# its own `br-emu engine` (G ranks, B slots) behind G br-shims, each replayed by its own
# `br-emu load` at the same time, first with JSQ and then with BR-0 (decision and shims
# restarted between). Each live run is compared with br-sim on the arrivals its group's
# decision saw (`--arrivals-csv`, as in scripts/demo.sh), one table per group. Each group's
# workload is drawn with its own seed, so the groups' traffic differs.
#
# Knobs (environment): LIVE_GROUPS (2), LIVE_TRACE (paper-azure), LIVE_REQUESTS (384 per group),
# LIVE_G (8), LIVE_B (16), LIVE_STEP_A / LIVE_STEP_B (0.0002 / 30), LIVE_TIME_SCALE (0.25),
# LIVE_POLICIES ("jsq br0"), LIVE_OUT (target/live-groups), LIVE_SKIP_BUILD=1, TWIN_REPLAYS (8),
# TWIN_JITTER_MS (1) (the twin's replays, as in scripts/demo.sh). Plaintext on
# loopback (br-certs' development CA is per group; the demo covers mutual TLS).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

NGROUPS="${LIVE_GROUPS:-2}"
TRACE="${LIVE_TRACE:-paper-azure}"
N="${LIVE_REQUESTS:-384}"
G="${LIVE_G:-8}"
B="${LIVE_B:-16}"
STEP_A="${LIVE_STEP_A:-0.0002}"
STEP_B="${LIVE_STEP_B:-30}"
SCALE="${LIVE_TIME_SCALE:-0.25}"
POLICIES="${LIVE_POLICIES:-jsq br0}"
OUT="${LIVE_OUT:-$ROOT/target/live-groups}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"

mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.csv
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${LIVE_SKIP_BUILD:-0}" != 1 ]; then
    say "building (release): br-snapshot br-ingest br-decision br-shim br-emu br-sim"
    cargo build --release -q --bin br-snapshot --bin br-ingest --bin br-decision --bin br-shim --bin br-emu --bin br-sim
fi
for b in br-snapshot br-ingest br-decision br-shim br-emu br-sim; do
    [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }
done
T0=$(date +%s)

GROUPS_LIST=()
for ((k = 0; k < NGROUPS; k++)); do GROUPS_LIST+=("live-$k"); done
GROUPS_CSV=$(IFS=,; echo "${GROUPS_LIST[*]}")

free_ports 2 SNAP
free_ports 2 INGEST
free_ports 2 DECISION
say "br-snapshot :$SNAP, br-ingest :$INGEST; $NGROUPS groups (${GROUPS_CSV}) of G=$G, B=$B, each its own br-emu engine"
start snapshot "$BIN/br-snapshot" --listen "127.0.0.1:$SNAP" --admin-listen "127.0.0.1:$((SNAP + 1))" \
    --reservation-ttl 60s
start ingest "$BIN/br-ingest" --listen "127.0.0.1:$INGEST" --admin-listen "127.0.0.1:$((INGEST + 1))" \
    --snapshot-addr "http://127.0.0.1:$SNAP"
declare -A ENGINE_OF SHIMS_OF
for grp in "${GROUPS_LIST[@]}"; do
    free_ports $((G + 1)) port
    ENGINE_OF[$grp]=$port
    free_ports $((2 * G)) port
    SHIMS_OF[$grp]=$port
    start "engine-$grp" "$BIN/br-emu" engine --ranks "$G" --slots "$B" --step-a "$STEP_A" \
        --step-b "$STEP_B" --time-scale "$SCALE" --base-port "${ENGINE_OF[$grp]}" \
        --dp-port "$((ENGINE_OF[$grp] + G))"
done
wait_http "http://127.0.0.1:$((SNAP + 1))/livez" br-snapshot
wait_http "http://127.0.0.1:$((INGEST + 1))/readyz" br-ingest
for grp in "${GROUPS_LIST[@]}"; do
    wait_http "http://127.0.0.1:${ENGINE_OF[$grp]}/health" "br-emu engine ($grp)"
done

start_group_shims() { # start_group_shims: G shims per group, announcing capacity B
    local grp
    for grp in "${GROUPS_LIST[@]}"; do
        start_shims "$B" "$grp" "${ENGINE_OF[$grp]}" "${SHIMS_OF[$grp]}"
        RANK_URLS_OF[$grp]=$RANK_URLS
    done
}
declare -A RANK_URLS_OF
stop_pids() {
    local pid
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

for policy in $POLICIES; do
    say "br-decision --policy $policy for $GROUPS_CSV; every group replays $N requests of $TRACE at once"
    start_group_shims
    start "decision-$policy" "$BIN/br-decision" --listen "127.0.0.1:$DECISION" \
        --admin-listen "127.0.0.1:$((DECISION + 1))" --snapshot-addr "http://127.0.0.1:$SNAP" \
        --groups "$GROUPS_CSV" --policy "$policy" --max-wait 600s
    DECISION_PID=$LAST_PID
    wait_http "http://127.0.0.1:$((DECISION + 1))/readyz" "br-decision ($policy)"
    LOADS=()
    for grp in "${GROUPS_LIST[@]}"; do
        "$BIN/br-emu" load --decision-addr "http://127.0.0.1:$DECISION" --group "$grp" \
            --rank-urls "${RANK_URLS_OF[$grp]}" --engine-url "http://127.0.0.1:${ENGINE_OF[$grp]}" \
            --trace "$TRACE" --limit "$N" --arrival saturated --label "$policy" --seed "$((1000 + ${grp#live-}))" \
            --json "$OUT/$grp-$policy.json" --arrivals-csv "$OUT/$grp-$policy-arrivals.csv" \
            >"$OUT/load-$grp-$policy.log" 2>&1 &
        LOADS+=("$!")
    done
    for pid in "${LOADS[@]}"; do
        wait "$pid" || { echo "br-emu load failed; see $OUT/load-*-$policy.log" >&2; exit 1; }
    done
    stop_pids "$DECISION_PID"
    stop_shims
done

for grp in "${GROUPS_LIST[@]}"; do
    RUNS=()
    for policy in $POLICIES; do RUNS+=("$OUT/$grp-$policy.json"); done
    # shellcheck disable=SC2086 # POLICIES is a word list
    sim_replay "$grp-" $POLICIES
    say "group $grp: $TRACE, $N requests, G=$G, B=$B, beside $((NGROUPS - 1)) other group(s); model time (wall / $SCALE)"
    "$BIN/br-emu" report "${RUNS[@]}" ${SIMS[@]+"${SIMS[@]}"}
done
echo
echo "run took $(( $(date +%s) - T0 )) s after the build; JSON and logs in $OUT"
