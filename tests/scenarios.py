"""Worker programs the multi-process tests run: ``python scenarios.py NAME OUTDIR JSON_ARGS``.

Each scenario runs in a real worker process (env set by tests/conftest.py) and writes
``OUTDIR/result.<rank>.json``; the test compares it with a locally computed ground truth.
Scenarios live here and in ``scenarios_*.py`` beside this file (registered with ``@scenario``).
"""
import atexit
import importlib
import json
import os
import sys
import threading
import time

import torch

import byteps.torch as bps

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def seeded(rank, shape, dtype, salt=0):
    """The tensor rank `rank` contributes; the test rebuilds it to compute the expected sum."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype)
    hi = 100 if dtype in (torch.uint8, torch.int8) else 1000
    lo = 0 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def error_text(fn):
    """Run fn; return None, or 'ExcType: message' for the test to read."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def write_result(outdir, rank, result):
    """OUTDIR/result.<rank>.json, written atomically (the harness reads it)."""
    path = os.path.join(outdir, f"result.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def digest(t):
    """Exact, JSON-friendly form of a tensor's bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


@scenario
def sums(out, args):
    """Many tensors of every dtype and shape in flight at once, for several rounds."""
    res = {}
    for rnd in range(args.get("rounds", 2)):
        handles = []
        for spec in args["tensors"]:
            dtype = getattr(torch, spec["dtype"])
            t = seeded(bps.rank(), tuple(spec["shape"]), dtype, salt=rnd)
            h = bps.push_pull_async_inplace(t, average=spec.get("average", False), name=spec["name"])
            handles.append((spec["name"], h))
        for name, h in handles:
            res[f"{name}@{rnd}"] = digest(bps.synchronize(h))
    return res


@scenario
def loop(out, args):
    """push_pull until something fails; report progress in OUTDIR/progress.<rank> and return the error."""
    t = torch.ones(args.get("numel", 10000))
    path = os.path.join(out, f"progress.{bps.rank()}")
    for step in range(args.get("steps", 10 ** 9)):
        try:
            bps.push_pull(t, average=False, name="loop")
        except Exception as e:
            return {"steps": step, "error_type": type(e).__name__, "error": str(e)}
        with open(path, "w") as f:
            f.write(str(step))
        time.sleep(args.get("sleep", 0))
    return {"steps": args.get("steps")}


@scenario
def mismatch(out, args):
    """Rank-dependent shape or dtype under one name: every rank must get an error; later calls still work."""
    r = bps.rank()
    got = {}
    kind = args["kind"]
    if kind == "shape":
        t = torch.ones(3 + r)
    elif kind == "dtype":
        t = torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
    else:  # root rank differs: a broadcast
        t = torch.ones(4)
    try:
        if kind == "root":
            bps.broadcast_(t, root_rank=r, name="x")
        else:
            bps.push_pull(t, name="x")
        got["first"] = "no error"
    except Exception as e:
        got["first"] = f"{type(e).__name__}: {e}"
    y = torch.full((5,), float(r + 1))
    got["after"] = bps.push_pull(y, average=False, name="y").tolist()
    return got


@scenario
def slow(out, args):
    """One rank pauses for less than the timeouts between steps: nobody fails."""
    t = torch.ones(100)
    for step in range(args["steps"]):
        if bps.rank() == 1 and step == 1:
            time.sleep(args["pause"])
        bps.push_pull(t, average=False, name="slow")
    return t.tolist()[:1]


@scenario
def priority(out, args):
    """A large low-priority tensor, then a small urgent one: the urgent one must finish first."""
    big = torch.ones(args["big"])
    small = torch.ones(4)
    order = []
    h_big = bps.push_pull_async_inplace(big, average=False, name="big", priority=0)
    h_small = bps.push_pull_async_inplace(small, average=False, name="small", priority=10)
    while len(order) < 2:
        for name, h in (("big", h_big), ("small", h_small)):
            if name not in order and bps.poll(h):
                order.append(name)
        time.sleep(0.0005)
    bps.synchronize(h_big)
    bps.synchronize(h_small)
    return {"order": order, "big_ok": bool((big == bps.size()).all()), "small": small.tolist()}


@scenario
def poll_race(out, args):
    """Start many push_pulls of new names (each declared, then handed to the native core by the engine
    thread while this thread polls): the moment poll() first says done, the tensor must hold the sum.
    A done reported between the engine's bookkeeping and the native submit showed the old values."""
    n, r = bps.size(), bps.rank()
    early = []
    for i in range(args["ops"]):
        t = torch.full((args["elems"],), float(r + 1))
        h = bps.push_pull_async_inplace(t, average=False, name=f"race.{i}")
        while not bps.poll(h):
            pass
        if not bool((t == n * (n + 1) / 2).all()):
            early.append(i)
        bps.synchronize(h)
    return {"early": early}


@scenario
def stalled_collectives(out, args):
    """One rank skips a collective the other makes, as a failing test does (rank 0 allreduces a tensor
    rank 1 never does; rank 1 goes on to a barrier, then both to a process-set check and a barrier):
    every rank gets an error within seconds, not after BYTEPS_TIMEOUT, and then the ranks are in step."""
    r = bps.rank()
    got = {}

    def timed(key, rank0_call):  # rank 0 makes ``rank0_call`` while rank 1 waits in a barrier
        t0 = time.monotonic()
        try:
            rank0_call() if r == 0 else bps.barrier()
            got[key] = "no error"
        except Exception as e:
            got[key] = f"{type(e).__name__}: {e}"
        got[key + "_s"] = time.monotonic() - t0

    timed("first", lambda: bps.allreduce(torch.ones(3), name="only_rank0"))
    timed("second", lambda: bps.add_process_set([0]))  # a process-set check against a barrier: stalled, both fail
    bps.barrier()  # the barriers are in step again
    got["after"] = bps.allreduce(torch.full((2,), float(r + 1)), op=bps.Sum).tolist()
    return got


@scenario
def join(out, args):
    """Horovod's join: rank r runs r + 1 steps of an averaged allreduce, then joins; joined ranks add
    zeros. The last rank also tries a broadcast while the others have joined (it must fail), and
    after everyone joined, a normal allreduce works again (rounds restart)."""
    r, n = bps.rank(), bps.size()
    if args.get("late_end") and r != n - 1:
        _hear_join_end_late(0.5)
    got = {"steps": []}
    for step in range(r + 1):
        t = torch.full((3, 1001), float(r + 1))  # several partitions: owners spread over local ranks
        got["steps"].append(bps.allreduce(t, name="j", op=bps.Average)[0, 0].item())
    if r == n - 1:
        time.sleep(0.5)  # let the others join first
        try:
            bps.broadcast(torch.ones(4), root_rank=0, name="b")
            got["broadcast"] = "no error"
        except Exception as e:
            got["broadcast"] = f"{type(e).__name__}: {e}"
    got["last"] = bps.join()
    got["after"] = bps.allreduce(torch.full((3, 1001), float(r + 1)), name="j", op=bps.Sum)[0, 0].item()
    return got


def _hear_join_end_late(secs):
    """This process handles the scheduler's "every rank joined" notice ``secs`` late, as a loaded machine
    may, while it goes on reading its other messages: its local peers' copies for their next op then
    arrive while it still runs join()."""
    from byteps.common import _job

    engine = _job.engine
    on_join, drain = engine._on_join, engine._drain_native
    held = []

    def hold_the_end(body):
        if body.get("done"):
            held.append((time.monotonic() + secs, body))
        else:
            on_join(body)

    def drain_then_release():  # the engine loop calls this every turn (at most a heartbeat interval apart)
        drain()
        while held and held[0][0] <= time.monotonic():
            on_join(held.pop(0)[1])
    engine._on_join, engine._drain_native = hold_the_end, drain_then_release


@scenario
def edge_inputs(out, args):
    """NaN/Inf pass through untouched; 10,000 small tensors in one step; a tensor resized between
    steps; an overlapping (expanded) view; each reported with its exact result or error text."""
    r, n = bps.rank(), bps.size()
    got = {}
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]) if r == 0 else torch.ones(4)
    got["nan_inf"] = [str(v) for v in bps.push_pull(t, average=False, name="nan_inf").tolist()]
    handles = [bps.push_pull_async_inplace(torch.full((1,), float(i + r)), average=False, name=f"small.{i}")
               for i in range(args["many"])]
    sums = [bps.synchronize(h).item() for h in handles]
    got["many_ok"] = sums == [float(n * i + sum(range(n))) for i in range(args["many"])]
    got["resized"] = [bps.push_pull(torch.ones(k), average=False, name="resized").sum().item() for k in (3, 5, 3)]
    try:
        bps.push_pull_inplace(torch.ones(1).expand(4), average=False, name="overlap")
        got["overlap"] = "no error"
    except Exception as e:
        got["overlap"] = f"{type(e).__name__}: {e}"
    got["after"] = bps.push_pull(torch.ones(2), average=False, name="after").tolist()
    return got


def _load_more():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    for fname in sorted(os.listdir(here)):
        if fname.startswith("scenarios_") and fname.endswith(".py"):
            importlib.import_module(fname[:-3])


def main():
    name, outdir, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.modules.setdefault("scenarios", sys.modules["__main__"])  # so scenarios_*.py share SCENARIOS
    _load_more()
    if args.get("no_init"):
        SCENARIOS[name](outdir, args)
        return
    if os.environ.get("TEST_NO_LOCAL_RINGS") == "1":  # a ring that cannot be made: the pair's link stays on TCP
        from byteps.core import shm

        def no_ring(nbytes):
            raise OSError("rings refused by the test")
        shm.ring_region = no_ring
    bps.init()
    from byteps.common import _job

    m = bps.metrics()  # the public introspection API (byteps.metrics())
    dataplane = _job.engine is not None
    result = {"rank": m["rank"], "size": m["size"], "local_rank": m["local_rank"], "local_size": m["local_size"],
              "colocated": [s["colocated"] for s in m["servers"]] if dataplane else None,
              "local_reduce": m["local_group"] if dataplane else None}
    try:
        result["value"] = SCENARIOS[name](outdir, args)
    except Exception as e:  # the test reads the error text
        result["error"] = f"{type(e).__name__}: {e}"
    if bps.is_initialized():
        m = bps.metrics()
    elif dataplane:  # the scenario shut byteps down: read the engine it ran on, as it was left
        m = dict(m, **_job.engine.metrics())
    # ops the native data plane ran whole (core/pipeline/bps_worker.h)
    result["native_ops"] = m["native"]["ops"] if dataplane else None
    # servers reached over a working direct link (core/transport/bps_link.h, bps_ucx.h)
    result["native_links"] = m["native"]["links_up"] if dataplane else None
    # what carries each server's link: "tcp", "ucx: <UCX transports>" or "none"
    result["link_transports"] = [s["transport"] for s in m["servers"]] if dataplane else None
    # UCX: pooled receive buffers registered (ucp_mem_map), transfers that passed a registration (core/transport/bps_ucx.h)
    from byteps.core import _worker_core
    result["ucx_registrations"] = list(_worker_core.ucx_registrations())
    # bytes this worker sent to servers on the data plane (both engines)
    result["data_sent"] = sum(s["bytes_sent"] for s in m["servers"]) if dataplane else None
    # the native local reduce's counters (ops, partitions reduced, of those on its thread), or None
    result["native_local"] = m["native"]["local_reduce"] if dataplane else None
    # partitions the native core moved into each stage of their lists (core/pipeline/worker_stages.h)
    result["stages"] = m["native"]["stages"] if dataplane else None
    # servers' replies a TCP link read straight into the tensor (core/pipeline/worker_stages.h place_reply)
    result["replies_in_place"] = m["native"]["replies_in_place"] if dataplane else None
    # partitions the native core pushed encoded by their wire compressor (core/pipeline/worker_codec.h)
    result["compressed_pushes"] = m["native"]["compressed_pushes"] if dataplane else None
    # the CPUs the training thread may run on (BYTEPS_CPU_BIND binds it where the host's processes fill its CPUs)
    result["cpus"] = sorted(os.sched_getaffinity(0))
    write_result(outdir, result["rank"], result)
    bps.shutdown()
    exit_without_teardown()


def exit_without_teardown():
    """Exit as a normal exit would (non-daemon threads joined, atexit handlers run, output flushed),
    but without the interpreter's teardown of torch's and TensorFlow's modules: 0.8-1.5 s of CPU per
    process that no test looks at, and most of a small job's time on 2 cores."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
