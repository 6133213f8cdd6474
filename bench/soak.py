"""Soak test: a long training run whose every process must hold steady memory, fds and speed.

Runs ``bpslaunch --local --workers 2 --servers 2`` with this file as the worker program: a small
MLP (6 parameter tensors) trained for ``--steps`` steps with ``byteps.torch.DistributedOptimizer``.
Meanwhile it samples, every ``--period`` seconds, the resident memory (psutil RSS) and open file
descriptors of EVERY process of the job (bpslaunch, the scheduler, both servers, both workers) and
the workers' step counts (throughput).

Verdict, after the warm-up (the first ``--warmup`` steps):

* RSS of every process stays within ``--tolerance`` (5%) of its value at the end of the warm-up,
  over every later sample (the end included);
* the fd count of every process likewise (at least 1 fd of slack, for counts in the tens);
* throughput: the run after the warm-up is cut into 10 windows; in each, steps per CPU-second of
  the whole job (all six processes, user + system) is what one step costs, which other jobs on
  a shared machine do not change (wall-clock steps/s, also printed, moves by +-30% there). The
  median of the last 3 windows must be at least 80% of the median of the first 3: a leak or a
  growing structure shows as a steady decline;
* the final parameters are bit-identical on both workers.

It prints a table and the verdict, writes the samples and the verdict as JSON
(``--out``, default bench/results/soak.json), and exits 1 if the verdict is "fail".

    .venv/bin/python bench/soak.py                       # 10,000 steps (a few minutes)
    .venv/bin/python bench/soak.py --steps 1500 --warmup 300 --out /tmp/soak_quick.json
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ------------------------------------------------------------------------------ worker program


def worker(args):
    import hashlib

    import torch

    import byteps.torch as bps

    bps.init()
    rank = bps.rank()
    torch.manual_seed(1234 + rank)  # different inits: broadcast_parameters makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(64 * 16, 32, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(64 * 16, 1, generator=g)
    loss_fn = torch.nn.MSELoss()
    path = os.path.join(args.progress, f"rank{rank}")

    timeline = open(os.path.join(args.progress, f"timeline{rank}"), "w")  # "step time" lines, for throughput

    def report(step):
        now = time.time()
        with open(path + ".tmp", "w") as f:
            f.write(f"{step} {now} {os.getpid()}")
        os.replace(path + ".tmp", path)
        timeline.write(f"{step} {now}\n")

    report(0)
    for step in range(1, args.steps + 1):
        lo = (step % 16) * 64
        opt.zero_grad()
        loss = loss_fn(model(x[lo:lo + 64]), y[lo:lo + 64])
        loss.backward()
        opt.step()
        if step % args.report_every == 0 or step == args.steps:
            report(step)
    timeline.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    same = len(set(bps.allgather_object(digest))) == 1
    with open(os.path.join(args.progress, f"final{rank}.json"), "w") as f:
        json.dump({"rank": rank, "identical": same, "loss": loss.item(), "sha256": digest}, f)
    bps.shutdown()
    return 0 if same else 1


# ------------------------------------------------------------------------------ driver


def _read_progress(progress):
    """rank -> (step, wall time, pid) from the workers' progress files."""
    out = {}
    for name in os.listdir(progress):
        if name.startswith("rank") and not name.endswith(".tmp"):
            try:
                step, t, pid = open(os.path.join(progress, name)).read().split()
                out[int(name[4:])] = (int(step), float(t), int(pid))
            except (OSError, ValueError):
                pass
    return out


def _classify(launcher, progress):
    """name -> psutil.Process for every process of the job."""
    procs = {"bpslaunch": launcher}
    pid_rank = {pid: r for r, (_, _, pid) in _read_progress(progress).items()}
    servers = []
    for p in launcher.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "byteps.scheduler" in cmd:
            procs["scheduler"] = p
        elif "byteps.server" in cmd:
            servers.append(p)
        elif p.pid in pid_rank:
            procs[f"worker{pid_rank[p.pid]}"] = p
    for i, p in enumerate(sorted(servers, key=lambda p: p.pid)):
        procs[f"server{i}"] = p
    return procs


def _sample(procs):
    out = {}
    for name, p in procs.items():
        try:
            with p.oneshot():
                cpu = p.cpu_times()
                out[name] = {"rss": p.memory_info().rss, "fds": p.num_fds(), "cpu": cpu.user + cpu.system}
        except psutil.Error:
            pass
    return out


def window_rates(timeline, warmup, steps, windows=10):
    """Steps/s of rank 0 in `windows` equal runs of steps after the warm-up, from its own clock."""
    points = [(step, t) for step, t in timeline if step >= warmup]
    if len(points) < 2 * windows:
        return []
    edges = [points[round(i * (len(points) - 1) / windows)] for i in range(windows + 1)]
    return [(b[0] - a[0]) / max(1e-9, b[1] - a[1]) for a, b in zip(edges, edges[1:])]


def cpu_rates(after, windows=10):
    """Steps per CPU-second of the whole job (every process, user + system) in `windows` equal runs
    of samples: what a step costs, which other load on a shared machine does not change."""
    if len(after) < 2 * windows:
        return []
    edges = [after[round(i * (len(after) - 1) / windows)] for i in range(windows + 1)]
    cpu = [sum(x["cpu"] for x in s["procs"].values()) for s in edges]
    return [(b["step"] - a["step"]) / max(1e-9, cb - ca) for a, b, ca, cb in zip(edges, edges[1:], cpu, cpu[1:])]


def verdict(samples, steps, warmup, tolerance, timeline=()):
    """The verdict dict from the samples (see the module docstring)."""
    # from the end of the warm-up to the last sample taken while training still ran (not shutdown)
    after = [s for s in samples if warmup <= s["step"] < steps]
    if len(after) < 3:
        return {"verdict": "fail", "why": ["too few samples after the warm-up: run more steps or sample faster"]}
    base, end = after[0], after[-1]
    why, table = [], []
    for name in sorted(base["procs"]):
        rss0, fd0 = base["procs"][name]["rss"], base["procs"][name]["fds"]
        seen = [s["procs"][name] for s in after if name in s["procs"]]
        rss_max, fd_max = max(x["rss"] for x in seen), max(x["fds"] for x in seen)
        rss_end = end["procs"].get(name, seen[-1])["rss"]
        fd_end = end["procs"].get(name, seen[-1])["fds"]
        row = {"process": name, "rss_warmup_mb": rss0 / 2 ** 20, "rss_end_mb": rss_end / 2 ** 20,
               "rss_max_mb": rss_max / 2 ** 20, "rss_growth_pct": 100.0 * (rss_max - rss0) / rss0,
               "fds_warmup": fd0, "fds_end": fd_end, "fds_max": fd_max}
        table.append(row)
        if rss_max > rss0 * (1 + tolerance):
            why.append(f"{name}: RSS grew {row['rss_growth_pct']:.1f}% after the warm-up "
                       f"({row['rss_warmup_mb']:.1f} -> max {row['rss_max_mb']:.1f} MB)")
        if fd_max > fd0 + max(1, int(fd0 * tolerance)):
            why.append(f"{name}: open fds grew from {fd0} to {fd_max}")
    rates, per_cpu = window_rates(timeline, warmup, steps), cpu_rates(after)
    if not rates or not per_cpu:
        why.append("too few samples to judge throughput")
        first = last = cfirst = clast = 0.0
    else:
        # medians of three windows each: one slow window is not a trend
        first, last = sorted(rates[:3])[1], sorted(rates[-3:])[1]
        cfirst, clast = sorted(per_cpu[:3])[1], sorted(per_cpu[-3:])[1]
        if clast < 0.8 * cfirst:
            why.append(f"throughput per CPU-second fell from {cfirst:.0f} to {clast:.0f} steps")
    span = end["t"] - base["t"]
    return {"verdict": "fail" if why else "pass", "why": why, "table": table,
            "throughput": {"first_after_warmup": first, "last": last, "windows": rates,
                           "overall": (end["step"] - base["step"]) / max(1e-9, span),
                           "per_cpu_s_windows": per_cpu, "per_cpu_s_first": cfirst, "per_cpu_s_last": clast}}


def print_table(v):
    print(f"{'process':<10} {'RSS warm-up MB':>15} {'RSS end MB':>11} {'max growth':>11} {'fds warm-up':>12} "
          f"{'fds end':>8}")
    for r in v.get("table", []):
        print(f"{r['process']:<10} {r['rss_warmup_mb']:>15.1f} {r['rss_end_mb']:>11.1f} {r['rss_growth_pct']:>10.1f}% "
              f"{r['fds_warmup']:>12} {r['fds_end']:>8}")
    if "throughput" in v:
        tp = v["throughput"]
        print(f"throughput (steps/s, rank 0's clock, {len(tp['windows'])} windows after the warm-up): "
              + " ".join(f"{r:.0f}" for r in tp["windows"]))
        print(f"  first 3 windows (median) {tp['first_after_warmup']:.0f}, last 3 {tp['last']:.0f}, "
              f"overall {tp['overall']:.0f}")
        print("steps per CPU-second of the whole job, same windows: "
              + " ".join(f"{r:.0f}" for r in tp["per_cpu_s_windows"]))
        print(f"  first 3 windows (median) {tp['per_cpu_s_first']:.0f}, last 3 {tp['per_cpu_s_last']:.0f}")
    print(f"verdict: {v['verdict'].upper()}" + "".join(f"\n  - {w}" for w in v["why"]))


def drive(args):
    progress = tempfile.mkdtemp(prefix="byteps-soak-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "byteps.launcher", "--local", "--workers", "2", "--servers", "2", "--",
            sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
            "--progress", progress, "--report-every", str(args.report_every)]
    print("command:", " ".join(argv), flush=True)
    log = open(os.path.join(progress, "bpslaunch.log"), "wb")
    launcher = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    lp = psutil.Process(launcher.pid)
    samples, procs = [], {}
    start = time.time()
    try:
        while launcher.poll() is None:
            prog = _read_progress(progress)
            if len(prog) == 2 and len(procs) < 6:
                procs = _classify(lp, progress)
            if len(procs) == 6 and 0 in prog:
                snap = _sample(procs)
                if len(snap) == 6:
                    samples.append({"t": time.time(), "step": prog[0][0], "procs": snap})
                    if len(samples) % 30 == 1:
                        print(f"  t={samples[-1]['t'] - start:6.0f} s  step {prog[0][0]:6d}  " + "  ".join(
                            f"{n} {s['rss'] / 2 ** 20:.0f}MB/{s['fds']}fd" for n, s in sorted(snap.items())),
                              flush=True)
            if time.time() - start > args.limit:
                raise SystemExit(f"the job ran past --limit {args.limit} s")
            time.sleep(args.period)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(30)
        log.close()
    code = launcher.returncode
    finals = []
    for r in (0, 1):
        try:
            finals.append(json.load(open(os.path.join(progress, f"final{r}.json"))))
        except OSError:
            pass
    timeline = []
    try:
        with open(os.path.join(progress, "timeline0")) as f:
            timeline = [(int(a), float(b)) for a, b in (line.split() for line in f if line.strip())]
    except (OSError, ValueError):
        pass
    v = verdict(samples, args.steps, args.warmup, args.tolerance, timeline) if samples else \
        {"verdict": "fail", "why": ["no samples"]}
    if code != 0:
        v["verdict"] = "fail"
        v["why"].append(f"bpslaunch exited {code}: see {progress}/bpslaunch.log")
    if len(finals) != 2 or not all(f["identical"] for f in finals):
        v["verdict"] = "fail"
        v["why"].append(f"final parameters not confirmed identical on both workers: {finals}")
    wall = time.time() - start
    report = {"command": " ".join(["python", "bench/soak.py"] + sys.argv[1:]), "launched": " ".join(argv),
              "steps": args.steps, "warmup_steps": args.warmup, "tolerance": args.tolerance,
              "sample_period_s": args.period, "wall_s": wall, "exit_code": code, "final": finals,
              "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2 ** 30, 1),
                          "python": platform.python_version(), "platform": platform.platform()},
              "date": time.strftime("%Y-%m-%d"), **v, "samples": samples}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{args.steps} steps in {wall:.0f} s, {len(samples)} samples; JSON in {args.out}")
    print_table(v)
    if v["verdict"] == "pass":
        import shutil

        shutil.rmtree(progress, ignore_errors=True)
    return 0 if v["verdict"] == "pass" else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=None, help="steps before the baseline (default: steps / 10)")
    ap.add_argument("--period", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed RSS / fd growth after the warm-up")
    ap.add_argument("--limit", type=float, default=3600, help="give up after this many seconds")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak.json"))
    ap.add_argument("--report-every", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.warmup is None:
        args.warmup = args.steps // 10
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
