"""Call patterns of training scripts: unnamed synchronous calls, out-of-place results,
fresh tensors. Checks that a warm loop reuses its key and its memory and that results stay right."""
import resource

import torch

from scenarios import digest, scenario

import byteps.torch as bps
from byteps import buffers, common


def _minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@scenario
def torch_calls(out, args):
    rank, size = bps.rank(), bps.size()
    n = args.get("elements", 1 << 18)  # 1 MB of float32: pooled out-of-place results
    res = {}
    # unnamed synchronous calls: one name per dtype and shape, whatever the number of calls
    keys_before = len(common.metrics()["tensors"])
    outs = []
    for step in range(4):
        t = torch.full((n,), float(rank + 1 + step))
        outs.append(bps.push_pull(t, average=False))           # out of place, autograd path
        bps.push_pull_inplace(t, average=False)                # in place, unnamed
        res.setdefault("inplace", []).append(float(t[0]))
    # every result still holds its own sum: a pooled block is never handed out while in use
    res["oop"] = [float(o[0]) for o in outs] + [float(o[-1]) for o in outs]
    res["distinct_storage"] = len({o.data_ptr() for o in outs}) == len(outs)
    res["new_keys"] = len(common.metrics()["tensors"]) - keys_before  # 8 calls, 1 name (dtype, shape)
    res["sync_name"] = common.sync_name("push_pull", "float32", (n,))
    # a warm loop of dropped out-of-place results reuses blocks and takes no page faults
    t = torch.full((n,), 1.0)
    for _ in range(3):
        bps.push_pull(t, average=False)
    reused0, allocated0 = buffers.pool.reused, buffers.pool.allocated
    f0 = _minflt()
    for _ in range(10):
        r = bps.push_pull(t, average=False)
        del r
    res["faults_per_call"] = (_minflt() - f0) / 10
    res["pool"] = {"reused": buffers.pool.reused - reused0, "allocated": buffers.pool.allocated - allocated0}
    # a view that outlives its result keeps the block
    r = bps.push_pull(torch.full((n,), float(rank)), average=False)
    view = r[:4]
    del r
    r2 = bps.push_pull(torch.full((n,), 100.0), average=False)
    res["view_kept"] = [float(view[0]), float(r2[0])]
    # the same name again right after synchronize, many times: never "already in flight"
    for i in range(50):
        bps.push_pull_inplace(torch.ones(3), average=False, name="again")
    res["again"] = True
    # async unnamed calls keep their numbered names (several may be in flight together)
    hs = [bps.push_pull_async(torch.full((5,), float(rank)), average=False) for _ in range(3)]
    res["async"] = [digest(bps.synchronize(h)) for h in hs]
    return res


@scenario
def push_pull_gradients(out, args):
    """push_pull is differentiable where autograd needs it, and skips autograd where it does not: the
    sums exact either way, a grad_fn only on a tensor that requires grad with grad enabled, and its
    backward pushes the gradient the same way (d/dx sum_r (r+1) * pp(x) = sum_r (r+1))."""
    r, n = bps.rank(), bps.size()
    want = float(sum(q + 1 for q in range(n)))
    x = torch.full((1000,), float(r + 1), requires_grad=True)
    y = bps.push_pull(x, average=False, name="pp.grad")
    (y * float(r + 1)).sum().backward()
    plain = bps.push_pull(torch.full((1000,), float(r + 1)), average=False, name="pp.plain")
    with torch.no_grad():
        under_no_grad = bps.push_pull(x, average=False, name="pp.nograd")
    return {"tracked": y.grad_fn is not None, "sum": bool(torch.equal(y.detach(), torch.full((1000,), want))),
            "grad": bool(torch.equal(x.grad, torch.full((1000,), want))),
            "plain_tracked": plain.grad_fn is not None, "plain_sum": bool(torch.equal(plain, torch.full((1000,), want))),
            "no_grad_tracked": under_no_grad.grad_fn is not None,
            "no_grad_sum": bool(torch.equal(under_no_grad, torch.full((1000,), want)))}


#: the dtypes an average divides in the native core (bps_divide_copy), and int32 (floor division in torch)
AVERAGE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")


def _rank_data(rank, n, dtype):
    """Rank ``rank``'s tensor: small integers, so that every sum is exact in any order and dtype (bf16 holds
    integers up to 256), while dividing the sum by 3 is not: the average's rounding is what is compared."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 5) % 80).to(getattr(torch, dtype))


@scenario
def torch_average(out, args):
    """Averaged push_pulls and Horovod allreduces (the default of both APIs) in every call pattern, small
    (one partition: the caller's direct path) and large (several partitions, from 1 MB: the streamed
    copy), against the locally computed sum divided by ``size`` with torch's own ``div_``, bit for bit."""
    rank, size = bps.rank(), bps.size()
    native = common.metrics()["native"]
    res = {"native_before": native["ops"], "averaged_before": native["averaged"], "wrong": []}
    for dtype in AVERAGE_DTYPES:
        for n in args["elements"]:
            mine = _rank_data(rank, n, dtype)
            total = sum(_rank_data(r, n, dtype).to(torch.float64) for r in range(size)).to(mine.dtype)
            want = total.div_(size) if mine.is_floating_point() else total.floor_divide_(size)
            got = {}
            t = mine.clone()
            got["inplace"] = bps.push_pull_inplace(t, name=f"avg.in.{dtype}.{n}")
            got["outofplace"] = bps.push_pull(mine, name=f"avg.out.{dtype}.{n}")
            t = mine.clone()
            got["async"] = bps.synchronize(bps.push_pull_async_inplace(t, name=f"avg.async.{dtype}.{n}"))
            got["async_oop"] = bps.synchronize(bps.push_pull_async(mine, name=f"avg.asyncoop.{dtype}.{n}"))
            got["unnamed"] = bps.push_pull(mine)
            if mine.is_floating_point():  # Horovod's Average truncates integers instead (mpi_ops)
                got["allreduce"] = bps.allreduce(mine, name=f"avg.hvd.{dtype}.{n}")
            for pattern, value in got.items():
                if value.dtype != want.dtype or not torch.equal(value.view(-1), want):
                    bad = (value.view(-1) != want).nonzero().view(-1)[:3].tolist()
                    res["wrong"].append(f"{pattern} {dtype} n={n}: at {bad}: got {value.view(-1)[bad].tolist()}, "
                                        f"want {want[bad].tolist()}")
    native = common.metrics()["native"]
    res["native"] = native["ops"] - res.pop("native_before")
    res["native_averaged"] = native["averaged"] - res.pop("averaged_before")
    return res


@scenario
def metrics_snapshot(out, args):
    """Three push_pulls of one tensor, then byteps.metrics() (made JSON-ready by the harness)."""
    r, n = bps.rank(), bps.size()
    exact = True
    for step in range(3):
        t = torch.full((args["numel"],), float(r + step))
        got = bps.push_pull(t, average=False, name="metrics.t")
        exact &= torch.equal(got, torch.full_like(t, float(sum(range(n)) + n * step)))
    return dict(bps.metrics(), exact=bool(exact))


@scenario
def abandoned_call(out, args):
    """Rank 1 refuses a broadcast locally (its root rank is out of range) before declaring it; rank 0
    declared it and must get an error naming rank 1 at once, not after BYTEPS_TIMEOUT. Then an unnamed
    push_pull on both ranks: the automatic names and the declarations are still in step."""
    import time

    r, n = bps.rank(), bps.size()
    t = torch.ones(4)
    began = time.monotonic()
    try:
        bps.broadcast(t, root_rank=0 if r == 0 else n, name="b")
        first = "no error"
    except Exception as e:  # noqa: BLE001 -- the scenario reports what it got
        first = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - began
    began = time.monotonic()
    try:  # the plugin's own check: a dtype byteps does not move (complex) on rank 1 only
        bps.push_pull(torch.zeros(4, dtype=torch.float32 if r == 0 else torch.complex64), name="c")
        second = "no error"
    except Exception as e:  # noqa: BLE001
        second = f"{type(e).__name__}: {e}"
    seconds = max(seconds, time.monotonic() - began)
    after = bps.synchronize(bps.push_pull_async(torch.full((5,), float(r + 1)), average=False)).tolist()
    return {"first": first, "second": second, "seconds": seconds, "after": after}


def _refused_by_rank_1(call):
    """(what ``call`` raised on this rank, or "no error"; seconds it took)."""
    import time

    began = time.monotonic()
    try:
        call()
        got = "no error"
    except Exception as e:  # noqa: BLE001 -- the scenario reports what it got
        got = f"{type(e).__name__}: {e}"
    return got, time.monotonic() - began


@scenario
def abandoned_warm_call(out, args):
    """Rank 1 refuses calls on names every rank used before (their keys are cached, so nobody declares
    them again): a complex tensor's push_pull, small (one partition) and of several partitions, and a
    broadcast with a root out of range. The others must get an error naming rank 1 within seconds,
    and the next call of each name must be exact everywhere: the refused call's rounds were used up."""
    r, n = bps.rank(), bps.size()
    total = float(n * (n + 1) // 2)
    res = {}
    for name, numel in (("small", 4), ("big", args.get("big", 3000))):
        def call(dtype=torch.float32):
            return bps.push_pull(torch.full((numel,), float(r + 1), dtype=dtype), average=False, name=name)

        warm = call()
        refused, seconds = _refused_by_rank_1(lambda: call(torch.complex64 if r == 1 else torch.float32))
        after = [call() for _ in range(2)]
        res[name] = {"warm": bool((warm == total).all()), "refused": refused, "seconds": seconds,
                     "after": [bool((a == total).all()) for a in after]}

    def cast(root):
        return bps.broadcast(torch.full((6,), float(r + 1)), root_rank=root, name="cast")

    warm = cast(0)
    refused, seconds = _refused_by_rank_1(lambda: cast(n if r == 1 else 0))
    res["cast"] = {"warm": warm.tolist() == [1.0] * 6, "refused": refused, "seconds": seconds,
                   "after": cast(0).tolist() == [1.0] * 6}
    if n >= 4:  # a process set's tensor: its own key, its members push themselves (no local reduce)
        pset = bps.add_process_set([0, 1])
        if r in (0, 1):
            def in_set(root=0):
                return bps.broadcast_(torch.full((5,), float(r + 1)), root, name="in_set", process_set=pset)

            warm = in_set()
            refused, seconds = _refused_by_rank_1(lambda: in_set(3 if r == 1 else 0))  # 3: not a member
            res["in_set"] = {"warm": warm.tolist() == [1.0] * 5, "refused": refused, "seconds": seconds,
                             "after": in_set().tolist() == [1.0] * 5}
    return res
