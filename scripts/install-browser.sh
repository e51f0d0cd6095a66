#!/usr/bin/env bash
# Installs headless Chromium from Debian's packages, for the live page's end-to-end test
# (tests/tests/live_page.rs), which loads the page in it (--dump-dom, --screenshot).
#
# Idempotent: packages already installed are left alone (no apt-get update, nothing fetched).
# It prints what it did and the versions it ends with. `.ci/run` calls it beside
# `make deploy-tools`; `cargo test` itself never installs anything: without a browser the test
# prints SKIPPED, unless BR_REQUIRE_BROWSER=1 (CI) makes that a failure.
#
# Packages: chromium (/usr/bin/chromium), and fonts-dejavu-core so the screenshot's text has
# glyphs (Chromium's recommended fonts are not pulled in with --no-install-recommends).
set -euo pipefail

PACKAGES=(chromium fonts-dejavu-core)

log() { echo "[browser] $*"; }

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

missing=()
for p in "${PACKAGES[@]}"; do
    installed "$p" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
    log "already installed: ${PACKAGES[*]} (nothing to do)"
else
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || {
            echo "[browser] not root and no sudo: install ${missing[*]} with apt-get" >&2
            exit 1
        }
        SUDO=(sudo)
    fi
    log "installing from Debian's packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    log "installed: ${missing[*]}"
fi

for bin in chromium; do
    path="$(command -v "$bin" || true)"
    [[ -n "$path" ]] || { echo "[browser] $bin is not on PATH after installing" >&2; exit 1; }
    log "$bin: $path ($("$path" --version 2>/dev/null | head -n1))"
done
