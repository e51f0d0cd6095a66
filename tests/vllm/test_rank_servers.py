"""One vLLM server per rank (each `--data-parallel-size 1`, bound to its own core), a br-shim
in front of each (`--worker-id N`), br-all deciding, the gateway assigning every request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from support import br_shim, free_pair, free_port, per_engine, scrape, vllm_server, wait_until, wait_vllm, workers
import workload

GROUP = "vllm-ranks"


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(GROUP)
    s.servers = {}
    for rank in (0, 1):
        port = free_port()
        v = vllm_server(f"vllm-rank{rank}", port, dp=1, cores=str(rank))
        s.procs.append(v.start())
        shim = free_pair()
        s.procs.append(br_shim(f"shim-rank{rank}", shim, shim + 1, port, s.grpc, GROUP,
                               ["--worker-id", str(rank)]).start())
        s.servers[rank] = (v, port)
    for v, port in s.servers.values():
        wait_vllm(v, port)
    s.wait_live([0, 1])
    return s


def generated(s) -> dict:
    """Each server's generation_tokens_total, by the rank it serves."""
    return {r: per_engine(scrape(f"http://127.0.0.1:{port}/metrics"), "vllm:generation_tokens_total").get(0, 0.0)
            for r, (_, port) in s.servers.items()}


def send_all(s, reqs):
    with ThreadPoolExecutor(len(reqs)) as ex:
        answers = list(ex.map(lambda r: s.gateway.send(*r), reqs))
    assert [a.status for a in answers] == [200] * len(answers), [a.raw[:200] for a in answers]
    return answers


def expect(answers) -> dict:
    return {r: sum(a.usage["completion_tokens"] for a in answers if a.worker_id == r) for r in (0, 1)}


def test_every_request_runs_on_the_rank_assign_chose(stack):
    s = stack
    g0 = generated(s)
    answers = send_all(s, workload.mixed(20, seed=21))
    want = expect(answers)
    assert all(want[r] > 0 for r in (0, 1)), f"BR-0 left a rank idle: {want}"
    wait_until(lambda: {r: generated(s)[r] - g0[r] for r in (0, 1)} == want, 30,
               f"each server's generation_tokens_total to grow by {want}")


def test_kill_9_of_one_rank_moves_routing_to_the_other_until_it_returns(stack):
    s = stack
    before = workers(s.grpc, s.group)
    v, port = s.servers[1]
    v.kill9()
    wait_until(lambda: s.live() == [0], 10, "rank 1 to leave routing")
    answers = send_all(s, workload.mixed(6, seed=22))
    assert [a.worker_id for a in answers] == [0] * 6, "an Assign went to the dead rank"
    v.start()
    wait_vllm(v, port)
    s.wait_live([0, 1])
    after = workers(s.grpc, s.group)
    assert after[1]["incarnation"] != before[1]["incarnation"], "the restarted rank kept its incarnation"
    assert after[0]["incarnation"] == before[0]["incarnation"]
    g0 = generated(s)
    answers = send_all(s, workload.mixed(12, seed=23))
    want = expect(answers)
    assert want[1] > 0, f"the returned rank got no request: {want}"
    wait_until(lambda: {r: generated(s)[r] - g0[r] for r in (0, 1)} == want, 30,
               f"each server's generation_tokens_total to grow by {want}")
