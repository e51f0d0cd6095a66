"""The stacks the end-to-end tests run: br-all, br-shim and real vLLM servers on free loopback
ports. Each test module builds one topology and tears it down, so at most one set of vLLM
processes holds the machine's memory at a time."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gateway import Gateway  # noqa: E402
from support import Proc, br_all, free_pair, http_ok, live_workers, wait_until  # noqa: E402


@dataclass
class Stack:
    group: str
    grpc: int
    admin: int
    control: Proc
    gateway: Gateway
    procs: List[Proc] = field(default_factory=list)
    vllm_ports: Dict[str, int] = field(default_factory=dict)

    def live(self) -> List[int]:
        return live_workers(self.grpc, self.group)

    def wait_live(self, ranks: List[int], timeout: float = 120.0) -> None:
        wait_until(lambda: self.live() == ranks, timeout,
                   f"σ's live ranks of {self.group} to be {ranks}", every=0.25)

    def stop(self) -> None:
        self.gateway.close()
        for p in reversed(self.procs):
            p.stop()
        self.control.stop()


def control_plane(group: str) -> "tuple[Proc, int, int]":
    grpc = free_pair()
    admin = grpc + 1
    p = br_all(f"br-all-{group}", grpc, admin, group).start()
    wait_until(lambda: p.alive() and http_ok(f"http://127.0.0.1:{admin}/livez"), 60,
               "br-all to answer /livez")
    return p, grpc, admin


# The stacks of the module running now: a failing test's report carries the end of each of
# their logs, so a failure on a CI machine (whose target/ is gone afterwards) says what the
# control plane and the shims saw.
RUNNING: List[Stack] = []
FAILURE_LOG_LINES = 60


@pytest.fixture(scope="module")
def make_stack(request):
    stacks: List[Stack] = []

    def make(group: str) -> Stack:
        p, grpc, admin = control_plane(group)
        s = Stack(group, grpc, admin, p, Gateway(f"127.0.0.1:{grpc}", group))
        stacks.append(s)
        RUNNING.append(s)
        return s

    yield make
    for s in stacks:
        RUNNING.remove(s)
        s.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for s in RUNNING:
        for p in [s.control, *s.procs]:
            if p.name.startswith("vllm"):
                continue  # its own log is long and rarely the story; it stays in target/
            report.sections.append((f"last {FAILURE_LOG_LINES} lines of {p.log}",
                                    p.tail(FAILURE_LOG_LINES)))
