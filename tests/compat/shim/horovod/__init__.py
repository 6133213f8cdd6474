"""A stand-in ``horovod`` package whose modules only re-export byteps, so that Horovod's own test files and
scripts run unchanged on byteps (tests/compat/harness.py puts this folder on PYTHONPATH).

Horovod's helper modules that its test files import (``horovod.runner.util.threads``,
``horovod.tensorflow.util``) are read from the pinned Horovod tree named by ``BYTEPS_COMPAT_DIR``.
"""
import os

_pinned = os.environ.get("BYTEPS_COMPAT_DIR")
if _pinned:
    __path__.append(os.path.join(_pinned, "horovod", "horovod"))
