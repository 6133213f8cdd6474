"""CUDA gradients copied to host memory off the thread that runs back-propagation.

A push_pull of a CUDA tensor on the default path works on a page-locked host copy (ops._host_buffer).
Made in a gradient hook, that copy would block autograd's thread: the host waits for every kernel
queued so far, and the GPU sits idle until the thread queues the rest of the backward pass. So
``DistributedOptimizer`` stages its CUDA gradients here instead:

1. on autograd's thread, :meth:`CudaStager.stage` queues the copy to page-locked memory on a side
   stream that first waits for the caller's current stream (where the gradient's kernel runs), records
   an event after it, and returns at once;
2. the ``byteps-d2h`` thread waits for each event in turn (without the GIL) and submits the host copy's
   push_pull, in the order the gradients came;
3. ``optimizer.synchronize()`` waits for the push_pull (:meth:`Staged.wait_into`) and queues the copy of
   the sum back into the gradient on the caller's current stream, which the optimizer's update then
   follows.

Not used for CUDA tensors that the GPU stages take (``BYTEPS_LOCAL_STRATEGY=topology``, ops._cuda_path).
"""
import concurrent.futures
import queue
import threading

import torch

from byteps import common
from byteps.errors import BytePSTimeoutError

#: what this process staged (tests check that the path ran)
stats = {"staged": 0}

_lock = threading.Lock()
_stager = None


class Staged:
    """One gradient on its way: the host copy's push_pull handle, once the ``byteps-d2h`` thread has
    submitted it."""

    def __init__(self, name, future):
        self.name, self._future = name, future

    def wait_into(self, target):
        """Wait for the sum and copy it into CUDA tensor ``target`` (queued on its current stream)."""
        from .ops import synchronize

        limit = common.config().timeout
        try:
            handle = self._future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            raise BytePSTimeoutError(
                f"byteps: gradient {self.name!r} was not copied to host memory within {limit:g} s (BYTEPS_TIMEOUT): "
                "the CUDA work that produces it did not finish") from None
        out = synchronize(handle)
        target.copy_(out, non_blocking=True)  # torch keeps the page-locked block until the copy is done
        return target


class CudaStager:
    """The ``byteps-d2h`` thread and a side stream per device."""

    def __init__(self):
        self._queue = queue.Queue()
        self._streams = {}
        self._thread = threading.Thread(target=self._run, name="byteps-d2h", daemon=True)
        self._thread.start()

    def stage(self, tensor, name, submit):
        """Queue ``tensor``'s copy to page-locked memory; ``submit(host_copy)`` then returns its handle.
        Returns a :class:`Staged`."""
        device = tensor.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(device))  # the kernel that writes the gradient
        with torch.cuda.stream(stream):
            host.copy_(tensor.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        tensor.record_stream(stream)  # its memory is not reused before the side stream has read it
        future = concurrent.futures.Future()
        self._queue.put((copied, host, submit, future))
        stats["staged"] += 1
        return Staged(name, future)

    def _run(self):
        while True:
            copied, host, submit, future = self._queue.get()
            try:
                copied.synchronize()  # without the GIL
                future.set_result(submit(host))
            except BaseException as e:  # the caller's synchronize() raises it
                future.set_exception(e)


def applies(tensor):
    """True when ``tensor``'s push_pull goes through a host copy that this module should make."""
    if not tensor.is_cuda:
        return False
    from .ops import _cuda_path

    return not _cuda_path()


def stager():
    global _stager
    with _lock:
        if _stager is None:
            _stager = CudaStager()
        return _stager
