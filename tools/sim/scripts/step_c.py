#!/usr/bin/env python3
"""What changes when the step pays per running request: T = a·max L + c·max n + b.

For each workload, G and c, runs `br-sim sweep --workers-list G --per-worker N --seed S` once
per seed (saturated, B = 64) with the baselines, BR-0, and BR-0 with the F-score's request term
(`request_cost_tokens = c/a`), reads each run's steady figures from the printed table, and
prints, paired by seed (mean ± standard error over the seeds):
  * each BR policy's steady gap share (s.gap%: the share of the best baseline's steady gap to
    the fluid limit it removes) and steady gain (s.gain%) against the best baseline of the same
    seed (by steady throughput, as br-sim's own tables);
  * the n-aware policy minus plain BR-0, per seed: s.gap%, s.gain%, steady imbalance, TPOT p95.

With `--moderate 60,85` it then runs Poisson arrivals at those percentages of capacity at the
first G (capacity: the best baseline's saturated steady throughput at that c, seed 1, over the
workload's mean output), `br-sim run --json` once per seed, and prints TPOT p50/p95, throughput
and imbalance of BR-0 and the n-aware BR-0 against the best baseline (lowest mean TPOT p95, as
paired.py), and n-aware − BR-0 paired by seed.

Usage: step_c.py BR_SIM OUT_TXT [--seeds 1,2,3,4,5] [--workloads paper-azure,paper-prop]
                 [--workers 8,32] [--c 0,0.25,1] [--slots 64] [--moderate 60,85]
"""
import json
import os
import re
import tempfile
import argparse
import subprocess
import sys
from simstats import mean_se

STEP_A = 2e-4  # br-sim's default a (ms per KV token); kappa = c / a
PER_RANK = {"paper-azure": 300, "paper-prop": 500}  # as scripts/widep.sh at B = 64
BASELINES = "rr,jsq,mintok"


def table(stdout):
    """The rows of br-sim's table: {policy: {column: value}}."""
    rows, header = {}, None
    for line in stdout.splitlines():
        cols = line.split()
        if cols and cols[0] == "policy" and "s.fluid" in cols:
            header = cols
            continue
        if header and len(cols) == len(header):
            rows[cols[0]] = dict(zip(header, cols))
        elif header and rows:
            break
    return rows


def run(sim, wl, g, c, seed, slots, policies):
    args = [
        sim, "sweep", "--trace", wl, "--arrival", "saturated", "--slots", str(slots),
        "--workers-list", str(g), "--per-worker", str(PER_RANK[wl]), "--seed", str(seed),
        "--step-c", str(c), "--policies", policies,
    ]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = table(out)
    if not rows:
        sys.exit(f"no table in the output of {' '.join(args)}:\n{out}")
    return rows


def capacity(sim, wl, g, c, slots):
    """Requests/s the best baseline sustains saturated: steady tok/s over the mean output."""
    args = [
        sim, "sweep", "--trace", wl, "--arrival", "saturated", "--slots", str(slots),
        "--workers-list", str(g), "--per-worker", str(PER_RANK[wl]), "--seed", "1",
        "--step-c", str(c), "--policies", BASELINES,
    ]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    mean_output = float(re.search(r"output mean (\d+)", out).group(1))
    rows = table(out)
    return max(float(r["steady"]) for r in rows.values()) / mean_output


def moderate(sim, wl, g, c, pct, seeds, slots):
    """Markdown rows for Poisson arrivals at pct% of capacity."""
    kappa = c / STEP_A
    aware = f"br0:request_cost_tokens={kappa:g}"
    rate = capacity(sim, wl, g, c, slots) * pct / 100
    per = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in seeds:
            print(f"== moderate {wl} G={g} c={c} {pct}% ({rate:.2f}/s) seed={s}", file=sys.stderr)
            out = os.path.join(tmp, f"{s}.json")
            subprocess.run(
                [sim, "--trace", wl, "--arrival", "poisson", "--rate", f"{rate:.3f}",
                 "--workers", str(g), "--slots", str(slots), "--step-c", str(c),
                 "--seed", str(s), "--json", out,
                 "--policies", f"{BASELINES},br0,{aware}"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            with open(out) as f:
                per.append({r["policy"]: r for r in json.load(f)["runs"]})
    bases = [p for p in per[0] if not p.startswith("br")]
    base = min(bases, key=lambda p: sum(r[p]["tpot_p95_ms"] for r in per))
    keys = [("tpot_p50_ms", "{:+.2f} ± {:.2f}"), ("tpot_p95_ms", "{:+.2f} ± {:.2f}"),
            ("throughput_tok_s", "{:+.1f} ± {:.1f}"), ("avg_imbalance", "{:+.0f} ± {:.0f}")]
    cells = [wl, str(g), f"{c:g}", f"{pct}% ({rate:.2f}/s)", base,
             "{:.1f} / {:.1f}".format(
                 mean_se([r[base]["tpot_p95_ms"] for r in per])[0],
                 mean_se([r[base]["avg_imbalance"] for r in per])[0] / 1000)]
    for name in ("br0", aware):
        cells.append(" / ".join(
            fmt.format(*mean_se([r[name][k] - r[base][k] for r in per]))
            for k, fmt in keys[1:2] + keys[3:]))
    cells += [fmt.format(*mean_se([r[aware][k] - r["br0"][k] for r in per])) for k, fmt in keys]
    return "| " + " | ".join(cells) + " |"


def figures(rows, name):
    """Steady gap share, steady gain (against the best baseline), s.imbal, tpot95."""
    f = lambda p, k: float(rows[p][k])
    bases = [p for p in rows if not p.startswith("br")]
    best = max(bases, key=lambda p: f(p, "steady"))
    e = f(name, "steady") / f(name, "s.fluid")
    eb = f(best, "steady") / f(best, "s.fluid")
    return {
        "s.gap%": 100 * (e - eb) / (1 - eb),
        "s.gain%": 100 * (f(name, "steady") / f(best, "steady") - 1),
        "s.imbal": f(name, "s.imbal"),
        "tpot95": f(name, "tpot95"),
        "best": best,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sim")
    ap.add_argument("out")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--workloads", default="paper-azure,paper-prop")
    ap.add_argument("--workers", default="8,32")
    ap.add_argument("--c", default="0,0.25,1")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--moderate", default="")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    lines = [
        f"$ step_c.py (saturated, B = {a.slots}, seeds {a.seeds}; br-sim sweep per seed, "
        f"{PER_RANK} requests per rank; a = {STEP_A} ms/token, b = 30 ms)",
        "mean ± standard error over seeds; s.gap%/s.gain% paired against the best baseline of "
        "the same seed; 'n-aware − br0' paired by seed",
        "| workload | G | c ms/req | κ = c/a | best baseline s.imbal | br0 s.imbal | br0 s.gap% "
        "| br0 s.gain% | n-aware s.gap% | n-aware s.gain% | n-aware − br0: s.gap% | s.gain% "
        "| s.imbal | tpot95 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in a.workloads.split(","):
        for g in [int(x) for x in a.workers.split(",")]:
            for c in [float(x) for x in a.c.split(",")]:
                kappa = c / STEP_A
                aware = f"br0:request_cost_tokens={kappa:g}"
                pols = f"{BASELINES},br0" + (f",{aware}" if c > 0 else "")
                per = []
                for s in seeds:
                    print(f"== {wl} G={g} c={c} seed={s}", file=sys.stderr)
                    per.append(run(a.sim, wl, g, c, s, a.slots, pols))
                br0 = [figures(r, "br0") for r in per]
                best_imbal = [float(r[f["best"]]["s.imbal"]) for r, f in zip(per, br0)]
                ms = lambda xs: "{:.1f} ± {:.1f}".format(*mean_se(xs))
                kk = lambda xs: "{:.1f}k".format(mean_se(xs)[0] / 1000)
                cells = [
                    wl, str(g), f"{c:g}", f"{kappa:g}" if c > 0 else "0",
                    kk(best_imbal), kk([f["s.imbal"] for f in br0]),
                    ms([f["s.gap%"] for f in br0]),
                    "{:+.2f} ± {:.2f}".format(*mean_se([f["s.gain%"] for f in br0])),
                ]
                if c > 0:
                    nav = [figures(r, aware) for r in per]
                    d = lambda k: [x[k] - y[k] for x, y in zip(nav, br0)]
                    cells += [
                        ms([f["s.gap%"] for f in nav]),
                        "{:+.2f} ± {:.2f}".format(*mean_se([f["s.gain%"] for f in nav])),
                        "{:+.1f} ± {:.1f}".format(*mean_se(d("s.gap%"))),
                        "{:+.2f} ± {:.2f}".format(*mean_se(d("s.gain%"))),
                        "{:+.0f} ± {:.0f}".format(*mean_se(d("s.imbal"))),
                        "{:+.2f} ± {:.2f}".format(*mean_se(d("tpot95"))),
                    ]
                else:
                    cells += ["–"] * 6
                line = "| " + " | ".join(cells) + " |"
                print(line, file=sys.stderr)
                lines.append(line)
                with open(a.out, "w") as f:  # keep what is done if a later run is stopped
                    f.write("\n".join(lines) + "\n")
    if a.moderate:
        g = int(a.workers.split(",")[0])
        lines += [
            "",
            f"moderate load, Poisson, G = {g}, B = {a.slots}: 'vs best' is the policy minus the best "
            "baseline (lowest mean TPOT p95) paired by seed, TPOT p95 ms / imbalance tokens; "
            "'n-aware − br0' paired by seed",
            "| workload | G | c ms/req | load (rate) | best baseline | its TPOT p95 ms / imbalance k "
            "| br0 vs best | n-aware vs best | n-aware − br0: TPOT p50 ms | TPOT p95 ms | tok/s "
            "| imbalance |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for wl in a.workloads.split(","):
            for c in [float(x) for x in a.c.split(",") if float(x) > 0]:
                for pct in [int(x) for x in a.moderate.split(",")]:
                    line = moderate(a.sim, wl, g, c, pct, seeds, a.slots)
                    print(line, file=sys.stderr)
                    lines.append(line)
                    with open(a.out, "w") as f:
                        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
