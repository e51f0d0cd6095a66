#!/usr/bin/env python3
"""BR-C's rule 6 (fill under) and its slack against the moderate-load targets, from
scripts/brc_fill.sh's outputs: per workload, G and load, each BR-C variant's TTFT p99 over the
best baseline's (target <= 1.25) and its TPOT p95 against the best baseline's (paired delta +-
standard error, ms; `!` worse beyond two standard errors, `+` better), then per variant the
cells where it misses either target.

Usage: brc_fill.py RESULTS_DIR
"""
import json
import os
import sys

from brc_targets import moderate_of

WORKLOADS = ["adp-shape", "azure2023_conv", "mooncake"]


def main(out):
    cells = []
    for wl in WORKLOADS:
        for g in (8, 16, 32):
            for pct in (60, 85):
                path = os.path.join(out, f"P-brc-fill-{wl}-G{g}-poisson{pct}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        cells.append((wl, g, pct, json.load(f)))
    if not cells:
        sys.exit(f"no P-brc-fill-*.json in {out}")
    variants = [p for p in cells[0][3]["policies"] if p.startswith("brc")]
    misses = {v: [] for v in variants}
    print("cell | " + " | ".join(variants))
    print("|".join(["---"] * (len(variants) + 1)))
    for wl, g, pct, j in cells:
        row = [f"{wl} G={g} {pct}%"]
        for v in variants:
            m = moderate_of(j, v)
            d, se, _ = m["tpot"]
            flag = j["policies"][v]["tpot_p95_ms"]["verdict"]
            row.append(f"{m['ttft']:.2f}x, {d:+.1f} ± {se:.1f}{flag}")
            if m["ttft"] > 1.25 or m["tpot_worse"]:
                misses[v].append(f"{wl} G={g} {pct}%")
        print(" | ".join(row))
    print()
    for v in variants:
        print(f"{v}: {len(cells) - len(misses[v])} of {len(cells)} cells hold"
              + (f"; misses {', '.join(misses[v])}" if misses[v] else ""))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tools/sim/results")
