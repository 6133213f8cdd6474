"""Keras callbacks of ``byteps.keras`` (the same classes as :mod:`byteps.tensorflow.callbacks`)."""
from byteps.tensorflow.callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,  # noqa: F401
                                         LearningRateWarmupCallback, MetricAverageCallback)
from byteps.tensorflow.callbacks import __all__  # noqa: F401
