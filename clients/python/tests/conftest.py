"""Fixtures for the tests of the balanceroute package against the real binaries.

scripts/python-tests.sh installs the package into a fresh virtualenv, starts the stack
(br-snapshot, br-ingest, br-decision --policy jsq, `br-emu engine`, one br-shim per rank, and a
second stack with mutual TLS) and passes in the environment:

- BR_DECISION_ADDR, BR_SNAPSHOT_ADDR: host:port (gRPC, plaintext)
- BR_GROUP, BR_RANKS: the lockstep group and its number of ranks
- BR_BIN_DIR: the directory of the binaries (the tests start, kill -9 and freeze br-decisions
  of their own)
- BR_TLS_DIR, BR_TLS_GROUP, BR_TLS_DECISION_ADDR, BR_TLS_INGEST_ADDR: the mutual-TLS stack
  (certificates from br-certs; the tests play its worker 0 themselves)
- BR_LOG_DIR: where the tests' own processes write their logs
"""

import os
import queue
import threading
import time

import grpc
import pytest

from support import DeadPort, DecisionProcess


def env(name):
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set (run scripts/python-tests.sh)")
    return value


@pytest.fixture(scope="session")
def decision_addr():
    return env("BR_DECISION_ADDR")


@pytest.fixture(scope="session")
def snapshot_addr():
    return env("BR_SNAPSHOT_ADDR")


@pytest.fixture(scope="session")
def group():
    return env("BR_GROUP")


@pytest.fixture(scope="session")
def ranks():
    return int(env("BR_RANKS"))


@pytest.fixture
def spawn_decision():
    """Starts br-decisions of the test's own; every one is killed at the end of the test."""
    started = []

    def spawn(**kw):
        p = DecisionProcess(
            env("BR_BIN_DIR"),
            env("BR_SNAPSHOT_ADDR"),
            env("BR_GROUP"),
            log_dir=os.environ.get("BR_LOG_DIR"),
            **kw,
        )
        started.append(p)
        return p

    yield spawn
    for p in started:
        p.stop()


@pytest.fixture
def dead_port():
    p = DeadPort()
    yield p.addr
    p.close()


@pytest.fixture(scope="session")
def tls_dir():
    return env("BR_TLS_DIR")


@pytest.fixture(scope="session")
def tls_group():
    return env("BR_TLS_GROUP")


@pytest.fixture(scope="session")
def tls_decision_addr():
    return env("BR_TLS_DECISION_ADDR")


class TlsWorker:
    """Worker 0 of the TLS group on ingest's Telemetry.Report stream, with its own certificate
    (a new incarnation): Hello, then a heartbeat every 0.5 s until closed, as br-shim does."""

    def __init__(self, addr, tls_dir, group):
        from balanceroute.v1 import telemetry_pb2 as pb
        from balanceroute.v1 import telemetry_pb2_grpc as rpc

        def read(name):
            with open(os.path.join(tls_dir, name), "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem"),
            private_key=read(f"worker-{group}-0-key.pem"),
            certificate_chain=read(f"worker-{group}-0.pem"),
        )
        self.channel = grpc.secure_channel(addr, creds)
        self.outbox = queue.Queue()
        self.outbox.put(
            pb.WorkerReport(
                hello=pb.Hello(group=group, worker_id=0, incarnation=time.time_ns() | 1, capacity=8)
            )
        )
        self.acks = rpc.TelemetryStub(self.channel).Report(iter(self.outbox.get, None))
        self.error = None
        self.closed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._beat, args=(pb,), daemon=True).start()

    def _read(self):
        try:
            for _ in self.acks:
                pass
        except grpc.RpcError as e:
            if not self.closed.is_set():
                self.error = e

    def _beat(self, pb):
        seq = 1
        # Keeps the stream inside ingest's --stream-idle-timeout however long the tests take.
        while not self.closed.wait(0.5):
            self.outbox.put(pb.WorkerReport(heartbeat=pb.Heartbeat(seq=seq)))
            seq += 1

    def close(self):
        self.closed.set()
        self.outbox.put(None)
        self.acks.cancel()
        self.channel.close()


@pytest.fixture(scope="session")
def tls_worker(tls_dir, tls_group):
    w = TlsWorker(env("BR_TLS_INGEST_ADDR"), tls_dir, tls_group)
    yield w
    w.close()
