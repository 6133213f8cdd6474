"""CUDA tensors through the native pipeline, per partition (core/pipeline/gpu_copier.h): COPYD2H into a
bounded ring of page-locked slots after the producer's ready event, the host stages, COPYH2D back, the
done event for the caller's stream.

No GPU is needed: a fake CUDA runtime (tests/fake_cudart/fake_cudart.c), built here with the system's C
compiler, is the library the native core loads (BYTEPS_CUDART). Its streams run on threads of their own
with a delay per copy, so asynchrony, stream waits and ordering are real. Every job is real (scheduler,
servers and workers as processes); every result is compared exactly with a locally computed sum
(tests/scenarios_gpu_native.py). ``whole_tensor_log`` builds the log the old path (one copy of the whole
tensor off the GPU, the push_pull, one copy back) would leave, and each ordering check is shown to
reject it.
"""
import os
import re
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PART = 4096  # partition bytes: 1024 float32 per partition


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA runtime (tests/fake_cudart/fake_cudart.c)")
    out = tmp_path_factory.mktemp("fake_cudart") / "libfake_cudart.so"
    # -Bsymbolic: the fake's calls to its own cuda* functions stay its own. On a GPU machine torch loads
    # the real libcudart into the global scope, whose symbols would otherwise take those calls.
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-Wl,-Bsymbolic", "-o", str(out),
                    os.path.join(HERE, "fake_cudart", "fake_cudart.c")], check=True)
    return str(out)


def run(cluster, fake_cudart, scenario, args, machines=2, local_size=1, env=None, timeout=90):
    c = cluster(machines, 1, local_size=local_size,
                env={"BYTEPS_CUDART": fake_cudart, "BYTEPS_PARTITION_BYTES": str(PART), **(env or {})})
    c.run_workers(scenario, args)
    codes, _, _ = c.wait_all(timeout)
    assert codes == [0] * (machines * local_size), c.all_logs()
    res = c.results()
    for rank, r in res.items():
        assert "error" not in r, (rank, r.get("error"), c.all_logs())
    return res


LINE = re.compile(r"(\d+) (call|done) (\S+)(.*)")


def events(log):
    """[(ns, 'call'|'done', what, {field: value})] of the fake's log."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            fields = dict(kv.split("=", 1) for kv in m.group(4).split() if "=" in kv)
            out.append((int(m.group(1)), m.group(2), m.group(3), fields))
    return out


def copies(log, base, nbytes, kind, phase="call"):
    """Copies (``kind`` 2: off the GPU, 1: onto it) of the device range [base, base + nbytes) in log
    order: [(ns, partition index by offset, bytes)]."""
    out = []
    for ns, ph, what, f in events(log):
        if ph != phase or what not in ("cudaMemcpyAsync", "memcpy") or int(f["kind"]) != kind:
            continue
        if f.get("rc", "0") != "0":
            continue
        dev = int(f["src" if kind == 2 else "dst"], 16)
        if base <= dev < base + nbytes:
            out.append((ns, (dev - base) // PART, int(f["n"])))
    return out


def whole_tensor_log(base, nbytes, host=0x7000):
    """The log the old path leaves for one tensor: its whole bytes off the GPU in one copy, then back."""
    return (f"1 call cudaMemcpyAsync kind=2 dst={host:#x} src={base:#x} n={nbytes} stream=1 rc=0\n"
            f"2 done memcpy kind=2 dst={host:#x} src={base:#x} n={nbytes} stream=1\n"
            f"3 call cudaMemcpyAsync kind=1 dst={base:#x} src={host:#x} n={nbytes} stream=1 rc=0\n"
            f"4 done memcpy kind=1 dst={base:#x} src={host:#x} n={nbytes} stream=1\n")


def per_partition(log, base, nbytes):
    """Every partition of the tensor was copied off the GPU and back on its own, once each."""
    n = -(-nbytes // PART)
    down, up = copies(log, base, nbytes, 2), copies(log, base, nbytes, 1)
    return sorted(p for _, p, _ in down) == list(range(n)) and sorted(p for _, p, _ in up) == list(range(n)) \
        and all(b <= PART for _, _, b in down + up)


def interleaved(log, base, nbytes):
    """Copies overlap the network: a partition's result came back onto the GPU (its push and pull done)
    before a later partition's copy off the GPU had finished."""
    first_back = min(ns for ns, _, _ in copies(log, base, nbytes, 1))
    last_off_done = max(ns for ns, _, _ in copies(log, base, nbytes, 2, phase="done"))
    return first_back < last_off_done


def waits_for_producer(log, base, nbytes):
    """A cudaStreamWaitEvent comes before the tensor's first copy off the GPU, on the copies' stream."""
    first = next(i for i, (_, ph, what, f) in enumerate(events(log)) if ph == "call" and what == "cudaMemcpyAsync"
                 and f.get("rc") == "0" and int(f["kind"]) == 2 and base <= int(f["src"], 16) < base + nbytes)
    ev = events(log)
    stream = ev[first][3]["stream"]
    return any(what == "cudaStreamWaitEvent" and f["stream"] == stream for _, _, what, f in ev[:first])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("machines,local_size", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_cuda_sums_are_exact_per_partition(cluster, fake_cudart, machines, local_size):
    """Push_pulls of 1 to 5 partitions and a broadcast, the producer's kernel 150 ms late: exact, each
    partition copied off and back on its own after a wait for the producer's event, in page-locked
    memory, no event wait that would spin; a push_pull submitted without its ready event reads the
    memory before the kernel wrote it (the fake exposes a missing wait)."""
    tensors = [{"name": "a", "numel": 5000, "dtype": "float32"}, {"name": "b", "numel": 3000, "dtype": "int32"},
               {"name": "c", "numel": 10, "dtype": "float32"},
               {"name": "bc", "numel": 2500, "dtype": "float32", "root": 0},
               {"name": "unwaited", "numel": 2000, "dtype": "float32", "ready": False}]
    res = run(cluster, fake_cudart, "gpu_sums", {"tensors": tensors, "kernel_delay_us": 150000, "rounds": 2},
              machines=machines, local_size=local_size)
    for rank, r in res.items():
        v = r["value"]
        ok = v["ok"]
        assert all(ok[f"{t}@{rnd}"] for t in ("a", "b", "c", "bc") for rnd in (0, 1)), (rank, ok)
        assert not ok["unwaited@0"] and not ok["unwaited@1"], (rank, ok)
        log = v["log"]
        for t, nbytes in (("a", 20000), ("b", 12000), ("c", 40)):
            base = v["ptrs"][f"{t}@0"]
            assert per_partition(log, base, nbytes), (rank, t)
            assert waits_for_producer(log, base, nbytes), (rank, t)
            assert not per_partition(whole_tensor_log(base, nbytes), base, nbytes) or nbytes <= PART
        # a broadcast's root copies nothing back, the others nothing off the GPU
        base = v["ptrs"]["bc@0"]
        down, up = copies(log, base, 10000, 2), copies(log, base, 10000, 1)
        assert (len(down), len(up)) == ((3, 0) if rank == 0 else (0, 3)), (rank, down, up)
        fake = v["fake"]
        assert fake["pageable_copies"] == 0 and fake["spinning_syncs"] == 0 and fake["wrong_device"] == 0, fake
        assert v["gpu"]["copies"] > 0 and v["gpu"]["peak_slots"] >= 1, v["gpu"]
        assert r["stages"]["copyd2h"] > 0 and r["stages"]["copyh2d"] > 0, r["stages"]


@pytest.mark.timeout(120)
def test_slots_grow_to_a_longer_partition(cluster, fake_cudart):
    """A staging ring whose slots are shorter than the partitions (a later server membership may cut
    longer ones than the ring was sized for): each slot is reallocated to the partition's length, and
    the sums are exact."""
    tensors = [{"name": "a", "numel": 5000, "dtype": "float32"}, {"name": "b", "numel": 3000, "dtype": "int32"}]
    res = run(cluster, fake_cudart, "gpu_sums", {"tensors": tensors, "rounds": 2, "slot_bytes": 1024})
    for rank, r in res.items():
        ok = r["value"]["ok"]
        assert all(ok[f"{t}@{rnd}"] for t in ("a", "b") for rnd in (0, 1)), (rank, ok)
        assert r["value"]["gpu"]["copies"] > 0, r["value"]["gpu"]


@pytest.mark.timeout(200)
def test_copies_overlap_the_network_in_a_bounded_ring(cluster, fake_cudart, tmp_path):
    """64 partitions, 4 staging slots, copies of 5 ms: a partition's result is back on the GPU before a
    later partition's copy off it finished (no whole-tensor phase), and the job's timeline shows a
    partition's COPYD2H span overlapping the PUSH span of the partition before it; at most 4 slots are
    ever held and 4 page-locked buffers allocated; exact."""
    from byteps.timeline import report

    numel = 64 * PART // 4
    trace_path = str(tmp_path / "gpu.trace.json")
    res = run(cluster, fake_cudart, "gpu_sums",
              {"tensors": [{"name": "big", "numel": numel, "dtype": "float32"}], "copy_delay_us": 5000},
              env={"BYTEPS_GPU_STAGING_BYTES": str(4 * PART), "BYTEPS_SCHEDULING_CREDIT": "2",
                   "BYTEPS_TIMELINE": trace_path})
    for rank, r in res.items():
        v = r["value"]
        assert v["ok"]["big@0"], rank
        base, log = v["ptrs"]["big@0"], v["log"]
        assert per_partition(log, base, numel * 4), rank
        assert interleaved(log, base, numel * 4), rank
        assert not interleaved(whole_tensor_log(base, numel * 4), base, numel * 4)
        assert v["gpu"]["peak_slots"] == 4, v["gpu"]
        assert v["fake"]["pinned_allocs"] == 4 and v["fake"]["pinned_peak"] == 4 * PART, v["fake"]
    check_overlap(report.load(trace_path), "big", 64)


def check_overlap(trace, tensor, partitions):
    """Each worker's timeline has a COPYD2H and a COPYH2D span per partition of ``tensor``'s first op,
    and a partition's PUSH span overlaps the COPYD2H span of a later partition: it was pushed while the
    later one was still being copied off the GPU. (A COPYD2H span comes before the partition's round is
    taken, at its push: the first op's spans are the earliest.) Any later partition counts: on a real
    GPU the next partition's copy may end within the same wake of byteps-net as the partition's own."""
    for pid in {s["pid"] for s in trace.spans if trace.role(s["pid"]) == "worker"}:
        spans = {}
        for s in sorted(trace.spans, key=lambda s: s["ts"]):
            if s["pid"] == pid and s["name"] in ("COPYD2H", "PUSH", "COPYH2D") and s["args"]["tensor"] == tensor:
                spans.setdefault((s["name"], s["args"]["partition"]), s)
        assert sum(k[0] == "COPYD2H" for k in spans) == partitions, (pid, sorted(spans))
        assert sum(k[0] == "COPYH2D" for k in spans) == partitions, (pid, sorted(spans))
        overlapping = [(i, j) for i in range(partitions - 1) if ("PUSH", i) in spans
                       for j in range(i + 1, partitions)
                       if spans[("COPYD2H", j)]["ts"] < spans[("PUSH", i)]["end"] and
                       spans[("PUSH", i)]["ts"] < spans[("COPYD2H", j)]["end"]]
        assert overlapping, (pid, sorted(spans))


@pytest.mark.timeout(200)
def test_urgent_tensor_takes_the_scarce_slots_first(cluster, fake_cudart):
    """Two staging slots (the fewest there are): a low-priority push_pull of 8 partitions, then an urgent one
    of 3. Once the first partitions' slots come back, the urgent tensor's partitions are copied off the
    GPU before the rest of the first; both exact."""
    res = run(cluster, fake_cudart, "gpu_order",
              {"tensors": [["slow", 8 * PART // 4, 0], ["urgent", 3 * PART // 4, 10]], "copy_delay_us": 20000},
              env={"BYTEPS_GPU_STAGING_BYTES": str(PART)})
    for rank, r in res.items():
        v = r["value"]
        assert v["ok"] == {"slow": True, "urgent": True}, (rank, v["ok"])
        order = []
        for ns, _, what, f in events(v["log"]):
            if what == "cudaMemcpyAsync" and f.get("rc") == "0" and int(f["kind"]) == 2:
                src = int(f["src"], 16)
                for name, n in (("slow", 8 * PART), ("urgent", 3 * PART)):
                    if v["ptrs"][name] <= src < v["ptrs"][name] + n:
                        order.append(name)
        assert order == ["slow"] * 2 + ["urgent"] * 3 + ["slow"] * 6, (rank, order)
        assert v["gpu"]["peak_slots"] == 2, v["gpu"]


@pytest.mark.timeout(120)
def test_ranks_holding_slots_for_different_tensors_do_not_deadlock(cluster, fake_cudart):
    """Two staging slots, two tensors of 2 partitions started in opposite orders on the two ranks: each
    rank's slots wait for partitions only the other rank has started. After a second without a slot
    coming back the ring grows by one, and both finish exactly."""
    res = run(cluster, fake_cudart, "gpu_crossed", {"copy_delay_us": 2000}, env={"BYTEPS_GPU_STAGING_BYTES": str(PART)})
    for rank, r in res.items():
        assert r["value"]["ok"] == [True] * 4, (rank, r["value"]["ok"])
    # one rank's extra slot is enough: its partitions then reach the server and the other's slots come back
    assert sum(r["value"]["gpu"]["grown"] for r in res.values()) >= 1, [r["value"]["gpu"] for r in res.values()]


@pytest.mark.timeout(120)
def test_failing_copy_fails_the_op_naming_the_tensor(cluster, fake_cudart):
    """cudaMemcpyAsync fails on every rank: the op fails at once with CUDA's error and the tensor's name
    (no hang, no crash), and the next push_pull still works."""
    res = run(cluster, fake_cudart, "gpu_copy_fails", {"numel": 3000}, env={"BYTEPS_TIMEOUT": "20"})
    for rank, r in res.items():
        v = r["value"]
        err = v["error"]
        assert err and err.startswith("BytePSError") and "'broken'" in err, (rank, err)
        assert "an illegal memory access was encountered" in err and "cudaMemcpyAsync" in err, err
        assert v["after_ok"], rank


def cuda_reason():
    """Why real CUDA tensors cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU build, or no GPU here)"
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("machines,local_size", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_torch_cuda_tensors_through_the_copy_stages(cluster, tmp_path, machines, local_size):
    """GPU only: torch CUDA tensors of 8 partitions of 4 MB, each written by a copy queued behind a
    sleeping kernel on torch's current stream just before push_pull (byteps must wait for it on the GPU),
    through the real libcudart: exact sums, copies per partition, and (two machines) the timeline shows a
    partition pushed while a later one is still copied off the GPU (check_overlap). The partitions are
    4 MB because a 1 MB copy of page-locked memory takes tens of microseconds on a current card."""
    reason = cuda_reason()
    if reason:
        pytest.skip(reason)
    from byteps.timeline import report

    trace_path = str(tmp_path / "cuda.trace.json")
    c = cluster(machines, 1, local_size=local_size,
                env={"BYTEPS_PARTITION_BYTES": str(4 << 20), "BYTEPS_TIMELINE": trace_path})
    c.run_workers("gpu_torch", {"tensors": [["t8", 8 << 20], ["t1", 1000]]})
    codes, _, _ = c.wait_all(240)
    assert codes == [0] * (machines * local_size), c.all_logs()
    for rank, r in c.results().items():
        assert "error" not in r, (rank, r.get("error"), c.all_logs())
        v = r["value"]
        assert all(v["ok"].values()) and len(v["ok"]) == 4, (rank, v["ok"])
        assert v["gpu"]["copies"] >= 2 * 9, (rank, v["gpu"])
    if machines == 2:
        check_overlap(report.load(trace_path), "t8", 8)


@pytest.mark.timeout(120)
def test_missing_runtime_fails_cuda_tensors_only(cluster, tmp_path):
    """BYTEPS_CUDART names a library that is not there: the CUDA tensor's op fails at once naming the
    tensor and the library; host tensors are not affected."""
    missing = str(tmp_path / "libcudart.so.99")
    res = run(cluster, missing, "gpu_no_runtime", {})
    for rank, r in res.items():
        v = r["value"]
        assert v["error"].startswith("BytePSError") and "'dev'" in v["error"] and missing in v["error"], v
        assert v["host_ok"], rank


@pytest.mark.timeout(120)
def test_stuck_producer_times_out_naming_the_copies(cluster, fake_cudart):
    """A producer whose kernel never ends: the op fails after BYTEPS_TIMEOUT saying it waited for its
    copies between the GPU and host memory, and the workers still exit (byteps-gpu, blocked on the copy's
    event, is left behind rather than waited for)."""
    # BYTEPS_TIMEOUT also bounds start-up, which takes seconds on a loaded machine
    res = run(cluster, fake_cudart, "gpu_stuck", {}, env={"BYTEPS_TIMEOUT": "15"}, timeout=90)
    for rank, r in res.items():
        err = r["value"]
        assert err and err.startswith("BytePSTimeoutError") and "'stuck'" in err, (rank, err)
        assert "its copies between the GPU and host memory" in err, err
