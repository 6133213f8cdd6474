"""GPU stages (core/gpu.py, core/gpu_stages.py).

Without a GPU the module must still import, and everything that is plain logic runs here: tensor
intake (DLPack on CPU tensors, the __cuda_array_interface__ protocol), the NCCL dtype map,
staging-buffer bookkeeping, communicator layout, and the NCCL unique-id exchange through shared
memory between real processes. The end-to-end tests need CUDA, NCCL, torch with CUDA and enough
GPUs; they skip with the reason otherwise.
"""
import os
import sys
import threading

import numpy as np
import pytest

import byteps.topology as topology
from byteps.core import dtypes, gpu, gpu_stages
from byteps.errors import BytePSTimeoutError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_topology_exec import check_sums, run_local  # noqa: E402


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


class CudaArray:
    """An object exposing the CUDA Array Interface (v3) the way CuPy/Numba/PyTorch do."""

    def __init__(self, **cai):
        self.__cuda_array_interface__ = {"version": 3, "data": (0x7F0000001000, False), "shape": (2, 3),
                                         "typestr": "<f4", "strides": None, **cai}


def test_cuda_array_interface():
    d = gpu.as_device_array(CudaArray(stream=7))
    assert (d.ptr, d.nbytes, d.count, d.dtype, d.device_type, d.stream) == (0x7F0000001000, 24, 6, dtypes.FLOAT32,
                                                                           "cuda", 7)
    assert gpu.as_device_array(CudaArray(strides=(12, 4))).nbytes == 24  # explicit C strides are fine
    assert gpu.as_device_array(CudaArray(shape=(1, 3), strides=(999, 4))).count == 3  # a size-1 dim's stride is free
    with pytest.raises(ValueError, match=r"strides \(4, 8\) is not C-contiguous"):
        gpu.as_device_array(CudaArray(strides=(4, 8)))
    with pytest.raises(TypeError, match="typestr '<c8' is not supported"):
        gpu.as_device_array(CudaArray(typestr="<c8"))
    assert gpu.as_device_array(CudaArray(typestr="<i8", shape=(5,))).nbytes == 40


def test_nccl_dtype_map_covers_every_byteps_dtype():
    assert set(gpu.NCCL_DTYPE) == set(dtypes.INFO)
    # nccl.h: ncclFloat32 = 7, ncclBfloat16 = 9
    assert gpu.NCCL_DTYPE[dtypes.FLOAT32] == 7 and gpu.NCCL_DTYPE[dtypes.BFLOAT16] == 9


# ---------------------------------------------------------------------------------------
# staging buffers


def test_staging_pool_bookkeeping():
    pinned, unpinned = [], []
    pool = gpu.StagingPool(10000, 2, pin=lambda p, n: pinned.append((p, n)), unpin=unpinned.append)
    assert pool.slot_bytes == 12288  # whole pages
    assert all(p % 4096 == 0 and n == 12288 for p, n in pinned) and len(pinned) == 2
    assert pool.slices(30000, 8) == [(0, 12288), (12288, 24576), (24576, 30000)]
    assert pool.slices(0) == []
    a, view_a = pool.acquire(1)
    b, view_b = pool.acquire(1)
    assert a != b and view_a.ctypes.data != view_b.ctypes.data and pool.in_use == 2
    with pytest.raises(BytePSTimeoutError, match="no staging buffer was released within 0.05 s"):
        pool.acquire(0.05)
    threading.Timer(0.05, pool.release, (a,)).start()
    c, _ = pool.acquire(5)  # a waiter gets the slot released by another thread
    assert c == a and pool.high_water == 2
    pool.release(b)
    with pytest.raises(ValueError, match="staging slot 1 is not in use"):
        pool.release(b)
    pool.close()
    assert sorted(unpinned) == sorted(p for p, _ in pinned)
    with pytest.raises(ValueError, match="not page-aligned"):
        gpu.StagingPool(4096, 1, allocate=lambda n: np.zeros(n + 1, np.uint8)[1:])


def test_staging_slices_respect_element_boundaries():
    pool = gpu.StagingPool(4096, 1)
    sl = pool.slices(6 * 7001, itemsize=6)
    assert all((b - a) % 6 == 0 for a, b in sl) and sl[-1][1] == 6 * 7001
    assert all(b - a <= 4096 for a, b in sl)


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
              "sizes": [(1 << 20) + 5, 7], "partition_bytes": 1 << 18, "hook": True}]
    return cases


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
        check_sums(tmp_path, records[case["name"]], case, local_size, offset=1000 if case.get("hook") else 0)
