"""One local process of a local-group test: ``python topology_worker.py SPEC.json RANK OUTDIR``.

SPEC (written by tests/test_localsync.py / test_gpu_stages.py):
  {"mode": "sums" | "gpu" | "ids", "token": str, "local_size": L, "timeout": s,
   "cases": [{"name": str, "machine": fixture name, "overrides": {...}, "sizes": [...],
              "dtype": "float32", "partition_bytes": int, "hook": bool, "skip_op": bool}]}

Every process builds its plan from the same inputs (so the test also checks that they agree),
runs each case's operations on inputs that depend on (rank, operation): "gpu" through the plan's
GPU stages (core/gpu_stages.py), "sums" through the bare LocalGroup (its arenas and barriers, which
the GPU stages stand on: each rank writes its input into its arena, every rank sums all arenas),
and saves the results as OUTDIR/<case>-<rank>-<op>.npy, plus OUTDIR/<case>-<rank>.json with the
hook calls or the error ("error": "TypeName: message"). The parent computes the expected sums
locally.
"""
import json
import os
import sys
import traceback

import numpy as np


def inputs(rank, op, count, dtype):
    """Small integers, exact in every dtype, different per rank and operation."""
    base = (np.arange(count, dtype=np.int64) * 7 + rank * 13 + op * 5) % 23 - 11
    return base.astype(dtype)


def main(spec_path, rank, outdir):
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(rank)
    import byteps.topology as topology

    for case in spec["cases"]:
        record = {"hooks": [], "error": None, "plan": None}
        try:
            plan = topology.plan(machine=case["machine"], local_size=case.get("plan_local_size", spec["local_size"]),
                                 overrides=case.get("overrides") or {}, env={})
            record["plan"] = [plan.strategy, [list(g) for g in plan.groups], list(plan.roots)]
            token = f"{spec['token']}-{case['name']}"
            if spec["mode"] == "ids":
                from byteps.core.gpu_stages import communicators, exchange_ids
                from byteps.topology.localsync import LocalGroup

                group = LocalGroup(token, rank, plan.local_size, 4096 * 2, spec["timeout"])
                try:
                    ids = exchange_ids(group, communicators(plan), lambda: os.urandom(128))
                    record["ids"] = {str(k): v.hex() for k, v in ids.items()}
                finally:
                    group.close()
            elif spec["mode"] == "sums":
                run_sums(spec, case, plan, rank, token, outdir)
            else:
                run_gpu(spec, case, plan, rank, token, outdir, record)
        except Exception as e:  # reported to the parent, which checks it
            record["error"] = f"{type(e).__name__}: {e}"
            record["trace"] = traceback.format_exc()
        with open(os.path.join(outdir, f"{case['name']}-{rank}.json"), "w") as f:
            json.dump(record, f)


def run_gpu(spec, case, plan, rank, token, outdir, record):
    import torch

    from byteps.core.gpu_stages import GpuExecutor

    # bfloat16 (numpy has none): inputs and results as float32, exact for these values
    bf16 = case.get("dtype") == "bfloat16"
    dtype = np.dtype(np.float32 if bf16 else case.get("dtype", "float32"))
    sizes = case["sizes"]
    cap = max(sizes) * (2 if bf16 else dtype.itemsize) if sizes else 8
    torch.cuda.set_device(plan.devices[rank])
    ex = GpuExecutor(plan, rank, token, cap, timeout=spec["timeout"],
                     partition_bytes=case.get("partition_bytes", 4096000))
    producer = torch.cuda.Stream()

    current = {"op": -1}

    def hook(view, start, stop, nic):
        record["hooks"].append([current["op"], start, stop, nic])
        view += np.asarray(1000, dtype=view.dtype)  # "the other machines' contribution"

    try:
        for op, count in enumerate(sizes):
            current["op"] = op
            if case.get("skip_op") and rank == plan.local_size - 1 and op == 0:
                continue  # this rank never joins: the others must time out naming it
            if case.get("mismatch") and rank == 1:
                count += 1
            x = inputs(rank, op, count, dtype)
            # the tensor is produced on a side stream behind a long kernel and handed over without
            # synchronizing, as a gradient is by its backward: the stages must wait for that stream
            src = torch.from_numpy(x).pin_memory()
            t = torch.empty(count, dtype=torch.bfloat16 if bf16 else src.dtype, device="cuda")
            with torch.cuda.stream(producer):
                torch.cuda._sleep(20_000_000)
                t.copy_(src, non_blocking=True)
                ex.push_pull(t, network=hook if case.get("hook") else None)  # orders after `producer`
            x = t.float().cpu().numpy() if bf16 else t.cpu().numpy()
            np.save(os.path.join(outdir, f"{case['name']}-{rank}-{op}.npy"), x)
    finally:
        ex.close()


def run_sums(spec, case, plan, rank, token, outdir):
    """Every operation: write this rank's input into its arena, barrier (the signature carries the
    byte count and dtype), sum every rank's arena into the result, barrier again (nobody writes the
    next input before every rank has read this one)."""
    from byteps.core import dtypes
    from byteps.topology.localsync import LocalGroup

    dtype = np.dtype(case.get("dtype", "float32"))
    code = dtypes.from_name(dtype.name)
    cap = max(max(case["sizes"]) * dtype.itemsize, 8)
    group = LocalGroup(token, rank, plan.local_size, cap, spec["timeout"])
    everyone = range(plan.local_size)
    try:
        for op, count in enumerate(case["sizes"]):
            if case.get("skip_op") and rank == plan.local_size - 1 and op == 0:
                continue  # this rank never joins: the others must time out naming it
            if case.get("mismatch") and rank == 1:
                count += 1
            x = inputs(rank, op, count, dtype)
            nbytes = x.nbytes
            group.peers[rank][:nbytes] = x.view(np.uint8)
            group.barrier(1 + 2 * op, 1, everyone, (nbytes, code), "stage")
            total = sum(group.peers[r][:nbytes].view(dtype).astype(np.float64) for r in everyone)
            group.barrier(2 + 2 * op, 2, everyone, (nbytes, code), "sum")
            np.save(os.path.join(outdir, f"{case['name']}-{rank}-{op}.npy"), total.astype(dtype))
    finally:
        group.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
