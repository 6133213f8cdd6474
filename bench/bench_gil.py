"""Progress without the GIL: does communication advance while the training thread runs Python?

What it measures
----------------
byteps: one worker process and one Summation Service server (``bpslaunch --local --workers 1
--servers 1`` with ``BYTEPS_FORCE_DISTRIBUTED=1``, so that a single worker still goes through the
server; nothing else is set, and inherited tuning variables are removed as in bench_users.py).
The whole job (bpslaunch, scheduler, server, worker) starts pinned to the communication core
(``--comm-core``, default 1), so every byteps thread and process runs there. In the worker, after
``bps.init()`` and one untimed round of every tensor (which creates byteps' lazily started threads),
the training thread alone moves to the training core (``--train-core``, default 0) with
``os.sched_setaffinity(0, ...)``, which on Linux applies to the calling thread only; every other
thread of the process is then checked (and if needed moved) to be on the communication core, and
the JSON lists them all with their affinity at the start and the end. Only the GIL is shared between
the training thread and byteps.

gloo (reference): two processes (``torch.distributed`` gloo, world size 2) both started on the
communication core; rank 0's main thread then moves to the training core as above. Rank 1 is the
peer (the counterpart of the byteps server).

``--local-size N`` (byteps only): one worker machine with N processes (``bpslaunch --local --workers 1
--local-size N``), which reduce locally through shared memory before the server; local rank 0 is the
measured process (its training thread on the training core), the others start the same operations
and wait for each, staying on the communication core (as gloo's peer does). Their sums then go
through the machine's local reduce (core/local.py's protocol, run by the native core).

``--compression METHOD`` (byteps only; needs ``--machines 2``, so that servers are on other machines):
byteps' push_pulls use that wire compressor (``byteps.compression.WireCompressor(METHOD)``, default
options: fp16, bf16, onebit, topk, randomk or dithering), which the native worker core applies to
each partition on its way to a server and to each reply. All-ones tensors survive fp16, bf16, onebit
and dithering exactly; topk and randomk keep some of the elements, so there a result is correct when
every element is the sum or 0. gloo runs uncompressed.

Cases: one 64 MB float32 tensor (``64MB``), and 256 tensors of 64 KB (``256x64KB``). Each timed run
starts every tensor asynchronously (``bps.push_pull_async_inplace`` / ``dist.all_reduce(...,
async_op=True)``), then:

* (a) ``wait``: the thread waits (``bps.synchronize`` / ``work.wait()`` on each, in order);
* (b) ``spin``: the thread runs pure-Python work (an integer LCG loop in chunks calibrated to
  ``--chunk-us``, default 50 us, on the idle training core) and polls (``bps.poll`` /
  ``work.is_completed()``, the oldest unfinished operation first) between chunks until all are done.

Time in flight = from just before the first start to the moment the last operation is seen done.
Reported: spin / wait (target <= 1.2), and the training thread's speed during (b): loop iterations
per second from the last start to the end, over its idle speed (the same loop with no communication,
measured just before and just after each pair of runs; target >= 85%). The speed is shown only when
at least 10 chunks ran after the last start: when everything completes while the operations are
still being started there is no window to measure. Also reported: the training thread's time to
start the operations, per operation (it holds the thread as much as any model code), how many work
chunks ran after the last start, and the share of the spin window spent in polls. Medians over
``--reps`` repetitions (default 7, after one untimed), [min-max] = spread over repetitions; the two
modes alternate order every repetition.

Commands
--------
    .venv/bin/python bench/bench_gil.py                  # byteps and gloo, both cases, 7 repetitions
    .venv/bin/python bench/bench_gil.py --quick          # smoke run (2 repetitions)
    .venv/bin/python bench/bench_gil.py --systems byteps --cases 256x64KB --reps 9
    .venv/bin/python bench/bench_gil.py --systems byteps --env BYTEPS_SPIN_US=0   # an A/B, labelled as such
    .venv/bin/python bench/bench_gil.py --systems byteps --local-size 2           # a 1x2 machine (local reduce)
    .venv/bin/python bench/bench_gil.py --systems byteps --machines 2 --compression onebit  # compressed pushes

Output: a markdown table on stdout, JSON in bench/results/gil-<date>.json (``--json``).
Needs at least 2 CPUs (the training and communication cores must differ).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from users_common import (  # noqa: E402
    bpslaunch_argv,
    clean_env,
    free_port,
    machine_meta,
    parse_env,
    spread,  # noqa: E402
)

CASES = {"64MB": (1, 64 << 20), "256x64KB": (256, 64 << 10)}
MIN_CHUNKS = 10  #: work chunks after the last start needed to report the thread's speed


# =================================================================================== training-thread work

def work(k, x=12345):
    """Pure Python: k steps of an integer LCG (holds the GIL throughout, as model code does)."""
    for _ in range(k):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    return x


def calibrate(chunk_us):
    """Iterations of :func:`work` per chunk of about ``chunk_us`` microseconds on this (idle) core."""
    n = 2000
    per = []
    for _ in range(30):
        t0 = time.perf_counter()
        work(n)
        per.append((time.perf_counter() - t0) / n)
    return max(10, int(chunk_us * 1e-6 / statistics.median(per)))


def idle_speed(k, seconds):
    """Iterations per second of chunks of :func:`work`, nothing else running in this process."""
    iters = 0
    t0 = time.perf_counter()
    while True:
        work(k)
        iters += k
        t = time.perf_counter() - t0
        if t >= seconds:
            return iters / t


# =================================================================================== threads and affinity

def thread_table():
    """[{tid, name, cpus}] for every thread of this process."""
    out = []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            cpus = sorted(os.sched_getaffinity(tid))
        except OSError:  # gone meanwhile
            continue
        out.append({"tid": tid, "name": name, "cpus": cpus})
    return out


def pin_training_thread(train_core, comm_core):
    """Move this thread alone to train_core and every other thread of the process to comm_core."""
    me = threading.get_native_id()
    os.sched_setaffinity(0, {train_core})  # pid 0: the calling thread only (Linux)
    moved = []
    for th in thread_table():
        if th["tid"] != me and th["cpus"] != [comm_core]:
            try:
                os.sched_setaffinity(th["tid"], {comm_core})
                moved.append(th["name"])
            except OSError:
                pass
    threads = thread_table()
    assert sorted(os.sched_getaffinity(0)) == [train_core], os.sched_getaffinity(0)
    return me, moved, threads


# =================================================================================== measurement (both systems)

class Ops:
    """start/poll/wait over byteps or gloo, plus a barrier with the peer (gloo only)."""

    def __init__(self, system, torch, compression=None):
        self.system = system
        self.torch = torch
        self.compression = compression  # a wire compressor's method name (byteps), or None
        if system == "byteps":
            import byteps.torch as bps
            from byteps.compression import WireCompressor

            self.bps = bps
            self.codec = WireCompressor(compression) if compression else False
        else:
            import torch.distributed as dist

            self.dist = dist

    def start(self, tensors, case):
        if self.system == "byteps":
            return [self.bps.push_pull_async_inplace(t, average=False, name=f"gil.{case}.{i}", compression=self.codec)
                    for i, t in enumerate(tensors)]
        return [self.dist.all_reduce(t, async_op=True) for t in tensors]

    def done(self, h):
        return self.bps.poll(h) if self.system == "byteps" else h.is_completed()

    def wait(self, h):
        if self.system == "byteps":
            self.bps.synchronize(h)
        else:
            h.wait()

    def barrier(self):
        if self.system == "gloo":
            self.dist.barrier()


def run_wait(ops, tensors, case):
    for t in tensors:
        t.fill_(1.0)
    ops.barrier()
    t0 = time.perf_counter()
    hs = ops.start(tensors, case)
    t_started = time.perf_counter()
    for h in hs:
        ops.wait(h)
    return {"in_flight_s": time.perf_counter() - t0, "start_s": t_started - t0}


def run_spin(ops, tensors, case, k):
    for t in tensors:
        t.fill_(1.0)
    ops.barrier()
    t0 = time.perf_counter()
    hs = ops.start(tensors, case)
    t_started = time.perf_counter()
    iters, i, n, polls, poll_s = 0, 0, len(hs), 0, 0.0
    clock = time.perf_counter
    while i < n:
        work(k)
        iters += k
        p0 = clock()
        while i < n and ops.done(hs[i]):
            i += 1
        poll_s += clock() - p0
        polls += 1
    t1 = time.perf_counter()
    for h in hs:  # releases the handles (already complete)
        ops.wait(h)
    return {"in_flight_s": t1 - t0, "start_s": t_started - t0, "spin_s": t1 - t_started, "iters": iters,
            "chunks": polls, "speed": iters / (t1 - t_started), "poll_s": poll_s}


def measure(args, ops, torch, pin):
    """The training thread's side (byteps worker, or gloo rank 0)."""
    cases = args.cases.split(",")
    tensors = {c: [torch.empty(CASES[c][1] // 4) for _ in range(CASES[c][0])] for c in cases}
    for c in cases:  # declarations, lazily started threads, first-touch of every buffer
        run_wait(ops, tensors[c], c)
    me, moved, threads_start = pin()
    k = calibrate(args.chunk_us)
    results = {c: [] for c in cases}
    for rep in range(1 + args.reps):
        for c in cases:
            ops.barrier()
            before = idle_speed(k, args.idle_s / 2)
            modes = ("wait", "spin") if rep % 2 == 0 else ("spin", "wait")
            got = {}
            for m in modes:
                got[m] = run_wait(ops, tensors[c], c) if m == "wait" else run_spin(ops, tensors[c], c, k)
            ops.barrier()
            idle = (before + idle_speed(k, args.idle_s / 2)) / 2  # around the two runs: load drifts
            want = 2.0 if ops.system == "gloo" else float(ops.bps.size())
            # topk and randomk send some elements only: the others come back 0
            sparse = ops.system == "byteps" and ops.compression in ("topk", "randomk")
            ok = all(bool(((t == want) | (t == 0)).all()) if sparse else float(t[0]) == want and float(t[-1]) == want
                     for t in tensors[c])
            if rep >= 1:
                sp = got["spin"]
                results[c].append({"wait_s": got["wait"]["in_flight_s"], "spin_s": sp["in_flight_s"],
                                   "ratio": sp["in_flight_s"] / got["wait"]["in_flight_s"],
                                   # too few chunks after the last start: no speed to speak of
                                   "speed_rel": sp["speed"] / idle if sp["chunks"] >= MIN_CHUNKS else None,
                                   "idle_speed": idle, "spin_speed": sp["speed"], "chunks": sp["chunks"],
                                   "start_s": (sp["start_s"] + got["wait"]["start_s"]) / 2,
                                   "poll_share": sp["poll_s"] / sp["spin_s"], "correct": ok})
        print(f"BENCH-PROGRESS {ops.system} rep {rep}", flush=True)
    return {"results": results, "chunk_iters": k, "chunk_us": args.chunk_us, "training_tid": me,
            "moved_to_comm_core": moved, "threads_start": threads_start, "threads_end": thread_table(),
            "switch_interval_s": sys.getswitchinterval()}


def peer(args, ops, torch):
    """gloo rank 1: the same collectives, waiting for each (it stays on the communication core)."""
    cases = args.cases.split(",")
    tensors = {c: [torch.empty(CASES[c][1] // 4) for _ in range(CASES[c][0])] for c in cases}
    for c in cases:
        run_wait(ops, tensors[c], c)
    for rep in range(1 + args.reps):
        for c in cases:
            ops.barrier()
            for _ in range(2):
                run_wait(ops, tensors[c], c)
            ops.barrier()


def worker_main(args):
    import torch

    if args.system == "byteps":
        import byteps.torch as bps

        bps.init()
        assert bps.size() == args.machines * args.local_size, bps.size()
        ops = Ops("byteps", torch, args.compression)
        if bps.rank() > 0:  # a peer process: same operations, waited for
            peer(args, ops, torch)
            bps.shutdown()
            return 0
        res = measure(args, ops, torch, lambda: pin_training_thread(args.train_core, args.comm_core))
        from byteps import common
        res["local_stats"] = common.metrics()["native"]["local_reduce"] if args.local_size > 1 else None
        bps.shutdown()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
        ops = Ops("gloo", torch)
        if args.rank == 1:
            peer(args, ops, torch)
            dist.barrier()
            dist.destroy_process_group()
            return 0
        res = measure(args, ops, torch, lambda: pin_training_thread(args.train_core, args.comm_core))
        dist.barrier()
        dist.destroy_process_group()
    res["torch_threads"] = torch.get_num_threads()
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "BYTEPS_FORCE"))}
    with open(args.out, "w") as f:
        json.dump(res, f)
    return 0


# =================================================================================== driver

def _pinned(core):
    return lambda: os.sched_setaffinity(0, {core})


def run_system(system, args):
    out = tempfile.mktemp(prefix=f"bench-gil-{system}-", suffix=".json")
    env, _ = clean_env(parse_env(args.env), quiet=True)
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--system", system, "--out", out,
          "--cases", args.cases, "--reps", str(args.reps), "--chunk-us", str(args.chunk_us),
          "--idle-s", str(args.idle_s), "--train-core", str(args.train_core), "--comm-core", str(args.comm_core),
          "--local-size", str(args.local_size), "--machines", str(args.machines)]
    if args.compression and system == "byteps":
        me += ["--compression", args.compression]
    if system == "byteps":
        env["BYTEPS_FORCE_DISTRIBUTED"] = "1"
        cmds = [[*bpslaunch_argv(), "--local", "--workers", str(args.machines), "--local-size", str(args.local_size),
                 "--servers", str(args.machines), "--no-prefix",
                 "--timeout", str(args.job_timeout), "--", *me]]
    else:
        port = free_port()
        cmds = [[*me, "--rank", str(r), "--port", str(port)] for r in (0, 1)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=_pinned(args.comm_core)) for c in cmds]
    tails = []

    def drain(p, tail):
        for line in p.stdout:
            if line.startswith("BENCH-PROGRESS"):
                print(f"  {line.split(' ', 1)[1].strip()}", file=sys.stderr, flush=True)
            else:
                tail.append(line)
                del tail[:-60]

    readers = []
    for p in procs:
        tails.append([])
        th = threading.Thread(target=drain, args=(p, tails[-1]), daemon=True)
        th.start()
        readers.append(th)
    deadline = time.monotonic() + args.job_timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(max(1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes.append("timeout")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for th in readers:
        th.join(5)
    if any(c != 0 for c in codes) or not os.path.exists(out):
        raise SystemExit(f"{system} job failed ({codes}):\n" + "".join(line for t in tails for line in t))
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def summarize(system, res):
    rows = []
    for case, reps in res["results"].items():
        w, s, r, v, ps, st = (spread([x[f] for x in reps]) for f in ("wait_s", "spin_s", "ratio", "speed_rel",
                                                                       "poll_share", "start_s"))
        rows.append({"system": system, "case": case, "reps": len(reps), "wait_s": w[0], "wait_min": w[1],
                     "wait_max": w[2], "spin_s": s[0], "spin_min": s[1], "spin_max": s[2], "ratio": r[0],
                     "ratio_min": r[1], "ratio_max": r[2], "speed_rel": v[0], "speed_min": v[1], "speed_max": v[2],
                     "poll_share": ps[0], "start_s": st[0], "start_us_per_op": st[0] / CASES[case][0] * 1e6,
                     "chunks": statistics.median(x["chunks"] for x in reps),
                     "correct": all(x["correct"] for x in reps), "per_rep": reps,
                     "meets_ratio": r[0] <= 1.2, "meets_speed": None if v[0] is None else v[0] >= 0.85})
    return rows


def table(rows):
    def ms(r, f):
        return f"{r[f] * 1e3:.1f}"

    out = ["| system | case | wait: in flight ms [min-max] | spin: in flight ms [min-max] | spin / wait [min-max] "
           "(target <= 1.2) | thread speed during spin / idle [min-max] (target >= 85%) | work chunks after the "
           "last start | start, us per op | time in polls | correct |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["speed_rel"] is None:
            speed = f"— (fewer than {MIN_CHUNKS} chunks)"
        else:
            speed = (f"{100 * r['speed_rel']:.0f}% [{100 * r['speed_min']:.0f}-{100 * r['speed_max']:.0f}%] "
                     f"{'ok' if r['meets_speed'] else 'MISSED'}")
        out.append(f"| {r['system']} | {r['case']} | {ms(r, 'wait_s')} [{ms(r, 'wait_min')}-{ms(r, 'wait_max')}] | "
                   f"{ms(r, 'spin_s')} [{ms(r, 'spin_min')}-{ms(r, 'spin_max')}] | {r['ratio']:.2f} "
                   f"[{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] {'ok' if r['meets_ratio'] else 'MISSED'} | {speed} | "
                   f"{r['chunks']:.0f} | {r['start_us_per_op']:.0f} | {100 * r['poll_share']:.0f}% | "
                   f"{'yes' if r['correct'] else 'NO'} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--systems", default="byteps,gloo", help="byteps and/or gloo (default both)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (default 7, after one untimed)")
    ap.add_argument("--chunk-us", type=float, default=50.0, help="pure-Python work between polls, us (default 50)")
    ap.add_argument("--idle-s", type=float, default=0.2, help="idle-speed measurement per case and repetition, s")
    ap.add_argument("--train-core", type=int, default=0, help="the training thread's core (default 0)")
    ap.add_argument("--comm-core", type=int, default=1, help="every other thread and process (default 1)")
    ap.add_argument("--local-size", type=int, default=1,
                    help="byteps worker processes on the one machine (default 1; >1: local reduce, rank 0 measured)")
    ap.add_argument("--machines", type=int, default=1,
                    help="byteps worker machines, each with a server (default 1: one machine's sum is the job's, "
                         "so only a local reduce moves data; 2: single-process machines push to servers)")
    ap.add_argument("--compression", choices=["fp16", "bf16", "onebit", "topk", "randomk", "dithering"],
                    help="byteps' push_pulls use this wire compressor (needs --machines 2: servers elsewhere)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 repetitions")
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--json", help="JSON path (default bench/results/gil-<date>.json)")
    ap.add_argument("--env", action="append", metavar="KEY=VALUE",
                    help="set a variable in the jobs (repeatable), e.g. BYTEPS_SPIN_US=0 for an A/B; printed with "
                         "the results")
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    if args.quick and "--reps" not in sys.argv:
        args.reps = 2
        args.idle_s = 0.1
    cores = os.sched_getaffinity(0)
    if args.train_core == args.comm_core or not {args.train_core, args.comm_core} <= cores:
        print(f"needs two different available cores (have {sorted(cores)}; --train-core {args.train_core}, "
              f"--comm-core {args.comm_core})", file=sys.stderr)
        return 2
    if args.compression and args.machines < 2:
        ap.error("--compression needs --machines 2: a colocated server reads shared memory, never compressed")
    for c in args.cases.split(","):
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {','.join(CASES)}")
    _, stripped = clean_env()
    explicit_env = parse_env(args.env)
    meta = dict(machine_meta(), stripped_env=stripped, explicit_env=explicit_env, args=vars(args))
    started = time.time()
    rows, raw = [], {}
    for system in args.systems.split(","):
        print(f"job: {system}", file=sys.stderr, flush=True)
        res = run_system(system, args)
        raw[system] = {k: v for k, v in res.items() if k != "results"}
        rows += summarize(system, res)
    meta["wall_s"] = time.time() - started
    meta["loadavg_end"] = os.getloadavg()
    print(f"## Progress without the GIL: training thread alone on core {args.train_core}, everything else on "
          f"core {args.comm_core}" + (f"; SET: {explicit_env}" if explicit_env else "") + "\n")
    print(table(rows))
    b = raw.get("byteps") or raw.get("gloo")
    print(f"\nin flight = first start to last completion seen; spin = pure-Python chunks of {args.chunk_us:g} us "
          f"({b['chunk_iters']} LCG steps) with a poll between chunks; speed = loop iterations/s during spin over "
          f"the idle rate measured just before and after the pair. Medians of {args.reps} repetitions. byteps: "
          f"{args.machines} worker machine(s) x {args.local_size} process(es), {args.machines} server(s) "
          f"(BYTEPS_FORCE_DISTRIBUTED=1)" + (f", wire compressor {args.compression}" if args.compression else "") +
          f"; gloo: 2 ranks, the peer on core {args.comm_core}. "
          f"sys.getswitchinterval() = {b['switch_interval_s'] * 1e3:g} ms; load average "
          f"{meta['loadavg'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}.")
    for system, r in raw.items():
        others = sorted({t["name"] for t in r["threads_end"] if t["tid"] != r["training_tid"]})
        stray = [t["name"] for t in r["threads_end"] if t["tid"] != r["training_tid"] and t["cpus"] != [args.comm_core]]
        print(f"{system}: other threads {', '.join(others)}" + (f"; NOT on core {args.comm_core}: {stray}" if stray
                                                                 else f" (all on core {args.comm_core})"))
    path = args.json or os.path.join(HERE, "results", f"gil-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows, "threads": raw}, f, indent=1, default=str)
    print(f"JSON: {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
