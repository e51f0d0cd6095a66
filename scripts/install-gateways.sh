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

# shellcheck source=scripts/lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"
apt_install gateways "${PACKAGES[@]}"

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
