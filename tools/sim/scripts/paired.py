#!/usr/bin/env python3
"""Paired seed-by-seed comparison of BR policies against the best baseline (moderate load).

Runs `br-sim run ... --seed S --json` once per seed and prints, for every BalanceRoute policy
(names starting with `br`), the mean over seeds of (policy - baseline) and its standard error,
paired by seed. The baseline is chosen per metric: the baseline policy with the best mean over
the seeds for that metric (lowest TPOT, imbalance and barrier idle, highest throughput), so the
comparison is against the strongest baseline on every figure, and the choice is one baseline for
all seeds (not a per-seed max over noise). A delta worse than zero by more than two standard
errors is marked `!` (worse beyond the seed spread), one better by more than two `+`.

Metrics: TPOT p50 and p95, TTFT p50, p95 and p99 (ms), throughput (tok/s), imbalance and
barrier idle (KV tokens).

`--against POLICY` (e.g. br0) prints a second table: every other BR policy minus POLICY of the
same seed, on the same metrics (what a variant changes against the policy it varies).

Usage: paired.py BR_SIM SEEDS [--json FILE] [--against POLICY] -- <br-sim run arguments without
--seed/--json>
"""
import json
import os
import subprocess
import sys
import tempfile
from simstats import mean_se, is_baseline

# (JSON key, label, True when higher is better)
METRICS = [
    ("tpot_p50_ms", "tpot50 ms", False),
    ("tpot_p95_ms", "tpot95 ms", False),
    ("ttft_p50_ms", "ttft50 ms", False),
    ("ttft_p95_ms", "ttft95 ms", False),
    ("ttft_p99_ms", "ttft99 ms", False),
    ("throughput_tok_s", "tok/s", True),
    ("avg_imbalance", "imbalance", False),
    ("avg_barrier_idle", "barrier idle", False),
]


def verdict(d, se, higher_better):
    """`!` worse beyond two standard errors, `+` better beyond two, blank otherwise."""
    worse = -d if higher_better else d
    if se != se:  # one seed: no spread to judge by
        return " "
    if worse > 2 * se:
        return "!"
    if worse < -2 * se:
        return "+"
    return " "


def main():
    sim, seeds_arg = sys.argv[1], sys.argv[2]
    seeds = [int(s) for s in seeds_arg.split(",")]
    opts = sys.argv[3 : sys.argv.index("--")]
    json_out = opts[opts.index("--json") + 1] if "--json" in opts else None
    against = opts[opts.index("--against") + 1] if "--against" in opts else None
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
    best = {}
    for key, _, higher in METRICS:
        total = lambda n: sum(s[n][key] for s in per_seed)  # noqa: E731
        best[key] = (max if higher else min)(bases, key=total)
    print(f"$ br-sim {' '.join(args)}  (seeds {seeds_arg})")
    print(
        "best baseline per metric: "
        + ", ".join(f"{label} {best[key]}" for key, label, _ in METRICS)
    )
    print("BR rows: mean (mean paired delta against that baseline ± standard error; ! worse, + better by > 2 SE)")
    print(f"{'policy':<40}" + "".join(f"{label:>30}" for _, label, _ in METRICS))
    summary = {"args": args, "seeds": seeds, "best_baseline": best, "policies": {}}
    for n in names:
        cells = []
        row = {}
        for key, _, higher in METRICS:
            vals = [s[n][key] for s in per_seed]
            m, se_m = mean_se(vals)
            if is_baseline(n):
                cells.append(f"{m:>30.1f}")
                row[key] = {"mean": m, "se": se_m}
            else:
                b = best[key]
                d, se = mean_se([s[n][key] - s[b][key] for s in per_seed])
                mark = verdict(d, se, higher)
                cells.append(f"{m:>12.1f} ({d:+8.2f}±{se:6.2f}){mark}")
                row[key] = {"mean": m, "delta": d, "se": se, "verdict": mark.strip()}
        summary["policies"][n] = row
        print(f"{n:<40}" + "".join(cells))
    if against:
        if against not in names:
            raise SystemExit(f"--against {against}: not among the policies {names}")
        print(f"BR rows against {against} of the same seed: mean paired delta ± standard error "
              "(! worse, + better by > 2 SE)")
        print(f"{'policy':<40}" + "".join(f"{label:>30}" for _, label, _ in METRICS))
        summary["against"] = {"policy": against, "policies": {}}
        for n in names:
            if is_baseline(n) or n == against:
                continue
            cells, row = [], {}
            for key, _, higher in METRICS:
                d, se = mean_se([s[n][key] - s[against][key] for s in per_seed])
                mark = verdict(d, se, higher)
                cells.append(f"{d:>+21.2f}±{se:6.2f}{mark:>2}")
                row[key] = {"delta": d, "se": se, "verdict": mark.strip()}
            summary["against"]["policies"][n] = row
            print(f"{n:<40}" + "".join(cells))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
