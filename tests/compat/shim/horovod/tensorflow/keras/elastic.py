"""``horovod.tensorflow.keras.elastic`` = ``byteps.tensorflow.keras.elastic``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.tensorflow.keras.elastic")
