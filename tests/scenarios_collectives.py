"""Scenarios for tests/test_collectives.py: alltoall, grouped allgather/reducescatter, reducescatter's
gradient, sparse allreduce, int16 moves, and the optimizer/state details of Horovod's test_torch.py.

Each worker returns raw data (exact digests, lists, error types); the tests rebuild every rank's
inputs with the generators below and compute the expected results locally.
"""
import time

import torch

from scenarios import digest, scenario

import byteps.torch as hvd


def _etype(fn):
    try:
        fn()
    except Exception as e:
        return {"types": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    return None


# ------------------------------------------------------------------------------ shared generators

A2A_DTYPES = ["float32", "float64", "int16", "int32", "uint8", "bfloat16"]


def a2a_splits(rank, size):
    """Rows rank ``rank`` sends to each rank (one is zero when size > 2)."""
    return [(rank + d) % 3 if size > 2 else rank + d + 1 for d in range(size)]


def a2a_input(rank, size, dtype, cols=3):
    """sum(splits) rows plus 2 rows that are not sent; row value encodes (rank, row)."""
    rows = sum(a2a_splits(rank, size)) + 2
    t = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) % 50 + 60 * rank
    return t.to(getattr(torch, dtype))


def gathered_piece(rank, i, dtype="float32"):
    """Tensor ``i`` of rank ``rank``'s grouped allgather: rank+i+1 rows."""
    return (torch.arange((rank + i + 1) * 2, dtype=torch.float64).reshape(-1, 2) + 100 * rank + 10 * i).to(
        getattr(torch, dtype))


def rs_input(rank, size, i=0, dtype="float64"):
    """Reducescatter input: size*2+1 rows (uneven), rank-dependent integers."""
    g = torch.Generator().manual_seed(31 * rank + i)
    return torch.randint(-20, 20, (size * 2 + 1, 3), generator=g).to(getattr(torch, dtype))


def sparse_input(rank, size):
    idx = torch.tensor([[rank % 5, (rank + 2) % 5, 4], [0, 1, rank % 3]])
    vals = torch.tensor([1.0 + rank, -2.0, 0.5 * rank])
    return torch.sparse_coo_tensor(idx, vals, (5, 3))


# ------------------------------------------------------------------------------ the job

def _alltoall(rank, size):
    res = {}
    for dtype in A2A_DTYPES:
        t = a2a_input(rank, size, dtype)
        out, recv = hvd.alltoall(t, splits=torch.tensor(a2a_splits(rank, size), dtype=torch.int32),
                                 name=f"a2a.{dtype}")
        res[dtype] = {"out": digest(out), "shape": list(out.shape), "recv": recv.tolist(),
                      "recv_dtype": str(recv.dtype), "input_unchanged": digest(t) == digest(a2a_input(rank, size,
                                                                                                    dtype))}
    # list splits, asynchronous, unnamed
    h = hvd.alltoall_async(a2a_input(rank, size, "float32"), splits=a2a_splits(rank, size))
    out, recv = hvd.synchronize(h)
    res["async"] = {"out": digest(out), "recv": recv.tolist()}
    # equal split: no splits argument returns only the output
    eq = torch.arange(size * 2 * 2, dtype=torch.int64).reshape(size * 2, 2) + 1000 * rank
    out = hvd.alltoall(eq)
    res["equal"] = {"is_tensor": isinstance(out, torch.Tensor), "out": out.tolist()}
    # autograd: the gradient is the alltoall of the upstream gradient with the received splits
    x = a2a_input(rank, size, "float64").requires_grad_()
    out, recv = hvd.alltoall(x, splits=torch.tensor(a2a_splits(rank, size), dtype=torch.int32), name="a2a.grad")
    w = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) + 7 * rank
    (out * w).sum().backward()
    res["grad"] = x.grad.tolist()
    xe = torch.ones(size * 2, 2, dtype=torch.float64, requires_grad=True)
    oe = hvd.alltoall(xe, name="a2a.grad.eq")
    (oe * (rank + 1)).sum().backward()
    res["grad_equal"] = xe.grad.tolist()
    # one rank's bad splits fail the alltoall on every rank at once, naming that rank (no barrier follows to
    # rescue a rank left waiting: it would wait for BYTEPS_TIMEOUT, 30 s)
    bad = [3, -1] + [1] * (size - 2) if rank == 1 else [1] * size
    start = time.monotonic()
    res["err_one_rank"] = _etype(lambda: hvd.alltoall(torch.ones(size, 2), splits=bad, name="a2a.one_rank"))
    res["err_one_rank_s"] = time.monotonic() - start
    # errors: bad splits (ValueError on every rank), cross-rank mismatches (RuntimeError on every rank); the
    # job goes on
    res["err_splits_type"] = _etype(lambda: hvd.alltoall(torch.ones(size, 2), splits=torch.ones(size)))
    res["err_equal_split"] = _etype(lambda: hvd.alltoall(torch.ones(size * 2 + 1, 2)))
    res["err_splits_sum"] = _etype(lambda: hvd.alltoall(torch.ones(2, 2), splits=[3] * size))
    res["err_rank"] = _etype(lambda: hvd.alltoall(torch.ones(size * 2, 3 + rank), name="a2a.rank_error"))
    res["err_type"] = _etype(lambda: hvd.alltoall(torch.ones(size * 2, 2, dtype=torch.int32 if rank % 2 else
                                                             torch.float32), name="a2a.type_error"))
    res["after_errors"] = hvd.alltoall(torch.full((size, 1), float(rank)), name="a2a.after").reshape(-1).tolist()
    return res


def _grouped_allgather(rank, size):
    res = {}
    ins = [gathered_piece(rank, i, dt) for i, dt in enumerate(["float32", "int16", "int64"])]
    outs = hvd.grouped_allgather(ins, name="gag")
    res["outs"] = [digest(o) for o in outs]
    res["shapes"] = [list(o.shape) for o in outs]
    res["is_list"] = isinstance(outs, list)
    h = hvd.grouped_allgather_async([gathered_piece(rank, 0)])
    res["async_tuple"] = isinstance(hvd.synchronize(h), tuple)
    xs = [gathered_piece(rank, i, "float64").requires_grad_() for i in range(2)]
    gs = hvd.grouped_allgather(xs, name="gag.grad")
    loss = sum(((g * (k + 1)) * (torch.arange(g.shape[0], dtype=torch.float64)[:, None] + 1)).sum()
               for k, g in enumerate(gs))
    loss.backward()
    res["grads"] = [x.grad.tolist() for x in xs]
    return res


def _reducescatter(rank, size):
    res = {}
    for op, key in ((hvd.Sum, "sum"), (hvd.Average, "avg")):
        x = rs_input(rank, size).requires_grad_()
        out = hvd.reducescatter(x, op=op, name=f"rs.{key}")
        res[key] = out.tolist()
        out.backward(torch.full_like(out, float(rank + 1)))
        res[f"{key}_grad"] = x.grad.tolist()
    outs = hvd.grouped_reducescatter([rs_input(rank, size, i, dt) for i, dt in
                                      enumerate(["float32", "int32", "float64"])], op=hvd.Sum, name="grs")
    res["grouped"] = [o.tolist() for o in outs]
    h = hvd.grouped_reducescatter_async([rs_input(rank, size, 5)], op=hvd.Average)
    res["grouped_async"] = [o.tolist() for o in hvd.synchronize(h)]
    xs = [rs_input(rank, size, i).requires_grad_() for i in range(2)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="grs.grad")
    for o in outs:
        o.backward(torch.ones_like(o))
    res["grouped_grad"] = [x.grad.tolist() for x in xs]
    res["err_scalar"] = _etype(lambda: hvd.reducescatter(torch.tensor(1.0)))
    res["err_adasum"] = _etype(lambda: hvd.reducescatter(torch.ones(size, 2), op=hvd.Adasum))
    res["err_grouped_max"] = _etype(lambda: hvd.grouped_reducescatter([torch.ones(size, 2)], op=hvd.Max))
    return res


def _sparse(rank, size):
    res = {}
    for op, key in ((hvd.Sum, "sum"), (hvd.Average, "avg")):
        fn = hvd.sparse_allreduce_async(sparse_input(rank, size), name=f"sparse.{key}", op=op)
        out = fn()
        res[key] = {"is_sparse": out.is_sparse, "dense": out.to_dense().tolist()}
    return res


def _int16(rank, size):
    res = {}
    t = torch.arange(12, dtype=torch.int16).reshape(4, 3) * (rank + 1) - 300 * rank
    res["broadcast"] = [hvd.broadcast(t, root, name=f"i16.b.{root}").tolist() for root in range(size)]
    res["broadcast_dtype"] = str(hvd.broadcast(t, 0, name="i16.bd").dtype)
    u = t.clone()
    hvd.broadcast_(u, size - 1, name="i16.inplace")
    res["broadcast_"] = u.tolist()
    res["allgather"] = hvd.allgather(torch.full((rank + 1, 2), rank - 7, dtype=torch.int16), name="i16.g").tolist()
    res["allreduce"] = _etype(lambda: hvd.allreduce(t, name="i16.ar"))
    res["bool_broadcast"] = _etype(lambda: hvd.broadcast(torch.ones(3, dtype=torch.bool), 0, name="bool.b"))
    res["complex_allgather"] = _etype(lambda: hvd.allgather(torch.ones(3, dtype=torch.complex64), name="c.g"))
    res["mismatch"] = _etype(lambda: hvd.broadcast(t if rank % 2 else t.to(torch.float16), 0, name="i16.mm"))
    return res


def sparse_model_step(rank, size=None, reduce=None):
    """Embedding(sparse=True) + SparseAdam through a DistributedOptimizer(sparse_as_dense=True); with
    ``reduce`` (the test's reference), the averaged gradient is computed locally instead."""
    torch.manual_seed(5)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    if reduce is None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=emb.named_parameters(), sparse_as_dense=True)
    idx = torch.tensor([rank % 6, (rank * 2 + 1) % 6, 5])
    w = torch.arange(9, dtype=torch.float32).reshape(3, 3) - rank
    (emb(idx) * w).sum().backward()
    if reduce is not None:
        emb.weight.grad = reduce(emb.weight.grad)
    grad_was_sparse = emb.weight.grad.is_sparse
    opt.step()
    return {"weight": emb.weight.detach().tolist(), "grad_sparse": grad_was_sparse,
            "grad_after": emb.weight.grad.is_sparse}


def _optimizer(rank, size):
    res = {}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters()}], lr=0.1))
    names = opt._parameter_names
    res["names_unique"] = len(names) == len(set(names.values())) == 4
    res["names_keys_are_params"] = all(any(p is q for q in model.parameters()) for p in names)
    res["names_all"] = [sorted(s) for s in hvd.allgather_object(set(names.values()))]
    res["sparse"] = sparse_model_step(rank)

    # broadcast_optimizer_state on an empty state: Horovod's dummy step (test_broadcast_state_no_grad)
    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
            self.b = torch.nn.Parameter(torch.arange(4, dtype=torch.float32) + rank)

    m = NoGrad()
    o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                                                 nesterov=True), named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(o, root_rank=0)
    grad = o.param_groups[0]["params"][1].grad
    res["no_grad"] = {"a_grad_none": o.param_groups[0]["params"][0].grad is None,
                      "b_grad": None if grad is None else grad.tolist(),
                      "b_grad_bcast": None if grad is None else hvd.broadcast(grad, 0, name="nograd.b").tolist(),
                      "state_keys": sorted(str(k) for st in o.state_dict()["state"].values() for k in st),
                      "b": m.b.detach().tolist()}
    # a fresh SparseAdam: its dummy step needs sparse zero gradients
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sa = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(sa, root_rank=0, prefix="sparseadam.")
    res["sparse_adam_state"] = sorted(str(k) for st in sa.state_dict()["state"].values() for k in st)
    lb = torch.optim.LBFGS(torch.nn.Linear(2, 1).parameters())
    hvd.broadcast_optimizer_state(lb, root_rank=0, prefix="lbfgs.")
    res["lbfgs_state"] = lb.state_dict()["state"] == {}
    return res


@scenario
def hvd_collectives(out, args):
    rank, size = hvd.rank(), hvd.size()
    res = {}
    for key, fn in [("alltoall", _alltoall), ("grouped_allgather", _grouped_allgather),
                    ("reducescatter", _reducescatter), ("sparse", _sparse), ("int16", _int16),
                    ("optimizer", _optimizer)]:
        res[key] = fn(rank, size)
    return res


@scenario
def hvd_join_order(out, args):
    """Horovod's join tests with the first joiner not rank 0 and the others' broadcasts and
    allgathers declared before it joins: they must fail at once, not wait for a time-out."""
    rank, size = hvd.rank(), hvd.size()
    first = args["first"]
    res = {}
    for kind in ("broadcast", "allgather"):
        hvd.barrier()
        t0 = time.monotonic()
        if rank == first:
            time.sleep(1.0)  # the others' declarations reach the scheduler before this join
            res[kind] = {"joined_first": True}
        else:
            if kind == "broadcast":
                err = _etype(lambda: hvd.broadcast(torch.ones(3), (first + 1) % size, name=f"join.{kind}"))
            else:
                err = _etype(lambda: hvd.allgather(torch.ones(rank + 1, 2), name=f"join.{kind}"))
            res[kind] = {"error": err, "seconds": time.monotonic() - t0}
        res[kind]["last"] = hvd.join()
    # training continues after the join
    res["after"] = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, name="join.after").tolist()
    return res


@scenario
def hvd_join_cached(out, args):
    """As hvd_join_order, for a broadcast and an allgather whose names every rank has used before
    (their keys are cached, so nothing is declared again): with the joiner's JOIN reaching the servers
    after the others' pushes ("late") and before them ("early"), they fail at once."""
    rank, size = hvd.rank(), hvd.size()
    first = args["first"]
    root = (first + 1) % size

    def bcast():
        return hvd.broadcast(torch.full((3,), float(rank)), root, name="join.cached.broadcast")

    def gather():
        return hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="join.cached.allgather")

    res = {"warm": [bcast().tolist(), gather().tolist()]}  # every rank: the keys are now known
    for order in ("late", "early"):
        for kind, fn in (("broadcast", bcast), ("allgather", gather)):
            hvd.barrier()
            t0 = time.monotonic()
            if rank == first:
                if order == "late":
                    time.sleep(1.0)  # the others' pushes reach the servers before this join
                res[f"{order}.{kind}"] = {"joined_first": True}
            else:
                if order == "early":
                    time.sleep(1.0)  # this join reaches the servers first
                res[f"{order}.{kind}"] = {"error": _etype(fn), "seconds": time.monotonic() - t0}
            res[f"{order}.{kind}"]["last"] = hvd.join()
    # the same names work again once every rank has joined
    res["again"] = [bcast().tolist(), gather().tolist()]
    return res
