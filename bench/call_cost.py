"""What one synchronous small push_pull costs a worker: time per call and the process's CPU per call.

Run under bpslaunch, one line per worker:

    .venv/bin/bpslaunch --local --workers 4 -- .venv/bin/python bench/call_cost.py
    BYTEPS_TRANSPORT=ucx UCX_TLS=tcp BYTEPS_ENABLE_IPC=0 \\
        .venv/bin/bpslaunch --local --workers 2 -- .venv/bin/python bench/call_cost.py

Each worker makes ``--calls`` in-place push_pulls of ``--bytes`` (after 100 untimed ones) and prints
the median time of a call, the wall time per call, the CPU time of the whole process per call
(getrusage: every thread, user + system), voluntary context switches per call, how many calls ran
on the calling thread (``submit_direct``) or were handed to byteps-net after their window, the
link to server 0 and how many local links run over shared-memory rings. No benchmark loop around
the calls (no checks, no fills): this is byteps' own cost. Rank 0 also prints how the host's CPUs
spent the timed calls (/proc/stat: user, system, idle), the servers' work included.

``--blocks N`` also splits the calls into N blocks, each after a barrier (a tiny push_pull), and
prints each block's median and the CPU the process was on at its end: where a machine's processes
share its CPUs, which ones share a CPU decides a small call's time (BYTEPS_CPU_BIND,
docs/benchmarks.md "Shared-memory local links").
"""
import argparse
import resource
import statistics
import time

import torch

import byteps.common as common
import byteps.torch as bps


def _cpu():
    """The CPU this process last ran on (/proc/self/stat, field 39)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _host_cpu():
    """The host's CPU time so far, by kind (/proc/stat's first line: user, nice, system, idle, ...)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=1, help="split the calls into blocks, each after a barrier")
    ap.add_argument("--check", action="store_true",
                    help="fill the tensor before each call and check the sum after it (Python between calls, "
                         "as in bench_users.py), outside the timed call")
    args = ap.parse_args()
    bps.init()
    t = torch.ones(args.bytes // 4)
    for _ in range(100):
        bps.push_pull_inplace(t, average=False, name="call_cost")
    m0 = common.metrics()  # a job of one process has no data plane: only byteps' Python runs
    native0 = m0.get("native", {})
    direct0, adopted0 = native0.get("direct_calls", 0), native0.get("direct_adopted", 0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    h0 = _host_cpu()
    w0 = time.perf_counter()
    times, blocks = [], []
    want = float(bps.size() * (bps.size() + 1) // 2)
    per_block = max(1, args.calls // args.blocks)
    barrier = torch.zeros(1)
    for i in range(args.calls):
        if args.blocks > 1 and i % per_block == 0:
            if i:
                blocks.append((statistics.median(times[-per_block:]), _cpu()))
            bps.push_pull_inplace(barrier, name="call_cost.barrier")
        if args.check:
            t.fill_(bps.rank() + 1)
        a = time.perf_counter()
        bps.push_pull_inplace(t, average=False, name="call_cost")
        times.append(time.perf_counter() - a)
        if args.check and not (float(t[0]) == want and float(t[-1]) == want):
            raise SystemExit(f"rank {bps.rank()}: got {float(t[0])}..{float(t[-1])}, want {want}")
    wall = (time.perf_counter() - w0) / args.calls
    if args.blocks > 1:
        blocks.append((statistics.median(times[-per_block:]), _cpu()))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    host = [b - a for a, b in zip(h0, _host_cpu())]
    user = (r1.ru_utime - r0.ru_utime) / args.calls
    system = (r1.ru_stime - r0.ru_stime) / args.calls
    m = common.metrics()
    native = m.get("native", {})
    direct = native.get("direct_calls", 0) - direct0
    adopted = native.get("direct_adopted", 0) - adopted0
    link = m["servers"][0]["transport"] if m["servers"] else "none"
    rings = (native.get("local_reduce") or {}).get("rings_up", 0)
    print(f"rank {bps.rank()}: {args.bytes} B, median {statistics.median(times) * 1e6:.0f} us, wall/call "
          f"{wall * 1e6:.0f} us, cpu/call {(user + system) * 1e6:.1f} us (user {user * 1e6:.1f}), voluntary "
          f"switches/call {(r1.ru_nvcsw - r0.ru_nvcsw) / args.calls:.1f}, on the caller's thread {direct}, "
          f"handed over {adopted}, link {link!r}, local rings {rings}", flush=True)
    if bps.rank() == 0:  # every process of the job, the servers too: where the host's CPUs went
        share = [100 * x / max(sum(host), 1) for x in host]
        print(f"host CPUs during the calls: user {share[0] + share[1]:.0f}%, system {share[2] + share[5] + share[6]:.0f}% "
              f"(softirq {share[6]:.0f}%), idle {share[3] + share[4]:.0f}%", flush=True)
    if blocks:
        print(f"rank {bps.rank()} blocks (median us @ CPU): " + " ".join(f"{m * 1e6:.0f}@{c}" for m, c in blocks),
              flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
