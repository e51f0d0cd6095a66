"""grpcio stubs generated from proto/ call the decision service, and the standard gRPC health
check (grpcio-health-checking) asks about it."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc


def test_health_check_reports_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "balanceroute.v1.Decision"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service


def test_assign_then_cancel(stubs, channel, group, ranks):
    pb, rpc = stubs["decision_pb2"], stubs["decision_pb2_grpc"]
    decision = rpc.DecisionStub(channel)
    req = pb.AssignRequest(group=group, request_id="py-assign-1", prompt_tokens=128, max_tokens=16)
    resp = decision.Assign(req, timeout=10)
    assert 0 <= resp.worker_id < ranks
    assert resp.policy == "jsq"
    assert resp.incarnation != 0
    # Idempotent: a retry with the same id gets the same answer.
    again = decision.Assign(req, timeout=10)
    assert (again.worker_id, again.incarnation) == (resp.worker_id, resp.incarnation)
    # The gateway gives up before sending it: the reservation is released.
    out = decision.Cancel(pb.CancelRequest(group=group, request_id="py-assign-1"), timeout=10)
    assert out.outcome == pb.CANCEL_OUTCOME_RELEASED


def test_invalid_request_is_invalid_argument(stubs, channel, group):
    pb, rpc = stubs["decision_pb2"], stubs["decision_pb2_grpc"]
    with pytest.raises(grpc.RpcError) as err:
        rpc.DecisionStub(channel).Assign(
            pb.AssignRequest(group=group, request_id="py-bad-1", prompt_tokens=0), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
