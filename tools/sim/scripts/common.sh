# Sourced by the simulator's scripts (tools/sim/scripts/*.sh): the repository root (the working
# directory from here on), where cargo puts its binaries (TARGET), the traces (TRACES), and a
# release br-sim built from this tree (SIM).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
TRACES="${BR_SIM_TRACES:-$ROOT/data/traces}"
cd "$ROOT"
cargo build -q -p br-sim --release
SIM="$TARGET/release/br-sim"

# rate_at FILE G FRACTION: requests/s at FRACTION of capacity at G ranks, the capacity being the
# best baseline's steady tok/s in a sweep's mean table (FILE, a `br-sim sweep` output) over the
# workload's mean output (the sweep's first line). For the scripts that run Poisson cells at a
# share of a saturated sweep's capacity (brc_targets.sh, brc_fill.sh).
rate_at() { # file, G, fraction
  awk -v g="$2" -v f="$3" '
    /^workload / { for (i = 1; i <= NF; i++) if ($i == "output" && $(i + 1) == "mean") out = $(i + 2) }
    /^policy +G +imbalance +s.imbal +barrier_idle/ { mean = 1; next }
    mean && $2 == g && $1 !~ /^br/ && $10 > best { best = $10 }
    END { printf "%.4f", f * best / out }' "$1"
}
