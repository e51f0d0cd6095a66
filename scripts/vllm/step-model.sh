#!/usr/bin/env bash
# The step model of a real engine: starts one vLLM rank (CPU build, tiny model, one core) on a
# free port, samples its decode step time under a sweep of loads (step_samples.py) and fits
# T = a·M + c·N + b with `br-sim calibrate`. Writes the samples and the fit under
# target/vllm/step-model/ and prints the fit with its standard errors.
#
# With STEP_PREFILL=256,1024,2048 (prompt lengths) it samples the colocated prefill term
# instead: prompts of those lengths arrive among decoding streams (step_samples.py --prefill),
# the engine's batched-token budget (8,192) holds each in one step, and the fit is
# T = a·M + p·P + c·N + b; samples and fit go to prefill-samples.csv and prefill-fit.*.
#
# Environment: STEP_ARGS (extra step_samples.py flags, e.g. "--repeats 1"), STEP_PREFILL,
# BR_VLLM_HOME.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
HOME_DIR="${BR_VLLM_HOME:-$ROOT/target/vllm}"
OUT="$HOME_DIR/step-model"
mkdir -p "$OUT"
mapfile -t installed < <(BR_VLLM_HOME="$HOME_DIR" bash scripts/vllm/install.sh)
VLLM_PY="${installed[0]}"
MODEL="${installed[1]}"
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"
free_ports 1 PORT

say "vLLM $MODEL on 127.0.0.1:$PORT (one rank, core 0)"
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 HF_HUB_OFFLINE=1 \
VLLM_NO_USAGE_STATS=1 start vllm "$VLLM_PY" -m vllm.entrypoints.cli.main serve "$MODEL" \
    --served-model-name tiny --host 127.0.0.1 --port "$PORT" --max-model-len 8192 \
    --dtype bfloat16 --enforce-eager --max-num-seqs 16 ${STEP_PREFILL:+--max-num-batched-tokens 8192}
for _ in $(seq 1 1200); do
    curl -fsS -o /dev/null "http://127.0.0.1:$PORT/v1/models" 2>/dev/null && break
    sleep 0.5
done
curl -fsS -o /dev/null "http://127.0.0.1:$PORT/v1/models"

NAME=""
[ -n "${STEP_PREFILL:-}" ] && NAME="prefill-"
say "sampling step times (step_samples.py ${STEP_PREFILL:+--prefill $STEP_PREFILL }${STEP_ARGS:-})"
# shellcheck disable=SC2086 # STEP_ARGS is split on purpose
"$VLLM_PY" scripts/vllm/step_samples.py "http://127.0.0.1:$PORT" ${STEP_PREFILL:+--prefill "$STEP_PREFILL"} \
    ${STEP_ARGS:-} >"$OUT/${NAME}samples.csv"

say "br-sim calibrate $OUT/${NAME}samples.csv"
cargo run -q --release -p br-sim -- calibrate "$OUT/${NAME}samples.csv" --json "$OUT/${NAME}fit.json" \
    | tee "$OUT/${NAME}fit.txt"
