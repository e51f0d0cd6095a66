#!/usr/bin/env bash
# Routing at wide-EP scale: BR-0's share of the best baseline's gap to the fluid
# limit against G = 8..128, and what moves it. Every table of tools/sim/RESULTS.md's "Wide-EP
# scale" section comes from here (raw outputs in results/W-*.txt).
# Usage: tools/sim/scripts/widep.sh [OUT_DIR] [SECTION...]   (default: tools/sim/results, all)
# Sections: scale (the G sweeps), knobs (what moves the share at G = 128), moderate (40/60/85%
# of capacity, seed spread), paired (the same, paired by seed with paired.py), lag, gap (the
# 90% target: saturated and Poisson at 1.2x the fluid capacity, G = 8..128, B = 64 and
# 256, BR-0 against the previous default; the figures' CSV), nextfinish (BR-H with Stage 2's
# mean fill measured at each rank's next predicted finish, B = 64, G = 8..128), turns (two
# deciders admitting in turn, G = 64, B = 64).
# Sized for a shared 2-core machine: 300 requests per rank (paper-azure) and 500 (paper-prop)
# keep several hundred steady steps at every G; 5 seeds; run it under `nice`.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
shift || true
SECTIONS="${*:-scale knobs moderate paired lag gap}"
mkdir -p "$OUT"
SEEDS=1,2,3,4,5
BASE=rr,jsq,mintok
# the paper's Stage 2 (the R_max oldest, filled to the max), each of the two changes alone, and
# the defaults (br0: the tick's head, filled to the mean); s_greedy=0 is Stage 1 alone (the
# oldest S_tot placed largest-first on the best-scoring rank)
PAPER=stage2_window=oldest:stage2_fill=max
BR="br0:$PAPER,br0:$PAPER:s_greedy=0,br0:stage2_fill=max,br0:stage2_window=oldest,br0"

run() { # name, then br-sim arguments; stdout to OUT/name.txt
  local name="$1"; shift
  echo "== $name: br-sim $*" >&2
  { echo "\$ br-sim $*"; "$SIM" "$@" 2>/dev/null; } > "$OUT/$name.txt"
}

# requests per rank: enough for several hundred steady steps (B = 64) and several B (256)
per_rank() { # workload B
  case "$1-$2" in
    paper-azure-64) echo 300 ;; paper-prop-64) echo 500 ;;
    paper-azure-256) echo 1250 ;; paper-prop-256) echo 1000 ;;
  esac
}

for section in $SECTIONS; do
  case "$section" in
  scale) # the scale table: saturated, steady state, G = 8..128, B = 64 and 256
    for wl in paper-azure paper-prop; do
      # BR-H (ExactMatch, learned online) where it is affordable to simulate
      run "W-scale-$wl-B64" sweep --trace "$wl" --arrival saturated --slots 64 \
          --workers-list 8,16,32,64,128 --per-worker "$(per_rank "$wl" 64)" \
          --policies "$BASE,$BR,brh" --seeds "$SEEDS"
      run "W-scale-$wl-B256" sweep --trace "$wl" --arrival saturated --slots 256 \
          --workers-list 8,16,32,64,128 --per-worker "$(per_rank "$wl" 256)" \
          --policies "$BASE,$BR" --seeds "$SEEDS"
    done ;;
  knobs) # what moves the share at G = 128, B = 64, paper-azure and paper-prop
    # (a G sweep of one G, so the workload is sized per rank; policies carry their parameter)
    for wl in paper-azure paper-prop; do
      for v in oldest:max tick-head:mean; do
        win=${v%%:*} fill=${v##*:}
        pols="$BASE"
        for p in r_max=1 r_max=2 r_max=4 r_max=8 s_greedy=0 s_greedy=2048 \
                 stage2_lookahead=3 stage2_lookahead=7 stage2_lookahead=15 stage2_lookahead=63; do
          pols="$pols,br0:stage2_window=$win:stage2_fill=$fill:$p"
        done
        run "W-knobs-$wl-G128-$win-$fill" sweep --trace "$wl" --arrival saturated --slots 64 \
            --workers-list 128 --per-worker "$(per_rank "$wl" 64)" --policies "$pols" --seeds "$SEEDS"
      done
    done ;;
  moderate) # 40 / 60 / 85 % of capacity: TPOT and throughput beside imbalance, G = 8 and 64
    # capacity = the best baseline's steady throughput / mean output (RESULTS.md, "Moderate load")
    for spec in "paper-azure 6.4" "paper-prop 7.1"; do
      set -- $spec
      for pct in 40 60 85; do
        rate=$(awk -v c="$2" -v p="$pct" 'BEGIN { printf "%.2f", c * p / 100 }')
        run "W-moderate-$1-$pct" sweep --trace "$1" --arrival poisson --rate "$rate" \
            --workers-list 8 --slots 256 --policies "$BASE,$BR,brh" --seeds "$SEEDS"
      done
    done
    MC="$TRACES/mooncake_conversation_trace.jsonl"
    # mooncake conversation: capacity 7.8 req/s at G = 8, B = 256 (mintok's saturated steady
    # 2,685 tok/s over a mean output of 343; results/C-mooncake-saturated.txt)
    if [ -f "$MC" ]; then
      for spec in "40 3.1" "60 4.7" "85 6.6"; do
        set -- $spec
        run "W-moderate-mooncake-$1" sweep --trace "$MC" --arrival poisson --rate "$2" \
            --workers-list 8 --slots 256 --policies "$BASE,$BR,brh" --seeds "$SEEDS"
      done
    fi ;;
  paired) # moderate load, paired by seed: TPOT p50/p95, throughput, imbalance, barrier idle
    PAIRED="$ROOT/tools/sim/scripts/paired.py"
    pr() { local name="$1"; shift; echo "== $name" >&2; python3 "$PAIRED" "$SIM" "$SEEDS" -- "$@" > "$OUT/$name.txt"; }
    for spec in "paper-azure 6.4" "paper-prop 7.1" "$TRACES/mooncake_conversation_trace.jsonl 7.8"; do
      set -- $spec
      [ -e "$1" ] || [ "${1#paper-}" != "$1" ] || continue
      tag=$(basename "$1" | sed 's/_conversation_trace.jsonl//')
      for pct in 40 60 85; do
        rate=$(awk -v c="$2" -v p="$pct" 'BEGIN { printf "%.2f", c * p / 100 }')
        pr "W-paired-$tag-$pct" --trace "$1" --arrival poisson --rate "$rate" --workers 8 --slots 256 \
            --policies "$BASE,br0,brh"
      done
    done ;;
  lag) # the deployed control plane: 2 steps of telemetry lag, 2 deciders, G = 64, B = 64
    for wl in paper-azure paper-prop; do
      for cp in "--telemetry-lag-steps 2" "--deciders 2"; do
        tag=$(echo "$cp" | tr -d '-' | tr ' ' '_')
        run "W-lag-$wl-$tag" sweep --trace "$wl" --arrival saturated --slots 64 \
            --workers-list 64 --per-worker "$(per_rank "$wl" 64)" --policies "$BASE,$BR" \
            --seeds "$SEEDS" $cp
      done
    done ;;
  gap) # the 90% target. Poisson at 1.2x the fluid capacity (the most any router could serve:
    # s.fluid / mean output of the saturated runs, about 0.62 req/s per rank at B = 64 and 0.83
    # (paper-azure) / 0.93 (paper-prop) at B = 256), so the pool grows under every policy;
    # `br0:stage1_shallow=false:stage2_hold=never` is the previous default (Stage 2 even when
    # the pool holds no more requests than the free slots; no slot left empty). Figures:
    # fig-gap-WORKLOAD-BN[-poisson]/scaling.svg, the gain, the imbalance and the gap share
    # against G of each sweep; W-gap.csv has every row (tools/sim/RESULTS.md tabulates it).
    PREVGAP=br0:stage1_shallow=false:stage2_hold=never
    for B in 64 256; do
      for spec in "paper-azure 0.75 1.00" "paper-prop 0.77 1.15"; do
        set -- $spec
        [ "$B" = 64 ] && coef=$2 || coef=$3
        run "W-gap-$1-B$B-saturated" sweep --trace "$1" --arrival saturated --slots "$B" \
            --workers-list 8,16,32,64,128 --per-worker "$(per_rank "$1" "$B")" \
            --policies "$BASE,$PREVGAP,br0" --seeds "$SEEDS" --plot "$OUT/fig-gap-$1-B$B"
        # paper-prop at B = 256: its requests live ~270 s, so 256 slots per rank take most of
        # 1,000 arrivals per rank to fill; 2,000 leave a long steady stretch after the ramp
        n=$(per_rank "$1" "$B")
        [ "$1-$B" = paper-prop-256 ] && n=2000
        # the same offered load per rank at every G: coef·G requests per second
        run "W-gap-$1-B$B-poisson" sweep --trace "$1" --arrival poisson --rate-per-worker "$coef" \
            --slots "$B" --workers-list 8,16,32,64,128 --per-worker "$n" \
            --policies "$BASE,$PREVGAP,br0" --seeds "$SEEDS" --plot "$OUT/fig-gap-$1-B$B-poisson"
      done
    done
    python3 "$ROOT/tools/sim/scripts/gap_table.py" "$OUT" > "$OUT/W-gap.csv"
    # the moderate-load results must hold: 60 and 85% of capacity, G = 8, B = 256, paired
    for spec in "paper-prop 7.1" "paper-azure 6.4" \
                "$TRACES/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv 26.7"; do
      set -- $spec
      [ -e "$1" ] || [ "${1#paper-}" != "$1" ] || continue
      tag=$(basename "$1" | sed 's/_sharegpt.*//')
      for pct in 60 85; do
        rate=$(awk -v c="$2" -v p="$pct" 'BEGIN { printf "%.2f", c * p / 100 }')
        echo "== W-gap-moderate-$tag-$pct" >&2
        python3 "$ROOT/tools/sim/scripts/paired.py" "$SIM" "$SEEDS" -- --trace "$1" \
            --arrival poisson --rate "$rate" --workers 8 --slots 256 \
            --policies "random,rr,p2c,jsq,vllm-dp,mintok,$PREVGAP,br0" > "$OUT/W-gap-moderate-$tag-$pct.txt"
      done
    done ;;
  nextfinish) # BR-H with Stage 2's mean fill measured at each rank's next predicted finish
    # (stage2_target = next-finish), online (ExactMatch) and with the oracle, against BR-0 and
    # BR-H as they are, B = 64, saturated and Poisson at 1.2x the fluid capacity as in `gap`
    NF=stage2_target=next-finish
    POLS="$BASE,br0,brh,brh:$NF,brh-oracle,brh-oracle:$NF"
    for spec in "paper-azure 0.75" "paper-prop 0.77"; do
      set -- $spec
      run "W-nf-$1-B64-saturated" sweep --trace "$1" --arrival saturated --slots 64 \
          --workers-list 8,16,32,64,128 --per-worker "$(per_rank "$1" 64)" \
          --policies "$POLS" --seeds "$SEEDS" --plot "$OUT/fig-nf-$1-B64"
      run "W-nf-$1-B64-poisson" sweep --trace "$1" --arrival poisson --rate-per-worker "$2" \
          --slots 64 --workers-list 8,16,32,64,128 --per-worker "$(per_rank "$1" 64)" \
          --policies "$POLS" --seeds "$SEEDS" --plot "$OUT/fig-nf-$1-B64-poisson"
    done
    # where BR-H earns its keep today (prompt-heavy, short outputs, 150% of capacity; the
    # H-mooncake tables of scripts/brh.sh), and moderate load (60%, G = 8, B = 256), paired
    MC="$TRACES/mooncake_conversation_trace.jsonl"
    if [ -f "$MC" ]; then
      for g in 8 32; do
        echo "== W-nf-mooncake-G$g-150" >&2
        python3 "$ROOT/tools/sim/scripts/brh.py" "$SIM" "$SEEDS" --capacity 150 -- --trace "$MC" \
            --arrival poisson --workers "$g" --slots 64 \
            --policies "$BASE,br0,brh,brh-survival,brh:$NF,brh-survival:$NF,brh-oracle:$NF" \
            > "$OUT/W-nf-mooncake-G$g-150.txt"
      done
    fi
    for spec in "paper-azure 3.84" "paper-prop 4.26"; do
      set -- $spec
      echo "== W-nf-moderate-$1-60" >&2
      python3 "$ROOT/tools/sim/scripts/paired.py" "$SIM" "$SEEDS" -- --trace "$1" --arrival poisson \
          --rate "$2" --workers 8 --slots 256 --policies "$BASE,br0,brh,brh:$NF" \
          > "$OUT/W-nf-moderate-$1-60.txt"
    done ;;
  turns) # two deciders admitting in turn against two active-active ones, G = 64, B = 64
    OUTF="$OUT/W-gap-deciders-turns-B64-G64.txt"
    : > "$OUTF"
    for spec in "paper-prop --deciders 2" "paper-prop --deciders 2 --decider-turns" \
                "paper-azure --deciders 2 --decider-turns"; do
      set -- $spec
      wl=$1; shift
      echo "== $wl $*" >&2
      { echo "\$ br-sim sweep --trace $wl --arrival saturated --slots 64 --workers-list 64 --per-worker $(per_rank "$wl" 64) --policies $BASE,br0 $* --seeds $SEEDS"
        "$SIM" sweep --trace "$wl" --arrival saturated --slots 64 --workers-list 64 \
            --per-worker "$(per_rank "$wl" 64)" --policies "$BASE,br0" "$@" --seeds "$SEEDS" 2>/dev/null
        echo; } >> "$OUTF"
    done ;;
  *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
echo "results in $OUT" >&2
