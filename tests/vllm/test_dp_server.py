"""One vLLM API server with `--data-parallel-size 2` behind one br-shim serving both ranks
(`--worker-ids 0-1 --dp-rank-header X-data-parallel-rank`), br-all deciding, the gateway
assigning every request before sending it."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed, wait

import pytest

from gateway import CHAT, COMPLETIONS, sse_events
from support import (SlowProbeProxy, br_shim, brctl, free_pair, free_port, per_engine, scrape,
                     vllm_server, wait_until, wait_vllm, workers)
import workload

GROUP = "vllm-dp"
RANKS = ["--worker-ids", "0-1", "--dp-rank-header", "X-data-parallel-rank"]
# Tokens of the request a client abandons: far more than the engine can generate while the
# disconnect travels through the shim. It must outlast the API server's lag, too: with both
# cores busy with the two lockstep engines (the idle rank runs dummy steps), vLLM's one API
# server was seen to hand the shim a stream's first events 9-14 s after the engine had started
# generating, by which time 7,000 tokens were done.
ABANDONED_TOKENS = 30000
# Tokens each stream of the quiet-point test asks for (the server allows 32,768 with the
# prompt): 8 of them take the two ranks minutes. Some may still finish before the pause when
# the machine stalls (processes on these VMs were seen standing still for 10-45 s while vLLM
# runs data parallel on two cores), so the comparison counts the streams still running and
# needs at least QUIET_POINT_RUNNING of them.
QUIET_POINT_TOKENS = 30000
QUIET_POINT_RUNNING = 4


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(GROUP)
    port = free_port()
    s.vllm = vllm_server("vllm-dp2", port, dp=2, cores="0|1", max_model_len=32768)
    s.procs.append(s.vllm.start())
    s.vllm_port = port
    s.shim_port = free_pair()
    s.shim = br_shim("shim-dp2", s.shim_port, s.shim_port + 1, port, s.grpc, GROUP, RANKS)
    s.procs.append(s.shim.start())
    wait_vllm(s.vllm, port)
    s.wait_live([0, 1])
    return s


def vllm_metrics(s):
    return scrape(f"http://127.0.0.1:{s.vllm_port}/metrics")


def shim_tokens(s):
    m = scrape(f"http://127.0.0.1:{s.shim_port + 1}/metrics")
    out = {}
    for (name, labels), v in m.items():
        if name == "balanceroute_shim_tokens_total":
            out[int(dict(labels)["worker"])] = v
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def sigma_requests(s):
    return brctl(s.grpc, "requests", s.group)


def sigma_empty(s) -> bool:
    return sigma_requests(s) == []


def test_every_request_runs_on_the_rank_assign_chose(stack):
    s = stack
    m0, t0 = vllm_metrics(s), shim_tokens(s)
    reqs = workload.mixed(24, seed=1)
    with ThreadPoolExecutor(len(reqs)) as ex:
        answers = list(ex.map(lambda r: s.gateway.send(*r), reqs))
    assert [a.status for a in answers] == [200] * len(answers), [a.raw[:200] for a in answers]
    want_gen = {r: sum(a.usage["completion_tokens"] for a in answers if a.worker_id == r) for r in (0, 1)}
    want_prompt = {r: sum(a.usage["prompt_tokens"] for a in answers if a.worker_id == r) for r in (0, 1)}
    # Each asked-for length was generated in full: usage is the engine's own count.
    assert [a.usage["completion_tokens"] for a in answers] == [b["max_tokens"] for _, b in reqs]
    assert all(want_gen[r] > 0 for r in (0, 1)), f"BR-0 left a rank idle: {want_gen}"

    def engine_counts():
        m = vllm_metrics(s)
        gen = delta(per_engine(m, "vllm:generation_tokens_total"), per_engine(m0, "vllm:generation_tokens_total"))
        prompt = delta(per_engine(m, "vllm:prompt_tokens_total"), per_engine(m0, "vllm:prompt_tokens_total"))
        assert (gen, prompt) == (want_gen, want_prompt), f"generated {gen}, prompt {prompt}"
        return gen, prompt

    # vLLM's API server publishes each engine's counters a little late under load.
    got = wait_until(engine_counts, 30, f"vLLM's per-engine token counters to reach {want_gen} / {want_prompt}")
    assert got == (want_gen, want_prompt)
    # The shim counted exactly the engine's tokens for each rank, and σ let every request go.
    assert delta(shim_tokens(s), t0) == want_gen
    wait_until(lambda: sigma_empty(s), 30, "σ to hold no request")


def normalise(raw: bytes) -> bytes:
    """The bytes with what differs between two runs of one request blanked: the response id
    and its creation time."""
    raw = re.sub(rb'"id":"(cmpl|chatcmpl)-[^"]*"', rb'"id":"X"', raw)
    return re.sub(rb'"created":\d+', rb'"created":0', raw)


def by_choice(raw: bytes) -> dict:
    """The normalised events of a stream grouped by their choice's index (-1: no choice)."""
    out: dict = {}
    for ev in normalise(raw).split(b"\n\n"):
        m = re.search(rb'"choices":\[\{"index":(\d+)', ev)
        out.setdefault(int(m.group(1)) if m else -1, []).append(ev)
    return out


# Runs of a pair (routed, direct) before a byte-for-byte case gives up on vLLM's chunking.
BYTE_ATTEMPTS = 4


def generated(raw: bytes) -> dict:
    """Each choice's generated text in a stream, however vLLM cut it into events."""
    out: dict = {}
    for ev in sse_events(raw):
        for c in ev.get("choices") or []:
            piece = c["text"] if "text" in c else (c.get("delta") or {}).get("content") or ""
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


BYTE_CASES = [
    ("completions", COMPLETIONS, dict(stream=True)),
    ("completions-usage", COMPLETIONS, dict(stream=True, stream_options={"include_usage": True})),
    ("completions-continuous-usage", COMPLETIONS,
     dict(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})),
    ("completions-logprobs", COMPLETIONS, dict(stream=True, logprobs=2)),
    # n > 1 needs sampling (vLLM refuses it greedy); the seed makes it repeatable.
    ("completions-n2", COMPLETIONS,
     dict(stream=True, n=2, temperature=1, stream_options={"include_usage": True})),
    ("chat-n2", CHAT, dict(stream=True, n=2, temperature=1)),
    ("completions-unary", COMPLETIONS, dict(stream=False)),
    ("chat", CHAT, dict(stream=True)),
    ("chat-usage", CHAT, dict(stream=True, stream_options={"include_usage": True})),
    ("chat-logprobs", CHAT, dict(stream=True, logprobs=True, top_logprobs=2)),
    ("chat-unary", CHAT, dict(stream=False)),
]


@pytest.mark.parametrize("name,path,extra", BYTE_CASES, ids=[c[0] for c in BYTE_CASES])
def test_the_stream_reaches_the_client_byte_for_byte(stack, name, path, extra):
    """The same request through the gateway and the shim, and straight to vLLM pinned to the
    rank Assign chose: the same bytes, and the shim counts the engine's tokens."""
    import random

    import httpx

    s = stack
    _, body = workload.request(random.Random(name), path, 24, words=10, **extra)
    # With n > 1 vLLM interleaves the choices' chunks in an order of its own from run to run:
    # each choice's chunks, and every chunk without choices, are the same bytes in the same order.
    same = (lambda a, b: normalise(a) == normalise(b)) if body.get("n", 1) == 1 else \
        (lambda a, b: by_choice(a) == by_choice(b))
    for attempt in range(1, BYTE_ATTEMPTS + 1):
        t0 = shim_tokens(s)
        routed = s.gateway.send(path, body)
        assert routed.status == 200, routed.raw[:300]
        direct = httpx.post(f"http://127.0.0.1:{s.vllm_port}{path}", json={"model": "tiny", **body},
                            headers={"X-data-parallel-rank": str(routed.worker_id)}, timeout=60)
        assert direct.status_code == 200, direct.text[:300]
        if same(routed.raw, direct.content):
            break
        # vLLM merges the pending deltas of a stream whose reader fell behind into one chunk,
        # so on busy cores one run may cut the same tokens into fewer events. That is the
        # engine's timing, not a change on the way: anything else that differs fails at once.
        assert body.get("stream") and generated(routed.raw) == generated(direct.content) and \
            len(sse_events(routed.raw)) != len(sse_events(direct.content)), \
            f"routed and direct differ beyond vLLM's chunking:\n{routed.raw!r}\n{direct.content!r}"
        print(f"attempt {attempt}: vLLM cut the same text into {len(sse_events(routed.raw))} "
              f"events routed, {len(sse_events(direct.content))} direct; sending both again")
    else:
        raise AssertionError(f"{BYTE_ATTEMPTS} runs each cut differently by vLLM under load")
    # σ's token count for the request is the engine's usage (the shim reports what it counted;
    # `ignore_eos` makes every choice generate max_tokens).
    want = body["max_tokens"] * body.get("n", 1)
    if routed.usage:
        assert routed.usage["completion_tokens"] == want, routed.usage
    got = delta(shim_tokens(s), t0)
    assert got.get(routed.worker_id) == want, (got, want)
    wait_until(lambda: sigma_empty(s), 30, "σ to hold no request")


def test_sigma_agrees_with_vllm_at_a_quiet_point(stack):
    """Eight long streams on the two ranks; the engine is paused with its requests kept
    (vLLM's `/pause?mode=keep`), so nothing moves while the two are compared: σ's running
    requests per rank are vLLM's, and σ's KV load per rank is vLLM's KV use within its block
    rounding. Then the engine resumes and the clients go away, which vLLM aborts and σ
    releases. (While tokens flow the two cannot be compared: the engine runs ahead of what its
    clients have read, and σ counts what the shim has forwarded.)"""
    import threading

    import httpx

    s = stack
    base = f"http://127.0.0.1:{s.vllm_port}"
    reqs = workload.mixed(8, seed=3, lengths=(QUIET_POINT_TOKENS,))

    def opened(req):
        # A deadline that outlasts a machine stall and the worker's return to routing after it.
        st = s.gateway.open_stream(*req, timeout=180)
        st.read_events(2)
        return st

    stop = threading.Event()
    paused = False
    reading = []
    # Two workers per stream: one opens it, one reads it.
    with ThreadPoolExecutor(2 * len(reqs)) as ex:
        try:
            # Opened side by side: vLLM's API server, short of CPU beside two busy engines, was
            # seen to take 10-70 s to start each stream, so streams opened one after another
            # start minutes apart. Each is read from the moment it opens, as a gateway reads
            # it: a stream left unread backs up into the shim, which then sees no engine bytes
            # and cannot tell a busy engine that answers its probes late from a frozen one.
            streams = []
            for f in as_completed([ex.submit(opened, r) for r in reqs]):
                st = f.result()
                streams.append(st)
                reading.append(ex.submit(st.read_until, stop))
            assert httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
            paused = True
            cfg = next(dict(l) for (n, l) in vllm_metrics(s) if n == "vllm:cache_config_info")
            block, kv_size = int(cfg["block_size"]), int(cfg["kv_cache_size_tokens"])

            def agree():
                # The streams still running: the clients keep reading, so every token the
                # engine made before the pause (a stream's end, too) reaches them, the shim
                # and σ.
                running_streams = {r: sum(1 for st in streams if st.worker_id == r and not st.finished)
                                   for r in (0, 1)}
                w = workers(s.grpc, s.group)
                m = vllm_metrics(s)
                running = per_engine(m, "vllm:num_requests_running")
                waiting = per_engine(m, "vllm:num_requests_waiting")
                kv = per_engine(m, "vllm:kv_cache_usage_perc")
                rows = {r: (running_streams[r], w[r]["running"] + w[r]["reserved"],
                            running.get(r, 0) + waiting.get(r, 0),
                            w[r]["load_tokens"], round(kv.get(r, 0) * kv_size)) for r in (0, 1)}
                ok = all(
                    rows[r][0] == rows[r][1] == rows[r][2]
                    # vLLM holds whole blocks: each request's last block is partly filled.
                    and rows[r][4] - block * rows[r][1] <= rows[r][3] <= rows[r][4]
                    for r in (0, 1)
                )
                assert ok, ("per rank (streams running, σ running, vLLM running+waiting, σ KV, "
                            f"vLLM KV): {rows}")
                return rows

            # Long enough for a machine stall to pass while the readers catch up.
            rows = wait_until(agree, 120, "σ and vLLM to agree per rank", every=0.25)
            print(f"quiet point, per rank (streams running, σ running, vLLM running+waiting, "
                  f"σ KV tokens, vLLM KV tokens): {rows}")
            ran = rows[0][0] + rows[1][0]
            assert ran >= QUIET_POINT_RUNNING, \
                f"only {ran} of {len(streams)} streams still ran at the pause: too few to compare"
        finally:
            stop.set()
            if paused:
                assert httpx.post(f"{base}/resume", timeout=60).status_code == 200
        for f in reading:
            f.result(timeout=120)
    wait_until(lambda: sigma_empty(s), 60, "σ to hold no request once every client went away")


def test_a_client_that_goes_away_aborts_the_request_and_sigma_lets_it_go(stack):
    s = stack
    m0 = vllm_metrics(s)
    path, body = workload.mixed(1, seed=4, lengths=(ABANDONED_TOKENS,))[0]
    st = s.gateway.open_stream(path, body)
    st.read_events(3)
    rank = st.worker_id
    # The shim reports the start in its next telemetry flush, which a loaded machine may run
    # after the client has its first events: wait for σ to hold it rather than read it once.
    wait_until(lambda: any(r["request_id"] == st.request_id for r in sigma_requests(s)), 30,
               "σ to hold the streaming request")
    st.close()
    wait_until(lambda: sigma_empty(s), 30, "σ to release the abandoned request")

    def aborted():
        # (vLLM counts no metric for a request the client left: it stops running it, and its
        # generated tokens stop short of what was asked)
        m = vllm_metrics(s)
        running = per_engine(m, "vllm:num_requests_running").get(rank, 0)
        assert running == 0, f"running {running}"
        return m

    m = wait_until(aborted, 30, f"vLLM's engine {rank} to abort the abandoned request")
    gen = delta(per_engine(m, "vllm:generation_tokens_total"),
                per_engine(m0, "vllm:generation_tokens_total"))
    assert gen.get(rank, 0) < ABANDONED_TOKENS, f"the engine generated the whole request: {gen}"


def test_a_slow_health_probe_never_takes_a_streaming_rank_out_of_routing(stack):
    """A second shim in front of the same two ranks (its own group), through a proxy that holds
    each /health probe past the shim's 10 ms probe timeout while every one of the test's
    streams runs (a decoding vLLM answers /health late on a busy machine, but not on cue).
    While the streams move, every timed-out probe is forgiven and the ranks stay in routing;
    the proxy stops holding probes as soon as the first stream ends, before the engine could
    fall silent with a probe held."""
    s = stack
    group = "vllm-dp-slow-probe"
    port = free_pair()
    proxy = SlowProbeProxy(s.vllm_port, "/health", delay=0.1)
    # A probe every 200 ms: a timed-out probe is forgiven while engine bytes arrived within
    # the last interval + timeout (210 ms), which twelve decoding streams keep well inside.
    shim = br_shim("shim-dp2-slow-probe", port, port + 1, proxy.port, s.grpc, group, RANKS,
                   ["--engine-probe-timeout", "10ms", "--engine-probe-interval", "200ms"])
    s.procs.append(shim.start())
    wait_until(lambda: workers(s.grpc, group) and all(
        w["liveness"] == "live" for w in workers(s.grpc, group).values()) and len(workers(s.grpc, group)) == 2,
        60, "the second shim's ranks to be live")

    def shim_metrics():
        return scrape(f"http://127.0.0.1:{port + 1}/metrics")

    def metric(m, name, reason=None):
        return sum(v for (n, l), v in m.items()
                   if n == name and (reason is None or dict(l).get("reason") == reason))

    def timeouts(m):
        return metric(m, "balanceroute_shim_engine_probe_failures_total", "timeout")

    m0 = shim_metrics()
    t0, tokens0 = timeouts(m0), metric(m0, "balanceroute_shim_tokens_total")
    reqs = workload.mixed(12, seed=9, lengths=(700,))
    import httpx

    def run(i_req):
        i, (path, body) = i_req
        rank = i % 2
        r = httpx.post(f"http://127.0.0.1:{port}/rank/{rank}{path}", json={"model": "tiny", **body},
                       headers={"X-Request-Id": f"slow-probe-{i}"}, timeout=300)
        return r.status_code

    out_of_routing = []
    held_while = []  # (active, tokens) each time the proxy started holding probes
    try:
        with ThreadPoolExecutor(len(reqs) + 1) as ex:
            done = ex.submit(lambda: list(ex.map(run, enumerate(reqs))))
            # Probes are held only while all twelve run and tokens flow; σ's view of the
            # group is sampled until every stream has ended.
            while not wait([done], timeout=0.1).done:
                m = shim_metrics()  # one scrape for both
                active = metric(m, "balanceroute_shim_active_requests")
                tokens = metric(m, "balanceroute_shim_tokens_total") - tokens0
                if active == len(reqs) and tokens > 0:
                    if not proxy.slow.is_set():
                        held_while.append((active, tokens))
                    proxy.slow.set()
                else:
                    proxy.slow.clear()
                down = [i for i, x in workers(s.grpc, group).items() if x["liveness"] != "live"]
                if down:
                    out_of_routing.append((time.monotonic(), down))
            results = done.result()
        forgiven = timeouts(shim_metrics()) - t0
    finally:
        shim.stop()
        proxy.close()
    print(f"probes held by the proxy: {proxy.held}; timeouts forgiven while streaming: {forgiven}")
    assert results == [200] * len(reqs)
    assert held_while, "the twelve streams never ran at once: no probe was held"
    assert out_of_routing == [], f"ranks left routing while streaming: {out_of_routing[:5]}"
    assert forgiven > 0, f"no probe timed out although the proxy held {proxy.held}"


def test_a_rank_mapping_the_server_does_not_have_is_refused_at_start_up(stack):
    """A shim told to serve ranks 0-2 of a DP = 2 server exits with a typed error naming rank 2,
    and the group never routes to it."""
    s = stack
    port = free_pair()
    bad = br_shim("shim-dp2-bad-ranks", port, port + 1, s.vllm_port, s.grpc, "vllm-dp-bad",
                  ["--worker-ids", "0-2", "--dp-rank-header", "X-data-parallel-rank"])
    s.procs.append(bad.start())
    code = wait_until(lambda: bad.exit_code(), 120, "the shim to refuse rank 2 and exit", every=0.25)
    log = bad.tail(20)
    assert code == 2, log
    assert "rank 2" in log and "out of range" in log, log


def test_kill_9_of_the_dp_server_takes_both_ranks_out_until_it_returns(stack):
    import balanceroute

    s = stack
    before = workers(s.grpc, s.group)
    s.vllm.kill9()
    wait_until(lambda: not s.live(), 10, "both ranks to leave routing")
    with pytest.raises(balanceroute.BalanceRouteError):
        s.gateway.assign(*workload.mixed(1, seed=5)[0], timeout=2)
    s.vllm.start()
    wait_vllm(s.vllm, s.vllm_port)
    s.wait_live([0, 1])
    after = workers(s.grpc, s.group)
    for r in (0, 1):
        assert after[r]["incarnation"] != before[r]["incarnation"], (before[r], after[r])
    answers = [s.gateway.send(*r) for r in workload.mixed(4, seed=6)]
    assert [a.status for a in answers] == [200] * 4
