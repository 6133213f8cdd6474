"""byteps.torch API behaviour, each through real multi-process runs (or a clean subprocess).

To keep the cost down one job runs many checks: a module-scoped fixture launches a cluster
once per scenario (tests/scenarios_torch.py) and the tests below each assert one behaviour of
its results. A failed run fails every test that depends on it, with the logs.
"""
import functools
import json
import operator
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_torch
from conftest import Run  # noqa: E402
from scenarios_torch import (_params_with_poison, batch_for_step, make_data, make_model,  # noqa: E402
                             make_optimizer, make_tensor, undigest)

import byteps  # noqa: E402

TIMEOUT = pytest.mark.timeout(120)


def total(spec, n, rnd=0):
    return functools.reduce(operator.add, [make_tensor(r, spec, rnd) for r in range(n)])


def tensor_of(hexstr, like):
    return undigest(hexstr, like.dtype, tuple(like.shape))


def assert_same_bytes(got_hex, want, what):
    got = tensor_of(got_hex, want)
    assert got_hex == (want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()), \
        f"{what}: got {got.reshape(-1)[:8].tolist()}, want {want.reshape(-1)[:8].tolist()}"


# ===================================================================================== API job

API_N = 3


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("api"), "torch_api", API_N, 2, env={"BYTEPS_PARTITION_BYTES": "1000"})


@TIMEOUT
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_parameters_overwrites_nan_inf(api, root):
    """Non-root ranks hold NaN/Inf/-1: after broadcast_parameters every rank has exactly root's bytes."""
    want = _params_with_poison(root, root)
    for r in range(API_N):
        got = api.value(r)["broadcast"][f"root{root}"]
        for name, t in want.items():
            assert_same_bytes(got[name], t, f"rank {r} {name} ({t.dtype}, {tuple(t.shape)}) from root {root}")


@TIMEOUT
def test_broadcast_parameters_named_parameters(api):
    model = make_model(100, torch.float32)  # rank 0's model
    for r in range(API_N):
        got = api.value(r)["broadcast"]["named"]
        for name, p in model.named_parameters():
            assert_same_bytes(got[name], p.detach(), f"rank {r} parameter {name}")


@TIMEOUT
@pytest.mark.parametrize("kind", ["momentum", "adam", "adam_fresh"])
def test_broadcast_optimizer_state(api, kind):
    """Tensors (momentum buffers, exp_avg, step), scalars and hyper-parameters all equal root 0's."""
    states = [api.value(r)["optimizer"][kind] for r in range(API_N)]
    root = states[0]
    for r in range(1, API_N):
        assert states[r] == root, f"rank {r}'s {kind} optimizer state differs from root 0's:\n{states[r]}\n{root}"
    group = root["param_groups"][0]
    if kind == "momentum":
        assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.05, 0.9, 1e-3)
        bufs = [s["momentum_buffer"] for s in root["state"].values()]
        assert len(bufs) == 4
        for b in bufs:  # real, finite momentum buffers
            t = undigest(b["hex"], torch.float32, tuple(b["shape"]))
            assert torch.isfinite(t).all() and t.abs().sum() > 0
    else:
        assert group["lr"] == 0.003 and list(group["betas"]) == [0.8, 0.95]
        if kind == "adam":
            assert len(root["state"]) == 4
            st = next(iter(root["state"].values()))
            assert set(st) >= {"step", "exp_avg", "exp_avg_sq"}
            step = undigest(st["step"]["hex"], getattr(torch, st["step"]["dtype"].split(".")[-1]), ())
            assert step.item() == 2
        else:  # Horovod's semantics: an empty state is first initialised by a local dummy step (zero grads)
            assert len(root["state"]) == 4
            st = next(iter(root["state"].values()))
            assert set(st) >= {"step", "exp_avg", "exp_avg_sq"}
            for key in ("exp_avg", "exp_avg_sq"):
                t = undigest(st[key]["hex"], torch.float32, tuple(st[key]["shape"]))
                assert (t == 0).all(), (key, t)
    after = [api.value(r)["optimizer"][kind + ".after_step"] for r in range(API_N)]
    for r in range(1, API_N):
        assert after[r] == after[0], f"rank {r}: a step with the received {kind} state gave other weights than root's"


@TIMEOUT
def test_broadcast_object_from_root_1(api):
    want = {"dict": repr({"a": 1, "b": [1.5, "x", None], "c": {"nested": (1, 2)}}),
            "list": repr([3, 1, 4, 1, 5, 9]), "none": repr(None)}
    for r in range(API_N):
        assert api.value(r)["objects"] == want, f"rank {r}"


@TIMEOUT
def test_unnamed_push_pulls_do_not_collide(api):
    s = API_N * (API_N + 1) / 2
    for r in range(API_N):
        ops = api.value(r)["ops"]
        for shape, hexstr in ops["unnamed"]:
            assert_same_bytes(hexstr, torch.full(tuple(shape), s), f"rank {r} unnamed push_pull of shape {shape}")
        for n, hexstr in zip((1, 2, 3, 4), ops["unnamed_async"]):
            want = torch.full((n,), float(n * sum(range(API_N))))
            assert_same_bytes(hexstr, want, f"rank {r} unnamed async push_pull of {n} elements")


@TIMEOUT
def test_out_of_place_leaves_input(api):
    spec = {"dtype": "float32", "shape": (4, 3), "kind": "int"}
    ispec = {"dtype": "int32", "shape": (6,), "kind": "int"}
    for r in range(API_N):
        ops = api.value(r)["ops"]
        for key, sp, want in [("oop", spec, total(spec, API_N)),
                              ("oop_async", ispec, torch.floor_divide(total(ispec, API_N), API_N))]:
            o = ops[key]
            assert not o["same_object"], f"rank {r} {key}: returned the input tensor"
            assert o["after"] == o["before"], f"rank {r} {key}: the input changed"
            assert_same_bytes(o["before"], make_tensor(r, sp), f"rank {r} {key} input")
            assert_same_bytes(o["out"], want, f"rank {r} {key} output")


@TIMEOUT
def test_inplace_async_poll_synchronize(api):
    spec = {"dtype": "float64", "shape": (9,), "kind": "int"}
    for r in range(API_N):
        o = api.value(r)["ops"]
        assert o["inplace"]["polled_true"], f"rank {r}: poll() never became True"
        assert o["inplace"]["same_object"], f"rank {r}: synchronize() returned another object"
        assert_same_bytes(o["inplace"]["value"], total(spec, API_N), f"rank {r} in-place result")
        assert o["sync_twice"] and o["sync_twice"].startswith("ValueError"), o["sync_twice"]


@TIMEOUT
def test_duplicate_inflight_name_raises_at_submit(api):
    o = api.value(0)["ops"]
    for key in ("dup_error", "dup_error_oop"):
        assert o[key] is not None and o[key].startswith("ValueError") and "'dup'" in o[key], o[key]
    for r in range(API_N):
        o = api.value(r)["ops"]
        assert_same_bytes(o["dup_value"], torch.full((3,), float(API_N)), f"rank {r}: the first 'dup' op")
        assert_same_bytes(o["dup_reuse"], torch.full((3,), float(API_N)), f"rank {r}: 'dup' reused later")


@TIMEOUT
def test_noncontiguous_inplace_written_back(api):
    s1 = {"dtype": "float32", "shape": (4, 6), "kind": "int"}
    s2 = {"dtype": "int64", "shape": (5, 6), "kind": "int", "salt": 3}
    s3 = {"dtype": "float64", "shape": (3, 8), "kind": "int", "salt": 4}
    for r in range(API_N):
        o = api.value(r)["ops"]
        assert o["noncontig_t"]["same_object"] and o["noncontig_slice"]["same_object"], \
            f"rank {r}: push_pull_inplace did not return the view it was given"
        assert_same_bytes(o["noncontig_t"]["base"], total(s1, API_N), f"rank {r}: base of t.t()")
        want = make_tensor(r, s2)
        want[:, ::2] = total(s2, API_N)[:, ::2]
        assert_same_bytes(o["noncontig_slice"]["base"], want, f"rank {r}: base of t[:, ::2] (odd columns untouched)")
        want = make_tensor(r, s3)
        want[1:, 1::3] = total(s3, API_N)[1:, 1::3] / API_N
        assert_same_bytes(o["noncontig_avg"]["base"], want, f"rank {r}: base of an averaged 2-D slice")
        s4 = {"dtype": "int32", "shape": (10,), "kind": "int", "salt": 5}
        want = make_tensor(r, s4)
        want[3:7] = total(s4, API_N)[3:7]
        assert_same_bytes(o["offset_view"]["base"], want, f"rank {r}: base of the view t[3:7]")


@TIMEOUT
def test_unsupported_dtype_type_error(api):
    """Horovod's UnsupportedTypeError (a TypeError and a ValueError), naming the tensor and its dtype."""
    for r in range(API_N):
        o = api.value(r)["ops"]
        errs = o["bad_dtype"]
        for key, name in [("complex64", "my_complex_tensor"), ("bool", "my_bool_tensor"),
                          ("bool_bcast", "my_bool_bcast")]:
            assert errs[key] and errs[key].startswith("UnsupportedTypeError") and name in errs[key], (r, key, errs[key])
        assert "complex64" in errs["complex64"] and "bool" in errs["bool"]
        assert_same_bytes(o["after_errors"], torch.full((2,), float(API_N)), f"rank {r}: push_pull after errors")


# ===================================================================================== training

RUNS = [
    dict(tag="sgd", opt="sgd", lr=0.1),
    dict(tag="momentum_bcast", opt="momentum", lr=0.05, different_init=True, broadcast=True),
    dict(tag="adam_bcast", opt="adam", lr=0.01, different_init=True, broadcast=True),
    dict(tag="passes2", opt="momentum", lr=0.05, passes=2),
    dict(tag="sgd32", opt="sgd", lr=0.1, dtype="float32"),
    dict(tag="fp16", opt="sgd", lr=0.1, dtype="float32", fp16=True),
    dict(tag="momentum", opt="momentum", lr=0.05),
    dict(tag="momentum_fused", opt="momentum", lr=0.05, fusion=True),
    dict(tag="passes2_fused", opt="momentum", lr=0.05, passes=2, fusion=True),
    dict(tag="fp16_fused", opt="sgd", lr=0.1, dtype="float32", fp16=True, fusion=True),
]
for _r in RUNS:
    _r.update(steps=6, data=24, per_step=8, seed=1)


def reference(cfg):
    """Single-process training on the combined batch, from rank 0's initial weights."""
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    model = make_model(cfg["seed"], dtype)
    x, y = make_data(cfg["data"], dtype)
    opt = make_optimizer(cfg["opt"], model.parameters(), cfg["lr"])
    for step in range(cfg["steps"]):
        xb, yb = batch_for_step(x, y, step, cfg["per_step"])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    return {n: p.detach() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("train"), "torch_train", 2, 2, {"runs": RUNS})


def trained(train, tag):
    """Rank 0's final parameters, after checking every rank holds bitwise the same ones."""
    vals = [v[tag] for v in train.values()]
    for r in range(1, len(vals)):
        assert vals[r] == vals[0], f"run {tag}: rank {r}'s parameters differ from rank 0's"
    ref = reference(next(c for c in RUNS if c["tag"] == tag))
    return {n: tensor_of(vals[0][n], ref[n]) for n in ref}, ref


@TIMEOUT
@pytest.mark.parametrize("tag", ["sgd", "momentum_bcast", "adam_bcast", "passes2", "sgd32", "momentum_fused",
                                 "passes2_fused"])
def test_distributed_optimizer_matches_combined_batch(train, tag):
    got, ref = trained(train, tag)
    init = make_model(1, ref[next(iter(ref))].dtype).state_dict()
    tol = dict(rtol=1e-9, atol=1e-12) if ref[next(iter(ref))].dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for n in ref:
        assert not torch.equal(ref[n], init[n]), f"{tag}: {n} did not train"
        torch.testing.assert_close(got[n], ref[n], **tol, msg=lambda m, n=n: f"run {tag}, parameter {n}: {m}")


@TIMEOUT
@pytest.mark.parametrize("fused,plain", [("momentum_fused", "momentum"), ("passes2_fused", "passes2"),
                                         ("fp16_fused", "fp16")])
def test_fusion_gives_the_same_bits(train, fused, plain):
    """Balanced fusion buffers (byteps/fusion.py) change how gradients travel, not the sums: with
    two workers every sum is order-free, so fused training ends bit-identical to per-tensor."""
    assert train.value(0)[fused] == train.value(0)[plain], f"{fused} differs from {plain}"


@TIMEOUT
def test_fp16_compression_close_to_uncompressed(train):
    got, ref = trained(train, "fp16")
    plain, _ = trained(train, "sgd32")
    assert any(not torch.equal(got[n], plain[n]) for n in got), "fp16 compression changed nothing: not applied?"
    for n in ref:
        torch.testing.assert_close(got[n], plain[n], rtol=2e-3, atol=2e-3, msg=lambda m, n=n: f"fp16 vs plain {n}: {m}")
        torch.testing.assert_close(got[n], ref[n], rtol=2e-3, atol=2e-3, msg=lambda m, n=n: f"fp16 vs ref {n}: {m}")


# ===================================================================================== re-init

@TIMEOUT
def test_shutdown_then_init_again(tmp_path):
    run = Run(tmp_path, "torch_reinit", 2, 2, {"epochs": 3}, env={"BYTEPS_PARTITION_BYTES": "1000"})
    assert run.server_codes == [0, 0] and run.sched_code == 0, run.c.all_logs()
    spec = {"dtype": "float32", "shape": (1001,), "kind": "int"}
    for r in range(2):
        v = run.value(r)
        assert v["initialized_between"] is False
        assert v["rank_between"].startswith("NotInitializedError"), v["rank_between"]
        assert v["push_pull_between"].startswith("NotInitializedError"), v["push_pull_between"]
        assert len(v["epochs"]) == 3
        for epoch, e in enumerate(v["epochs"]):
            assert (e["rank"], e["size"]) == (r, 2)
            assert_same_bytes(e["again"], total(spec, 2, rnd=epoch), f"rank {r} epoch {epoch}")
            assert_same_bytes(e["unnamed"], torch.full((3,), 1.0), f"rank {r} epoch {epoch} unnamed")


# ===================================================================================== no cluster

def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def run_standalone(tmp_path, scenario, env):
    argv = [sys.executable, os.path.join(HERE, "scenarios.py"), scenario, str(tmp_path), json.dumps({"no_init": True})]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    name = {"torch_standalone": "standalone", "torch_init_error": "init_error"}[scenario]
    path = tmp_path / f"{name}.json"
    assert p.returncode == 0 and path.exists(), f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    return run_standalone(tmp_path_factory.mktemp("alone"), "torch_standalone", clean_env())


@TIMEOUT
def test_calls_before_init_raise_not_initialized(standalone):
    assert standalone["is_initialized_before"] is False
    for what, err in standalone["before"].items():
        assert err is not None and err.startswith("NotInitializedError"), f"{what} before init(): {err}"
    assert standalone["after_shutdown"].startswith("NotInitializedError"), standalone["after_shutdown"]
    assert standalone["after_shutdown_push_pull"].startswith("NotInitializedError")


@TIMEOUT
def test_single_process_mode_without_dmlc(standalone):
    assert (standalone["rank"], standalone["size"]) == (0, 1)
    assert (standalone["local_rank"], standalone["local_size"]) == (0, 1)
    x = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    pp = standalone["push_pull"]
    assert pp["out"] == x and pp["int"] == [[0, 1, 2], [3, 4, 5]] and pp["input"] == x and pp["inplace_same"]
    assert standalone["broadcast_object"] == {"k": [1, 2]}
    assert standalone["bad_dtype"].startswith("UnsupportedTypeError") and "alone_complex" in standalone["bad_dtype"]


def test_not_initialized_in_process():
    """In this very process (never initialized): NotInitializedError, which is a byteps error."""
    import byteps.torch as bps

    assert not bps.is_initialized()
    with pytest.raises(byteps.NotInitializedError):
        bps.rank()
    with pytest.raises(byteps.NotInitializedError):
        bps.push_pull(torch.ones(2))
    assert issubclass(byteps.NotInitializedError, byteps.BytePSError)


@TIMEOUT
def test_bad_num_worker_raises_config_error(tmp_path):
    env = clean_env(DMLC_ROLE="worker", DMLC_NUM_WORKER="abc", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0",
                    DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9")
    res = run_standalone(tmp_path, "torch_init_error", env)
    assert res["error"] and res["error"].startswith("ConfigError") and "DMLC_NUM_WORKER" in res["error"], res
    assert "abc" in res["error"]
    assert res["is_initialized"] is False
