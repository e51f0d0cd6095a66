# apt_install TAG PACKAGE...: installs the Debian packages not yet installed, with sudo when
# not root, saying what it does under "[TAG]"; does nothing when all are there. The packages'
# services are neither started nor enabled by the callers' tests (where there is no init
# system, invoke-rc.d starts nothing anyway). The sourcing script sets `set -euo pipefail`.
apt_install() {
    local tag=$1 p
    shift
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        echo "[$tag] already installed: $* (nothing to do)"
        return 0
    fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || {
            echo "[$tag] not root and no sudo: install ${missing[*]} with apt-get" >&2
            exit 1
        }
        sudo=(sudo)
    fi
    echo "[$tag] installing from Debian's packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    echo "[$tag] installed: ${missing[*]}"
}
