"""``horovod.tensorflow`` = ``byteps.tensorflow`` (plus Horovod's own ``horovod.tensorflow.util``, pinned)."""
from horovod._reexport import reexport

reexport(globals(), "byteps.tensorflow", pinned_subdir="tensorflow")
