#!/usr/bin/env bash
# Does BR-H earn its keep? BR-H with predictors learned online as the twin runs
# (ExactMatch by prompt hash, Survival by prompt-length octave; `brh`, `brh-survival`, and
# `brh:prompt_buckets=false` for Survival without buckets) against BR-H with the oracle and
# against BR-0, paired by seed (scripts/brh.py), B = 64, G = 8 and 32, above capacity and at
# 85% of it, on the workloads whose output length is predictable: the two paper shapes
# (synthetic: 30% of requests repeat a template with correlated outputs) and the mooncake
# conversation trace (prompt-heavy; 1% repeated prompts). Every table of tools/sim/RESULTS.md's
# "BR-H" section comes from here (raw outputs in results/H-*.txt). A few seconds per table.
# Usage: tools/sim/scripts/brh.sh [OUT_DIR] [SECTION...]   (default: tools/sim/results, all)
# Sections: paired (the matrix), knobs (the oracle's (beta, gamma, H) at G = 8, paper shapes),
# hints (brh-hinted with clients' expected output lengths of several errors, paper-azure G = 32
# saturated and mooncake G = 8 at 150%; not in the default set: its tables are RESULTS.md's "BR-H with clients' output-length hints"),
# stagger (hints used at placement: Stage 2's finish-stagger term, against the hint's error,
# G = 32, B = 64; not in the default set: RESULTS.md's "Hints at placement"),
# sigma (the same policies at paper-prop G = 32, B = 64, Poisson, hint errors 0..1 and shuffled:
# the inputs of the figure results/fig-hints-paper-prop-B64-G32/gap_share.svg, drawn by
# hints_fig.py), stagger256 (the stagger cells at B = 256, G = 8..128 as the wide-EP tables;
# exact, sigma 0.1 and 0.3, shuffled; BRH_G256 / BRH_WL256 / BRH_HINTS256 run a subset),
# moderate (the stagger term at 40 / 60 / 85% of capacity, G = 8, B = 256, exact and sigma-0.3
# hints, paired by seed with paired.py against the best baseline and br0; rates as
# moderate.sh's), classes (brh-class with 8 request classes of several precisions, useless
# ones included; RESULTS.md's "Request classes"). None of these is in the default set.
set -euo pipefail
# shellcheck source=tools/sim/scripts/common.sh
source "$(dirname "$0")/common.sh"
OUT="${1:-$ROOT/tools/sim/results}"
shift || true
SECTIONS="${*:-paired knobs}"
PAIRED="$ROOT/tools/sim/scripts/brh.py"
mkdir -p "$OUT"
SEEDS=1,2,3,4,5
POL=rr,jsq,mintok,br0,brh,brh-survival,brh:prompt_buckets=false,brh-oracle
MC="$TRACES/mooncake_conversation_trace.jsonl"

run() { # name, then brh.py options and br-sim arguments; stdout to OUT/name.txt
  local name="$1"; shift
  echo "== $name" >&2
  "$PAIRED" "$SIM" "$SEEDS" "$@" > "$OUT/$name.txt"
}

for section in $SECTIONS; do
  case "$section" in
  paired)
    for g in 8 32; do
      for wl in paper-azure paper-prop; do
        # above capacity: the whole (seeded, synthetic) workload waiting at t = 0
        run "H-$wl-G$g-saturated" -- --trace "$wl" --arrival saturated --workers "$g" \
            --slots 64 --policies "$POL"
        run "H-$wl-G$g-85" --capacity 85 -- --trace "$wl" --arrival poisson --workers "$g" \
            --slots 64 --policies "$POL"
      done
      # a fixed trace: seeded Poisson arrivals at 150% of capacity give the seed spread
      run "H-mooncake-G$g-150" --capacity 150 -- --trace "$MC" --arrival poisson \
          --workers "$g" --slots 64 --policies "$POL"
      run "H-mooncake-G$g-85" --capacity 85 -- --trace "$MC" --arrival poisson \
          --workers "$g" --slots 64 --policies "$POL"
    done ;;
  knobs) # can any (beta, gamma, H) make the oracle beat BR-0 on the paper shapes?
    for wl in paper-azure paper-prop; do
      pols=rr,jsq,mintok,br0,brh-oracle
      for k in beta=8 beta=14.67 beta=100 gamma=0.64 gamma=0.95 horizon=10 horizon=300 \
               horizon=1000:gamma=0.99:beta=8 gate=0.9; do
        pols="$pols,brh-oracle:$k"
      done
      run "H-knobs-$wl-G8-saturated" -- --trace "$wl" --arrival saturated --workers 8 \
          --slots 64 --policies "$pols"
    done ;;
  hints) # what a client's expected output length is worth: exact, log-normal errors of
    # sigma 0.3 and 1.0, and useless (the sigma-0.3 hints shuffled among requests, or every
    # request the mean); the baselines are there for s.gap%
    pols=rr,jsq,mintok,br0,brh-survival,brh-oracle,brh-hinted
    for h in "0:--hint-error 0" "0.3:--hint-error 0.3" "1.0:--hint-error 1.0" \
             "shuffled:--hint-mode shuffled --hint-error 0.3" "constant:--hint-mode constant"; do
      # shellcheck disable=SC2086 # the flags are words
      run "H-hints-${h%%:*}-paper-azure-G32-saturated" --renewal -- --trace paper-azure \
          --arrival saturated --workers 32 --slots 64 --policies "$pols" ${h#*:}
    done
    # and where the horizon does earn its keep (mooncake above capacity at G = 8, above)
    for h in "0:--hint-error 0" "0.3:--hint-error 0.3" "shuffled:--hint-mode shuffled --hint-error 0.3"; do
      # shellcheck disable=SC2086
      run "H-hints-${h%%:*}-mooncake-G8-150" --renewal --capacity 150 -- --trace "$MC" \
          --arrival poisson --workers 8 --slots 64 --policies "$pols" ${h#*:}
    done ;;
  stagger) # hints at placement: BR-0 and BR-H (Hinted, next-finish target) with and without
    # the finish-stagger term, hints from exact to useless, above capacity under Poisson
    # (0.77 and 0.75 requests/s per rank, the wide-EP tables' B = 64 rates) and saturated
    NF=brh-hinted:stage2_target=next-finish
    pols="rr,jsq,mintok,br0,br0:stagger_weight=1,$NF,$NF:stagger_weight=1"
    for h in "0:--hint-error 0" "0.05:--hint-error 0.05" "0.1:--hint-error 0.1" \
             "0.3:--hint-error 0.3" "shuffled:--hint-mode shuffled --hint-error 0.05"; do
      # shellcheck disable=SC2086 # the flags are words
      run "H-stagger-${h%%:*}-paper-prop-G32-poisson" --renewal -- --trace paper-prop \
          --arrival poisson --rate 24.64 --limit 16000 --workers 32 --slots 64 \
          --policies "$pols" ${h#*:}
      # shellcheck disable=SC2086
      run "H-stagger-${h%%:*}-paper-azure-G32-poisson" --renewal -- --trace paper-azure \
          --arrival poisson --rate 24 --limit 9600 --workers 32 --slots 64 \
          --policies "$pols" ${h#*:}
    done
    run "H-stagger-0-paper-prop-G32-saturated" --renewal -- --trace paper-prop \
        --arrival saturated --limit 16000 --workers 32 --slots 64 --policies "$pols" --hint-error 0
    run "H-stagger-0-paper-prop-G64-poisson" --renewal -- --trace paper-prop \
        --arrival poisson --rate 49.28 --limit 32000 --workers 64 --slots 64 \
        --policies "$pols" --hint-error 0 ;;
  sigma) # the figure: gap share against the hints' error at the section's headline cell
    NF=brh-hinted:stage2_target=next-finish
    pols="rr,jsq,mintok,br0,br0:stagger_weight=1,$NF,$NF:stagger_weight=1"
    for h in "0:--hint-error 0" "0.05:--hint-error 0.05" "0.1:--hint-error 0.1" \
             "0.2:--hint-error 0.2" "0.3:--hint-error 0.3" "0.5:--hint-error 0.5" \
             "1.0:--hint-error 1.0" \
             "shuffled:--hint-mode shuffled --hint-error 0.05"; do
      # shellcheck disable=SC2086 # the flags are words
      run "H-stagger-${h%%:*}-paper-prop-G32-poisson" --renewal -- --trace paper-prop \
          --arrival poisson --rate 24.64 --limit 16000 --workers 32 --slots 64 \
          --policies "$pols" ${h#*:}
    done
    python3 "$ROOT/tools/sim/scripts/hints_fig.py" "$OUT" paper-prop-G32-poisson \
        "$OUT/fig-hints-paper-prop-B64-G32/gap_share.svg" ;;
  stagger256) # B = 256: Poisson at 1.2x the fluid capacity per rank (1.15 req/s paper-prop,
    # 1.00 paper-azure: widep.sh gap's B = 256 rates) with its requests per rank (2,000 and
    # 1,250), so the pool grows under every policy
    NF=brh-hinted:stage2_target=next-finish
    pols="rr,jsq,mintok,br0,br0:stagger_weight=1,$NF,$NF:stagger_weight=1"
    # BRH_G256, BRH_WL256 and BRH_HINTS256 (0 0.1 0.3 shuffled) choose a subset of the cells
    for g in ${BRH_G256:-8 16 32 64 128}; do
      for spec in "paper-prop 1.15 2000" "paper-azure 1.00 1250"; do
        set -- $spec
        case " ${BRH_WL256:-$1} " in *" $1 "*) ;; *) continue ;; esac
        rate=$(awk -v c="$2" -v g="$g" 'BEGIN { printf "%.2f", c * g }')
        for h in "0:--hint-error 0" "0.1:--hint-error 0.1" "0.3:--hint-error 0.3" \
                 "shuffled:--hint-mode shuffled --hint-error 0.05"; do
          case " ${BRH_HINTS256:-${h%%:*}} " in *" ${h%%:*} "*) ;; *) continue ;; esac
          # shellcheck disable=SC2086 # the flags are words
          run "H-stagger-${h%%:*}-$1-B256-G$g-poisson" --renewal -- --trace "$1" \
              --arrival poisson --rate "$rate" --limit $(($3 * g)) --workers "$g" --slots 256 \
              --policies "$pols" ${h#*:}
        done
      done
    done ;;
  classes) # what a gateway's request class is worth to BR-H (brh-class: Survival and hints
    # learned per class): 8 classes from the output-length quantiles (sigma 0, the most a
    # class of 8 can say), blurred by noise of sigma 0.5 and 1.0, and useless (random), where
    # BR-H earns its keep (mooncake G = 8 at 150%) and at the hint tables' B = 64 cells
    pols=rr,jsq,mintok,br0,brh-survival,brh-class,brh-oracle
    for c in "q8:--classes 8" "q8-0.5:--classes 8 --class-error 0.5" \
             "q8-1.0:--classes 8 --class-error 1.0" "random8:--classes 8 --class-mode random"; do
      # shellcheck disable=SC2086 # the flags are words
      run "H-classes-${c%%:*}-mooncake-G8-150" --renewal --capacity 150 -- --trace "$MC" \
          --arrival poisson --workers 8 --slots 64 --policies "$pols" ${c#*:}
      # shellcheck disable=SC2086
      run "H-classes-${c%%:*}-paper-prop-G32-poisson" --renewal -- --trace paper-prop \
          --arrival poisson --rate 24.64 --limit 16000 --workers 32 --slots 64 \
          --policies "$pols" ${c#*:}
      # shellcheck disable=SC2086
      run "H-classes-${c%%:*}-paper-azure-G32-saturated" --renewal -- --trace paper-azure \
          --arrival saturated --workers 32 --slots 64 --policies "$pols" ${c#*:}
    done
    # the horizon's discount against what the predictor knows, where BR-H gains: does a
    # shorter effective horizon (gamma 0.6 .. 0.3, H = 20) let the better-informed predictors
    # (classes, the oracle) overtake Survival?
    pols=rr,jsq,mintok,br0
    for p in brh-survival brh-class brh-oracle; do
      pols="$pols,$p,$p:gamma=0.6,$p:gamma=0.5"
    done
    pols="$pols,brh-oracle:gamma=0.4,brh-oracle:gamma=0.3,brh-oracle:gamma=0.95,brh-oracle:horizon=20"
    run "H-classes-gamma-mooncake-G8-150" --capacity 150 -- --trace "$MC" --arrival poisson \
        --workers 8 --slots 64 --policies "$pols" --classes 8 ;;
  moderate) # below capacity: does the stagger term cost TPOT where the barrier rarely binds?
    # capacity in requests/s at G = 8, B = 256 as moderate.sh's WORKLOADS
    NF=brh-hinted:stage2_target=next-finish
    pols="random,rr,p2c,jsq,vllm-dp,mintok,br0,br0:stagger_weight=1,brh-hinted"
    pols="$pols,brh-hinted:stagger_weight=1,$NF:stagger_weight=1"
    for spec in "paper-azure 6.4" "paper-prop 7.1" "$MC 7.8" \
                "$TRACES/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv 26.7" \
                "$TRACES/azure2023_conv.csv 101"; do
      set -- $spec
      [ -e "$1" ] || [ "${1#paper-}" != "$1" ] || continue
      tag=$(basename "$1" | sed 's/_conversation_trace.jsonl//; s/_sharegpt.*//; s/_conv.csv//')
      for pct in 40 60 85; do
        rate=$(awk -v c="$2" -v p="$pct" 'BEGIN { printf "%.2f", c * p / 100 }')
        for h in "0:--hint-error 0" "0.3:--hint-error 0.3"; do
          name="H-moderate-${h%%:*}-$tag-$pct"
          echo "== $name" >&2
          # shellcheck disable=SC2086 # the flags are words
          python3 "$ROOT/tools/sim/scripts/paired.py" "$SIM" "$SEEDS" --json "$OUT/$name.json" \
              --against br0 -- --trace "$1" --arrival poisson --rate "$rate" --workers 8 \
              --slots 256 --policies "$pols" ${h#*:} > "$OUT/$name.txt"
        done
      done
    done ;;
  *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
