# Helpers to run BalanceRoute processes on loopback from a script: free ports, start in the
# background with a log file, wait for an HTTP 200, and stop everything on exit.
# The sourcing script sets OUT_LOGS (a directory for the logs) and `set -euo pipefail`.

PIDS=()
cleanup() {
    local code=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        # Give each a moment to drain, then insist.
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "$code" -ne 0 ]; then
        echo "${0##*/} failed (exit $code); logs in $OUT_LOGS" >&2
    fi
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say() { printf '\n==> %s\n' "$*"; }

# --- mutual TLS (STACK_TLS=1) ----------------------------------------------------------------
# Every service, shim and the load generator get their own certificate (br-certs: a CA, one per
# role, one per worker, SPIFFE URI SANs); admin ports speak HTTPS (probes open, see br-trust).
STACK_TLS="${STACK_TLS:-0}"
ADMIN_SCHEME=http
CURL_TLS=()
tls_init() { # writes the certificates into $OUT_LOGS/certs (needs BIN, GROUP, G)
    [ "$STACK_TLS" = 1 ] || return 0
    CERTS="$OUT_LOGS/certs"
    "$BIN/br-certs" "$CERTS" "$GROUP" "$G" >/dev/null
    say "mutual TLS on every connection (development certificates in $CERTS)"
    ADMIN_SCHEME=https
    CURL_TLS=(--cacert "$CERTS/ca.pem")
}
tls_for() { # tls_for NAME: sets TLS_F to the flags for certificate NAME (a role, or worker-<group>-<id>)
    TLS_F=()
    [ "$STACK_TLS" = 1 ] || return 0
    TLS_F=(--tls-cert "$CERTS/$1.pem" --tls-key "$CERTS/$1-key.pem" --tls-ca "$CERTS/ca.pem")
}

# --- Prometheus file_sd targets ---------------------------------------------------------------
# Every admin endpoint the stack runs, in $OUT_LOGS/prometheus-targets.json, which the
# balanceroute-local job of deploy/prometheus/prometheus.yml reads (file_sd): a local Prometheus
# scrapes snapshot, ingest, decision and every shim on whatever ports the run picked.
PROM_TARGETS=()
prom_add() { # prom_add ADDR COMPONENT [WORKER]
    PROM_TARGETS+=("$1|$2|${3:-}")
    prom_write
}
prom_remove() { # prom_remove COMPONENT: drops every target of that component
    local kept=() t
    for t in ${PROM_TARGETS[@]+"${PROM_TARGETS[@]}"}; do
        case "$t" in *"|$1|"*) ;; *) kept+=("$t") ;; esac
    done
    PROM_TARGETS=(${kept[@]+"${kept[@]}"})
    prom_write
}
prom_write() {
    local t addr comp worker sep="" out="["
    for t in ${PROM_TARGETS[@]+"${PROM_TARGETS[@]}"}; do
        IFS='|' read -r addr comp worker <<<"$t"
        out="$out$sep{\"targets\":[\"$addr\"],\"labels\":{\"component\":\"$comp\",\"balanceroute_group\":\"${GROUP:-}\"${worker:+,\"balanceroute_worker\":\"$worker\"}}}"
        sep=","
    done
    printf '%s]\n' "$out" >"$OUT_LOGS/prometheus-targets.json.tmp"
    mv "$OUT_LOGS/prometheus-targets.json.tmp" "$OUT_LOGS/prometheus-targets.json"
}

# --- free loopback ports --------------------------------------------------------------------
USED=" "
port_free() { # a port is free if nothing accepts on it and we did not hand it out
    case "$USED" in *" $1 "*) return 1 ;; esac
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
free_ports() { # free_ports COUNT VAR: finds COUNT consecutive free ports, sets VAR to the first
    local count=$1 base ok i
    for _ in $(seq 1 200); do
        # Below the kernel's ephemeral range (32768+), where outgoing connections take ports.
        base=$(( 15000 + RANDOM % 17000 ))
        ok=1
        for ((i = 0; i < count; i++)); do
            port_free $((base + i)) || { ok=0; break; }
        done
        if [ "$ok" = 1 ]; then
            for ((i = 0; i < count; i++)); do USED="$USED$((base + i)) "; done
            printf -v "$2" '%s' "$base"
            return 0
        fi
    done
    echo "no free ports" >&2
    return 1
}

wait_http() { # wait_http URL WHAT: until URL answers 200 (at most 60 s)
    for _ in $(seq 1 600); do
        if curl -fsS ${CURL_TLS[@]+"${CURL_TLS[@]}"} -o /dev/null "$1" 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "timed out waiting for $2 ($1)" >&2
    return 1
}

admin_get() { # admin_get URL: an admin route beyond the probes (under TLS, with the admin certificate)
    local auth=()
    [ "$STACK_TLS" = 1 ] && auth=(--cert "$CERTS/admin.pem" --key "$CERTS/admin-key.pem")
    curl -fsS ${CURL_TLS[@]+"${CURL_TLS[@]}"} ${auth[@]+"${auth[@]}"} "$1"
}

start() { # start NAME CMD...: runs CMD in the background, logging to $OUT/NAME.log
    local name=$1
    shift
    "$@" >"$OUT_LOGS/$name.log" 2>&1 &
    PIDS+=("$!")
    LAST_PID=$!
}


# STACK_DEPLOY: how the control plane runs. split (the default here): br-snapshot and br-ingest
# start with the stack and live through every run, and br-decision starts and stops per run
# (start_decision, stop_decision). all: br-all, the three in one process, starts before the
# shims of each run (start_all) and stops with it (stop_decision), so each run begins on an
# empty σ; SNAP, INGEST and DECISION are then all its one port.
STACK_DEPLOY="${STACK_DEPLOY:-split}"
case "$STACK_DEPLOY" in
    split | all) ;;
    *) echo "STACK_DEPLOY must be split or all, not '$STACK_DEPLOY'" >&2; exit 2 ;;
esac

# start_stack: `br-emu engine` on free loopback ports, ports for G br-shims (start_shims), and
# (split) br-snapshot and br-ingest, or (all) ports for br-all. Uses BIN, G, B, STEP_A, STEP_B,
# SCALE, GROUP; sets SNAP, INGEST, DECISION, ENGINE (rank g on ENGINE+g, the
# X-data-parallel-rank port on ENGINE+G), SHIMS (shim g on SHIMS+2g, its admin port next) and
# RANK_URLS (the shims, comma-separated).
start_stack() {
    if [ "$STACK_DEPLOY" = all ]; then
        free_ports 2 SNAP
        INGEST=$SNAP
        DECISION=$SNAP
    else
        free_ports 2 SNAP
        free_ports 2 INGEST
        free_ports 2 DECISION
    fi
    free_ports $((G + 1)) ENGINE
    free_ports $((2 * G)) SHIMS

    tls_init
    # the step model as the engine runs it (with colocated prefill, its p·max P term: the
    # value after --step-p in COLOCATED_F)
    local model="T=($STEP_A·max L + $STEP_B) ms × $SCALE" i
    for i in "${!COLOCATED_F[@]}"; do
        [ "${COLOCATED_F[$i]}" = --step-p ] &&
            model="T=($STEP_A·max L + ${COLOCATED_F[$((i + 1))]}·max P + $STEP_B) ms × $SCALE"
    done
    if [ "$STACK_DEPLOY" = all ]; then
        say "br-all will listen on :$SNAP (one per run); starting br-emu engine :$ENGINE..$((ENGINE + G)) (G=$G, B=$B, $model), $G br-shims :$SHIMS.."
    else
        say "starting br-snapshot :$SNAP, br-ingest :$INGEST, br-emu engine :$ENGINE..$((ENGINE + G)) (G=$G, B=$B, $model), $G br-shims :$SHIMS.."
        tls_for snapshot
        start snapshot "$BIN/br-snapshot" --listen "127.0.0.1:$SNAP" --admin-listen "127.0.0.1:$((SNAP + 1))" \
            --reservation-ttl 60s ${TLS_F[@]+"${TLS_F[@]}"}
        tls_for ingest
        start ingest "$BIN/br-ingest" --listen "127.0.0.1:$INGEST" --admin-listen "127.0.0.1:$((INGEST + 1))" \
            --snapshot-addr "http://127.0.0.1:$SNAP" ${TLS_F[@]+"${TLS_F[@]}"}
    fi
    start engine "$BIN/br-emu" engine --ranks "$G" --slots "$B" --step-a "$STEP_A" --step-b "$STEP_B" \
        ${COLOCATED_F[@]+"${COLOCATED_F[@]}"} \
        --time-scale "$SCALE" --base-port "$ENGINE" --dp-port "$((ENGINE + G))"
    if [ "$STACK_DEPLOY" = split ]; then
        wait_http "$ADMIN_SCHEME://127.0.0.1:$((SNAP + 1))/livez" br-snapshot
        wait_http "$ADMIN_SCHEME://127.0.0.1:$((INGEST + 1))/readyz" br-ingest
        prom_add "127.0.0.1:$((SNAP + 1))" snapshot
        prom_add "127.0.0.1:$((INGEST + 1))" ingest
    fi
    wait_http "http://127.0.0.1:$ENGINE/health" "br-emu engine"
}

# policy_flags SPEC: sets POLICY_F to the decision's flags for a policy in br-sim's spec syntax,
# NAME[:key=value]...: `--policy NAME` and `--key value` for each setting (`_` in the key as `-`,
# the dispatcher's settings being flags of the same names, e.g. brh-hinted:stagger_weight=1 is
# `--policy brh-hinted --stagger-weight 1`; BR-C's are `--brc-*`), so a live run and its twin (`br-sim --policies
# SPEC`) run the same policy with the same settings.
policy_flags() {
    local spec=$1 kv key parts
    POLICY_F=(--policy "${spec%%:*}")
    IFS=':' read -ra parts <<<"$spec"
    for kv in "${parts[@]:1}"; do
        if [[ $kv != ?*=?* ]]; then
            echo "policy $spec: expected NAME:key=value..., got '$kv'" >&2
            return 2
        fi
        key=${kv%%=*}
        # BR-C's own settings are the decision's --brc-* flags (brc:max_wait_steps=16 is
        # --brc-max-wait-steps 16; shallow_wait_steps, hold_fraction, wave_fraction, kv_swap,
        # lookahead, fill_under and fill_slack alike); any other key is a flag of its own name,
        # as for every policy
        case "${spec%%:*}:$key" in
        brc:max_wait_steps | brc:shallow_wait_steps | brc:hold_fraction | brc:wave_fraction | brc:kv_swap | brc:lookahead | brc:fill_under | brc:fill_slack)
            key="brc_$key" ;;
        esac
        POLICY_F+=("--${key//_/-}" "${kv#*=}")
    done
}

# start_all POLICY (STACK_DEPLOY=all): br-all for GROUP on SNAP with POLICY (a spec, see
# policy_flags), until it is live; start the shims next (they report to it), then start_decision
# waits until it can place. Does nothing under split.
start_all() {
    [ "$STACK_DEPLOY" = all ] || return 0
    tls_for all
    policy_flags "$1"
    start "all-$1" "$BIN/br-all" --listen "127.0.0.1:$SNAP" --admin-listen "127.0.0.1:$((SNAP + 1))" \
        --groups "$GROUP" "${POLICY_F[@]}" --max-wait 600s --reservation-ttl 60s ${TLS_F[@]+"${TLS_F[@]}"}
    DECISION_PID=$LAST_PID
    wait_http "$ADMIN_SCHEME://127.0.0.1:$((SNAP + 1))/livez" "br-all ($1)"
}

# start_decision POLICY: (split) br-decision for GROUP on DECISION with POLICY (a spec, see
# policy_flags); (all)
# the br-all start_all started. Waits until it is ready (it can place: σ with a live worker, so
# start the shims first). stop_decision: SIGTERM and wait (under all, the whole control plane).
DECISION_PID=""
DECISION_COMPONENT=decision
[ "$STACK_DEPLOY" = split ] || DECISION_COMPONENT=all
start_decision() {
    if [ "$STACK_DEPLOY" = split ]; then
        tls_for decision
        policy_flags "$1"
        start "decision-$1" "$BIN/br-decision" --listen "127.0.0.1:$DECISION" \
            --admin-listen "127.0.0.1:$((DECISION + 1))" --snapshot-addr "http://127.0.0.1:$SNAP" \
            --groups "$GROUP" "${POLICY_F[@]}" --max-wait 600s ${TLS_F[@]+"${TLS_F[@]}"}
        DECISION_PID=$LAST_PID
    fi
    wait_http "$ADMIN_SCHEME://127.0.0.1:$((DECISION + 1))/readyz" "br-$DECISION_COMPONENT ($1)"
    prom_add "127.0.0.1:$((DECISION + 1))" "$DECISION_COMPONENT"
}
stop_decision() {
    prom_remove "$DECISION_COMPONENT"
    kill -TERM "$DECISION_PID" 2>/dev/null || true
    wait "$DECISION_PID" 2>/dev/null || true
}

# start_shims CAPACITY [GROUP ENGINE SHIMS]: one br-shim per rank of GROUP (default $GROUP) in
# front of its engine (rank g on ENGINE+g, default $ENGINE), listening on SHIMS+2g (default
# $SHIMS), announcing CAPACITY; waits until each is ready. Appends to SHIM_PIDS (several groups
# can be started one after another) and sets RANK_URLS to this group's shims, comma-separated.
# stop_shims: SIGTERM every shim started so far and wait (a restart is a new incarnation).
SHIM_PIDS=()
start_shims() {
    local cap=$1 grp=${2:-$GROUP} engine=${3:-$ENGINE} shims=${4:-$SHIMS} g p
    RANK_URLS=""
    for ((g = 0; g < G; g++)); do
        p=$((shims + 2 * g))
        tls_for "worker-$grp-$g"
        start "shim-$grp-$g-cap$cap" "$BIN/br-shim" --listen "127.0.0.1:$p" --admin-listen "127.0.0.1:$((p + 1))" \
            --upstream "http://127.0.0.1:$((engine + g))" --ingest-addr "http://127.0.0.1:$INGEST" \
            --group "$grp" --worker-id "$g" --capacity "$cap" ${TLS_F[@]+"${TLS_F[@]}"}
        SHIM_PIDS+=("$LAST_PID")
        RANK_URLS="$RANK_URLS${RANK_URLS:+,}http://127.0.0.1:$p"
    done
    for ((g = 0; g < G; g++)); do
        wait_http "$ADMIN_SCHEME://127.0.0.1:$((shims + 2 * g + 1))/readyz" "br-shim $grp/$g"
        prom_add "127.0.0.1:$((shims + 2 * g + 1))" shim "$g"
    done
}
stop_shims() {
    local pid
    prom_remove shim
    for pid in "${SHIM_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${SHIM_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    SHIM_PIDS=()
}

# sim_replay PREFIX POLICY...: the twin (br-sim) on the requests each live run replayed, arriving
# as that run's decision saw them ($OUT/PREFIX<policy>-arrivals.csv, from `br-emu load
# --arrivals-csv`, with the expected output length each Assign carried, if any), with the
# stack's G, B and step model, and the same policy spec (its settings included). The client that timed the arrivals does
# not know the order of calls that reached the decision within a millisecond of each other, and
# routing on arrival is sensitive to it (JSQ's imbalance moves by about ±15% with a ±1 ms jitter;
# docs/design/0008-twin-replays-with-jitter.md), so the twin runs TWIN_REPLAYS times (default 8) with seeded
# `--arrival-jitter-ms` TWIN_JITTER_MS (default 1) and `br-emu report` shows their mean and spread.
# Sets SIMS to the `--sim FILE` arguments; a policy whose twin fails is reported and left out.
sim_replay() {
    local prefix=$1 policy k
    shift
    SIMS=()
    for policy in "$@"; do
        for ((k = 1; k <= ${TWIN_REPLAYS:-8}; k++)); do
            if "$BIN/br-sim" run --trace "$OUT/$prefix$policy-arrivals.csv" --arrival trace --limit "$N" \
                --arrival-jitter-ms "${TWIN_JITTER_MS:-1}" --seed "$k" \
                --workers "$G" --slots "$B" --policies "$policy" --step-a "$STEP_A" --step-b "$STEP_B" \
                ${COLOCATED_F[@]+"${COLOCATED_F[@]}"} --json "$OUT/${prefix}sim-$policy-$k.json" >"$OUT/${prefix}sim-$policy-$k.log" 2>&1; then
                SIMS+=(--sim "$OUT/${prefix}sim-$policy-$k.json")
            else
                echo "(br-sim failed for $policy; see $OUT/${prefix}sim-$policy-$k.log)"
            fi
        done
    done
}
