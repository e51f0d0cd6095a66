#!/usr/bin/env bash
# Colocated prefill: every on-arrival baseline and BR-0 on adp-shape (synthetic, the shape of
# TensorRT-LLM's attention-DP balancing dataset) with each rank prefilling its own requests in
# the steps it decodes (--colocated), G = 8 and 16, B = 256, 3 seeds; saturated, and Poisson at
# 85% of capacity (the best baseline's saturated steady throughput over the mean output of
# 3,653 tokens, at each G). The decode-only runs of the same workload are the reference. The
# tables of tools/sim/RESULTS.md's "Colocated prefill" section come from here (raw outputs in
# results/P-*.txt).
#
# p = 0.48 ms per prefill token: a prefill token costs 0.51 of a decode token's share of a full
# decode step on GB200 (SGLang, DeepSeek V3: 26,156 input and 13,386 output tokens/s per GPU),
# and the twin's balanced decode step of this workload at B = 256 is 0.94 ms per running request
# (results/P-decode-saturated.txt: s.fluid of the best baseline at G = 8, 2,048 tokens per step).
# The chunk is 8,192 prompt tokens per rank per step (TensorRT-LLM's DeepSeek-R1 serving example
# with attention DP sets max_num_tokens 8192). Sensitivity: chunk 2,048, and p = 0.03 (a full
# 8,192-token chunk costing about one balanced decode step), saturated at G = 8.
# Then BR-C (prefill waves) in the same cells, with sweeps of its two hold budgets.
# Usage: tools/sim/scripts/colocated.sh [OUT_DIR [brc]]   (default: tools/sim/results; `brc`:
# only the BR-C part, reading the rate from OUT_DIR/P-colocated-saturated.txt); run it under
# nice. A few minutes on one core.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
mkdir -p "$OUT"
POLICIES=rr,jsq,vllm-dp,mintok,br0
P=0.48
CHUNK=8192
COMMON=(--trace adp-shape --slots 256 --seeds 1,2,3 --policies "$POLICIES")
COLO=(--colocated --step-p "$P" --prefill-chunk "$CHUNK")

run() { # name, then br-sim sweep arguments; colocated runs' stderr lines on the step time
  # beyond the aligned limit go at the end, one per run (seed by seed, in table order)
  local name="$1" err; shift
  echo "== $name" >&2
  err="$(mktemp)"
  { echo "\$ br-sim sweep $*"; "$SIM" sweep "$@" 2>"$err"
    if grep -q "beyond the aligned limit" "$err"; then
      echo "per run (stderr), seeds in order:"; grep "beyond the aligned limit" "$err"
    fi
  } > "$OUT/$name.txt"
  rm -f "$err"
}

# requests/s at 85% of capacity: the best baseline's steady tok/s (mean table) over 3,653
rate_85() { # file, G
  awk -v g="$2" '
    /^policy +G +imbalance +s.imbal +barrier_idle/ { mean = 1; next }
    mean && $2 == g && $1 !~ /^br/ && $10 > best { best = $10 }
    END { printf "%.4f", 0.85 * best / 3653 }' "$1"
}

if [ "${2:-}" != brc ]; then
run P-decode-saturated "${COMMON[@]}" --arrival saturated --workers-list 8,16
run P-colocated-saturated "${COMMON[@]}" "${COLO[@]}" --arrival saturated --workers-list 8,16
for g in 8 16; do
  rate="$(rate_85 "$OUT/P-colocated-saturated.txt" "$g")"
  run "P-colocated-poisson85-G$g" "${COMMON[@]}" "${COLO[@]}" --arrival poisson --rate "$rate" \
    --workers-list "$g"
  run "P-decode-poisson85-G$g" "${COMMON[@]}" --arrival poisson --rate "$rate" --workers-list "$g"
done
run P-colocated-saturated-chunk2048 "${COMMON[@]}" --colocated --step-p "$P" --prefill-chunk 2048 \
  --arrival saturated --workers-list 8
run P-colocated-saturated-p0.03 "${COMMON[@]}" --colocated --step-p 0.03 --prefill-chunk "$CHUNK" \
  --arrival saturated --workers-list 8
fi

# BR-C (prefill waves) beside the same baselines and BR-0, in the same cells (the Poisson rate
# is the one above: 85% of the best baseline's saturated capacity), with a sweep of each of its
# two hold budgets where it acts: saturated, the deep pool's max_wait_steps (0, 4, 16, 32, 64:
# the default, 128); below capacity, the shallow pool's shallow_wait_steps (0, 1, 2: the
# default, 4, 8, 64). Decode-only, BR-C only holds requests (nothing to align): one saturated
# run at G = 8 shows what that costs. The scaling figure (gain and gap share against G,
# G = 8..32) is the saturated sweep's --plot.
# Usage for this part alone: tools/sim/scripts/colocated.sh OUT_DIR brc
DEEP="brc,brc:max_wait_steps=0,brc:max_wait_steps=4,brc:max_wait_steps=16,brc:max_wait_steps=32"
DEEP="$DEEP,brc:max_wait_steps=128"
SHALLOW="brc,brc:shallow_wait_steps=0,brc:shallow_wait_steps=1,brc:shallow_wait_steps=4"
SHALLOW="$SHALLOW,brc:shallow_wait_steps=8,brc:shallow_wait_steps=64"
BRC_COMMON=(--trace adp-shape --slots 256 --seeds 1,2,3)
run P-brc-colocated-saturated "${BRC_COMMON[@]}" --policies "$POLICIES,$DEEP" "${COLO[@]}" \
  --arrival saturated --workers-list 8,16
run P-brc-colocated-scaling "${BRC_COMMON[@]}" --policies "$POLICIES,brc" "${COLO[@]}" \
  --arrival saturated --workers-list 8,16,32 --plot "$OUT/P-brc-scaling"
for g in 8 16; do
  rate="$(rate_85 "$OUT/P-colocated-saturated.txt" "$g")"
  run "P-brc-colocated-poisson85-G$g" "${BRC_COMMON[@]}" --policies "$POLICIES,$SHALLOW" \
    "${COLO[@]}" --arrival poisson --rate "$rate" --workers-list "$g"
done
run P-brc-decode-saturated --trace adp-shape --slots 256 --seeds 1,2,3 \
  --policies "$POLICIES,brc" --arrival saturated --workers-list 8
echo "results in $OUT/P-*.txt" >&2
