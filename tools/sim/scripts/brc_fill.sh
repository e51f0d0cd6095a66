#!/usr/bin/env bash
# BR-C's rule 6 (fill under the most queued prefill between waves, `fill_under`) and its slack
# (`fill_slack`) at 60% and 85% of capacity, where the pool is shallow and the rule acts: the
# target cells of scripts/brc_targets.sh (adp-shape, azure2023_conv's and mooncake's request
# lengths, G = 8, 16, 32, 5 seeds paired by seed against the best baseline), BR-C without the
# rule, with slack 0, 0.25, 0.5, 1 (the default), 2 and 4. The rates are the target cells' (the
# best baseline's saturated steady tok/s over the mean output, from brc_targets.sh's saturated
# outputs, which must exist in OUT_DIR). Saturated runs are not swept: the rule acts only in a
# shallow pool, and there only in the last steps of a run.
# Usage: tools/sim/scripts/brc_fill.sh [OUT_DIR] (about two minutes)
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
PAIRED="$ROOT/tools/sim/scripts/paired.py"
POLICIES=rr,jsq,vllm-dp,mintok,br0,brc:fill_under=false,brc:fill_slack=0,brc:fill_slack=0.25,brc:fill_slack=0.5,brc,brc:fill_slack=2,brc:fill_slack=4
COLO=(--colocated --step-p 0.48 --prefill-chunk 8192)
declare -A WORKLOADS=(
  [adp-shape]=adp-shape
  [azure2023_conv]="$TRACES/azure2023_conv.csv"
  [mooncake]="$TRACES/mooncake_conversation_trace.jsonl"
)

for wl in adp-shape azure2023_conv mooncake; do
  saturated="$OUT/P-brc-T-$wl-saturated.txt"
  [ -f "$saturated" ] || { echo "missing $saturated: run scripts/brc_targets.sh $OUT first" >&2; exit 1; }
  for g in 8 16 32; do
    for pct in 60 85; do
      rate="$(rate_at "$saturated" "$g" "0.$pct")"
      echo "== P-brc-fill-$wl-G$g-poisson$pct (rate $rate)" >&2
      python3 "$PAIRED" "$SIM" 1,2,3,4,5 --json "$OUT/P-brc-fill-$wl-G$g-poisson$pct.json" -- \
        --trace "${WORKLOADS[$wl]}" --slots 256 "${COLO[@]}" --policies "$POLICIES" \
        --arrival poisson --rate "$rate" --workers "$g" > "$OUT/P-brc-fill-$wl-G$g-poisson$pct.txt"
    done
  done
done
python3 "$ROOT/tools/sim/scripts/brc_fill.py" "$OUT" | tee "$OUT/P-brc-fill-summary.txt"
