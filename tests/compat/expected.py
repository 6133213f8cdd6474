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
        "TorchTests::test_broadcast_state_gpu": "marked skip in Horovod's file (unittest.skip)",
        "TorchTests::test_timeline_api": "marked skip in Horovod's file (pytest.mark.skip)",
        "TorchTests::test_delta_optimizer": "Horovod skips it without MPI (Adasum needs MPI); byteps has no Adasum",
        "TorchTests::test_horovod_allreduce_cpu_gpu_error": _GPU,
        "TorchTests::test_horovod_allreduce_multi_gpu": _GPU,
        "TorchTests::test_horovod_alltoall_splits_on_gpu": _GPU,
        "TorchTests::test_horovod_grouped_allreduce_cpu_gpu_error": _GPU,
        "TorchTests::test_horovod_sync_batch_norm": _GPU,
        "TorchTests::test_model_parallelism": _GPU,
    },
}

# test_tensorflow.py runs every test in graph and in eager mode as unittest subtests: a subtest that fails
# is listed as "test[graph_mode]" / "test[eager_mode]"; GPU-only tests skip inside their subtests (their
# test line reads PASSED), so the skip list names only what pytest itself skips.
_KERAS3_REF = ("calls var.ref() on a Keras 3 variable, which has no ref() (keras.Variable is not a tf.Variable); "
               "fails before any byteps call, whatever the backend")
_KERAS3_FUSED = ("builds its reference tf.keras.layers.BatchNormalization(fused=False): Keras 3 removed fused=, so "
                 "it fails before hvd.SyncBatchNormalization is reached (byteps.tensorflow has it: docs/compat.md)")
_TF_SESSION = "tf.test.TestCase's own session helper, collected by pytest and skipped by TensorFlow"
_FP16_PRODUCT = ("float16: the product of 4 values in [-100, 100] overflows to inf in the test's own reference "
                 "(tf.math.reduce_prod) as in any backend's result; inf - inf is NaN, which fails diff <= threshold")
TENSORFLOW = {
    # test -> (fewest ranks, reason), for each test that fails on every rank of a job of that many ranks or more
    "failed_from": {
        "TensorFlowTests::test_horovod_allreduce_product_cpu[graph_mode]": (4, _FP16_PRODUCT),
        "TensorFlowTests::test_horovod_allreduce_product_cpu[eager_mode]": (4, _FP16_PRODUCT),
        "TensorFlowTests::test_horovod_grouped_allreduce_product_cpu[graph_mode]": (4, _FP16_PRODUCT),
        "TensorFlowTests::test_horovod_grouped_allreduce_product_cpu[eager_mode]": (4, _FP16_PRODUCT),
    },
    "failed": {
        "TensorFlowTests::test_horovod_syncbn_cpu[graph_mode]": _KERAS3_FUSED,
        "TensorFlowTests::test_horovod_syncbn_cpu[eager_mode]": _KERAS3_FUSED,
        "TensorFlowTests::test_partial_distributed_gradient_tape[graph_mode]": _KERAS3_REF,
        "TensorFlowTests::test_partial_distributed_gradient_tape[eager_mode]": _KERAS3_REF,
    },
    "skipped": {
        "TensorFlowTests::test_session": _TF_SESSION,
        "BaseTensorFlowTests::test_session": _TF_SESSION + " (the file's base class, imported by name, is "
                                                           "collected too)",
    },
}
