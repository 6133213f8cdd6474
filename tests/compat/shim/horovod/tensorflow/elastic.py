"""``horovod.tensorflow.elastic`` = ``byteps.tensorflow.elastic``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.tensorflow.elastic")
