"""GPU push_pull stages on one machine: the plan's local aggregation of CUDA tensors, timed.

One process per GPU (local rank r drives GPU r), all running :class:`byteps.core.gpu_stages.GpuExecutor`
with the plan chosen for the detected machine (or ``--machine FIXTURE`` / ``--strategy``). For
each tensor size it times push_pull (local reduce, COPYD2H, PCIE_REDUCE, COPYH2D, broadcast; the
network hook is left out, so this is the intra-machine part the paper's J describes) and, as a
reference, ``torch.distributed`` NCCL all_reduce of the same tensor. Goodput = tensor bytes / time.

    python bench/bench_gpu_stages.py                 # all GPUs, default sizes
    python bench/bench_gpu_stages.py --gpus 4 --sizes 1MB,64MB --iters 20
    python bench/bench_gpu_stages.py --dtype bfloat16   # torch's "<V2" tensors through the stages

Needs CUDA, NCCL and torch with CUDA; otherwise it prints why and exits 0 (nothing to measure).
Writes a markdown table to stdout and JSON to bench/results/gpu_stages.json.
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
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_size(text):
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


def worker(args):
    import torch
    import torch.distributed as dist

    import byteps.topology as topology
    from byteps.core.gpu_stages import GpuExecutor

    rank, size = args.rank, args.gpus
    torch.cuda.set_device(rank)
    overrides = {"strategy": args.strategy} if args.strategy else {}
    plan = topology.plan(machine=args.machine or None, local_size=size, devices=tuple(range(size)),
                         overrides=overrides, env={} if args.machine else None)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    isz = torch.empty(0, dtype=dtype).element_size()
    ex = GpuExecutor(plan, rank, args.token, max(sizes), timeout=120)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl", rank=rank, world_size=size)
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // isz, dtype=dtype, device="cuda")
        times = {"byteps": [], "nccl_allreduce": []}
        for it in range(args.warmup + args.iters):
            for name in times:
                t.fill_(1.0)
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                if name == "byteps":
                    ex.push_pull(t)  # waits for torch's current stream itself (DLPack with our stream)
                else:
                    dist.all_reduce(t)
                torch.cuda.synchronize()
                if it >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                assert float(t[0]) == float(size) and float(t[-1]) == float(size), "wrong sum"
        rows.append({"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}})
    ex.close()
    dist.destroy_process_group()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"plan": plan.strategy, "groups": plan.groups, "roots": plan.roots, "rows": rows,
                       "machine": plan.machine.name, "gpus": size, "dtype": args.dtype}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="GPUs (processes); default all")
    p.add_argument("--sizes", default="1MB,4MB,16MB,64MB,256MB")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--machine", default="", help="plan for this fixture instead of the detected machine")
    p.add_argument("--strategy", default="", help="force a strategy (BYTEPS_INTRA_STRATEGY)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--token", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank >= 0:
        return worker(args)

    from byteps.core import gpu
    reason = gpu.unavailable_reason(need_nccl=True)
    if reason:
        print(f"nothing to measure: {reason}")
        return 0
    args.gpus = args.gpus or gpu.cuda().device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    token = uuid.uuid4().hex[:12]
    base = [sys.executable, os.path.abspath(__file__), "--gpus", str(args.gpus), "--sizes", args.sizes, "--iters",
            str(args.iters), "--warmup", str(args.warmup), "--machine", args.machine, "--strategy", args.strategy,
            "--dtype", args.dtype,
            "--token", token, "--port", str(port), "--out", out]
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")  # detected GPU i (PCI order) is CUDA device i
    procs = [subprocess.Popen(base + ["--rank", str(r)], env=env) for r in range(args.gpus)]
    codes = [proc.wait(timeout=1800) for proc in procs]
    if any(codes):
        print(f"a worker failed: exit codes {codes}")
        return 1
    with open(out) as f:
        result = json.load(f)
    print(f"machine {result['machine']}, {result['gpus']} GPUs, {result['dtype']}, strategy {result['plan']}, "
          f"groups {result['groups']}, roots {result['roots']}\n")
    print("| size | byteps stages (ms) | GB/s | NCCL all_reduce (ms) | GB/s |\n|---|---|---|---|---|")
    for row in result["rows"]:
        b = row["bytes"]
        print(f"| {b / 2**20:g} MiB | {row['byteps'] * 1e3:.2f} | {b / row['byteps'] / 1e9:.1f} | "
              f"{row['nccl_allreduce'] * 1e3:.2f} | {b / row['nccl_allreduce'] / 1e9:.1f} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "gpu_stages.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
