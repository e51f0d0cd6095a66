#!/usr/bin/env bash
# A step model with a request term: T = a·max L + c·max n + b. BR-0 with and without
# the F-score's request term (request_cost_tokens = c/a) against the best baseline, saturated,
# B = 64, G = 8, 32 and 128, c = 0 (the paper's model), 0.25 and 1 ms per running request, paired
# by seed over 5 seeds; then Poisson arrivals at 60% and 85% of capacity at G = 8. The tables of tools/sim/RESULTS.md's "A step model with a request term"
# comes from here (raw output in results/S-step-c.txt).
# Usage: tools/sim/scripts/step_c.sh [OUT_DIR]   (default: tools/sim/results); run it under nice.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
mkdir -p "$OUT"
python3 "$ROOT/tools/sim/scripts/step_c.py" "$TARGET/release/br-sim" "$OUT/S-step-c.txt" \
  --seeds 1,2,3,4,5 --workloads paper-azure,paper-prop --workers 8,32,128 --c 0,0.25,1 --slots 64 --moderate 60,85
echo "results in $OUT/S-step-c.txt" >&2
