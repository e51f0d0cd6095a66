#!/usr/bin/env python3
"""The renewal model of what is left at B = 64 (tools/sim/RESULTS.md, "What bounds
the B = 64 targets"), set against widep.sh's `gap` runs (results/W-gap-*.txt).

A full rank's load moves only at its own finishes, and between them it climbs one token per
running request per step, as every other full rank does. A router that refills each freed slot
at once and to the same level (it cannot know when the rank's requests will end) leaves the
max rank ahead of the mean by what it climbed since its last refill more than the average rank
did. Each rank's finishes are the superposition of B slots' renewals, near a Poisson process of
rate B / E[out] per step, so the time since a rank's last finish is near exponential with mean
E[out] / B steps, and the largest of G of them exceeds the mean by (H_G − 1) of those means
(H_G the G-th harmonic number). In tokens, at B tokens per step:

    max L − mean L ≈ E[out] · (H_G − 1)

independent of B and of the prompts. The baselines' excess grows with B, so the share of their
gap this leaves is higher at B = 256 than at B = 64; this prints the model's share beside the
measured one.

Measured excess from a run's steady throughput: a step of the fluid limit takes
T_f = G·B / s.fluid, a step of the policy T = G·B / steady, and T − T_f = a·(max L − mean L).

Usage: renewal.py RESULTS_DIR [PREFIX]   (PREFIX W-gap by default; --markdown for a table)
"""
import glob
import os
import re
import sys

from gap_table import rows as means_rows  # the means table's rows, as gap_table.py reads them

BASELINES = ("rr", "jsq", "mintok")
NAME = r"-((?:paper-|x)\w+)-B(\d+)-(saturated|poisson)(?:-G\d+)?\.txt$"
# the per-G table after the means: policy G imbalance s.imbal barrier_idle tok/s fluid gain%
# gap% steady s.fluid ...
ROW = re.compile(r"^(\S+)\s+(\d+)\s+\d+\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+)\s")
STEP = re.compile(r"step T = ([\d.e+-]+)·max L")
OUTPUT = re.compile(r"output mean (\d+)")


def harmonic(n):
    return sum(1.0 / k for k in range(1, n + 1))


def runs(path):
    """(G, B, E[out] at G, {policy: excess tokens}, {policy: s.gap%}) per G of one sweep file."""
    text = open(path).read()
    b = int(re.search(r"B=(\d+)", text).group(1))
    a = float(STEP.search(text).group(1))
    # E[out] of each G's workloads (one `workload` line per seed, before its `G=` line): a
    # sweep generates each G's requests afresh
    outs, pending = {}, []
    for line in text.splitlines():
        m = OUTPUT.search(line)
        if m and line.startswith("workload"):
            pending.append(float(m.group(1)))
        g_line = re.match(r"G=(\d+) B=", line)
        if g_line:
            outs.setdefault(int(g_line.group(1)), []).extend(pending)
            pending = []
    gap = {}
    for m in means_rows(path):
        gap.setdefault(int(m[1]), {})[m[0]] = (float(m[10]), float(m[11]))
    excess = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            policy, g, steady, fluid = m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))
            t_fluid_ms = g * b / fluid * 1e3
            t_ms = g * b / steady * 1e3
            excess.setdefault(g, {})[policy] = (t_ms - t_fluid_ms) / a
    for g in sorted(excess):
        e_out = sum(outs[g]) / len(outs[g])
        yield g, b, e_out, excess[g], gap.get(g, {})


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    markdown = "--markdown" in sys.argv
    if not args:
        sys.exit(__doc__)
    out, prefix = args[0], (args[1] if len(args) > 1 else "W-gap")
    rows = []
    for path in glob.glob(os.path.join(out, prefix + "-*.txt")):
        m = re.search(re.escape(prefix) + NAME, path)
        if not m:
            continue
        workload, _, arrival = m.groups()
        for g, b, e_out, excess, gap in runs(path):
            if "br0" not in excess or not any(p in excess for p in BASELINES):
                continue
            base = min(excess[p] for p in BASELINES if p in excess)
            model = e_out * (harmonic(g) - 1)
            s_gap = gap.get("br0", (float("nan"), float("nan")))
            rows.append((workload, b, arrival, g, e_out, base, excess["br0"], model, s_gap))
    rows.sort()
    if markdown:
        print("| workload | B | arrival | G | best baseline max − mean | br0 max − mean "
              "| model E[out]·(H_G − 1) | br0 / model | model share | br0 s.gap% |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("workload,B,arrival,G,e_out,baseline_excess,br0_excess,model_excess,br0_over_model,"
              "model_share_pct,br0_s_gap_pct,br0_s_gap_se")
    for workload, b, arrival, g, e_out, base, br0, model, (s_gap, s_gap_se) in rows:
        share = 100 * (1 - model / base)
        if markdown:
            print(f"| {workload} | {b} | {arrival} | {g} | {base / 1e3:.1f}k | {br0 / 1e3:.2f}k "
                  f"| {model / 1e3:.2f}k | {br0 / model:.2f} | {share:.1f} | {s_gap:.1f} ± {s_gap_se:.1f} |")
        else:
            print(f"{workload},{b},{arrival},{g},{e_out:.0f},{base:.0f},{br0:.0f},{model:.0f},"
                  f"{br0 / model:.3f},{share:.1f},{s_gap},{s_gap_se}")


if __name__ == "__main__":
    main()
