"""Keras callbacks of ``byteps.tensorflow.keras`` (the same classes as :mod:`byteps.tensorflow.callbacks`)."""
from ..callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,  # noqa: F401
                         LearningRateWarmupCallback, MetricAverageCallback)
from ..callbacks import __all__  # noqa: F401
