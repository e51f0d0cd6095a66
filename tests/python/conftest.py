"""Fixtures for the tests that drive a running BalanceRoute stack with third-party clients.

scripts/python-tests.sh starts the stack (br-snapshot, br-ingest, br-decision --policy jsq,
`br-emu engine` and one br-shim per rank) and passes its addresses in the environment:

- BR_SHIM_URL: rank 0's shim (OpenAI-compatible base URL, without /v1)
- BR_SHIM_ADMIN_URL: that shim's admin port (/metrics)
- BR_DECISION_ADDR: the decision service, host:port (gRPC)
- BR_GROUP, BR_RANKS: the lockstep group and its number of ranks
- BR_PROTO_DIR: the proto/ directory to generate the gRPC stubs from
"""

import os
import sys
import tempfile

import pytest


def _env(name):
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set (run scripts/python-tests.sh)")
    return value


@pytest.fixture(scope="session")
def shim_url():
    return _env("BR_SHIM_URL")


@pytest.fixture(scope="session")
def shim_admin_url():
    return _env("BR_SHIM_ADMIN_URL")


@pytest.fixture(scope="session")
def decision_addr():
    return _env("BR_DECISION_ADDR")


@pytest.fixture(scope="session")
def group():
    return _env("BR_GROUP")


@pytest.fixture(scope="session")
def ranks():
    return int(_env("BR_RANKS"))


@pytest.fixture(scope="session")
def stubs():
    """Python modules generated from proto/ with grpcio-tools, as the docs tell users to."""
    import importlib

    from grpc_tools import protoc

    proto_dir = _env("BR_PROTO_DIR")
    out = tempfile.mkdtemp(prefix="br-stubs-")
    files = sorted(
        os.path.join("balanceroute", "v1", f)
        for f in os.listdir(os.path.join(proto_dir, "balanceroute", "v1"))
        if f.endswith(".proto")
    )
    import grpc_tools

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    code = protoc.main(
        ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}",
         f"--python_out={out}", f"--grpc_python_out={out}", *files]
    )
    assert code == 0, f"protoc failed ({code}) on {files}"
    sys.path.insert(0, out)
    return {
        f"{name}_{kind}": importlib.import_module(f"balanceroute.v1.{name}_{kind}")
        for name in ("decision", "snapshot", "telemetry")
        for kind in ("pb2", "pb2_grpc")
    }


@pytest.fixture(scope="session")
def channel(decision_addr):
    import grpc

    ch = grpc.insecure_channel(decision_addr)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()
