"""``hvd.SyncBatchNorm`` on a real 3-worker job with different batch sizes per rank: outputs, input,
weight and bias gradients and running statistics equal torch.nn.BatchNorm's on the concatenated
batch, computed here (float64)."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # --import-mode=importlib: find conftest / scenarios_psets
from conftest import Run  # noqa: E402
from scenarios_psets import bn_input, bn_module  # noqa: E402

N = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("syncbn"), "hvd_sync_batch_norm", N, 1, timeout=150)


def close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("dims", [[], [4, 5]], ids=["1d", "2d"])
def test_sync_batch_norm_equals_batch_norm_of_the_whole_batch(job, dims):
    ref = bn_module(torch.nn.BatchNorm1d if not dims else torch.nn.BatchNorm2d)
    vals = job.values()
    bounds = [0]
    for r in range(N):
        bounds.append(bounds[-1] + r + 2)
    for step in range(2):
        xs, ws = zip(*(bn_input(r, step, dims) for r in range(N)))
        x = torch.cat(xs).requires_grad_()
        ref.zero_grad()
        out = ref(x)
        (out * torch.cat(ws)).sum().backward()
        dw = torch.zeros(3, dtype=torch.float64)
        db = torch.zeros(3, dtype=torch.float64)
        for r, v in enumerate(vals):
            got = v[str(len(dims))][step]
            close(got["out"], out.detach()[bounds[r]:bounds[r + 1]])
            close(got["dx"], x.grad[bounds[r]:bounds[r + 1]])
            close(got["running"][0], ref.running_mean)
            close(got["running"][1], ref.running_var)
            dw += torch.tensor(got["dw"], dtype=torch.float64)
            db += torch.tensor(got["db"], dtype=torch.float64)
        close(dw.tolist(), ref.weight.grad)  # each rank holds its share; the optimizer adds them up
        close(db.tolist(), ref.bias.grad)
    ref.eval()
    for r, v in enumerate(vals):
        close(v[f"{len(dims)}.eval"], ref(bn_input(r, 5, dims)[0]).detach())
