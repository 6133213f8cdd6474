"""Horovod-compatibility and DDP scenarios for tests/test_horovod_compat.py and tests/test_ddp.py.

Each scenario runs in every worker of a real job and returns raw data (tensors as lists or exact
digests, error texts); the tests compute the expected values themselves. The scripts use the
Horovod spelling, ``import byteps.torch as hvd``.

Also runnable directly (no harness): ``python tests/scenarios_hvd.py launcher OUTDIR`` under
torchrun / mpirun / horovodrun-style environments, for the launcher-environment tests.
"""
import os
import sys
import time
import warnings

import torch

from scenarios import digest, exit_without_teardown, scenario, write_result  # tests/ is on sys.path also when run directly
from scenarios import error_text as _err

import byteps.torch as hvd


def _etype(fn):
    """(exception class names along the MRO, message) or None."""
    try:
        fn()
    except Exception as e:
        return {"types": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    return None


# ------------------------------------------------------------------------------ shared generators

DTYPES_REDUCE = ["int32", "int64", "float16", "float32", "float64"]
DTYPES_ALL = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def base_tensor(dtype, dim, salt=0):
    """Horovod's test tensor: 17^dim values in [-100, 100), the same on every rank."""
    g = torch.Generator().manual_seed(1234 + salt)
    return torch.randint(-100, 100, (17,) * dim, generator=g).to(getattr(torch, dtype))


def rank_tensor(rank, dtype, shape, lo=-5, hi=6, salt=0):
    """Rank-dependent small integers (exact in every dtype)."""
    g = torch.Generator().manual_seed(7 * rank + 1000 * salt + 1)
    return torch.randint(lo, hi, shape, generator=g).to(getattr(torch, dtype))


GATHER_ROWS = [17, 32, 81, 12, 15, 23, 22]


def gather_piece(rank, dtype):
    """Rank r's allgather contribution: GATHER_ROWS[r] rows of 3x2, filled with r (plus specials for floats)."""
    t = torch.full((GATHER_ROWS[rank], 3, 2), rank, dtype=getattr(torch, dtype))
    if t.dtype.is_floating_point:
        t[0, 0, 0] = -0.0
        t[0, 0, 1] = float("nan")
        t[0, 1, 0] = float("-inf")
    return t


def hvd_model(seed, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def hvd_data(n, seed=4242, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype))


# ------------------------------------------------------------------------------ the API job


def _allreduce_values():
    res = {}
    for dtype in DTYPES_REDUCE:
        for dim in (1, 2):
            x = base_tensor(dtype, dim)
            res[f"sum.{dtype}.{dim}"] = digest(hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{dim}"))
            res[f"avg.{dtype}.{dim}"] = digest(hvd.allreduce(x, name=f"avg.{dtype}.{dim}"))
            res[f"unnamed.{dtype}.{dim}"] = digest(hvd.allreduce(x, op=hvd.Sum))
    # in place
    x = base_tensor("float32", 2, salt=1)
    y = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    res["inplace_same"] = y is x
    res["inplace"] = digest(x)
    # out of place leaves the input alone
    x = base_tensor("int32", 1, salt=2)
    before = digest(x)
    h = hvd.allreduce_async(x, op=hvd.Sum, name="oop_async")
    out = hvd.synchronize(h)
    res["oop_async"] = {"input_unchanged": digest(x) == before, "other_object": out is not x, "out": digest(out)}
    # negative integer averages truncate toward zero (Horovod)
    t = torch.tensor([-7, -5, 5, 7], dtype=torch.int64) + (1 if hvd.rank() == 0 else 0)
    res["int_avg_trunc"] = hvd.allreduce(t, name="int_avg_trunc").tolist()
    # deprecated average=
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        res["average_false"] = hvd.allreduce(torch.ones(3), average=False, name="avg_false").tolist()
    res["average_warned"] = any(issubclass(w.category, DeprecationWarning) for w in ws)
    res["op_and_average"] = _err(lambda: hvd.allreduce(torch.ones(3), average=True, op=hvd.Sum))
    res["adasum"] = _err(lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum))
    res["unsupported_int16"] = _etype(lambda: hvd.allreduce(torch.ones(3, dtype=torch.int16), name="i16"))
    return res


def _async_checks():
    """poll() is False right after submit while rank 1 is late; a burst of async ops all complete."""
    res = {}
    r = hvd.rank()
    if r == 1:
        time.sleep(1.0)
    t = torch.full((1000,), float(r))
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="late")
    res["poll_right_after"] = hvd.poll(h)
    out = hvd.synchronize(h)
    res["late"] = out[:3].tolist()
    # Horovod's test_horovod_allreduce_async_fused: many ops, poll False at least once
    if r == 1:
        time.sleep(0.5)
    handles, polled_false = [], False
    for i in range(20):
        x = torch.full((17, 17), float(i))
        handles.append(hvd.allreduce_async(x, op=hvd.Sum, name=f"burst.{i}"))
    for h in handles:
        polled_false |= not hvd.poll(h)
    res["burst_poll_false"] = polled_false
    res["burst"] = [hvd.synchronize(h)[0, 0].item() for h in handles]
    # an async allgather is async too
    if r == 1:
        time.sleep(0.5)
    h = hvd.allgather_async(torch.full((r + 1,), r), name="late_gather")
    res["gather_poll_right_after"] = hvd.poll(h)
    res["late_gather"] = hvd.synchronize(h).tolist()
    return res


def _broadcasts():
    res = {}
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES_ALL:
        for root in range(n):
            src = torch.full((17, 3), r, dtype=getattr(torch, dtype))
            before = digest(src)
            out = hvd.broadcast(src, root, name=f"b.{dtype}.{root}")
            inp = torch.full((17, 3), r, dtype=getattr(torch, dtype))
            ret = hvd.broadcast_(inp, root, name=f"bi.{dtype}.{root}")
            res[f"{dtype}.{root}"] = {"out": digest(out), "src_unchanged": digest(src) == before,
                                      "inplace": digest(inp), "inplace_same": ret is inp}
    h = hvd.broadcast_async(torch.full((4,), float(r)), 1, name="basync")
    res["async"] = hvd.synchronize(h).tolist()
    return res


def _allgathers():
    res = {}
    r = hvd.rank()
    for dtype in DTYPES_ALL:
        res[dtype] = digest(hvd.allgather(gather_piece(r, dtype), name=f"g.{dtype}"))
    res["unnamed"] = hvd.allgather(torch.tensor([r, r])).tolist()
    res["scalar"] = hvd.allgather(torch.tensor(float(r)), name="g.scalar").tolist()
    res["empty_rank0"] = hvd.allgather(torch.full((0 if r == 0 else 2, 2), r), name="g.empty").tolist()
    h = hvd.allgather_async(torch.full((r + 1, 2), r, dtype=torch.int64), name="g.async")
    res["async"] = hvd.synchronize(h).tolist()
    return res


def _autograd():
    res = {}
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(5, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, name="gsum").sum().backward()
    res["allreduce_sum"] = x.grad.tolist()
    x = torch.ones(5, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x, name="gavg").sum().backward()
    res["allreduce_avg"] = x.grad.tolist()
    x = torch.ones(5, dtype=torch.float64, requires_grad=True)
    hvd.allreduce(x * 3, op=hvd.Sum, name="gnoname_in").backward(torch.full((5,), float(r + 1), dtype=torch.float64))
    res["allreduce_sum_rank_grads"] = x.grad.tolist()
    for root in range(n):
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        hvd.broadcast(x, root, name=f"gb.{root}").sum().backward()
        res[f"broadcast.{root}"] = x.grad.tolist()
    x = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x, name="gg")
    w = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape)
    (y * w).sum().backward()
    res["allgather"] = x.grad.tolist()
    xs = [torch.ones(3, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="ggroup")
    sum(o.sum() for o in outs).backward()
    res["grouped"] = [t.grad.tolist() for t in xs]
    return res


def _min_max_prod():
    res = {}
    r = hvd.rank()
    for dtype in ("int32", "int64", "float32", "float64"):
        t = rank_tensor(r, dtype, (4, 5))
        for opname in ("Min", "Max", "Product"):
            op = getattr(hvd, opname)
            res[f"{opname}.{dtype}"] = digest(hvd.allreduce(t, op=op, name=f"mmp.{opname}.{dtype}"))
        y = t.clone()
        hvd.allreduce_(y, op=hvd.Max, name=f"mmp.inplace.{dtype}")
        res[f"Max_inplace.{dtype}"] = digest(y)
    h = hvd.allreduce_async(rank_tensor(r, "float32", (3,)), op=hvd.Min, name="mmp.async")
    res["Min_async"] = digest(hvd.synchronize(h))
    return res


def _scaling():
    res = {}
    r = hvd.rank()
    for dtype in ("int32", "int64", "float16", "float32", "float64"):
        t = rank_tensor(r, dtype, (6,), lo=-9, hi=10)
        res[f"pre.{dtype}"] = digest(hvd.allreduce(t, op=hvd.Sum, prescale_factor=1.5, name=f"pre.{dtype}"))
        res[f"post.{dtype}"] = digest(hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5, name=f"post.{dtype}"))
        res[f"avg_pre_post.{dtype}"] = digest(hvd.allreduce(t, op=hvd.Average, prescale_factor=2.0,
                                                            postscale_factor=0.25, name=f"app.{dtype}"))
    return res


def _grouped():
    res = {}
    r = hvd.rank()
    ts = [rank_tensor(r, dt, (3 + i,), salt=i) for i, dt in enumerate(["float32", "int32", "float64", "int64",
                                                                      "float16"])]
    out = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grp")
    res["sync_type"] = type(out).__name__
    res["sync"] = [digest(o) for o in out]
    h = hvd.grouped_allreduce_async(ts, op=hvd.Sum, name="grp_async")
    out = hvd.synchronize(h)
    res["async_type"] = type(out).__name__
    res["async"] = [digest(o) for o in out]
    res["inputs_unchanged"] = all(torch.equal(a, rank_tensor(r, str(a.dtype).split(".")[1], a.shape, salt=i))
                                  for i, a in enumerate(ts))
    copies = [t.clone() for t in ts]
    ret = hvd.grouped_allreduce_(copies, op=hvd.Sum, name="grp_inplace")
    res["inplace"] = [digest(c) for c in copies]
    res["inplace_same"] = all(a is b for a, b in zip(ret, copies))
    avg = hvd.grouped_allreduce([torch.full((2,), float(r)) for _ in range(3)], name="grp_avg")
    res["avg"] = [a.tolist() for a in avg]
    return res


def _mismatches():
    """Every rank must raise RuntimeError; a collective afterwards still works."""
    res = {}
    r = hvd.rank()
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(17 + r), name="mm.shape"),
        "ndim": lambda: hvd.allreduce(torch.ones(4, 6) if r % 2 == 0 else torch.ones(2, 3, 4), name="mm.ndim"),
        "dtype": lambda: hvd.allreduce(torch.ones(5, dtype=torch.int32 if r % 2 == 0 else torch.float32),
                                       name="mm.dtype"),
        "bcast_root": lambda: hvd.broadcast(torch.ones(3), r, name="mm.root"),
        "bcast_shape": lambda: hvd.broadcast(torch.ones(3 + r), 0, name="mm.bshape"),
        "bcast_dtype": lambda: hvd.broadcast(torch.ones(3, dtype=torch.int32 if r == 0 else torch.float32), 0,
                                             name="mm.bdtype"),
        "gather_dim1": lambda: hvd.allgather(torch.ones(2, 3 + r), name="mm.gather"),
        "gather_dtype": lambda: hvd.allgather(torch.ones(2, dtype=torch.int64 if r == 0 else torch.float64),
                                              name="mm.gdtype"),
        "min_shape": lambda: hvd.allreduce(torch.ones(2 + r), op=hvd.Min, name="mm.min"),
        "grouped_shape": lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(3 + r)], name="mm.grp"),
    }
    for key, fn in cases.items():
        res[key] = _etype(fn)
        res[f"{key}.after"] = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name=f"after.{key}").tolist()
    return res


def _duplicates():
    """Horovod's *_duplicate_name_error: rank 0 submits the name twice (ValueError), the rest once."""
    res = {}
    r = hvd.rank()
    for kind in ("allreduce", "allgather", "broadcast", "grouped", "min"):
        start = {
            "allreduce": lambda: hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup.ar"),
            "allgather": lambda: hvd.allgather_async(torch.ones(2, 2), name="dup.ag"),
            "broadcast": lambda: hvd.broadcast_async(torch.full((3,), float(r)), 0, name="dup.bc"),
            "grouped": lambda: hvd.grouped_allreduce_async([torch.ones(2)], op=hvd.Sum, name="dup.gr"),
            "min": lambda: hvd.allreduce_async(torch.full((2,), float(r)), op=hvd.Min, name="dup.min"),
        }[kind]
        if r == 0:
            h = start()
            res[kind] = _etype(start)
            hvd.barrier()
        else:
            hvd.barrier()
            h = start()
        out = hvd.synchronize(h)
        res[f"{kind}.value"] = [o.tolist() for o in out] if isinstance(out, tuple) else out.tolist()
    return res


def _misc():
    res = {}
    r, n = hvd.rank(), hvd.size()
    res["ids"] = {"rank": hvd.rank(), "size": n, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                  "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                  "is_initialized": hvd.is_initialized(), "is_homogeneous": hvd.is_homogeneous()}
    res["built"] = {f: getattr(hvd, f)() for f in ("mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
                                                  "nccl_built", "cuda_built", "rocm_built", "ddl_built",
                                                  "ccl_built", "mpi_threads_supported")}
    res["ops"] = [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product]
    # fp16 compression
    c = hvd.Compression.fp16
    out = {}
    for dt in ("float32", "float64", "int32", "int64", "uint8"):
        t = torch.ones(4, dtype=getattr(torch, dt))
        comp, ctx = c.compress(t)
        back = c.decompress(comp, ctx)
        out[dt] = [str(comp.dtype), str(back.dtype), back.tolist()]
    res["fp16"] = out
    res["fp16_allreduce"] = hvd.allreduce(torch.full((5,), 0.5 * (r + 1)), op=hvd.Sum, name="fp16ar",
                                          compression=hvd.Compression.fp16).tolist()
    res["fp16_allreduce_dtype"] = str(hvd.allreduce(torch.ones(2, dtype=torch.float64), name="fp16dt",
                                                    compression=hvd.Compression.fp16).dtype)
    # objects
    res["bcast_object"] = hvd.broadcast_object({"root": r, "t": (1, 2.5)} if r == 1 else None, root_rank=1)
    res["allgather_object"] = hvd.allgather_object({"rank": r, "x": [r] * r})
    # barrier: rank 0 arrives 1 s late
    if r == 0:
        time.sleep(1.5)
    t0 = time.monotonic()
    hvd.barrier()
    res["barrier_waited"] = time.monotonic() - t0
    # join: the last rank to arrive (rank n-1 is 1 s late) is returned everywhere
    if r == n - 1:
        time.sleep(1.0)
    res["join"] = hvd.join()
    res["join_again"] = hvd.join(device=-1)
    # reducescatter (Horovod's split: the first dim0 % size ranks get an extra row)
    t = torch.arange(2 * n + 1, dtype=torch.float64).unsqueeze(1).repeat(1, 2) * (r + 1)
    res["reducescatter_sum"] = hvd.reducescatter(t, op=hvd.Sum, name="rs").tolist()
    res["reducescatter_avg"] = hvd.reducescatter(t, name="rs_avg").tolist()
    res["reducescatter_min"] = _err(lambda: hvd.reducescatter(t, op=hvd.Min))
    res["process_set"] = _err(lambda: hvd.add_process_set([0]))
    return res


def _reinit():
    """Horovod's tearDown pattern: barrier, shutdown, init again; multi-stage ops still work."""
    r = hvd.rank()
    hvd.barrier()
    hvd.shutdown()
    res = {"between": hvd.is_initialized()}
    hvd.init()
    res["rank"] = hvd.rank()
    res["allgather"] = hvd.allgather(torch.full((r + 1,), r), name="again").tolist()
    res["max"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Max, name="again").tolist()
    return res


@scenario
def hvd_api(out, args):
    """The Horovod collective API, one section per behaviour group."""
    res = {}
    for key, fn in [("allreduce", _allreduce_values), ("async", _async_checks), ("broadcast", _broadcasts),
                    ("allgather", _allgathers), ("autograd", _autograd), ("mmp", _min_max_prod),
                    ("scaling", _scaling), ("grouped", _grouped), ("mismatch", _mismatches),
                    ("duplicate", _duplicates), ("misc", _misc), ("reinit", _reinit)]:
        try:
            res[key] = fn()
        except Exception as e:  # one section failing must not hide the others
            import traceback

            res[key] = {"__error__": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
            raise
    return res


# ------------------------------------------------------------------------------ the optimizer job


def all_optimizers():
    """(name, factory(params, rank)) for every optimizer in torch.optim; hyper-parameters depend on rank."""
    import torch.optim as O

    def lr(rank, base):
        return base * (1 + rank)  # rank-dependent: the broadcast must restore root 0's

    f = {
        "SGD": lambda p, r: O.SGD(p, lr=lr(r, 0.01), momentum=0.9, nesterov=r == 0, weight_decay=1e-4 * r),
        "Adam": lambda p, r: O.Adam(p, lr=lr(r, 1e-3), betas=(0.9 - 0.1 * r, 0.99), amsgrad=r == 0),
        "AdamW": lambda p, r: O.AdamW(p, lr=lr(r, 1e-3), weight_decay=0.01 * (r + 1)),
        "Adamax": lambda p, r: O.Adamax(p, lr=lr(r, 2e-3)),
        "Adagrad": lambda p, r: O.Adagrad(p, lr=lr(r, 1e-2), lr_decay=0.001 * r),
        "Adadelta": lambda p, r: O.Adadelta(p, lr=lr(r, 1.0), rho=0.9 - 0.05 * r),
        "RMSprop": lambda p, r: O.RMSprop(p, lr=lr(r, 1e-3), momentum=0.5, centered=r == 0),
        "Rprop": lambda p, r: O.Rprop(p, lr=lr(r, 1e-3), etas=(0.5, 1.2 + 0.1 * r)),
        "ASGD": lambda p, r: O.ASGD(p, lr=lr(r, 1e-2), t0=10 + r),
        "NAdam": lambda p, r: O.NAdam(p, lr=lr(r, 2e-3), decoupled_weight_decay=r == 1),
        "RAdam": lambda p, r: O.RAdam(p, lr=lr(r, 1e-3)),
        "Adafactor": lambda p, r: O.Adafactor(p, lr=lr(r, 1e-2)),
        "LBFGS": lambda p, r: O.LBFGS(p, lr=lr(r, 0.5), history_size=5 + r),
        "SparseAdam": lambda p, r: O.SparseAdam(p, lr=lr(r, 1e-3)),
        "Muon": lambda p, r: O.Muon(p, lr=lr(r, 1e-3)),
    }
    return f


def _state_digest(sd):
    if isinstance(sd, torch.Tensor):
        return {"dtype": str(sd.dtype), "shape": list(sd.shape), "hex": digest(sd)}
    if isinstance(sd, dict):
        return {str(k): _state_digest(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return {"__type__": type(sd).__name__, "items": [_state_digest(v) for v in sd]}
    return {"__type__": type(sd).__name__, "repr": repr(sd)}


def _model_for(name, seed):
    torch.manual_seed(seed)
    if name == "SparseAdam":
        return torch.nn.Embedding(10, 4, sparse=True)
    if name == "Muon":
        return torch.nn.Linear(6, 3, bias=False)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _loss(name, model, rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    if name == "SparseAdam":
        idx = torch.randint(0, 10, (5,), generator=g)
        return model(idx).pow(2).sum()
    x = torch.randn(4, 6, generator=g)
    return model(x).pow(2).mean()


def _optimizer_round_trip(name, factory, rank):
    model = _model_for(name, seed=3 + rank)  # rank-dependent weights too
    opt = factory(list(model.parameters()), rank)
    for step in range(2):  # populate rank-dependent state
        def closure():
            opt.zero_grad()
            loss = _loss(name, model, rank, step)
            loss.backward()
            return loss
        if name == "LBFGS":
            opt.step(closure)
        else:
            closure()
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0, prefix=f"rt.{name}.")
    hvd.broadcast_optimizer_state(opt, root_rank=0, prefix=f"rt.{name}.opt.")
    res = {"state": _state_digest(opt.state_dict())}
    # the received state is live: one more step on the same data gives the same weights everywhere
    def closure2():
        opt.zero_grad()
        loss = _loss(name, model, 0, 99)
        loss.backward()
        return loss
    if name == "LBFGS":
        opt.step(closure2)
    else:
        closure2()
        opt.step()
    res["after_step"] = {k: digest(v) for k, v in model.state_dict().items()}
    return res


def _fresh_state(rank):
    """Broadcasting an empty state (fresh Adam) onto ranks that have one."""
    model = _model_for("Adam", seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank != 0:
        _loss("Adam", model, rank, 0).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0, prefix="fresh.")
    return _state_digest(opt.state_dict())


def _train(tag, rank, size, op=None, predivide=1.0, passes=1, steps=4, compression=hvd.Compression.none):
    model = hvd_model(1)
    x, y = hvd_data(8 * size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    kwargs = {} if op is None else {"op": op}
    dopt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                                    backward_passes_per_step=passes, gradient_predivide_factor=predivide,
                                    compression=compression, **kwargs)
    for step in range(steps):
        xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
        dopt.zero_grad()
        for px, py in zip(xs.chunk(passes), ys.chunk(passes)):
            (torch.nn.functional.mse_loss(model(px), py) / passes).backward()
        dopt.step()
    return {n: digest(p.detach()) for n, p in model.state_dict().items()}


def _optimizer_behaviour(rank, size):
    res = {}
    res["train_avg"] = _train("avg", rank, size)
    res["train_sum"] = _train("sum", rank, size, op=hvd.Sum)
    res["train_predivide"] = _train("pre", rank, size, predivide=2.0)
    res["train_passes"] = _train("passes", rank, size, passes=2)
    res["predivide_with_sum"] = _err(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(hvd_model(1).parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0))
    res["adasum"] = _err(lambda: hvd.DistributedOptimizer(torch.optim.SGD(hvd_model(1).parameters(), lr=0.1),
                                                          op=hvd.Adasum))
    m = hvd_model(1)
    res["not_tuples"] = _err(lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                              named_parameters=[p for p in m.parameters()]))
    res["duplicate_names"] = _err(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=[("same", p) for p in m.parameters()]))
    res["missing_names"] = _err(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=list(m.named_parameters())[:1]))

    # gradient clipping: synchronize(), clip, step() inside skip_synchronize(); then the warning
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.zero_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[("clip." + n, p) for n, p in model.named_parameters()])
    x, y = torch.ones(1, 1), torch.ones(1, 1) * (rank + 2)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    res["clipped"] = [prior, model.weight.grad.item()]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    res["skip_warnings"] = len(ws)
    res["after_clip"] = digest(model.weight.detach())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    res["step_warnings"] = [str(w.message) for w in ws]
    # zero_grad() with reductions in flight
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    res["zero_grad_inflight"] = _etype(opt.zero_grad)
    opt.step()
    # a second backward before step() without backward_passes_per_step
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    res["twice"] = _etype(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
    opt.step()

    # Horovod's test_force_allreduce: ranks use different outputs, so different parameters get grads
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 2)
            self.b = torch.nn.Linear(3, 2)

        def forward(self, x, which):
            return self.a(x) if which == 0 else self.b(x)

    torch.manual_seed(5)
    two = Two()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(two.parameters(), lr=0.1),
                                   named_parameters=[("force." + n, p) for n, p in two.named_parameters()])
    for step in range(2):
        opt.zero_grad()
        two(torch.ones(2, 3), 0 if rank == 0 else 1).sum().backward()
        opt.step()
    res["force_allreduce"] = {n: digest(p.detach()) for n, p in two.state_dict().items()}

    # sparse gradients (Embedding(sparse=True) + SparseAdam) through the DistributedOptimizer
    torch.manual_seed(6)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=[("sparse." + n, p) for n, p in emb.named_parameters()])
    for step in range(2):
        opt.zero_grad()
        emb(torch.tensor([rank, rank + 3, 7])).sum().backward()
        opt.step()
    res["sparse"] = digest(emb.weight.detach())
    # fp16 compression trains and stays identical across ranks
    res["train_fp16"] = _train("fp16", rank, size, compression=hvd.Compression.fp16)
    return res


@scenario
def hvd_optim(out, args):
    rank, size = hvd.rank(), hvd.size()
    res = {"round_trip": {}}
    for name, factory in all_optimizers().items():
        res["round_trip"][name] = _optimizer_round_trip(name, factory, rank)
    res["fresh"] = _fresh_state(rank)
    res["behaviour"] = _optimizer_behaviour(rank, size)
    return res


# ------------------------------------------------------------------------------ DDP


def ddp_reference_batches(size, steps, per_rank=4):
    x, y = hvd_data(size * per_rank * steps, seed=99)
    return x, y


def _ddp_train(model, rank, size, steps, opt_kind="sgd"):
    x, y = ddp_reference_batches(size, steps)
    per = x.shape[0] // steps
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_kind == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    losses = []
    for step in range(steps):
        xb, yb = x[step * per:(step + 1) * per], y[step * per:(step + 1) * per]
        mx, my = xb.chunk(size)[rank], yb.chunk(size)[rank]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(mx), my)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@scenario
def ddp_backend(out, args):
    """init_process_group(backend="byteps") + unmodified DDP; plus torch.distributed collectives."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = hvd.rank(), hvd.size()
    dist.init_process_group(backend="byteps", init_method="byteps://")
    res = {"backend": dist.get_backend(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    # collectives through the torch.distributed API
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    res["all_reduce"] = t.tolist()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["all_reduce_max"] = t.tolist()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    res["all_reduce_avg"] = t.tolist()
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=1)
    res["broadcast"] = t.tolist()
    outs = [torch.empty(2) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    res["all_gather"] = [o.tolist() for o in outs]
    out_t = torch.empty(size * 2)
    dist.all_gather_into_tensor(out_t, torch.full((2,), float(rank)))
    res["all_gather_into_tensor"] = out_t.tolist()
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * size) * (rank + 1))
    res["reduce_scatter_tensor"] = rs.tolist()
    t = torch.full((2,), float(rank + 1))
    dist.reduce(t, dst=1)
    res["reduce"] = t.tolist()
    gl = [torch.empty(2) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gl, dst=0)
    res["gather"] = None if gl is None else [g.tolist() for g in gl]
    sc = torch.empty(2)
    dist.scatter(sc, [torch.full((2,), 10.0 + q) for q in range(size)] if rank == 1 else None, src=1)
    res["scatter"] = sc.tolist()
    w = dist.all_reduce(torch.ones(2), async_op=True)
    res["async_work_wait"] = w.wait()
    objs = [None] * size
    dist.all_gather_object(objs, {"r": rank})
    res["all_gather_object"] = objs
    a2a = torch.empty(size * 2)
    dist.all_to_all_single(a2a, torch.arange(size * 2.0) + 100 * rank)
    res["all_to_all_single"] = a2a.tolist()
    dist.barrier()
    res["bad_op"] = _err(lambda: dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BAND))
    # DDP: different initial weights on every rank; DDP broadcasts rank 0's at construction
    model = hvd_model(1 + rank)
    ddp = DDP(model)
    res["after_construction"] = {n: digest(p.detach()) for n, p in model.state_dict().items()}
    res["losses"] = _ddp_train(ddp, rank, size, args.get("steps", 5))
    res["params"] = {n: digest(p.detach()) for n, p in model.state_dict().items()}
    dist.destroy_process_group()
    return res


@scenario
def ddp_hook(out, args):
    """DDP over a gloo group, with gradients averaged by byteps through the communication hook."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, size = hvd.rank(), hvd.size()
    dist.init_process_group(backend="gloo", init_method=f"file://{out}/gloo_store", rank=rank, world_size=size)
    model = hvd_model(1 + rank)
    ddp = DDP(model)
    calls = []

    def counting_hook(state, bucket):
        calls.append(tuple(bucket.buffer().shape))
        return hvd.ddp_comm_hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=counting_hook)
    res = {"losses": _ddp_train(ddp, rank, size, args.get("steps", 5))}
    res["params"] = {n: digest(p.detach()) for n, p in model.state_dict().items()}
    res["hook_calls"] = len(calls)
    dist.destroy_process_group()
    return res


# ------------------------------------------------------------------------------ launcher environments


def _launcher_main(outdir):
    """Run by torchrun / an mpirun- or horovodrun-style environment: no DMLC_* variables."""
    from byteps import launch_env

    from byteps import common

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    cfg = common.config()
    res = {"rank": r, "size": n, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
           "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
           "env_dmlc": sorted(k for k in os.environ if k.startswith("DMLC_")),
           "config": {k: getattr(cfg, k) for k in ("num_worker", "worker_id", "num_server", "root_uri", "root_port",
                                                   "local_rank", "local_size", "job_id")},
           "service_pids": launch_env.service_pids()}
    res["allreduce"] = hvd.allreduce(torch.full((4,), float(r + 1)), op=hvd.Sum, name="launch").tolist()
    res["allgather"] = hvd.allgather(torch.full((r + 1,), r), name="launch.g").tolist()
    write_result(outdir, r, res)
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "launcher":
        _launcher_main(sys.argv[2])
        exit_without_teardown()


@scenario
def hvd_refused_dtypes(out, args):
    """Rank 1 passes a complex tensor (which byteps cannot move) to each Horovod collective, unnamed, while
    rank 0 passes float32: rank 0's call must fail at once naming rank 1, and the automatic names stay in
    step (an unnamed allreduce afterwards is exact)."""
    r = hvd.rank()
    dtype = torch.float32 if r == 0 else torch.complex64
    calls = {
        "allreduce": lambda: hvd.allreduce(torch.ones(4, dtype=dtype), op=hvd.Sum),
        "max": lambda: hvd.allreduce(torch.ones(4, dtype=dtype), op=hvd.Max),
        "grouped": lambda: hvd.grouped_allreduce([torch.ones(3), torch.ones(4, dtype=dtype)], op=hvd.Sum),
        "allgather": lambda: hvd.allgather(torch.ones(2, dtype=dtype)),
        "alltoall": lambda: hvd.alltoall(torch.ones(2, dtype=dtype)),
        "grouped_allgather": lambda: hvd.grouped_allgather([torch.ones(2), torch.ones(2, dtype=dtype)]),
    }
    got = {}
    for name, call in calls.items():
        began = time.monotonic()
        got[name] = {"error": _err(call), "seconds": time.monotonic() - began}
    try:
        got["after"] = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum).tolist()
    except Exception as e:  # noqa: BLE001 -- the test shows it beside the calls' errors
        got["after"] = f"{type(e).__name__}: {e}"
    return got

