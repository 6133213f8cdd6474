"""push_pull goodput against torch.distributed all_reduce (gloo), side by side on the same processes.

One machine, N worker processes plus Summation Service servers, all started by ``bpslaunch
--local``. Every worker process joins both byteps and a gloo process group; for each tensor size
the two are timed alternately, after a barrier, several times; medians are reported. Goodput =
tensor bytes / time per operation (the "algorithm bandwidth" of NCCL-tests). The servers' CPU time
is sampled to report core-seconds per GB summed.

    python bench/bench_push_pull.py                      # 2 and 4 workers, 1 server, all sizes
    python bench/bench_push_pull.py --sweep              # partition size x credit sweep at 64 MB
    python bench/bench_push_pull.py --overhead           # per-partition cost (tiny partitions)
    python bench/bench_push_pull.py --quick              # a short smoke run
    python bench/bench_push_pull.py --layout local --local-strategy owners,topology --repeat 3
                                                         # BYTEPS_LOCAL_STRATEGY side by side, alternating

Layouts (--layout): "local" = one worker machine with N processes that reduce through shared
memory first (bpslaunch --workers 1 --local-size N: the paper's one-machine case); "machines" =
N single-process worker machines (bpslaunch --workers N), each pushing to the colocated server
through shared memory.

Writes a markdown table to stdout, JSON to bench/results/, and a PNG plot with --plot.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20, "256MB": 256 << 20}


# --------------------------------------------------------------------------------- worker side

def worker(args):
    import torch
    import torch.distributed as dist

    import byteps.torch as bps

    torch.set_num_threads(1)
    bps.init()
    if args.cpu_only:
        return cpu_worker(args, bps, torch)
    if args.thread_cpu:
        return thread_cpu_worker(args, bps, torch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=bps.rank(),
                            world_size=bps.size())
    results = {}
    for label in args.sizes.split(","):
        nbytes = SIZES[label]
        t = torch.ones(nbytes // 4)
        reps = args.reps if nbytes < (64 << 20) else max(3, args.reps // 2)
        warm = 2 if nbytes >= (16 << 20) else 10
        times = {"byteps": [], "gloo": []}
        inner = 1 if nbytes >= (1 << 20) else 20  # small tensors: time a batch of calls
        for i in range(warm + reps):
            for impl in ("byteps", "gloo"):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(inner):
                    if impl == "byteps":
                        bps.push_pull_inplace(t, average=False, name=f"bench.{label}")
                    else:
                        dist.all_reduce(t)
                elapsed = (time.perf_counter() - start) / inner
                if i >= warm:
                    times[impl].append(elapsed)
        results[label] = {impl: statistics.median(v) for impl, v in times.items()}
        results[label]["bytes"] = nbytes
        if bps.rank() == 0:
            print(f"BENCH-PROGRESS {label}", flush=True)
    if bps.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    bps.shutdown()


def cpu_worker(args, bps, torch):
    """byteps only: rank 0 prints markers around the timed loop so the driver can read server CPU."""
    for label in args.sizes.split(","):
        t = torch.ones(SIZES[label] // 4)
        for _ in range(3):
            bps.push_pull_inplace(t, average=False, name=f"cpu.{label}")
        bps.barrier()
        if bps.rank() == 0:
            print(f"BENCH-MARK start {label}", flush=True)
            time.sleep(0.3)  # let the driver sample
        bps.barrier()
        start = time.perf_counter()
        for _ in range(args.reps):
            bps.push_pull_inplace(t, average=False, name=f"cpu.{label}")
        elapsed = time.perf_counter() - start
        bps.barrier()
        if bps.rank() == 0:
            print(f"BENCH-MARK end {label} {elapsed}", flush=True)
            time.sleep(0.3)
        bps.barrier()
    bps.shutdown()


def thread_cpus(pid):
    """CPU seconds (user + system) of each named thread of a process, from /proc (core/threads.py names them)."""
    import glob

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread exited meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_cpu_worker(args, bps, torch):
    """--overhead: push_pull one tensor in tiny partitions ``--ops`` times; rank 0 reports the CPU time
    of every thread of itself and of the servers, per partition of its tensor."""
    import psutil

    label = args.sizes.split(",")[0]
    t = torch.ones(SIZES[label] // 4)
    for _ in range(3):
        bps.push_pull_inplace(t, average=False, name="overhead")
    servers = [p.pid for p in psutil.Process(os.getppid()).children()
               if "byteps.server" in " ".join(p.cmdline())]
    procs = {"worker": os.getpid(), **{f"server{i}": pid for i, pid in enumerate(servers)}}
    bps.barrier()
    before = {name: thread_cpus(pid) for name, pid in procs.items()}
    start = time.perf_counter()
    for _ in range(args.ops):
        bps.push_pull_inplace(t, average=False, name="overhead")
    elapsed = time.perf_counter() - start
    after = {name: thread_cpus(pid) for name, pid in procs.items()}
    if bps.rank() == 0:
        parts = args.ops * -(-SIZES[label] // int(os.environ["BYTEPS_PARTITION_BYTES"]))
        cpu = {proc: {th: (after[proc].get(th, 0.0) - v) / parts * 1e6 for th, v in threads.items()
                      if after[proc].get(th, 0.0) - v > 0.005}
               for proc, threads in before.items()}
        with open(args.out, "w") as f:
            json.dump({label: {"us_per_partition": elapsed / parts * 1e6, "thread_us_per_partition": cpu,
                               "partitions": parts}}, f)
    bps.barrier()
    bps.shutdown()


# --------------------------------------------------------------------------------- driver side

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(workers, servers, sizes, reps, env_extra=None, progress=None, layout="local", extra_args=()):
    """One bpslaunch job; returns (per-size medians, server core-seconds)."""
    import psutil

    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    shape = ["--workers", "1", "--local-size", str(workers)] if layout == "local" else ["--workers", str(workers)]
    cmd = [sys.executable, "-m", "byteps.launcher", "--local", *shape, "--servers", str(servers),
           "--no-prefix", "--", sys.executable, os.path.abspath(__file__), "--worker", "--sizes", ",".join(sizes),
           "--reps", str(reps), "--gloo-port", str(free_port()), "--out", out, *extra_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = psutil.Process(proc.pid)
    server_cpu = {}
    marks = {}
    log = []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("BENCH-PROGRESS") and progress is not None:
            progress.update(1)
        try:  # sample the servers' CPU time while they live
            for child in launcher.children(recursive=True):
                if "byteps.server" in " ".join(child.cmdline()):
                    t = child.cpu_times()
                    server_cpu[child.pid] = t.user + t.system
        except psutil.Error:
            pass
        if line.startswith("BENCH-MARK"):
            _, what, label, *rest = line.split()
            marks[(what, label)] = (sum(server_cpu.values()), float(rest[0]) if rest else None)
    if proc.wait() != 0 or not (marks or os.path.exists(out)):
        raise SystemExit(f"benchmark job failed ({proc.returncode}):\n{''.join(log[-40:])}")
    if marks:
        return {label: {"server_cpu": marks[("end", label)][0] - marks[("start", label)][0],
                        "elapsed": marks[("end", label)][1]} for (what, label) in marks if what == "end"}, None
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res, sum(server_cpu.values())


def compare_strategies(args):
    """BYTEPS_LOCAL_STRATEGY values side by side (one machine, N processes): the jobs alternate
    between strategies ``--repeat`` times, and each cell is the median over those jobs of the
    per-job medians, so load that comes and goes on the machine hits every strategy alike."""
    strategies = args.local_strategy.split(",")
    counts = [int(w) for w in args.workers.split(",")]
    sizes = args.sizes.split(",")
    runs = {}  # (strategy, workers, size) -> [(byteps s, gloo s) per job]
    for _ in range(args.repeat):
        for workers in counts:
            for strategy in strategies:
                res, _ = run_job(workers, args.servers, sizes, args.reps, {"BYTEPS_LOCAL_STRATEGY": strategy})
                for label, r in res.items():
                    runs.setdefault((strategy, workers, label), []).append((r["byteps"], r["gloo"]))
    head = " | ".join(f"{s} ms | {s} / gloo" for s in strategies)
    lines = [f"| processes | size | {head} | {strategies[-1]} / {strategies[0]} |",
             "|---:|---|" + "---:|" * (2 * len(strategies) + 1)]
    for workers in counts:
        for label in sizes:
            cells, times = [], []
            for strategy in strategies:
                got = runs[(strategy, workers, label)]
                t = statistics.median(b for b, _ in got)
                ratio = statistics.median(g / b for b, g in got)
                cells.append(f"{t * 1e3:.2f} | {ratio:.2f}")
                times.append(t)
            lines.append(f"| {workers} | {label} | {' | '.join(cells)} | {times[-1] / times[0]:.2f} |")
    print("\n".join(lines))
    return 0


def table(all_results):
    lines = ["| layout | workers | size | byteps ms | gloo ms | byteps GB/s | gloo GB/s | byteps / gloo |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (layout, workers), res in all_results:
        for label, r in res.items():
            b, g = r["byteps"], r["gloo"]
            lines.append(f"| {layout} | {workers} | {label} | {b * 1e3:.3f} | {g * 1e3:.3f} | "
                         f"{r['bytes'] / b / 1e9:.2f} | {r['bytes'] / g / 1e9:.2f} | {g / b:.2f} |")
    return "\n".join(lines)


def plot(all_results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (layout, workers), res in all_results:
        labels = list(res)
        xs = [res[k]["bytes"] for k in labels]
        ax.plot(xs, [res[k]["bytes"] / res[k]["byteps"] / 1e9 for k in labels], "-o",
                label=f"byteps, {workers} workers ({layout})")
        if layout == "local":  # gloo sees the same processes in both layouts
            ax.plot(xs, [res[k]["bytes"] / res[k]["gloo"] / 1e9 for k in labels], "--s",
                    label=f"gloo, {workers} workers")
    ax.set_xscale("log", base=2)
    ax.set_xticks([SIZES[k] for k in SIZES])
    ax.set_xticklabels(list(SIZES))
    ax.set_xlabel("tensor size")
    ax.set_ylabel("goodput (GB/s, tensor bytes / time)")
    ax.set_title("push_pull vs gloo all_reduce, one machine (2 cores)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--workers", default="2,4", help="worker process counts (comma list)")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="2 workers, 3 sizes, 3 reps")
    ap.add_argument("--sweep", action="store_true", help="partition size x credit sweep at 64 MB, 2 workers")
    ap.add_argument("--overhead", action="store_true", help="per-partition cost: 16 MB in 4 KB partitions")
    ap.add_argument("--cpu-cost", action="store_true", help="server core-seconds per GB summed (byteps only)")
    ap.add_argument("--cpu-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--thread-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ops", type=int, default=40, help="--overhead: push_pulls per measurement")
    ap.add_argument("--layout", choices=["local", "machines", "both"], default="both")
    ap.add_argument("--local-strategy", help="compare BYTEPS_LOCAL_STRATEGY values, e.g. owners,topology "
                    "(one machine with --workers processes each)")
    ap.add_argument("--repeat", type=int, default=1, help="with --local-strategy: jobs per strategy, alternating")
    ap.add_argument("--plot", help="write a PNG plot here")
    ap.add_argument("--json", help="write all results as JSON here")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from tqdm import tqdm

    if args.local_strategy:
        return compare_strategies(args)

    if args.sweep:
        rows = ["| partition | credit | byteps ms | gloo ms | byteps / gloo |", "|---:|---:|---:|---:|---:|"]
        combos = [(p, c) for p in (256 << 10, 1 << 20, 4096000, 16 << 20) for c in (1, 4, 16)]
        for part, credit in tqdm(combos, desc="sweep"):
            res, _ = run_job(2, args.servers, ["64MB"], args.reps,
                             {"BYTEPS_PARTITION_BYTES": str(part), "BYTEPS_SCHEDULING_CREDIT": str(credit)})
            r = res["64MB"]
            rows.append(f"| {part} | {credit} | {r['byteps'] * 1e3:.1f} | {r['gloo'] * 1e3:.1f} | "
                        f"{r['gloo'] / r['byteps']:.2f} |")
        print("\n".join(rows))
        return 0

    if args.cpu_cost:
        rows = ["| layout | workers | size | pushes to servers | server core-s | core-s per GB summed | "
                "push_pull GB/s |", "|---|---:|---|---:|---:|---:|---:|"]
        reps = args.reps * 3
        for layout in ("machines", "local"):
            res, _ = run_job(2, args.servers, ["16MB", "64MB"], reps, layout=layout, extra_args=["--cpu-only"])
            for label, r in res.items():
                pushes = (1 if layout == "local" else 2) * reps
                gb = pushes * SIZES[label] / 1e9
                rows.append(f"| {layout} | 2 | {label} | {pushes} | {r['server_cpu']:.3f} | "
                            f"{r['server_cpu'] / gb:.3f} | {SIZES[label] * reps / r['elapsed'] / 1e9:.2f} |")
        print("\n".join(rows))
        return 0

    if args.overhead:
        # 16 MB in 4 KB partitions, 2 workers, credit unlimited: the cost of a partition, not of its bytes.
        # Per-thread CPU per partition of one worker's tensor: the engine thread runs the PUSH and PULL
        # stages (and STAGE inline at this size), a local-reduce owner's byteps-reduce thread its
        # LOCAL_REDUCE, the server's main thread receives, sums and replies to every worker's push.
        # BYTEPS_NATIVE=1: the worker's partitions run on byteps-net (core/bps_worker.h) and the server's
        # on its native thread; 0: the Python engine thread and server loop, as before the native core.
        rows = ["| layout | engine | wall us / partition | worker: byteps-net | worker: Python engine + completion | "
                "reduce thread | worker zmq I/O | server (all but zmq I/O) | server zmq I/O |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        out = {}
        for layout in ("machines", "local"):
            for native in ("1", "0"):
                res, _ = run_job(2, args.servers, ["16MB"], 1, {"BYTEPS_PARTITION_BYTES": "4096",
                                                               "BYTEPS_SCHEDULING_CREDIT": "0",
                                                               "BYTEPS_NATIVE": native},
                                 layout=layout, extra_args=["--thread-cpu", "--ops", str(args.ops)])
                r = res["16MB"]
                th = r["thread_us_per_partition"]
                w, srv = th["worker"], th.get("server0", {})
                zmq_io = sum(v for k, v in w.items() if k.startswith("ZMQbg"))
                srv_io = sum(v for k, v in srv.items() if k.startswith("ZMQbg"))
                srv_main = sum(v for k, v in srv.items() if not k.startswith("ZMQbg"))
                py = w.get("byteps-engine", 0) + w.get("byteps-complete", 0)
                rows.append(f"| {layout} | {'native' if native == '1' else 'Python'} | "
                            f"{r['us_per_partition']:.1f} | {w.get('byteps-net', 0):.1f} | {py:.1f} | "
                            f"{w.get('byteps-reduce', 0):.1f} | {zmq_io:.1f} | {srv_main:.1f} | {srv_io:.1f} |")
                out[f"{layout},{native}"] = r
        print("\n".join(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0

    counts = [2] if args.quick else [int(w) for w in args.workers.split(",")]
    layouts = ["local", "machines"] if args.layout == "both" else [args.layout]
    sizes = ["4KB", "1MB", "16MB"] if args.quick else args.sizes.split(",")
    reps = 3 if args.quick else args.reps
    all_results = []
    cpu_rows = []
    with tqdm(total=len(layouts) * len(counts) * len(sizes), desc="push_pull vs gloo") as bar:
        for layout, workers in [(lay, w) for w in counts for lay in layouts]:
            res, server_cpu = run_job(workers, args.servers, sizes, reps, progress=bar, layout=layout)
            all_results.append(((layout, workers), res))
            # bytes the servers summed: every worker pushes each size (warm-up + reps) x inner calls
            summed = 0
            for label in sizes:
                nbytes = SIZES[label]
                r = reps if nbytes < (64 << 20) else max(3, reps // 2)
                warm = 2 if nbytes >= (16 << 20) else 10
                inner = 1 if nbytes >= (1 << 20) else 20
                summed += workers * nbytes * (r + warm) * inner
            if layout == "local":  # one push per machine reaches the server
                summed //= workers
            cpu_rows.append((f"{layout}, {workers}", server_cpu, summed))
    print(table(all_results))
    print()
    for workers, cpu, summed in cpu_rows:
        print(f"server CPU, {workers} workers: {cpu:.2f} core-s for {summed / 1e9:.2f} GB pushed "
              f"= {cpu / (summed / 1e9):.3f} core-s/GB (includes idle heartbeats during the gloo phases)")
    if args.plot:
        plot(all_results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": all_results, "server_cpu": cpu_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
