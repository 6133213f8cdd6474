"""A ``torch.distributed`` backend named ``"byteps"``: unmodified DDP over the Summation Service.

Importing ``byteps.torch`` registers it (``init_process_group(backend="byteps", init_method="byteps://")``
under bpslaunch, ``backend="byteps"`` under torchrun); docs/launchers.md lists what it supports.
Collectives are byteps operations named ``pg<group>.<sequence>.<kind>`` (torch issues a group's
collectives in the same order on every rank), each returning a ``Work`` completed from byteps'
completion callback."""
import importlib
import itertools
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from byteps import common

from . import completion
from .mpi_ops import Average, Max, Min, Product, Sum, _allreduce_start
from .ops import broadcast_async_

BACKEND = "byteps"

_REDUCE_OPS = {dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average, dist.ReduceOp.MIN: Min,
               dist.ReduceOp.MAX: Max, dist.ReduceOp.PRODUCT: Product}


def _work(handles, result, after=None):
    """A Work whose future holds ``result`` once every handle has finished (``after`` runs first)."""
    from torch._C._distributed_c10d import _create_work_from_future

    fut = torch.futures.Future()

    def done(outcomes):
        err = completion.first_error(outcomes)
        if err is None and after is not None:
            try:
                after()
            except Exception as e:
                err = e
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(result)

    completion.when_done(handles, done)
    return _create_work_from_future(fut)


def _op(opts):
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for k, v in _REDUCE_OPS.items():
        if op == k:
            return v
    raise NotImplementedError(f"byteps process group: reduce op {getattr(op, 'op', op)} is not supported "
                              "(SUM, AVG, MIN, MAX, PRODUCT are)")


class ProcessGroupBytePS(dist.ProcessGroup):
    """The byteps job as a torch process group (see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, rank, size):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gid = next(ProcessGroupBytePS._ids)
        self._seq = itertools.count()

    def _name(self, kind):
        return f"pg{self._gid}.{next(self._seq)}.{kind}"

    def getBackendName(self):
        return BACKEND

    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def __repr__(self):
        return f"ProcessGroupBytePS(rank={self._rank}, size={self._size})"

    # ---------------------------------------------------------------- reductions

    def allreduce(self, tensors, opts=None):
        op = _op(opts)
        base = self._name("allreduce")
        handles = [_allreduce_start(t, f"{base}.{i}", op) for i, t in enumerate(tensors)]
        return _work(handles, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        op = _op(opts)
        base = self._name("reduce")
        copies = [t.detach().clone() for t in tensors]
        handles = [_allreduce_start(c, f"{base}.{i}", op) for i, c in enumerate(copies)]
        root = opts.rootRank

        def write():
            if self._rank == root:
                for t, c in zip(tensors, copies):
                    t.copy_(c)
        return _work(handles, tensors, write)

    def _reduce_scatter_into(self, output, chunks, op, name):
        flat = torch.cat([c.reshape(-1) for c in chunks])
        h = _allreduce_start(flat, name, op)
        n = chunks[self._rank].numel()
        offset = sum(c.numel() for c in chunks[:self._rank])
        return h, lambda: output.copy_(flat[offset:offset + n].view_as(output))

    def _reduce_scatters(self, outputs, chunk_lists, opts, kind):
        op = _op(opts)
        base = self._name(kind)
        parts = [self._reduce_scatter_into(out, list(chunks), op, f"{base}.{i}")
                 for i, (out, chunks) in enumerate(zip(outputs, chunk_lists))]
        return _work([h for h, _ in parts], outputs, lambda: [after() for _, after in parts])

    def reduce_scatter(self, output_tensors, input_tensor_lists, opts=None):
        return self._reduce_scatters(output_tensors, input_tensor_lists, opts, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op(opts)
        h, after = self._reduce_scatter_into(output, list(input.chunk(self._size)), op,
                                             self._name("reduce_scatter_single"))
        return _work([h], [output], after)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatters(outputs, [inp.chunk(self._size) for inp in inputs], opts,
                                     "reduce_scatter_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---------------------------------------------------------------- broadcasts and gathers

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        base = self._name("broadcast")
        handles = [broadcast_async_(t, root, name=f"{base}.{i}") for i, t in enumerate(tensors)]
        return _work(handles, tensors)

    def _gather_into(self, outs, inp, name):
        """outs[r] <- rank r's ``inp`` (one broadcast per root)."""
        if len(outs) != self._size:
            raise ValueError(f"byteps process group: {len(outs)} output tensors for {self._size} ranks")
        with torch.no_grad():
            outs[self._rank].copy_(inp)
        return [broadcast_async_(o, r, name=f"{name}.{r}") for r, o in enumerate(outs)]

    def _gathers(self, output_lists, inputs, kind):
        base = self._name(kind)
        return [h for i, (outs, inp) in enumerate(zip(output_lists, inputs))
                for h in self._gather_into(list(outs), inp, f"{base}.{i}")]

    def allgather(self, output_tensors, input_tensors, opts=None):
        return _work(self._gathers(output_tensors, input_tensors, "allgather"), output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        handles = self._gather_into(list(output.chunk(self._size)), input, self._name("all_gather_single"))
        return _work(handles, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _work(self._gathers([out.chunk(self._size) for out in outputs], inputs, "all_gather_coalesced"),
                     outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        base = self._name("gather")
        handles = []
        for i, inp in enumerate(input_tensors):
            outs = list(output_tensors[i]) if self._rank == root else [torch.empty_like(inp) for _ in
                                                                      range(self._size)]
            handles += self._gather_into(outs, inp, f"{base}.{i}")
        return _work(handles, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        base = self._name("scatter")
        handles = []
        for i, out in enumerate(output_tensors):
            for r in range(self._size):
                if self._rank == root:
                    buf = out if r == root else input_tensors[i][r].detach().clone()
                    if r == root:
                        with torch.no_grad():
                            out.copy_(input_tensors[i][r])
                else:
                    buf = out if r == self._rank else torch.empty_like(out)
                handles.append(broadcast_async_(buf, root, name=f"{base}.{i}.{r}"))
        return _work(handles, output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if list(output_split_sizes) or list(input_split_sizes):
            n = self._size
            sizes = set(output_split_sizes) | set(input_split_sizes)
            if not (len(sizes) == 1 and len(output_split_sizes) == n == len(input_split_sizes)):
                raise NotImplementedError("byteps process group: all_to_all with unequal splits is not supported")
        base = self._name("all_to_all_single")
        gathered = [input.detach().clone() if r == self._rank else torch.empty_like(input)
                    for r in range(self._size)]
        handles = [broadcast_async_(g, r, name=f"{base}.{r}") for r, g in enumerate(gathered)]
        outs = output.chunk(self._size)

        def pick():
            for r in range(self._size):
                outs[r].copy_(gathered[r].chunk(self._size)[self._rank])
        return _work(handles, [output], pick)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        t = torch.zeros(1)
        return _work([_allreduce_start(t, self._name("barrier"), Sum)], [t])

    def send(self, tensors, dst, tag=0):
        raise NotImplementedError("byteps process group: point-to-point send/recv is not supported")

    def recv(self, tensors, src, tag=0):
        raise NotImplementedError("byteps process group: point-to-point send/recv is not supported")


def _create(store, rank, world_size, timeout):
    common.init()
    if (rank, world_size) != (common.rank(), common.size()):
        raise RuntimeError(
            f"init_process_group(backend='byteps'): torch says rank {rank} of {world_size}, but the byteps job "
            f"(from the DMLC_*/launcher environment) has this process as rank {common.rank()} of {common.size()}; "
            "the byteps backend only supports the whole job as one group with byteps' ranks "
            "(use init_method='byteps://', or leave rank/world_size to torchrun)")
    return ProcessGroupBytePS(rank, world_size)


def _byteps_rendezvous(url, timeout=None, **kwargs):
    """``init_method="byteps://"``: rank and world size come from the byteps job."""
    common.init()
    query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
    rank, size = common.rank(), common.size()
    for key, mine in (("rank", rank), ("world_size", size)):
        if key in query and int(query[key]) not in (-1, mine):
            raise RuntimeError(f"init_process_group(init_method='byteps://'): {key}={query[key]} was given, but "
                               f"the byteps job has {key} {mine}")
    yield dist.HashStore(), rank, size
    raise RuntimeError("the byteps:// rendezvous cannot be repeated (re-initialize byteps instead)")


def register():
    """Register backend "byteps" and the "byteps://" rendezvous with torch.distributed (idempotent)."""
    if not dist.is_available():
        return False
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND not in rendezvous._rendezvous_handlers:
        rendezvous.register_rendezvous_handler(BACKEND, _byteps_rendezvous)
    return True
