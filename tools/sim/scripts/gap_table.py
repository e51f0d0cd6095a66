#!/usr/bin/env python3
"""Collects widep.sh's `gap` section (results/W-gap-*.txt) into one CSV: per workload, B,
arrival, G and policy, the steady gain and gap share (mean and standard error over seeds,
paired against the best baseline of the same seed and G), as `br-sim sweep` printed them.

Usage: gap_table.py RESULTS_DIR > W-gap.csv
       gap_table.py --markdown RESULTS_DIR   (RESULTS.md's tables: s.gap% and s.gain% against G
                                              of `br0`, the previous default in parentheses)
       gap_table.py --prefix W-nf --by-policy RESULTS_DIR
                                             (widep.sh's `nextfinish` section, W-nf-*.txt: one
                                              row per workload, arrival and BR policy, s.gap%
                                              and s.gain% against G)
"""
import glob
import os
import re
import sys

def name_re(prefix):
    return re.compile(prefix + r"-(paper-\w+)-B(\d+)-(saturated|poisson)(?:-G\d+)?\.txt$")
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


def collect(out, prefix="W-gap"):
    lines = []
    name = name_re(prefix)
    for path in glob.glob(os.path.join(out, prefix + "-*.txt")):
        m = name.search(path)
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


BASELINES = ("rr", "jsq", "mintok")


def by_policy(rows):
    cells = {}
    gs = sorted({int(r[3]) for r in rows})
    keys = []
    for wl, b, arrival, g, policy, _imb, gain, gain_se, gap, gap_se, _tpot in rows:
        if policy in BASELINES:
            continue
        key = (wl, int(b), arrival, policy)
        if key not in keys:
            keys.append(key)
        cells[(key, int(g))] = (float(gain), float(gain_se), float(gap), float(gap_se))
    head = "| workload | B | arrival | policy | " + " | ".join(f"G = {g}" for g in gs) + " |"
    rule = "|---|---|---|---|" + "---|" * len(gs)
    for title in ("s.gap%", "s.gain%"):
        print(f"{title}, mean ± standard error over 5 seeds:\n")
        print(head)
        print(rule)
        for key in keys:
            row = []
            for g in gs:
                c = cells.get((key, g))
                if c is None:
                    row.append("")
                elif title == "s.gap%":
                    row.append(f"{c[2]:.1f} ± {c[3]:.1f}")
                else:
                    row.append(f"{c[0]:+.2f} ± {c[1]:.2f}")
            print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(row) + " |")
        print()


def main():
    args = sys.argv[1:]
    md = "--markdown" in args
    per_policy = "--by-policy" in args
    prefix = "W-gap"
    if "--prefix" in args:
        i = args.index("--prefix")
        prefix = args[i + 1]
        del args[i : i + 2]
    args = [a for a in args if a not in ("--markdown", "--by-policy")]
    rows = collect(args[0], prefix)
    if per_policy:
        by_policy(rows)
        return
    if md:
        markdown(rows)
        return
    print("workload,B,arrival,G,policy,s_imbal,s_gain_pct,s_gain_se,s_gap_pct,s_gap_se,tpot95_ms")
    for fields in rows:
        print(",".join(fields))


if __name__ == "__main__":
    main()
