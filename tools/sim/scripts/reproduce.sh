#!/usr/bin/env bash
# Reproduces every table and figure in tools/sim/RESULTS.md.
# Usage: tools/sim/scripts/reproduce.sh [OUT_DIR]   (default: tools/sim/results)
# Section C reads the public traces in data/traces (BR_SIM_TRACES names another directory).
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
mkdir -p "$OUT"
SEEDS=1,2,3,4,5
ALL=random,rr,p2c,jsq,vllm-dp,mintok,br0,br0-bypass,brh,brh-survival,brh-oracle

run() { # name, then br-sim arguments; stdout to OUT/name.txt
  local name="$1"; shift
  echo "== $name: br-sim $*" >&2
  { echo "\$ br-sim $*"; "$SIM" "$@" 2>/dev/null; } > "$OUT/$name.txt"
}

# A. G = 8, paper-shaped workloads (synthetic), mean of 5 seeds
for wl in "paper-azure saturated" "paper-azure poisson 8" "paper-azure poisson 5.5" "paper-azure poisson 4" \
          "paper-prop saturated" "paper-prop poisson 10" "paper-prop poisson 6" "paper-prop poisson 4.5"; do
  set -- $wl
  if [ "$2" = saturated ]; then arr=(--arrival saturated); tag="$1-saturated"
  else arr=(--arrival poisson --rate "$3"); tag="$1-poisson-$3"; fi
  run "A-$tag" sweep --trace "$1" --workers-list 8 --slots 256 --policies "$ALL" "${arr[@]}" \
      --seeds "$SEEDS" --json "$OUT/A-$tag.json"
done

# Figure 3: per-worker load over steps, paper-prop, G = 8, saturated (seed 42)
run "fig3-paper-prop" --trace paper-prop --workers 8 --slots 256 --policies random,jsq,br0,brh \
    --plot "$OUT/fig3-paper-prop"
run "fig3-paper-azure" --trace paper-azure --workers 8 --slots 256 --policies random,jsq,br0,brh \
    --plot "$OUT/fig3-paper-azure"

# B. Scaling with G (Figure 4): same load per worker at every G, saturated, mean of 3 seeds
for wl in paper-prop paper-azure; do
  run "B-scaling-$wl" sweep --trace "$wl" --slots 256 --policies rr,jsq,mintok,br0,brh,brh-oracle \
      --seeds 1,2,3 --plot "$OUT/fig4-$wl" --json "$OUT/B-scaling-$wl.json"
done

# C. Public traces, G = 8
if [ -d "$TRACES" ]; then
  AZ="$TRACES/azure2023_conv.csv"; MC="$TRACES/mooncake_conversation_trace.jsonl"
  SA="$TRACES/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
  run C-azure2023-saturated --trace "$AZ" --arrival saturated --policies "$ALL"
  run C-azure2023-trace --trace "$AZ" --arrival trace --policies "$ALL"
  run C-azure2023-trace-x4 --trace "$AZ" --arrival trace --rate-scale 4 --policies "$ALL"
  run C-mooncake-saturated --trace "$MC" --arrival saturated --policies "$ALL"
  run C-mooncake-trace --trace "$MC" --arrival trace --policies "$ALL"
  run C-mooncake-trace-x2 --trace "$MC" --arrival trace --rate-scale 2 --policies "$ALL"
  run C-sarathi-saturated --trace "$SA" --arrival saturated --policies "$ALL"
  run C-sarathi-poisson-20 --trace "$SA" --arrival poisson --rate 20 --policies "$ALL"
  run C-sarathi-long-saturated --trace "$SA" --arrival saturated --filter-min-output 500 --policies "$ALL"
else
  echo "skipping C: $TRACES not found" >&2
fi

# D. Parameter sweeps at G = 8 (mean of 3 seeds), heavy timed load and saturated
for wl in "paper-azure --arrival poisson --rate 8" "paper-prop --arrival poisson --rate 10" "paper-prop --arrival saturated"; do
  tag=$(echo "$wl" | tr -d '-' | tr ' ' '_')
  for p in s_greedy=0,8,16,32,64,128,256,1024 r_max=1,2,3,4,6,8 stage1_worker=most-free-slots,least-loaded,by-score \
           cold_start=score,largest-first stage1_scope=whole-pool,head-batch; do
    run "D-$tag-${p%%=*}" sweep --trace $wl --policies jsq,mintok,br0 --param "$p" --seeds 1,2,3 || true
  done
  run "D-$tag-tie_break" sweep --trace $wl --policies jsq,mintok,br0-bypass \
      --param tie_break=lowest-id,least-loaded,fewest-requests --seeds 1,2,3
  for p in beta=4,8,14.67,43,none gamma=0.5,0.64,0.86,0.95 horizon=0,10,40,80,160 gate=0.3,0.5,0.7,0.9; do
    run "D-$tag-${p%%=*}" sweep --trace $wl --policies jsq,mintok,brh --param "$p" --seeds 1,2,3
  done
done

# D'. The open choices at moderate load (paper-azure at 85% of capacity, mean of 5 seeds)
for p in stage1_worker=most-free-slots,least-loaded,by-score s_greedy=0,32,256,none; do
  run "D-moderate-paperazure_5.5-${p%%=*}" sweep --trace paper-azure --arrival poisson --rate 5.5 \
      --policies jsq,mintok,br0 --param "$p" --seeds "$SEEDS"
done
run "D-moderate-paperazure_5.5-tie_break" sweep --trace paper-azure --arrival poisson --rate 5.5 \
    --policies jsq,mintok,br0-bypass --param tie_break=least-loaded,fewest-requests --seeds "$SEEDS"

# E. Speed: all policies, 10k paper-azure, G = 8 (wall time per run on stderr)
{ echo "\$ time br-sim --trace paper-azure --workers 8 --slots 256 --policies $ALL";
  /usr/bin/env time -f "%e s wall, %M KB max RSS" "$SIM" --trace paper-azure --workers 8 --slots 256 --policies "$ALL" 2>&1 >/dev/null; } > "$OUT/E-speed.txt" 2>&1 || true
"$SIM" sweep --trace paper-azure --slots 256 --policies "$ALL" 2>&1 >/dev/null | grep "ns per" >> "$OUT/E-speed.txt" || true

# F. calibrate on the fixture
run F-calibrate calibrate tools/sim/tests/fixtures/step_samples.csv
run F-calibrate-n calibrate tools/sim/tests/fixtures/step_samples_n.csv
echo "results in $OUT" >&2
