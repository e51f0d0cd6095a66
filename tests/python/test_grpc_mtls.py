"""grpcio over mutual TLS with client certificates written by br-certs: a stack of
br-snapshot, br-ingest and br-decision started with --tls-cert/--tls-key/--tls-ca by
scripts/python-tests.sh. Environment (the tests skip without it):

- BR_TLS_DIR: the certificates (ca.pem, <role>.pem/<role>-key.pem, worker-<group>-<id>.pem)
- BR_TLS_DECISION_ADDR, BR_TLS_SNAPSHOT_ADDR, BR_TLS_INGEST_ADDR: host:port (gRPC over TLS)
- BR_TLS_GROUP: the group the worker certificates are for

The servers are verified with ca.pem like any TLS server (their certificates carry DNS
`localhost` and IP 127.0.0.1 SANs); BalanceRoute authorises each method by the caller's SPIFFE
role.
"""

import os
import queue
import threading
import time

import grpc
import pytest


def _env(name):
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set (run scripts/python-tests.sh)")
    return value


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def tls_dir():
    return _env("BR_TLS_DIR")


@pytest.fixture(scope="module")
def tls_group():
    return _env("BR_TLS_GROUP")


def _channel(addr, tls_dir, name=None):
    """A grpcio channel to addr verifying the server with ca.pem, presenting NAME.pem if given."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(os.path.join(tls_dir, "ca.pem")),
        private_key=_read(os.path.join(tls_dir, f"{name}-key.pem")) if name else None,
        certificate_chain=_read(os.path.join(tls_dir, f"{name}.pem")) if name else None,
    )
    return grpc.secure_channel(addr, creds)


class Worker:
    """Worker 0 of the group on ingest's Telemetry.Report stream, with its own certificate:
    Hello, then heartbeats until closed (as br-shim does)."""

    def __init__(self, stubs, addr, tls_dir, group):
        pb, rpc = stubs["telemetry_pb2"], stubs["telemetry_pb2_grpc"]
        self.channel = _channel(addr, tls_dir, f"worker-{group}-0")
        self.outbox = queue.Queue()
        self.outbox.put(pb.WorkerReport(hello=pb.Hello(
            group=group, worker_id=0, incarnation=int(time.time()) | 1, capacity=8)))
        self.acks = rpc.TelemetryStub(self.channel).Report(iter(self.outbox.get, None))
        self.error = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.pb = pb

    def _read(self):
        try:
            for _ in self.acks:
                pass
        except grpc.RpcError as e:
            self.error = e

    def close(self):
        self.outbox.put(None)
        self.acks.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def worker(stubs, tls_dir, tls_group):
    w = Worker(stubs, _env("BR_TLS_INGEST_ADDR"), tls_dir, tls_group)
    yield w
    w.close()


def test_gateway_certificate_assigns(stubs, tls_dir, tls_group, worker):
    pb, rpc = stubs["decision_pb2"], stubs["decision_pb2_grpc"]
    with _channel(_env("BR_TLS_DECISION_ADDR"), tls_dir, "gateway") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        decision = rpc.DecisionStub(ch)
        req = pb.AssignRequest(group=tls_group, request_id="py-tls-1", prompt_tokens=128,
                               max_tokens=16)
        # Bounded wait for the worker's Hello to reach σ (ingest → snapshot → decision); until
        # then the decision service answers UNAVAILABLE or waits in its pool.
        deadline = time.monotonic() + 30
        while True:
            try:
                resp = decision.Assign(req, timeout=10)
                break
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.PERMISSION_DENIED, e
                assert e.code() != grpc.StatusCode.UNAUTHENTICATED, e
                if time.monotonic() > deadline:
                    raise AssertionError(f"no answer within 30 s; last: {e.code()} {e.details()}")
                time.sleep(0.2)
        assert worker.error is None, worker.error
        assert resp.worker_id == 0
        assert resp.incarnation != 0
        out = decision.Cancel(pb.CancelRequest(group=tls_group, request_id="py-tls-1"),
                              timeout=10)
        assert out.outcome == pb.CANCEL_OUTCOME_RELEASED


def test_gateway_certificate_may_not_apply(stubs, tls_dir, tls_group):
    pb, rpc = stubs["snapshot_pb2"], stubs["snapshot_pb2_grpc"]
    with _channel(_env("BR_TLS_SNAPSHOT_ADDR"), tls_dir, "gateway") as ch:
        acks = rpc.SnapshotStub(ch).Apply(
            iter([pb.ChangeBatch(batch_seq=1, group=tls_group)]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(acks)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value


def test_no_client_certificate_fails(stubs, tls_dir, tls_group):
    pb, rpc = stubs["decision_pb2"], stubs["decision_pb2_grpc"]
    with _channel(_env("BR_TLS_DECISION_ADDR"), tls_dir) as ch:
        with pytest.raises(grpc.RpcError) as err:
            rpc.DecisionStub(ch).Assign(
                pb.AssignRequest(group=tls_group, request_id="py-tls-anon", prompt_tokens=128),
                timeout=10)
    # The server requires a client certificate: the handshake fails, nothing is called.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
