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

# shellcheck source=scripts/lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"
apt_install browser "${PACKAGES[@]}"

for bin in chromium; do
    path="$(command -v "$bin" || true)"
    [[ -n "$path" ]] || { echo "[browser] $bin is not on PATH after installing" >&2; exit 1; }
    log "$bin: $path ($("$path" --version 2>/dev/null | head -n1))"
done
