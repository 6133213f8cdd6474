"""``horovod.keras.elastic`` = ``byteps.keras.elastic``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.keras.elastic")
