#!/usr/bin/env python3
"""BR-H against BR-0, paired by seed (does the horizon earn its keep?).

For one workload, G and arrival, runs `br-sim run` once per seed with the baselines, br0 and
the BR-H variants, and prints for every BR policy the mean over seeds and the mean paired
difference against br0 of the same seed, with its standard error:
  s.gap%   share of the best baseline's gap to the fluid limit removed (steady state; from the
           steady and s.fluid columns, not br-sim's whole-percent column)
  steady   steady-state throughput, % against br0
  tok/s    whole-run throughput, % against br0
  tpot95   TPOT p95, ms against br0
  idle     barrier idle per step, whole run (KV tokens), % against br0
A difference beyond two standard errors is marked `+` (BR-H better) or `!` (worse). It also
prints where the idle comes from (br-sim's stderr line): the barrier idle per step and how much
of it growth alone adds per step (every running request writes a token; zero when every rank
runs the same number of requests), the part a horizon projection of growth could act on.

`--capacity` first runs the workload saturated (seed 1) and sets `--rate` to PCT% of the best
baseline's steady throughput over the mean output (RESULTS.md's definition of capacity).

`--renewal` also prints, per policy, its steady max − mean load over the renewal model's
E[out]·(H_G − 1) (RESULTS.md, "A model of what is left"; scripts/renewal.py): the excess comes
from the steady throughput (T − T_fluid = a·(max L − mean L), T = G·B / steady), 1.0 is the
model's residual, below 1 a policy that beats it; and the share of the best baseline's gap a
policy with exactly the model's excess would remove (the renewal bound in s.gap% terms).

Usage: brh.py BR_SIM SEEDS [--capacity PCT] [--renewal] -- <br-sim run arguments without --seed>
"""
import re
import subprocess
import sys
from simstats import mean_se, is_baseline

REFERENCE = "br0"


def run(sim, args):
    p = subprocess.run([sim, *args], check=True, capture_output=True, text=True)
    table, idle, workload, shape = {}, {}, None, {}
    header = None
    for line in p.stdout.splitlines():
        cols = line.split()
        if cols[:2] == ["policy", "G"]:
            header = cols
        elif header and len(cols) == len(header) and cols[1].isdigit():
            table[cols[0]] = dict(zip(header, cols))
    for line in p.stderr.splitlines() + p.stdout.splitlines():
        m = re.match(
            r"\s+(\S+)\s+idle/step: steady (\d+) over (\d+) steps, growth adds ([-+\d.]+)"
            r".*whole run (\d+), growth adds ([-+\d.]+)",
            line,
        )
        if m:
            idle[m.group(1)] = {
                "steady_idle": float(m.group(2)),
                "steady_steps": int(m.group(3)),
                "steady_growth": float(m.group(4)),
                "run_idle": float(m.group(5)),
                "run_growth": float(m.group(6)),
            }
        m = re.match(r"workload .*output mean ([\d.]+)", line)
        if m:
            workload = line
            out_mean = float(m.group(1))
        m = re.match(r"G=(\d+) B=(\d+) .*step T = ([\d.e+-]+)·max L", line)
        if m:
            shape = {"G": int(m.group(1)), "B": int(m.group(2)), "a": float(m.group(3))}
    if not table:
        raise SystemExit(f"no table in br-sim output for {args}:\n{p.stdout}\n{p.stderr}")
    steady_gap_shares(table)
    return table, idle, workload, out_mean, shape


def steady_gap_shares(table):
    """Sets each row's s.gap% from its steady and s.fluid columns (br-sim's definition: the share
    of the gap of the baseline with the highest steady throughput, by efficiency steady / steady
    fluid), unrounded: the table prints whole percent, too coarse where shares differ by a point."""
    bases = [r for n, r in table.items() if is_baseline(n)]
    if not bases:
        return
    best = max(bases, key=lambda r: float(r["steady"]))
    eb = float(best["steady"]) / float(best["s.fluid"])
    for r in table.values():
        if 1.0 - eb > 1e-9 and float(r["s.fluid"]) > 0:
            er = float(r["steady"]) / float(r["s.fluid"])
            r["s.gap%"] = str(100.0 * (er - eb) / (1.0 - eb))


def flow(per_seed, n):
    """Idle per step and what growth alone adds to it per step: steady state, whole run."""
    idles = [i[n] for _, i, *_ in per_seed if n in i]
    if not idles:
        return ""
    m = lambda k: mean_se([x[k] for x in idles])[0]  # noqa: E731
    return (f"{m('steady_growth'):+8.1f} / {m('steady_idle'):<9.0f}"
            f"{m('run_growth'):+8.1f} / {m('run_idle'):<9.0f}")


def main():
    sim, seeds_arg = sys.argv[1], sys.argv[2]
    seeds = [int(s) for s in seeds_arg.split(",")]
    opts = sys.argv[3 : sys.argv.index("--")]
    args = sys.argv[sys.argv.index("--") + 1 :]
    if "--capacity" in opts:
        pct = float(opts[opts.index("--capacity") + 1])
        sat = [a for a in args]
        i = sat.index("--arrival")
        sat[i + 1] = "saturated"
        table, _, _, out_mean, _ = run(sim, sat + ["--seed", "1"])
        best = max(float(r["steady"]) for n, r in table.items() if is_baseline(n))
        rate = pct / 100 * best / out_mean
        args = args + ["--rate", f"{rate:.3f}"]
        print(f"capacity {best / out_mean:.3f} req/s (best baseline steady {best:.1f} tok/s "
              f"/ mean output {out_mean:.0f}); {pct:.0f}% = {rate:.3f} req/s")
    per_seed = [run(sim, args + ["--seed", str(s)]) for s in seeds]
    print(f"$ br-sim {' '.join(args)}  (seeds {seeds_arg})")
    print(per_seed[0][2])
    names = [n for n in per_seed[0][0] if not is_baseline(n)]
    cols = [
        ("s.gap%", "s.gap%", "abs", True),
        ("steady", "steady", "pct", True),
        ("tok/s", "tok/s", "pct", True),
        ("tpot95", "tpot95", "abs", False),
        ("barrier_idle", "idle", "pct", False),
    ]
    print("mean over seeds (paired difference against br0 of the same seed ± standard error; "
          "+ better, ! worse beyond 2 SE)")
    print(f"{'policy':<28}" + "".join(f"{label:>28}" for _, label, _, _ in cols)
          + f"{'growth/idle: steady':>24}{'whole run':>20}")
    for n in names:
        cells = []
        for key, _, kind, higher in cols:
            vals = [float(t[n][key]) for t, *_ in per_seed]
            refs = [float(t[REFERENCE][key]) for t, *_ in per_seed]
            if kind == "pct":
                diffs = [100 * (v - r) / r if r else 0.0 for v, r in zip(vals, refs)]
            else:
                diffs = [v - r for v, r in zip(vals, refs)]
            m, _ = mean_se(vals)
            d, se = mean_se(diffs)
            better = d if higher else -d
            mark = " " if se != se or abs(d) <= 2 * se else ("+" if better > 0 else "!")
            unit = "%" if kind == "pct" else ""
            cells.append(f"{m:>10.1f} ({d:+6.2f}{unit}±{se:5.2f}){mark}")
        print(f"{n:<28}" + "".join(f"{c:>28}" for c in cells) + flow(per_seed, n))
    bases = [n for n in per_seed[0][0] if is_baseline(n)]
    for n in bases:
        gap = [float(t[n]["s.gap%"]) for t, *_ in per_seed]
        print(f"{n:<28} (baseline) s.gap% {mean_se(gap)[0]:6.1f}" + " " * 100 + flow(per_seed, n))
    if "--renewal" in opts:
        renewal(per_seed)


def renewal(per_seed):
    """Each policy's steady max − mean over the renewal model E[out]·(H_G − 1), per seed."""
    print("steady max − mean load over the renewal model E[out]·(H_G − 1) (mean ± standard "
          "error over seeds; 1.0 = the model's residual)")
    for n in per_seed[0][0]:
        ratios, excesses = [], []
        for table, _, _, out_mean, shape in per_seed:
            g, b, a = shape["G"], shape["B"], shape["a"]
            row = table[n]
            t_ms, t_fluid_ms = (g * b / float(row[k]) * 1e3 for k in ("steady", "s.fluid"))
            excess = (t_ms - t_fluid_ms) / a
            model = out_mean * (sum(1.0 / k for k in range(1, g + 1)) - 1)
            excesses.append(excess)
            ratios.append(excess / model)
        r, r_se = mean_se(ratios)
        e, _ = mean_se(excesses)
        print(f"{n:<28} max − mean {e:9.0f}   / model {r:5.2f} ± {r_se:4.2f}")
    # the share of the best baseline's gap a policy whose excess is the model's would remove
    # (renewal.py's "model share"), per seed against that seed's best baseline
    shares = []
    for table, _, _, out_mean, shape in per_seed:
        g, b, a = shape["G"], shape["B"], shape["a"]
        base = min(
            (g * b / float(r["steady"]) - g * b / float(r["s.fluid"])) * 1e3 / a
            for n, r in table.items()
            if is_baseline(n)
        )
        model = out_mean * (sum(1.0 / k for k in range(1, g + 1)) - 1)
        shares.append(100 * (1 - model / base))
    s, s_se = mean_se(shares)
    print(f"{'renewal model':<28} share of the best baseline's gap {s:5.1f} ± {s_se:4.1f}")


if __name__ == "__main__":
    main()
