#!/usr/bin/env bash
# End-to-end tests against a real vLLM (the CPU build, data parallel), no mocks: br-all decides,
# br-shim sits beside the engine, a Python gateway assigns every request with the `balanceroute`
# client and streams it through the rank Assign chose (tests/vllm/).
#
# Installs what it needs (pinned, idempotent) into target/: vLLM's CPU build and the tiny local
# model (scripts/vllm/install.sh), and a test virtualenv with the gateway's packages and
# ./clients/python. A failure to install is a failure, not a skip.
#
# Environment: BR_PROFILE (debug | release, default debug), TESTS (pytest node ids, default
# tests/vllm; e.g. tests/vllm/test_dp_server.py::test_kill_9_of_the_dp_server_takes_both_ranks_out_until_it_returns),
# PYTEST_ARGS (e.g. -x),
# BR_VLLM_HOME (default target/vllm), PYTHON (python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROFILE="${BR_PROFILE:-debug}"
PY="${PYTHON:-python3}"
HOME_DIR="${BR_VLLM_HOME:-$ROOT/target/vllm}"
TEST_VENV="$HOME_DIR/test-venv"
LOGS="$ROOT/target/e2e-vllm"
say() { printf '\n==> %s\n' "$*"; }

say "vLLM (CPU build) and the tiny model: scripts/vllm/install.sh"
# Its last two lines name the venv's python and the model; any failure stops here, with its own
# message above, rather than as a missing path further on.
if ! install_out="$(BR_VLLM_HOME="$HOME_DIR" bash scripts/vllm/install.sh)"; then
    echo "error: scripts/vllm/install.sh failed (its message is above)" >&2
    exit 1
fi
mapfile -t installed < <(tail -n 2 <<<"$install_out")
VLLM_PY="${installed[0]}"
MODEL="${installed[1]}"

say "test virtualenv ($TEST_VENV): tests/vllm/requirements.txt and ./clients/python"
want="$(cat tests/vllm/requirements.txt clients/python/pyproject.toml clients/python/setup.py \
    $(find proto -name "*.proto" | sort) | sha256sum | cut -c1-16)"
if [ "$(cat "$TEST_VENV/.balanceroute-installed" 2>/dev/null)" != "$want" ]; then
    rm -rf "$TEST_VENV"
    "$PY" -m venv "$TEST_VENV"
    "$TEST_VENV/bin/python" -m pip install -q --disable-pip-version-check \
        -r tests/vllm/requirements.txt ./clients/python
    echo "$want" >"$TEST_VENV/.balanceroute-installed"
fi

say "building ($PROFILE): br-all br-shim brctl"
flags=()
[ "$PROFILE" = release ] && flags=(--release)
cargo build -q "${flags[@]}" --bin br-all --bin br-shim --bin brctl
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"

mkdir -p "$LOGS"
rm -f "$LOGS"/*.log
say "pytest tests/vllm (logs in $LOGS)"
# shellcheck disable=SC2086 # TESTS and PYTEST_ARGS are split on purpose
BR_BIN_DIR="$BIN" BR_LOG_DIR="$LOGS" BR_VLLM_PYTHON="$VLLM_PY" BR_VLLM_MODEL="$MODEL" \
    "$TEST_VENV/bin/python" -m pytest -q -p no:cacheprovider -rA ${PYTEST_ARGS:-} ${TESTS:-tests/vllm}
