"""Intra-machine aggregation: a machine's worker processes sum through shared memory, and only one
copy of each machine's sum crosses the network (the CPU analogue of the paper's §4.2 local
reduce, with §6.2's shared memory).

Partition ``i`` of tensor key ``t`` is owned by local rank ``(t + i) % L``, so the partitions of a
tensor, and single-partition tensors across a model, spread over the machine's processes (a
reduce-scatter at partition granularity); BYTEPS_LOCAL_PUSH=root makes local rank 0 own all. For each partition and round:

1. COORDINATE: every other local rank copies its partition into its shared staging region and
   sends the owner LOCAL_READY with a descriptor of it.
2. LOCAL_REDUCE: once all L copies are there, the owner's :class:`ComputeStage` thread sums them
   (``sum_many``, fp16/bf16 accumulated in fp32 and rounded once) into the owner's staging region.
3. PUSH / PULL: the owner pushes the machine's sum to the partition's server (shared memory if
   the server is on this machine, TCP otherwise); the server expects one push per machine.
4. LOCAL_BROADCAST: the owner sends LOCAL_DONE with a descriptor of the result (its staging
   region, or the colocated server's store) to the others; every process copies it into its tensor.

A staging region is reused by the next round only after everyone has moved on: a process sends
LOCAL_READY for round r+1 only once it has copied out round r.

Plain push_pulls run these steps in the native core, core/pipeline/bps_worker.h ("Local reduce"): the
network thread byteps-net owns the local sockets, and the sums of partitions >= 256 KB run on its
stage thread (also named byteps-reduce), by priority. The Python path here (core/engine.py) stays
only for what the native core does not run yet: compressed and process-set ops, and join() (a
process switches to it for the rest of the job); the wire messages are the same, and the native
thread hands each partition's messages to whichever side runs it.
"""
import collections
import threading

from byteps.log import logger

from ._pipeline import PriorityQueue
from .threads import name_native


class LocalPlan:
    """Who owns what on this machine: every local rank in turn ("owners"), or local rank 0 ("root",
    BytePS's choice; BYTEPS_LOCAL_PUSH=root). docs/benchmarks.md compares the two."""

    def __init__(self, peers, my_local_rank, mode="owners"):
        self.peers = sorted(peers, key=lambda w: w["local_rank"])  # address-book entries, this machine
        self.size = len(self.peers)
        self.local_rank = my_local_rank
        self.root_only = mode == "root"

    def owner(self, tkey, partition):
        return 0 if self.root_only else (tkey + partition) % self.size

    def owns(self, tkey, partition):
        return self.owner(tkey, partition) == self.local_rank


class ComputeStage:
    """A pipeline stage thread: runs summations in priority order, off the network thread.

    ``submit(priority, fn)`` queues ``fn`` (a closure around ``nogil`` kernels); when it has run,
    ``(fn, error)`` is appended to :attr:`done` and ``wake()`` is called so the network thread
    picks the result up. The thread only ever waits inside the C++ queue, without the GIL.
    """

    def __init__(self, wake, name="byteps-reduce"):
        self._queue = PriorityQueue()
        self._fns = {}
        self._ids = iter(range(1 << 62))
        self._wake = wake
        self.done = collections.deque()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority, fn):
        task = next(self._ids)
        self._fns[task] = fn
        self._queue.push(priority, task, 0)

    def _run(self):
        name_native()
        while (task := self._queue.pop(timeout=-1)) is not None:
            fn = self._fns.pop(task)
            try:
                fn()
                self.done.append((fn, None))
            except Exception as e:  # reported on the op, never lost
                logger.exception("local reduce failed")
                self.done.append((fn, e))
            self._wake()

    def close(self):
        self._queue.close()
        self._thread.join(5)
