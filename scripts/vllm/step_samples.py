"""Samples a real vLLM rank's decode step time under a sweep of loads, for `br-sim calibrate`.

Each point of the sweep runs N concurrent streams whose prompts are P tokens long, generating
G tokens each (`ignore_eos`, per-chunk usage so every chunk is one step's token). A step of a
rank produces one token of every running request, so the time between two chunks of a stream
is that rank's step time. The sample of a point is the median gap over the middle half of
every stream (all N running, none in prefill or finishing), with M, the rank's KV tokens, at
the middle of that window: N · (P + G/2); N is the running requests.

Writes `max_kv_tokens,max_running,step_ms` rows (the three-term format of br-sim calibrate)
to standard output.

With `--prefill P1,P2,...` it samples the prefill term instead (rows
`max_kv_tokens,max_prefill_tokens,max_running,step_ms`, br-sim calibrate's colocated format):
N streams decode steadily, and a prompt of P tokens (one output token) arrives among them.
The rank prefills it in the same step as their decode tokens (the engine's batched-token
budget must hold P, so it is one step), so the longest gap of each stream while the prompt
was in flight is that step's time: the median of those over the streams, and the point's
sample is the median over its probes (`--probes`). The steady gaps between the probes give the
same N's sample with no prefill (P = 0).

With `--header X-data-parallel-rank:0` every stream is pinned to one rank of a data-parallel
server: in a mixture-of-experts server the other ranks step with it in lockstep (idle ones run
dummy steps), so the samples are the group's step time with the load on one rank.

Usage: python step_samples.py BASE_URL [--prompts 16,256,1024] [--running 1,2,4,8,16]
       [--generate 96] [--repeats 2] [--header NAME:VALUE] [--prefill 256,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

WORD = " rank"  # one token of the tiny model's tokenizer per word


HEADERS: dict = {}


def stream_gaps(base: str, prompt_words: int, generate: int) -> list:
    body = {
        "model": "tiny", "prompt": WORD * prompt_words, "max_tokens": generate,
        "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    stamps = []
    prompt_tokens = None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=HEADERS, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices"):
                stamps.append(time.monotonic())
            if ev.get("usage"):
                prompt_tokens = ev["usage"]["prompt_tokens"]
    lo, hi = len(stamps) // 4, 3 * len(stamps) // 4
    return prompt_tokens, [b - a for a, b in zip(stamps[lo:hi], stamps[lo + 1:hi + 1])]


def prefill_step_ms(streams: list, start: float, end: float):
    """The step that prefilled a prompt in flight over [start, end], seen by the decoding
    streams (each a list of chunk times): per stream, the longest gap between two chunks that
    overlaps the window; their median in ms (None when no stream has such a gap)."""
    longest = []
    for stamps in streams:
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > start and a < end]
        if gaps:
            longest.append(max(gaps))
    return 1000 * statistics.median(longest) if longest else None


def steady_step_ms(streams: list, quiet: list):
    """The median gap between chunks that lie wholly inside a quiet window (no probe in flight),
    over every stream; None without any."""
    gaps = []
    for stamps in streams:
        for a, b in zip(stamps, stamps[1:]):
            if any(lo <= a and b <= hi for lo, hi in quiet):
                gaps.append(b - a)
    return 1000 * statistics.median(gaps) if gaps else None


def stream_stamps(base: str, prompt_words: int, generate: int, stamps: list, started: threading.Event):
    """Streams one request, appending each chunk's arrival time to `stamps`."""
    body = {
        "model": "tiny", "prompt": WORD * prompt_words, "max_tokens": generate,
        "ignore_eos": True, "temperature": 0, "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=HEADERS, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                stamps.append(time.monotonic())
                if len(stamps) == 16:
                    started.set()


def prefill_point(base: str, n: int, prefill_words: int, probes: int, background_words: int = 16):
    """N streams decoding, then `probes` prompts of `prefill_words` one after another, each
    after 8 quiet steps. Returns ([(kv, prefill, running, ms)], steady (kv, running, ms))."""
    generate = 8 + probes * 40
    streams = [[] for _ in range(n)]
    started = [threading.Event() for _ in range(n)]
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(stream_stamps, base, background_words, generate, streams[i], started[i]) for i in range(n)]
        for e in started:
            e.wait(600)
        rows, quiet = [], []
        mark = time.monotonic()
        for _ in range(probes):
            # 8 steps of the streams with no probe in flight
            base_len = len(streams[0])
            while len(streams[0]) < base_len + 8 and not futs[0].done():
                time.sleep(0.001)
            quiet.append((mark, time.monotonic()))
            body = {"model": "tiny", "prompt": WORD * prefill_words, "max_tokens": 1, "temperature": 0}
            t0 = time.monotonic()
            r = httpx.post(f"{base}/v1/completions", json=body, headers=HEADERS, timeout=600)
            r.raise_for_status()
            t1 = time.monotonic()
            prompt = r.json()["usage"]["prompt_tokens"]
            # the step in flight when the answer came may end after it: wait for one more chunk
            seen = len(streams[0])
            while len(streams[0]) <= seen and not futs[0].done():
                time.sleep(0.001)
            ms = prefill_step_ms(streams, t0, t1)
            kv = sum(background_words + len(s) for s in streams)
            if ms is not None:
                rows.append((kv, prompt, n + 1, ms))
            mark = time.monotonic()
        for f in futs:
            f.result()
    steady = steady_step_ms(streams, quiet)
    kv = n * (background_words + generate // 2)
    return rows, (kv, n, steady)


def point(base: str, n: int, prompt_words: int, generate: int):
    with ThreadPoolExecutor(n) as ex:
        runs = list(ex.map(lambda _: stream_gaps(base, prompt_words, generate), range(n)))
    prompt = runs[0][0]
    gaps = [g for _, gs in runs for g in gs]
    return n * (prompt + generate // 2), n, 1000 * statistics.median(gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("--prompts", default="16,256,1024")
    ap.add_argument("--running", default="1,2,4,8,16")
    ap.add_argument("--generate", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--header", action="append", default=[], help="NAME:VALUE sent with every request")
    ap.add_argument("--prefill", default="", help="prompt lengths (words) of the prefill probes: sample the prefill term")
    ap.add_argument("--probes", type=int, default=4, help="prefill probes per point")
    a = ap.parse_args()
    for h in a.header:
        name, sep, value = h.partition(":")
        if not sep or not name:
            ap.error(f"--header {h!r}: expected NAME:VALUE")
        HEADERS[name.strip()] = value.strip()
    # warm-up: the first requests of a fresh server pay one-off costs
    point(a.base, 2, 16, 16)
    if a.prefill:
        print("max_kv_tokens,max_prefill_tokens,max_running,step_ms")
        for _ in range(a.repeats):
            for p in map(int, a.prefill.split(",")):
                for n in map(int, a.running.split(",")):
                    rows, (kv, n_run, steady) = prefill_point(a.base, n, p, a.probes)
                    if rows:
                        # one sample per point, the probes' median: a probe that met a pause of
                        # the machine (hundreds of ms on a shared one) does not lead the fit
                        kv_p = statistics.median(r[0] for r in rows)
                        ms = statistics.median(r[3] for r in rows)
                        print(f"{kv_p:.0f},{rows[0][1]},{rows[0][2]},{ms:.3f}", flush=True)
                    if steady is not None:
                        print(f"{kv},0,{n_run},{steady:.3f}", flush=True)
                    shown = ", ".join(f"{ms:.2f}" for *_, ms in rows)
                    print(f"  N={n} P={p}: prefill steps {shown} ms; steady {steady or float('nan'):.2f} ms", file=sys.stderr)
        return
    print("max_kv_tokens,max_running,step_ms")
    for _ in range(a.repeats):
        for p in map(int, a.prompts.split(",")):
            for n in map(int, a.running.split(",")):
                m, n_run, ms = point(a.base, n, p, a.generate)
                print(f"{m},{n_run},{ms:.3f}", flush=True)
                print(f"  N={n} P={p}: M={m} step {ms:.2f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
