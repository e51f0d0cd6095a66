#!/usr/bin/env bash
# BR-C (prefill waves) against its targets, cell by cell: adp-shape (synthetic, the shape of
# TensorRT-LLM's attention-DP balancing dataset) and two public traces' request shapes
# (azure2023_conv: short outputs; mooncake: 12k-token prompts, prompt-heavy) with colocated
# prefill (p = 0.48 ms per prefill token, 8,192-token chunk: scripts/colocated.sh says why),
# G = 8, 16, 32, B = 256, 5 seeds.
#   saturated: balance ratio (s.bal%) >= 90% and >= 80% of the best baseline's steady gap to
#              the aligned limit (s.gap%);
#   Poisson at 60% and 85% of capacity (the best baseline's saturated steady tok/s over the
#              workload's mean output): TTFT p99 <= 1.25x the best baseline's and TPOT p95 no
#              worse, paired by seed (scripts/paired.py).
# The public traces are replayed for their prompt and output lengths; their own timestamps
# overload every policy under this step model (TTFT of minutes), so the loads are Poisson.
# mooncake's saturated runs replay its 12,031 requests 4 times over (`--repeat 4`): once, they
# fill G = 32 ranks of 256 slots 1.5 times, and the steady window is too short to read.
# BRC_WORKLOADS (default "adp-shape azure2023_conv mooncake") runs the target and look-ahead sweeps
# for some of them only (the summary reads whatever outputs OUT_DIR holds).
# Then the look-ahead's sweep (lookahead 0, 0.25, 0.5, 1) on the three workloads saturated, and
# the same saturated cells with 2 steps of telemetry lag, and with the engine's p at 0.5x
# and 1.5x (BR-C reads no p: its rules look only at which ranks have prompts queued, free
# slots and KV tokens). The target table of tools/sim/RESULTS.md's "BR-C against its targets"
# comes from scripts/brc_targets.py over the outputs (results/P-brc-T-*).
# Usage: tools/sim/scripts/brc_targets.sh [OUT_DIR] [robust|targets]; under nice on a shared
# machine (about half an hour on one core; `robust`: only the robustness sweeps and the
# summary; `targets`: everything but the robustness sweeps, a few minutes).
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
PAIRED="$ROOT/tools/sim/scripts/paired.py"
mkdir -p "$OUT"
SEEDS=1,2,3,4,5
POLICIES=rr,jsq,vllm-dp,mintok,br0,brc
COLO=(--colocated --step-p 0.48 --prefill-chunk 8192)
declare -A WORKLOADS=(
  [adp-shape]=adp-shape
  [azure2023_conv]="$TRACES/azure2023_conv.csv"
  [mooncake]="$TRACES/mooncake_conversation_trace.jsonl"
)

RUN_WORKLOADS="${BRC_WORKLOADS:-adp-shape azure2023_conv mooncake}"
# saturated runs replay a short trace several times over (see above)
declare -A SATURATED_REPEAT=([mooncake]="--repeat 4")

sweep() { # output name, then br-sim sweep arguments
  local name="$1"; shift
  echo "== $name" >&2
  { echo "\$ br-sim sweep $*"; "$SIM" sweep "$@" 2>/dev/null; } > "$OUT/$name.txt"
}

if [ "${2:-}" != robust ]; then
  for wl in $RUN_WORKLOADS; do
    trace="${WORKLOADS[$wl]}"
    base=(--trace "$trace" --slots 256 "${COLO[@]}")
    # shellcheck disable=SC2086 # the repeat flag and its count, or nothing
    sweep "P-brc-T-$wl-saturated" "${base[@]}" ${SATURATED_REPEAT[$wl]:-} --seeds "$SEEDS" \
      --policies "$POLICIES" --arrival saturated --workers-list 8,16,32
    for g in 8 16 32; do
      for pct in 60 85; do
        rate="$(rate_at "$OUT/P-brc-T-$wl-saturated.txt" "$g" "0.$pct")"
        echo "== P-brc-T-$wl-G$g-poisson$pct (rate $rate)" >&2
        python3 "$PAIRED" "$SIM" "$SEEDS" --json "$OUT/P-brc-T-$wl-G$g-poisson$pct.json" -- \
          "${base[@]}" --policies "$POLICIES" --arrival poisson --rate "$rate" --workers "$g" \
          > "$OUT/P-brc-T-$wl-G$g-poisson$pct.txt"
      done
    done
  done
fi

# the look-ahead (a deep pool's wave choosing among more than the oldest), saturated, against
# BR-C without it (lookahead=0) and at half and twice the default; the public traces' saturated
# runs are one fixed order (every seed the same run), so one seed each
if [ "${2:-}" != robust ]; then
  for wl in $RUN_WORKLOADS; do
    seeds="$SEEDS"
    [ "$wl" = adp-shape ] || seeds=1
    # shellcheck disable=SC2086 # as above
    sweep "P-brc-lookahead-$wl-saturated" --trace "${WORKLOADS[$wl]}" --slots 256 "${COLO[@]}" \
      ${SATURATED_REPEAT[$wl]:-} --seeds "$seeds" --arrival saturated --workers-list 8,16,32 \
      --policies rr,jsq,vllm-dp,mintok,br0,brc:lookahead=0,brc:lookahead=0.25,brc,brc:lookahead=1
  done
fi

if [ "${2:-}" != targets ]; then
  # robustness, adp-shape saturated: telemetry 2 steps late (G = 32 on its own: a lagged σ copies
  # the state of 64,000 requests every step, a quarter of an hour on two cores); the engine's p
  # off by -50% / +50%
  adp=(--trace adp-shape --slots 256 --prefill-chunk 8192 --colocated --seeds "$SEEDS"
    --policies "$POLICIES" --arrival saturated)
  sweep P-brc-T-adp-shape-saturated-lag2 "${adp[@]}" --workers-list 8,16 --step-p 0.48 \
    --telemetry-lag-steps 2
  sweep P-brc-T-adp-shape-saturated-lag2-G32 "${adp[@]}" --workers-list 32 --step-p 0.48 \
    --telemetry-lag-steps 2
  adp+=(--workers-list 8,16,32)
  sweep P-brc-T-adp-shape-saturated-p0.24 "${adp[@]}" --step-p 0.24
  sweep P-brc-T-adp-shape-saturated-p0.72 "${adp[@]}" --step-p 0.72
fi
python3 "$ROOT/tools/sim/scripts/brc_targets.py" "$OUT" | tee "$OUT/P-brc-T-summary.txt"
