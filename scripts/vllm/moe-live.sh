#!/usr/bin/env bash
# JSQ against BR-0 on a real mixture-of-experts engine, and the twin on the same arrivals.
#
# One vLLM server (CPU build) serves the tiny Mixtral (4 experts, top 2) with
# --data-parallel-size 2: its MoE layers gather and reduce across both ranks, so the ranks step
# in lockstep, which is the barrier BalanceRoute routes for. One br-shim serves both ranks with
# the X-data-parallel-rank header, br-all decides, and `br-emu load` replays the same Poisson
# arrivals of a public-trace-shaped workload once per policy. Then it
#   1. samples the server's step time with the load on one rank (scripts/vllm/step_samples.py
#      --header X-data-parallel-rank:0) and fits T = a·M + c·N + b with `br-sim calibrate`;
#   2. replays each live run's arrivals in br-sim with that fit (G = 2, the same capacity);
#   3. prints live and twin side by side (`br-emu report`).
#
# vLLM 0.32.0's CPU build cannot run a MoE model with DP > 1 as shipped: its all-gather and
# reduce-scatter MoE dispatcher calls collectives the CPU communicator lacks
# (vllm-project/vllm#57837). scripts/vllm/cpu_moe_dp/sitecustomize.py adds them for this run.
# With --enable-expert-parallel the CPU experts ignore the expert map and the worker segfaults in
# cpu_fused_moe at the first step; the same file maps the ids to local experts, after which EP = 2
# serves (EP=1 below). Without EP the experts are sharded by tensor parallelism across the two
# ranks; the lockstep is the same either way.
#
# Environment: N (requests per policy, 100), RATE (Poisson requests/s, 1.2: near what the server
# decodes on 2 cores), TRACE (paper-azure),
# B (running requests per rank: vLLM --max-num-seqs and the shim's capacity, 16), POLICIES
# ("jsq br0"; run it again in the other order to see the spread), WARMUP (1: replay the workload
# once, unmeasured, before the policies), EP (1: --enable-expert-parallel, 0), SEED (42), BR_PROFILE (release | debug, release), STEP_ARGS (extra
# step_samples.py flags), BR_VLLM_HOME. Output in target/vllm/moe-live/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
HOME_DIR="${BR_VLLM_HOME:-$ROOT/target/vllm}"
OUT="$HOME_DIR/moe-live"
OUT_LOGS="$OUT"
N="${N:-100}"
RATE="${RATE:-1.2}"
TRACE="${TRACE:-paper-azure}"
B="${B:-16}"
POLICIES="${POLICIES:-jsq br0}"
SEED="${SEED:-42}"
WARMUP="${WARMUP:-1}"
EP="${EP:-0}"
PROFILE="${BR_PROFILE:-release}"
# Above every prompt + output of the paper-shaped traces: vLLM ends a stream silently (finish
# reason "length") when prompt + generated tokens reach the model length, whatever max_tokens.
# The tiny model declares 8,192 positions; its weights are random and only step times are
# measured here, so vLLM is allowed past that (VLLM_ALLOW_LONG_MAX_MODEL_LEN below).
MAX_LEN=16384
GROUP=moe
G=2
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.csv

mapfile -t installed < <(BR_VLLM_HOME="$HOME_DIR" bash scripts/vllm/install.sh)
VLLM_PY="${installed[0]}"
MODEL="$HOME_DIR/models/tiny-mixtral"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

say "building ($PROFILE): br-all br-shim br-emu br-sim"
flags=()
[ "$PROFILE" = release ] && flags=(--release)
cargo build -q "${flags[@]}" --bin br-all --bin br-shim --bin br-emu --bin br-sim
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"

free_ports 1 VLLM
free_ports 2 ALL
free_ports 2 SHIM
say "vLLM: tiny Mixtral, --data-parallel-size 2, on 127.0.0.1:$VLLM (both ranks; a few minutes to start)"
PYTHONPATH="$ROOT/scripts/vllm/cpu_moe_dp" VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 \
VLLM_CPU_OMP_THREADS_BIND='0|1' HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 \
start vllm "$VLLM_PY" -m vllm.entrypoints.cli.main serve "$MODEL" --served-model-name tiny \
    --host 127.0.0.1 --port "$VLLM" --max-model-len "$MAX_LEN" --dtype bfloat16 --enforce-eager \
    --data-parallel-size 2 --max-num-seqs "$B" $([ "$EP" = 1 ] && echo --enable-expert-parallel)
for _ in $(seq 1 1200); do
    curl -fsS -o /dev/null "http://127.0.0.1:$VLLM/v1/models" 2>/dev/null && break
    kill -0 "$LAST_PID" 2>/dev/null || { echo "vLLM exited; see $OUT/vllm.log" >&2; exit 1; }
    sleep 0.5
done
curl -fsS -o /dev/null "http://127.0.0.1:$VLLM/v1/models"
# A step through both ranks proves the MoE collectives work before anything is measured.
for r in 0 1; do
    if ! curl -fsS -o /dev/null -H "X-data-parallel-rank: $r" -H 'content-type: application/json' \
        -d '{"model":"tiny","prompt":"rank token step","max_tokens":8,"ignore_eos":true}' \
        "http://127.0.0.1:$VLLM/v1/completions"; then
        if grep -q 'died unexpectedly' "$OUT/vllm.log"; then
            echo "vLLM's first step through rank $r killed a worker (seen on an Intel Xeon with AMX, with" \
                "and without EP, where the AMD EPYC machines serve; docs/benchmarks.md);" \
                "see $OUT/vllm.log" >&2
        else
            echo "vLLM refused a step through rank $r; see $OUT/vllm.log" >&2
        fi
        exit 1
    fi
done

# One live run: br-all with POLICY and a shim over both ranks, the workload replayed once, saved
# as OUT/LABEL.json (and its arrivals for the twin).
live_run() {
    local policy=$1 label=$2
    say "br-all --policy $policy; br-shim for ranks 0-1 (capacity $B); $N requests of $TRACE, Poisson $RATE/s ($label)"
    start "all-$label" "$BIN/br-all" --listen "127.0.0.1:$ALL" --admin-listen "127.0.0.1:$((ALL + 1))" \
        --groups "$GROUP" --policy "$policy" --max-wait 600s
    local all_pid=$LAST_PID
    wait_http "http://127.0.0.1:$((ALL + 1))/livez" br-all
    start "shim-$label" "$BIN/br-shim" --listen "127.0.0.1:$SHIM" --admin-listen "127.0.0.1:$((SHIM + 1))" \
        --upstream "http://127.0.0.1:$VLLM" --ingest-addr "http://127.0.0.1:$ALL" --group "$GROUP" \
        --worker-ids 0-1 --dp-rank-header X-data-parallel-rank --capacity "$B"
    local shim_pid=$LAST_PID
    wait_http "http://127.0.0.1:$((SHIM + 1))/readyz" br-shim
    wait_http "http://127.0.0.1:$((ALL + 1))/readyz" "br-all ($policy)"
    "$BIN/br-emu" load --decision-addr "http://127.0.0.1:$ALL" --group "$GROUP" --model tiny \
        --rank-urls "http://127.0.0.1:$SHIM/rank/0,http://127.0.0.1:$SHIM/rank/1" \
        --trace "$TRACE" --limit "$N" --arrival poisson --rate "$RATE" --seed "$SEED" --label "$label" \
        --json "$OUT/$label.json" --arrivals-csv "$OUT/$label-arrivals.csv"
    curl -fsS "http://127.0.0.1:$VLLM/metrics" | grep -E '^vllm:(generation_tokens_total|prompt_tokens_total)' \
        >"$OUT/$label-vllm-counters.txt" || true
    kill -TERM "$shim_pid" "$all_pid" 2>/dev/null || true
    wait "$shim_pid" "$all_pid" 2>/dev/null || true
}

# A freshly started server was slower through its first pass over the workload: without this
# pass, whichever policy ran first came out 14-35% worse on TPOT p95 (two runs, both orders).
if [ "$WARMUP" = 1 ]; then
    live_run jsq warmup
fi
RUNS=()
for policy in $POLICIES; do
    live_run "$policy" "$policy"
    RUNS+=("$OUT/$policy.json")
done

say "step model: streams pinned to rank 0 (rank 1 steps with it), step_samples.py ${STEP_ARGS:-}"
# shellcheck disable=SC2086 # STEP_ARGS is split on purpose
"$VLLM_PY" scripts/vllm/step_samples.py "http://127.0.0.1:$VLLM" --header X-data-parallel-rank:0 \
    --running "1,2,4,8,$B" ${STEP_ARGS:-} >"$OUT/step-samples.csv"
"$BIN/br-sim" calibrate "$OUT/step-samples.csv" --json "$OUT/fit.json" | tee "$OUT/fit.txt"
read -r -a STEP_FLAGS <<<"$(sed -n 's/^use: //p' "$OUT/fit.txt")"
if grep -q '^warning: a negative coefficient' "$OUT/fit.txt"; then
    # The tiny model's step does not grow with KV tokens on a CPU (per-step and per-request
    # overheads dominate), so a can come out below zero within its error. The twin then runs
    # T = c·N + b: the same samples fitted on the running requests alone (the two-term model
    # with N in the first column), and a = 0.
    awk -F, 'NR == 1 { print "max_kv_tokens,step_ms"; next } { print $2 "," $3 }' \
        "$OUT/step-samples.csv" >"$OUT/step-samples-n.csv"
    "$BIN/br-sim" calibrate "$OUT/step-samples-n.csv" | tee "$OUT/fit-n.txt"
    read -r _ a _ b <<<"$(sed -n 's/^use: //p' "$OUT/fit-n.txt")"
    STEP_FLAGS=(--step-a 0 "--step-c=$a" "--step-b=$b")
    echo "the twin uses T = c·N + b: ${STEP_FLAGS[*]}"
fi

say "br-sim: the twin on each live run's arrivals (G = $G, B = $B, ${STEP_FLAGS[*]})"
SIMS=()
for policy in $POLICIES; do
    for k in 1 2 3 4; do
        "$BIN/br-sim" run --trace "$OUT/$policy-arrivals.csv" --arrival trace --limit "$N" \
            --arrival-jitter-ms 1 --seed "$k" --workers "$G" --slots "$B" --policies "$policy" \
            "${STEP_FLAGS[@]}" --json "$OUT/sim-$policy-$k.json" >"$OUT/sim-$policy-$k.log" 2>&1
        SIMS+=(--sim "$OUT/sim-$policy-$k.json")
    done
done

say "results: $TRACE, $N requests, Poisson $RATE/s, G = $G, B = $B (times in wall ms)"
"$BIN/br-emu" report "${RUNS[@]}" "${SIMS[@]}"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load average $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)"
