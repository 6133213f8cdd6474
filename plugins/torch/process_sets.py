"""Horovod's process sets: ``hvd.ProcessSet``, ``global_process_set``, ``init(process_sets=...)``,
``add_process_set`` / ``remove_process_set`` (how a set's operations travel: docs/compat.md).

Sets are numbered in the order they are added (the global set is 0): every rank must add and remove
the same sets in the same order, as Horovod requires; adding and removing are collective over the job."""
import threading

from byteps import common


class ProcessSet:
    """A set of ranks (Horovod's class): ``ProcessSet([0, 2])``; usable once added."""

    def __init__(self, ranks=None):
        self._ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id = 0 if ranks is None else None
        self.mpi_comm = None

    @property
    def ranks(self):
        return list(range(common.size())) if self._ranks is None else list(self._ranks)

    def size(self):
        return len(self.ranks)

    def rank(self):
        """This process's index among the set's ranks, or None if it is not a member."""
        ranks = self.ranks
        return ranks.index(common.rank()) if common.rank() in ranks else None

    def included(self):
        return common.rank() in self.ranks

    def __repr__(self):
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet(id={self.process_set_id}, {self._ranks})"


global_process_set = ProcessSet()

_registered = {}            # id -> ProcessSet added on this rank (the global set is not listed)
_lock = threading.Lock()


def _register(process_set):
    """Give ``process_set`` the next id (the same on every rank that adds the same sets in order)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} was added already (it has an id)")
    ranks = process_set.ranks
    if not ranks or not all(0 <= r < common.size() for r in ranks):
        raise ValueError(f"a process set needs ranks in 0..{common.size() - 1}, got {ranks}")
    with _lock:
        if ranks == global_process_set.ranks or any(p.ranks == ranks for p in _registered.values()):
            raise ValueError(f"a process set with ranks {ranks} exists already")
        process_set.process_set_id = max(_registered, default=0) + 1
        _registered[process_set.process_set_id] = process_set
    return process_set


def _agree(what, value):
    """Check that every rank of the job called ``what`` with the same ``value`` (a collective)."""
    # named by the call alone (exchanges are sequential): a rank whose last one failed still meets the others'
    seen = common.exchange(f"process_set.{what}", value)
    if len({repr(v) for v in seen.values()}) > 1:
        detail = "; ".join(f"rank {r}: {v}" for r, v in sorted(seen.items()))
        raise ValueError(f"{what}() must be called by every rank with the same process set: {detail}")


def init_sets(process_sets):
    """``init(process_sets=...)``: a list of ProcessSets or rank lists, numbered 1, 2, ... in order
    (every rank passes the same list), or "dynamic"; returns nothing."""
    _reset()
    if process_sets is None or process_sets == "dynamic":
        return
    for p in process_sets:
        _register(p)


def add_process_set(process_set):
    """Add a process set (a ProcessSet or a list of ranks) on every rank (collective); return it."""
    ranks = process_set.ranks if isinstance(process_set, ProcessSet) else sorted({int(r) for r in process_set})
    _agree("add_process_set", ranks)
    return _register(process_set)


def remove_process_set(process_set):
    """Remove an added process set on every rank (collective); False for the global set or an unknown one."""
    _agree("remove_process_set", getattr(process_set, "process_set_id", None))
    with _lock:
        pid = getattr(process_set, "process_set_id", None)
        if not pid or _registered.get(pid) is not process_set:
            return False
        del _registered[pid]
        process_set.process_set_id = None
        return True


def _reset():
    """Forget every added set (init and shutdown)."""
    with _lock:
        for p in _registered.values():
            p.process_set_id = None
        _registered.clear()


def _wire_set(process_set):
    """What the engine takes for ``process_set``: None for every rank, else ``(id, ranks)``; ValueError
    for a set that was never added (or was removed), or that this rank is not a member of."""
    if process_set is None or process_set is global_process_set or process_set.process_set_id == 0:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    pid = process_set.process_set_id
    if pid is None or _registered.get(pid) is not process_set:
        raise ValueError(f"{process_set!r} is not a registered process set: add it with add_process_set() "
                         "or init(process_sets=...)")
    ranks = process_set.ranks
    if ranks == global_process_set.ranks:
        return None
    if common.rank() not in ranks:
        raise ValueError(f"rank {common.rank()} is not a member of {process_set!r}")
    return pid, tuple(ranks)


def _members(pset):
    """(size, this rank's index, global ranks) of an engine-level set (None: the whole job)."""
    if pset is None:
        return common.size(), common.rank(), list(range(common.size()))
    ranks = list(pset[1])
    return len(ranks), ranks.index(common.rank()), ranks
