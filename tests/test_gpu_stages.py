"""GPU stages (core/gpu.py, core/gpu_stages.py, the torch plugin's CUDA hand-over).

Without a GPU the module must still import, and everything that is plain logic runs here: tensor
intake (DLPack on CPU tensors, the __cuda_array_interface__ that torch really produces, bfloat16),
the NCCL dtype map, staging-buffer bookkeeping, communicator layout, and the NCCL unique-id
exchange through shared memory between real processes.

The GPU stages themselves also run here, on tests/fake_cuda.py: a CUDA runtime and NCCL on the CPU
behind core/gpu.py's ctypes seam, which keeps the current device per thread, binds streams, events
and communicators to devices, and runs stream work asynchronously. With it these tests check, on
several "GPUs", that every thread that issues CUDA or NCCL calls set its own device (NCCL
communicators were created in a fresh thread on GPU 0), that the stages wait for the producer's
stream (a gradient read while its backward kernel still writes it), and that torch's bfloat16 goes
through.

The end-to-end tests on a real GPU need CUDA, NCCL, torch with CUDA and enough GPUs; they skip
with the reason otherwise.
"""
import os
import sys
import threading
import time
import types
import uuid

import numpy as np
import pytest

import byteps.topology as topology
from byteps.core import dtypes, gpu, gpu_stages

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_cuda  # noqa: E402
from test_localsync import check_sums, run_local  # noqa: E402


def test_imports_without_a_gpu_and_says_why():
    reason = gpu.unavailable_reason()
    if reason is not None:
        assert reason.startswith(("no CUDA device: ", "no NCCL: ", "needs ")), reason


# ---------------------------------------------------------------------------------------
# tensor intake


def test_dlpack_numpy_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = gpu.as_device_array(a)
    assert (d.ptr, d.nbytes, d.count, d.dtype, d.device_type) == (a.ctypes.data, 48, 12, dtypes.FLOAT32, "cpu")
    s = a[1:]  # byte offset into the same buffer
    assert gpu.as_device_array(s).ptr == a.ctypes.data + 16
    for dt, code in [(np.float64, dtypes.FLOAT64), (np.float16, dtypes.FLOAT16), (np.int32, dtypes.INT32),
                     (np.int64, dtypes.INT64), (np.uint8, dtypes.UINT8), (np.int8, dtypes.INT8)]:
        assert gpu.as_device_array(np.zeros(3, dt)).dtype == code
    with pytest.raises(ValueError, match="not C-contiguous"):
        gpu.as_device_array(a.T)
    with pytest.raises(TypeError, match="is not supported"):
        gpu.as_device_array(np.zeros(3, np.complex64))
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __dlpack__"):
        gpu.as_device_array([1, 2, 3])


def test_dlpack_torch_bfloat16():
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.bfloat16)[2:]
    d = gpu.as_device_array(t)
    assert (d.dtype, d.count, d.nbytes, d.ptr) == (dtypes.BFLOAT16, 8, 16, t.data_ptr())


class FakeCudaTensor:
    """A torch CUDA tensor as far as the hand-over looks at one. Its ``__cuda_array_interface__`` is
    produced by torch's own code (``torch.Tensor.__cuda_array_interface__``), so the tests see what
    the installed torch really exports; its memory is the fake GPU's (or any address)."""

    is_cuda, is_sparse, requires_grad = True, False, False

    def __init__(self, ptr, shape, dtype, device, strides=None):
        import torch

        self.ptr, self.shape, self.dtype = ptr, torch.Size(shape), dtype
        self.device = torch.device("cuda", device)
        self._strides = strides

    def element_size(self):
        import torch

        return torch.empty(0, dtype=self.dtype).element_size()

    def stride(self):
        if self._strides is not None:
            return self._strides
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    def is_contiguous(self):
        return self._strides is None

    def numel(self):
        return int(np.prod(self.shape))

    def data_ptr(self):
        return self.ptr

    def detach(self):
        return self

    @property
    def __cuda_array_interface__(self):
        import torch

        return torch.Tensor.__cuda_array_interface__.fget(self)


def test_torch_cuda_array_interface_names_no_stream():
    """What torch exports: version 2 and no ``stream`` entry (CAI v3 says "no synchronization
    needed"), although the tensor's producer kernels may still be queued. The stages must not rely
    on the interface to order after the producer (see test_handover_waits_for_the_producer_stream)."""
    torch = pytest.importorskip("torch")
    cai = FakeCudaTensor(0x7F0000001000, (2, 3), torch.float32, 1).__cuda_array_interface__
    assert cai.get("stream") is None, f"torch {torch.__version__} now exports a stream: {cai}"
    d = gpu.as_device_array(FakeCudaTensor(0x7F0000001000, (2, 3), torch.float32, 1))
    assert (d.ptr, d.nbytes, d.count, d.dtype, d.device_type, d.stream, d.ready_event) == (
        0x7F0000001000, 24, 6, dtypes.FLOAT32, "cuda", None, None)
    assert gpu.as_device_array(FakeCudaTensor(0x1000, (5,), torch.int64, 0)).nbytes == 40
    assert gpu.as_device_array(FakeCudaTensor(0x1000, (1, 3), torch.float32, 0, strides=(999, 1))).count == 3
    with pytest.raises(ValueError, match=r"strides \(4, 16\) is not C-contiguous"):
        gpu.as_device_array(FakeCudaTensor(0x1000, (2, 3), torch.float32, 0, strides=(1, 4)))
    with pytest.raises(TypeError, match="typestr '<c8' is not supported"):
        gpu.as_device_array(FakeCudaTensor(0x1000, (2,), torch.complex64, 0))


def test_torch_bfloat16_cuda_tensors_are_taken():
    """torch exports bfloat16 as the raw typestr "<V2": with the dtype known (the plugin passes it) it
    is taken; without, DLPack (which names bfloat16) is used where the object has it."""
    torch = pytest.importorskip("torch")
    t = FakeCudaTensor(0x7F0000002000, (4, 5), torch.bfloat16, 0)
    assert t.__cuda_array_interface__["typestr"] == "<V2"
    d = gpu.as_device_array(t, dtype=dtypes.BFLOAT16)
    assert (d.ptr, d.dtype, d.count, d.nbytes, d.device_type) == (0x7F0000002000, dtypes.BFLOAT16, 20, 40, "cuda")
    with pytest.raises(TypeError, match="'<V2' is not supported.*needs the dtype"):
        gpu.as_device_array(t)  # no dtype and no DLPack: nothing can tell what the two bytes are
    with pytest.raises(TypeError, match="'<f2' is float16, but the tensor's dtype is bfloat16"):
        gpu.as_device_array(FakeCudaTensor(0x1000, (2,), torch.float16, 0), dtype=dtypes.BFLOAT16)

    class WithDLPack(FakeCudaTensor):  # "<V2" in the interface, DLPack from a (CPU) bfloat16 tensor
        def __init__(self, cpu):
            super().__init__(cpu.data_ptr(), cpu.shape, cpu.dtype, 0)
            self.cpu = cpu

        def __dlpack__(self, stream=None):
            return self.cpu.__dlpack__()

    cpu = torch.arange(6, dtype=torch.bfloat16)
    d = gpu.as_device_array(WithDLPack(cpu))  # the order: the DLPack fallback comes before the TypeError
    assert (d.dtype, d.count, d.ptr) == (dtypes.BFLOAT16, 6, cpu.data_ptr())


def test_cai_v3_stream_and_dlpack_consumer_stream():
    """A CAI v3 producer (CuPy, Numba) names its stream; one that names none but speaks DLPack is
    taken through DLPack with the consumer's stream, so that the producer orders its work first."""

    class CupyLike:
        def __init__(self, **cai):
            self.__cuda_array_interface__ = {"version": 3, "data": (0x7F0000001000, False), "shape": (2, 3),
                                             "typestr": "<f4", "strides": None, **cai}

    d = gpu.as_device_array(CupyLike(stream=7))
    assert (d.stream, d.nbytes, d.dtype) == (7, 24, dtypes.FLOAT32)
    assert gpu.as_device_array(CupyLike(stream=7), stream=0x99).stream == 7  # named: CAI, waited for by the stages

    class NoStreamWithDLPack(CupyLike):
        def __init__(self, cpu):
            super().__init__()
            self.cpu, self.asked = cpu, []

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

        def __dlpack__(self, stream=None):
            self.asked.append(stream)
            return self.cpu.__dlpack__()

    obj = NoStreamWithDLPack(np.arange(6, dtype=np.float32))
    gpu.as_device_array(obj)
    assert obj.asked == []  # no consumer stream: CAI
    d = gpu.as_device_array(obj, stream=0x99)
    assert obj.asked == [0x99] and d.ptr == obj.cpu.ctypes.data
    # numpy on the CPU is never handed a stream (it refuses one)
    assert gpu.as_device_array(np.zeros(3, np.float32), stream=0x99).device_type == "cpu"


def test_nccl_dtype_map_covers_every_byteps_dtype():
    assert set(gpu.NCCL_DTYPE) == set(dtypes.INFO)
    # nccl.h: ncclFloat32 = 7, ncclBfloat16 = 9
    assert gpu.NCCL_DTYPE[dtypes.FLOAT32] == 7 and gpu.NCCL_DTYPE[dtypes.BFLOAT16] == 9


# ---------------------------------------------------------------------------------------
# communicators and the unique-id exchange


def test_communicators_follow_the_plan():
    pcie = topology.plan(machine="pcie_only", env={})
    assert gpu_stages.communicators(pcie) == [(1, (0, 1, 2, 3)), (2, (4, 5, 6, 7))]
    dgx = topology.plan(machine="dgx1_nvlink", env={})
    assert gpu_stages.communicators(dgx) == [(0, tuple(range(8)))]
    one = topology.plan(machine="pcie_only", local_size=1, env={})
    assert gpu_stages.communicators(one) == []
    singles = topology.plan(machine="pcie_only", overrides={"switch_size": 1}, env={})
    assert gpu_stages.communicators(singles) == []  # groups of one GPU need no NCCL


@pytest.mark.parametrize("machine,local_size,overrides", [("pcie_only", 8, {}), ("cpu_2numa", 4, {}),
                                                          ("dgx1_nvlink", 8, {})])
def test_unique_ids_travel_through_shared_memory(tmp_path, machine, local_size, overrides):
    case = {"name": "ids", "machine": machine, "overrides": overrides, "sizes": []}
    records = run_local(tmp_path, local_size, [case], mode="ids", wall=180)["ids"]
    plan = topology.plan(machine=machine, local_size=local_size, env={})
    comms = gpu_stages.communicators(plan)
    assert comms
    for r, rec in enumerate(records):
        assert rec["error"] is None, rec["error"]
        assert set(rec["ids"]) == {str(slot) for slot, members in comms if r in members}
    for slot, members in comms:
        ids = {records[r]["ids"][str(slot)] for r in members}
        assert len(ids) == 1 and len(bytes.fromhex(ids.pop())) == 128
    all_ids = [rec["ids"][k] for rec in records for k in rec["ids"]]
    assert len(set(all_ids)) == len(comms)  # one id per communicator, all different


# ---------------------------------------------------------------------------------------
# the GPU stages on the fake GPU (tests/fake_cuda.py): devices per thread, producer streams


@pytest.fixture
def fake(monkeypatch):
    """8 fake GPUs behind core/gpu.py's cuda() and nccl()."""
    fg = fake_cuda.FakeGpu(devices=8)
    rt = gpu.Cuda(fg.cudart)
    monkeypatch.setattr(gpu, "_CUDA", rt)
    monkeypatch.setattr(gpu, "_NCCL", gpu.Nccl(fg.nccl, rt))
    return fg


def test_build_queries_answer_for_the_loaded_libraries(fake, monkeypatch):
    """cuda_built() / nccl_built() (Horovod's names) say whether the CUDA runtime and NCCL load in this
    process, and NCCL's version; where they do not load, False and 0."""
    from byteps import build_info

    assert build_info.cuda_built() is True and build_info.nccl_built() == 22105  # the fake's ncclGetVersion

    def missing(*_):
        raise gpu.GpuError("libcudart not found")
    monkeypatch.setattr(gpu, "cuda", missing)
    monkeypatch.setattr(gpu, "nccl", missing)
    assert build_info.cuda_built() is False and build_info.nccl_built() == 0


def _in_thread(name, fn, *args):
    """Run ``fn`` in a new thread called ``name`` (a thread whose current CUDA device is unset)."""
    out = {}

    def body():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised below
            out["error"] = e

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"thread {name} hangs"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_the_fake_gpu_shows_a_missing_wait(fake):
    """The model is strict enough to fail: a copy that does not wait for the producer's event reads
    the memory before the producer's kernel wrote it; with the wait it reads what the kernel wrote."""
    rt = gpu.cuda()
    rt.set_device(1)
    src, src_view = fake.alloc(1, 16)
    host = np.zeros(16, np.uint8)
    producer = fake.stream(1)
    for wait in (False, True):
        src_view[:] = 0
        fake.kernel(producer, lambda: src_view.__setitem__(slice(None), 7), delay=3)
        ready = rt.event_create()
        rt.event_record(ready, producer)
        ours, done = rt.stream_create(), rt.event_create()
        if wait:
            rt.stream_wait_event(ours, ready)
        rt.memcpy_async(host.ctypes.data, src, 16, gpu.cudaMemcpyDeviceToHost, ours)
        rt.event_record(done, ours)
        rt.event_wait(done, 5, "copy")
        assert (host == 7).all() == wait, (wait, host)
    # resources of another device than the thread's current one are refused
    other = fake.stream(2)
    with pytest.raises(gpu.CudaError, match="cudaErrorInvalidResourceHandle"):
        rt.memcpy_async(host.ctypes.data, src, 16, gpu.cudaMemcpyDeviceToHost, other)


def test_nccl_communicator_is_created_on_the_callers_device(fake):
    """ncclCommInitRank runs in a helper thread, whose current device would be 0: it must be the
    caller's (or the one named), or with two GPUs per machine every process would use GPU 0."""
    nc, rt = gpu.nccl(), gpu.cuda()
    uid = nc.get_unique_id()

    def caller():
        rt.set_device(3)
        return nc.comm_init_rank(1, uid, 0, timeout=10)

    comm = _in_thread("training", caller)
    assert fake.comms[comm].device == 3
    comm = _in_thread("fresh", nc.comm_init_rank, 1, uid, 0, 10, 5)  # device named, caller set none
    assert fake.comms[comm].device == 5
    assert ("byteps-nccl-init", 3) in fake.devices_of("cudaSetDevice")
    assert not [i for i in fake.implicit if i[0] != "fresh"], fake.implicit


def _device_tensor(fake, device, values, dtype_code):
    """A DeviceArray of fake-GPU memory on ``device`` holding ``values`` (numpy, in the dtype's view)."""
    ptr, buf = fake.alloc(device, values.nbytes)
    view = buf[:values.nbytes].view(values.dtype)
    view[:] = values
    return gpu.DeviceArray(ptr, values.nbytes, dtype_code, values.size, "cuda", device, None, buf), view


@pytest.mark.parametrize("machine,local_size,overrides", [
    ("dgx1_nvlink", 2, {}),                                   # reduce_scatter, one communicator
    ("pcie_only", 2, {"strategy": "reduce_broadcast"}),       # per-partition roots
    ("nvswitch_8nic", 4, {"strategy": "cpu_assisted"}),       # two communicators + PCIE_REDUCE
    ("pcie_only", 2, {"switch_size": 1}),                     # no NCCL: PCIE_REDUCE only
])
def test_every_thread_uses_its_own_gpu(fake, machine, local_size, overrides):
    """Each local rank's executor is built, run and closed on three different threads (none of which set
    a device), as a user or the engine may: every CUDA and NCCL call of rank r must run on GPU r, the
    communicators must belong to GPU r, and the sums must be right."""
    plan = topology.plan(machine=machine, local_size=local_size, overrides=overrides, env={})
    devices = [gpu_stages.cuda_ordinal(d, env={}) for d in plan.devices]
    assert len(set(devices)) == local_size > 1
    token = uuid.uuid4().hex[:12]
    count = 1001  # uneven: tails and several partitions
    inputs = [((np.arange(count) * 7 + r * 13) % 23 - 11).astype(np.float32) for r in range(local_size)]
    executors, tensors = {}, {}
    hooks = []

    def hook(view, start, stop, nic):
        hooks.append((start, stop))
        view += np.float32(1000)

    def run_all(phase, fn):
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, _catch(fn, r)), name=f"r{r}-{phase}")
                   for r in range(local_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errors = {r: e for r, e in results.items() if isinstance(e, BaseException)}
        assert not errors, f"{phase}: {errors}"

    def build(r):
        executors[r] = gpu_stages.GpuExecutor(plan, r, token, count * 4, timeout=20, partition_bytes=1024)

    def push_pull(r):
        arr, view = _device_tensor(fake, devices[r], inputs[r], dtypes.FLOAT32)
        tensors[r] = view
        executors[r].push_pull(arr, network=hook)

    results = {}
    run_all("build", build)
    try:
        run_all("op", push_pull)
    finally:
        run_all("close", lambda r: executors[r].close())
    expect = sum(inputs) + 1000
    for r in range(local_size):
        assert np.array_equal(tensors[r], expect), (r, np.flatnonzero(tensors[r] != expect)[:5])
    assert hooks
    for thread, device, function, _ in fake.calls:
        if thread.startswith("r"):
            rank = int(thread[1:].split("-")[0])
            assert device == devices[rank], f"{function} of local rank {rank} ({thread}) ran on GPU {device}"
    member_devices = sorted(c.device for c in fake.comms.values()) if fake.comms else []
    expect_comms = sorted(devices[r] for _, members in gpu_stages.communicators(plan) for r in members)
    assert member_devices == [] or member_devices == expect_comms  # closed comms are gone; see below
    inits = [d for t, d, f, _ in fake.calls if f == "ncclCommInitRank"]
    assert sorted(inits) == expect_comms, f"communicators were created on GPUs {sorted(inits)}"
    assert fake.implicit == [], f"CUDA calls from threads that set no device (GPU 0): {fake.implicit[:5]}"


def test_a_failing_network_step_fails_every_rank_in_step(fake):
    """Local rank 1's network step raises: it raises its own error, local rank 0 a LocalPeerError naming
    rank 1 and that error, in the same barrier (nobody waits for a time-out)."""
    from byteps.topology.localsync import LocalPeerError

    plan = topology.plan(machine="pcie_only", local_size=2, overrides={"strategy": "reduce_scatter"}, env={})
    devices = [gpu_stages.cuda_ordinal(d, env={}) for d in plan.devices]
    token = uuid.uuid4().hex[:12]
    count = 1001
    executors, results = {}, {}

    def hook(view, start, stop, nic):
        if threading.current_thread().name.startswith("r1"):
            raise ValueError("server 3 went away")
        view += np.float32(1000)

    def run_all(phase, fn):
        threads = [threading.Thread(target=lambda r=r: results.__setitem__((phase, r), _catch(fn, r)),
                                    name=f"r{r}-{phase}") for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), f"{phase}: a rank is still waiting"

    def push_pull(r):
        arr, _ = _device_tensor(fake, devices[r], np.ones(count, np.float32), dtypes.FLOAT32)
        executors[r].push_pull(arr, network=hook)

    run_all("build", lambda r: executors.__setitem__(r, gpu_stages.GpuExecutor(plan, r, token, count * 4,
                                                                                timeout=20, partition_bytes=1024)))
    began = time.monotonic()
    try:
        run_all("op", push_pull)
    finally:
        run_all("close", lambda r: executors[r].close())
    assert time.monotonic() - began < 15, "the ranks waited for a time-out"
    mine, theirs = results[("op", 1)], results[("op", 0)]
    assert isinstance(mine, ValueError) and "server 3 went away" in str(mine), repr(mine)
    assert isinstance(theirs, LocalPeerError), repr(theirs)
    assert "local rank 1" in str(theirs) and "server 3 went away" in str(theirs), str(theirs)


def _catch(fn, *args):
    try:
        return fn(*args)
    except BaseException as e:
        return e


class FakeTorchCuda:
    """torch.cuda's current_stream() and Event on the fake GPU, as torch implements them: the current
    stream is per thread (the default stream where none was selected); an Event is created when first
    recorded, on the device of the stream it is recorded on (torch guards the device, so the caller's
    current device does not change)."""

    def __init__(self, fake):
        self.fake = fake
        self.current = {}  # thread id -> stream handle selected (torch.cuda.stream(s))
        self.records = []  # (thread name, event handle, stream handle)
        outer = self

        class Stream:
            def __init__(self, handle, device):
                import torch

                self.cuda_stream, self.device = handle, torch.device("cuda", device)

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self.cuda_event = 0

            def record(self, stream=None):
                stream = stream or outer.current_stream()
                saved = fake.current()
                fake.tls.device = stream.device.index  # torch's CUDAGuard
                try:
                    if not self.cuda_event:
                        ref = ctypes_void_p()
                        assert fake.cudart.cudaEventCreateWithFlags(ctypes_byref(ref), 2) == 0
                        self.cuda_event = ref.value
                    assert fake.cudart.cudaEventRecord(self.cuda_event, stream.cuda_stream) == 0
                finally:
                    fake.tls.device = saved
                outer.records.append((threading.current_thread().name, self.cuda_event, stream.cuda_stream))

        self.Stream, self.Event = Stream, Event

    def select(self, handle):
        """torch.cuda.set_stream(s) on the calling thread."""
        self.current[threading.get_ident()] = handle

    def current_stream(self, device=None):
        device = 0 if device is None else device.index
        handle = self.current.get(threading.get_ident(), 0)  # 0: the default stream
        return self.Stream(handle, device)


from ctypes import byref as ctypes_byref, c_void_p as ctypes_void_p  # noqa: E402


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_handover_waits_for_the_producer_stream(fake, monkeypatch, dtype_name):
    """A gradient submitted while its backward kernel is still queued on the training thread's stream:
    the plugin's hand-over (on the training thread) and the engine's local executor (on its own
    thread, chunk by chunk) must read it only after that kernel. On the fake GPU, a read that does not
    wait sees the memory before the kernel wrote it, and the result is wrong."""
    torch = pytest.importorskip("torch")
    from byteps.core import local_exec
    from byteps.torch import ops

    fake_torch = FakeTorchCuda(fake)
    monkeypatch.setattr(torch.cuda, "current_stream", fake_torch.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", fake_torch.Event)
    device = 3
    plan = topology.plan(machine="pcie_only", local_size=1, devices=(device,), env={})
    torch_dtype, code = getattr(torch, dtype_name), dtypes.from_name(dtype_name)
    count = 1000
    values = torch.arange(1, count + 1, dtype=torch.float32).remainder(200).add(1).to(torch_dtype)
    bits = values.view(torch.int16).numpy().view(np.uint16) if dtype_name == "bfloat16" else values.numpy()
    ptr, buf = fake.alloc(device, bits.nbytes)
    memory = buf[:bits.nbytes].view(bits.dtype)
    producer = fake.stream(device, "backward")

    def training_thread():
        fake_torch.select(producer)  # torch.cuda.stream(producer): backward ran on it
        fake.kernel(producer, lambda: memory.__setitem__(slice(None), bits), delay=4)  # still running
        return ops._device_buffer(FakeCudaTensor(ptr, (count,), torch_dtype, device))

    arr = _in_thread("training", training_thread)
    assert arr.dtype == code and arr.ready_event
    assert fake_torch.records == [("training", arr.ready_event, producer)]  # on the producer's stream

    def negate(data, dtype):
        """The network step: the other machines make the sum the negation (exact in every dtype)."""
        if dtype == dtypes.BFLOAT16:
            data.view(np.uint16)[:] ^= 0x8000
        else:
            v = data.view(dtypes.numpy_view_dtype(dtype))
            np.negative(v, out=v)

    class Engine:  # what LocalExec uses of the engine: its config and push_range
        cfg = types.SimpleNamespace(local_rank=0, partition_bytes=16 * dtypes.itemsize(code), timeout=20.0)
        failure = None

        def push_range(self, rop):
            negate(rop.buf, rop.dtype)
            rop.done.set()

    ex = local_exec.LocalExec(Engine(), plan, uuid.uuid4().hex[:12])
    assert local_exec.cuda_reason(plan) is None, local_exec.cuda_reason(plan)
    op = types.SimpleNamespace(name="grad", buf=arr, dtype=code, tkey=5, priority=0, codec=None)
    lay = local_exec.layout(plan, count, dtypes.itemsize(code), Engine.cfg.partition_bytes)
    assert len(lay.chunks) == 4  # the first chunk waits; the others follow it on the stream

    def executor_thread():
        try:
            ex._execute(op, lay)
        finally:
            if ex.gpu is not None:
                ex.gpu.close()

    _in_thread("byteps-local-exec", executor_thread)
    fake._progress()  # whatever is still queued runs now
    expect = bits.copy()
    negate(expect.view(np.uint8), code)
    assert np.array_equal(memory, expect), f"first differences at {np.flatnonzero(memory != expect)[:5]}"
    assert ex.stats["chunks"] == 4 and fake.implicit == []
    assert {d for t, d in fake.devices_of("cudaMemcpyAsync")} == {device}


def test_direct_push_pull_waits_for_the_named_producer_stream(fake):
    """``GpuExecutor.push_pull(x, stream=s)`` and a CAI v3 ``stream``: an event is recorded on that stream
    on the calling thread, and the stages wait for it."""
    device = 2
    plan = topology.plan(machine="pcie_only", local_size=1, devices=(device,), env={})
    count = 300
    values = np.arange(1, count + 1, dtype=np.float64)

    class CupyLike:  # a CAI v3 producer naming its stream
        def __init__(self, ptr, stream):
            self.__cuda_array_interface__ = {"version": 3, "data": (ptr, False), "shape": (count,), "typestr": "<f8",
                                             "strides": None, "stream": stream}

    def negate(view, start, stop, nic):  # the network step
        view *= -1

    def run():
        ex = gpu_stages.GpuExecutor(plan, 0, uuid.uuid4().hex[:12], count * 8, timeout=20)
        try:
            for how in ("stream=", "cai v3"):
                arr, view = _device_tensor(fake, device, np.zeros(count), dtypes.FLOAT64)
                producer = fake.stream(device, how)
                fake.kernel(producer, lambda: view.__setitem__(slice(None), values), delay=4)
                if how == "stream=":
                    ex.push_pull(arr, network=negate, stream=producer)
                else:
                    ex.push_pull(CupyLike(arr.ptr, producer), network=negate)
                fake._progress()
                assert np.array_equal(view, -values), (how, view[:5])
        finally:
            ex.close()

    _in_thread("user", run)
    assert fake.implicit == []


# ---------------------------------------------------------------------------------------
# on a GPU machine


def _gpu_reason(min_devices):
    reason = gpu.unavailable_reason(need_nccl=min_devices > 1, min_devices=min_devices)
    if reason:
        return reason
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU tests make CUDA tensors with it)"
    if not torch.cuda.is_available():
        return "torch has no CUDA (a CPU build?)"
    return None


def _cases(local_size):
    cases = [{"name": "pcie", "machine": "pcie_only", "sizes": [1 << 20, 1001, 3]},
             {"name": "pcie_switch1", "machine": "pcie_only", "overrides": {"switch_size": 1}, "sizes": [1001, 5]},
             {"name": "rs", "machine": "nvswitch_8nic", "sizes": [(1 << 20) + 3, 2], "dtype": "float64"},
             {"name": "rb", "machine": "dgx1_nvlink", "overrides": {"strategy": "reduce_broadcast"},
              "sizes": [(1 << 20) + 5, 7], "partition_bytes": 1 << 18, "hook": True},
             # torch exports bfloat16 as "<V2"; sums of these inputs are exact in bfloat16 (no hook: +1000 is not)
             {"name": "bf16", "machine": "pcie_only", "sizes": [(1 << 20) + 1, 3], "dtype": "bfloat16"}]
    return cases


# The workers (tests/topology_worker.py, mode "gpu") produce each tensor on a side stream behind a
# long kernel and hand it over without synchronizing, so a stage that does not wait for the
# producer's stream reads stale memory and the sums come out wrong.


def test_gpu_single_process_copies_through_pinned_staging(tmp_path):
    reason = _gpu_reason(1)
    if reason:
        pytest.skip(reason)
    case = {"name": "alone", "machine": "pcie_only", "sizes": [1 << 20, 1, 0], "hook": True}
    records = run_local(tmp_path, 1, [case], mode="gpu", wall=300)["alone"]
    check_sums(tmp_path, records, case, 1, offset=1000)


@pytest.mark.parametrize("local_size", [2, 4, 8])
def test_gpu_stages_every_strategy(tmp_path, local_size):
    reason = _gpu_reason(local_size)
    if reason:
        pytest.skip(reason)
    cases = _cases(local_size)
    records = run_local(tmp_path, local_size, cases, mode="gpu", wall=600)
    for case in cases:
        saved = dict(case, dtype="float32") if case.get("dtype") == "bfloat16" else case  # the worker saves float32
        check_sums(tmp_path, records[case["name"]], saved, local_size, offset=1000 if case.get("hook") else 0)
