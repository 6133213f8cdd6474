"""``horovod.tensorflow.keras`` = ``byteps.tensorflow.keras``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.tensorflow.keras")
