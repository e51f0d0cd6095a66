#!/usr/bin/env bash
# The one-command demo (`make run`): builds the release binaries, starts br-all (the embedded
# default: ingest, snapshot and decision in one process), G br-shims and `br-emu engine` on
# loopback (free ports), replays a paper-shaped workload through them first with JSQ and then
# with BR-0 (br-all and the shims restarted with --policy, so each run starts on an empty σ),
# and prints the measured imbalance, balance ratio, TPOT and throughput side by side with
# br-sim's for the same workload, and how many ranks each run lost from routing at any time (a shim that
# judged its engine down): runs that did not keep the same ranks in routing are not compared
# fairly, and the summary says so. The twin replays each live run's arrivals as the decision
# service saw them (`br-emu load --arrivals-csv`): a "saturated" burst reaches the decision over
# a fraction of a second, and the first wave is placed as it arrives, which the twin's idealised
# burst (all in the pool at time 0) does not see (docs/design/0008-twin-replays-with-jitter.md).
# Every process it starts is stopped on exit.
#
# Knobs (environment): DEMO_TRACE (paper-azure), DEMO_REQUESTS (requests per policy), DEMO_G
# (ranks), DEMO_B (slots per rank), DEMO_STEP_A / DEMO_STEP_B (model ms: T = a·max L + b),
# DEMO_TIME_SCALE (wall = model × this), DEMO_COLOCATED=1 with DEMO_STEP_P and DEMO_PREFILL_CHUNK
# (the ranks prefill too, engine and twin alike: `--colocated --step-p --prefill-chunk`),
# DEMO_POLICIES ("jsq br0"; a policy may carry dispatcher settings in br-sim's spec syntax,
# NAME:key=value..., which the live decision gets as flags, `--key value`, and the twin as the
# spec), DEMO_HINT_ERROR=σ and DEMO_HINT_MODE (lognormal | shuffled | constant): every Assign
# carries a client's expected output length, made from the request's true one as `br-emu load
# --hint-error σ --hint-mode MODE` makes it (σ = 0: exact), and the twin replays the hint each
# request was sent with; with hints DEMO_POLICIES defaults to "jsq br0 brh-hinted:stagger_weight=1"
# (BR-H predicting from the hints, Stage 2 staggering each rank's finishes), DEMO_CLASSES=K with
# DEMO_CLASS_ERROR=σ and DEMO_CLASS_MODE (noisy | random): every Assign carries a request class
# key, one of K made from the output lengths as `br-emu load --classes K` makes them, replayed by
# the twin; DEMO_POLICIES then defaults to "jsq br0 brh-class", DEMO_ARRIVAL (saturated |
# poisson | trace) and DEMO_RATE (requests per model second), DEMO_OUT (target/demo; one demo
# at a time in each: a second is refused while the first runs),
# DEMO_SKIP_BUILD=1, DEMO_DEPLOY (all: br-all; split: br-snapshot, br-ingest and br-decision as
# three processes, decision restarted per policy), DEMO_TLS (1: mutual TLS on every connection of the control plane, with
# development certificates from br-certs; 0: plaintext on loopback), TWIN_REPLAYS (8) and
# TWIN_JITTER_MS (1): the twin's replays per policy over seeds of `--arrival-jitter-ms` (see
# scripts/lib/stack.sh's sim_replay).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TRACE="${DEMO_TRACE:-paper-azure}"
N="${DEMO_REQUESTS:-384}"
G="${DEMO_G:-8}"
B="${DEMO_B:-16}"
STEP_A="${DEMO_STEP_A:-0.0002}"
STEP_B="${DEMO_STEP_B:-30}"
COLOCATED_F=()
if [ "${DEMO_COLOCATED:-0}" = 1 ]; then
    COLOCATED_F=(--colocated --step-p "${DEMO_STEP_P:-0.01}" --prefill-chunk "${DEMO_PREFILL_CHUNK:-2048}")
fi
SCALE="${DEMO_TIME_SCALE:-0.25}"
HINT_F=()
[ -n "${DEMO_HINT_ERROR:-}" ] && HINT_F+=(--hint-error "$DEMO_HINT_ERROR")
[ -n "${DEMO_HINT_MODE:-}" ] && HINT_F+=(--hint-mode "$DEMO_HINT_MODE")
CLASSES="${DEMO_CLASSES:-}"
if [ -n "$CLASSES" ]; then
    HINT_F+=(--classes "$CLASSES")
    [ -n "${DEMO_CLASS_ERROR:-}" ] && HINT_F+=(--class-error "$DEMO_CLASS_ERROR")
    [ -n "${DEMO_CLASS_MODE:-}" ] && HINT_F+=(--class-mode "$DEMO_CLASS_MODE")
fi
if [ -n "$CLASSES" ] && [ -z "${DEMO_HINT_ERROR:-}${DEMO_HINT_MODE:-}" ]; then
    POLICIES="${DEMO_POLICIES:-jsq br0 brh-class}"
elif [ ${#HINT_F[@]} -gt 0 ]; then
    POLICIES="${DEMO_POLICIES:-jsq br0 brh-hinted:stagger_weight=1}"
else
    POLICIES="${DEMO_POLICIES:-jsq br0}"
fi
ARRIVAL="${DEMO_ARRIVAL:-saturated}"
RATE_FLAGS=()
[ -n "${DEMO_RATE:-}" ] && RATE_FLAGS=(--rate "$DEMO_RATE")
OUT="${DEMO_OUT:-$ROOT/target/demo}"
GROUP="demo"
STACK_TLS="${DEMO_TLS:-1}"
STACK_DEPLOY="${DEMO_DEPLOY:-all}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"

mkdir -p "$OUT"
# One demo per output directory: a second one would overwrite the first's logs and results.
LOCK="$OUT/.demo.pid"
if [ -s "$LOCK" ] && kill -0 "$(cat "$LOCK")" 2>/dev/null; then
    echo "a demo (pid $(cat "$LOCK")) is writing to $OUT; wait for it to end, or set DEMO_OUT to another directory" >&2
    exit 1
fi
echo $$ >"$LOCK"
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.csv

OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"
# shellcheck source=scripts/lib/routing.sh
source "$ROOT/scripts/lib/routing.sh"

SERVICES=(br-all)
[ "$STACK_DEPLOY" = all ] || SERVICES=(br-snapshot br-ingest br-decision)

# --- build ------------------------------------------------------------------------------------
if [ "${DEMO_SKIP_BUILD:-0}" != 1 ]; then
    say "building (release): ${SERVICES[*]} br-shim br-emu br-sim br-certs"
    cargo build --release -q "${SERVICES[@]/#/--bin=}" --bin br-shim --bin br-emu --bin br-sim --bin br-certs
fi
for b in "${SERVICES[@]}" br-shim br-emu br-sim br-certs; do
    [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }
done

T0=$(date +%s)

start_stack

# --- the runs ---------------------------------------------------------------------------------
RUNS=()
# Per run, POLICY=the ranks a shim took out of routing at some time (ranks_out_of_routing): the
# runs compare only if they had the same ranks in routing.
OUT_OF_ROUTING=()
for policy in $POLICIES; do
    # Every shim announces the engine's real capacity B. BalanceRoute's pooled policies admit a
    # request only into a free slot; the baselines route on arrival, as vLLM's or a gateway's
    # JSQ does, and their reservations are accepted past capacity (queue_if_full): the request
    # waits in the rank's local FIFO, as in br-sim's model.
    cap=$B
    policy_flags "$policy" # the flags the spec stands for, as start_all/start_decision pass them
    say "br-$DECISION_COMPONENT ${POLICY_F[*]} (shims announce capacity $cap); replaying $N requests of $TRACE ($ARRIVAL)${HINT_F[*]:+ with hints: ${HINT_F[*]}}"
    start_all "$policy"
    start_shims "$cap"
    start_decision "$policy"
    tls_for gateway
    "$BIN/br-emu" load --decision-addr "http://127.0.0.1:$DECISION" --group "$GROUP" ${TLS_F[@]+"${TLS_F[@]}"} \
        --rank-urls "$RANK_URLS" --engine-url "http://127.0.0.1:$ENGINE" \
        --trace "$TRACE" --limit "$N" --arrival "$ARRIVAL" ${RATE_FLAGS[@]+"${RATE_FLAGS[@]}"} \
        ${HINT_F[@]+"${HINT_F[@]}"} --label "$policy" \
        --json "$OUT/$policy.json" --arrivals-csv "$OUT/$policy-arrivals.csv"
    RUNS+=("$OUT/$policy.json")
    if [[ $policy == brh* ]]; then
        # How each tick got its per-request predictions (the share `made` is BR-H's tick cost)
        # and what its predictor learned (finishes, hinted ones, classes).
        say "$policy: BR-H's prediction cache and predictor over the run (br-$DECISION_COMPONENT's /metrics)"
        admin_get "$ADMIN_SCHEME://127.0.0.1:$((DECISION + 1))/metrics" |
            grep -E '^balanceroute_decision_(predictions_total|predictor_entries)' ||
            echo "(no predictor series)"
    fi
    # read before the shims stop (their counters go with them); the shims' logs are kept per
    # run for the ranks that left routing, since the next run's shims write the same files
    out=$(ranks_out_of_routing)
    OUT_OF_ROUTING+=("$policy=$out")
    for g in $out; do
        g=${g%\?}
        cp "$OUT/shim-$GROUP-$g-cap$cap.log" "$OUT/$policy-shim-$g.log" 2>/dev/null || true
    done
    stop_decision
    stop_shims
done

say "br-sim: the twin on the same requests, arriving as each live run's did${HINT_F[*]:+, with the hints they were sent with}"
# shellcheck disable=SC2086 # POLICIES is a word list
sim_replay "" $POLICIES

say "results: $TRACE, $N requests, G=$G, B=$B${HINT_F[*]:+, hints ${HINT_F[*]}}; model time (wall / $SCALE)"
"$BIN/br-emu" report "${RUNS[@]}" ${SIMS[@]+"${SIMS[@]}"}
echo
routing_verdict "$G" "${OUT_OF_ROUTING[@]}"
echo
echo "imbalance = mean over engine steps of max_g L_g - min_g L_g (KV tokens, the paper's metric);"
echo "br-sim, brctl and the live page use the same name, and call G*max L - sum L the barrier idle;"
echo "balance% = mean over engine steps of sum_g work_g / (G*max_g work_g), work_g = a*L_g + p*P_g + c*n_g"
echo "(each rank's share of the step time, its prompt tokens P_g included when colocated; br-sim's balance%)"
echo "run took $(( $(date +%s) - T0 )) s after the build; JSON and logs in $OUT"
# Beside every figure: the machine and how busy it was (the emulated engine's steps are wall
# time, so a loaded machine stretches them; compare runs from the same machine).
echo "machine: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs;" \
    "load average $(cut -d' ' -f1-3 /proc/loadavg); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
