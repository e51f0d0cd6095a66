#!/usr/bin/env bash
# Tests with real third-party clients (issue 5): Python's `openai` package streams through
# br-shim to `br-emu engine`, and grpcio stubs generated from proto/ call Decision.Assign and the
# standard gRPC health check. Creates a venv under target/py-venv with the pinned packages of
# tests/python/requirements.txt, builds the binaries, starts the stack on free loopback ports,
# runs pytest and stops everything it started.
#
# Environment: BR_PROFILE (debug | release, default debug), PYTHON (python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROFILE="${BR_PROFILE:-debug}"
PY="${PYTHON:-python3}"
VENV="$ROOT/target/py-venv"
OUT_LOGS="$ROOT/target/py-tests"
mkdir -p "$OUT_LOGS"
rm -f "$OUT_LOGS"/*.log

# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

say "python venv ($VENV) with tests/python/requirements.txt"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt

say "building ($PROFILE): br-snapshot br-ingest br-decision br-shim br-emu"
flags=()
[ "$PROFILE" = release ] && flags=(--release)
cargo build -q "${flags[@]}" --bin br-snapshot --bin br-ingest --bin br-decision --bin br-shim --bin br-emu
BIN="$ROOT/target/$PROFILE"

G=2 B=4 STEP_A=0.0002 STEP_B=20 SCALE=0.05 GROUP=pytest
start_stack
start_shims "$B"
start_decision jsq

say "pytest tests/python"
BR_SHIM_URL="http://127.0.0.1:$SHIMS" \
BR_SHIM_ADMIN_URL="http://127.0.0.1:$((SHIMS + 1))" \
BR_DECISION_ADDR="127.0.0.1:$DECISION" \
BR_GROUP="$GROUP" BR_RANKS="$G" BR_PROTO_DIR="$ROOT/proto" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/python
