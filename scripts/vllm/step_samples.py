"""Samples a real vLLM rank's decode step time under a sweep of loads, for `br-sim calibrate`.

Each point of the sweep runs N concurrent streams whose prompts are P tokens long, generating
G tokens each (`ignore_eos`, per-chunk usage so every chunk is one step's token). A step of a
rank produces one token of every running request, so the time between two chunks of a stream
is that rank's step time. The sample of a point is the median gap over the middle half of
every stream (all N running, none in prefill or finishing), with M, the rank's KV tokens, at
the middle of that window: N · (P + G/2); N is the running requests.

Writes `max_kv_tokens,max_running,step_ms` rows (the three-term format of br-sim calibrate)
to standard output.

With `--header X-data-parallel-rank:0` every stream is pinned to one rank of a data-parallel
server: in a mixture-of-experts server the other ranks step with it in lockstep (idle ones run
dummy steps), so the samples are the group's step time with the load on one rank.

Usage: python step_samples.py BASE_URL [--prompts 16,256,1024] [--running 1,2,4,8,16]
       [--generate 96] [--repeats 2] [--header NAME:VALUE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    a = ap.parse_args()
    for h in a.header:
        name, sep, value = h.partition(":")
        if not sep or not name:
            ap.error(f"--header {h!r}: expected NAME:VALUE")
        HEADERS[name.strip()] = value.strip()
    # warm-up: the first requests of a fresh server pay one-off costs
    point(a.base, 2, 16, 16)
    print("max_kv_tokens,max_running,step_ms")
    for _ in range(a.repeats):
        for p in map(int, a.prompts.split(",")):
            for n in map(int, a.running.split(",")):
                m, n_run, ms = point(a.base, n, p, a.generate)
                print(f"{m},{n_run},{ms:.3f}", flush=True)
                print(f"  N={n} P={p}: M={m} step {ms:.2f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
