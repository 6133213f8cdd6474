"""PyTorch DistributedDataParallel on byteps: the "byteps" torch.distributed backend and the DDP
communication hook, each checked on a real 2-worker job against single-process training on the
combined batch; and examples/train_ddp.py under torchrun (no DMLC_* variables)."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_hvd
from scenarios_hvd import ddp_reference_batches, hvd_model  # noqa: E402
from test_horovod_compat import Run, _clean_env  # noqa: E402

TIMEOUT = pytest.mark.timeout(180)
N, STEPS = 2, 5


def reference():
    """Single process, rank 0's initial weights, each step on both workers' batches together."""
    model = hvd_model(1)
    x, y = ddp_reference_batches(N, STEPS)
    per = x.shape[0] // STEPS
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[step * per:(step + 1) * per]), y[step * per:(step + 1) * per]).backward()
        opt.step()
    return model.state_dict()


def check_training(run):
    vals = run.values()
    for r in range(1, N):
        assert vals[r]["params"] == vals[0]["params"], f"rank {r}'s parameters differ from rank 0's"
    ref, init = reference(), hvd_model(1).state_dict()
    for n, want in ref.items():
        got = torch.frombuffer(bytearray(bytes.fromhex(vals[0]["params"][n])), dtype=torch.float64).reshape(want.shape)
        assert not torch.equal(want, init[n]), f"{n} did not train"
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"parameter {n}: {m}")
    assert vals[0]["losses"] != vals[1]["losses"], "both workers saw the same data"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("ddp_backend"), "ddp_backend", N, 1, {"steps": STEPS})


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("ddp_hook"), "ddp_hook", N, 1, {"steps": STEPS})


@TIMEOUT
def test_backend_ddp_matches_combined_batch(backend):
    """init_process_group(backend="byteps") + unmodified DDP: construction broadcasts rank 0's weights
    (the ranks start different), training equals one process on the combined batch."""
    init = {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
            for n, t in hvd_model(1).state_dict().items()}
    for v in backend.values():
        assert (v["backend"], v["world_size"]) == ("byteps", N)
        assert v["after_construction"] == init, "DDP did not broadcast rank 0's parameters at construction"
    check_training(backend)


@TIMEOUT
def test_backend_collectives(backend):
    for r, v in enumerate(backend.values()):
        assert v["rank"] == r
        assert v["all_reduce"] == [3.0] * 5
        assert v["all_reduce_max"] == [2.0] * 3
        assert v["all_reduce_avg"] == [1.5] * 3
        assert v["broadcast"] == [1.0, 1.0]
        assert v["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert v["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        full = torch.arange(2.0 * N) * 3  # sum over ranks of arange * (rank + 1)
        assert v["reduce_scatter_tensor"] == full[2 * r:2 * r + 2].tolist()
        assert v["reduce"] == ([3.0] * 2 if r == 1 else [r + 1.0] * 2)  # only the root takes the sum
        assert v["gather"] == ([[float(q)] * 2 for q in range(N)] if r == 0 else None)
        assert v["scatter"] == [10.0 + r] * 2
        assert v["async_work_wait"] is True
        assert v["all_gather_object"] == [{"r": 0}, {"r": 1}]
        assert v["all_to_all_single"] == [2.0 * r, 2.0 * r + 1, 100 + 2.0 * r, 101 + 2.0 * r]
        assert v["bad_op"].startswith("NotImplementedError") and "BAND" in v["bad_op"]


@TIMEOUT
def test_comm_hook_ddp_matches_combined_batch(hook):
    """DDP over gloo with register_comm_hook(state=None, hook=bps.ddp_comm_hook)."""
    for v in hook.values():
        assert v["hook_calls"] >= STEPS, "the communication hook was not called"
    check_training(hook)


@TIMEOUT
def test_train_ddp_example_under_torchrun(tmp_path):
    """examples/train_ddp.py under torchrun, plain env:// rendezvous, no DMLC_* variables."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    argv = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(ROOT, "examples", "train_ddp.py"),
            "--epochs", "2"]
    p = subprocess.run(argv, env=_clean_env(), capture_output=True, text=True, timeout=150, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-4000:]}"
    assert "final parameters identical on all workers" in out and "backend byteps" in out, out[-4000:]
