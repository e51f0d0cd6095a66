#!/usr/bin/env bash
# The renewal model's test (tools/sim/RESULTS.md, "A model of what is left"): it
# predicts BR-0's steady max − mean as E[out]·(H_G − 1) tokens, so scaling every output length
# by k should scale it by k (the baselines' excess grows far less). One workload, paper-azure's
# shape (prompts uniform 700..8,000; outputs 55% exactly 1,024, the rest uniform 1,001..1,500,
# like `paper-azure`'s filter), outputs × k for k in 0.25..4; G = 64, B = 64, Poisson arrivals
# at 1.2× the fluid capacity (48/s at k = 1, 48/k otherwise), 5 seeds. Writes
# OUT/R-renewal-xK-B64-poisson-G64.txt (the traces go to target/renewal-traces/); prints
# scripts/renewal.py's table. About 4 minutes on 2 cores; BR_SIM_NF=0 leaves out BR-H with the
# next-finish target (online and oracle) and takes 1.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
TRACES="$TARGET/renewal-traces"  # generated again on every run: not kept in the tree
mkdir -p "$TRACES"
POLICIES="rr,jsq,mintok,br0"
if [ "${BR_SIM_NF:-1}" = 1 ]; then
    POLICIES="$POLICIES,brh-survival:stage2_target=next-finish,brh-oracle:stage2_target=next-finish"
fi
for k in 0.25 0.5 1 2 4; do
    name="x$(echo "$k" | tr -d .)"
    trace="$TRACES/$name.csv"
    python3 - "$k" "$trace" <<'EOF'
import random, sys
k, path = float(sys.argv[1]), sys.argv[2]
rnd = random.Random(7)  # the same prompts and length draws for every k
with open(path, "w") as f:
    f.write("prompt_tokens,output_tokens\n")
    for _ in range(64 * 300):
        p = rnd.randint(700, 8000)
        o = 1024 if rnd.random() < 0.55 else rnd.randint(1001, 1500)
        f.write(f"{p},{max(1, round(o * k))}\n")
EOF
    rate=$(python3 -c "print(48 / $k)")
    args=(sweep --trace "$trace" --arrival poisson --rate "$rate" --slots 64 --workers-list 64
          --policies "$POLICIES" --seeds 1,2,3,4,5)
    { echo "\$ br-sim ${args[*]/#$TARGET/target}"; "$SIM" "${args[@]}" 2>/dev/null; } \
        > "$OUT/R-renewal-$name-B64-poisson-G64.txt"
done
python3 "$ROOT/tools/sim/scripts/renewal.py" --markdown "$OUT" R-renewal
