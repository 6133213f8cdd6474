"""Time per step with and without each wire compressor on a rate-limited network (docs/compression.md).

    .venv/bin/python bench/bench_compression.py                       # 100 Mbit/s, 1 Gbit/s and unlimited links
    .venv/bin/python bench/bench_compression.py --rates 100 --quick   # a short smoke run

Needs root: the cluster is emulated with network namespaces (bench/netns.py): 2 worker hosts and 2
standalone server hosts plus a scheduler host on one bridge, every host's link limited to the rate
in both directions (tc tbf). The servers are on hosts of their own, so every partition crosses a
link and is compressed (a server on a worker's own host would be reached through shared memory,
uncompressed). For each rate one job runs every compressor in turn on the same tensors; a step is
one push_pull of every tensor (all started before any is awaited), timed on each worker after a
barrier; a step's time is the slower worker's; the result is the median over ``--reps`` steps after
``--warmup``. The gradients are fixed random normal tensors (refilled every step, so error feedback
and momentum see a realistic stream). Bytes per step are each worker host's link counters (frames
sent) around the timed steps. Everything the script creates (namespaces, veths, processes) is
removed when it ends, also on errors and Ctrl-C (bench/netns.py).

Writes a markdown table to stdout and JSON to bench/results/compression.json.
"""
import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

SCHED_PORT = 9000  #: fixed port: the address exists only inside our namespaces
#: label -> (method or None, options); every wire codec, with and without error feedback
CODECS = {
    "none": (None, {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "onebit": ("onebit", {}),
    "onebit+ef": ("onebit", {"error_feedback": True}),
    "topk 1%": ("topk", {"k": 0.01}),
    "topk 1%+ef": ("topk", {"k": 0.01, "error_feedback": True}),
    "randomk 1%": ("randomk", {"k": 0.01}),
    "dithering s=7": ("dithering", {"levels": 7}),
}


# --------------------------------------------------------------------------------------- worker side

def _mark(rundir, what, rank, barrier):
    """Rank 0 asks the coordinator to read the link counters, then everyone waits for the answer."""
    barrier()
    if rank == 0:
        open(os.path.join(rundir, f"mark.{what}"), "w").close()
        ack = os.path.join(rundir, f"ack.{what}")
        while not os.path.exists(ack):
            time.sleep(0.01)
    barrier()


def worker(args):
    import numpy as np
    import torch

    import byteps.torch as bps
    from byteps.compression import WireCompressor

    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    numel = args.model_mb * (1 << 20) // 4 // args.tensors
    g = np.random.default_rng(rank)
    grads = [torch.from_numpy(g.standard_normal(numel).astype(np.float32)) for _ in range(args.tensors)]
    work = [torch.empty(numel) for _ in range(args.tensors)]
    result = {}
    for label in args.codecs.split(","):
        method, opts = CODECS[label]
        codec = False if method is None else WireCompressor(method, min_bytes=0, **opts)
        tag = label.replace(" ", "_")

        def step():
            for w, gr in zip(work, grads):
                w.copy_(gr)
            bps.barrier()
            t0 = time.perf_counter()
            handles = [bps.push_pull_async_inplace(w, average=False, name=f"{tag}.{i}", compression=codec)
                       for i, w in enumerate(work)]
            for h in handles:
                bps.synchronize(h)
            return time.perf_counter() - t0

        for _ in range(args.warmup):
            step()
        _mark(args.rundir, f"{tag}.start", rank, bps.barrier)
        times = [step() for _ in range(args.reps)]
        _mark(args.rundir, f"{tag}.end", rank, bps.barrier)
        result[label] = times
    with open(os.path.join(args.rundir, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)
    bps.shutdown()


# --------------------------------------------------------------------------------------- coordinator

def run_rate(rate, args):
    from netns import Network

    hosts = ["sched", "w0", "w1", "x0", "x1"]
    rundir = tempfile.mkdtemp(prefix="bench-compression-")
    out = {}
    with Network(hosts, rate_mbit=rate) as net:
        base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BYTEPS_JOB_SECRET=secrets.token_hex(16),
                    BYTEPS_JOB_ID=f"bench-compression-{rate}", BYTEPS_TIMEOUT="600", BYTEPS_HEARTBEAT_TIMEOUT="30",
                    BYTEPS_LOG_LEVEL="WARNING", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="2",
                    DMLC_PS_ROOT_URI=net.addr["sched"], DMLC_PS_ROOT_PORT=str(SCHED_PORT))
        base.pop("DMLC_ROLE", None)
        procs, logs = [], []

        def start(host, tag, argv, extra):
            log = open(os.path.join(rundir, f"{tag}.log"), "wb")
            logs.append(log.name)
            env = dict(base, DMLC_NODE_HOST=net.addr[host], **extra)
            procs.append((tag, net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)))
            log.close()

        py = sys.executable
        start("sched", "scheduler", [py, "-m", "byteps.scheduler"], {"DMLC_ROLE": "scheduler"})
        for i, host in enumerate(["x0", "x1"]):
            start(host, f"server{i}", [py, "-m", "byteps.server"], {"DMLC_ROLE": "server"})
        argv = [py, os.path.abspath(__file__), "--worker", "--rundir", rundir, "--reps", str(args.reps),
                "--warmup", str(args.warmup), "--model-mb", str(args.model_mb), "--tensors", str(args.tensors),
                "--codecs", args.codecs]
        for i, host in enumerate(["w0", "w1"]):
            start(host, f"worker{i}", argv, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)})
        deadline = time.monotonic() + args.timeout
        counters = {}
        try:
            for label in args.codecs.split(","):
                for what in ("start", "end"):
                    tag = f"{label.replace(' ', '_')}.{what}"
                    while not os.path.exists(os.path.join(rundir, f"mark.{tag}")):
                        bad = [(t, p.returncode) for t, p in procs if p.poll() not in (None, 0)]
                        if bad or time.monotonic() > deadline:
                            tails = "\n".join(f"----- {p}\n{open(p, errors='replace').read()[-2000:]}" for p in logs)
                            raise RuntimeError(f"rate {rate}: {bad or 'timed out'}\n{tails}")
                        time.sleep(0.01)
                    counters[tag] = net.counters()
                    open(os.path.join(rundir, f"ack.{tag}"), "w").close()
            for tag, p in procs:
                p.wait(max(1, deadline - time.monotonic()))
                if p.returncode != 0:
                    raise RuntimeError(f"{tag} exited with {p.returncode}")
            res = [json.load(open(os.path.join(rundir, f"result.{r}.json"))) for r in range(2)]
        finally:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
    for label in args.codecs.split(","):
        tag = label.replace(" ", "_")
        steps = [max(a, b) for a, b in zip(res[0][label], res[1][label])]
        c0, c1 = counters[f"{tag}.start"], counters[f"{tag}.end"]
        tx = [(c1[h][0] - c0[h][0]) / args.reps for h in ("w0", "w1")]
        out[label] = {"time_s": statistics.median(steps), "steps_s": steps, "worker_tx_bytes": statistics.mean(tx)}
    shutil.rmtree(rundir, ignore_errors=True)
    return out


def table(results, model_bytes):
    rates = list(results)
    head = "| compressor | " + " | ".join(f"{r} ms/step | x" for r in rates) + " | bytes sent per worker per step |"
    lines = [head, "|---|" + "---:|---:|" * len(rates) + "---:|"]
    for label in CODECS:
        if label not in results[rates[0]]:
            continue
        cells = []
        for r in rates:
            t, base = results[r][label]["time_s"], results[r]["none"]["time_s"] if "none" in results[r] else None
            cells.append(f"{t * 1e3:.0f} | {base / t:.2f}" if base else f"{t * 1e3:.0f} | -")
        tx = results[rates[0]][label]["worker_tx_bytes"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {tx / 1e6:.2f} MB ({model_bytes / tx:.1f}x less) |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="100,1000,0", help="link rates in Mbit/s; 0 = no limit (default %(default)s)")
    ap.add_argument("--model-mb", type=int, default=16, help="MiB of float32 gradients per step (default 16)")
    ap.add_argument("--tensors", type=int, default=4, help="tensors the model is split into (default 4)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="4 MiB, 3 reps, 1 warm-up")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.model_mb, args.reps, args.warmup = 4, 3, 1
    from netns import available

    why = available()
    if why is not None:
        sys.exit(f"bench_compression needs network namespaces: {why}")
    results = {}
    for rate in [int(r) for r in args.rates.split(",")]:
        label = f"{rate} Mbit/s" if rate else "unlimited"
        print(f"running {label} ...", file=sys.stderr, flush=True)
        results[label] = run_rate(rate or None, args)
    model_bytes = args.model_mb << 20
    print(f"{args.model_mb} MiB float32 in {args.tensors} tensors, 2 workers, 2 standalone servers, "
          f"median of {args.reps} steps\n")
    print(table(results, model_bytes))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "compression.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
