"""Server engine threads (BYTEPS_SERVER_ENGINE_THREAD): summation off the server's network thread.

The network thread receives every push; the sums run on N threads (BytePS's server engine
threads), so one server uses several cores when many keys are busy and keeps receiving while it
sums. A key is always summed by the same thread (``key % N``), and each thread runs its queue in
arrival order, so the sums of one key never race and are applied in the order they arrived. The
kernels release the GIL (core/_reduce.pyx), so the threads really run in parallel.

Each task is a closure that holds what it reads (the zmq frame or shared-memory view) until it has
run. When it is done the thread appends ``(key, error)`` to :attr:`done` and writes a byte to a
pipe the network thread polls; that thread then finishes the round (core of summation/server.py).
With N = 0 the pool runs every task inline, on the network thread (the single-threaded server).
"""
import collections
import fcntl
import os
import threading

from byteps.core._pipeline import PriorityQueue
from byteps.core.threads import name_native
from byteps.log import logger


class SumPool:
    def __init__(self, threads):
        self.threads = threads
        self.done = collections.deque()
        self._wake_r = self._wake_w = None
        self._queues, self._workers, self._tasks = [], [], {}
        self._ids = iter(range(1 << 62))
        if threads <= 0:
            return
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
        for i in range(threads):
            q = PriorityQueue()
            t = threading.Thread(target=self._run, args=(q,), name=f"byteps-server-sum-{i}", daemon=True)
            self._queues.append(q)
            self._workers.append(t)
            t.start()

    @property
    def fd(self):
        """A file descriptor that becomes readable when tasks have finished (None: inline pool)."""
        return self._wake_r

    def submit(self, key, fn):
        """Run ``fn()`` for ``key``; returns True if it ran already (inline), False if queued."""
        if self.threads <= 0:
            fn()
            return True
        task = next(self._ids)
        self._tasks[task] = (key, fn)
        self._queues[key % self.threads].push(0, task, 0)
        return False

    def _run(self, queue):
        name_native()
        while (task := queue.pop(timeout=-1)) is not None:
            key, fn = self._tasks.pop(task)
            try:
                fn()
                self.done.append((key, None))
            except Exception as e:  # reported on the round, never lost
                logger.exception("server summation failed")
                self.done.append((key, e))
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full: the network thread is being woken anyway
                pass

    def drain_wakeups(self):
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def close(self):
        for q in self._queues:
            q.close()
        for t in self._workers:
            t.join(5)
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
