#!/usr/bin/env bash
# Installs nginx with its Lua module and HAProxy from Debian's packages, for the Lua gateways'
# end-to-end tests (tests/tests/gateways_openresty.rs, tests/tests/gateways_haproxy.rs), which
# start them as real processes in front of br-all, br-shim and br-emu.
#
# Idempotent: packages already installed are left alone (no apt-get update, nothing fetched).
# It prints what it did and the versions it ends with. `.ci/run` calls it beside
# `make browser`; `cargo test` itself never installs anything: without nginx or haproxy the
# tests print SKIPPED, unless BR_REQUIRE_GATEWAYS=1 (CI) makes that a failure.
#
# Packages (Debian 12): nginx with libnginx-mod-http-lua (lua-nginx-module, which OpenResty,
# Kong and APISIX build on), lua-resty-core (which that module requires at start), lua-cjson
# (the JSON codec OpenResty ships), and haproxy (2.6, Lua and core.httpclient built in).
# The installed services are neither started nor enabled here: the tests run their own
# processes as the current user with configurations in a temporary directory.
set -euo pipefail

PACKAGES=(nginx libnginx-mod-http-lua lua-resty-core lua-cjson haproxy)

log() { echo "[gateways] $*"; }

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
            echo "[gateways] not root and no sudo: install ${missing[*]} with apt-get" >&2
            exit 1
        }
        SUDO=(sudo)
    fi
    log "installing from Debian's packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d would be the usual way to keep the packages' services from starting; where
    # there is no init system (containers) invoke-rc.d starts nothing anyway.
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    log "installed: ${missing[*]}"
fi

for bin in nginx haproxy; do
    path="$(command -v "$bin" || true)"
    [[ -n "$path" ]] || { echo "[gateways] $bin is not on PATH after installing" >&2; exit 1; }
done
log "nginx: $(command -v nginx) ($(nginx -v 2>&1 | head -n1))"
log "haproxy: $(command -v haproxy) ($(haproxy -v 2>/dev/null | head -n1))"
for module in ndk_http_module.so ngx_http_lua_module.so; do
    [[ -f /usr/lib/nginx/modules/$module ]] || {
        echo "[gateways] /usr/lib/nginx/modules/$module is missing after installing" >&2
        exit 1
    }
done
log "nginx Lua module: /usr/lib/nginx/modules/ngx_http_lua_module.so ($(dpkg-query -W -f='${Version}' libnginx-mod-http-lua))"
