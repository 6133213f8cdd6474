"""What Horovod's pinned test files are expected to do on byteps, per test, with the reason for each
failure and skip. tests/compat/test_horovod_suites.py holds every rank's outcome to these lists exactly:
a new failure fails CI, and so does a listed failure that starts passing (update the list and
docs/compat.md together).
"""

_MUON = "torch 2.13's own torch.optim.Muon refuses 1-D parameters (the test builds one; Horovod fails it too)"
_GPU = "needs a GPU (CPU-only machine)"

TORCH = {
    # test -> reason, for each test that fails on every rank
    "failed": {
        "TorchTests::test_broadcast_state": _MUON,
        "TorchTests::test_broadcast_state_options": _MUON,
        "TorchTests::test_force_allreduce": _MUON,
    },
    # test -> reason, for each test that skips on every rank
    "skipped": {
        "TorchTests::test_gpu_required": _GPU,
        "TorchTests::test_horovod_sync_batch_norm": _GPU,
        "TorchTests::test_model_parallelism": _GPU,
    },
}
