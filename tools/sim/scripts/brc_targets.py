#!/usr/bin/env python3
"""BR-C against its targets, one row per workload and G, from scripts/brc_targets.sh's outputs.

Saturated (the sweep's tables): BR-C's steady balance ratio (s.bal%, target >= 90) and its
share of the best baseline's steady gap to the aligned limit (s.gap%, paired by seed, target
>= 80), with its steady throughput gain (s.gain%). Poisson at 60% and 85% of capacity
(paired.py's JSON): BR-C's TTFT p99 over the best baseline's (target <= 1.25) and its TPOT p95
against the best baseline's (paired delta +- standard error; target: not worse beyond two
standard errors). The robustness sweeps (lag, p off by half) get the saturated columns only.

Usage: brc_targets.py RESULTS_DIR
"""
import glob
import json
import os
import re
import sys


def spread_rows(path):
    """{(policy, G): [numbers]} from the sweep's `mean ± standard error` table: imbalance,
    s.imbal, steady tok/s, s.gain%, s.gap% (each mean then its standard error), tpot95."""
    rows, inside = {}, False
    with open(path) as f:
        for line in f:
            if line.startswith("mean ± standard error"):
                inside = True
                continue
            if inside and line.startswith("policy"):
                if rows:
                    break  # the mean table that follows
                continue
            if inside:
                toks = [t.lstrip("±") for t in line.split() if t != "±"]
                try:
                    rows[(toks[0], int(toks[1]))] = [float(t) for t in toks[2:14]]
                except (IndexError, ValueError):
                    break  # the table ends
    return rows


def mean_rows(path):
    """{(policy, G): {column: value}} from the sweep's mean table (the last full table)."""
    rows, header = {}, None
    with open(path) as f:
        for line in f:
            toks = line.split()
            if re.match(r"^policy +G +imbalance +s\.imbal +barrier_idle", line):
                header, rows = toks, {}
                continue
            if header and len(toks) == len(header):
                rows[(toks[0], int(toks[1]))] = dict(zip(header, toks))
            else:
                header = None
    return rows


def saturated(path, g):
    spread, mean = spread_rows(path), mean_rows(path)
    s, m = spread.get(("brc", g)), mean.get(("brc", g))
    if s is None or m is None:
        return None
    return {
        "s.bal": float(m["s.bal%"]),
        "s.gain": (s[6], s[7]),
        "s.gap": (s[8], s[9]),
    }


def moderate(path, policy="brc"):
    """moderate_of() the paired.py JSON at `path`."""
    with open(path) as f:
        return moderate_of(json.load(f), policy)


def moderate_of(j, policy="brc"):
    """A BR-C policy's TTFT p99 over the best baseline's and its paired TPOT p95 delta
    (delta, standard error, the baseline's mean) from paired.py's JSON, loaded."""
    best, pol = j["best_baseline"], j["policies"]
    brc = pol[policy]
    ttft_ratio = brc["ttft_p99_ms"]["mean"] / pol[best["ttft_p99_ms"]]["ttft_p99_ms"]["mean"]
    tpot = brc["tpot_p95_ms"]
    return {
        "ttft": ttft_ratio,
        "tpot": (tpot["delta"], tpot["se"], tpot["mean"] - tpot["delta"]),
        "tpot_worse": tpot["verdict"] == "!",
    }


def fmt_sat(c):
    if c is None:
        return "- | - | -"
    return (f"{c['s.bal']:.1f} | {c['s.gap'][0]:.1f} ± {c['s.gap'][1]:.1f} | "
            f"{c['s.gain'][0]:+.1f} ± {c['s.gain'][1]:.1f}")


def main():
    out = sys.argv[1]
    print("| workload | G | s.bal% | s.gap% | s.gain% | 60%: TTFT p99 ratio | 60%: TPOT p95 ms (best baseline) | "
          "85%: TTFT p99 ratio | 85%: TPOT p95 ms (best baseline) | targets |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wl in ("adp-shape", "azure2023_conv", "mooncake"):
        sat_path = os.path.join(out, f"P-brc-T-{wl}-saturated.txt")
        if not os.path.exists(sat_path):
            continue
        for g in (8, 16, 32):
            sat = saturated(sat_path, g)
            cells, ok = [fmt_sat(sat)], []
            if sat is not None:
                ok += [sat["s.bal"] >= 90, sat["s.gap"][0] >= 80]
            for pct in (60, 85):
                p = os.path.join(out, f"P-brc-T-{wl}-G{g}-poisson{pct}.json")
                if not os.path.exists(p):
                    cells.append("- | -")
                    continue
                m = moderate(p)
                d, se, base = m["tpot"]
                cells.append(f"{m['ttft']:.2f}× | {d:+.1f} ± {se:.1f} ({base:.0f})")
                ok += [m["ttft"] <= 1.25, not m["tpot_worse"]]
            verdict = f"{sum(ok)} of {len(ok)}"
            print(f"| {wl} | {g} | " + " | ".join(cells) + f" | {verdict} |")
    print()
    print("| robustness (adp-shape, saturated) | G | s.bal% | s.gap% | s.gain% |")
    print("|---|---|---|---|---|")
    for tag, label in (("lag2", "telemetry 2 steps late"), ("p0.24", "engine p = 0.24 (-50%)"),
                       ("p0.72", "engine p = 0.72 (+50%)")):
        # one sweep, or one per part of the G's (the lagged G = 32 runs on its own)
        paths = sorted(glob.glob(os.path.join(out, f"P-brc-T-adp-shape-saturated-{tag}*.txt")))
        for g in (8, 16, 32):
            cell = next((c for c in (saturated(p, g) for p in paths) if c is not None), None)
            if cell is not None:
                print(f"| {label} | {g} | {fmt_sat(cell)} |")


if __name__ == "__main__":
    main()
