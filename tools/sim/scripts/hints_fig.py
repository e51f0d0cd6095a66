#!/usr/bin/env python3
"""Gap share against the hints' error: one cell of brh.sh's `sigma` section as an SVG.

Reads OUT/H-stagger-<hints>-<CELL>.txt (brh.py --renewal outputs, <hints> a log-normal σ or
`shuffled`) and draws, for each BR policy other than br0, its share of the best baseline's
steady gap to the fluid limit (s.gap%, mean over seeds) against σ, with the standard error of
its paired difference to br0 as the bar; br0's share (the same at every σ: it reads no hint)
and the renewal model's share (brh.py's `renewal model` line: a router whose max − mean is
E[out]·(H_G − 1)) as horizontal lines. Shuffled hints sit apart at the right.
No dependencies beyond the standard library.

Usage: hints_fig.py OUT CELL SVG      e.g. hints_fig.py tools/sim/results paper-prop-G32-poisson \
           tools/sim/results/fig-hints-paper-prop-B64-G32/gap_share.svg
"""
import glob
import os
import re
import sys

ROW = re.compile(r"^(br\S*)\s+([-\d.]+) \(\s*([-+\d.]+)±\s*([\d.]+)\)")
MODEL = re.compile(r"^renewal model\s+share of the best baseline's gap\s+([-\d.]+) ±\s*([\d.]+)")
LABELS = {
    "br0:stagger_weight=1": "BR-0 + stagger",
    "brh-hinted:stage2_target=next-finish": "BR-H hinted, next-finish fill",
    "brh-hinted:stage2_target=next-finish:stagger_weight=1": "BR-H hinted, next-finish + stagger",
}
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b"]


def read(path):
    """{policy: (s.gap% mean, paired difference to br0, its standard error)}, model share."""
    rows, model = {}, None
    for line in open(path):
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = tuple(float(m.group(k)) for k in (2, 3, 4))
        m = MODEL.match(line)
        if m:
            model = (float(m.group(1)), float(m.group(2)))
    return rows, model


def cells(out, cell):
    """[(label, σ or None for shuffled, rows, model)] sorted by σ, shuffled last."""
    found = []
    for path in glob.glob(os.path.join(out, f"H-stagger-*-{cell}.txt")):
        tag = os.path.basename(path)[len("H-stagger-") : -len(f"-{cell}.txt")]
        if tag == "shuffled":
            sigma = None
        else:
            try:
                sigma = float(tag)
            except ValueError:
                continue
        rows, model = read(path)
        found.append((tag, sigma, rows, model))
    found.sort(key=lambda c: (c[1] is None, c[1] or 0.0))
    return found


def svg(found, title):
    if not found:
        raise SystemExit("no H-stagger files for that cell")
    w, h = 900, 520
    left, right, top, bottom = 70, 300, 50, 70
    pw, ph = w - left - right, h - top - bottom
    n = len(found)
    xs = [left + pw * (i + 0.5) / n for i in range(n)]
    if found[-1][1] is None and n > 1:  # a gap before the shuffled point
        xs = [left + pw * (i + 0.5) / (n + 0.5) for i in range(n - 1)]
        xs.append(left + pw * (n - 0.5 + 0.5) / (n + 0.5))
    policies = [p for p in found[0][2] if p != "br0"]
    br0 = [c[2]["br0"][0] for c in found if "br0" in c[2]]
    models = [c[3] for c in found if c[3]]
    values = br0 + [m[0] for m in models]
    for _, _, rows, _ in found:
        for p in policies:
            if p in rows:
                values += [rows[p][0] - 2 * rows[p][2], rows[p][0] + 2 * rows[p][2]]
    lo, hi = min(values), max(values)
    lo, hi = (int(lo) // 2) * 2 - 2, (int(hi) // 2) * 2 + 4
    y = lambda v: top + ph * (hi - v) / (hi - lo)  # noqa: E731
    out = [
        f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg" '
        'font-family="sans-serif" font-size="13">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left + pw / 2}" y="24" text-anchor="middle" font-size="15">{title}</text>',
    ]
    for v in range(lo, hi + 1, 2):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
               'stroke="black"/>')
    for x, (tag, sigma, _, _) in zip(xs, found):
        label = "shuffled" if sigma is None else f"{sigma:g}"
        out.append(f'<text x="{x:.1f}" y="{top + ph + 20}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 22}" text-anchor="middle">σ of the hints\' '
               'log-normal error (shuffled: σ = 0.05 hints permuted among requests)</text>')
    out.append(f'<text transform="translate(20 {top + ph / 2}) rotate(-90)" text-anchor="middle">'
               "share of the best baseline's steady gap removed, %</text>")
    legend = []
    if br0:
        b = sum(br0) / len(br0)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(b):.1f}" y2="{y(b):.1f}" '
                   'stroke="black" stroke-width="2"/>')
        legend.append(("black", "", f"BR-0 ({b:.1f}%)"))
    if models:
        m = sum(v for v, _ in models) / len(models)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(m):.1f}" y2="{y(m):.1f}" '
                   'stroke="#ff7f0e" stroke-width="2" stroke-dasharray="8 5"/>')
        legend.append(("#ff7f0e", "8 5", f"renewal model ({m:.1f}%)"))
    for k, p in enumerate(policies):
        color = COLORS[k % len(COLORS)]
        pts = [(x, c[2][p]) for x, c in zip(xs, found) if p in c[2]]
        line = [(x, r) for (x, r), c in zip(pts, found) if c[1] is not None]
        if len(line) > 1:
            path = " ".join(f"{x:.1f},{y(r[0]):.1f}" for x, r in line)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, (mean, _, se) in pts:
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y(mean - se):.1f}" '
                       f'y2="{y(mean + se):.1f}" stroke="{color}" stroke-width="2"/>')
            out.append(f'<circle cx="{x:.1f}" cy="{y(mean):.1f}" r="4" fill="{color}"/>')
        legend.append((color, "", LABELS.get(p, p)))
    for i, (color, dash, text) in enumerate(legend):
        ly = top + 10 + 22 * i
        lx = left + pw + 15
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{ly}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"{d}/>')
        out.append(f'<text x="{lx + 30}" y="{ly + 4}" font-size="12">{text}</text>')
    note = top + 10 + 22 * len(legend) + 10
    out.append(f'<text x="{left + pw + 15}" y="{note}" font-size="11" fill="#555">bars: ± one '
               "standard error of</text>")
    out.append(f'<text x="{left + pw + 15}" y="{note + 15}" font-size="11" fill="#555">the '
               "difference to BR-0, paired by seed</text>")
    out.append(f'<text x="{left + pw + 15}" y="{note + 40}" font-size="11" fill="#555">the '
               "stagger term runs at full weight while</text>")
    out.append(f'<text x="{left + pw + 15}" y="{note + 55}" font-size="11" fill="#555">the '
               "hints' RMS log error is ≤ 0.05, none ≥ 0.1</text>")
    out.append(f'<text x="{left + pw + 15}" y="{note + 70}" font-size="11" fill="#555">'
               "(shared/core/src/dispatch/trust.rs); σ is not</text>")
    out.append(f'<text x="{left + pw + 15}" y="{note + 85}" font-size="11" fill="#555">'
               "to scale on this axis</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    out, cell, dest = sys.argv[1:]
    found = cells(out, cell)
    first = open(glob.glob(os.path.join(out, f"H-stagger-*-{cell}.txt"))[0]).readline()
    g = re.search(r"--workers (\d+)", first)
    b = re.search(r"--slots (\d+)", first)
    wl = re.search(r"--trace (\S+)", first)
    title = (f"Hints at placement: {wl.group(1) if wl else cell}, G = {g.group(1) if g else '?'}, "
             f"B = {b.group(1) if b else '?'}, Poisson above capacity, 5 seeds")
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    with open(dest, "w") as f:
        f.write(svg(found, title))
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
