"""Horovod compatibility: a Horovod script runs with ``import byteps.torch as hvd``.

Ports of the core behaviours of Horovod's test/parallel/test_torch.py
(https://github.com/horovod/horovod/blob/master/test/parallel/test_torch.py), each checked on real multi-process
jobs. To keep the cost down, one job (tests/scenarios_hvd.py) runs many checks and the tests
below each assert one behaviour of its results. Also: jobs started by torchrun, by a
horovodrun-style and by an mpirun-style environment, with no DMLC_* variable at all.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_hvd
from conftest import FAST_ENV, Run  # noqa: E402
from scenarios_hvd import (DTYPES_ALL, DTYPES_REDUCE, all_optimizers, base_tensor, gather_piece,  # noqa: E402
                           hvd_data, hvd_model, rank_tensor)

from byteps import config, launch_env  # noqa: E402
from byteps.errors import ConfigError  # noqa: E402

TIMEOUT = pytest.mark.timeout(180)
N = 3  # workers of the API and optimizer jobs (Min/Max/allgather need more than 2 to mean much)


def hexof(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


def same_bytes(got_hex, want, what):
    assert got_hex == hexof(want), f"{what}: want {want.reshape(-1)[:8].tolist()}"


# ===================================================================================== collectives

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("hvd_api"), "hvd_api", N, 2, env={"BYTEPS_PARTITION_BYTES": "1000"})


@TIMEOUT
def test_allreduce_sum_and_average(api):
    """test_horovod_allreduce / _average: Sum = x*size exactly; Average (the default) = x."""
    for r, v in enumerate(api.values("allreduce")):
        for dtype in DTYPES_REDUCE:
            for dim in (1, 2):
                x = base_tensor(dtype, dim)
                same_bytes(v[f"sum.{dtype}.{dim}"], x * N, f"rank {r} Sum {dtype} {dim}-D")
                same_bytes(v[f"unnamed.{dtype}.{dim}"], x * N, f"rank {r} unnamed Sum {dtype} {dim}-D")
                same_bytes(v[f"avg.{dtype}.{dim}"], x, f"rank {r} Average {dtype} {dim}-D")


@TIMEOUT
def test_allreduce_inplace_and_out_of_place(api):
    for r, v in enumerate(api.values("allreduce")):
        assert v["inplace_same"], f"rank {r}: allreduce_ returned another tensor"
        same_bytes(v["inplace"], base_tensor("float32", 2, salt=1) * N, f"rank {r} allreduce_")
        o = v["oop_async"]
        assert o["input_unchanged"] and o["other_object"], (r, o)
        same_bytes(o["out"], base_tensor("int32", 1, salt=2) * N, f"rank {r} allreduce_async")


@TIMEOUT
def test_integer_average_truncates_like_horovod(api):
    # sum over ranks of [-7, -5, 5, 7] (+1 on rank 0) = [-20, -14, 16, 22]; / 3 toward zero
    for v in api.values("allreduce"):
        assert v["int_avg_trunc"] == [-6, -4, 5, 7]


@TIMEOUT
def test_op_average_arguments(api):
    for v in api.values("allreduce"):
        assert v["average_false"] == [float(N)] * 3 and v["average_warned"]
        assert v["op_and_average"].startswith("ValueError: The op parameter supersedes average")
        assert v["adasum"].startswith("NotImplementedError")
        e = v["unsupported_int16"]
        assert "ValueError" in e["types"] and "TypeError" in e["types"] and "int16" in e["msg"], e


@TIMEOUT
def test_async_ops_are_async(api):
    """poll() is False right after submit while rank 1 is late (test_horovod_allreduce_async_fused)."""
    vals = api.values("async")
    for r in (0, 2):
        assert vals[r]["poll_right_after"] is False, f"rank {r}: allreduce_async_ completed before rank 1 submitted"
        assert vals[r]["burst_poll_false"], f"rank {r}: poll() never returned False in a burst of 20"
        assert vals[r]["gather_poll_right_after"] is False, f"rank {r}: allgather_async was not async"
    for v in vals:
        assert v["late"] == [float(sum(range(N)))] * 3
        assert v["burst"] == [float(N * i) for i in range(20)]
        assert v["late_gather"] == [r for r in range(N) for _ in range(r + 1)]


@TIMEOUT
def test_broadcast_from_every_root(api):
    """test_horovod_broadcast / _inplace: every root, 8 dtypes; out-of-place leaves the source alone."""
    for r, v in enumerate(api.values("broadcast")):
        for dtype in DTYPES_ALL:
            for root in range(N):
                b = v[f"{dtype}.{root}"]
                want = torch.full((17, 3), root, dtype=getattr(torch, dtype))
                same_bytes(b["out"], want, f"rank {r} broadcast {dtype} from {root}")
                same_bytes(b["inplace"], want, f"rank {r} broadcast_ {dtype} from {root}")
                assert b["src_unchanged"] and b["inplace_same"], (r, dtype, root, b)
        assert v["async"] == [1.0] * 4


@TIMEOUT
def test_allgather_variable_sizes_bit_exact(api):
    """test_horovod_allgather_variable_size: dim 0 differs per rank; -0.0, NaN, -inf survive bit-exactly."""
    for r, v in enumerate(api.values("allgather")):
        for dtype in DTYPES_ALL:
            want = torch.cat([gather_piece(q, dtype) for q in range(N)])
            same_bytes(v[dtype], want, f"rank {r} allgather {dtype}")
        assert v["unnamed"] == [q for q in range(N) for _ in range(2)]
        assert v["scalar"] == [float(q) for q in range(N)]
        assert v["empty_rank0"] == [[q, q] for q in range(1, N) for _ in range(2)]
        assert v["async"] == [[q, q] for q in range(N) for _ in range(q + 1)]


@TIMEOUT
def test_autograd(api):
    """Gradients: Sum allreduce -> size x; Average -> 1 x; broadcast -> root only; allgather -> own slice."""
    for r, v in enumerate(api.values("autograd")):
        assert v["allreduce_sum"] == [float(N)] * 5
        assert v["allreduce_avg"] == [1.0] * 5
        assert v["allreduce_sum_rank_grads"] == [3.0 * sum(range(1, N + 1))] * 5
        for root in range(N):
            assert v[f"broadcast.{root}"] == [1.0 if r == root else 0.0] * 4, (r, root)
        offset = sum(q + 1 for q in range(r)) * 2
        want = torch.arange(offset, offset + (r + 1) * 2, dtype=torch.float64).reshape(r + 1, 2)
        assert v["allgather"] == want.tolist()
        assert v["grouped"] == [[float(N)] * 3] * 3


@TIMEOUT
def test_min_max_product(api):
    """test_horovod_allreduce_min / _max / _product: rank-dependent tensors, exact."""
    for r, v in enumerate(api.values("mmp")):
        for dtype in ("int32", "int64", "float32", "float64"):
            stacked = torch.stack([rank_tensor(q, dtype, (4, 5)) for q in range(N)])
            same_bytes(v[f"Min.{dtype}"], stacked.amin(0), f"rank {r} Min {dtype}")
            same_bytes(v[f"Max.{dtype}"], stacked.amax(0), f"rank {r} Max {dtype}")
            same_bytes(v[f"Max_inplace.{dtype}"], stacked.amax(0), f"rank {r} Max in place {dtype}")
            same_bytes(v[f"Product.{dtype}"], stacked.prod(0, dtype=stacked.dtype), f"rank {r} Product {dtype}")
        same_bytes(v["Min_async"], torch.stack([rank_tensor(q, "float32", (3,)) for q in range(N)]).amin(0),
                   f"rank {r} Min async")


def _scaled(t, f):
    if f == 1.0:
        return t
    if t.dtype == torch.float16:
        return (t.float() * f).half()
    if t.dtype.is_floating_point:
        return t * f
    return (t.double() * f).to(t.dtype)  # fp64, truncated toward zero (Horovod's ScaleBuffer)


@TIMEOUT
def test_prescale_postscale(api):
    """test_horovod_allreduce_prescale / _postscale, integers scaled in fp64 and truncated."""
    for r, v in enumerate(api.values("scaling")):
        for dtype in ("int32", "int64", "float16", "float32", "float64"):
            ts = [rank_tensor(q, dtype, (6,), lo=-9, hi=10) for q in range(N)]
            pre = sum(_scaled(t, 1.5) for t in ts)
            same_bytes(v[f"pre.{dtype}"], pre, f"rank {r} prescale {dtype}")
            same_bytes(v[f"post.{dtype}"], _scaled(sum(ts), 0.5), f"rank {r} postscale {dtype}")
            s = sum(_scaled(t, 2.0) for t in ts)
            if s.dtype.is_floating_point:
                want = _scaled(s, 0.25) / N
            else:
                want = _scaled(s, 0.25 / N)
            same_bytes(v[f"avg_pre_post.{dtype}"], want, f"rank {r} Average with pre/postscale {dtype}")


@TIMEOUT
def test_grouped_allreduce(api):
    dts = ["float32", "int32", "float64", "int64", "float16"]
    for r, v in enumerate(api.values("grouped")):
        want = [sum(rank_tensor(q, dt, (3 + i,), salt=i) for q in range(N)) for i, dt in enumerate(dts)]
        for key in ("sync", "async", "inplace"):
            for i, w in enumerate(want):
                same_bytes(v[key][i], w, f"rank {r} grouped {key} #{i}")
        assert (v["sync_type"], v["async_type"]) == ("list", "tuple")
        assert v["inputs_unchanged"] and v["inplace_same"]
        assert v["avg"] == [[1.0, 1.0]] * 3


@TIMEOUT
def test_mismatches_raise_runtime_error_on_every_rank_and_job_continues(api):
    """Shape (17+rank), ndim, dtype, root rank, allgather dim>0 ... : RuntimeError everywhere, then it works."""
    keys = ["shape", "ndim", "dtype", "bcast_root", "bcast_shape", "bcast_dtype", "gather_dim1", "gather_dtype",
            "min_shape", "grouped_shape"]
    for r, v in enumerate(api.values("mismatch")):
        for key in keys:
            e = v[key]
            assert e is not None, f"rank {r}: no error for mismatched {key}"
            assert "RuntimeError" in e["types"] and "TensorMismatchError" in e["types"], (r, key, e)
            assert v[f"{key}.after"] == [float(sum(range(N)))] * 3, (r, key)


@TIMEOUT
def test_duplicate_inflight_name_raises_value_error(api):
    """test_horovod_*_duplicate_name_error: ValueError at submit on the duplicating rank; the first op completes."""
    vals = api.values("duplicate")
    for kind in ("allreduce", "allgather", "broadcast", "grouped", "min"):
        e = vals[0][kind]
        assert e is not None and e["types"][0] == "ValueError", (kind, e)
        for r, v in enumerate(vals):
            want = {"allreduce": [float(N)] * 3, "allgather": [[1.0, 1.0]] * (2 * N), "broadcast": [0.0] * 3,
                    "grouped": [[float(N)] * 2], "min": [0.0, 0.0]}[kind]
            assert v[f"{kind}.value"] == want, (r, kind)


@TIMEOUT
def test_ranks_sizes_and_build_queries(api):
    for r, v in enumerate(api.values("misc")):
        assert v["ids"] == {"rank": r, "size": N, "local_rank": 0, "local_size": 1, "cross_rank": r, "cross_size": N,
                            "is_initialized": True, "is_homogeneous": True}
        from byteps import build_info  # the GPU libraries load in the workers as they do here
        gpu = {"cuda_built": build_info.cuda_built(), "nccl_built": build_info.nccl_built()}
        assert {k: v["built"][k] for k in gpu} == gpu, v["built"]
        assert not any(b for k, b in v["built"].items() if k not in gpu), v["built"]
        assert v["ops"] == [0, 1, 2, 3, 4, 5]  # Average, Sum, Adasum, Min, Max, Product as in Horovod


@TIMEOUT
def test_fp16_compression(api):
    """test_compression_fp16: floats travel as fp16 and come back in their dtype; integers untouched."""
    for v in api.values("misc"):
        f = v["fp16"]
        assert f["float32"] == ["torch.float16", "torch.float32", [1.0] * 4]
        assert f["float64"] == ["torch.float16", "torch.float64", [1.0] * 4]
        for dt in ("int32", "int64", "uint8"):
            assert f[dt] == [f"torch.{dt}", f"torch.{dt}", [1] * 4]
        assert v["fp16_allreduce"] == [0.5 * sum(range(1, N + 1))] * 5
        assert v["fp16_allreduce_dtype"] == "torch.float64"


@TIMEOUT
def test_objects_barrier_join_reducescatter(api):
    vals = api.values("misc")
    for r, v in enumerate(vals):
        assert v["bcast_object"] == {"root": 1, "t": [1, 2.5]}
        assert v["allgather_object"] == [{"rank": q, "x": [q] * q} for q in range(N)]
        if r != 0:
            assert v["barrier_waited"] > 0.8, f"rank {r} left the barrier before rank 0 arrived"
        assert v["join"] == N - 1, f"rank {r}: join() returned {v['join']}, not the last rank to join"
        assert v["join_again"] == vals[0]["join_again"], "join() returned different ranks"
        rows = 2 * N + 1
        counts = [rows // N + (1 if q < rows % N else 0) for q in range(N)]
        start = sum(counts[:r])
        idx = torch.arange(start, start + counts[r], dtype=torch.float64)
        scale = sum(range(1, N + 1))
        assert v["reducescatter_sum"] == (idx * scale).unsqueeze(1).repeat(1, 2).tolist()
        assert v["reducescatter_avg"] == (idx * scale / N).unsqueeze(1).repeat(1, 2).tolist()
        assert v["reducescatter_min"].startswith("RuntimeError")
        assert v["process_set"] is None  # a collective add_process_set works (tests/test_process_sets.py)


@TIMEOUT
def test_shutdown_then_init_again(api):
    """test_horovod_reinit: Horovod's tearDown (barrier, shutdown) then init: same rank, ops work."""
    for r, v in enumerate(api.values("reinit")):
        assert v["between"] is False and v["rank"] == r
        assert v["allgather"] == [q for q in range(N) for _ in range(q + 1)]
        assert v["max"] == [float(N - 1)]


# ===================================================================================== optimizers

@pytest.fixture(scope="module")
def optim(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("hvd_optim"), "hvd_optim", N, 1)


def _all_optimizer_classes():
    out, todo = set(), list(torch.optim.Optimizer.__subclasses__())
    while todo:
        c = todo.pop()
        if c.__module__.startswith("torch.optim"):
            out.add(c.__name__)
        todo += c.__subclasses__()
    return out


def test_every_torch_optimizer_is_covered():
    missing = _all_optimizer_classes() - set(all_optimizers())
    assert not missing, f"scenarios_hvd.all_optimizers() lacks {sorted(missing)}"


@TIMEOUT
@pytest.mark.parametrize("name", sorted(all_optimizers()))
def test_broadcast_optimizer_state_round_trip(optim, name):
    """test_broadcast_state(_options): every optimizer (LBFGS and SparseAdam included), rank-dependent
    state and hyper-parameters; afterwards every rank holds root 0's, with Python types preserved."""
    got = [v[name] for v in optim.values("round_trip")]
    for r in range(1, N):
        assert got[r]["state"] == got[0]["state"], f"{name}: rank {r}'s state differs from root 0's"
        assert got[r]["after_step"] == got[0]["after_step"], f"{name}: a step after the broadcast diverged"
    groups = got[0]["state"]["param_groups"]["items"]
    assert float(groups[0]["lr"]["repr"]) == pytest.approx(_root_lr(name)), f"{name}: lr is not root 0's"
    assert got[0]["state"]["state"], f"{name}: the state is empty"
    if name in ("Adam", "Rprop"):
        key = "betas" if name == "Adam" else "etas"
        assert groups[0][key]["__type__"] == "tuple"


def _root_lr(name):
    return {"SGD": 0.01, "Adam": 1e-3, "AdamW": 1e-3, "Adamax": 2e-3, "Adagrad": 1e-2, "Adadelta": 1.0,
            "RMSprop": 1e-3, "Rprop": 1e-3, "ASGD": 1e-2, "NAdam": 2e-3, "RAdam": 1e-3, "Adafactor": 1e-2,
            "LBFGS": 0.5, "SparseAdam": 1e-3, "Muon": 1e-3}[name]


@TIMEOUT
def test_broadcast_empty_optimizer_state(optim):
    """The root's empty Adam state first takes Horovod's local dummy step (zero gradients), so every
    rank ends with the root's one-step state, whatever it held before."""
    vals = optim.values("fresh")
    assert all(v == vals[0] for v in vals) and vals[0]["state"] != {}
    for st in vals[0]["state"].values():
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        zero = torch.zeros(st["exp_avg"]["shape"], dtype=torch.float32)
        assert st["exp_avg"]["hex"] == st["exp_avg_sq"]["hex"] == hexof(zero)


def _reference(op_sum=False, steps=4):
    model = hvd_model(1)
    x, y = hvd_data(8 * N)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if op_sum:
            for p in model.parameters():
                p.grad.mul_(N)
        opt.step()
    return model.state_dict()


def _trained(optim, key):
    vals = [v[key] for v in optim.values("behaviour")]
    for r in range(1, N):
        assert vals[r] == vals[0], f"{key}: rank {r}'s parameters differ from rank 0's"
    ref = _reference()
    return {n: torch.frombuffer(bytearray(bytes.fromhex(vals[0][n])), dtype=torch.float64).reshape(ref[n].shape)
            for n in ref}


@TIMEOUT
@pytest.mark.parametrize("key,op_sum,tol", [("train_avg", False, 1e-12), ("train_sum", True, 1e-12),
                                            ("train_predivide", False, 1e-12), ("train_passes", False, 1e-12),
                                            ("train_fp16", False, 2e-3)])
def test_distributed_optimizer_ops(optim, key, op_sum, tol):
    """op=Average/Sum, gradient_predivide_factor, backward_passes_per_step, fp16 compression: the
    same weights on every rank, equal to single-process training on the combined batch."""
    got, ref = _trained(optim, key), _reference(op_sum)
    init = hvd_model(1).state_dict()
    for n in ref:
        assert not torch.equal(ref[n], init[n])
        torch.testing.assert_close(got[n], ref[n], rtol=tol, atol=tol, msg=lambda m, n=n: f"{key} {n}: {m}")


@TIMEOUT
def test_distributed_optimizer_errors(optim):
    for v in optim.values("behaviour"):
        assert v["predivide_with_sum"].startswith("ValueError")
        assert v["adasum"].startswith("NotImplementedError")
        for key in ("not_tuples", "duplicate_names", "missing_names"):
            assert v[key] and v[key].startswith("ValueError"), (key, v[key])
        assert v["zero_grad_inflight"]["types"][0] == "AssertionError"
        assert "optimizer.zero_grad() was called after loss.backward()" in v["zero_grad_inflight"]["msg"]
        assert v["twice"]["types"][0] == "AssertionError"
        assert "Gradients were computed more than backward_passes_per_step" in v["twice"]["msg"]


@TIMEOUT
def test_gradient_clipping_and_step_warning(optim):
    """test_gradient_clipping / test_synchronize_step_warning."""
    vals = optim.values("behaviour")
    for v in vals:
        prior, clipped = v["clipped"]
        assert abs(prior) > abs(clipped)
        assert v["skip_warnings"] == 0
        assert len(v["step_warnings"]) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in v["step_warnings"][0]
        assert v["after_clip"] == vals[0]["after_clip"]


@TIMEOUT
def test_force_allreduce_and_sparse_gradients(optim):
    """test_force_allreduce (ranks use different outputs: no deadlock, same weights); SparseAdam with an
    Embedding(sparse=True) through the DistributedOptimizer."""
    vals = optim.values("behaviour")
    for v in vals[1:]:
        assert v["force_allreduce"] == vals[0]["force_allreduce"]
        assert v["sparse"] == vals[0]["sparse"]
    torch.manual_seed(6)
    init = torch.nn.Embedding(10, 3, sparse=True).weight.detach()
    assert vals[0]["sparse"] != hexof(init)


# ===================================================================================== launch_env (unit)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc"}


def test_launch_env_torchrun_mapping():
    out = launch_env.translate(dict(TORCHRUN))
    assert {k: out[k] for k in ("DMLC_NUM_WORKER", "DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
                                "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER", "BYTEPS_JOB_ID")} == {
        "DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_RANK": "1", "BYTEPS_LOCAL_SIZE": "2",
        "DMLC_PS_ROOT_URI": "10.0.0.5", "DMLC_PS_ROOT_PORT": "29501", "DMLC_NUM_SERVER": "1",
        "BYTEPS_JOB_ID": "torchrun-abc"}


def test_launch_env_overrides_and_passthrough():
    env = dict(TORCHRUN, DMLC_PS_ROOT_PORT="7000", DMLC_NUM_SERVER="3")
    out = launch_env.translate(env)
    assert (out["DMLC_PS_ROOT_PORT"], out["DMLC_NUM_SERVER"]) == ("7000", "3")
    out = launch_env.translate(dict(TORCHRUN, BYTEPS_SCHEDULER_URI="sched.example:6000"))
    assert (out["DMLC_PS_ROOT_URI"], out["DMLC_PS_ROOT_PORT"]) == ("sched.example", "6000")
    explicit = dict(TORCHRUN, DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0")
    assert launch_env.translate(explicit) is explicit  # a byteps job description wins
    for role in ("scheduler", "server"):
        assert launch_env.translate(dict(TORCHRUN), role=role)["RANK"] == "3"
        assert "DMLC_NUM_WORKER" not in launch_env.translate(dict(TORCHRUN), role=role)
    single = dict(TORCHRUN, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                  GROUP_WORLD_SIZE="1")
    assert launch_env.translate(single) is single  # one process: standalone, no services


def test_launch_env_horovod_and_mpi_mapping():
    hv = {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "6", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
          "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "3", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9",
          "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000", "BYTEPS_SCHEDULER_URI": "10.0.0.7"}
    out = launch_env.translate(hv)
    assert (out["DMLC_NUM_WORKER"], out["DMLC_WORKER_ID"], out["BYTEPS_LOCAL_RANK"], out["BYTEPS_LOCAL_SIZE"],
            out["DMLC_PS_ROOT_URI"], out["DMLC_PS_ROOT_PORT"]) == ("3", "2", "1", "2", "10.0.0.7", "4001")
    del hv["BYTEPS_SCHEDULER_URI"]
    with pytest.raises(ConfigError, match="BYTEPS_SCHEDULER_URI"):  # several nodes, rank 0's host unknown
        launch_env.translate(hv)
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_ess_base_jobid": "777"}
    out = launch_env.translate(ompi)
    assert (out["DMLC_NUM_WORKER"], out["DMLC_WORKER_ID"], out["BYTEPS_LOCAL_RANK"], out["DMLC_PS_ROOT_URI"]) == \
        ("1", "0", "2", "127.0.0.1")
    assert out["DMLC_PS_ROOT_PORT"] == launch_env.translate(dict(ompi, OMPI_COMM_WORLD_RANK="0"))["DMLC_PS_ROOT_PORT"]
    pmi = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "5000"}
    out = launch_env.translate(pmi)
    assert (out["DMLC_NUM_WORKER"], out["DMLC_WORKER_ID"], out["BYTEPS_LOCAL_RANK"], out["DMLC_PS_ROOT_URI"],
            out["DMLC_PS_ROOT_PORT"]) == ("2", "1", "1", "10.1.1.1", "5001")


def test_launch_env_rejects_uneven_nodes_and_feeds_config():
    with pytest.raises(ConfigError, match="same number of processes"):
        launch_env.translate(dict(TORCHRUN, WORLD_SIZE="5"))
    cfg = config.load(dict(TORCHRUN, MASTER_ADDR="127.0.0.1"))
    assert (cfg.num_worker, cfg.worker_id, cfg.local_rank, cfg.local_size, cfg.root_uri, cfg.root_port,
            cfg.num_server) == (2, 1, 1, 2, "127.0.0.1", 29501, 1)
    assert launch_env.service_pids() == []  # a dict that is not os.environ never starts services


# ===================================================================================== launchers (processes)

def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "HOROVOD_", "OMPI_", "PMI_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.update({k: v for k, v in FAST_ENV.items() if k != "BYTEPS_TIMEOUT"}, BYTEPS_TIMEOUT="60", **extra)
    return env


def _results(outdir, n):
    out = {}
    for r in range(n):
        path = os.path.join(outdir, f"result.{r}.json")
        assert os.path.exists(path), f"no result from rank {r}"
        with open(path) as f:
            out[r] = json.load(f)
    return out


def _assert_gone(pids, what):
    deadline = time.monotonic() + 5
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: scheduler/server processes {alive} are still running after the job")


def _check_job(res, n, local_size, nodes):
    pids = []
    for r in range(n):
        v = res[r]
        assert (v["rank"], v["size"]) == (r, n)
        assert (v["local_rank"], v["local_size"]) == (r % local_size, local_size)
        assert (v["cross_rank"], v["cross_size"]) == (r // local_size, nodes)
        assert v["env_dmlc"] == [], "the launcher test must run without DMLC_* variables"
        assert v["allreduce"] == [float(sum(range(1, n + 1)))] * 4
        assert v["allgather"] == [q for q in range(n) for _ in range(q + 1)]
        assert (v["config"]["num_worker"], v["config"]["worker_id"]) == (nodes, r // local_size)
        assert bool(v["service_pids"]) == (r == 0), "only global rank 0 starts the scheduler and servers"
        pids += v["service_pids"]
    assert len(pids) == 2  # scheduler + 1 server
    return pids


@TIMEOUT
def test_torchrun_standalone_without_dmlc(tmp_path):
    """`torchrun --standalone --nproc_per_node=2 script.py`: rank 0 starts the scheduler and a server;
    the allreduce is right; when torchrun returns, those services are gone."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(HERE, "scenarios_hvd.py"), "launcher",
            str(tmp_path)]
    p = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    res = _results(str(tmp_path), 2)
    pids = _check_job(res, 2, 2, 1)
    assert res[0]["config"]["job_id"].startswith("torchrun-")
    _assert_gone(pids, "torchrun")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@TIMEOUT
def test_torchrun_two_nodes_without_dmlc(tmp_path):
    """Two torchrun agents (--nnodes=2, node ranks 0/1, 1 process each): DMLC_NUM_WORKER=2, worker ids = node ranks."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = _free_port()
    procs = []
    for node in (0, 1):
        argv = [torchrun, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                f"--master_port={port}", os.path.join(HERE, "scenarios_hvd.py"), "launcher", str(tmp_path)]
        procs.append(subprocess.Popen(argv, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    _assert_gone(_check_job(_results(str(tmp_path), 2), 2, 1, 2), "torchrun --nnodes=2")


def _spawn_all(envs, outdir):
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "scenarios_hvd.py"), "launcher", outdir],
                              env=_clean_env(**e), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-3000:] for o in outs)


@TIMEOUT
def test_horovodrun_gloo_environment(tmp_path):
    """The variables horovodrun --gloo sets (2 processes on one host), no DMLC_*."""
    port = _free_port()
    envs = [{"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r), "HOROVOD_LOCAL_SIZE": "2",
             "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
             "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port - 1), "HOROVOD_CONTROLLER": "gloo"} for r in range(2)]
    _spawn_all(envs, str(tmp_path))
    _assert_gone(_check_job(_results(str(tmp_path), 2), 2, 2, 1), "horovodrun")


@TIMEOUT
def test_mpirun_environment(tmp_path):
    """Open MPI's variables (3 processes on one host), no DMLC_*; with a real mpirun when one is installed."""
    n = 3
    if shutil.which("mpirun"):
        argv = ["mpirun", "--allow-run-as-root", "-np", str(n), "-x", "PYTHONPATH", sys.executable,
                os.path.join(HERE, "scenarios_hvd.py"), "launcher", str(tmp_path)]
        p = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    else:
        job = str(_free_port())
        envs = [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(n), "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                 "OMPI_COMM_WORLD_LOCAL_SIZE": str(n), "OMPI_MCA_ess_base_jobid": job} for r in range(n)]
        _spawn_all(envs, str(tmp_path))
    _assert_gone(_check_job(_results(str(tmp_path), n), n, n, 1), "mpirun")


@TIMEOUT
def test_scheduler_port_taken_fails_fast(tmp_path):
    """Rank 0 cannot start the scheduler (its port is taken): a clear error within seconds, not a hang."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = _clean_env(HOROVOD_RANK="0", HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="2",
                         HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1", HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                         HOROVOD_GLOO_RENDEZVOUS_PORT=str(port - 1))
        start = time.monotonic()
        p = subprocess.run([sys.executable, os.path.join(HERE, "scenarios_hvd.py"), "launcher", str(tmp_path)],
                           env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and time.monotonic() - start < 20
    assert "ConfigError" in p.stderr and f"127.0.0.1:{port}" in p.stderr and "DMLC_PS_ROOT_PORT" in p.stderr, \
        p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_dtype_one_rank_refuses_fails_every_collective_promptly(tmp_path):
    """Horovod's collectives, unnamed, with a complex tensor on rank 1 only: rank 0's allreduce, Max
    allreduce, grouped allreduce, allgather, alltoall and grouped allgather each fail within seconds naming rank 1 (not after
    BYTEPS_TIMEOUT, 30 s here), and the next unnamed allreduce is exact on both ranks."""
    run = Run(tmp_path, "hvd_refused_dtypes", 2, 1, timeout=110)
    for rank, v in enumerate(run.values()):
        assert v["after"] == [3.0] * 3, (rank, v)
        for name in ("allreduce", "max", "grouped", "allgather", "alltoall", "grouped_allgather"):
            err = v[name]["error"]
            assert err is not None and "complex64" in err, (rank, name, v[name])
            if rank == 0:
                assert "rank 1 refused the call" in err and v[name]["seconds"] < 10, (name, v[name])
