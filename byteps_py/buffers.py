"""Host memory that byteps hands out again instead of allocating (and page-faulting) on every call.

Out-of-place calls (``bps.push_pull(t)``, ``push_pull_async``) need a new output tensor each time (a
fresh 64 MB buffer costs 16,384 page faults when first written), so they take it from
:class:`HostPool`: page-aligned blocks that return to the pool, already faulted in, when the numpy
view the framework tensor was made from is freed (``torch.from_numpy`` keeps that exact object alive
as long as any tensor shares its storage), so a result the caller still holds is never reused.
"""
import mmap
import threading
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
#: below this, ordinary allocation is cheap (the heap, no fresh pages): no pooling
MIN_POOLED_BYTES = 256 << 10
#: free blocks kept for reuse, in bytes, across sizes; beyond it a returned block is freed
MAX_FREE_BYTES = 1 << 30
#: blocks of at least this many bytes ask for transparent huge pages (2 MB pages: 512x fewer faults)
HUGEPAGE_BYTES = 2 << 20


def fresh_block(nbytes):
    """A page-aligned uint8 array of ``nbytes`` (rounded up to pages) in its own anonymous mapping,
    with MADV_HUGEPAGE from :data:`HUGEPAGE_BYTES` up. Its pages are faulted in by the first write."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
    if size >= HUGEPAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: ordinary pages
            pass
    return np.frombuffer(m, dtype=np.uint8)


class HostPool:
    """Reusable host blocks by exact (page-rounded) size. Thread-safe."""

    def __init__(self, max_free_bytes=MAX_FREE_BYTES):
        self.max_free_bytes = max_free_bytes
        self._free = {}          # page-rounded size -> [block, ...]
        self._free_bytes = 0
        self._lock = threading.RLock()  # _give_back may run from a collection inside either method
        self.allocated = 0       # blocks made (for tests and benchmarks)
        self.reused = 0

    def take(self, nbytes):
        """A writable uint8 array of exactly ``nbytes`` whose block returns to the pool when the array
        object is freed. Give it to exactly one owner (e.g. ``torch.from_numpy``) and keep no other
        reference or numpy view of it: numpy views point at the block, not at this array."""
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= size
                self.reused += 1
        if block is None:
            block = fresh_block(size)
            self.allocated += 1
        lease = block[:nbytes]
        weakref.finalize(lease, self._give_back, block).atexit = False
        return lease

    def _give_back(self, block):
        size = block.size
        with self._lock:
            if self._free_bytes + size > self.max_free_bytes:
                return  # dropped: the mapping is unmapped when the last reference goes
            self._free.setdefault(size, []).append(block)
            self._free_bytes += size

    def free_bytes(self):
        return self._free_bytes


#: the process's pool for out-of-place results
pool = HostPool()
