"""The UCX transport's Python side: which libucp the native cores call, and whether to use it.

The native threads call UCP themselves (core/transport/bps_ucx.h); this module only finds the library
(the ``libucx`` wheel through its own loader, which honours RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY, else
a system ``libucp.so.0``) and hands its path to each native module (``ucx_load``). :func:`choose`
turns ``BYTEPS_TRANSPORT`` (auto|tcp|ucx) into the transport of this process's links and logs the
choice once per process (docs/ucx.md).
"""
import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger("byteps.ucx")

_lock = threading.Lock()
_loaded = {}    # native module name -> (ok, version or why)
_library = None  # (path, origin) of the libucp chosen, once found
_logged = set()


def library():
    """(path, origin) of the libucp to call, origin "wheel" or "system"; (None, why) if none is found."""
    global _library
    if _library is not None:
        return _library
    prefer_system = os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "false").lower() != "false"
    try:
        import libucx
    except ImportError:
        libucx = None
    if libucx is not None:
        libs = libucx.load_library()  # libucs, libucs_signal, libuct, libucp (None where absent)
        ucp = libs[-1] if libs else None
        if ucp is not None:
            wheel_dir = os.path.dirname(libucx.__file__)
            path = ucp._name
            origin = "wheel" if os.path.isabs(path) and path.startswith(wheel_dir) else "system"
            _library = (path, origin)
            return _library
    # no wheel (or it lacks libucp): a system UCX
    for name in ("libucp.so.0", ctypes.util.find_library("ucp")):
        if not name:
            continue
        try:
            ctypes.CDLL(name, ctypes.RTLD_LOCAL)
        except OSError:
            continue
        _library = (name, "system")
        return _library
    why = ("no libucp: pip install libucx-cu12, or install a system UCX (Debian: libucx0)"
           + (" (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY is set)" if prefer_system else ""))
    return None, why


def load(module):
    """Resolve libucp's calls in native ``module`` (byteps.core._worker_core or byteps.server._server_core):
    (True, "UCX <version> (<origin>: <path>)") or (False, why). Cached per module."""
    with _lock:
        name = module.__name__
        if name in _loaded:
            return _loaded[name]
        if not getattr(module, "ucx_built", False):
            result = (False, "byteps was built without UCX headers (pip install libucx-cu12, then rebuild byteps)")
        else:
            path, origin = library()
            if path is None:
                result = (False, origin)
            else:
                ok, info = module.ucx_load(path)
                result = (True, f"UCX {info} ({origin}: {path})") if ok else (False, info)
        _loaded[name] = result
        return result


def choose(setting, module):
    """The transport of this process's direct links for ``BYTEPS_TRANSPORT=setting``: "ucx" or "tcp".

    ``ucx`` insists (RuntimeError naming why UCX cannot be used); ``auto`` takes UCX only where it
    pays: an RDMA device on this machine (topology/rdma.py) and UCX loads; else TCP. The choice is
    logged once per process, with UCX_TLS and the library."""
    if setting == "tcp":
        return _log("tcp", "BYTEPS_TRANSPORT=tcp")
    if setting == "ucx":
        ok, info = load(module)
        if not ok:
            raise RuntimeError(f"BYTEPS_TRANSPORT=ucx, but UCX cannot be used: {info}")
        return _use_ucx(f"BYTEPS_TRANSPORT=ucx; {info}", rdma_present=bool(_rdma_devices()))
    devices = _rdma_devices()
    if not devices:
        return _log("tcp", "BYTEPS_TRANSPORT=auto: no RDMA device")
    ok, info = load(module)
    names = ", ".join(d.name for d in devices)
    if not ok:
        return _log("tcp", f"BYTEPS_TRANSPORT=auto: RDMA device(s) {names}, but UCX cannot be used ({info})")
    return _use_ucx(f"BYTEPS_TRANSPORT=auto: RDMA device(s) {names}; {info}", rdma_present=True)


def _rdma_devices():
    from byteps.topology import rdma

    return rdma.discover().devices


#: byteps' UCX defaults, set only where the user has not set them (UCX reads them when byteps creates
#: its context, after choose()); docs/ucx.md, "Measured here", says why. Larger tcp segments:
TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
#: without an RDMA device, eager messages up to 1 MB (a rendezvous over tcp costs a round trip)
TCP_ONLY = {"UCX_RNDV_THRESH": "1m"}


def _use_ucx(why, rdma_present):
    defaults = dict(TCP_SEGMENTS, **({} if rdma_present else TCP_ONLY))
    ours = [f"{name}={value}" for name, value in defaults.items() if name not in os.environ]
    os.environ.update(dict(item.split("=", 1) for item in ours))
    return _log("ucx", why + (f"; byteps' defaults: {' '.join(ours)}" if ours else ""))


def _log(transport, why):
    with _lock:
        if transport + why not in _logged:
            _logged.add(transport + why)
            tls = os.environ.get("UCX_TLS", "") or "unset: UCX picks"
            logger.info("direct links: %s (%s)%s", transport, why, f"; UCX_TLS={tls}" if transport == "ucx" else "")
    return transport
