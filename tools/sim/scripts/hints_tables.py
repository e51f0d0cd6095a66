#!/usr/bin/env python3
"""RESULTS.md's "Hints at placement" tables from brh.sh's raw outputs (results/H-*).

  hints_tables.py b256 OUT       the stagger256 cells (H-stagger-<hints>-<workload>-B256-G<G>-
                                 poisson.txt, brh.py --renewal outputs): per cell, br0's s.gap%
                                 and each policy's paired difference to it, with the steady
                                 max − mean over the renewal model, and the model's own share
  hints_tables.py moderate OUT   the moderate cells (H-moderate-<hints>-<workload>-<pct>.json,
                                 paired.py outputs): POLICY's TPOT and TTFT against the best
                                 baseline and against br0, paired by seed (--policy, default
                                 brh-hinted:stagger_weight=1)

Markdown on stdout; ✗ marks a difference worse than zero by more than two standard errors, ✓
one better by more than two (paired.py's verdicts).
"""
import glob
import json
import os
import re
import sys

NF = "brh-hinted:stage2_target=next-finish"
B256_POLICIES = ["br0:stagger_weight=1", NF, f"{NF}:stagger_weight=1"]
HINTS_ORDER = {"0": 0, "0.05": 1, "0.1": 2, "0.2": 3, "0.3": 4, "0.5": 5, "1.0": 6, "shuffled": 9}
ROW = re.compile(r"^(br\S*)\s+([-\d.]+) \(\s*([-+\d.]+)±\s*([\d.]+)\)")
RATIO = re.compile(r"^(\S+)\s+max − mean\s+(\d+)\s+/ model\s+([\d.]+) ± ([\d.]+)")
MODEL = re.compile(r"^renewal model\s+share of the best baseline's gap\s+([-\d.]+) ±\s*([\d.]+)")


def hints_label(tag):
    return {"0": "exact", "shuffled": "shuffled"}.get(tag, f"σ = {tag}")


def read_brh(path):
    gap, ratio, model = {}, {}, None
    for line in open(path):
        m = ROW.match(line)
        if m:
            gap[m.group(1)] = tuple(float(m.group(k)) for k in (2, 3, 4))
        m = RATIO.match(line)
        if m:
            ratio[m.group(1)] = (float(m.group(3)), float(m.group(4)))
        m = MODEL.match(line)
        if m:
            model = (float(m.group(1)), float(m.group(2)))
    return gap, ratio, model


def b256(out):
    name = re.compile(r"H-stagger-([\d.]+|shuffled)-(paper-\w+)-B256-G(\d+)-poisson\.txt$")
    cells = []
    for path in glob.glob(os.path.join(out, "H-stagger-*-B256-G*-poisson.txt")):
        m = name.search(path)
        if m:
            cells.append((m.group(2), int(m.group(3)), HINTS_ORDER.get(m.group(1), 8),
                          m.group(1), path))
    cells.sort()
    print("| workload | G | hints | br0 s.gap% (/ model) | br0 + stagger | NF | NF + stagger "
          "| renewal model's share |")
    print("|---|---|---|---|---|---|---|---|")
    for wl, g, _, tag, path in cells:
        gap, ratio, model = read_brh(path)
        if "br0" not in gap:
            continue
        row = [wl, str(g), hints_label(tag),
               f"{gap['br0'][0]:.1f} ({ratio.get('br0', (float('nan'),))[0]:.2f})"]
        for p in B256_POLICIES:
            if p not in gap:
                row.append("")
                continue
            _, d, se = gap[p]
            mark = "" if abs(d) <= 2 * se or se != se else (" ✓" if d > 0 else " ✗")
            r = ratio.get(p, (float("nan"),))[0]
            row.append(f"{d:+.1f} ± {se:.1f}{mark} ({r:.2f})")
        row.append(f"{model[0]:.1f}" if model else "")
        print("| " + " | ".join(row) + " |")


def moderate(out, policy):
    name = re.compile(r"H-moderate-([\d.]+|shuffled)-([\w-]+)-(\d+)\.json$")
    cells = []
    for path in glob.glob(os.path.join(out, "H-moderate-*.json")):
        m = name.search(path)
        if m:
            cells.append((m.group(2), int(m.group(3)), HINTS_ORDER.get(m.group(1), 8),
                          m.group(1), path))
    order = {"paper-azure": 0, "paper-prop": 1, "mooncake": 2, "sarathi": 3, "azure2023": 4}
    cells.sort(key=lambda c: (order.get(c[0], 9), c[1], c[2]))
    keys = ["tpot_p50_ms", "tpot_p95_ms", "ttft_p50_ms", "ttft_p95_ms"]
    print(f"| workload, load | hints | Δ TPOT p50 ms | Δ TPOT p95 ms | Δ TTFT p50 ms "
          f"| Δ TTFT p95 ms | against br0: Δ TPOT p50 / p95 / TTFT p95 ms |")
    print("|---|---|---|---|---|---|---|")
    mark = {"!": " ✗", "+": " ✓", "": ""}

    def cell(x):
        return f"{x['delta']:+.2f} ± {x['se']:.2f}{mark[x['verdict']]}"

    for wl, pct, _, tag, path in cells:
        data = json.load(open(path))
        row = data["policies"].get(policy)
        if row is None:
            continue
        best = data["best_baseline"]
        vs = [cell(row[k]) + (f" ({best[k]})" if best[k] != "mintok" else "") for k in keys]
        br0 = data.get("against", {}).get("policies", {}).get(policy)
        tail = " / ".join(cell(br0[k]) for k in ("tpot_p50_ms", "tpot_p95_ms", "ttft_p95_ms")) \
            if br0 else ""
        print(f"| {wl} {pct}% | {hints_label(tag)} | " + " | ".join(vs) + f" | {tail} |")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    what, out = sys.argv[1], sys.argv[2]
    if what == "b256":
        b256(out)
    elif what == "moderate":
        policy = sys.argv[sys.argv.index("--policy") + 1] if "--policy" in sys.argv \
            else "brh-hinted:stagger_weight=1"
        moderate(out, policy)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
