#!/usr/bin/env python3
"""Renders RESULTS.md's tables from reproduce.sh's outputs (results/A-*, B-*, C-*), so a rerun
against a new core is a copy, not a retyping.

Usage: results_tables.py heavy FILE          one A-*.txt as the "Heavy load" table (the mean of
                                             the seeds, as `br-sim sweep` printed it)
       results_tables.py scaling PROP AZURE  the "Scaling with G" table from the two
                                             B-scaling-*.txt
       results_tables.py traces DIR          the "Public traces" table from DIR/C-*.txt
       results_tables.py params DIR          the "open choices and parameters" table from
                                             DIR/D-*.txt (defaults in bold)
"""
import os
import re
import sys

from gap_table import rows as spread_rows  # the mean ± standard error table, as gap_table reads it
from simstats import is_baseline

# the last table a sweep prints: the mean of its seeds, one row per policy and G
HEADER = re.compile(r"^policy\s+G\s+imbalance\s+s\.imbal\s+barrier_idle")
# the gains it prints after that table, against the best baseline of the same G
GAIN = re.compile(
    r"^G=(\d+)\s+(.+?)\s+gain\s+([+-][\d.]+)%\s+steady gain\s+([+-][\d.]+)%"
    r"\s+imbalance (\d+)\s+steady imbalance (\d+)\s*$"
)


def mean_table(path):
    """The rows of the file's last mean table: a dict per row, keyed by the header's names."""
    rows, cols = [], None
    with open(path) as f:
        for line in f:
            if HEADER.match(line):
                rows, cols = [], line.split()
                continue
            parts = line.split()
            if cols and len(parts) == len(cols) and parts[1].isdigit():
                rows.append(dict(zip(cols, parts)))
            elif cols and rows:
                cols = None
    if not rows:
        sys.exit(f"{path}: no mean table (is it a br-sim sweep output?)")
    return rows


def gains(path):
    """(G, policy) -> (gain%, steady gain%, imbalance, steady imbalance)."""
    out = {}
    with open(path) as f:
        for line in f:
            m = GAIN.match(line)
            if m:
                g, pol = int(m[1]), m[2]
                out[(g, pol)] = (float(m[3]), float(m[4]), int(m[5]), int(m[6]))
    return out


def heavy(path):
    cols = ["imbalance", "s.imbal", "tok/s", "fluid", "gap%", "steady", "s.fluid", "s.gap%",
            "tpot50", "tpot95"]
    print("| policy | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in mean_table(path):
        print(f"| {r['policy']} | " + " | ".join(r[c] for c in cols) + " |")


def scaling(prop, azure):
    gp, ga = gains(prop), gains(azure)
    print("| G | paper-prop BR-0 gain (steady) | paper-prop BR-H | best-baseline / BR-0 steady "
          "imbalance | paper-azure BR-0 gain (steady) | paper-azure BR-H | best-baseline / BR-0 "
          "steady imbalance |")
    print("|---|---|---|---|---|---|---|")
    for g in sorted({g for g, _ in gp}):
        cells = []
        for gn in (gp, ga):
            b0, bh, best = gn[(g, "br0")], gn[(g, "brh")], gn[(g, "best baseline")]
            cells += [f"{b0[0]:+.1f}% ({b0[1]:+.1f}%)", f"{bh[0]:+.1f}% ({bh[1]:+.1f}%)",
                      f"{best[3]} / {b0[3]}"]
        print(f"| {g} | " + " | ".join(cells) + " |")


TRACES = [
    ("C-azure2023-saturated", "azure2023_conv, saturated"),
    ("C-azure2023-trace", "azure2023_conv, trace timestamps"),
    ("C-azure2023-trace-x4", "azure2023_conv, trace ×4"),
    ("C-mooncake-saturated", "mooncake, saturated"),
    ("C-mooncake-trace", "mooncake, trace timestamps"),
    ("C-mooncake-trace-x2", "mooncake, trace ×2"),
    ("C-sarathi-saturated", "sarathi ShareGPT, saturated"),
    ("C-sarathi-long-saturated", "sarathi, outputs ≥ 500, saturated"),
    ("C-sarathi-poisson-20", "sarathi, Poisson 20/s"),
]


def traces(d):
    print("| trace, arrival | best baseline (steady) | JSQ imbalance (steady) | BR-0 imbalance "
          "(steady) | BR-0 s.gain% | BR-0 gap% / s.gap% | BR-H s.gap% | TPOT p95: lowest "
          "baseline / BR-0 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label in TRACES:
        path = os.path.join(d, name + ".txt")
        if not os.path.exists(path):
            continue
        rows = {r["policy"]: r for r in mean_table(path)}
        # the best baseline by steady throughput, as the gap shares are measured against
        baselines = [r for p, r in rows.items() if is_baseline(p)]
        best = max(baselines, key=lambda r: float(r["steady"]))
        # below capacity the baselines' throughputs tie (the arrival rate sets them), so TPOT
        # is compared against the baseline with the lowest TPOT p95, not the best baseline's
        tpot = min(float(r["tpot95"]) for r in baselines)
        jsq, b0, bh = rows["jsq"], rows["br0"], rows["brh"]
        print(f"| {label} | {best['policy']} | {jsq['imbalance']} ({jsq['s.imbal']}) | "
              f"{b0['imbalance']} ({b0['s.imbal']}) | {b0['s.gain%']} | "
              f"{b0['gap%']} / {b0['s.gap%']} | {bh['s.gap%']} | "
              f"{tpot:.2f} / {b0['tpot95']} |")


# (policy, parameter): the rows of the table, in reproduce.sh's order
PARAMS = [
    ("br0", "s_greedy"), ("br0", "r_max"), ("br0", "stage1_worker"), ("br0", "cold_start"),
    ("br0", "stage1_scope"), ("br0-bypass", "tie_break"), ("brh", "beta"), ("brh", "gamma"),
    ("brh", "horizon"), ("brh", "gate"),
]
# the core's defaults at G = 8 (s_greedy: G·R_max), drawn in bold
DEFAULTS = {"s_greedy": "32", "r_max": "4", "stage1_worker": "by-score",
            "cold_start": "largest-first", "stage1_scope": "head-batch",
            "tie_break": "fewest-requests", "beta": "43", "gamma": "0.86", "horizon": "80",
            "gate": "0.5"}
CASES = [("paperazure_arrival_poisson_rate_8", "azure 8/s"),
         ("paperprop_arrival_poisson_rate_10", "prop 10/s"),
         ("paperprop_arrival_saturated", "prop saturated")]


def param_rows(path):
    """value -> (s.gain% mean, its se, s.imbal mean, s.gap% mean) of the swept policy's rows
    (`policy[param=value]`) in the sweep's mean ± standard error table."""
    out = {}
    for m in spread_rows(path):
        if "[" in m[0]:
            value = m[0].split("=", 1)[1].rstrip("]")
            out[value] = (float(m[8]), float(m[9]), float(m[4]), float(m[10]))
    return out


def params(d):
    print("| parameter = value | " + " | ".join(f"{label}: s.gain% / s.imbal / s.gap%"
                                             for _, label in CASES) + " |")
    print("|---" * (len(CASES) + 1) + "|")
    for policy, name in PARAMS:
        per_case = [param_rows(os.path.join(d, f"D-{tag}-{name}.txt")) for tag, _ in CASES]
        for value in per_case[0]:
            label = f"{policy} {name} = {value}"
            if DEFAULTS[name] == value:
                label = f"**{label}**"
            cells = []
            for rows in per_case:
                g, se, imbal, gap = rows[value]
                cells.append(f"{g:+.2f} ± {se:.2f} / {imbal:.0f} / {gap:.1f}")
            print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv):
    if len(argv) == 3 and argv[1] == "heavy":
        heavy(argv[2])
    elif len(argv) == 4 and argv[1] == "scaling":
        scaling(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "traces":
        traces(argv[2])
    elif len(argv) == 3 and argv[1] == "params":
        params(argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
