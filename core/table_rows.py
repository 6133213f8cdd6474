"""The rows of a native table: one per partition of a tensor (core/_worker_core.pyx
``WorkerCore.add_table``, which reads them into ``BpsPart``s: core/pipeline/worker_types.h).

Every writer builds them here, so the column layout is written down once."""
import numpy as np

KEY, OFFSET, LENGTH, SERVER = 0, 1, 2, 3  # the partition: wire key, its bytes in the tensor, its server
REGION, PID, FD, INODE, REGION_OFFSET = 4, 5, 6, 7, 8  # its shared staging region: address here, descriptor
OWNER, COLOCATED = 9, 10  # local reduce: the owner's local rank (-1: none), whether the server shares memory
ENCODED = 11  # whether the table's wire codec encodes its pushes
NCCL_ROOT = 12  # the NCCL stages (CUDA tensors): the local rank whose GPU gets the machine's sum (-1: none)
COLUMNS = 13


def new(count):
    """``count`` rows without staging region, local reduce or encoding."""
    rows = np.zeros((count, COLUMNS), dtype=np.int64)
    rows[:, OWNER] = -1
    rows[:, NCCL_ROOT] = -1
    return rows


def place(rows, row, key, offset, length, server, encoded=False):
    rows[row, KEY:SERVER + 1] = (key, offset, length, server)
    rows[row, ENCODED] = encoded


def stage(rows, row, address, descriptor):
    """The partition's shared staging region: its ``address`` in this process and its ``descriptor``
    (pid, fd, inode, offset: core/shm.py) for the process that maps it."""
    rows[row, REGION:REGION_OFFSET + 1] = (address, *descriptor)


def reduce_locally(rows, row, owner, colocated):
    """The partition is summed on this machine first, by local rank ``owner``."""
    rows[row, OWNER] = owner
    rows[row, COLOCATED] = colocated


def nccl_root(rows, row, root):
    """The partition takes the NCCL stages: reduced onto local rank ``root``'s GPU, pushed from there."""
    rows[row, NCCL_ROOT] = root
