"""``horovod.keras`` = ``byteps.keras``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.keras")
