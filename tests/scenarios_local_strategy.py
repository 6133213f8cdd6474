"""Worker scenarios of tests/test_local_strategy.py: push_pull with BYTEPS_LOCAL_STRATEGY=topology in real
jobs (host tensors: the native local reduce with the plan's owners, core/local.py; CUDA push_pulls on a
machine of GPUs: the NCCL stages, core/pipeline/nccl_stages.h)."""
import numpy as np
import torch

import byteps.torch as bps
from scenarios import digest, scenario


def values(rank, rnd, index, count, dtype):
    """Small integers (|x| <= 8): every sum of up to 8 ranks is exact in every dtype, fp16 included."""
    base = (np.arange(count, dtype=np.int64) * 7 + rank * 13 + rnd * 5 + index * 3) % 17 - 8
    return base.astype(dtype)


def tensor(rank, rnd, index, count, dtype_name):
    """values() as a torch tensor; bfloat16 (which numpy lacks) through float32, exactly."""
    if dtype_name == "bfloat16":
        return torch.from_numpy(values(rank, rnd, index, count, np.float32)).to(torch.bfloat16)
    return torch.from_numpy(values(rank, rnd, index, count, np.dtype(dtype_name)))


@scenario
def topology_sums(out, args):
    """Every tensor of ``args["tensors"]`` ({name, count, dtype}) in flight at once, for several rounds,
    summed (not averaged), with ``args["compression"]`` (a wire codec's method) if given; local rank 1
    submits them in the reverse order (the native local reduce needs no common order). Returns the
    exact bytes and byteps.metrics()' local strategy."""
    from byteps.compression import WireCompressor

    codec = WireCompressor(args["compression"], min_bytes=0) if args.get("compression") else None
    res = {"sums": {}}
    for rnd in range(args.get("rounds", 2)):
        handles = []
        order = list(enumerate(args["tensors"]))
        for index, spec in reversed(order) if bps.local_rank() == 1 else order:
            t = tensor(bps.rank(), rnd, index, spec["count"], spec["dtype"])
            handles.append((spec["name"], bps.push_pull_async_inplace(t, average=False, name=spec["name"],
                                                                      compression=codec)))
        for name, h in handles:
            res["sums"][f"{name}@{rnd}"] = digest(bps.synchronize(h))
    res["local"] = bps.metrics()["local_strategy"]
    return res


@scenario
def cuda_default_path(out, args):
    """CUDA tensors on the default path (the copy stages and the host's local reduce, so one GPU may serve
    every process): in-place, out-of-place and asynchronous push_pull in turn, each input
    written by a kernel queued on torch's current stream just before the call, and a broadcast. Returns
    the exact bytes, the results' devices and whether the out-of-place inputs were left alone."""
    dev = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    res = {"sums": {}, "devices": [], "inputs_changed": []}
    modes = ("inplace", "outofplace", "async")
    for rnd in range(args.get("rounds", 3)):
        handles = []
        for index, spec in enumerate(args["tensors"]):
            src = tensor(bps.rank(), rnd, index, spec["count"], spec["dtype"])
            t = torch.zeros_like(src, device=dev)
            t.copy_(src.pin_memory(), non_blocking=True)  # queued, not waited for: byteps must order after it
            key, mode = f"{spec['name']}@{rnd}", modes[(index + rnd) % 3]
            if mode == "async":
                handles.append((key, bps.push_pull_async_inplace(t, average=False, name=spec["name"])))
                continue
            if mode == "inplace":
                got = bps.push_pull_inplace(t, average=False, name=spec["name"])
            else:
                got = bps.push_pull(t, average=False, name=spec["name"])
                if not torch.equal(t.cpu(), src):
                    res["inputs_changed"].append(key)
            res["sums"][key] = digest(got.cpu())
            res["devices"].append(str(got.device))
        for key, h in handles:
            got = bps.synchronize(h)
            res["sums"][key] = digest(got.cpu())
            res["devices"].append(str(got.device))
    b = torch.full((1001,), float(bps.rank() + 1), device=dev)
    res["broadcast"] = sorted(set(bps.broadcast(b, root_rank=0, name="cuda.bc").cpu().tolist()))
    res["device"] = str(dev)
    # DistributedOptimizer on a CUDA model: gradients copied off the GPU per partition by the native core
    # (COPYD2H / COPYH2D, core/pipeline/gpu_copier.h), autograd's thread only records an event.
    # loss = sum(W x) over 2 rows of (rank + 1): every gradient entry is 2 (rank + 1), their average n + 1

    model = torch.nn.Sequential(torch.nn.Linear(64, 300, bias=False), torch.nn.Linear(300, 5, bias=False)).to(dev)
    with torch.no_grad():
        model[0].weight.fill_(0.0)
        model[1].weight.fill_(1.0)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    copies = bps.metrics()["native"]["gpu"]["copies"]
    for _ in range(3):
        opt.zero_grad()
        x = torch.full((2, 300), float(bps.rank() + 1), device=dev)
        model[1](x).sum().backward()  # model[0] gets no gradient: the optimizer sends zeros for it
        opt.step()
    res["weights"] = sorted(set(model[1].weight.detach().cpu().reshape(-1).tolist()))
    res["unused"] = sorted(set(model[0].weight.detach().cpu().reshape(-1).tolist()))
    res["copies"] = bps.metrics()["native"]["gpu"]["copies"] - copies
    res["ddp"] = _ddp_hook_on_cuda(out, dev)
    return res


def _ddp_hook_on_cuda(out, dev):
    """DDP over a gloo group on a CUDA model, its buckets averaged by ``bps.ddp_comm_hook``: the used layer
    of cuda_default_path's optimizer part, 3 steps of SGD with lr 1, so that every weight ends at exactly
    1 - 3 (n + 1). Returns the weights and the devices of the buckets the hook got."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{out}/gloo_store", rank=bps.rank(), world_size=bps.size())
    model = torch.nn.Linear(300, 5, bias=False).to(dev)
    with torch.no_grad():
        model.weight.fill_(float(bps.rank()))  # DDP broadcasts rank 0's weights at construction
    ddp = DDP(model, device_ids=[dev.index])
    with torch.no_grad():
        model.weight.fill_(1.0)
    calls = []

    def counting_hook(state, bucket):
        calls.append(str(bucket.buffer().device))
        return bps.ddp_comm_hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):
        opt.zero_grad()
        x = torch.full((2, 300), float(bps.rank() + 1), device=dev)
        ddp(x).sum().backward()
        opt.step()
    res = {"weights": sorted(set(model.weight.detach().cpu().reshape(-1).tolist())),
           "calls": sorted(set(calls)), "hook_calls": len(calls)}
    dist.destroy_process_group()
    return res


@scenario
def topology_declare(out, args):
    """Two push_pulls (their errors, if any) and a broadcast, for jobs whose machines differ."""
    got = {}
    for name in ("x", "y"):
        try:
            got[name] = bps.push_pull(torch.ones(5), average=False, name=name).tolist()
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
    got["broadcast"] = bps.broadcast(torch.full((3,), float(bps.rank() + 1)), root_rank=0, name="bc").tolist()
    return got


@scenario
def topology_cuda(out, args):
    """topology_sums on CUDA tensors (local rank r on cuda:r): the NCCL stages."""
    torch.cuda.set_device(bps.local_rank())
    res = {"sums": {}}
    # each tensor is produced on a side stream behind a long kernel and submitted without synchronizing,
    # as a gradient is from its backward: the NCCL stages must wait for that stream (the plugin records
    # an event on torch's current stream at submission)
    producer = torch.cuda.Stream()
    for rnd in range(args.get("rounds", 2)):
        handles = []
        for index, spec in enumerate(args["tensors"]):
            src = tensor(bps.rank(), rnd, index, spec["count"], spec["dtype"]).pin_memory()
            t = torch.empty_like(src, device="cuda")
            with torch.cuda.stream(producer):
                torch.cuda._sleep(10_000_000)
                t.copy_(src, non_blocking=True)
                handles.append((spec["name"], t, bps.push_pull_async_inplace(t, average=False, name=spec["name"])))
        for name, t, h in handles:
            res["sums"][f"{name}@{rnd}"] = digest(bps.synchronize(h).cpu())
    m = bps.metrics()
    res["nccl_stages"] = m["local_strategy"]["nccl_stages"]
    res["collectives"] = m["native"]["gpu"]["collectives"]
    return res
