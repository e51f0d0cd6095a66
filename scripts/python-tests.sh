#!/usr/bin/env bash
# Tests with real third-party clients: Python's `openai` package streams through
# br-shim to `br-emu engine`, and grpcio stubs generated from proto/ call Decision.Assign and the
# standard gRPC health check; and grpcio with client certificates calls a second stack of
# br-snapshot, br-ingest and br-decision started with mutual TLS (certificates from br-certs). Creates a venv under target/py-venv with the pinned packages of
# tests/python/requirements.txt, builds the binaries, starts the stack on free loopback ports,
# runs pytest and stops everything it started. Then the `balanceroute` package is
# installed from clients/python into a virtualenv made afresh (target/py-client-venv) and its
# tests run against the same stacks (they start, kill -9 and freeze br-decisions of their own),
# and the PD proxy example (examples/pd-proxy) runs in front of a prefill engine and the stack's
# ranks with the `openai` package as its client.
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
rm -rf "$OUT_LOGS"/*.log "$OUT_LOGS"/br-decision-* "$OUT_LOGS"/pd-decision-*

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
cargo build -q "${flags[@]}" --bin br-snapshot --bin br-ingest --bin br-decision --bin br-shim --bin br-emu \
    --bin br-certs
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE"

G=2 B=4 STEP_A=0.0002 STEP_B=20 SCALE=0.05 GROUP=pytest
start_stack
start_shims "$B"
start_decision jsq

# The mutual-TLS stack (tests/python/test_grpc_mtls.py): its own certificates, ports and group;
# the test plays the worker itself on ingest's Telemetry stream with worker-<group>-0.pem.
TLS_DIR="$ROOT/target/py-tests/certs"
TLS_GROUP=pytls
say "mutual-TLS stack: certificates in $TLS_DIR (br-certs), br-snapshot, br-ingest, br-decision"
"$BIN/br-certs" "$TLS_DIR" "$TLS_GROUP" 1 >"$OUT_LOGS/certs.log" 2>&1
tls_flags() { # tls_flags ROLE
    echo --tls-cert "$TLS_DIR/$1.pem" --tls-key "$TLS_DIR/$1-key.pem" --tls-ca "$TLS_DIR/ca.pem"
}
wait_https() { # wait_https URL WHAT: like wait_http, verifying the server with ca.pem
    for _ in $(seq 1 600); do
        if curl -fsS --cacert "$TLS_DIR/ca.pem" -o /dev/null "$1" 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "timed out waiting for $2 ($1)" >&2
    return 1
}
free_ports 2 TLS_SNAP
free_ports 2 TLS_INGEST
free_ports 2 TLS_DECISION
# shellcheck disable=SC2046 # tls_flags is word-split on purpose (no spaces in the paths)
start tls-snapshot "$BIN/br-snapshot" --listen "127.0.0.1:$TLS_SNAP" \
    --admin-listen "127.0.0.1:$((TLS_SNAP + 1))" --reservation-ttl 60s $(tls_flags snapshot)
# shellcheck disable=SC2046
start tls-ingest "$BIN/br-ingest" --listen "127.0.0.1:$TLS_INGEST" \
    --admin-listen "127.0.0.1:$((TLS_INGEST + 1))" --snapshot-addr "http://127.0.0.1:$TLS_SNAP" \
    $(tls_flags ingest)
wait_https "https://127.0.0.1:$((TLS_SNAP + 1))/livez" "br-snapshot (TLS)"
wait_https "https://127.0.0.1:$((TLS_INGEST + 1))/readyz" "br-ingest (TLS)"
# shellcheck disable=SC2046
start tls-decision "$BIN/br-decision" --listen "127.0.0.1:$TLS_DECISION" \
    --admin-listen "127.0.0.1:$((TLS_DECISION + 1))" --snapshot-addr "http://127.0.0.1:$TLS_SNAP" \
    --groups "$TLS_GROUP" --policy jsq --max-wait 600s $(tls_flags decision)
# live, not ready: it is ready once it can place, after the test's worker says Hello
wait_https "https://127.0.0.1:$((TLS_DECISION + 1))/livez" "br-decision (TLS)"

say "pytest tests/python"
BR_SHIM_URL="http://127.0.0.1:$SHIMS" \
BR_SHIM_ADMIN_URL="http://127.0.0.1:$((SHIMS + 1))" \
BR_DECISION_ADDR="127.0.0.1:$DECISION" \
BR_GROUP="$GROUP" BR_RANKS="$G" BR_PROTO_DIR="$ROOT/proto" \
BR_TLS_DIR="$TLS_DIR" BR_TLS_GROUP="$TLS_GROUP" \
BR_TLS_DECISION_ADDR="127.0.0.1:$TLS_DECISION" BR_TLS_SNAPSHOT_ADDR="127.0.0.1:$TLS_SNAP" \
BR_TLS_INGEST_ADDR="127.0.0.1:$TLS_INGEST" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/python

# The balanceroute package (clients/python) from a virtualenv made afresh every run,
# as a user gets it: `pip install ./clients/python` builds it, generating its stubs from proto/.
CLIENT_VENV="$ROOT/target/py-client-venv"
say "fresh virtualenv ($CLIENT_VENV): pip install ./clients/python"
rm -rf "$CLIENT_VENV"
"$PY" -m venv "$CLIENT_VENV"
"$CLIENT_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -r clients/python/requirements-test.txt ./clients/python \
    -r examples/pd-proxy/requirements.txt -r examples/pd-proxy/requirements-test.txt

say "pytest clients/python/tests"
BR_DECISION_ADDR="127.0.0.1:$DECISION" BR_SNAPSHOT_ADDR="127.0.0.1:$SNAP" \
BR_GROUP="$GROUP" BR_RANKS="$G" BR_BIN_DIR="$BIN" BR_LOG_DIR="$OUT_LOGS" \
BR_TLS_DIR="$TLS_DIR" BR_TLS_GROUP="$TLS_GROUP" \
BR_TLS_DECISION_ADDR="127.0.0.1:$TLS_DECISION" BR_TLS_INGEST_ADDR="127.0.0.1:$TLS_INGEST" \
    "$CLIENT_VENV/bin/python" -m pytest -q -p no:cacheprovider clients/python/tests

# The PD proxy example (examples/pd-proxy): a second `br-emu engine` is the prefill engine,
# behind a br-shim that reports nowhere (it only counts what it forwards); the stack's ranks
# decode; the proxy runs from the fresh virtualenv.
free_ports 2 PREFILL
free_ports 2 PREFILL_SHIM
free_ports 1 PD_PROXY
say "PD proxy :$PD_PROXY: prefill br-emu engine :$PREFILL behind br-shim :$PREFILL_SHIM, decode on the $G ranks"
start prefill-engine "$BIN/br-emu" engine --ranks 1 --slots 16 --step-a "$STEP_A" --step-b "$STEP_B" \
    --time-scale "$SCALE" --base-port "$PREFILL" --dp-port "$((PREFILL + 1))"
wait_http "http://127.0.0.1:$PREFILL/health" "prefill br-emu engine"
start prefill-shim "$BIN/br-shim" --listen "127.0.0.1:$PREFILL_SHIM" \
    --admin-listen "127.0.0.1:$((PREFILL_SHIM + 1))" --upstream "http://127.0.0.1:$PREFILL" \
    --ingest-addr "" --group pytest-prefill
wait_http "http://127.0.0.1:$((PREFILL_SHIM + 1))/readyz" "prefill br-shim"
start pd-proxy "$CLIENT_VENV/bin/python" examples/pd-proxy/pd_proxy.py --listen "127.0.0.1:$PD_PROXY" \
    --prefill "http://127.0.0.1:$PREFILL_SHIM" --decision "127.0.0.1:$DECISION" --group "$GROUP"
wait_http "http://127.0.0.1:$PD_PROXY/health" "PD proxy"
SHIM_ADMIN_URLS=""
for ((g = 0; g < G; g++)); do
    SHIM_ADMIN_URLS="$SHIM_ADMIN_URLS${SHIM_ADMIN_URLS:+,}http://127.0.0.1:$((SHIMS + 2 * g + 1))"
done

say "pytest examples/pd-proxy/tests"
BR_PD_PROXY_URL="http://127.0.0.1:$PD_PROXY" BR_SHIM_ADMIN_URLS="$SHIM_ADMIN_URLS" \
BR_PREFILL_URL="http://127.0.0.1:$PREFILL_SHIM" BR_PREFILL_ADMIN_URL="http://127.0.0.1:$((PREFILL_SHIM + 1))" \
BR_BIN_DIR="$BIN" BR_LOG_DIR="$OUT_LOGS" \
BR_DECISION_ADMIN_URL="http://127.0.0.1:$((DECISION + 1))" BR_SNAPSHOT_ADDR="127.0.0.1:$SNAP" \
BR_GROUP="$GROUP" \
    "$CLIENT_VENV/bin/python" -m pytest -q -p no:cacheprovider examples/pd-proxy/tests
