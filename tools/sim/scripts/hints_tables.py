#!/usr/bin/env python3
"""RESULTS.md's "Hints at placement" tables from brh.sh's raw outputs (results/H-*).

  hints_tables.py b256 OUT       the stagger256 cells (H-stagger-<hints>-<workload>-B256-G<G>-
                                 poisson.txt, brh.py --renewal outputs): with exact hints, br0's
                                 s.gap% and each policy's paired difference to it, with the
                                 steady max − mean over the renewal model, and the model's own
                                 share; with erring hints, the three differences per cell
  hints_tables.py b64 OUT        the B = 64 cells (stagger and sigma sections), one row per file,
                                 as the exact-hint table of b256
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


def signed(x, digits):
    """+1.2 / −1.2 (RESULTS.md's minus sign)."""
    return f"{x:+.{digits}f}".replace("-", "−")


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
    """Two tables: exact hints (each policy's difference to br0 with its / model), and the
    erring hints (the three differences in one cell per hint)."""
    name = re.compile(r"H-stagger-([\d.]+|shuffled)-(paper-\w+)-B256-G(\d+)-poisson\.txt$")
    cells = {}
    for path in glob.glob(os.path.join(out, "H-stagger-*-B256-G*-poisson.txt")):
        m = name.search(path)
        if m:
            cells.setdefault((m.group(2), int(m.group(3))), {})[m.group(1)] = read_brh(path)
    keys = sorted(cells)

    def diff(gap, ratio, p, with_ratio):
        if p not in gap:
            return ""
        _, d, se = gap[p]
        mark = "" if se != se or abs(d) <= 2 * se else (" ✓" if d > 0 else " ✗")
        if not with_ratio:
            return f"{signed(d, 1)}{mark}"
        return f"{signed(d, 1)} ± {se:.1f}{mark} ({ratio.get(p, (float('nan'),))[0]:.2f})"

    print("| workload | G | br0 s.gap% (/ model) | renewal model's share | br0 + stagger | NF "
          "| NF + stagger |")
    print("|---|---|---|---|---|---|---|")
    for wl, g in keys:
        if "0" not in cells[(wl, g)]:
            continue
        gap, ratio, model = cells[(wl, g)]["0"]
        if "br0" not in gap or "br0" not in ratio:  # not written yet
            continue
        row = [wl, str(g), f"{gap['br0'][0]:.1f} ({ratio['br0'][0]:.2f})",
               f"{model[0]:.1f}" if model else ""]
        row += [diff(gap, ratio, p, True) for p in B256_POLICIES]
        print("| " + " | ".join(row) + " |")
    print()
    errs = ["0.1", "0.3", "shuffled"]
    print("| workload | G | " + " | ".join(hints_label(t) for t in errs) + " |")
    print("|---|---|" + "---|" * len(errs))
    for wl, g in keys:
        row = [wl, str(g)]
        for t in errs:
            if t not in cells[(wl, g)]:
                row.append("")
                continue
            gap, ratio, _ = cells[(wl, g)][t]
            if "br0" not in gap:
                row.append("")
                continue
            row.append(" / ".join(diff(gap, ratio, p, False) for p in B256_POLICIES))
        print("| " + " | ".join(row) + " |")


def b64(out):
    """The B = 64 cells (H-stagger-<hints>-<workload>-G<G>-<arrival>.txt): one row per file,
    br0's s.gap% and each policy's paired difference to it with its / model."""
    name = re.compile(r"H-stagger-([\d.]+|shuffled)-(paper-\w+)-G(\d+)-(poisson|saturated)\.txt$")
    rows = []
    for path in glob.glob(os.path.join(out, "H-stagger-*-G*-*.txt")):
        m = name.search(path)
        if m:
            wl, g, arrival = m.group(2), int(m.group(3)), m.group(4)
            order = (wl != "paper-prop", arrival != "poisson", g, HINTS_ORDER.get(m.group(1), 8))
            rows.append((order, f"{wl} G = {g}, {'Poisson' if arrival == 'poisson' else arrival}",
                         m.group(1), path))
    rows.sort()
    print("| cell | hints | br0 s.gap% (/ model) | renewal model's share | br0 + stagger | NF "
          "| NF + stagger |")
    print("|---|---|---|---|---|---|---|")
    for _, cell, tag, path in rows:
        gap, ratio, model = read_brh(path)
        if "br0" not in gap or "br0" not in ratio:
            continue
        row = [cell, hints_label(tag), f"{gap['br0'][0]:.1f} ({ratio['br0'][0]:.2f})",
               f"{model[0]:.1f}" if model else ""]
        for p in B256_POLICIES:
            if p not in gap:
                row.append("")
                continue
            _, d, se = gap[p]
            mark = "" if se != se or abs(d) <= 2 * se else (" ✓" if d > 0 else " ✗")
            row.append(f"{signed(d, 1)} ± {se:.1f}{mark} ({ratio.get(p, (float('nan'),))[0]:.2f})")
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
        return f"{signed(x['delta'], 2)} ± {x['se']:.2f}{mark[x['verdict']]}"

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
    elif what == "b64":
        b64(out)
    elif what == "moderate":
        policy = sys.argv[sys.argv.index("--policy") + 1] if "--policy" in sys.argv \
            else "brh-hinted:stagger_weight=1"
        moderate(out, policy)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
