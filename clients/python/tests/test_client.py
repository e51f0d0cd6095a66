"""The blocking `balanceroute.Client` against the real br-decision (policy jsq, answers at once):
assign and cancel, retries that keep the request id, failover to the next address when the
first is dead or killed with -9, deadlines against a frozen replica, typed errors, mutual TLS."""

import os
import threading

import grpc
import pytest

import balanceroute
from balanceroute import CancelOutcome, Client, ClientOptions, TLSConfig
from support import LosingProxy, rid, same_answer, unread_bytes, wait_until


def test_assign_then_cancel(decision_addr, group, ranks):
    with Client(decision_addr) as c:
        r = rid("happy")
        a = c.assign(group, r, 128, max_tokens=16, prompt_hash=2**64 - 1, timeout=10)
        assert 0 <= a.worker_id < ranks
        assert a.policy == "jsq"
        assert a.incarnation != 0
        assert a.attempts == 1
        assert a.replica == decision_addr
        # The shims announce their own URL: the endpoint the gateway sends the decode to.
        assert a.endpoint.startswith("http://127.0.0.1:"), a.endpoint
        # Assign is idempotent by request id: asking again gets the original answer.
        assert same_answer(c.assign(group, r, 128, max_tokens=16, timeout=10), a)
        assert c.cancel(group, r) == CancelOutcome.RELEASED
        # Cancel is idempotent too.
        assert c.cancel(group, r) == CancelOutcome.NOT_FOUND


def test_no_addresses_reads_the_variable_and_otherwise_is_br_all(
    decision_addr, group, monkeypatch
):
    monkeypatch.setenv(balanceroute.ADDRESS_ENV, f"http://{decision_addr}")
    with Client() as c:
        assert c.replicas() == [(decision_addr, False)]
        r = rid("env")
        assert c.assign(group, r, 32, timeout=10).replica == decision_addr
        assert c.cancel(group, r) == CancelOutcome.RELEASED
    # Without the variable: br-all's default port (not dialled here; nothing is called).
    monkeypatch.delenv(balanceroute.ADDRESS_ENV)
    with Client() as c:
        assert c.replicas() == [(balanceroute.DEFAULT_ADDRESS, False)]


def test_a_lost_answer_is_retried_with_the_same_id_and_gets_the_original(decision_addr, group):
    proxy = LosingProxy(decision_addr)
    try:
        with Client(proxy.addr) as c:
            r = rid("lost")
            a = c.assign(group, r, 64, timeout=10)
        # The server answered the first attempt, the client never heard it, retried with the
        # same id and was given that first answer (not a second placement).
        assert proxy.lost.is_set()
        assert proxy.connections == 2
        assert a.attempts == 2
        with Client(decision_addr) as direct:
            assert same_answer(direct.assign(group, r, 64, timeout=10), a)
            assert direct.cancel(group, r) == CancelOutcome.RELEASED
    finally:
        proxy.close()


def test_failover_past_a_port_nobody_listens_on(dead_port, decision_addr, group):
    with Client([dead_port, decision_addr]) as c:
        a = c.assign(group, rid("deadport"), 64, timeout=10)
        assert (a.replica, a.attempts) == (decision_addr, 2)
        # The dead address is skipped for a while: the next call goes straight to the live one.
        assert c.replicas() == [(dead_port, True), (decision_addr, False)]
        r = rid("deadport-2")
        b = c.assign(group, r, 64, timeout=10)
        assert (b.replica, b.attempts) == (decision_addr, 1)
        # Cancel goes to every replica; the dead one's failure does not hide the live answer.
        assert c.cancel(group, r) == CancelOutcome.RELEASED


def test_failover_when_the_first_replica_is_killed(spawn_decision, decision_addr, group):
    first = spawn_decision()
    with Client([first.addr, decision_addr]) as c:
        r = rid("kill9")
        a = c.assign(group, r, 96, timeout=10)
        assert a.replica == first.addr
        first.kill9()
        # The same id again: the killed replica fails, the next one answers with the placement
        # the first one made (the snapshot service's Reserve keeps one placement per id).
        b = c.assign(group, r, 96, timeout=20)
        assert b.replica == decision_addr
        assert b.attempts >= 2
        assert (b.worker_id, b.incarnation) == (a.worker_id, a.incarnation)
        n = c.assign(group, rid("kill9-next"), 96, timeout=10)
        assert (n.replica, n.attempts) == (decision_addr, 1)
        assert c.cancel(group, r) in (CancelOutcome.RELEASED, CancelOutcome.NOT_FOUND)


def test_failover_when_the_replica_is_killed_in_the_middle_of_a_call(
    spawn_decision, decision_addr, group
):
    first = spawn_decision()
    opts = ClientOptions(keepalive_interval=30, keepalive_timeout=30)
    with Client([first.addr, decision_addr], options=opts) as c:
        c.assign(group, rid("midcall-warm"), 16, timeout=10)  # the connection is up
        first.freeze()
        port = int(first.addr.rsplit(":", 1)[1])
        # Bytes already queued (a window update, a ping) are not the call.
        queued = unread_bytes(port)
        r = rid("midcall")
        out = {}

        def call():
            try:
                out["a"] = c.assign(group, r, 16, timeout=30)
            except Exception as e:  # noqa: BLE001 - reported below
                out["e"] = e

        t = threading.Thread(target=call)
        t.start()
        wait_until(
            lambda: unread_bytes(port) > queued, 10, "the Assign to reach the frozen replica"
        )
        # Killed with the call unread: its kernel resets the connection, the call fails over.
        first.kill9()
        t.join(timeout=40)
        assert not t.is_alive(), "assign did not return"
        assert "e" not in out, out.get("e")
        a = out["a"]
        assert (a.replica, a.attempts) == (decision_addr, 2)
        assert c.cancel(group, r) == CancelOutcome.RELEASED


# Keepalives far apart, so that only the deadline can end a call to a frozen replica.
SLOW_PINGS = ClientOptions(keepalive_interval=30, keepalive_timeout=30)


def test_deadline_exceeded_on_a_frozen_replica(spawn_decision, group):
    frozen = spawn_decision()
    with Client(frozen.addr, options=SLOW_PINGS) as c:
        c.assign(group, rid("frozen-warm"), 32, timeout=10)  # the connection is up
        frozen.freeze()
        with pytest.raises(balanceroute.DeadlineExceeded) as err:
            c.assign(group, rid("frozen"), 32, timeout=1.0)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.value.attempts == 1
        assert not err.value.retryable


def test_an_attempt_timeout_moves_on_to_the_next_replica(spawn_decision, decision_addr, group):
    frozen = spawn_decision()
    opts = ClientOptions(attempt_timeout=0.5, keepalive_interval=30, keepalive_timeout=30)
    with Client([frozen.addr, decision_addr], options=opts) as c:
        c.assign(group, rid("attempt-warm"), 32, timeout=10)
        frozen.freeze()
        a = c.assign(group, rid("attempt"), 32, timeout=10)
        assert (a.replica, a.attempts) == (decision_addr, 2)


def test_bad_input_is_invalid_argument_and_not_retried(decision_addr, group):
    with Client(decision_addr) as c:
        with pytest.raises(balanceroute.InvalidArgument) as err:
            c.assign(group, rid("zero"), 0, timeout=10)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.attempts == 1
        assert "prompt_tokens" in err.value.message
        # A retry that changes prompt_tokens is not a retry: refused, and the first stands.
        r = rid("conflict")
        a = c.assign(group, r, 50, timeout=10)
        with pytest.raises(balanceroute.InvalidArgument) as err:
            c.assign(group, r, 51, timeout=10)
        assert "prompt_tokens" in err.value.message
        assert same_answer(c.assign(group, r, 50, timeout=10), a)
        c.cancel(group, r)
        # What cannot be encoded is refused before any call.
        with pytest.raises(balanceroute.InvalidArgument) as err:
            c.assign(group, rid("neg"), -1, timeout=10)
        assert err.value.attempts == 0
        with pytest.raises(balanceroute.InvalidArgument):
            c.assign("", rid("nogroup"), 10, timeout=10)


def fnv1a_64(key: str) -> int:
    """The class id the contract defines (Reservation.request_class_id), written out here."""
    h = 0xCBF29CE484222325
    for b in key.encode():
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def test_output_length_hints_reach_sigma(decision_addr, group, snapshot_addr):
    from balanceroute.v1 import snapshot_pb2, snapshot_pb2_grpc

    with Client(decision_addr) as c, grpc.insecure_channel(snapshot_addr) as ch:
        snap = snapshot_pb2_grpc.SnapshotStub(ch)

        def held(r):
            s = snap.Get(snapshot_pb2.GetRequest(group=group), timeout=10)
            return next(q for q in s.requests if q.request_id == r)

        hinted, plain = rid("hints"), rid("no-hints")
        c.assign(
            group,
            hinted,
            128,
            max_tokens=512,
            timeout=10,
            expected_output_tokens=300,
            request_class="chat/tools",
        )
        c.assign(group, plain, 128, timeout=10)
        q = held(hinted)
        assert q.HasField("expected_output_tokens") and q.expected_output_tokens == 300
        assert q.HasField("request_class_id") and q.request_class_id == fnv1a_64("chat/tools")
        q = held(plain)
        assert not q.HasField("expected_output_tokens")
        assert not q.HasField("request_class_id")
        for r in (hinted, plain):
            assert c.cancel(group, r) == CancelOutcome.RELEASED


@pytest.mark.parametrize(
    "hints, says",
    [
        ({"expected_output_tokens": 0}, "expected_output_tokens is 0"),
        ({"expected_output_tokens": 17, "max_tokens": 16}, "above max_tokens 16"),
        ({"request_class": ""}, "request_class must not be empty"),
        ({"request_class": "c" * 65}, "request_class is 65 bytes long"),
        ({"request_class": "tenant 7"}, "request_class contains ' '"),
        ({"request_class": "thinking-\u00e9"}, "request_class contains"),
    ],
)
def test_bad_hints_are_invalid_argument(decision_addr, group, hints, says):
    with Client(decision_addr) as c:
        with pytest.raises(balanceroute.InvalidArgument) as err:
            c.assign(group, rid("bad-hint"), 10, timeout=10, **hints)
        assert err.value.attempts == 1
        assert says in err.value.message, err.value.message


def test_unknown_group_is_not_found(decision_addr):
    with Client(decision_addr) as c:
        with pytest.raises(balanceroute.NotFound) as err:
            c.assign("no-such-group", rid("nf"), 10, timeout=10)
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_nothing_reachable_is_unavailable_within_the_deadline(dead_port):
    with Client(dead_port) as c:
        with pytest.raises(balanceroute.Unavailable) as err:
            c.assign("g", rid("none"), 10, timeout=0.5)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert err.value.retryable
        # Retried with backoff until the deadline, not once and not in a tight loop.
        assert 2 <= err.value.attempts < 64, err.value.attempts


def test_bad_addresses_are_refused_at_construction():
    for bad in ("", "127.0.0.1", "http://x:port", "localhost:99999"):
        with pytest.raises(ValueError):
            Client(bad)
    with pytest.raises(ValueError):
        Client("https://127.0.0.1:1")  # https without TLSConfig


def tls(tls_dir, role=None):
    if role is None:
        return TLSConfig(ca=os.path.join(tls_dir, "ca.pem"))
    return TLSConfig(
        ca=os.path.join(tls_dir, "ca.pem"),
        cert=os.path.join(tls_dir, f"{role}.pem"),
        key=os.path.join(tls_dir, f"{role}-key.pem"),
    )


def test_mutual_tls_with_the_gateway_certificate(tls_dir, tls_group, tls_decision_addr, tls_worker):
    with Client(f"https://{tls_decision_addr}", tls=tls(tls_dir, "gateway")) as c:
        r = rid("tls")
        # Until the worker's Hello reaches σ the service answers UNAVAILABLE; the client retries.
        a = c.assign(tls_group, r, 128, timeout=30)
        assert tls_worker.error is None, tls_worker.error
        assert a.worker_id == 0
        assert c.cancel(tls_group, r) == CancelOutcome.RELEASED


def test_mutual_tls_refuses_other_roles_and_no_certificate(tls_dir, tls_group, tls_decision_addr):
    # A worker's certificate is authenticated but may not call Assign.
    with Client(tls_decision_addr, tls=tls(tls_dir, f"worker-{tls_group}-0")) as c:
        with pytest.raises(balanceroute.PermissionDenied) as err:
            c.assign(tls_group, rid("tls-worker"), 10, timeout=10)
        assert err.value.attempts == 1
        with pytest.raises(balanceroute.PermissionDenied):
            c.cancel(tls_group, "x")
    # Without a client certificate the handshake fails: nothing is called.
    with Client(tls_decision_addr, tls=tls(tls_dir)) as c:
        with pytest.raises(balanceroute.Unavailable):
            c.assign(tls_group, rid("tls-anon"), 10, timeout=1.0)
