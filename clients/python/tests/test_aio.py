"""`balanceroute.AsyncClient` on asyncio against the real br-decision: the same behaviours as
the blocking client (it shares their rules), exercised through grpc.aio."""

import asyncio
import os

import grpc
import pytest

import balanceroute
from balanceroute import AsyncClient, CancelOutcome, ClientOptions, TLSConfig
from support import LosingProxy, rid, same_answer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_assign_then_cancel(decision_addr, group, ranks):
    async def main():
        async with AsyncClient(decision_addr) as c:
            r = rid("aio-happy")
            a = await c.assign(group, r, 128, max_tokens=16, timeout=10)
            assert 0 <= a.worker_id < ranks and a.policy == "jsq" and a.attempts == 1
            assert same_answer(await c.assign(group, r, 128, max_tokens=16, timeout=10), a)
            assert await c.cancel(group, r) == CancelOutcome.RELEASED
            assert await c.cancel(group, r) == CancelOutcome.NOT_FOUND

    run(main())


def test_no_addresses_reads_the_variable_and_otherwise_is_br_all(
    decision_addr, group, monkeypatch
):
    monkeypatch.setenv(balanceroute.ADDRESS_ENV, decision_addr)

    async def main():
        async with AsyncClient() as c:
            r = rid("aio-env")
            assert (await c.assign(group, r, 32, timeout=10)).replica == decision_addr
            assert await c.cancel(group, r) == CancelOutcome.RELEASED

    run(main())
    monkeypatch.delenv(balanceroute.ADDRESS_ENV)
    assert AsyncClient().replicas() == [(balanceroute.DEFAULT_ADDRESS, False)]


def test_many_concurrent_assigns_share_the_client(decision_addr, group):
    async def main():
        async with AsyncClient(decision_addr) as c:
            ids = [rid(f"aio-many-{i}") for i in range(20)]
            answers = await asyncio.gather(*(c.assign(group, r, 16, timeout=10) for r in ids))
            assert all(a.attempts == 1 for a in answers)
            outcomes = await asyncio.gather(*(c.cancel(group, r) for r in ids))
            assert outcomes == [CancelOutcome.RELEASED] * len(ids)

    run(main())


def test_a_lost_answer_is_retried_with_the_same_id(decision_addr, group):
    proxy = LosingProxy(decision_addr)

    async def main():
        r = rid("aio-lost")
        async with AsyncClient(proxy.addr) as c:
            a = await c.assign(group, r, 64, timeout=10)
        assert proxy.lost.is_set() and proxy.connections == 2 and a.attempts == 2
        async with AsyncClient(decision_addr) as direct:
            assert same_answer(await direct.assign(group, r, 64, timeout=10), a)
            assert await direct.cancel(group, r) == CancelOutcome.RELEASED

    try:
        run(main())
    finally:
        proxy.close()


def test_failover_past_a_dead_port_and_a_killed_replica(
    dead_port, spawn_decision, decision_addr, group
):
    first = spawn_decision()

    async def main():
        async with AsyncClient([dead_port, first.addr, decision_addr]) as c:
            r = rid("aio-failover")
            a = await c.assign(group, r, 80, timeout=10)
            assert (a.replica, a.attempts) == (first.addr, 2)
            first.kill9()
            b = await c.assign(group, r, 80, timeout=20)
            assert b.replica == decision_addr
            assert (b.worker_id, b.incarnation) == (a.worker_id, a.incarnation)
            await c.cancel(group, r)

    run(main())


def test_deadline_exceeded_on_a_frozen_replica(spawn_decision, group):
    frozen = spawn_decision()

    async def main():
        opts = ClientOptions(keepalive_interval=30, keepalive_timeout=30)
        async with AsyncClient(frozen.addr, options=opts) as c:
            await c.assign(group, rid("aio-frozen-warm"), 32, timeout=10)
            frozen.freeze()
            with pytest.raises(balanceroute.DeadlineExceeded) as err:
                await c.assign(group, rid("aio-frozen"), 32, timeout=1.0)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    run(main())


def test_typed_errors(decision_addr, group):
    async def main():
        async with AsyncClient(decision_addr) as c:
            with pytest.raises(balanceroute.InvalidArgument) as err:
                await c.assign(group, rid("aio-zero"), 0, timeout=10)
            assert err.value.attempts == 1
            with pytest.raises(balanceroute.NotFound):
                await c.assign("no-such-group", rid("aio-nf"), 10, timeout=10)
            with pytest.raises(balanceroute.InvalidArgument) as err:
                await c.assign(
                    group, rid("aio-hint"), 10, timeout=10, request_class="tenant 7"
                )
            assert "request_class" in err.value.message

    run(main())


def test_hints_are_sent(decision_addr, group):
    async def main():
        async with AsyncClient(decision_addr) as c:
            r = rid("aio-hints")
            a = await c.assign(
                group,
                r,
                64,
                max_tokens=100,
                timeout=10,
                expected_output_tokens=100,
                request_class="chat",
            )
            assert a.attempts == 1
            assert await c.cancel(group, r) == CancelOutcome.RELEASED

    run(main())


def test_mutual_tls(tls_dir, tls_group, tls_decision_addr, tls_worker):
    def cfg(role):
        return TLSConfig(
            ca=os.path.join(tls_dir, "ca.pem"),
            cert=os.path.join(tls_dir, f"{role}.pem"),
            key=os.path.join(tls_dir, f"{role}-key.pem"),
        )

    async def main():
        async with AsyncClient(tls_decision_addr, tls=cfg("gateway")) as c:
            r = rid("aio-tls")
            a = await c.assign(tls_group, r, 128, timeout=30)
            assert a.worker_id == 0
            assert await c.cancel(tls_group, r) == CancelOutcome.RELEASED
        async with AsyncClient(tls_decision_addr, tls=cfg(f"worker-{tls_group}-0")) as c:
            with pytest.raises(balanceroute.PermissionDenied):
                await c.assign(tls_group, rid("aio-tls-worker"), 10, timeout=10)

    run(main())
