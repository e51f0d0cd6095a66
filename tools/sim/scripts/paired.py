#!/usr/bin/env python3
"""Paired seed-by-seed comparison of BR policies against the best baseline (issue 16, moderate load).

Runs `br-sim run ... --seed S --json` once per seed and prints, for every non-baseline policy,
the mean over seeds of (policy - baseline) and its standard error, where the baseline is the
one with the lowest mean TPOT p95 over the seeds (one baseline for all seeds, so the choice is
not a max over noise). Metrics: TPOT p50 and p95 (ms), throughput (tok/s), imbalance and
barrier idle (KV tokens).

Usage: paired.py BR_SIM SEEDS -- <br-sim run arguments without --seed/--json>
"""
import json
import math
import os
import subprocess
import sys
import tempfile

METRICS = [
    ("tpot_p50_ms", "tpot50 ms"),
    ("tpot_p95_ms", "tpot95 ms"),
    ("throughput_tok_s", "tok/s"),
    ("avg_imbalance", "imbalance"),
    ("avg_barrier_idle", "barrier idle"),
]


def is_baseline(name):
    return not name.startswith("br")


def mean_se(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    v = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(v / len(xs))


def main():
    sim, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    args = sys.argv[sys.argv.index("--") + 1 :]
    per_seed = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            out = os.path.join(tmp, f"{seed}.json")
            subprocess.run(
                [sim, *args, "--seed", str(seed), "--json", out],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            with open(out) as f:
                per_seed.append({r["policy"]: r for r in json.load(f)["runs"]})
    names = list(per_seed[0])
    bases = [n for n in names if is_baseline(n)]
    base = min(bases, key=lambda n: sum(s[n]["tpot_p95_ms"] for s in per_seed))
    print(f"$ br-sim {' '.join(args)}  (seeds {sys.argv[2]})")
    print(f"best baseline (lowest mean TPOT p95): {base}")
    print(f"{'policy':<14}" + "".join(f"{label:>26}" for _, label in METRICS))
    for n in names:
        cells = []
        for key, _ in METRICS:
            vals = [s[n][key] for s in per_seed]
            m, _ = mean_se(vals)
            if n == base or is_baseline(n):
                cells.append(f"{m:>26.1f}")
            else:
                d, se = mean_se([s[n][key] - s[base][key] for s in per_seed])
                cells.append(f"{m:>10.1f} ({d:+8.1f}±{se:5.1f})")
        print(f"{n:<14}" + "".join(cells))


if __name__ == "__main__":
    main()
