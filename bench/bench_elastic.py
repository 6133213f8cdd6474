"""Elastic Summation Service on the emulated cluster (docs/elastic.md): what a server change costs.

Two jobs on network namespaces with tc-limited links (bench/netns.py; run as root). Each is 3
worker machines, each with one worker process training tests/scenarios_elastic.py's SGD loop with
exact sums (default environment apart from BYTEPS_ELASTIC=1 and short heartbeats):

* **kill**: servers on w0, w1 and the extra CPU machine x0. x0's server is SIGKILLed after step
  ``--at``. The bench reports:
  - the time from the kill to the scheduler's commit of the new membership (detection plus switch);
  - the switch itself as the scheduler logs it;
  - the slowest step around the kill, against the median step before.
* **join**: a colocated server on each worker machine (k = 0). An extra CPU machine's server starts
  after step ``--at`` (k = 1). The bench reports:
  - the median step time before and after, against the plan's t_opt(n, k) ratio (Eq. 6);
  - each server's share of the bytes the workers sent, against Eq. 1-2.

* **spot**: what spot CPU servers buy. A colocated server on each worker machine (k = 0); extra CPU
  machines' servers join one by one (k = 1, 2), then leave (SIGKILL, as a preemption: k = 1, 0), each
  after ``--phase`` steps of the previous membership. The bench reports the median step time of
  each phase against the first, beside the plan's t_opt(n, k) / t_opt(n, 0) (Eq. 6).

    sudo .venv/bin/python bench/bench_elastic.py              # 100 Mbit/s links, 30 steps
    sudo .venv/bin/python bench/bench_elastic.py --rate-mbit 400 --steps 40
    sudo .venv/bin/python bench/bench_elastic.py --only spot --phase 8
"""
import argparse
import os
import re
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402
from test_elastic import read_progress  # noqa: E402
from test_netns_elastic import ElasticJob, byte_shares  # noqa: E402  (the same job the tests run)

from byteps import placement  # noqa: E402


def slowest(results, step):
    return max(v["times"][step] for v in results.values())


def run_kill(args):
    hosts = ["w0", "w1", "w2", "x0", "sched"]
    with netns.Network(hosts, rate_mbit=args.rate_mbit) as net:
        job = ElasticJob(net, tempfile.mkdtemp(prefix="bench-elastic-kill-"), ["w0", "w1", "x0"],
                         ["w0", "w1", "w2"], {"steps": args.steps})
        job.wait_step(args.at)
        killed = time.monotonic()
        job.procs["server2"].send_signal(signal.SIGKILL)
        committed = job.membership_logged(1, 60)
        results = job.wait_workers(600)
        log = job.log("scheduler")
    switch = float(re.search(r"the switch took ([0-9.]+) s", log).group(1))
    before = statistics.median(slowest(results, s) for s in range(2, args.at))
    around = max(slowest(results, s) for s in range(args.at, min(args.at + 3, args.steps)))
    after = statistics.median(slowest(results, s) for s in range(args.at + 3, args.steps))
    print(f"kill: {args.rate_mbit:g} Mbit/s, n=3, servers w0, w1 + x0; x0's server SIGKILLed after step {args.at}")
    print(f"  kill -> new membership committed: {committed - killed:.3f} s (the switch itself: {switch:.3f} s)")
    print(f"  step before {before:.3f} s, slowest step around the kill {around:.3f} s, after {after:.3f} s")
    print("  every step's sums and the final parameters exact on every worker")


def run_join(args):
    n = 3
    with netns.Network(["w0", "w1", "w2", "x0", "sched"], rate_mbit=args.rate_mbit) as net:
        job = ElasticJob(net, tempfile.mkdtemp(prefix="bench-elastic-join-"), ["w0", "w1", "w2"],
                         ["w0", "w1", "w2"], {"steps": args.steps})
        job.wait_step(args.at)
        started = time.monotonic()
        job.start_server("x0", "server3")
        admitted = job.membership_logged(1, 60)
        results = job.wait_workers(600)

    def shares(step):
        return {s: round(x, 3) for s, x in byte_shares(results, step).items()}
    pre = statistics.median(slowest(results, s) for s in range(2, args.at))
    post = statistics.median(slowest(results, s) for s in range(args.at + 4, args.steps))
    t0, t1 = (placement.plan(n, k, 1 << 20, 1.0).t_opt for k in (0, 1))
    w_std, w_col = 2 * (n - 1), n - 1
    total = n * w_std + 3 * (n - 1) * w_col
    print(f"join: {args.rate_mbit:g} Mbit/s, n=3 with colocated servers; x0's server started after step {args.at}")
    print(f"  server start -> admitted (new membership committed): {admitted - started:.1f} s "
          "(includes the new process importing byteps)")
    print(f"  median step {pre:.3f} s (k=0) -> {post:.3f} s (k=1): {post / pre:.3f}x; the plan: {t1 / t0:.3f}x")
    print(f"  byte shares before {shares(args.at - 1)}")
    print(f"  byte shares after  {shares(-1)}; Eq. 1-2: standalone {n * w_std / total:.3f}, "
          f"colocated {(n - 1) * w_col / total:.3f} each")


def run_spot(args):
    n, extra = 3, ["x0", "x1"]
    changes = [("join", "x0"), ("join", "x1"), ("leave", "x1"), ("leave", "x0")]
    steps = args.phase * (len(changes) + 1) + 5 * len(changes)  # a change takes a few steps to commit
    with netns.Network(["w0", "w1", "w2", *extra, "sched"], rate_mbit=args.rate_mbit) as net:
        job = ElasticJob(net, tempfile.mkdtemp(prefix="bench-elastic-spot-"), ["w0", "w1", "w2"],
                         ["w0", "w1", "w2"], {"steps": steps})
        bounds, k = [(0, 0)], 0  # (first step of the phase, k)
        for members, (what, host) in enumerate(changes, start=1):
            job.wait_step(bounds[-1][0] + args.phase, timeout=300)
            if what == "join":
                job.start_server(host, f"server-{host}")
                k += 1
            else:
                job.procs[f"server-{host}"].send_signal(signal.SIGKILL)
                k -= 1
            job.membership_logged(members, 120)
            at = min(read_progress(job.tmp, r) for r in range(n))
            bounds.append((at + 2, k))  # the step in flight and the next one may still use the old servers
        results = job.wait_workers(900)
    t = {kk: placement.plan(n, kk, 1 << 20, 1.0).t_opt for kk in range(len(extra) + 1)}
    print(f"spot: {args.rate_mbit:g} Mbit/s, n={n} with colocated servers; extra CPU servers join, then are killed "
          f"(every phase {args.phase} steps after the change is committed)")
    print("  | phase | k | steps | median step s | vs k=0 | the plan: t_opt(k)/t_opt(0) | bytes sent to each server |")
    base = None
    for i, (first, kk) in enumerate(bounds):
        last = bounds[i + 1][0] - 2 if i + 1 < len(bounds) else steps - 1
        times = [slowest(results, s) for s in range(max(first, 2), last + 1)]
        med = statistics.median(times)
        base = base or med
        shares = ", ".join(f"{s}: {x:.3f}" for s, x in byte_shares(results, last).items())
        print(f"  | {i} | {kk} | {max(first, 2)}-{last} | {med:.3f} | {med / base:.3f} | {t[kk] / t[0]:.3f} | {shares} |")
    print("  every step's sums and the final parameters exact on every worker")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbit", type=float, default=100, help="per-host link rate (default 100)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per job (default 30)")
    ap.add_argument("--at", type=int, default=10, help="the step after which the change happens (default 10)")
    ap.add_argument("--phase", type=int, default=8, help="spot: steps per membership (default 8)")
    ap.add_argument("--only", choices=("kill", "join", "spot"), help="run one of the jobs")
    args = ap.parse_args()
    why = netns.available()
    if why is not None:
        raise SystemExit(f"emulated cluster unavailable: {why}")
    for name, run in (("kill", run_kill), ("join", run_join), ("spot", run_spot)):
        if args.only in (None, name):
            run(args)


if __name__ == "__main__":
    main()
