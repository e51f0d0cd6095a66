#!/usr/bin/env python3
"""Collects widep.sh's `gap` section (results/W-gap-*.txt) into one CSV: per workload, B,
arrival, G and policy, the steady gain and gap share (mean and standard error over seeds,
paired against the best baseline of the same seed and G), as `br-sim sweep` printed them.

Usage: gap_table.py RESULTS_DIR > W-gap.csv
       gap_table.py --markdown RESULTS_DIR   (the README's tables: s.gap% and s.gain% against G
                                              of `br0`, the previous default in parentheses)
"""
import glob
import os
import re
import sys

NAME = re.compile(r"W-gap-(paper-\w+)-B(\d+)-(saturated|poisson)(?:-G\d+)?\.txt$")
# policy G  imbalance ± se  s.imbal ± se  steady ± se  s.gain% ± se  s.gap% ± se  tpot95 ± se
ROW = re.compile(
    r"^(\S+)\s+(\d+)" + r"\s+(-?[\d.+]+)\s+±\s+([\d.]+)" * 6 + r"\s*$"
)


def rows(path):
    inside = False
    with open(path) as f:
        for line in f:
            if line.startswith("mean ± standard error"):
                inside = True
                continue
            if inside and "barrier_idle" in line:
                return
            m = ROW.match(line) if inside else None
            if m:
                yield m.groups()


def collect(out):
    lines = []
    for path in glob.glob(os.path.join(out, "W-gap-*.txt")):
        m = NAME.search(path)
        if not m:
            continue
        wl, b, arrival = m.groups()
        for order, g in enumerate(rows(path)):
            policy, G = g[0], g[1]
            s_imbal, s_gain, s_gain_se, s_gap, s_gap_se, tpot = g[4], g[8], g[9], g[10], g[11], g[12]
            key = (wl, int(b), arrival, int(G), order)
            lines.append((key, [wl, b, arrival, G, policy, s_imbal, s_gain, s_gain_se, s_gap, s_gap_se, tpot]))
    # numeric G, policies in the order the sweep printed them
    return [fields for _, fields in sorted(lines, key=lambda x: x[0])]


PREVIOUS = "br0:stage1_shallow=false:stage2_hold=never"


def markdown(rows):
    cells = {}
    gs = sorted({int(r[3]) for r in rows})
    cases = []
    for wl, b, arrival, g, policy, _imb, gain, gain_se, gap, gap_se, _tpot in rows:
        case = (wl, int(b), arrival)
        if case not in cases:
            cases.append(case)
        cells[(case, int(g), policy)] = (float(gain), float(gain_se), float(gap), float(gap_se))
    head = "| workload | B | arrival | " + " | ".join(f"G = {g}" for g in gs) + " |"
    rule = "|---|---|---|" + "---|" * len(gs)
    for title, pick in (("s.gap%", lambda c: (c[2], c[3])), ("s.gain%", lambda c: (c[0], c[1]))):
        print(f"{title} of br0, mean ± standard error over 5 seeds (the previous default):\n")
        print(head)
        print(rule)
        for case in sorted(cases, key=lambda c: (c[1], c[0], c[2])):
            row = []
            for g in gs:
                now, prev = cells.get((case, g, "br0")), cells.get((case, g, PREVIOUS))
                if now is None:
                    row.append("")
                    continue
                m, se = pick(now)
                text = f"{m:.1f} ± {se:.1f}" if title == "s.gap%" else f"{m:+.2f} ± {se:.2f}"
                if prev is not None:
                    pm, _ = pick(prev)
                    text += f" ({pm:.1f})" if title == "s.gap%" else f" ({pm:+.2f})"
                row.append(text)
            print(f"| {case[0]} | {case[1]} | {case[2]} | " + " | ".join(row) + " |")
        print()


def main():
    args = sys.argv[1:]
    md = "--markdown" in args
    args = [a for a in args if a != "--markdown"]
    rows = collect(args[0])
    if md:
        markdown(rows)
        return
    print("workload,B,arrival,G,policy,s_imbal,s_gain_pct,s_gain_se,s_gap_pct,s_gap_se,tpot95_ms")
    for fields in rows:
        print(",".join(fields))


if __name__ == "__main__":
    main()
