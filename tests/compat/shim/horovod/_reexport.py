"""Make a shim module a view of a byteps module: every name, public or not, comes from byteps."""
import importlib
import os


def reexport(namespace, target, pinned_subdir=None):
    """Copy ``target``'s names into ``namespace`` (a shim module's globals) and forward later lookups.

    ``pinned_subdir``: a folder of the pinned Horovod tree whose modules (e.g. ``util.py``) become
    submodules of the shim, as in Horovod's own package.
    """
    module = importlib.import_module(target)
    namespace.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    namespace["__all__"] = list(getattr(module, "__all__", [k for k in vars(module) if not k.startswith("_")]))
    namespace["__getattr__"] = lambda name: getattr(module, name)
    pinned = os.environ.get("BYTEPS_COMPAT_DIR")
    if pinned_subdir and pinned:
        namespace["__path__"].append(os.path.join(pinned, "horovod", "horovod", pinned_subdir))
