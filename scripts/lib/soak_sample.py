"""Samples a running stack for scripts/soak.sh: every INTERVAL seconds until the load process
ends, each named process's RSS and CPU share (from /proc) and decision's Assign latency over
the window (p50/p99 from the deltas of balanceroute_decision_assign_latency_seconds,
interpolated inside buckets), written
to a CSV; then a verdict: RSS flat (the last third of the samples after warm-up against the
first third) and p99 steady.

Usage: soak_sample.py OUT.csv INTERVAL WARMUP_S LOAD_PID DECISION_METRICS_URL NAME=PID[,PID...]...
A NAME ending in `*` is sampled but left out of the verdict (the emulated engine keeps a record of
every step for its report, so it grows by design).
"""
import csv
import os
import sys
import time
import urllib.request

HZ = os.sysconf("SC_CLK_TCK")
METRIC = "balanceroute_decision_assign_latency_seconds_bucket"


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ
    except OSError:
        return 0.0


def buckets(url):
    """Cumulative counts by upper bound, summed over groups."""
    out = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if not line.startswith(METRIC + "{"):
                continue
            labels, value = line.rsplit(" ", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            le = float("inf") if le == "+Inf" else float(le)
            out[le] = out.get(le, 0.0) + float(value)
    return out


def quantile(delta, q):
    """The q-quantile of a window's cumulative bucket counts, interpolated linearly inside its
    bucket as Prometheus' histogram_quantile does (bucket bounds alone are too coarse: 10 ms
    and 25 ms are neighbours)."""
    total = delta.get(float("inf"), 0.0)
    if total <= 0:
        return None
    rank = q * total
    lo, below = 0.0, 0.0
    for le in sorted(delta):
        if delta[le] >= rank:
            if le == float("inf"):
                return lo
            inside = delta[le] - below
            return lo + (le - lo) * ((rank - below) / inside if inside > 0 else 1.0)
        lo, below = le, delta[le]
    return lo


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # a zombie (the script has not reaped it yet) has ended too
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main():
    out, interval, warmup, load_pid, url = sys.argv[1:6]
    interval, warmup, load_pid = float(interval), float(warmup), int(load_pid)
    procs = []
    for spec in sys.argv[6:]:
        name, pids = spec.split("=", 1)
        procs.append((name, [int(p) for p in pids.split(",") if p]))
    names = [n for n, _ in procs]
    start = time.time()
    last_cpu = {n: sum(cpu_s(p) for p in ps) for n, ps in procs}
    last_b = buckets(url)
    rows = []
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "assigns", "p50_ms", "p99_ms"]
                   + [f"{n}_rss_mb" for n in names] + [f"{n}_cpu_pct" for n in names])
        while alive(load_pid):
            time.sleep(interval)
            t = time.time() - start
            b = buckets(url)
            delta = {le: b.get(le, 0.0) - last_b.get(le, 0.0) for le in b}
            last_b = b
            p50, p99 = quantile(delta, 0.50), quantile(delta, 0.99)
            row = {"t": t, "n": delta.get(float("inf"), 0.0), "p50": p50, "p99": p99, "rss": {}, "cpu": {}}
            for n, ps in procs:
                row["rss"][n] = sum(rss_mb(p) for p in ps)
                c = sum(cpu_s(p) for p in ps)
                row["cpu"][n] = 100 * (c - last_cpu[n]) / interval
                last_cpu[n] = c
            rows.append(row)
            ms = lambda v: "" if v is None else ("inf" if v == float("inf") else f"{v * 1000:.2f}")
            w.writerow([f"{t:.0f}", f"{row['n']:.0f}", ms(p50), ms(p99)]
                       + [f"{row['rss'][n]:.1f}" for n in names]
                       + [f"{row['cpu'][n]:.0f}" for n in names])
            f.flush()
            print(f"t={t:5.0f}s assigns={row['n']:6.0f} p50={ms(p50):>6} ms p99={ms(p99):>6} ms  "
                  + "  ".join(f"{n} {row['rss'][n]:.0f} MB {row['cpu'][n]:.0f}%" for n in names),
                  flush=True)
    steady = [r for r in rows if r["t"] >= warmup and r["n"] > 0]
    if len(steady) < 3:
        print(f"verdict: too few samples after the {warmup:.0f} s warm-up ({len(steady)})")
        return 1
    third = max(1, len(steady) // 3)
    first, last = steady[:third], steady[-third:]
    ok = True
    print(f"verdict over {len(steady)} samples after {warmup:.0f} s (first third vs last third):")
    for n in names:
        a = sum(r["rss"][n] for r in first) / len(first)
        z = sum(r["rss"][n] for r in last) / len(last)
        growth = (z - a) / a if a else 0.0
        flat = growth <= 0.10
        judged = not n.endswith("*")
        ok &= flat or not judged
        state = ("flat" if flat else "GROWING") if judged else "(not judged)"
        print(f"  {n:9} RSS {a:8.1f} MB -> {z:8.1f} MB ({growth:+.1%}) {state}")
    p = lambda rs: sorted(r["p99"] for r in rs if r["p99"] is not None)
    a, z = p(first), p(last)
    if a and z:
        med = lambda xs: xs[len(xs) // 2]
        ratio = med(z) / med(a) if med(a) > 0 else float("inf")
        steady_p99 = ratio <= 1.5
        ok &= steady_p99
        print(f"  Assign p99 (median of windows) {med(a) * 1000:.2f} ms -> {med(z) * 1000:.2f} ms "
              f"(x{ratio:.2f}) {'steady' if steady_p99 else 'RISING'}")
    print("verdict:", "RSS flat and p99 steady" if ok else "NOT steady")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
