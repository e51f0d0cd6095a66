#!/usr/bin/env bash
# Moderate load: BR-0 against the best baseline at 40 / 60 / 85% of capacity on every
# public trace and both paper shapes, paired by seed (scripts/paired.py), and the saturated check
# that the fix keeps the heavy-load results. Every table of tools/sim/RESULTS.md's "Moderate load"
# section comes from here (raw outputs in results/M-*.txt).
# Usage: tools/sim/scripts/moderate.sh [OUT_DIR] [SECTION...]   (default: tools/sim/results, all)
# Sections:
#   paired     the table: 5 workloads x 3 loads, 5 seeds; br0 (defaults) and br0:stage1_level=1
#              (the previous default: Stage 1 fills to the max, the F-score alone); BR-H both ways
#   hypotheses why the previous default lost on paper-prop and sarathi: Stage 1's tie-break (by
#              load instead of by request count), its worker rule and scope, and its fill level
#              (0 = the mean .. 1 = the max), 10 seeds
#   saturated  the heavy-load check: saturated, B = 64, G = 8 and 64, steady s.gap%, 5 seeds
#   capacity   what the rates are fractions of: each workload saturated, G = 8, B = 256
#   drain      why throughput differs at all below capacity: the same run with 4x the requests
# Each moderate-load run is a few tenths of a second (G = 8, B = 256); the saturated section
# takes a few minutes. Run it under `nice` on a shared machine.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
shift || true
SECTIONS="${*:-capacity paired hypotheses saturated drain}"
PAIRED="$ROOT/tools/sim/scripts/paired.py"
mkdir -p "$OUT"
SEEDS=1,2,3,4,5
HSEEDS=1,2,3,4,5,6,7,8,9,10
BASE=random,rr,p2c,jsq,vllm-dp,mintok
PREV=br0:stage1_level=1

# workload, capacity in requests/s at G = 8, B = 256: the best baseline's saturated steady
# throughput over the mean output (section `capacity`; the paper shapes and mooncake keep the
# values of the earlier moderate-load tables, 6.4 / 7.1 / 7.8)
WORKLOADS=(
  "paper-azure 6.4"
  "paper-prop 7.1"
  "$TRACES/mooncake_conversation_trace.jsonl 7.8"
  "$TRACES/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv 26.7"
  "$TRACES/azure2023_conv.csv 101"
)

tag_of() { basename "$1" | sed 's/_conversation_trace.jsonl//; s/_sharegpt.*//; s/_conv.csv//'; }
rate_of() { awk -v c="$1" -v p="$2" 'BEGIN { printf "%.2f", c * p / 100 }'; }
pr() { # name seeds policies, then br-sim arguments
  local name="$1" seeds="$2" pols="$3"; shift 3
  echo "== $name" >&2
  python3 "$PAIRED" "$SIM" "$seeds" --json "$OUT/$name.json" -- "$@" --policies "$pols" > "$OUT/$name.txt"
}
present() { [ -e "$1" ] || [ "${1#paper-}" != "$1" ]; }

for section in $SECTIONS; do
  case "$section" in
  capacity)
    for spec in "${WORKLOADS[@]}"; do
      set -- $spec
      present "$1" || continue
      { echo "\$ br-sim --trace $1 --arrival saturated --workers 8 --slots 256 --policies $BASE"
        "$SIM" --trace "$1" --arrival saturated --workers 8 --slots 256 --policies "$BASE" 2>/dev/null
      } > "$OUT/M-capacity-$(tag_of "$1").txt"
    done ;;
  paired)
    for spec in "${WORKLOADS[@]}"; do
      set -- $spec
      present "$1" || continue
      for pct in 40 60 85; do
        pr "M-paired-$(tag_of "$1")-$pct" "$SEEDS" "$BASE,$PREV,br0,brh:stage1_level=1,brh" --trace "$1" \
           --arrival poisson --rate "$(rate_of "$2" "$pct")" --workers 8 --slots 256
      done
    done ;;
  hypotheses)
    H="$PREV,$PREV:tie_break=least-loaded,$PREV:stage1_worker=least-loaded"
    H="$H,$PREV:stage1_scope=whole-pool,br0:stage1_level=0,br0:stage1_level=0.25,br0"
    H="$H,br0:stage1_level=0.75"
    for spec in "${WORKLOADS[@]}"; do
      set -- $spec
      present "$1" || continue
      for pct in 40 60 85; do
        pr "M-hyp-$(tag_of "$1")-$pct" "$HSEEDS" "$BASE,$H" --trace "$1" \
           --arrival poisson --rate "$(rate_of "$2" "$pct")" --workers 8 --slots 256
      done
    done ;;
  saturated) # the heavy-load results must hold: s.gap% before (level 1) and after (defaults)
    for spec in "paper-azure 300" "paper-prop 500"; do
      set -- $spec
      echo "== M-saturated-$1-B64" >&2
      { echo "\$ br-sim sweep --trace $1 --arrival saturated --slots 64 --workers-list 8,64 --per-worker $2 --policies rr,jsq,mintok,$PREV,br0 --seeds $SEEDS"
        "$SIM" sweep --trace "$1" --arrival saturated --slots 64 --workers-list 8,64 \
          --per-worker "$2" --policies "rr,jsq,mintok,$PREV,br0" --seeds "$SEEDS" 2>/dev/null
      } > "$OUT/M-saturated-$1-B64.txt"
    done ;;
  drain) # throughput below capacity is the arrival rate; what is left is the finite trace's
    # final drain, so the differences shrink as the trace grows (paper-azure 60%, 10k and 40k)
    for n in 1250 5000; do
      echo "== M-drain-paper-azure-60-$n" >&2
      { echo "\$ br-sim sweep --trace paper-azure --arrival poisson --rate 3.84 --workers-list 8 --slots 256 --per-worker $n --policies rr,jsq,mintok,$PREV,br0 --seeds $SEEDS"
        "$SIM" sweep --trace paper-azure --arrival poisson --rate 3.84 --workers-list 8 \
          --slots 256 --per-worker "$n" --policies "rr,jsq,mintok,$PREV,br0" --seeds "$SEEDS" 2>/dev/null
      } > "$OUT/M-drain-paper-azure-60-$n.txt"
    done ;;
  *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
echo "results in $OUT" >&2
