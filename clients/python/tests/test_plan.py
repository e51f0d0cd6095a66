"""The retry and failover rules (`_core.assign_plan`, `_core.cancel_plan`) without a network:
the plans are driven by hand with made-up outcomes and a fake clock, so every rule is checked
exactly, including the ones the end-to-end tests can only provoke by chance."""

import grpc
import pytest

from balanceroute import _core, errors
from balanceroute._core import (
    Call,
    CallAll,
    CancelOutcome,
    ClientOptions,
    Outcome,
    Replica,
    Replicas,
    RetryPolicy,
    Selection,
    Sleep,
)

C = grpc.StatusCode


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Resp:
    """An AssignResponse / CancelResponse stand-in."""

    def __init__(self, worker_id=1, outcome=0):
        self.worker_id = worker_id
        self.endpoint = f"http://rank{worker_id}"
        self.incarnation = 7
        self.policy = "jsq"
        self.pool_wait_us = 1500
        self.sigma_version = 9
        self.stale = False
        self.outcome = outcome


def replicas(n, selection=Selection.ORDERED):
    return Replicas([Replica(f"r{i}", None, None) for i in range(n)], selection)


def drive(plan, answer, clock):
    """Runs a plan: `answer(step)` gives the outcome of each Call; a Sleep advances the clock.
    Returns (result or exception, the steps taken)."""
    steps, sent = [], None
    while True:
        try:
            step = plan.send(sent)
        except StopIteration as done:
            return done.value, steps
        except errors.BalanceRouteError as e:
            return e, steps
        steps.append(step)
        if isinstance(step, Sleep):
            clock.t += step.seconds
            sent = None
        else:
            sent = answer(step)


def fail(code, details=""):
    return Outcome(code=code, details=details)


def test_unavailable_moves_to_the_next_replica_at_once_and_keeps_the_call():
    clock, rs = Clock(), replicas(3)
    plan = _core.assign_plan(rs, ClientOptions(), RetryPolicy(), clock() + 10, clock)
    answers = {
        "r0": fail(C.UNAVAILABLE, "connection refused"),
        "r1": fail(C.FAILED_PRECONDITION, "standby"),
        "r2": Outcome(response=Resp(4)),
    }
    a, steps = drive(plan, lambda s: answers[s.replica.addr], clock)
    assert [s.replica.addr for s in steps] == ["r0", "r1", "r2"]  # no sleep in between
    assert (a.worker_id, a.attempts, a.replica, a.pool_wait) == (4, 3, "r2", 0.0015)
    # The failed ones are skipped by the next call.
    b, steps = drive(
        _core.assign_plan(rs, ClientOptions(), RetryPolicy(), clock() + 10, clock),
        lambda s: Outcome(response=Resp(5)),
        clock,
    )
    assert [s.replica.addr for s in steps] == ["r2"] and b.attempts == 1


@pytest.mark.parametrize(
    "code,cls",
    [
        (C.INVALID_ARGUMENT, errors.InvalidArgument),
        (C.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (C.NOT_FOUND, errors.NotFound),
        (C.PERMISSION_DENIED, errors.PermissionDenied),
        (C.UNAUTHENTICATED, errors.Unauthenticated),
        (C.INTERNAL, errors.Internal),
        (C.CANCELLED, errors.Cancelled),
        (C.ABORTED, errors.BalanceRouteError),
    ],
)
def test_final_errors_are_not_retried_and_are_typed(code, cls):
    clock = Clock()
    plan = _core.assign_plan(replicas(2), ClientOptions(), RetryPolicy(), clock() + 10, clock)
    e, steps = drive(plan, lambda s: fail(code, "no"), clock)
    assert type(e) is cls and e.code == code and e.message == "no" and e.attempts == 1
    assert len(steps) == 1


def test_every_replica_down_backs_off_with_equal_jitter_until_the_deadline():
    clock = Clock()
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.08)
    plan = _core.assign_plan(replicas(2), ClientOptions(), retry, clock() + 2, clock)
    e, steps = drive(plan, lambda s: fail(C.UNAVAILABLE, "down"), clock)
    assert isinstance(e, errors.Unavailable) and e.retryable
    sleeps = [s.seconds for s in steps if isinstance(s, Sleep)]
    ceilings = [min(0.01 * 2**i, 0.08) for i in range(len(sleeps))]
    assert all(c / 2 <= s <= c for s, c in zip(sleeps, ceilings)), (sleeps, ceilings)
    # Two calls per round (both replicas), then a pause; never a pause past the deadline.
    calls = [s for s in steps if isinstance(s, Call)]
    assert len(calls) == e.attempts == 2 * (len(sleeps) + 1)
    assert clock() <= 1000 + 2


def test_by_default_retries_run_until_the_deadline_not_a_count():
    # A restart of the decision service: refused, then "no σ yet", for more calls than any
    # fixed default would allow, all well within the deadline: the call is answered.
    clock = Clock()
    retry = RetryPolicy(initial_backoff=0.001, max_backoff=0.001)
    plan = _core.assign_plan(replicas(1), ClientOptions(), retry, clock() + 10, clock)
    calls = []

    def answer(step):
        calls.append(step)
        return Outcome(response=Resp(2)) if len(calls) > 200 else fail(C.UNAVAILABLE, "down")

    a, steps = drive(plan, answer, clock)
    assert isinstance(a, _core.Assignment) and a.attempts == 201 and a.worker_id == 2


def test_a_restart_is_ridden_out_with_the_default_policy():
    # br-all killed and started again: 5.1 s without an answer, then answers; a call with a
    # 10 s deadline made as it died is answered, with pauses of at most max_backoff.
    clock = Clock()
    start = clock()
    plan = _core.assign_plan(replicas(1), ClientOptions(), RetryPolicy(), start + 10, clock)

    def answer(step):
        if clock() - start < 5.1:
            return fail(C.UNAVAILABLE, "connection refused")
        return Outcome(response=Resp(1))

    a, steps = drive(plan, answer, clock)
    assert isinstance(a, _core.Assignment), a
    sleeps = [s.seconds for s in steps if isinstance(s, Sleep)]
    assert max(sleeps) <= RetryPolicy().max_backoff
    # Answered within one longest pause of the service's return.
    assert clock() - start <= 5.1 + RetryPolicy().max_backoff


def test_max_attempts_bounds_the_calls():
    clock = Clock()
    plan = _core.assign_plan(
        replicas(1), ClientOptions(), RetryPolicy(max_attempts=3), clock() + 100, clock
    )
    e, steps = drive(plan, lambda s: fail(C.UNAVAILABLE, "down"), clock)
    assert isinstance(e, errors.Unavailable) and e.attempts == 3


def test_deadline_exceeded_at_the_callers_deadline_is_final():
    clock = Clock()
    plan = _core.assign_plan(replicas(2), ClientOptions(), RetryPolicy(), clock() + 5, clock)

    def answer(step):
        assert step.timeout == 5  # the whole remaining time: a pooled Assign may wait
        clock.t += step.timeout
        return fail(C.DEADLINE_EXCEEDED, "Deadline Exceeded")

    e, steps = drive(plan, answer, clock)
    assert isinstance(e, errors.DeadlineExceeded) and len(steps) == 1


def test_an_attempt_timeout_is_retried_on_the_next_replica():
    clock = Clock()
    plan = _core.assign_plan(
        replicas(2), ClientOptions(attempt_timeout=0.5), RetryPolicy(), clock() + 5, clock
    )

    def answer(step):
        assert step.timeout == 0.5
        if step.replica.addr == "r0":
            clock.t += 0.5
            return fail(C.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return Outcome(response=Resp(2))

    a, steps = drive(plan, answer, clock)
    assert (a.replica, a.attempts) == ("r1", 2)


def test_cancelled_at_the_timeout_is_a_timeout_but_early_is_a_cancel():
    clock = Clock()
    plan = _core.assign_plan(
        replicas(2), ClientOptions(attempt_timeout=1.0), RetryPolicy(), clock() + 5, clock
    )

    def late(step):
        if step.replica.addr == "r0":
            clock.t += 1.0
            return fail(C.CANCELLED, "")
        return Outcome(response=Resp())

    a, _ = drive(plan, late, clock)
    assert a.replica == "r1"
    plan = _core.assign_plan(
        replicas(2), ClientOptions(attempt_timeout=1.0), RetryPolicy(), clock() + 5, clock
    )
    e, _ = drive(plan, lambda s: fail(C.CANCELLED, "cancelled"), clock)
    assert isinstance(e, errors.Cancelled)


def test_broken_connections_are_retried_but_a_servers_internal_is_not():
    assert _core.retryable(C.UNKNOWN, "Stream removed")
    assert _core.retryable(C.INTERNAL, "Socket closed")
    assert not _core.retryable(C.INTERNAL, "reservation refused: worker full")
    assert not _core.retryable(C.DEADLINE_EXCEEDED, "")


def test_ejection_doubles_from_250ms_to_5s_and_a_probe_is_let_through_when_due():
    r = Replica("r", None, None)
    t = 0.0
    for want in (0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0):
        r.failed(t)
        assert r.down_until() == pytest.approx(t + want)
    assert not r.try_take(t + 4.9)
    assert r.try_take(t + 5.0)  # the probe
    assert not r.try_take(t + 5.0)  # the others keep skipping it
    r.succeeded()
    assert r.try_take(t + 5.0) and not r.is_down(t + 5.0)


def test_round_robin_starts_each_call_at_the_next_replica():
    rs = replicas(3, Selection.ROUND_ROBIN)
    firsts = [rs.list[rs.pick([False] * 3, 0.0)].addr for _ in range(4)]
    assert firsts == ["r0", "r1", "r2", "r0"]


def test_cancel_reports_the_strongest_outcome_and_errors_only_when_nobody_answered():
    clock = Clock()
    rs = replicas(3)
    plan = _core.cancel_plan(rs, RetryPolicy(), clock() + 2, clock)
    rounds = []

    def answer(step):
        assert isinstance(step, CallAll)
        rounds.append([r.addr for r in step.replicas])
        if len(rounds) == 1:
            return [
                Outcome(response=Resp(outcome=2)),
                fail(C.UNAVAILABLE, "x"),
                Outcome(response=Resp(outcome=3)),
            ]
        return [Outcome(response=Resp(outcome=1))]

    out, _ = drive(plan, lambda s: answer(s), clock)
    assert rounds == [["r0", "r1", "r2"], ["r1"]]  # only the failed one again
    assert out == CancelOutcome.WITHDRAWN
    plan = _core.cancel_plan(replicas(2), RetryPolicy(), clock() + 2, clock)
    e, _ = drive(
        plan, lambda s: [fail(C.PERMISSION_DENIED, "role gateway needed")] * len(s.replicas), clock
    )
    assert isinstance(e, errors.PermissionDenied)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True, "3", None])
def test_values_that_cannot_be_encoded_are_refused_before_any_call(bad):
    with pytest.raises(errors.InvalidArgument) as err:
        _core.validate("g", "r", bad, None, None)
    assert err.value.attempts == 0


@pytest.mark.parametrize(
    "hints",
    [
        {"expected_output_tokens": -1},
        {"expected_output_tokens": 2**32},
        {"expected_output_tokens": "300"},
        {"expected_output_tokens": True},
        {"request_class": 7},
        {"request_class": b"chat"},
    ],
)
def test_hints_that_cannot_be_encoded_are_refused_before_any_call(hints):
    with pytest.raises(errors.InvalidArgument) as err:
        _core.validate("g", "r", 10, None, None, **hints)
    assert err.value.attempts == 0


def test_hints_the_server_judges_pass_the_client():
    # ranges and the class key's characters are the server's to check (one rule, one place)
    _core.validate("g", "r", 10, None, 5, expected_output_tokens=0, request_class="")
    _core.validate("g", "r", 10, None, 5, expected_output_tokens=9, request_class="a b")


def test_addresses():
    assert _core.parse_address("http://127.0.0.1:50063/", False) == "127.0.0.1:50063"
    assert _core.parse_address("https://decision.svc:443", True) == "decision.svc:443"
    assert _core.parse_address("[::1]:50063", False) == "[::1]:50063"
    assert _core.split_addresses("a:1, b:2,a:1") == ["a:1", "b:2"]
    for bad in ("", "host", "host:0", "host:x", "http://h:1/path"):
        with pytest.raises(ValueError):
            _core.parse_address(bad, False)


def test_no_addresses_means_the_variable_else_br_all(monkeypatch):
    monkeypatch.delenv(_core.ADDRESS_ENV, raising=False)
    assert _core.default_addresses() == [_core.DEFAULT_ADDRESS] == ["127.0.0.1:50060"]
    monkeypatch.setenv(_core.ADDRESS_ENV, "  ")
    assert _core.default_addresses() == ["127.0.0.1:50060"]
    # As deploy/split.env and the Rust binaries spell it: URLs whose scheme does not choose TLS.
    monkeypatch.setenv(_core.ADDRESS_ENV, "http://127.0.0.1:50063, https://b:2,c:3")
    assert _core.default_addresses() == ["127.0.0.1:50063", "b:2", "c:3"]
    for a in _core.default_addresses():
        _core.parse_address(a, False)
        _core.parse_address(a, True)
