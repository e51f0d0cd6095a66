# Sourced by the simulator's scripts (tools/sim/scripts/*.sh): the repository root (the working
# directory from here on), where cargo puts its binaries (TARGET), the traces (TRACES), and a
# release br-sim built from this tree (SIM).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
TRACES="${BR_SIM_TRACES:-$ROOT/data/traces}"
cd "$ROOT"
cargo build -q -p br-sim --release
SIM="$TARGET/release/br-sim"
