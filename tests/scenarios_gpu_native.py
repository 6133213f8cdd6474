"""Scenarios for tests/test_gpu_native.py: "CUDA tensors" of the fake CUDA runtime (tests/fake_cudart)
through the native copy stages, submitted as the torch plugin submits a CUDA tensor (a DeviceBuffer with
the producer's ready event and a done event), and checked exactly against a locally computed sum.

The fake runtime is the library BYTEPS_CUDART names: the native core dlopens it, and this process opens
the same library through ctypes, so both share its devices, streams, events and log.
"""
import ctypes
import os

import numpy as np

import byteps.common as common
import byteps.torch as bps
from byteps.core import dtypes
from byteps.core.device_buffer import DeviceBuffer
from scenarios import scenario

D2H, H2D = 2, 1


class FakeCuda:
    """The fake runtime's calls this process makes: device memory, a producer's stream and late kernel,
    events, and reading a result back the way a consumer would (after the done event)."""

    def __init__(self, device=0):
        self.lib = lib = ctypes.CDLL(os.environ["BYTEPS_CUDART"])
        self.device = device
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in {"cudaMalloc": [ctypes.POINTER(vp), sz], "cudaHostAlloc": [ctypes.POINTER(vp), sz, ctypes.c_uint],
                           "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
                           "cudaEventCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
                           "cudaEventRecord": [vp, vp], "cudaStreamWaitEvent": [vp, vp, ctypes.c_uint],
                           "cudaStreamSynchronize": [vp], "cudaMemcpyAsync": [vp, vp, sz, ctypes.c_int, vp],
                           "fake_kernel_write": [vp, vp, vp, sz, ctypes.c_int], "fake_log": [ctypes.c_char_p, sz],
                           "fake_set_copy_delay_us": [ctypes.c_int], "fake_fail_memcpy": [ctypes.c_longlong, ctypes.c_int],
                           "fake_stats": [ctypes.POINTER(ctypes.c_longlong)], "cudaSetDevice": [ctypes.c_int]}.items():
            getattr(lib, name).argtypes = args
        lib.fake_log.restype = sz
        assert lib.cudaSetDevice(device) == 0  # this thread's: memory, streams and events are made on it
        self.producer = self._handle(lib.cudaStreamCreateWithFlags, 1)

    def _handle(self, fn, *args):
        h = ctypes.c_void_p()
        rc = fn(ctypes.byref(h), *args)
        assert rc == 0, (fn.__name__, rc)
        return h.value

    def device_array(self, values, delay_us):
        """Device memory that the producer's kernel fills with ``values`` after ``delay_us``; (pointer,
        the producer's ready event recorded after that kernel)."""
        raw = np.ascontiguousarray(values).view(np.uint8)
        ptr = self._handle(self.lib.cudaMalloc, raw.nbytes)
        assert self.lib.fake_kernel_write(self.producer, ptr, raw.ctypes.data, raw.nbytes, delay_us) == 0
        ready = self.event()
        assert self.lib.cudaEventRecord(ready, self.producer) == 0
        return ptr, ready

    def event(self):
        return self._handle(self.lib.cudaEventCreateWithFlags, 2)  # cudaEventDisableTiming, as torch's

    def read(self, ptr, like, done_event):
        """The tensor as a consumer on the producer's stream sees it: after waiting for the done event."""
        host = self._handle(self.lib.cudaHostAlloc, like.nbytes, 0)
        assert self.lib.cudaStreamWaitEvent(self.producer, done_event, 0) == 0
        assert self.lib.cudaMemcpyAsync(host, ptr, like.nbytes, D2H, self.producer) == 0
        assert self.lib.cudaStreamSynchronize(self.producer) == 0
        return np.frombuffer(ctypes.string_at(host, like.nbytes), dtype=like.dtype).copy()

    def log(self):
        n = self.lib.fake_log(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.fake_log(buf, n)
        return buf.raw[:n].decode()

    def stats(self):
        out = (ctypes.c_longlong * 6)()
        self.lib.fake_stats(out)
        return dict(zip(("pinned_now", "pinned_peak", "pinned_allocs", "pageable_copies", "spinning_syncs",
                         "wrong_device"), list(out)))


def contribution(rank, numel, dtype, salt):
    """Rank ``rank``'s integer-valued data (exact sums in float32 too): the test recomputes the sum."""
    g = np.random.default_rng(1000 * rank + salt)
    return g.integers(-1000, 1000, numel).astype(dtype)


def _submit(cuda, name, values, delay_us, broadcast_root=None, priority=0, ready=True):
    ptr, ready_event = cuda.device_array(values, delay_us)
    done = cuda.event()
    buf = DeviceBuffer(ptr, values.nbytes, cuda.device, ready_event if ready else 0, done)
    handle = common.submit(name, buf, dtypes.from_name(values.dtype.name), values.shape, broadcast_root=broadcast_root,
                           priority=priority)
    return handle, ptr, done


def _result(cuda):
    """What every scenario reports once its ops are synchronized, before it reads results back (which
    copies too): the fake's log, its counters, the native core's."""
    return {"log": cuda.log(), "fake": cuda.stats(), "gpu": bps.metrics()["native"]["gpu"]}


@scenario
def gpu_sums(out, args):
    """Tensors of several partitions through COPYD2H -> host stages -> COPYH2D, the producer's kernel late
    (``kernel_delay_us``): every result exact; one push_pull submitted without its ready event (its
    copies do not wait for the kernel) and a broadcast from rank 0. A machine's processes use devices 0
    and 1 (the core's copies must run on the tensor's device)."""
    cuda = FakeCuda(device=bps.local_rank() % 2)
    cuda.lib.fake_set_copy_delay_us(args.get("copy_delay_us", 0))
    if "slot_bytes" in args:  # a ring of slots smaller than the partitions, as after a membership that cuts larger ones
        common._job.engine._native.enable_gpu(os.environ["BYTEPS_CUDART"], args["slot_bytes"], 2)
    r, n = bps.rank(), bps.size()
    res = {"ok": {}, "ptrs": {}}
    for rnd in range(args.get("rounds", 1)):
        running = []
        for spec in args["tensors"]:
            dtype = np.dtype(spec["dtype"])
            values = contribution(r, spec["numel"], dtype, rnd)
            root = spec.get("root")
            h, ptr, done = _submit(cuda, spec["name"], values, args.get("kernel_delay_us", 0), broadcast_root=root,
                                   ready=spec.get("ready", True))
            want = contribution(root, spec["numel"], dtype, rnd) if root is not None else \
                sum(contribution(q, spec["numel"], dtype, rnd) for q in range(n)).astype(dtype)
            running.append((spec["name"], h, ptr, done, want))
            res["ptrs"][f"{spec['name']}@{rnd}"] = ptr
        for name, h, ptr, done, want in running:
            common.synchronize(h)
        if rnd == 0:
            res.update(_result(cuda))
        for name, h, ptr, done, want in running:
            res["ok"][f"{name}@{rnd}"] = bool(np.array_equal(cuda.read(ptr, want, done), want))
    return res


@scenario
def gpu_order(out, args):
    """Two push_pulls submitted back to back, the second more urgent: where staging slots are scarce the
    urgent one's partitions are copied off the GPU first; both exact."""
    cuda = FakeCuda()
    cuda.lib.fake_set_copy_delay_us(args.get("copy_delay_us", 0))
    r, n = bps.rank(), bps.size()
    res = {"ok": {}, "ptrs": {}}
    running = []
    for name, numel, priority in args["tensors"]:
        values = contribution(r, numel, np.float32, 7)
        h, ptr, done = _submit(cuda, name, values, 0, priority=priority)
        running.append((name, h, ptr, done, sum(contribution(q, numel, np.float32, 7) for q in range(n))))
        res["ptrs"][name] = ptr
    for name, h, ptr, done, want in running:
        common.synchronize(h)
    res.update(_result(cuda))
    for name, h, ptr, done, want in running:
        res["ok"][name] = bool(np.array_equal(cuda.read(ptr, want.astype(np.float32), done), want))
    return res


@scenario
def gpu_crossed(out, args):
    """Two push_pulls of 2 partitions each, of equal priority, once in the same order on every rank (which
    declares them), then in opposite orders on odd and even ranks: with 2 staging slots each rank holds
    both for the tensor the other has not started, until the ring grows by a slot (no deadlock); exact."""
    cuda = FakeCuda()
    cuda.lib.fake_set_copy_delay_us(args.get("copy_delay_us", 0))
    r, n = bps.rank(), bps.size()
    ok = []
    for rnd, names in enumerate((["x", "y"], ["x", "y"] if r % 2 == 0 else ["y", "x"])):
        running = []
        for name in names:
            values = contribution(r, 2 * 1024, np.float32, rnd)
            h, ptr, done = _submit(cuda, name, values, 0)
            running.append((h, ptr, done, sum(contribution(q, 2 * 1024, np.float32, rnd) for q in range(n))))
        for h, ptr, done, want in running:
            common.synchronize(h)
        ok += [bool(np.array_equal(cuda.read(ptr, want, done), want)) for h, ptr, done, want in running]
    return {"ok": ok, "gpu": bps.metrics()["native"]["gpu"]}


@scenario
def gpu_torch(out, args):
    """Real torch CUDA tensors (a GPU machine): each written by a copy queued behind a sleeping kernel on
    torch's current stream just before its push_pull, which must wait for both on the GPU; exact sums."""
    import torch

    dev = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    r, n = bps.rank(), bps.size()
    ok = {}
    for rnd in range(2):
        running = []
        for name, numel in args["tensors"]:
            src = torch.from_numpy(contribution(r, numel, np.float32, rnd)).pin_memory()
            want = torch.from_numpy(sum(contribution(q, numel, np.float32, rnd) for q in range(n)))
            t = torch.zeros(numel, device=dev)
            torch.cuda._sleep(20_000_000)  # a late producer: some ms of GPU time before the copy that writes t
            t.copy_(src, non_blocking=True)
            running.append((f"{name}@{rnd}", bps.push_pull_async_inplace(t, average=False, name=name), want))
        for key, h, want in running:
            ok[key] = bool(torch.equal(bps.synchronize(h).cpu(), want))
    return {"ok": ok, "gpu": bps.metrics()["native"]["gpu"]}


@scenario
def gpu_stuck(out, args):
    """The producer's kernel never ends (in the job's time): the op times out (BYTEPS_TIMEOUT) naming its
    copies, and the process still shuts down."""
    cuda = FakeCuda()
    values = contribution(bps.rank(), 3000, np.float32, 0)
    h, _, _ = _submit(cuda, "stuck", values, 600 * 10 ** 6)
    try:
        common.synchronize(h)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@scenario
def gpu_no_runtime(out, args):
    """BYTEPS_CUDART names no library: a CUDA tensor's push_pull fails naming the tensor and the library
    (its device memory is never touched); host tensors still work."""
    buf = DeviceBuffer(0x1000, 4000, 0)
    try:
        common.synchronize(common.submit("dev", buf, dtypes.FLOAT32, (1000,)))
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    import torch

    t = torch.ones(1000)
    bps.push_pull_inplace(t, average=False, name="host")
    return {"error": error, "host_ok": bool(torch.equal(t, torch.full((1000,), float(bps.size()))))}


@scenario
def gpu_copy_fails(out, args):
    """The first copy off the GPU fails (the fake's cudaMemcpyAsync returns an illegal-address error): the
    op fails at once naming the tensor and CUDA's error; the next push_pull still works (its slots came
    back)."""
    cuda = FakeCuda()
    r, n = bps.rank(), bps.size()
    cuda.lib.fake_fail_memcpy(0, 700)
    values = contribution(r, args["numel"], np.float32, 1)
    h, _, _ = _submit(cuda, "broken", values, 0)
    try:
        common.synchronize(h)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    values = contribution(r, args["numel"], np.float32, 2)
    h, ptr, done = _submit(cuda, "after", values, 0)
    common.synchronize(h)
    want = sum(contribution(q, args["numel"], np.float32, 2) for q in range(n))
    return dict(_result(cuda), error=error, after_ok=bool(np.array_equal(cuda.read(ptr, want, done), want)))


@scenario
def nccl_sums(out, args):
    """CUDA push_pulls on the NCCL stages (BYTEPS_LOCAL_STRATEGY=topology, several processes of a machine,
    each its own fake GPU): tensors of several partitions in flight at once, for several rounds, the
    producer's kernel late; local rank 1 submits them in the reverse order and with priorities reversed
    (the machine's order of collectives is the coordinator's, not anyone's program order). A tensor's
    ``skip`` local ranks leave it out from round ``skip_from`` on (a time-out test). Reports
    whether each result is exact (``average``: divided by the job's size) or the error it raised."""
    from byteps.errors import BytePSError

    def data(rank, spec, rnd):  # float16 within +-250: every sum of up to 8 ranks exact, in any order
        dtype = np.dtype(spec["dtype"])
        got = contribution(rank, spec["numel"], np.int64, rnd)
        return (got // 4 if dtype == np.float16 else got).astype(dtype)

    cuda = FakeCuda(device=0)
    cuda.lib.fake_set_copy_delay_us(args.get("copy_delay_us", 0))
    r, n, lr = bps.rank(), bps.size(), bps.local_rank()
    res = {"ok": {}, "ptrs": {}, "errors": {}}
    for rnd in range(args.get("rounds", 1)):
        running = []
        specs = [s for s in args["tensors"] if lr not in s.get("skip", ()) or rnd < s.get("skip_from", 0)]
        order = list(enumerate(specs))
        for index, spec in reversed(order) if lr == 1 else order:
            dtype = np.dtype(spec["dtype"])
            values = data(r, spec, rnd)
            ptr, ready = cuda.device_array(values, args.get("kernel_delay_us", 0))
            done = cuda.event()
            buf = DeviceBuffer(ptr, values.nbytes, cuda.device, ready, done)
            average = spec.get("average", False)
            h = common.submit(spec["name"], buf, dtypes.from_name(dtype.name), values.shape,
                              priority=-index if lr == 1 else index, average_by=n if average else 1)
            want = sum(data(q, spec, rnd).astype(np.float64) for q in range(n)).astype(dtype)
            if average:
                want = (want / n).astype(dtype)
            running.append((f"{spec['name']}@{rnd}", h, ptr, done, want))
            res["ptrs"][f"{spec['name']}@{rnd}"] = ptr
        for key, h, ptr, done, want in running:
            try:
                common.synchronize(h)
            except BytePSError as e:
                res["errors"][key] = f"{type(e).__name__}: {e}"
                continue
            res["ok"][key] = bool(np.array_equal(cuda.read(ptr, want, done), want))
    res.update(_result(cuda))
    res["local"] = bps.metrics()["local_strategy"]
    return res
