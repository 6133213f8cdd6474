"""What bench_users.py, its parts and bench_gil.py share: the default environment a job is started in,
the machine's description, the sizes, spreads and table cells, the worker's device."""
import datetime
import os
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = {"4KB": 4 << 10, "64KB": 64 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20,
         "256MB": 256 << 20}
LATENCY_SIZES = ("4KB", "64KB", "1MB")


def spread(values):
    """(median, min, max) of a non-empty list, else (None, None, None)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def _f(x, fmt=".2f"):
    return "—" if x is None else format(x, fmt)


def device(args, torch):
    """The torch device of this worker's tensors (``--device``): a CUDA worker takes GPU local_rank
    modulo the GPUs there are, so processes share a GPU when there are fewer GPUs than processes."""
    if args.device == "cpu":
        return torch.device("cpu")
    import byteps.torch as bps

    return torch.device("cuda", bps.local_rank() % torch.cuda.device_count())


#: inherited variables that tune byteps, ps-lite or the thread pools: removed before launching
TUNING_PREFIXES = ("BYTEPS_", "DMLC_", "PS_", "OMP_", "KMP_", "GOMP_", "MKL_")
TUNING_NAMES = ("OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")
SECRET_VARS = ("BYTEPS_JOB_SECRET",)  #: never recorded


def clean_env(extra=None, quiet=False):
    """os.environ without tuning variables (printed on stderr unless quiet), plus ``extra``."""
    env = dict(os.environ)
    stripped = sorted(k for k in env if k.startswith(TUNING_PREFIXES) or k in TUNING_NAMES)
    for k in stripped:
        del env[k]
    if stripped and not quiet:
        print(f"default environment: removed inherited {', '.join(stripped)}", file=sys.stderr)
    env.update(extra or {})
    return env, stripped


def parse_env(items):
    """--env KEY=VALUE options as a dict (for an explicit, labelled A/B; the default is none)."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def bpslaunch_argv():
    """The bpslaunch console script of this interpreter's environment (as users start jobs)."""
    script = os.path.join(os.path.dirname(sys.executable), "bpslaunch")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "byteps.launcher"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_meta():
    import platform

    try:
        import torch
        tv = torch.__version__
    except ImportError:
        tv = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(), "python": platform.python_version(), "torch": tv, "commit": git_commit(),
            "kernel": os.uname().release, "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}


def child_env_info():
    """What the worker really runs with: byteps/OpenMP variables (the secret left out) and torch threads."""
    import torch

    seen = {k: v for k, v in os.environ.items()
            if (k.startswith(TUNING_PREFIXES) or k in TUNING_NAMES) and k not in SECRET_VARS}
    return {"env": dict(sorted(seen.items())), "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads()}
