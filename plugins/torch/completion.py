"""Completion plumbing for operations made of several byteps operations (Horovod's allgather, grouped and
Min/Max/Product allreduces, DDP hook futures, the ``torch.distributed`` backend).

:func:`when_done` runs a function on one helper thread once every given handle has finished (from the
engine's completion callbacks: nothing polls); :class:`Pending` is the user's handle of a multi-stage
operation. Functions on the helper thread never block on other ranks (they only submit operations and
register callbacks), so two ranks cannot deadlock on the helper threads' order."""
import queue
import threading

from byteps import common
from byteps.log import logger

_tasks = queue.SimpleQueue()
_thread = None
_thread_lock = threading.Lock()

#: handle -> Pending, for the multi-stage operations of this job
_pending = {}


def _run():
    while True:
        fn = _tasks.get()
        try:
            fn()
        except Exception:  # a task must not kill the helper thread
            logger.exception("byteps.torch completion task failed")


def _post(fn):
    global _thread
    if _thread is None:
        with _thread_lock:
            if _thread is None:
                _thread = threading.Thread(target=_run, name="byteps-torch-completion", daemon=True)
                _thread.start()
    _tasks.put(fn)


def _outcome(handle):
    try:
        return synchronize(handle), None
    except Exception as e:
        return None, e


def when_done(handles, fn):
    """Call ``fn(outcomes)`` on the helper thread once every handle in ``handles`` has finished.

    ``handles`` may mix byteps handles and :class:`Pending` handles. ``outcomes[i]`` is
    ``(result, None)`` or ``(None, error)`` for ``handles[i]``; each handle is synchronized (and
    so released) before ``fn`` runs.
    """
    handles = list(handles)
    job = common._require()
    sources = [_pending[h] if h in _pending else job.handles[h][0] for h in handles]
    if not sources:
        _post(lambda: fn([]))
        return
    lock = threading.Lock()
    seen = set()

    def finished(src):
        with lock:
            if id(src) in seen:
                return
            seen.add(id(src))
            last = len(seen) == len(sources)
        if last:
            _post(lambda: fn([_outcome(h) for h in handles]))

    for src in sources:
        src.callbacks.append(finished)
        if job.engine is not None and not isinstance(src, Pending):
            job.engine.prompt(src)  # the completion thread delivers it now, not its caller (Engine.prompt)
        if src.done.is_set():  # finished before the callback was in place (or it ran alone)
            finished(src)


class Pending:
    """A multi-stage operation behind one integer handle."""

    __slots__ = ("name", "done", "result", "error", "handle", "callbacks", "extra")

    def __init__(self, name):
        self.name = name
        self.done = threading.Event()
        self.result = None
        self.error = None
        self.callbacks = []
        self.extra = None
        self.handle = next(common._require().next_handle)
        _pending[self.handle] = self

    def finish(self, result=None, error=None):
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()
        for cb in self.callbacks:
            try:
                cb(self)
            except Exception:
                logger.exception("completion callback of %r failed", self.name)

    def discard(self):
        """Forget this operation (its submission failed before anything was started)."""
        _pending.pop(self.handle, None)

    def guard(self, fn):
        """``fn`` wrapped so that an exception it raises fails this operation instead of vanishing."""
        def run(*args):
            try:
                fn(*args)
            except Exception as e:
                self.finish(error=e)
        return run

    def wait(self):
        common.wait_bounded(self.done.wait, repr(self.name))  # every stage is itself bounded by BYTEPS_TIMEOUT
        if self.error is not None:
            raise self.error
        return self.result


def first_error(outcomes):
    return next((err for _, err in outcomes if err is not None), None)


def poll(handle):
    """True when the operation behind ``handle`` has finished."""
    p = _pending.get(handle)
    if p is not None:
        return p.done.is_set()
    return common.poll(handle)


def synchronize(handle):
    """Wait for ``handle`` and return the output tensor (raises the operation's error, if any).

    Handles of multi-stage operations (Horovod-style allgather, grouped or Min/Max/Product
    allreduces) return what the operation produces: a tensor, or a tuple for grouped operations.
    """
    p = _pending.get(handle)
    if p is not None:
        try:
            return p.wait()
        finally:
            _pending.pop(handle, None)
    return common.synchronize(handle)


def reset():
    """Forget every pending operation (at shutdown, like Horovod's handle map)."""
    _pending.clear()
