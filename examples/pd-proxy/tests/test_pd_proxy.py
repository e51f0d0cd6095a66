"""The PD proxy end to end (scripts/python-tests.sh): the `openai` package is the client,
`br-emu engine` plays the prefill engine (behind a br-shim that only counts, in no group) and
the decode ranks (each behind the stack's br-shim, reporting to BalanceRoute), and the real
br-decision assigns. Checked for every request: the prefill engine saw it once with one token,
the rank Assign chose saw it exactly once (and no other rank did) under the request's id, the
client got the whole answer; and a client that goes away mid-stream leaves nothing in σ.

Environment: BR_PD_PROXY_URL, BR_SHIM_ADMIN_URLS (the decode shims' admin URLs, by rank),
BR_PREFILL_URL and BR_PREFILL_ADMIN_URL (the prefill shim and its admin URL),
BR_DECISION_ADMIN_URL, BR_SNAPSHOT_ADDR, BR_GROUP, BR_BIN_DIR and BR_LOG_DIR (one test starts
and freezes a br-decision of its own).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

import grpc
import openai
import pytest

MODEL = "br-emu"
TOKEN = " tok"


def env(name):
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set (run scripts/python-tests.sh)")
    return value


def metric(admin_url, name, **labels):
    """The sum of a metric's samples whose labels include `labels`."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total, found = 0.0, False
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    assert found, f"{name}{labels} not exported by {admin_url}"
    return total


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(
        base_url=f"{env('BR_PD_PROXY_URL')}/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def shims():
    return env("BR_SHIM_ADMIN_URLS").split(",")


@pytest.fixture(scope="module")
def prefill_admin():
    return env("BR_PREFILL_ADMIN_URL")


@pytest.fixture(scope="module")
def sigma():
    """Reads the group's σ from the snapshot service (Snapshot.Get, plaintext on loopback)."""
    from balanceroute.v1 import snapshot_pb2, snapshot_pb2_grpc

    ch = grpc.insecure_channel(env("BR_SNAPSHOT_ADDR"))
    stub = snapshot_pb2_grpc.SnapshotStub(ch)
    group = env("BR_GROUP")

    def requests():
        snap = stub.Get(snapshot_pb2.GetRequest(group=group), timeout=10)
        return {r.request_id: r for r in snap.requests}

    yield requests
    ch.close()


class Counts:
    """The shims' request and token counters before a request, to compare after it."""

    def __init__(self, shims, prefill_admin):
        self.shims, self.prefill = shims, prefill_admin
        self.before = self.read()

    def read(self):
        return (
            [metric(s, "balanceroute_shim_requests_total") for s in self.shims],
            metric(self.prefill, "balanceroute_shim_requests_total"),
            metric(self.prefill, "balanceroute_shim_tokens_total"),
        )

    def assert_once_on(self, rank):
        ranks, prefills, prefill_tokens = self.read()
        delta = [a - b for a, b in zip(ranks, self.before[0])]
        want = [1.0 if g == rank else 0.0 for g in range(len(self.shims))]
        assert delta == want, f"decode requests per rank {delta}, want {want} (rank {rank})"
        assert prefills - self.before[1] == 1, "the prefill engine saw it once"
        assert prefill_tokens - self.before[2] == 1, "prefill generates one token"


def rid(name):
    return f"pd-{name}-{uuid.uuid4().hex[:8]}"


def test_chat_without_streaming(client, shims, prefill_admin, sigma):
    counts = Counts(shims, prefill_admin)
    r = rid("chat")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about lockstep decoding."}],
        max_tokens=8,
        extra_headers={"X-Request-Id": r},
    )
    rank = int(raw.headers["x-balanceroute-worker"])
    assert raw.headers["x-request-id"] == r
    resp = raw.parse()
    # The decode rank got the request under its id (the engine echoes it in the response id).
    assert resp.id == f"chatcmpl-{r}"
    assert resp.choices[0].message.content == TOKEN * 8
    assert resp.usage.completion_tokens == 8
    counts.assert_once_on(rank)
    # Finished: σ holds nothing for it any more (its reservation was turned into a request
    # by the rank's telemetry, which then reported it finished).
    wait_until(lambda: r not in sigma(), 10, f"{r} to leave σ")


def test_streaming_completion(client, shims, prefill_admin, sigma):
    counts = Counts(shims, prefill_admin)
    r = rid("stream")
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt="a" * 400,
        max_tokens=12,
        stream=True,
        extra_headers={"X-Request-Id": r},
    )
    rank = int(raw.headers["x-balanceroute-worker"])
    text, finish = "", None
    for chunk in raw.parse():
        assert chunk.id == f"cmpl-{r}"
        for c in chunk.choices:
            text += c.text or ""
            finish = c.finish_reason or finish
    assert text == TOKEN * 12
    assert finish == "length"
    counts.assert_once_on(rank)
    wait_until(lambda: r not in sigma(), 10, f"{r} to leave σ")


def test_requests_without_an_id_get_one_and_each_is_placed_once(client, shims, prefill_admin):
    for _ in range(4):
        counts = Counts(shims, prefill_admin)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        rid_ = raw.headers["x-request-id"]
        assert raw.parse().id == f"chatcmpl-{rid_}"
        counts.assert_once_on(int(raw.headers["x-balanceroute-worker"]))


def test_a_client_that_goes_away_leaves_no_reservation(client, shims, prefill_admin, sigma):
    decision_admin = env("BR_DECISION_ADMIN_URL")
    group = env("BR_GROUP")
    cancels = metric(decision_admin, "balanceroute_decision_cancel_total", group=group)
    r = rid("gone")
    # Long enough (thousands of steps) to still be decoding when the client leaves.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x" * 200}],
        max_tokens=100_000,
        stream=True,
        extra_headers={"X-Request-Id": r},
    )
    rank = int(raw.headers["x-balanceroute-worker"])
    stream = raw.parse()
    it = iter(stream)
    for _ in range(3):
        next(it)
    # Decoding on the rank Assign chose, as σ sees it through that rank's telemetry.
    seen = wait_until(lambda: sigma().get(r), 10, f"{r} in σ")
    assert seen.worker_id == rank
    stream.close()  # the client goes away mid-stream
    # The proxy cancelled it and closed the decode call: the shim saw its client go and
    # reported the request finished, so σ holds nothing for it; the rank is idle again.
    wait_until(lambda: r not in sigma(), 10, f"{r} to leave σ after the disconnect")
    wait_until(
        lambda: metric(shims[rank], "balanceroute_shim_active_requests") == 0,
        10,
        "the rank's shim to have no request in flight",
    )
    wait_until(
        lambda: metric(decision_admin, "balanceroute_decision_cancel_total", group=group) > cancels,
        10,
        "the proxy's Cancel to reach the decision service",
    )


def fnv1a_64(key):
    """The class id the contract defines (Reservation.request_class_id)."""
    h = 0xCBF29CE484222325
    for b in key.encode():
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


@pytest.mark.parametrize(
    "headers, body, expected, cls",
    [
        # Dynamo's body field and the Gateway API Inference Extension's objective header
        (
            {"X-Gateway-Inference-Objective": "chat"},
            {"nvext": {"agent_hints": {"osl": 512}}},
            512,
            "chat",
        ),
        # BalanceRoute's header wins over the body
        (
            {"X-BalanceRoute-Expected-Output-Tokens": "77"},
            {"nvext": {"agent_hints": {"osl": 512}}},
            77,
            None,
        ),
        # hints outside the contract are left out; the request goes on without them
        (
            {"X-Gateway-Inference-Objective": "tenant 7"},
            {"nvext": {"agent_hints": {"osl": 0}}},
            None,
            None,
        ),
    ],
)
def test_output_length_hints_go_to_assign(client, sigma, headers, body, expected, cls):
    r = rid("hints")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "y" * 200}],
        max_tokens=100_000,
        stream=True,
        extra_headers={"X-Request-Id": r, **headers},
        extra_body=body,
    )
    stream = raw.parse()
    next(iter(stream))
    # Decoding: σ holds the request with the hints its reservation carried.
    seen = wait_until(lambda: sigma().get(r), 10, f"{r} in σ")
    got = seen.expected_output_tokens if seen.HasField("expected_output_tokens") else None
    assert got == expected
    got = seen.request_class_id if seen.HasField("request_class_id") else None
    assert got == (fnv1a_64(cls) if cls else None)
    stream.close()
    wait_until(lambda: r not in sigma(), 10, f"{r} to leave σ after the disconnect")


def test_hints_are_read_as_the_proto_bounds_them():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pd_proxy

    hinted = {"nvext": {"agent_hints": {"osl": 300}}}
    header = pd_proxy.EXPECTED_OUTPUT_HEADER
    assert pd_proxy.expected_output_tokens(hinted, {}, None) == 300
    assert pd_proxy.expected_output_tokens(hinted, {}, 300) == 300
    assert pd_proxy.expected_output_tokens(hinted, {}, 299) is None, "above max_tokens"
    assert pd_proxy.expected_output_tokens(hinted, {header: " 12 "}, None) == 12
    assert pd_proxy.expected_output_tokens(hinted, {header: "many"}, None) is None
    for bad in (0, -1, 10_000_001, "300", True, 1.5):
        body = {"nvext": {"agent_hints": {"osl": bad}}}
        assert pd_proxy.expected_output_tokens(body, {}, None) is None, bad
    assert pd_proxy.expected_output_tokens({"nvext": 5}, {}, None) is None
    assert pd_proxy.expected_output_tokens({}, {}, None) is None
    objective = pd_proxy.REQUEST_CLASS_HEADER
    assert pd_proxy.request_class({objective: "tenant-7/tools"}) == "tenant-7/tools"
    assert pd_proxy.request_class({objective: "~" * 64}) == "~" * 64
    for bad in ("", "a b", "c" * 65, "caf\u00e9", "a\tb"):
        assert pd_proxy.request_class({objective: bad}) is None, bad
    assert pd_proxy.request_class({}) is None


def test_prefill_errors_reach_the_client_as_they_are(client, shims, prefill_admin):
    before = [metric(s, "balanceroute_shim_requests_total") for s in shims]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    # Nothing was assigned or decoded for it.
    assert [metric(s, "balanceroute_shim_requests_total") for s in shims] == before


class OwnDecision:
    """A br-decision of the test's own for the group (port 0, --ready-file), to freeze with
    SIGSTOP: its kernel then accepts calls, nothing answers."""

    def __init__(self):
        d = tempfile.mkdtemp(prefix="pd-decision-", dir=os.environ.get("BR_LOG_DIR"))
        ready = os.path.join(d, "ready.json")
        self.log = open(os.path.join(d, "decision.log"), "wb")
        self.proc = subprocess.Popen(
            [
                os.path.join(env("BR_BIN_DIR"), "br-decision"),
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--ready-file",
                ready,
                "--snapshot-addr",
                f"http://{env('BR_SNAPSHOT_ADDR')}",
                "--groups",
                env("BR_GROUP"),
                "--policy",
                "jsq",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

        def bound():
            assert self.proc.poll() is None, f"br-decision exited; see {d}"
            return os.path.exists(ready) and json.load(open(ready))

        ports = wait_until(bound, 30, "br-decision's ready file")
        self.addr, self.admin = ports["grpc"], f"http://{ports['admin']}"

        def ready_ok():
            try:
                with urllib.request.urlopen(f"{self.admin}/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready_ok, 30, "br-decision ready")

    def freeze(self):
        """SIGSTOP, then waits until every thread is stopped (the signal is delivered
        asynchronously: a thread still running could answer the next call)."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: self._thread_states() <= {"T"}, 10, "br-decision stopped")

    def thaw(self):
        self.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: "T" not in self._thread_states(), 10, "br-decision resumed")

    def _thread_states(self):
        """Scheduler states of the process's threads (/proc/<pid>/task/<tid>/stat, after the
        parenthesised name); 'T' is stopped by a signal."""
        states = set()
        task_dir = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass  # a thread that exited meanwhile
        return states

    def stop(self):
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


class InProcessProxy:
    """The proxy app served by uvicorn on a thread, on a socket bound before it starts."""

    def __init__(self, cfg):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import pd_proxy
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(pd_proxy.create_app(pd_proxy.Config(**cfg)), log_level="warning")
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the in-process proxy to start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def proxy_stats(url):
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as r:
        return json.load(r)


def test_a_client_that_leaves_while_assign_waits_is_cancelled_and_never_decoded(shims, sigma):
    decision = OwnDecision()
    proxy = None
    try:
        proxy = InProcessProxy(
            dict(
                prefill=[env("BR_PREFILL_URL")],
                decision=decision.addr,
                group=env("BR_GROUP"),
                assign_timeout=60,
            )
        )
        client = openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30
        )
        # One request through, so the proxy's connection to the replica is up before it freezes.
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w"}], max_tokens=2
        )
        decision.freeze()
        before = [metric(s, "balanceroute_shim_requests_total") for s in shims]
        start = proxy_stats(proxy.url)
        r = rid("leaves-in-assign")
        # Prefill answers; Assign waits on the frozen replica; the client gives up.
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "y" * 100}],
                max_tokens=100_000,
                extra_headers={"X-Request-Id": r},
            )

        def ended():
            s = proxy_stats(proxy.url)
            return (
                s["client_gone"] > start["client_gone"]
                and s["cancelled"] + s["cancel_failed"]
                > start["cancelled"] + start["cancel_failed"]
                and s
            )

        # The proxy saw the client go, stopped waiting and sent Cancel (which the frozen
        # replica cannot answer, so it may fail after its 2 s).
        s = wait_until(ended, 20, "the proxy to see the client leave and cancel")
        assert s["decoded"] == start["decoded"]
        decision.thaw()
        # Nothing was decoded for the client that left (a proxy that went on waiting would,
        # once the replica answers, decode 100,000 tokens on some rank), nor held in σ.
        wait_until(lambda: r not in sigma(), 10, f"{r} to be absent from σ")
        assert [metric(s, "balanceroute_shim_requests_total") for s in shims] == before
        assert proxy_stats(proxy.url)["decoded"] == start["decoded"]
    finally:
        if proxy is not None:
            proxy.stop()
        decision.stop()


def test_given_only_its_prefill_engine_it_asks_br_all_for_the_default_group(monkeypatch):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import balanceroute
    import pd_proxy

    args = pd_proxy.parse_args(["--prefill", "http://127.0.0.1:8000"])
    assert args.decision is None
    # The group br-shim reports in and br-decision serves when neither is told otherwise.
    assert args.group == "default"
    monkeypatch.delenv(balanceroute.ADDRESS_ENV, raising=False)
    client = balanceroute.AsyncClient(args.decision)
    assert client.replicas() == [(balanceroute.DEFAULT_ADDRESS, False)]
    monkeypatch.setenv(balanceroute.ADDRESS_ENV, "http://127.0.0.1:50063")
    assert balanceroute.AsyncClient(args.decision).replicas() == [("127.0.0.1:50063", False)]
