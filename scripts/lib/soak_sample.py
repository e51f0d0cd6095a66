"""Samples a running stack for scripts/soak.sh and gives the soak's verdict.

Every INTERVAL seconds until the load process ends: each named process's RSS, open file
descriptors and CPU share (from /proc), the requests decision has answered so far and its
Assign p50/p99 over the window (from the deltas of
balanceroute_decision_assign_latency_seconds, interpolated inside buckets), and the requests σ
holds (balanceroute_snapshot_requests), written to a CSV. Then the verdict over the samples
after the warm-up (scripts/lib/soak_verdict.py): RSS, descriptors, σ's requests and p99, each
fitted against the requests answered, must not rise beyond their noise.

Usage: soak_sample.py OUT.csv INTERVAL WARMUP_S LOAD_PID DECISION_METRICS_URL SNAPSHOT_METRICS_URL
       NAME=PID[,PID...]...
A NAME ending in `*` is sampled but left out of the verdict (the emulated engine keeps a record of
every step for its report, so it grows by design).
"""
import csv
import os
import sys
import time
import urllib.request

from soak_verdict import fd_series, p99_series, rss_series, sigma_series, verdict

HZ = os.sysconf("SC_CLK_TCK")
LATENCY = "balanceroute_decision_assign_latency_seconds_bucket"
SIGMA = "balanceroute_snapshot_requests"


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / HZ
    except OSError:
        return 0.0


def scrape(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode().splitlines()


def buckets(lines):
    """Cumulative counts by upper bound, summed over groups."""
    out = {}
    for line in lines:
        if not line.startswith(LATENCY + "{"):
            continue
        labels, value = line.rsplit(" ", 1)
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        le = float("inf") if le == "+Inf" else float(le)
        out[le] = out.get(le, 0.0) + float(value)
    return out


def gauge_sum(lines, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines
               if l.startswith(name + "{") or l.startswith(name + " "))


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
    out, interval, warmup, load_pid, decision_url, snapshot_url = sys.argv[1:7]
    interval, warmup, load_pid = float(interval), float(warmup), int(load_pid)
    procs = []
    for spec in sys.argv[7:]:
        name, pids = spec.split("=", 1)
        procs.append((name, [int(p) for p in pids.split(",") if p]))
    names = [n for n, _ in procs]
    start = time.time()
    last_cpu = {n: sum(cpu_s(p) for p in ps) for n, ps in procs}
    last_b = buckets(scrape(decision_url))
    rows = []
    ms = lambda v: "" if v is None else ("inf" if v == float("inf") else f"{v * 1000:.2f}")
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "answered", "window_assigns", "p50_ms", "p99_ms", "sigma_requests"]
                   + [f"{n}_rss_mb" for n in names] + [f"{n}_fds" for n in names]
                   + [f"{n}_cpu_pct" for n in names])
        while alive(load_pid):
            time.sleep(interval)
            t = time.time() - start
            b = buckets(scrape(decision_url))
            sigma = gauge_sum(scrape(snapshot_url), SIGMA)
            delta = {le: b.get(le, 0.0) - last_b.get(le, 0.0) for le in b}
            last_b = b
            row = {"t": t, "answered": b.get(float("inf"), 0.0), "n": delta.get(float("inf"), 0.0),
                   "p50": quantile(delta, 0.50), "p99": quantile(delta, 0.99), "sigma": sigma,
                   "rss": {}, "fds": {}, "cpu": {}}
            for n, ps in procs:
                row["rss"][n] = sum(rss_mb(p) for p in ps)
                row["fds"][n] = sum(fds(p) for p in ps)
                c = sum(cpu_s(p) for p in ps)
                row["cpu"][n] = 100 * (c - last_cpu[n]) / interval
                last_cpu[n] = c
            rows.append(row)
            w.writerow([f"{t:.0f}", f"{row['answered']:.0f}", f"{row['n']:.0f}", ms(row["p50"]),
                        ms(row["p99"]), f"{sigma:.0f}"]
                       + [f"{row['rss'][n]:.1f}" for n in names]
                       + [str(row["fds"][n]) for n in names]
                       + [f"{row['cpu'][n]:.0f}" for n in names])
            f.flush()
            print(f"t={t:5.0f}s answered={row['answered']:8.0f} p50={ms(row['p50']):>6} ms "
                  f"p99={ms(row['p99']):>6} ms σ={sigma:5.0f}  "
                  + "  ".join(f"{n} {row['rss'][n]:.0f} MB {row['fds'][n]} fds {row['cpu'][n]:.0f}%"
                              for n in names),
                  flush=True)
    steady = [r for r in rows if r["t"] >= warmup and r["n"] > 0]
    xs = [r["answered"] for r in steady]
    series = []
    for n in names:
        if not n.endswith("*"):
            series.append(rss_series(n, xs, [r["rss"][n] for r in steady]))
            series.append(fd_series(n, xs, [r["fds"][n] for r in steady]))
    series.append(sigma_series(xs, [r["sigma"] for r in steady]))
    timed = [r for r in steady if r["p99"] is not None and r["p99"] != float("inf")]
    series.append(p99_series([r["answered"] for r in timed], [r["p99"] * 1000 for r in timed]))
    judged = verdict(series)
    if judged is None:
        print(f"verdict: too few samples after the {warmup:.0f} s warm-up ({len(steady)})")
        return 1
    span = (xs[-1] - xs[0]) if xs else 0
    print(f"verdict over {len(steady)} samples after {warmup:.0f} s, {span:.0f} requests answered "
          f"(each series fitted against requests answered; rise = the fit's rise over them):")
    for j in judged:
        print(j.line())
    ok = all(j.flat for j in judged)
    print("verdict:", "flat within noise" if ok else "NOT flat")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
