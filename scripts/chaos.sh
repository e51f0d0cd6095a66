#!/usr/bin/env bash
# The chaos run, minutes long: the seeded e2e test tests/tests/chaos.rs (one
# br-snapshot, two br-ingest and two br-decision replicas, workers spread over the ingest
# replicas; kill -9 and restart of any service, frozen connections and SIGSTOPped processes
# under Assign load; checks no Assign lost before its deadline, no request id on two ranks, no
# reservation left to expire, σ equal to the workers' ground truth once quiet) run again and
# again with new seeds until the time is up. CI runs the test once with its default seed.
#
# Usage: scripts/chaos.sh [--minutes M] [--seed FIRST] [--faults KINDS] [--count N]
#   --minutes M     keep drawing seeds for M minutes (default 10)
#   --seed FIRST    first seed (default: from the clock); seeds go FIRST, FIRST+1, ...
#   --faults KINDS  comma-separated, default all: decision-kill, decision-freeze,
#                   snapshot-kill, snapshot-freeze, ingest-kill, shim-kill
#   --count N       faults per run (default 6)
# A failing seed is printed; rerun it alone with BR_CHAOS_SEED=<seed> (and the same
# BR_CHAOS_FAULTS / BR_CHAOS_COUNT) cargo test -p br-e2e --test chaos -- --nocapture.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=10
seed=$(date +%s)
faults="decision-kill,decision-freeze,snapshot-kill,snapshot-freeze,ingest-kill,shim-kill"
count=6
while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) minutes=$2; shift 2 ;;
        --seed) seed=$2; shift 2 ;;
        --faults) faults=$2; shift 2 ;;
        --count) count=$2; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "chaos.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
cargo test -q -p br-e2e --test chaos --no-run
end=$(( $(date +%s) + 60 * minutes ))
runs=0
while [ "$(date +%s)" -lt "$end" ]; do
    echo "==> chaos seed $seed (faults $faults, $count per run)"
    if ! BR_CHAOS_SEED=$seed BR_CHAOS_FAULTS=$faults BR_CHAOS_COUNT=$count cargo test -q -p br-e2e --test chaos -- --nocapture; then
        echo "chaos.sh: seed $seed failed after $runs passing runs" >&2
        exit 1
    fi
    runs=$((runs + 1))
    seed=$((seed + 1))
done
echo "chaos.sh: $runs seeds passed in $minutes min"
