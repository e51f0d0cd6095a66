#!/usr/bin/env python3
"""The summary of scripts/bench-cost.sh: per set-up, the median over rounds of each measure,
CPU per progress event from the two phases, and the ratios to the floor.

Reads the summary.tsv the script writes (one line per run). Prints a table, then one line
per side, the last of which reads

    cost ratio: br-all CPU X.XXx p99 X.XXx, split CPU X.XXx p99 X.XXx

(the `load` phase's server CPU per call and added p99, each over the floor's in the same run).
Exits 1 when a run answered nothing: its figures would be meaningless.
"""

import csv
import statistics
import sys

SETUPS = ["floor", "br-all", "split"]
# The targets of each set-up's ratios to the floor (CPU, p99), printed for the reader, not judged.
TARGETS = {"br-all": (1.5, 2.0), "split": (2.0, 3.0)}


def num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def main(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        print("no runs recorded", file=sys.stderr)
        return 1
    silent = [r for r in rows if num(r["answered"]) in (None, 0.0)]
    for r in silent:
        print(f"{r['setup']} {r['side']} {r['phase']} round {r['round']}: no call answered "
              f"(errors: {r['errors']}); see its log", file=sys.stderr)
    for r in rows:
        if (num(r.get("skipped")) or 0) > 0:
            print(f"note: {r['setup']} {r['side']} {r['phase']} round {r['round']}: the load tool "
                  f"skipped {r['skipped']} calls at its in-flight limit (the set-up did not keep "
                  f"up with the offered rate)", file=sys.stderr)
    failing = [r for r in rows if r["errors"] not in ("", "-")]
    for r in failing:
        print(f"note: {r['setup']} {r['side']} {r['phase']} round {r['round']} had errors: "
              f"{r['errors']}", file=sys.stderr)

    sides = sorted({r["side"] for r in rows if r["setup"] != "floor"}) or ["-"]
    # (setup, side) -> phase -> round -> row; the floor has one side, shared by A and B.
    runs = {}
    for r in rows:
        runs.setdefault((r["setup"], r["side"]), {}).setdefault(r["phase"], {})[r["round"]] = r

    def measures(setup, side):
        by_phase = runs.get((setup, side), {})
        calls, load = by_phase.get("calls", {}), by_phase.get("load", {})
        per_event = []
        for rnd, l in load.items():
            c = calls.get(rnd)
            if c is None:
                continue
            cl, cc = num(l["cpu_us_per_call"]), num(c["cpu_us_per_call"])
            el = num(l["events_sent"]) / max(num(l["calls_sent"]) or 1, 1)
            ec = num(c["events_sent"]) / max(num(c["calls_sent"]) or 1, 1)
            if None not in (cl, cc) and el > ec:
                per_event.append((cl - cc) / (el - ec))
        col = lambda rows_, key: median(num(r.get(key)) for r in rows_.values())  # noqa: E731
        return {
            "assign_cpu": col(calls, "cpu_us_per_call") if calls else None,
            "event_cpu": median(per_event),
            "cpu": col(load, "cpu_us_per_call") if load else None,
            "csw": col(load, "csw_per_call") if load else None,
            "p50": col(load, "p50_us") if load else None,
            "p99": col(load, "p99_us") if load else None,
            "p999": col(load, "p999_us") if load else None,
            "gen": col(load, "generator_cpu_s") if load else None,
            "rss": col(load, "rss_mib") if load else None,
            "rounds": len(load),
        }

    print("median over rounds; CPU and context switches are of every server process, per call "
          "sent; latency is the load phase's added latency")
    header = ["set-up", "side", "CPU µs/Assign (calls)", "CPU µs/event", "CPU µs/call (load)",
              "csw/call", "added p50 µs", "p99 µs", "p99.9 µs", "RSS MiB", "load-tool CPU s",
              "CPU ratio", "p99 ratio"]
    table = [header]
    ratio_lines = []
    floor = measures("floor", "-")
    for side in sides:
        parts = []
        for setup in SETUPS:
            if setup == "floor" and side != sides[0]:
                continue
            m = measures(setup, "-" if setup == "floor" else side)
            if m["rounds"] == 0 and m["assign_cpu"] is None:
                continue
            cpu_ratio = p99_ratio = None
            if floor["cpu"] and m["cpu"] is not None:
                cpu_ratio = m["cpu"] / floor["cpu"]
            if floor["p99"] and m["p99"] is not None:
                p99_ratio = m["p99"] / floor["p99"]
            table.append([setup, "-" if setup == "floor" else side, fmt(m["assign_cpu"]),
                          fmt(m["event_cpu"], ".2f"), fmt(m["cpu"]), fmt(m["csw"], ".2f"),
                          fmt(m["p50"], ".0f"), fmt(m["p99"], ".0f"), fmt(m["p999"], ".0f"),
                          fmt(m["rss"], ".0f"), fmt(m["gen"], ".2f"), fmt(cpu_ratio, ".2f"), fmt(p99_ratio, ".2f")])
            if setup in TARGETS:
                parts.append(f"{setup} CPU {fmt(cpu_ratio, '.2f')}x p99 {fmt(p99_ratio, '.2f')}x")
        if parts:
            label = "" if side == "-" else f" ({side})"
            ratio_lines.append(f"cost ratio{label}: " + ", ".join(parts))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("targets (ratio to the floor): " + "; ".join(
        f"{setup} CPU <= {cpu:g}x, p99 <= {p99:g}x" for setup, (cpu, p99) in TARGETS.items()))
    if not ratio_lines or floor["cpu"] is None:
        print("cost ratio: not measured (needs the floor set-up and the load phase)")
    else:
        for line in ratio_lines:
            print(line)
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
