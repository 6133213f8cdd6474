"""Benchmark byteps.core._reduce.sum_into against numpy.add and torch.add.

Throughput is "GB/s of input summed": 2 x buffer bytes / time for one ``dst += src`` (both
operands read; the write-back of dst is not counted). GB = 1e9 bytes, median of --reps runs.
np.copyto gives the machine's copy bandwidth (read + write = 2 x bytes / time). "of copy" is
copy time / sum time for the same buffer size: a copy and an in-place sum move about the same
bytes through memory (copy: read src, read dst for ownership, write dst; sum: read dst, read src,
write dst), so ~100% means the sum runs at memory speed.

    .venv/bin/python bench/bench_sum.py --threads 1
    .venv/bin/python bench/bench_sum.py --quick
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np

from byteps.core import _reduce
from byteps.core import dtypes

try:
    import torch
except ImportError:  # torch columns become n/a
    torch = None

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32"]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def fmt_size(nbytes):
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}B"
    return f"{nbytes} B"


def time_calls(fns, reps):
    """Median seconds per call of each function. The functions take turns within every
    repetition, so load from other processes hits them alike; small buffers repeat the call so
    one sample is >= ~2 ms."""
    inner = []
    for fn in fns:
        fn()  # warm-up: page faults, thread-pool start
        t0 = time.perf_counter()
        fn()
        inner.append(max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))))
    samples = [[] for _ in fns]
    for _ in range(reps):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(inner[k]):
                fn()
            samples[k].append((time.perf_counter() - t0) / inner[k])
    return [statistics.median(x) for x in samples]


def make_pair(name, nbytes, rng):
    """Two buffers of nbytes holding small values (repeated adds must not overflow fp16)."""
    code = dtypes.from_name(name)
    n = nbytes // dtypes.itemsize(code)
    if name == "bfloat16":
        vals = rng.standard_normal(2 * n, dtype=np.float32)
        bits = (vals.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
        return code, bits[:n].copy(), bits[n:].copy()
    if name.startswith("int"):
        vals = rng.integers(-1000, 1000, 2 * n, dtype=np.int32).astype(name)
    else:
        vals = (rng.standard_normal(2 * n, dtype=np.float32) * 1e-3).astype(name)
    return code, vals[:n].copy(), vals[n:].copy()


def torch_view(arr, name):
    if torch is None:
        return None
    if name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def gbps(nbytes, seconds):
    return 2 * nbytes / seconds / 1e9


def ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def cell(x):
    return "n/a" if x is None else f"{x:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M,256M", help="comma list of buffer sizes, e.g. 1M,64M")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per point (median; >= 5)")
    ap.add_argument("--threads", type=int, default=_reduce.get_num_threads(),
                    help="OpenMP threads for byteps and intra-op threads for torch")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--quick", action="store_true", help="sizes 1M,16M, 3 reps: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = "1M,16M", 3
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    names = args.dtypes.split(",")

    _reduce.set_num_threads(args.threads)
    if torch is not None:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    print(f"# {datetime.date.today()}  {platform.machine()}  {os.cpu_count()} CPUs  python {platform.python_version()}"
          f"  numpy {np.__version__}  torch {torch.__version__ if torch else 'n/a'}")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# byteps threads={args.threads} (single-threaded below {_reduce._get_parallel_threshold() >> 10} KiB)"
          f"  cpu_features={_reduce.cpu_features()}")
    print("# GB/s of input summed = 2 x buffer bytes / time per dst += src (median);"
          " copy bw = np.copyto read+write = 2 x bytes / time;")
    print("# 'of copy' = np.copyto time / byteps sum time, same size;"
          " 'vs fp32' = byteps GB/s / byteps float32 GB/s at that size")
    print()

    copy_bw = {}
    for nbytes in sizes:
        a = np.ones(nbytes, np.uint8)
        b = np.ones(nbytes, np.uint8)
        reps = args.reps if nbytes < (128 << 20) else max(5, args.reps // 2)
        t_np, t_bps = time_calls([lambda: np.copyto(a, b), lambda: _reduce.copy_into(a, b)], reps)
        copy_bw[nbytes] = gbps(nbytes, t_np)
        print(f"# copy {fmt_size(nbytes)}: np.copyto {copy_bw[nbytes]:.1f} GB/s,"
              f" byteps copy_into {gbps(nbytes, t_bps):.1f} GB/s")
        del a, b
    print()

    print("| dtype | size | byteps GB/s | numpy GB/s | torch GB/s | byteps/numpy | byteps/torch | of copy | vs fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    fp32 = {}
    for name in names:
        for nbytes in sizes:
            reps = args.reps if nbytes < (128 << 20) else max(5, args.reps // 2)
            code, a, b = make_pair(name, nbytes, rng)
            fns = [lambda: _reduce.sum_into(a, b, code)]
            if name != "bfloat16":  # numpy has no bfloat16
                fns.append(lambda: np.add(a, b, out=a))
            if torch is not None:
                ta, tb = torch_view(a, name), torch_view(b, name)
                fns.append(lambda: torch.add(ta, tb, out=ta))
            rates = [gbps(nbytes, t) for t in time_calls(fns, reps)]
            r_bps = rates.pop(0)
            r_np = rates.pop(0) if name != "bfloat16" else None
            r_t = rates.pop(0) if torch is not None else None
            if name == "float32":
                fp32[nbytes] = r_bps
            frac = r_bps / copy_bw[nbytes]
            print(f"| {name} | {fmt_size(nbytes)} | {cell(r_bps)} | {cell(r_np)} | {cell(r_t)} | "
                  f"{ratio(r_bps, r_np)} | {ratio(r_bps, r_t)} | {frac:.0%} | {ratio(r_bps, fp32.get(nbytes))} |",
                  flush=True)
            del a, b


if __name__ == "__main__":
    main()
