#!/usr/bin/env bash
# The flake hunt (`make flake-hunt`): every test binary of the workspace, run ROUNDS times,
# PARALLEL at once (two binaries side by side load the machine as CI's `cargo test` does), each
# from its crate's directory as `cargo test` runs it. A test that fails once in a hundred runs
# passes most CI runs and fails one in a few; this loop finds such tests (for example a
# shutdown check read once per batch, a test reading a gauge before it was set, a test writer
# outrunning the watcher it checks).
#
# Knobs (environment): FLAKE_ROUNDS (10), FLAKE_PARALLEL (2), FLAKE_FILTER (a grep -E pattern
# on binary names; default every binary), FLAKE_TIMEOUT (900 s per run), FLAKE_OUT
# (target/flake-hunt). Builds first (`cargo test --no-run`). Every failing run's output is kept
# in FLAKE_OUT/fail-<binary>-r<round>.log; times.txt has one line per run. Exit 0 only if no
# run failed.
#
# Property tests draw fresh cases in every run here (CI's `make unit` fixes PROPTEST_RNG_SEED),
# unless PROPTEST_RNG_SEED is set (each property fixes its own case count, so more rounds are
# how to draw more). A failing case is printed in the run's log with its minimal input.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ROUNDS="${FLAKE_ROUNDS:-10}"
PARALLEL="${FLAKE_PARALLEL:-2}"
FILTER="${FLAKE_FILTER:-.}"
TIMEOUT="${FLAKE_TIMEOUT:-900}"
OUT="${FLAKE_OUT:-$ROOT/target/flake-hunt}"
mkdir -p "$OUT"
# absolute: each run changes into its crate's directory
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/fail-*.log "$OUT"/times.txt "$OUT"/run-*.log

echo "building the test binaries"
# One line per test binary: its path and the directory of the crate it belongs to.
if ! cargo test --workspace --locked --no-run --message-format=json > "$OUT/build.json" 2> "$OUT/build.log"; then
    tail -20 "$OUT/build.log" >&2
    exit 2
fi
python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        crate_dir = os.path.dirname(m["manifest_path"])
        print(m["executable"] + "\t" + crate_dir)
' < "$OUT/build.json" | sort -u | grep -E "$FILTER" > "$OUT/binaries.tsv" || true
total=$(wc -l < "$OUT/binaries.tsv")
if [ "$total" -eq 0 ]; then
    echo "no test binary matches FLAKE_FILTER=$FILTER" >&2
    exit 2
fi
echo "$total binaries, $ROUNDS rounds, $PARALLEL at once; output in $OUT"

run_one() { # "<binary>\t<crate dir>" round
    local bin dir name round start rc
    bin="${1%%$'\t'*}"
    dir="${1#*$'\t'}"
    round="$2"
    name="$(basename "$bin")"
    start=$(date +%s%N)
    rc=0
    (cd "$dir" && timeout "$TIMEOUT" "$bin" > "$OUT/run-$name-r$round.log" 2>&1) || rc=$?
    echo "$name r$round rc=$rc $(( ($(date +%s%N) - start) / 1000000 )) ms" >> "$OUT/times.txt"
    if [ "$rc" -eq 0 ]; then
        rm -f "$OUT/run-$name-r$round.log"
    else
        mv "$OUT/run-$name-r$round.log" "$OUT/fail-$name-r$round.log"
        echo "FAILED: $name round $round (rc $rc): $OUT/fail-$name-r$round.log"
    fi
}
export -f run_one
export OUT TIMEOUT

for round in $(seq 1 "$ROUNDS"); do
    tr '\n' '\0' < "$OUT/binaries.tsv" \
        | xargs -0 -P "$PARALLEL" -I{} bash -c 'run_one "$1" "$2"' _ {} "$round"
    echo "round $round of $ROUNDS done"
done

# find, not ls: with no failure an unmatched glob made ls (and, under pipefail, the script)
# exit 2 before the verdict
failed=$(find "$OUT" -maxdepth 1 -name 'fail-*.log' | wc -l)
echo "$(wc -l < "$OUT/times.txt") runs, $failed failed"
[ "$failed" -eq 0 ]
