"""Wire-compression scenarios for tests/test_compression_jobs.py (run by tests/scenarios.py).

Each returns raw data (result digests, tensor keys, partition layouts, transport byte counts,
losses, error texts); the test rebuilds every rank's input with :func:`make_input` and computes
the expected result itself.
"""
import sys

import numpy as np


def scenario(fn):
    """Register ``fn`` with the runner if it is running (the test imports this file for make_input only)."""
    runner = sys.modules.get("scenarios")
    return runner.scenario(fn) if runner is not None else fn


def make_input(rank, case, rnd):
    """Rank ``rank``'s float tensor of ``case`` in round ``rnd`` (a numpy array).

    kind "int": small integers (exact in fp16 and in any sum of a few of them); "rand": normal
    floats with a few larger ones, so top-k has clear winners.
    """
    g = np.random.default_rng([rank, rnd, case.get("salt", 0), 77])
    dtype = np.dtype(case.get("dtype", "float32"))
    n = case["numel"]
    if case.get("kind", "rand") == "int":
        return g.integers(-8, 9, size=n).astype(dtype)
    return (g.standard_normal(n) * (1 + 9 * (g.random(n) < 0.01))).astype(dtype)


def _engine():
    from byteps.common import _job

    return _job.engine


def _layout(name):
    """(tensor key, [(partition index, byte offset, byte length, server index)]) of a declared tensor."""
    engine = _engine()
    tkey = next(k for (n, _), k in engine._keys.items() if n == name)
    return tkey, engine


@scenario
def compression_sums(out, args):
    """push_pull every case for some rounds with its wire compressor; report results and layouts."""
    import torch

    import byteps.torch as bps
    from byteps import common
    from byteps.compression import WireCompressor

    from scenarios import digest

    res = {}
    for case in args["cases"]:
        method = case.get("method")
        codec = False if method is None else WireCompressor(method, **{"min_bytes": 0, **case.get("opts", {})})
        before, metrics_before = common.transport_bytes(), _moved(common.metrics())
        digests = []
        for rnd in range(case.get("rounds", 1)):
            t = torch.from_numpy(make_input(bps.rank(), case, rnd))
            bps.push_pull_inplace(t, average=False, name=case["name"], compression=codec)
            digests.append(digest(t))
        after, metrics_after = common.transport_bytes(), _moved(common.metrics())
        tkey, engine = _layout(case["name"])
        itemsize = np.dtype(case.get("dtype", "float32")).itemsize
        parts = engine.placement.partitions(tkey, case["numel"] * itemsize, itemsize)
        res[case["name"]] = {
            "digests": digests, "tkey": tkey,
            "parts": sorted([int(i), int(off), int(length), int(server)] for i, off, length, server in parts),
            "sent": sum(after["sent"].values()) - sum(before["sent"].values()),
            "received": sum(after["received"].values()) - sum(before["received"].values()),
            "server_node_ids": [s["node_id"] for s in engine.book["servers"]],
            # partitions the native core pushed, and those it encoded (byteps.metrics())
            "pushed": metrics_after[0] - metrics_before[0],
            "compressed_pushes": metrics_after[1] - metrics_before[1],
        }
    return res


@scenario
def compression_join(out, args):
    """Every case push_pulled for ``rounds`` rounds (round by round, case by case) by every rank but
    ``joiner``, which runs only the first ``joiner_rounds`` and then calls join(): from then on it
    reduces its local peers' copies of the partitions it owns and pushes them, encoded, for them.
    A case without "method" uses the job's BYTEPS_COMPRESSOR. Every rank joins at the end. Digests,
    layouts (of the tensors this rank declared) and the joiner's pushes."""
    import torch

    import byteps.torch as bps
    from byteps import common
    from byteps.compression import WireCompressor

    from scenarios import digest

    r = bps.rank()
    rounds = args["rounds"] if r != args["joiner"] else args["joiner_rounds"]
    res = {case["name"]: {"digests": []} for case in args["cases"]}
    for rnd in range(rounds):
        for case in args["cases"]:
            codec = WireCompressor(case["method"], **{"min_bytes": 0, **case.get("opts", {})}) \
                if "method" in case else None
            t = torch.from_numpy(make_input(r, case, rnd))
            bps.push_pull_inplace(t, average=False, name=case["name"], compression=codec)
            res[case["name"]]["digests"].append(digest(t))
    pushed_before = _moved(common.metrics())
    last = bps.join()
    pushed_after = _moved(common.metrics())
    for case in args["cases"]:
        if not res[case["name"]]["digests"]:  # never pushed here: not declared
            continue
        tkey, engine = _layout(case["name"])
        parts = engine.placement.partitions(tkey, case["numel"] * 4, 4)
        res[case["name"]].update(tkey=tkey, server_node_ids=[s["node_id"] for s in engine.book["servers"]],
                                 parts=sorted([int(i), int(off), int(length), int(server)]
                                              for i, off, length, server in parts))
    # the partitions this process pushed while in join() (for its peers), and of them those it encoded
    res["in_join"] = {"pushed": pushed_after[0] - pushed_before[0],
                      "compressed_pushes": pushed_after[1] - pushed_before[1], "last": last}
    return res


def _moved(metrics):
    """(partitions the native core pushed, of them those it pushed compressed) so far."""
    return metrics["native"]["stages"].get("push", 0), metrics["native"]["compressed_pushes"]


def _train(bps, torch, compression, steps, lr, seed=7):
    """A small regression MLP trained with DistributedOptimizer; returns every step's global loss."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    g = torch.Generator().manual_seed(123)
    teacher = torch.randn(32, 1, generator=g) / 32 ** 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt = bps.DistributedOptimizer(opt, named_parameters=[(f"{compression[0]}.{n}", p)
                                                          for n, p in model.named_parameters()],
                                   compression=compression[1])
    losses = []
    for step in range(steps):
        gb = torch.Generator().manual_seed(10000 * step + bps.rank())
        x = torch.randn(64, 32, generator=gb)
        y = torch.tanh(2 * x @ teacher) + 0.01 * torch.randn(64, 1, generator=gb)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        total = bps.push_pull(loss.detach().reshape(1), average=True, name=f"{compression[0]}.loss",
                              compression=False)
        losses.append(float(total))
    return losses


@scenario
def compression_training(out, args):
    """The same training without compression and with onebit + error feedback; report losses."""
    import torch

    import byteps.torch as bps

    torch.set_num_threads(1)
    runs = {"none": bps.Compression.none,
            "onebit_ef": bps.Compression.onebit(error_feedback=True, min_bytes=0),
            "onebit": bps.Compression.onebit(min_bytes=0)}
    return {name: _train(bps, torch, (name, comp), args["steps"], args.get("lr", 0.1)) for name, comp in runs.items()
            if name in args.get("runs", runs)}


@scenario
def compression_mismatch(out, args):
    """Rank 0 compresses with onebit, rank 1 does not (then topk seeds); both must get an error
    naming the ranks and methods; a matching push_pull afterwards still works."""
    import torch

    import byteps.torch as bps
    from scenarios import error_text

    r = bps.rank()
    got = {}
    t = torch.ones(4096)
    codec = bps.Compression.onebit(min_bytes=0) if r == 0 else False
    got["method"] = error_text(lambda: bps.push_pull_inplace(t, average=False, name="m", compression=codec))
    codec = bps.Compression.randomk(min_bytes=0, k=16, seed=r)
    got["seed"] = error_text(lambda: bps.push_pull_inplace(torch.ones(4096), average=False, name="s",
                                                           compression=codec))
    y = torch.full((4096,), float(r + 1))
    bps.push_pull_inplace(y, average=False, name="after", compression=bps.Compression.wire("fp16", min_bytes=0))
    got["after"] = sorted(set(y.tolist()))
    return got


@scenario
def compression_env(out, args):
    """BYTEPS_COMPRESSOR & co. (set by the test): the job-wide default applies to push_pulls that
    pass no compression, and compression=False turns it off for one call."""
    import torch

    import byteps.torch as bps
    from byteps import common

    from scenarios import digest

    got = {}
    for name, comp in (("default", None), ("off", False)):
        before = sum(common.transport_bytes()["sent"].values())
        t = torch.from_numpy(make_input(bps.rank(), {"numel": 1 << 16, "kind": "int"}, 0))
        bps.push_pull_inplace(t, average=False, name=name, compression=comp)
        got[name] = {"digest": digest(t), "sent": sum(common.transport_bytes()["sent"].values()) - before}
    # Horovod's allreduce takes a wire compressor too (an explicit one overrides the default)
    before = sum(common.transport_bytes()["sent"].values())
    t = torch.from_numpy(make_input(bps.rank(), {"numel": 1 << 16, "kind": "int"}, 0))
    out = bps.allreduce(t, op=bps.Sum, name="hvd", compression=bps.Compression.onebit)
    got["hvd"] = {"sent": sum(common.transport_bytes()["sent"].values()) - before,
                  "values": sorted(set(out.abs().tolist()))}
    small = torch.ones(100)  # below BYTEPS_MIN_COMPRESS_BYTES: raw
    before = sum(common.transport_bytes()["sent"].values())
    bps.push_pull_inplace(small, average=False, name="small")
    got["small_sent"] = sum(common.transport_bytes()["sent"].values()) - before
    return got


@scenario
def compression_tf(out, args):
    """byteps.tensorflow: push_pull and DistributedGradientTape with a wire compressor."""
    import tensorflow as tf

    import byteps.tensorflow as bps
    from byteps import common

    r = bps.rank()
    got = {}
    x = tf.constant(make_input(r, {"numel": 20000, "kind": "int"}, 0))
    before = sum(common.transport_bytes()["sent"].values())
    y = bps.push_pull(x, op=bps.Sum, name="tf.fp16", compression=bps.Compression.wire("fp16", min_bytes=0))
    got["fp16_sum"] = y.numpy().tolist()
    got["fp16_sent"] = sum(common.transport_bytes()["sent"].values()) - before
    before = sum(common.transport_bytes()["sent"].values())
    y = bps.push_pull(x, op=bps.Sum, name="tf.raw")
    got["raw_sent"] = sum(common.transport_bytes()["sent"].values()) - before
    w = tf.Variable(tf.ones((200, 100)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(r + 1))
    tape = bps.DistributedGradientTape(tape, compression=bps.Compression.randomk(k=0.1, min_bytes=0))
    (grad,) = tape.gradient(loss, [w])
    g = grad.numpy().ravel()
    got["tape_nonzero"] = int(np.count_nonzero(g))
    got["tape_values"] = sorted(set(g[g != 0].tolist()))
    return got
