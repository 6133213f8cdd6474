"""Elastic state of ``byteps.keras`` (the same classes as :mod:`byteps.tensorflow.keras.elastic`)."""
from byteps.tensorflow.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                             UpdateEpochStateCallback, run)
from byteps.tensorflow.keras.elastic import __all__  # noqa: F401
