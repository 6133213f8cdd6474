"""Horovod's alltoall, grouped allgather/reducescatter, reducescatter's gradient, sparse allreduce and
int16 moves, on a real 3-worker job (tests/scenarios_collectives.py); every expected value is
computed here from the generators every rank used."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_collectives
from conftest import Run  # noqa: E402
from scenarios_collectives import (A2A_DTYPES, a2a_input, a2a_splits, gathered_piece, rs_input,  # noqa: E402
                                   sparse_input, sparse_model_step)

TIMEOUT = pytest.mark.timeout(240)
N = 3


def hexof(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("collectives"), "hvd_collectives", N, 2,
               env={"BYTEPS_PARTITION_BYTES": "1000"}, timeout=200)


def a2a_reference(n, dtype, inputs=None):
    """[rank] -> (output, received splits) of an alltoall, computed locally."""
    inputs = inputs or [a2a_input(r, n, dtype) for r in range(n)]
    splits = [a2a_splits(r, n) for r in range(n)]
    outs = []
    for me in range(n):
        pieces = []
        for r in range(n):
            start = sum(splits[r][:me])
            pieces.append(inputs[r][start:start + splits[r][me]])
        outs.append((torch.cat(pieces), [splits[r][me] for r in range(n)]))
    return outs


@TIMEOUT
def test_alltoall_with_splits_every_dtype(job):
    """test_horovod_alltoall: rows addressed to each rank, in source order; received splits as int32."""
    for r, v in enumerate(job.values("alltoall")):
        for dtype in A2A_DTYPES:
            out, recv = a2a_reference(N, dtype)[r]
            got = v[dtype]
            assert got["out"] == hexof(out), (r, dtype)
            assert got["shape"] == list(out.shape) and got["recv"] == recv and got["recv_dtype"] == "torch.int32"
            assert got["input_unchanged"]
        out, recv = a2a_reference(N, "float32")[r]
        assert v["async"] == {"out": hexof(out), "recv": recv}


@TIMEOUT
def test_alltoall_equal_split(job):
    for r, v in enumerate(job.values("alltoall")):
        want = torch.cat([(torch.arange(N * 4, dtype=torch.int64).reshape(N * 2, 2) + 1000 * q)[2 * r:2 * r + 2]
                          for q in range(N)])
        assert v["equal"] == {"is_tensor": True, "out": want.tolist()}


@TIMEOUT
def test_alltoall_gradient(job):
    """The gradient of an alltoall is the alltoall of the upstream gradient with the received splits."""
    ins = [a2a_input(q, N, "float64").requires_grad_() for q in range(N)]
    outs = a2a_reference(N, "float64", ins)
    loss = 0
    for me, (out, _) in enumerate(outs):
        w = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) + 7 * me
        loss = loss + (out * w).sum()
    loss.backward()
    for r, v in enumerate(job.values("alltoall")):
        assert v["grad"] == ins[r].grad.tolist(), r
        # equal split, upstream (me + 1): the two rows sent to rank d come back as d + 1
        assert v["grad_equal"] == [[float(d + 1)] * 2 for d in range(N) for _ in range(2)]


@TIMEOUT
def test_alltoall_errors(job):
    for r, v in enumerate(job.values("alltoall")):
        for key in ("err_splits_type", "err_equal_split", "err_splits_sum"):
            assert v[key] is not None and "ValueError" in v[key]["types"], (r, key, v[key])
        for key in ("err_rank", "err_type"):
            assert v[key] is not None and "RuntimeError" in v[key]["types"], (r, key, v[key])
        assert v["after_errors"] == [float(q) for q in range(N)]
        err = v["err_one_rank"]
        assert err is not None and "ValueError" in err["types"], (r, err)
        assert "a2a.one_rank" in err["msg"] and "rank 1's splits ([3, -1, " in err["msg"], (r, err["msg"])
        assert v["err_one_rank_s"] < 10, f"rank {r}: the error took {v['err_one_rank_s']:.1f} s"


@TIMEOUT
def test_grouped_allgather(job):
    for r, v in enumerate(job.values("grouped_allgather")):
        for i, dt in enumerate(["float32", "int16", "int64"]):
            want = torch.cat([gathered_piece(q, i, dt) for q in range(N)])
            assert v["outs"][i] == hexof(want) and v["shapes"][i] == list(want.shape), (r, i)
        assert v["is_list"] and v["async_tuple"]
        # gradient: Average-allreduce of the upstream gradient, then this rank's rows
        for k in range(2):
            rows = sum(q + k + 1 for q in range(N))
            up = (torch.arange(rows, dtype=torch.float64)[:, None] + 1).expand(rows, 2) * (k + 1)
            off = sum(q + k + 1 for q in range(r))
            assert v["grads"][k] == up[off:off + r + k + 1].tolist(), (r, k)


def _blocks(rows, n):
    counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
    return [sum(counts[:q]) for q in range(n)], counts


@TIMEOUT
def test_reducescatter_values_and_gradient(job):
    """Horovod: the gradient of a reducescatter is the gathered upstream gradient (x size for Sum)."""
    total = sum(rs_input(q, N) for q in range(N))
    offs, counts = _blocks(total.shape[0], N)
    up = torch.cat([torch.full((counts[q], 3), float(q + 1), dtype=torch.float64) for q in range(N)])
    for r, v in enumerate(job.values("reducescatter")):
        block = total[offs[r]:offs[r] + counts[r]]
        assert v["sum"] == block.tolist()
        assert v["avg"] == (block / N).tolist()
        assert v["sum_grad"] == (up * N).tolist()
        assert v["avg_grad"] == up.tolist()


@TIMEOUT
def test_grouped_reducescatter(job):
    for r, v in enumerate(job.values("reducescatter")):
        for i, dt in enumerate(["float32", "int32", "float64"]):
            total = sum(rs_input(q, N, i, dt) for q in range(N))
            offs, counts = _blocks(total.shape[0], N)
            assert v["grouped"][i] == total[offs[r]:offs[r] + counts[r]].tolist(), (r, i)
        total = sum(rs_input(q, N, 5) for q in range(N)) / N
        offs, counts = _blocks(total.shape[0], N)
        assert v["grouped_async"] == [total[offs[r]:offs[r] + counts[r]].tolist()]
        assert v["grouped_grad"] == [[[float(N)] * 3] * (2 * N + 1)] * 2
        assert "ValueError" in v["err_scalar"]["types"] and "RuntimeError" in v["err_scalar"]["types"]
        assert "RuntimeError" in v["err_adasum"]["types"]
        assert "RuntimeError" in v["err_grouped_max"]["types"]


@TIMEOUT
def test_sparse_allreduce_async(job):
    dense = sum(sparse_input(q, N).to_dense() for q in range(N))
    for v in job.values("sparse"):
        assert v["sum"] == {"is_sparse": True, "dense": dense.tolist()}
        assert v["avg"] == {"is_sparse": True, "dense": (dense / N).tolist()}


@TIMEOUT
def test_int16_moves_and_unsupported_types(job):
    """Horovod's int16 for broadcast/allgather/alltoall; other dtypes raise UnsupportedTypeError
    (a ValueError, as Horovod's, and a TypeError)."""
    ts = [torch.arange(12, dtype=torch.int16).reshape(4, 3) * (q + 1) - 300 * q for q in range(N)]
    for r, v in enumerate(job.values("int16")):
        assert v["broadcast"] == [ts[root].tolist() for root in range(N)]
        assert v["broadcast_dtype"] == "torch.int16"
        assert v["broadcast_"] == ts[N - 1].tolist()
        assert v["allgather"] == [[q - 7] * 2 for q in range(N) for _ in range(q + 1)]
        for key in ("allreduce", "bool_broadcast", "complex_allgather"):
            e = v[key]
            assert e is not None and "UnsupportedTypeError" in e["types"], (key, e)
            assert "ValueError" in e["types"] and "TypeError" in e["types"]
        assert "RuntimeError" in v["mismatch"]["types"], v["mismatch"]


@TIMEOUT
def test_optimizer_parameter_names(job):
    """test_optimizer_no_named_parameters: ``_parameter_names`` maps each parameter to a unique name,
    the same set on every rank."""
    for v in job.values("optimizer"):
        assert v["names_unique"] and v["names_keys_are_params"]
        assert all(names == v["names_all"][0] for names in v["names_all"]) and len(v["names_all"]) == N


@TIMEOUT
def test_sparse_as_dense_hands_back_sparse(job):
    """Embedding(sparse=True) + SparseAdam with sparse_as_dense=True: the averaged gradient is made
    sparse again before the step, as Horovod does (SparseAdam rejects dense gradients)."""
    grads = []
    for q in range(N):
        sparse_model_step(q, reduce=lambda g: grads.append(g.to_dense()) or g)
    mean = sum(grads) / N
    want = sparse_model_step(0, reduce=lambda g: mean.to_sparse())
    for v in job.values("optimizer"):
        assert v["sparse"] == want and v["sparse"]["grad_after"]


@TIMEOUT
def test_broadcast_optimizer_state_initialises_like_horovod(job):
    """test_broadcast_state_no_grad: an empty state takes Horovod's local dummy step (zero grads),
    frozen parameters keep grad None; SparseAdam gets sparse zero grads; LBFGS (which Horovod
    rejects) is broadcast without it."""
    for v in job.values("optimizer"):
        ng = v["no_grad"]
        assert ng["a_grad_none"]
        assert ng["b_grad"] == [0.0] * 4 and ng["b_grad_bcast"] == ng["b_grad"]
        assert ng["state_keys"] == ["momentum_buffer"]
        # rank 0's b, after one step with a zero gradient: weight decay only, nesterov momentum
        b = torch.arange(4, dtype=torch.float32)
        p = torch.nn.Parameter(b.clone())
        o = torch.optim.SGD([p], lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
        p.grad = torch.zeros(4)
        o.step()
        assert ng["b"] == p.detach().tolist()
        assert v["sparse_adam_state"] == ["exp_avg", "exp_avg_sq", "step"]
        assert v["lbfgs_state"]


@pytest.mark.timeout(180)
def test_join_first_joiner_not_rank_0_fails_fast(tmp_path):
    """Four ranks, rank 2 joins last of nothing but first of all: the others' broadcast and allgather,
    declared before its join, raise RuntimeError at once (Horovod fails at once), and join() returns
    the same last rank everywhere."""
    run = Run(tmp_path, "hvd_join_order", 4, 1, args={"first": 2}, timeout=150)
    vals = run.values()
    for kind in ("broadcast", "allgather"):
        lasts = {v[kind]["last"] for v in vals}
        assert len(lasts) == 1 and lasts != {2}, (kind, lasts)
        for r, v in enumerate(vals):
            if r == 2:
                continue
            e = v[kind]["error"]
            assert e is not None and "RuntimeError" in e["types"], (kind, r, e)
            assert v[kind]["seconds"] < 10, (kind, r, v[kind]["seconds"])  # BYTEPS_TIMEOUT is 30 here
    for v in vals:
        assert v["after"] == [6.0, 6.0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("first", [0, 3])
def test_join_fails_fast_for_cached_names(tmp_path, first):
    """A broadcast or allgather whose key every rank already has (no new declaration reaches the
    scheduler) fails at once on the ranks still running, whichever rank joins first and whether
    its JOIN reaches the servers before or after their pushes; the names work again afterwards."""
    run = Run(tmp_path, "hvd_join_cached", 4, 2, args={"first": first}, timeout=170)
    vals = run.values()
    root = (first + 1) % 4
    bcast = [float(root)] * 3
    gathered = [[float(r)] * 2 for r in range(4) for _ in range(r + 1)]
    for r, v in enumerate(vals):
        assert v["warm"] == [bcast, gathered] and v["again"] == [bcast, gathered], r
    for order in ("late", "early"):
        for kind in ("broadcast", "allgather"):
            sec = f"{order}.{kind}"
            assert len({v[sec]["last"] for v in vals}) == 1, sec
            for r, v in enumerate(vals):
                if r == first:
                    continue
                e = v[sec]["error"]
                assert e is not None and "RuntimeError" in e["types"], (sec, r, e)
                assert v[sec]["seconds"] < 10, (sec, r, v[sec]["seconds"])  # BYTEPS_TIMEOUT is 30 here
