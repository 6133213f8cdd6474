"""Process-set scenarios for tests/test_process_sets.py: Horovod's static (``init(process_sets=...)``)
and dynamic (``add_process_set``) sets on 4 ranks. Each rank returns raw values; the test rebuilds
every rank's input with :func:`pset_input` and computes the expected results itself."""
import torch

from scenarios import error_text, scenario, write_result

import byteps.torch as hvd

A, B, DYN = [0, 2], [1, 2, 3], [0, 1, 3]


def pset_input(rank, rows=4, salt=0):
    """Rank ``rank``'s integer-valued float64 data (sums exact)."""
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randint(-50, 50, (rows, 3), generator=g).double()


def gather_rows(rank):
    return rank + 1  # uneven dim 0 for allgather


@scenario
def hvd_process_sets(out, args):
    hvd.init(process_sets=[hvd.ProcessSet(A), hvd.ProcessSet(B)])
    r = hvd.rank()
    res = {"rank": r}
    sets = {"A": hvd.ProcessSet(A), "B": hvd.ProcessSet(B)}  # not registered: refused
    res["unregistered"] = error_text(lambda: hvd.allreduce(torch.ones(1), process_set=sets["A"]))
    a, b = (p for p in _registered_sets())
    res["ids"] = [a.process_set_id, b.process_set_id]
    res["set_rank"] = [a.rank(), b.rank(), a.size(), b.size(), a.included(), b.included()]
    x = pset_input(r)
    # the same name in the whole job and in each set: three tensors
    res["global_sum"] = hvd.allreduce(x, name="x", op=hvd.Sum).tolist()
    for label, ps in (("A", a), ("B", b)):
        if not ps.included():
            res[f"{label}.non_member"] = error_text(lambda ps=ps: hvd.allreduce(x, name="x", process_set=ps))
            continue
        res[f"{label}.sum"] = hvd.allreduce(x, name="x", op=hvd.Sum, process_set=ps).tolist()
        res[f"{label}.avg"] = hvd.allreduce(x, op=hvd.Average, process_set=ps).tolist()  # unnamed
        res[f"{label}.max"] = hvd.allreduce(x, op=hvd.Max, process_set=ps).tolist()
        res[f"{label}.inplace"] = hvd.allreduce_(x.clone(), name="xi", op=hvd.Sum, process_set=ps).tolist()
        res[f"{label}.grouped"] = [t.tolist() for t in hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum,
                                                                             process_set=ps)]
        res[f"{label}.gather"] = hvd.allgather(torch.full((gather_rows(r), 2), float(r)), process_set=ps).tolist()
        root = ps.ranks[-1]
        res[f"{label}.bcast"] = hvd.broadcast(x, root, name="b", process_set=ps).tolist()
        outsider = min(set(range(4)) - set(ps.ranks))
        res[f"{label}.bad_root"] = error_text(lambda ps=ps: hvd.broadcast(x, outsider, process_set=ps))
        res[f"{label}.rs"] = hvd.reducescatter(x, op=hvd.Sum, process_set=ps).tolist()
        splits = [1] * ps.size()
        o, recv = hvd.alltoall(x[: ps.size()] + 1000 * r, splits=splits, process_set=ps)
        res[f"{label}.a2a"] = o.tolist()
        res[f"{label}.obj"] = hvd.allgather_object({"r": r}, process_set=ps)
        hvd.barrier(process_set=ps)
        # autograd through a set's allreduce: the gradient is allreduced in the set too
        w = x.clone().requires_grad_()
        hvd.allreduce(w, op=hvd.Sum, name="g", process_set=ps).sum().backward()
        res[f"{label}.grad"] = w.grad.tolist()
    # DistributedOptimizer(process_set=): gradients averaged over the set's members only
    if b.included():
        w = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], process_set=b)
        (w * x).sum().backward()
        opt.step()
        res["B.optimizer"] = w.detach().tolist()
    # unnamed global operations still pair up after unnamed set operations on some ranks only
    res["global_after"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    # dynamic sets: collective add, use, remove
    d = hvd.add_process_set(DYN)
    res["dyn_id"] = d.process_set_id
    res["dyn_dup"] = error_text(lambda: hvd.add_process_set(list(DYN)))
    if d.included():
        res["dyn_sum"] = hvd.allreduce(x, name="x", op=hvd.Sum, process_set=d).tolist()
    res["dyn_removed"] = hvd.remove_process_set(d)
    res["dyn_after_remove"] = error_text(lambda: hvd.allreduce(x, process_set=d))
    res["global_removed"] = hvd.remove_process_set(hvd.global_process_set)
    # ranks disagreeing on the set to add: every rank gets the error, none registers it
    res["mismatch"] = error_text(lambda: hvd.add_process_set([0, 1] if r == 0 else [0, 3]))
    res["again"] = hvd.add_process_set([2, 3]).process_set_id
    res["end"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="end").tolist()
    # a set's ops run on the native core: ops it ran, partitions per stage (byteps.metrics())
    res["native_ops"] = hvd.metrics()["native"]["ops"]
    res["stages"] = hvd.metrics()["native"]["stages"]
    write_result(out, r, {"rank": r, "size": hvd.size(), "value": res})
    hvd.shutdown()


def _registered_sets():
    from byteps.torch import process_sets

    return [process_sets._registered[i] for i in sorted(process_sets._registered)]


# ------------------------------------------------------------------------------ SyncBatchNorm

def bn_input(rank, step, dims):
    """Rank ``rank``'s batch at ``step`` (rank + 2 samples: batch sizes differ) and its loss weights."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + len(dims))
    x = torch.randn((rank + 2, 3, *dims), generator=g, dtype=torch.float64) * 3 + 1.5
    w = torch.randn((rank + 2, 3, *dims), generator=g, dtype=torch.float64)
    return x, w


def bn_run(module, inputs):
    """Train-mode forward/backward of ``module`` on each (x, w) of ``inputs``; loss sum(out * w)."""
    steps = []
    for x, w in inputs:
        x = x.clone().requires_grad_()
        module.zero_grad()
        out = module(x)
        (out * w).sum().backward()
        steps.append({"out": out.detach().tolist(), "dx": x.grad.tolist(), "dw": module.weight.grad.tolist(),
                      "db": module.bias.grad.tolist(), "running": [module.running_mean.tolist(),
                                                                   module.running_var.tolist()]})
    return steps


def bn_module(cls):
    m = cls(3, momentum=0.3).double()
    with torch.no_grad():
        m.weight.copy_(torch.tensor([0.5, 1.5, -2.0]))
        m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return m


@scenario
def hvd_sync_batch_norm(out, args):
    r = hvd.rank()
    res = {}
    for dims in ([], [4, 5]):
        m = bn_module(hvd.SyncBatchNorm)
        res[str(len(dims))] = bn_run(m, [bn_input(r, s, dims) for s in range(2)])
        m.eval()
        res[f"{len(dims)}.eval"] = m(bn_input(r, 5, dims)[0]).detach().tolist()
    return res
