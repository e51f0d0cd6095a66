#!/usr/bin/env bash
# Development certificates for a mutual-TLS deployment: a CA (ca.pem), one certificate per role
# (ingest, snapshot, decision, gateway, admin, all: <role>.pem + <role>-key.pem), one per worker
# (worker-<group>-<id>.pem + key) and, with --worker-range FIRST-LAST, one for a shim serving
# ranks FIRST..LAST (worker-<group>-FIRST-LAST.pem + key, its id br/worker/<group>/FIRST-LAST),
# each with its SPIFFE id as a URI SAN.
#
#   scripts/dev-certs.sh OUT_DIR GROUP WORKERS [--trust-domain TD] [--keep-ca] [--worker-range FIRST-LAST]...
#
# Built from the project's own tool (br-certs, on rcgen): no openssl needed. Running it again
# with --keep-ca rotates every leaf certificate in place (atomically), which running services
# pick up without a restart.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "usage: $0 OUT_DIR GROUP WORKERS [--trust-domain TD] [--keep-ca] [--worker-range FIRST-LAST]..." >&2
  exit 2
fi
exec cargo run --quiet --release --locked -p br-certs -- "$@"
