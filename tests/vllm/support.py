"""Processes, ports, metrics and σ for the end-to-end tests against a real vLLM.

Everything here talks to real processes: vLLM's CPU build serving the tiny local model,
BalanceRoute's br-all and br-shim binaries, and brctl to read σ. Waiting is always on a
condition (`wait_until`), bounded, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

BIN_DIR = Path(os.environ.get("BR_BIN_DIR", "target/debug"))
LOG_DIR = Path(os.environ.get("BR_LOG_DIR", "target/e2e-vllm"))
VLLM_PYTHON = os.environ.get("BR_VLLM_PYTHON", "target/vllm/venv/bin/python")
MODEL = os.environ.get("BR_VLLM_MODEL", "target/vllm/models/tiny-llama")
# vLLM's start-up on two shared cores: 25-30 s for one rank, 46-86 s for a DP = 2 server when
# the machine is quiet; CI's machine also builds beside it.
VLLM_START_TIMEOUT = float(os.environ.get("BR_VLLM_START_TIMEOUT", "420"))
MODEL_NAME = "tiny"


class Timeout(AssertionError):
    pass


def wait_until(check: Callable[[], Optional[T]], timeout: float, what: str, every: float = 0.1) -> T:
    """Calls `check` until it returns something other than None/False; fails after `timeout`
    seconds with `what` and the last value or error seen."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            v = check()
            if v is not None and v is not False:
                return v
            last = v
        except Exception as e:  # noqa: BLE001 - the condition may fail until it holds
            last = e
        if time.monotonic() >= deadline:
            raise Timeout(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(every)


_rng = random.Random()
_handed_out: set = set()


def _free(port: int) -> bool:
    if port in _handed_out:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on now, below the
    kernel's ephemeral range (32768+) where outgoing connections (vLLM's own among them) take
    theirs, and not handed out before in this run."""
    for _ in range(500):
        base = _rng.randrange(15000, 32000 - count)
        if all(_free(base + i) for i in range(count)):
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports")


def free_port() -> int:
    return free_ports(1)


def free_pair() -> int:
    """A port p with p + 1 also free (the services' gRPC and admin ports side by side)."""
    return free_ports(2)


@dataclass
class Proc:
    """A process started in its own session (so kill -9 reaches every child, e.g. vLLM's
    engine cores), its output in a log file."""

    name: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    # Added to the process's nice value and to its session's (the scheduler shares the CPU
    # between sessions first, then between the processes of one).
    nice: int = 0
    popen: Optional[subprocess.Popen] = None
    log: Optional[Path] = None
    starts: int = 0

    def start(self) -> "Proc":
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.log = LOG_DIR / f"{self.name}.{self.starts}.log"
        out = open(self.log, "wb")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_lower_priority(self.nice) if self.nice else None,
        )
        out.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def exit_code(self) -> Optional[int]:
        return None if self.popen is None else self.popen.poll()

    def kill9(self) -> None:
        """SIGKILL to the whole session: the API server and every engine process at once."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)
        wait_until(lambda: not _session_alive(self.popen.pid), 30, f"{self.name}'s children to exit")

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()

    def tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _lower_priority(nice: int) -> Callable[[], None]:
    """Run in the child after its new session is made: lowers its priority, and its session's
    where the kernel groups sessions (autogroup), which needs no privilege."""
    def lower() -> None:
        os.nice(nice)
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass  # no autogroup: the process's own nice value is what counts
    return lower


def _session_alive(sid: int) -> bool:
    """Whether any process of session `sid` is still alive (not a zombie)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...
        rest = stat.rsplit(")", 1)[1].split()
        if int(rest[3]) == sid and rest[0] != "Z":
            return True
    return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


# --- vLLM ------------------------------------------------------------------------------------

# vLLM runs below the control plane's priority. In production the engine decodes on its GPUs
# and the shim and control plane have CPU to themselves; here the two engines and their API
# server keep both cores busy, and at equal priority the shim and br-all waited on the run
# queue for seconds at a time (10 s in 6 s of wall time, from /proc/PID/task/*/schedstat),
# long enough for keepalive pings and telemetry heartbeats to go unanswered and streams to be
# ended as dead. vLLM still gets every cycle the control plane does not use.
VLLM_NICE = 10

# The tiny model's own context (max_position_embeddings).
MODEL_CONTEXT = 8192


def vllm_server(name: str, port: int, dp: int = 1, cores: str = "0", model: str = MODEL,
                extra: Optional[List[str]] = None, max_model_len: int = MODEL_CONTEXT) -> Proc:
    """`vllm serve` of the tiny model on `port`: `dp` ranks bound to `cores` (vLLM's
    `VLLM_CPU_OMP_THREADS_BIND`, one entry per rank separated by `|`). A `max_model_len`
    above the model's context lets a request run longer than that (its random weights make
    any position as good as another)."""
    argv = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--dtype", "bfloat16", "--enforce-eager",
        "--max-num-seqs", "16",
    ]
    if dp > 1:
        # One API server in front of the DP engines: vLLM's /pause (the quiet-point test)
        # reaches only the API server that receives it.
        argv += ["--data-parallel-size", str(dp), "--api-server-count", "1"]
    argv += extra or []
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # /pause and /resume: the tests compare σ with the engine at a point where nothing
        # moves (requests kept, frozen).
        "VLLM_SERVER_DEV_MODE": "1",
        "DO_NOT_TRACK": "1",
    }
    if max_model_len > MODEL_CONTEXT:
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return Proc(name, argv, env, nice=VLLM_NICE)


def wait_vllm(proc: Proc, port: int) -> None:
    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited ({proc.exit_code()}):\n{proc.tail()}")
        return http_ok(f"http://127.0.0.1:{port}/v1/models")

    wait_until(ready, VLLM_START_TIMEOUT, f"{proc.name} to serve on :{port}", every=0.5)


def scrape(url: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """A Prometheus text page as {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_engine(metrics: dict, name: str) -> Dict[int, float]:
    """vLLM's `name` by its `engine` label (the DP rank of a `--data-parallel-size` server;
    0 for a one-rank server)."""
    out: Dict[int, float] = {}
    for (n, labels), v in metrics.items():
        if n == name:
            engine = dict(labels).get("engine", "0")
            out[int(engine)] = out.get(int(engine), 0.0) + v
    return out


class SlowProbeProxy:
    """A TCP proxy in front of an engine that, while `slow` is set, holds every request whose
    bytes begin with `GET <path>` for `delay` seconds before passing it on: the engine's health
    endpoint answers late, on demand, while everything else (the streams) goes through as it
    is. Only a read that starts a request can begin with those bytes: a request body is JSON.
    Serves on its own thread and event loop until `close()`."""

    def __init__(self, upstream: int, path: str = "/health", delay: float = 0.1):
        self.upstream = upstream
        self.head = f"GET {path} ".encode()
        self.delay = delay
        self.slow = threading.Event()
        self.held = 0  # requests held so far
        self.port = free_port()
        self._clients: set = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise AssertionError(f"the slow-probe proxy did not start on :{self.port}")

    def _serve(self, started: threading.Event) -> None:
        async def pump(reader, writer, hold: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if hold and self.slow.is_set() and data.startswith(self.head):
                        self.held += 1
                        await asyncio.sleep(self.delay)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        async def client(reader, writer) -> None:
            me = asyncio.current_task()
            self._clients.add(me)
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
                await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False),
                                     return_exceptions=True)
            except OSError:
                writer.close()
            finally:
                self._clients.discard(me)

        async def main() -> None:
            self._stop = asyncio.Event()
            server = await asyncio.start_server(client, "127.0.0.1", self.port)
            started.set()
            await self._stop.wait()
            server.close()
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)

        self._loop.run_until_complete(main())
        self._loop.close()

    def close(self) -> None:
        """Stops holding probes, closes every connection and the listener."""
        self.slow.clear()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)


# --- BalanceRoute ----------------------------------------------------------------------------

def br_all(name: str, grpc: int, admin: int, group: str, extra: Optional[List[str]] = None) -> Proc:
    return Proc(name, [
        str(BIN_DIR / "br-all"), "--listen", f"127.0.0.1:{grpc}",
        "--admin-listen", f"127.0.0.1:{admin}", "--groups", group, "--policy", "br0",
        *(extra or []),
    ])


# The shim's bound on a request head's arrival (10 s by default, against slowloris clients),
# past which hyper closes the connection without an answer. Here the heads come from the
# test's own threads on two cores the engines keep busy: in a run where br-all was not
# scheduled for 6 s, a test client's fresh connection to the shim ended "without sending a
# response", as a late head ends. These tests judge placement and release, not a client's
# speed.
HEADER_READ_TIMEOUT = "120s"


def br_shim(name: str, listen: int, admin: int, upstream: int, ingest: int, group: str,
            ranks: List[str], extra: Optional[List[str]] = None) -> Proc:
    """A shim in front of the vLLM server on `upstream`; `ranks` is its topology flags
    (`--worker-id N`, or `--worker-ids 0-1 --dp-rank-header X-data-parallel-rank`)."""
    return Proc(name, [
        str(BIN_DIR / "br-shim"), "--listen", f"127.0.0.1:{listen}",
        "--admin-listen", f"127.0.0.1:{admin}", "--upstream", f"http://127.0.0.1:{upstream}",
        "--ingest-addr", f"http://127.0.0.1:{ingest}", "--group", group, "--capacity", "16",
        "--endpoint", f"http://127.0.0.1:{listen}",
        "--header-read-timeout", HEADER_READ_TIMEOUT, *ranks, *(extra or []),
    ])


# How long one control-plane call may take here. These tests judge what is placed and released,
# never how fast: the control plane runs debug builds on the two cores a decoding vLLM keeps
# busy (its DP engines step in lockstep, so both cores stay busy while any request runs), and
# one `brctl` call has been seen to take 3.3 s there, beyond brctl's 5 s default in CI.
CONTROL_CALL_TIMEOUT = "30s"


def brctl(snapshot: int, *args: str) -> object:
    out = subprocess.run(
        [str(BIN_DIR / "brctl"), "--snapshot-addr", f"http://127.0.0.1:{snapshot}", "-o", "json",
         "--call-timeout", CONTROL_CALL_TIMEOUT, *args],
        capture_output=True, text=True, timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"brctl {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def workers(snapshot: int, group: str) -> Dict[int, dict]:
    """σ's workers of `group` by id (`brctl status GROUP`)."""
    return {w["worker_id"]: w for w in brctl(snapshot, "status", group)["workers"]}


def live_workers(snapshot: int, group: str) -> List[int]:
    return sorted(i for i, w in workers(snapshot, group).items()
                  if w["liveness"] == "live" and not w["cordoned"])
