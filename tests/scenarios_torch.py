"""byteps.torch scenarios for tests/test_push_pull.py and tests/test_torch_api.py.

Every scenario returns raw data (tensor digests, error texts); the tests compute the ground
truth in their own process with the same generators (:func:`make_tensor`, :func:`make_model`,
:func:`make_data`) and compare.
"""
import json
import os
import time

import torch

from scenarios import digest, scenario, seeded
from scenarios import error_text as _err

import byteps
import byteps.torch as bps

# ------------------------------------------------------------------------------ shared generators


def make_tensor(rank, spec, rnd=0):
    """Rank `rank`'s contribution in round `rnd` for a spec {"dtype", "shape", "kind", ...}.

    kinds: "rand"   -- scenarios.seeded(): random floats (non-integers) / random ints;
           "int"    -- integer values in [-8, 8] (exact in every float dtype, so any order sums exactly);
           "extreme" -- integers near the dtype's maximum, so that any sum wraps around.
    """
    dtype = getattr(torch, spec["dtype"])
    shape = tuple(spec["shape"])
    kind = spec.get("kind", "rand")
    salt = 7919 * rnd + spec.get("salt", 0)
    if kind == "rand":
        return seeded(rank, shape, dtype, salt=salt)
    g = torch.Generator().manual_seed(100003 * rank + salt + 17)
    if kind == "int":
        lo = 0 if dtype == torch.uint8 else -8
        return torch.randint(lo, 9, shape, generator=g, dtype=torch.int64).to(dtype)
    if kind == "extreme":
        hi = torch.iinfo(dtype).max
        return (hi - torch.randint(0, 50, shape, generator=g, dtype=torch.int64)).to(dtype)
    raise ValueError(f"unknown kind {kind!r}")


def undigest(hexstr, dtype, shape):
    """Inverse of scenarios.digest()."""
    raw = bytearray(bytes.fromhex(hexstr))
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def make_model(seed, dtype=torch.float64):
    """A deterministic tiny MLP (weights from `seed`)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def make_data(batch, dtype=torch.float64, seed=4242):
    """Synthetic regression data: (inputs [steps-independent], targets); the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(batch, 3, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def make_optimizer(kind, params, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(kind)


def batch_for_step(x, y, step, per_step):
    """The combined batch of one step: rows [step*per_step, (step+1)*per_step) cyclically."""
    idx = (torch.arange(per_step) + step * per_step) % x.shape[0]
    return x[idx], y[idx]


def state_digests(sd):
    """Digest of every tensor in a (possibly nested) state dict, plus its non-tensor leaves."""
    if isinstance(sd, torch.Tensor):
        return {"dtype": str(sd.dtype), "shape": list(sd.shape), "hex": digest(sd)}
    if isinstance(sd, dict):
        return {str(k): state_digests(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return [state_digests(v) for v in sd]
    return sd


# ------------------------------------------------------------------------------ push_pull matrix


@scenario
def torch_sums(out, args):
    """Every spec of args["tensors"] in flight at once, for args["rounds"] rounds of the same names.

    Returns {"name@round": digest}. Handles are synchronized in reverse order of submission, so
    later ops finishing first is exercised too.
    """
    res = {}
    for rnd in range(args.get("rounds", 2)):
        handles = []
        for spec in args["tensors"]:
            t = make_tensor(bps.rank(), spec, rnd)
            h = bps.push_pull_async_inplace(t, average=spec.get("average", False), name=spec["name"])
            handles.append((spec["name"], t, h))
        for name, t, h in reversed(handles):
            got = bps.synchronize(h)
            if got is not t:
                raise AssertionError(f"synchronize() of {name} returned another tensor object")
            res[f"{name}@{rnd}"] = digest(got)
    return res


# ------------------------------------------------------------------------------ training


def _train(cfg):
    """One training run described by cfg; returns final parameter digests (and per-step losses)."""
    rank, size = bps.rank(), bps.size()
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    seed = cfg.get("seed", 1) + (rank if cfg.get("different_init") else 0)
    model = make_model(seed, dtype)
    x, y = make_data(cfg["data"], dtype)
    opt = make_optimizer(cfg["opt"], model.parameters(), cfg["lr"])
    tag = cfg["tag"]
    if cfg.get("broadcast"):
        bps.broadcast_parameters(model.state_dict(), root_rank=0, prefix=f"{tag}.Parameter.")
        bps.broadcast_optimizer_state(opt, root_rank=0, prefix=f"{tag}.Optimizer.")
    compression = bps.Compression.fp16 if cfg.get("fp16") else bps.Compression.none
    passes = cfg.get("passes", 1)
    named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
    dopt = bps.DistributedOptimizer(opt, named_parameters=named, compression=compression,
                                    backward_passes_per_step=passes, fusion=cfg.get("fusion", False))
    per_step = cfg["per_step"]
    for step in range(cfg["steps"]):
        xb, yb = batch_for_step(x, y, step, per_step)
        mine_x, mine_y = xb.chunk(size)[rank], yb.chunk(size)[rank]
        dopt.zero_grad()
        for mx, my in zip(mine_x.chunk(passes), mine_y.chunk(passes)):
            loss = torch.nn.functional.mse_loss(model(mx), my) / passes
            loss.backward()
        dopt.step()
    return {n: digest(p.detach()) for n, p in model.state_dict().items()}


@scenario
def torch_train(out, args):
    """Several training runs (args["runs"]) one after another in the same job."""
    return {cfg["tag"]: _train(cfg) for cfg in args["runs"]}


# ------------------------------------------------------------------------------ API behaviour


def _params_with_poison(rank, root):
    """A state dict: the root's is seeded; other ranks hold NaN/Inf/garbage."""
    sd = {}
    for i, (dtype, shape) in enumerate([("float32", (5, 3)), ("float64", (7,)), ("float16", (4,)),
                                        ("bfloat16", (2, 2)), ("int64", (3,)), ("float32", ()),
                                        ("float32", (1001,))]):
        t = make_tensor(root, {"dtype": dtype, "shape": shape, "salt": 55 + i})
        if rank != root:
            if t.dtype.is_floating_point:
                t = torch.full_like(t, float("nan"))
                if t.numel() > 1:
                    t.view(-1)[1] = float("inf")
                    t.view(-1)[0] = float("-inf")
            else:
                t = torch.full_like(t, -1)
        sd[f"p{i}"] = t
    return sd


def _poisoned_broadcasts(rank):
    res = {}
    for root in (0, 1):
        sd = _params_with_poison(rank, root)
        bps.broadcast_parameters(sd, root_rank=root, prefix=f"poison{root}.")
        res[f"root{root}"] = {k: digest(v) for k, v in sd.items()}
    # a model's parameters via named_parameters(): the nn.Parameter path
    model = make_model(100 + rank, torch.float32)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    bps.broadcast_parameters(model.named_parameters(), root_rank=0, prefix="named.")
    res["named"] = {n: digest(p.detach()) for n, p in model.named_parameters()}
    return res


def _optimizer_states(rank):
    res = {}
    for kind in ("momentum", "adam", "adam_fresh"):
        model = make_model(7, torch.float32)
        if rank == 0:
            opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
                   if kind == "momentum" else torch.optim.Adam(model.parameters(), lr=0.003, betas=(0.8, 0.95)))
            if kind != "adam_fresh":
                for s in range(2):  # populate momentum buffers / exp_avg / step
                    opt.zero_grad()
                    x, y = make_data(4, torch.float32, seed=s)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
        else:
            # other hyper-parameters and (for momentum) a garbage state that must be replaced
            opt = (torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.1)
                   if kind == "momentum" else torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.5, 0.5)))
            if kind == "momentum":
                for p in model.parameters():
                    opt.state[p]["momentum_buffer"] = torch.full_like(p, float("nan"))
        bps.broadcast_optimizer_state(opt, root_rank=0, prefix=f"optstate.{kind}.")
        res[kind] = state_digests(opt.state_dict())
        # the received state is live: one more identical step from identical weights stays identical
        bps.broadcast_parameters(model.state_dict(), root_rank=0, prefix=f"optstate.{kind}.model.")
        opt.zero_grad()
        x, y = make_data(4, torch.float32, seed=9)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        res[kind + ".after_step"] = {n: digest(p.detach()) for n, p in model.state_dict().items()}
    return res


def _objects(rank):
    res = {}
    objs = {"dict": {"a": 1, "b": [1.5, "x", None], "c": {"nested": (1, 2)}}, "list": [3, 1, 4, 1, 5, 9],
            "none": None}
    for k, obj in objs.items():
        mine = obj if rank == 1 else {"garbage": rank}
        got = bps.broadcast_object(mine, root_rank=1)
        res[k] = repr(got)
    return res


def _ops(rank, size):
    res = {}
    # unnamed push_pulls of different shapes, issued in the same order everywhere
    outs = []
    for shape in [(3,), (2, 5), (), (7, 1), (3,)]:
        t = torch.full(shape, float(rank + 1))
        outs.append([list(shape), digest(bps.push_pull(t, average=False))])
    res["unnamed"] = outs
    # unnamed async ones all in flight at once
    hs = [bps.push_pull_async(torch.full((n,), float(rank * n)), average=False) for n in (1, 2, 3, 4)]
    res["unnamed_async"] = [digest(bps.synchronize(h)) for h in hs]

    # out-of-place push_pull leaves the input untouched
    t = make_tensor(rank, {"dtype": "float32", "shape": (4, 3), "kind": "int"})
    before = digest(t)
    out = bps.push_pull(t, average=False, name="oop")
    res["oop"] = {"before": before, "after": digest(t), "out": digest(out), "same_object": out is t}
    t = make_tensor(rank, {"dtype": "int32", "shape": (6,), "kind": "int"})
    before = digest(t)
    out = bps.synchronize(bps.push_pull_async(t, average=True, name="oop_async"))
    res["oop_async"] = {"before": before, "after": digest(t), "out": digest(out), "same_object": out is t}

    # in place + poll + synchronize returns the very same tensor
    t = make_tensor(rank, {"dtype": "float64", "shape": (9,), "kind": "int"})
    h = bps.push_pull_async_inplace(t, average=False, name="inplace")
    polls = 0
    deadline = time.monotonic() + 30
    while not bps.poll(h) and time.monotonic() < deadline:
        polls += 1
        time.sleep(0.001)
    polled = bps.poll(h)
    got = bps.synchronize(h)
    res["inplace"] = {"polled_true": polled, "same_object": got is t, "value": digest(t)}
    res["sync_twice"] = _err(lambda: bps.synchronize(h))

    # duplicate in-flight name: rank 1 holds back so rank 0's first op cannot complete meanwhile
    t1 = torch.ones(3)
    if rank != 0:
        time.sleep(0.5)
    h = bps.push_pull_async_inplace(t1, average=False, name="dup")
    res["dup_error"] = None
    if rank == 0:
        res["dup_error"] = _err(lambda: bps.push_pull_async_inplace(torch.ones(3), average=False, name="dup"))
        res["dup_error_oop"] = _err(lambda: bps.push_pull_async(torch.ones(3), average=False, name="dup"))
    res["dup_value"] = digest(bps.synchronize(h))
    # the name is free again once synchronized
    res["dup_reuse"] = digest(bps.push_pull_inplace(torch.ones(3), average=False, name="dup"))

    # non-contiguous tensors pushed in place: the values are written back into the view
    base = make_tensor(rank, {"dtype": "float32", "shape": (4, 6), "kind": "int"})
    tv = base.t()
    assert not tv.is_contiguous()
    r = bps.push_pull_inplace(tv, average=False, name="noncontig.t")
    res["noncontig_t"] = {"base": digest(base), "same_object": r is tv}
    base2 = make_tensor(rank, {"dtype": "int64", "shape": (5, 6), "kind": "int", "salt": 3})
    sl = base2[:, ::2]
    assert not sl.is_contiguous()
    r = bps.push_pull_inplace(sl, average=False, name="noncontig.slice")
    res["noncontig_slice"] = {"base": digest(base2), "same_object": r is sl}
    base3 = make_tensor(rank, {"dtype": "float64", "shape": (3, 8), "kind": "int", "salt": 4})
    sl3 = base3[1:, 1::3]
    bps.synchronize(bps.push_pull_async_inplace(sl3, average=True, name="noncontig.avg"))
    res["noncontig_avg"] = {"base": digest(base3)}
    # a contiguous view with a storage offset: only its own elements change
    base4 = make_tensor(rank, {"dtype": "int32", "shape": (10,), "kind": "int", "salt": 5})
    bps.push_pull_inplace(base4[3:7], average=False, name="offset.view")
    res["offset_view"] = {"base": digest(base4)}

    # unsupported dtypes: TypeError naming the tensor, raised at submit, on every rank alike
    res["bad_dtype"] = {
        "complex64": _err(lambda: bps.push_pull_async_inplace(torch.zeros(3, dtype=torch.complex64),
                                                              name="my_complex_tensor")),
        "bool": _err(lambda: bps.push_pull(torch.zeros(3, dtype=torch.bool), name="my_bool_tensor")),
        "bool_bcast": _err(lambda: bps.broadcast_(torch.zeros(3, dtype=torch.bool), 0, name="my_bool_bcast")),
    }
    # after the failures everything still works (and names did not get stuck in flight)
    res["after_errors"] = digest(bps.push_pull(torch.full((2,), 1.0), average=False, name="my_complex_tensor"))
    return res


@scenario
def torch_api(out, args):
    rank, size = bps.rank(), bps.size()
    return {"broadcast": _poisoned_broadcasts(rank), "optimizer": _optimizer_states(rank),
            "objects": _objects(rank), "ops": _ops(rank, size)}


@scenario
def torch_reinit(out, args):
    """init (by the runner) / push_pull / shutdown / init / push_pull (+ same names again)."""
    res = {"epochs": []}
    for epoch in range(args.get("epochs", 2)):
        if epoch:
            bps.shutdown()
            res["initialized_between"] = bps.is_initialized()
            res["rank_between"] = _err(bps.rank)
            res["push_pull_between"] = _err(lambda: bps.push_pull(torch.ones(2), name="between"))
            bps.init()
        t = make_tensor(bps.rank(), {"dtype": "float32", "shape": (1001,), "kind": "int"}, rnd=epoch)
        a = bps.push_pull(t, average=False, name="again")           # the same name in every epoch
        b = bps.push_pull(torch.full((3,), float(bps.rank())), average=False)  # unnamed
        res["epochs"].append({"rank": bps.rank(), "size": bps.size(), "again": digest(a), "unnamed": digest(b)})
    return res


@scenario
def torch_standalone(out, args):
    """Run with no_init and no DMLC_* variables: checks before init(), then single-process mode."""
    res = {"before": {}}
    t = torch.arange(5.0)
    for what, fn in [("rank", bps.rank), ("size", bps.size), ("local_rank", bps.local_rank),
                     ("push_pull", lambda: bps.push_pull(t)),
                     ("push_pull_async_inplace", lambda: bps.push_pull_async_inplace(t)),
                     ("broadcast_parameters", lambda: bps.broadcast_parameters([t], root_rank=0)),
                     ("broadcast_object", lambda: bps.broadcast_object({"a": 1})),
                     ("synchronize", lambda: bps.synchronize(1))]:
        try:
            fn()
            res["before"][what] = None
        except byteps.NotInitializedError as e:
            res["before"][what] = f"NotInitializedError: {e}"
        except Exception as e:
            res["before"][what] = f"OTHER {type(e).__name__}: {e}"
    res["is_initialized_before"] = bps.is_initialized()
    bps.init()
    res["rank"], res["size"] = bps.rank(), bps.size()
    res["local_rank"], res["local_size"] = bps.local_rank(), bps.local_size()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    y = bps.push_pull(x, average=True, name="alone")
    z = bps.push_pull(x.to(torch.int32), average=True)
    h = bps.push_pull_async_inplace(x, average=False)
    same = bps.synchronize(h) is x
    res["push_pull"] = {"out": y.tolist(), "int": z.tolist(), "input": x.tolist(), "inplace_same": same}
    res["broadcast_object"] = bps.broadcast_object({"k": [1, 2]}, root_rank=0)
    res["bad_dtype"] = _err(lambda: bps.push_pull(torch.zeros(2, dtype=torch.complex64), name="alone_complex"))
    bps.barrier()
    bps.shutdown()
    res["after_shutdown"] = _err(bps.rank)
    res["after_shutdown_push_pull"] = _err(lambda: bps.push_pull(t))
    _write(out, "standalone", res)
    return res


@scenario
def torch_init_error(out, args):
    """Run with no_init: init() in a bad environment; records the exception."""
    res = {}
    try:
        bps.init()
        res["error"] = None
    except byteps.ConfigError as e:
        res["error"] = f"ConfigError: {e}"
    except Exception as e:
        res["error"] = f"OTHER {type(e).__name__}: {e}"
    res["is_initialized"] = bps.is_initialized()
    _write(out, "init_error", res)
    return res


def _write(out, name, res):
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f)

