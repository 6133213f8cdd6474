"""BytePS's ``byteps.torch.cross_barrier``: ``CrossBarrier`` lets the next iteration start before the
parameter update of this one has finished (ByteScheduler's "crossing the barrier").

``import byteps.torch.cross_barrier as bps`` gives the whole ``byteps.torch`` API plus
:func:`CrossBarrier`. ``optimizer.step()`` returns at once: a background thread waits for the
gradients and runs the wrapped optimizer's step, while the model's next ``forward`` (and
``zero_grad``, ``state_dict``, ``synchronize``) waits for that update. How this differs from
BytePS: docs/compat.md. ``num_steps`` is accepted and unused."""
import threading

from byteps import common

from . import *  # noqa: F401,F403  (BytePS: the module is used as ``bps``)
from . import __all__ as _torch_all
from .compression import Compression
from .optimizer import _DistributedOptimizer


class _CrossBarrier(_DistributedOptimizer):
    """Methods added to the dynamic optimizer class; see the module docstring."""

    def _cb_setup(self, model):
        self._cb_error = None
        self._cb_thread = None  # the update in progress, if any
        self._cb_hook = model.register_forward_pre_hook(lambda module, inputs: self._cb_wait())

    def _cb_wait(self):
        if self._cb_thread is not None:
            self._cb_thread.join()
            self._cb_thread = None
        if self._cb_error is not None:
            err, self._cb_error = self._cb_error, None
            raise err

    def _cb_update(self, closure):
        try:
            if self._should_synchronize:
                _DistributedOptimizer.synchronize(self)
            self._synchronized = False
            super(self.__class__, self).step(closure)
        except BaseException as e:  # raised on the training thread at the next wait
            self._cb_error = e

    def step(self, closure=None):
        self._cb_wait()
        if closure is not None or common.size() == 1:  # a closure re-runs forward: no overlap possible
            return _DistributedOptimizer.step(self, closure)
        # not a daemon: the interpreter waits for the last update before shutting byteps down
        self._cb_thread = threading.Thread(target=self._cb_update, args=(None,), name="byteps-cross-barrier")
        self._cb_thread.start()
        return None

    def synchronize(self):
        self._cb_wait()
        return _DistributedOptimizer.synchronize(self)

    def zero_grad(self, set_to_none=True):
        self._cb_wait()
        return _DistributedOptimizer.zero_grad(self, set_to_none=set_to_none)

    def state_dict(self, *args, **kwargs):
        self._cb_wait()
        return super(self.__class__, self).state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._cb_wait()
        return _DistributedOptimizer.load_state_dict(self, *args, **kwargs)


def CrossBarrier(model, optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 num_steps=10 ** 6):
    """Wrap ``optimizer`` like :func:`DistributedOptimizer`, with the update overlapping the next
    iteration (see the module docstring). ``model`` gets a forward pre-hook that waits for it."""
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update({k: v for k, v in _CrossBarrier.__dict__.items() if not k.startswith("__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
    opt._cb_setup(model)
    return opt


__all__ = list(_torch_all) + ["CrossBarrier"]
