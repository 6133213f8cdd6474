"""Every figure README's performance section quotes, regenerated on this machine, printed as README's tables.

    .venv/bin/python bench/figures.py            # as root: everything, 3 runs of each configuration (make figures)
    .venv/bin/python bench/figures.py --runs 5 --only goodput,latency
    .venv/bin/python bench/figures.py --quick    # smoke run: tiny sizes, 1 run, small cluster (proves it works)

Each configuration is a separate run of bench/bench_users.py or bench/emulated_cluster.py in the
default environment (no BYTEPS_*, OMP_* or partition variables; those benchmarks remove inherited
ones), repeated ``--runs`` times; every cell is the min-max over the runs of each run's median (for
goodput, over the sizes from 16 MB and both naming modes too). A cell from one run says
"measured once". Groups (``--only``):

* ``goodput``: push_pull / gloo all_reduce from 16 MB in each call pattern (in place, a fresh tensor,
  out of place), on one machine with 2 and 4 worker processes, between 2 and 3 hosts (network
  namespaces, k = 0, unshaped and 1 Gbit/s; root), and the shared-memory test layout (single-process
  "machines" of one host);
* ``latency``: a 4 KB synchronous push_pull in place, against the round trip of two fresh, unbound
  processes (bench/raw_exchange.py) and against the in-job round trip taken beside it;
* ``train``: a training step, bps.DistributedOptimizer against DDP over gloo, samples/s;
* ``cluster``: the emulated cluster at default settings, time / t_opt for every k = 0..n on four
  cluster shapes (root).

Needs root for the hosts layout and the emulated cluster; without it those rows are left out and
the output says so. The whole set took 38 minutes on an idle 2-core Intel VM (goodput and latency 24,
cluster 11, train 3), and 56 and 41 on two AMD ones (goodput and latency 30 and 26, train 6 and 5,
cluster 20 and 12); measure on a machine nothing else is using, and quote the machine line printed
with the tables. GPU figures come from bench/gpu_checks.sh, on a machine with a GPU.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GROUPS = ("goodput", "latency", "train", "cluster")
PATTERNS = ("inplace", "fresh", "outofplace")
LARGE = ("16MB", "64MB")  #: the goodput cells' sizes
SHAPES = "3x1000x96MiB,2x200x46.8MB,3x500x30000001,4x500x30000001"  #: the cluster shapes README quotes (n x Mbit/s x model bytes)

#: bench_users.py configurations: (name, needs root, arguments); the table rows come from their JSON
COLLECTIVES = [
    ("one machine", False, ["--layouts", "local", "--procs", "2,4"]),
    ("hosts", True, ["--layouts", "hosts", "--procs", "2,3", "--host-rates", "0,1000"]),
    ("shared-memory test layout", False, ["--layouts", "machines", "--procs", "2"]),
]
TRAIN = [
    ("one machine", False, ["--layouts", "local", "--procs", "2,4"]),
    ("hosts", True, ["--layouts", "hosts", "--procs", "2", "--host-rates", "0,1000"]),
]


TRAIN_HEADER = "| training step, bps.DistributedOptimizer / DDP over gloo, samples/s | ratio | runs |"
CLUSTER_HEADER = "| emulated cluster at default settings: step time / t_opt (Eq. 6) | k = 0 .. n | worst | runs |"


def describe(layout, procs):
    """README's wording for a bench_users layout label."""
    if layout == "local":
        return f"one machine, {procs} worker processes"
    if layout == "machines":
        return f"{procs} single-process \"machines\" of one host (shared memory; a test layout)"
    rate = layout.split(" ", 1)[1].replace("Mbit", " Mbit/s") if " " in layout else "unshaped"
    return f"{procs} hosts (network namespaces, k = 0), {rate}"


def machine_line():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB, Linux {os.uname().release}, Python "
            f"{platform.python_version()}, torch {tv}; commit {commit or '?'}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")


def run(argv, json_path, log):
    """Run a benchmark; its JSON, or SystemExit with its output's tail."""
    started = time.time()
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    log.append({"argv": argv, "rc": res.returncode, "wall_s": time.time() - started, "loadavg": os.getloadavg()})
    print(f"  {' '.join(argv[:1] + argv[1:8])} ... exit {res.returncode}, {time.time() - started:.0f} s",
          file=sys.stderr, flush=True)
    if not os.path.exists(json_path) or (res.returncode != 0 and "emulated_cluster" not in argv[0]):
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    with open(json_path) as f:
        return json.load(f)


def span(values, fmt="{:.2f}", suffix="x"):
    """'lo-hi' (or one value) of a list; '—' when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    text = fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"
    return text + suffix


def runs_note(runs):
    return "measured once" if runs == 1 else f"{runs} runs"


# ================================================================================ the groups

def collectives(args, log, tmp):
    """{(layout, procs): {"ratios": [...], "latency": [...]}} over the runs."""
    sizes = args.sizes
    got = {}
    for name, root, extra in COLLECTIVES:
        if root and os.geteuid() != 0:
            print(f"left out (needs root): {name}", file=sys.stderr)
            continue
        for r in range(args.runs):
            path = os.path.join(tmp, f"users-{name.replace(' ', '_')}-{r}.json")
            doc = run(["bench/bench_users.py", *extra, "--sizes", sizes, "--patterns", ",".join(PATTERNS),
                       "--names", args.names, "--repeat", str(args.repeat), "--json", path], path, log)
            for q in doc["ratios"]:
                got.setdefault((q["layout"], q["procs"]), {"ratios": [], "latency": []})["ratios"].append(dict(q, run=r))
            for q in doc["latency"]:
                got.setdefault((q["layout"], q["procs"]), {"ratios": [], "latency": []})["latency"].append(dict(q, run=r))
    return got


def goodput_table(got, runs, large):
    lines = ["| push_pull / gloo all_reduce, from 16 MB | same tensor in place | fresh tensor | out of place | runs |",
             "|---|---:|---:|---:|---|"]
    for (layout, procs), data in got.items():
        cells = [span([q["ratio"] for q in data["ratios"] if q["pattern"] == p and q["size"] in large])
                 for p in PATTERNS]
        lines.append(f"| {describe(layout, procs)} | {' | '.join(cells)} | {runs_note(runs)} |")
    return "\n".join(lines)


def latency_table(got, runs, size="4KB"):
    lines = [f"| {size} synchronous push_pull, in place | byteps us | gloo us | round trip of two fresh processes us | "
             "byteps / that round trip | byteps / the job's round trip beside | runs |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for (layout, procs), data in got.items():
        rows = [q for q in data["latency"] if q["size"] == size and q["pattern"] == "inplace"]
        if not rows:
            continue
        us = "{:.0f}"
        lines.append(f"| {describe(layout, procs)} | {span([q['byteps_s'] * 1e6 for q in rows], us, '')} | "
                     f"{span([q['gloo_s'] * 1e6 for q in rows], us, '')} | "
                     f"{span([(q.get('fresh_rtt_s') or 0) * 1e6 or None for q in rows], us, '')} | "
                     f"{span([q.get('byteps_over_fresh_rtt') for q in rows])} | "
                     f"{span([q.get('byteps_over_rtt_beside') for q in rows])} | {runs_note(runs)} |")
    return "\n".join(lines)


def train(args, log, tmp):
    lines = [TRAIN_HEADER, "|---|---:|---|"]
    for name, root, extra in TRAIN:
        if root and os.geteuid() != 0:
            print(f"left out (needs root): training, {name}", file=sys.stderr)
            continue
        ratios = {}
        for r in range(args.runs):
            path = os.path.join(tmp, f"train-{name.replace(' ', '_')}-{r}.json")
            doc = run(["bench/bench_users.py", "--train", *extra, "--repeat", str(args.repeat), *args.train_extra,
                       "--json", path], path, log)
            for row in doc["results"]:
                ratios.setdefault((row["layout"], row["procs"]), []).append(row["ratio"])
        for (layout, procs), values in ratios.items():
            model = f"MLP, {doc['results'][0]['model_bytes'] / 1e6:.1f} MB"
            lines.append(f"| {describe(layout, procs)}, {model} | {span(values)} | {runs_note(args.runs)} |")
    return "\n".join(lines)


def cluster(args, log, tmp):
    if os.geteuid() != 0:
        print("left out (needs root): the emulated cluster", file=sys.stderr)
        return None
    per = {}
    for r in range(args.runs):
        path = os.path.join(tmp, f"cluster-{r}.json")
        doc = run(["bench/emulated_cluster.py", "--shapes", args.shapes, "--systems", "default,gloo", "--reps",
                   str(args.cluster_reps), "--out", path], path, log)
        for res in doc["results"]:
            if res["system"] == "default":
                per.setdefault((res["n"], res["rate_mbit"], res["model_bytes"]), {}).setdefault(res["k"], []).append(
                    res["vs_t_opt"])
    lines = [CLUSTER_HEADER, "|---|---|---:|---|"]
    for (n, rate, model), by_k in per.items():
        cells = ", ".join(f"{k}: {span(v, '{:.3f}', '')}" for k, v in sorted(by_k.items()))
        worst = max(max(v) for v in by_k.values())
        lines.append(f"| n = {n} worker hosts, {rate:g} Mbit/s, {model / 1e6:.1f} MB model | {cells} | {worst:.3f} | "
                     f"{runs_note(args.runs)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of every configuration (default 3)")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions inside each bench_users run (default 5)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"subset of {','.join(GROUPS)}")
    ap.add_argument("--names", default="fixed,auto", help="bench_users --names (default fixed,auto)")
    ap.add_argument("--shapes", default=SHAPES, help=f"emulated cluster shapes (default {SHAPES})")
    ap.add_argument("--cluster-reps", type=int, default=3, help="emulated cluster steps per result (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4KB and 1MB, 1 run, 1 repetition, small model "
                                                         "and cluster: proves the tool works; not figures")
    ap.add_argument("--json", help="everything measured (default bench/results/figures-<date>.json)")
    args = ap.parse_args()
    args.sizes, args.large, args.train_extra = "4KB,16MB,64MB", LARGE, []
    if args.quick:
        args.sizes, args.large, args.runs, args.repeat, args.names = "4KB,1MB", ("1MB",), 1, 1, "fixed"
        args.train_extra = ["--quick", "--steps", "1"]
        args.shapes, args.cluster_reps = "2x1000x4MB", 1
    groups = args.only.split(",")
    for g in groups:
        if g not in GROUPS:
            ap.error(f"unknown group {g!r}; choose from {','.join(GROUPS)}")
    machine, load0, started = machine_line(), os.getloadavg(), time.time()
    log, out = [], {}
    with tempfile.TemporaryDirectory(prefix="figures-") as tmp:
        if "goodput" in groups or "latency" in groups:
            got = collectives(args, log, tmp)
            if "goodput" in groups:
                out["goodput"] = goodput_table(got, args.runs, args.large)
            if "latency" in groups:
                out["latency"] = latency_table(got, args.runs)
        if "train" in groups:
            out["train"] = train(args, log, tmp)
        if "cluster" in groups:
            out["cluster"] = cluster(args, log, tmp)
    load1 = os.getloadavg()
    print(f"Measured on: {machine}; load average {load0[0]:.1f} before, {load1[0]:.1f} after; "
          f"{time.time() - started:.0f} s. Command: {' '.join(['bench/figures.py'] + sys.argv[1:])}\n")
    if args.quick:
        print("SMOKE RUN (--quick): tiny sizes, one run; these are not figures to quote.\n")
    for g in GROUPS:
        if out.get(g):
            print(out[g] + "\n")
    path = args.json or os.path.join(HERE, "results", f"figures-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine, "loadavg": [load0, load1], "args": vars(args), "tables": out, "runs": log},
                  f, indent=1)
    print(f"JSON: {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
