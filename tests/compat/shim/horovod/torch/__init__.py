"""``horovod.torch`` = ``byteps.torch``."""
from horovod._reexport import reexport

reexport(globals(), "byteps.torch")
