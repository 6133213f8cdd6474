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


def _future(handles, result, after=None):
    """A ``torch.futures.Future`` that holds ``result`` once every handle has finished (``after`` runs
    first); it holds the first error instead, if any."""
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
    return fut


def _work(handles, result, after=None):
    """A Work completed as :func:`_future` is."""
    from torch._C._distributed_c10d import _create_work_from_future

    return _create_work_from_future(_future(handles, result, after))


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

    def __repr__(self):
        return f"ProcessGroupBytePS(rank={self._rank}, size={self._size})"

    # ---------------------------------------------------------------- reductions

    def allreduce(self, tensors, opts=None):
        op = _op(opts)
        base = self._name("allreduce")
        handles = [_allreduce_start(t, f"{base}.{i}", op) for i, t in enumerate(tensors)]
        return _work(handles, tensors)

    allreduce_coalesced = allreduce

    def reduce(self, tensors, opts=None):
        op = _op(opts)
        base = self._name("reduce")
        # only the root's tensors take the result
        targets = tensors if self._rank == opts.rootRank else [t.detach().clone() for t in tensors]
        return _work([_allreduce_start(t, f"{base}.{i}", op) for i, t in enumerate(targets)], tensors)

    def _reduce_scatters(self, outputs, chunk_lists, opts, kind):
        """outputs[i] <- this rank's chunk of chunk_lists[i] reduced over the ranks (one allreduce each)."""
        op = _op(opts)
        base = self._name(kind)
        flats = [torch.cat([c.reshape(-1) for c in chunks]) for chunks in chunk_lists]
        handles = [_allreduce_start(flat, f"{base}.{i}", op) for i, flat in enumerate(flats)]

        def cut():
            for out, chunks, flat in zip(outputs, chunk_lists, flats):
                offset = sum(c.numel() for c in chunks[:self._rank])
                out.copy_(flat[offset:offset + chunks[self._rank].numel()].view_as(out))
        return _work(handles, outputs, cut)

    def reduce_scatter(self, output_tensors, input_tensor_lists, opts=None):
        return self._reduce_scatters(output_tensors, input_tensor_lists, opts, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatters([output], [input.chunk(self._size)], opts, "reduce_scatter_single")

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

    allgather_coalesced = allgather

    def all_gather_single(self, output, input, opts=None):
        return _work(self._gathers([output.chunk(self._size)], [input], "all_gather_single"), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _work(self._gathers([out.chunk(self._size) for out in outputs], inputs, "all_gather_coalesced"),
                     outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        outs = output_tensors
        if self._rank != opts.rootRank:  # every rank receives; only the root keeps what it got
            outs = [[torch.empty_like(inp) for _ in range(self._size)] for inp in input_tensors]
        return _work(self._gathers(outs, input_tensors, "gather"), output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        base = self._name("scatter")
        handles = []
        for i, out in enumerate(output_tensors):
            if self._rank == root:
                with torch.no_grad():
                    out.copy_(input_tensors[i][root])
            for r in range(self._size):
                if r == self._rank:
                    buf = out
                elif self._rank == root:
                    buf = input_tensors[i][r].detach().clone()
                else:
                    buf = torch.empty_like(out)
                handles.append(broadcast_async_(buf, root, name=f"{base}.{i}.{r}"))
        return _work(handles, output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if list(output_split_sizes) or list(input_split_sizes):
            n = self._size
            sizes = set(output_split_sizes) | set(input_split_sizes)
            if not (len(sizes) == 1 and len(output_split_sizes) == n == len(input_split_sizes)):
                raise NotImplementedError("byteps process group: all_to_all with unequal splits is not supported")
        gathered = [torch.empty_like(input) for _ in range(self._size)]
        handles = self._gather_into(gathered, input, self._name("all_to_all_single"))
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
