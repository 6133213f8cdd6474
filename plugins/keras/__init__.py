"""``import byteps.keras as bps``: BytePS's and Horovod's standalone-Keras module. Keras 3 is one
library whether imported as ``keras`` or ``tf.keras``, so this is :mod:`byteps.tensorflow.keras`."""
from byteps.tensorflow.keras import (Average, Compression, DistributedOptimizer, Sum, allgather,  # noqa: F401
                                     allgather_object, allreduce, barrier, broadcast, broadcast_global_variables,
                                     broadcast_object, broadcast_variables, init, is_initialized, load_model,
                                     local_rank, local_size, push_pull, rank, reducescatter, shutdown, size,
                                     SyncBatchNormalization)
from byteps.tensorflow.keras import __all__  # noqa: F401

from . import callbacks, elastic  # noqa: F401,E402
