"""Horovod's process sets (``hvd.ProcessSet``, ``global_process_set``, ...): byteps supports only
the global set, every rank of the job.

A module of its own below ops.py and mpi_ops.py, so that both check ``process_set`` arguments
without importing each other; mpi_ops.py re-exports these names as Horovod's.
"""
from byteps import common


class ProcessSet:
    """Horovod's process set. byteps supports only the global set (every rank)."""

    def __init__(self, ranks=None):
        self._ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None
        self.mpi_comm = None

    @property
    def ranks(self):
        return list(range(common.size())) if self._ranks is None else list(self._ranks)

    def size(self):
        return len(self.ranks)

    def rank(self):
        return common.rank() if self.included() else None

    def included(self):
        return common.rank() in self.ranks

    def __repr__(self):
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet({self._ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set):
    raise NotImplementedError("byteps supports only the global process set (every rank); "
                              "add_process_set() is not available")


def remove_process_set(process_set):
    return False


def _check_process_set(process_set):
    if process_set is None or process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.ranks == list(range(common.size())):
        return
    raise NotImplementedError(f"byteps supports only the global process set, not {process_set!r}")
