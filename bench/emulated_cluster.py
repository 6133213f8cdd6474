"""Emulated-cluster benchmark: the k/n placement against ring all-reduce and plain PS, the analogue of
the BytePS paper's Fig. 12, on n + k hosts built as network namespaces (bench/netns.py).

    .venv/bin/python bench/emulated_cluster.py                  # n=4 workers, k=0..4, 200 Mbit/s, ResNet-18 sizes
    .venv/bin/python bench/emulated_cluster.py --quick          # n=2, k=0..2, 4 MB: a smoke run (bench/results/)
    .venv/bin/python bench/emulated_cluster.py --ks 2 --systems balanced,hash --reps 5
    .venv/bin/python bench/emulated_cluster.py --shapes 3x1000x96MiB,2x200x46.8MB,4x500x30000001 --systems default
                                           # the defaults against t_opt for every k = 0..n, on three cluster shapes

Partition size and credit are not set: the workers probe their links at init() and agree on them
(byteps/autotune.py), as a user's job does; each job prints the choice and the table's "partition
(credit)" column shows it ("probed", or "set" under ``--partition-bytes`` / ``--credit``).

Needs root. Every host (namespace) has one link of rate B, limited in both directions (tc tbf on
both ends of its veth). Worker machine i runs one worker process and one colocated server; extra
machine j runs one standalone server; the scheduler has a host of its own. For every k it measures
on the same emulated network:

* ``default``: byteps as a user's job runs it, no placement, fusion or partition variable set:
  the gradients of a ``DistributedOptimizer`` (its ``synchronize()`` timed), which tells the engine
  the model's size (fused only where ``BYTEPS_FUSION``'s default says so; today every tensor is its
  own push_pull);
* ``balanced``: byteps, BYTEPS_PLACEMENT=balanced, gradients fused into balanced fusion buffers
  (byteps/fusion.py), each cut over all n + k servers in the Eq. 1-2 proportions;
* ``hash``: byteps, BYTEPS_PLACEMENT=hash, every gradient push_pulled on its own, partitions hashed
  into the n² + kn - 2k slots (the paper's approximation);
* ``plain-ps``: byteps as plain non-colocated PS: servers only on the k extra machines (k >= 1);
* ``gloo``: torch.distributed all_reduce with gloo (ring) on the n worker machines, over DDP-style
  25 MB buckets (once: it cannot use extra machines).

A step is one push_pull (all_reduce) of every tensor of the model; its time is the slowest rank's
(after a barrier); each result is the median over ``--reps`` steps after ``--warmup`` steps. Each
step's sums are checked (every element must equal 1 + 2 + ... + n, or its average). Per-host bytes come from each
host's link counters around the timed steps, divided by the steps, and are compared with the
model's prediction: Eq. 1-2 (``plan``) and the placement the workers really used (``placed``). CPU:
the machine's utilisation (all cores, other users included) and the job's own processes' CPU, in
cores, over the timed steps.

Writes a markdown table to stdout and docs/img/emulated_cluster.md, the plot to
docs/img/emulated_cluster.png and everything to bench/results/emulated_cluster.json.

``--shapes NxRATExMODEL,...`` (n worker hosts, Mbit/s, model bytes with an optional unit: 96MiB,
46.8MB, 30000001) runs every k = 0..n on each cluster shape in turn (its own network) and prints,
per system, time / t_opt for every k and whether all are within ``--target`` (default 1.05); the
JSON goes to bench/results/emulated_cluster_shapes.json and no docs file is written.
"""
import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "emulated_cluster.json")
SCHED_PORT = 9000  #: fixed ports are fine: every address lives in our own namespaces
GLOO_PORT = 29500
BUCKET_BYTES = 25 << 20  #: DDP's default bucket size, for the gloo baseline
SYSTEMS = ("default", "balanced", "hash", "plain-ps", "gloo")
BYTEPS_SYSTEMS = ("default", "balanced", "hash")  #: byteps with servers on every host (vs t_opt)


def resnet18_layers():
    """(name, numel) of ResNet-18's parameters (11.7 M, 46.8 MB in float32), in forward order."""
    layers = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            pre = f"layer{stage}.{block}"
            first_in = cin if block == 0 else cout
            layers += [(f"{pre}.conv1.weight", cout * first_in * 9), (f"{pre}.bn1.weight", cout),
                       (f"{pre}.bn1.bias", cout), (f"{pre}.conv2.weight", cout * cout * 9),
                       (f"{pre}.bn2.weight", cout), (f"{pre}.bn2.bias", cout)]
            if block == 0 and first_in != cout:
                layers += [(f"{pre}.downsample.0.weight", cout * first_in), (f"{pre}.downsample.1.weight", cout),
                           (f"{pre}.downsample.1.bias", cout)]
        cin = cout
    layers += [("fc.weight", 1000 * 512), ("fc.bias", 1000)]
    return layers


def model_layers(model_bytes=None):
    """ResNet-18's layer sizes, scaled to about ``model_bytes`` (float32) when given."""
    layers = resnet18_layers()
    if model_bytes:
        scale = model_bytes / (4 * sum(n for _, n in layers))
        layers = [(name, max(1, round(n * scale))) for name, n in layers]
    return layers


# =================================================================================== worker side

def _marker(rundir, what, rank, barrier):
    """Synchronise with the driver around the timed steps: rank 0 asks, the driver reads the
    counters and answers; a barrier then releases every rank."""
    barrier()
    if rank == 0:
        with open(os.path.join(rundir, f"mark.{what}"), "w") as f:
            f.write(str(time.time()))
        ack = os.path.join(rundir, f"ack.{what}")
        deadline = time.monotonic() + 60
        while not os.path.exists(ack):
            if time.monotonic() > deadline:
                raise SystemExit(f"the driver did not acknowledge {what} within 60 s")
            time.sleep(0.01)
    barrier()


def worker(args):
    import torch

    torch.set_num_threads(1)
    layers = model_layers(args.model_bytes)
    rank, n = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_SIZE"])
    tensors = [torch.empty(numel) for _, numel in layers]
    names = [name for name, _ in layers]
    want = float(n * (n + 1) // 2)
    backward = list(reversed(range(len(layers))))  # gradients become ready last layer first

    if args.system == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{GLOO_PORT}", rank=rank, world_size=n)
        buckets, size = [], 0
        for i in backward:  # DDP-style buckets, pre-flattened (no copy is timed: favours gloo)
            if not buckets or size + tensors[i].numel() * 4 > BUCKET_BYTES:
                buckets.append(0)
                size = 0
            buckets[-1] += tensors[i].numel()
            size += tensors[i].numel() * 4
        flat = [torch.empty(numel) for numel in buckets]
        barrier = dist.barrier

        def step():
            for b in flat:
                b.fill_(rank + 1)
            barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(b, async_op=True) for b in flat]
            for w in works:
                w.wait()
            elapsed = time.perf_counter() - t0
            ok = all(bool((b == want).all()) for b in flat)
            return elapsed, ok
    else:
        import byteps.common as common
        import byteps.torch as bps
        from byteps.core import dtypes
        from byteps.fusion import FusedPushPull

        bps.init()
        assert bps.rank() == rank and bps.size() == n, (bps.rank(), bps.size())
        barrier = bps.barrier
        # "default" fuses exactly when DistributedOptimizer would (BYTEPS_FUSION, default off)
        fuse = args.fuse or (args.system == "default" and common.config().fusion)
        fusion = FusedPushPull("grads") if fuse else None
        views = [t.view(torch.uint8).numpy() for t in tensors]
        optimizer = None
        if fusion is None:
            # unfused gradients go as users' do: DistributedOptimizer's push_pulls (averages), which also
            # tell the engine the model's size (byteps.common.expect_model: its partition size)
            params = [torch.nn.Parameter(t) for t in tensors]
            for p in params:
                p.grad = torch.empty_like(p)
            tensors = [p.grad for p in params]
            optimizer = bps.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=zip(names, params))
            want = float(n + 1) / 2  # the average of 1..n: exact in float32 for these n

        def step():
            for t in tensors:
                t.fill_(rank + 1)
            barrier()
            t0 = time.perf_counter()
            if fusion is not None:
                for i in backward:
                    fusion.add(names[i], views[i], dtypes.FLOAT32)
                fusion.synchronize()
            else:
                optimizer.synchronize()
            elapsed = time.perf_counter() - t0
            ok = all(bool((t == want).all()) for t in tensors)
            return elapsed, ok

    for _ in range(args.warmup):
        step()
    _marker(args.rundir, "start", rank, barrier)
    times, correct = [], True
    for _ in range(args.reps):
        elapsed, ok = step()
        times.append(elapsed)
        correct = correct and ok
    _marker(args.rundir, "end", rank, barrier)
    result = {"rank": rank, "times": times, "correct": correct}
    if args.system != "gloo":
        result["tuning"] = common.tuning()  # the partition size and credit this worker used
        # what carried each server's data: "tcp", "ucx: ..." or "" (ZeroMQ)
        result["links"] = [("" if s["transport"] == "zeromq" else s["transport"]) for s in common.metrics()["servers"]]
    if args.system != "gloo" and rank == 0:
        result["placed"] = _placed_bytes(common, names, tensors, fusion)
    with open(os.path.join(args.rundir, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)
    if args.system == "gloo":
        dist.destroy_process_group()
    else:
        bps.shutdown()


def _placed_bytes(common, names, tensors, fusion):
    """Bytes each server summed per step under the placement the engine really used (its keys)."""
    engine = common._job.engine
    keys = common.metrics()["tensors"]
    if fusion is not None:
        items = [(keys[f"grads.buffer.{b}"], nbytes, 4) for b, (_, nbytes) in enumerate(fusion.layout.buffers)]
    else:  # DistributedOptimizer's names
        items = [(keys[f"Gradient.{name}"], t.numel() * 4, 4) for name, t in zip(names, tensors)]
    # the gradients were first used after the optimizer declared the model: cut to the partition size then
    load = engine.placement.resized(common.metrics()["partition_bytes"]).server_bytes(items)
    return {"server_bytes": load, "server_hosts": [s["host"] for s in engine.book["servers"]],
            "worker_hosts": [w["host"] for w in engine.book["workers"]]}


# =================================================================================== driver side

class JobFailed(RuntimeError):
    pass


def _cpu_snapshot(procs):
    """(machine busy jiffies, machine total jiffies, our processes' CPU seconds)."""
    import psutil

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    ours = 0.0
    for p in procs:
        try:
            t = psutil.Process(p.pid).cpu_times()
            ours += t.user + t.system
        except psutil.Error:
            pass
    return sum(fields) - idle, sum(fields), ours


def run_job(net, system, n, k, args):
    """One job on the emulated network; returns its measurements."""
    from byteps import placement

    rundir = tempfile.mkdtemp(prefix=f"emu-{system}-k{k}-")
    workers = [f"w{i}" for i in range(n)]
    extras = [f"x{j}" for j in range(k)]
    base = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BENCH_SIZE=str(n),
                BYTEPS_JOB_SECRET=secrets.token_hex(16), BYTEPS_JOB_ID=f"emu-{system}-{k}",
                BYTEPS_TIMEOUT=str(args.timeout), BYTEPS_HEARTBEAT_INTERVAL="1", BYTEPS_HEARTBEAT_TIMEOUT="20",
                BYTEPS_PLACEMENT="hash" if system == "hash" else "balanced", BYTEPS_LOG_LEVEL="WARNING",
                DMLC_NUM_WORKER=str(n), DMLC_PS_ROOT_URI=net.addr["sched"], DMLC_PS_ROOT_PORT=str(SCHED_PORT),
                GLOO_SOCKET_IFNAME="eth0")
    base.pop("DMLC_ROLE", None)
    if system == "default":  # what a user's job gets: no byteps variable beyond the job's layout
        base.pop("BYTEPS_PLACEMENT", None)
    # by default the workers choose partition size and credit from the link they probe at start
    # (byteps/autotune.py); --partition-bytes / --credit force them, and the table says so
    for var in ("BYTEPS_PARTITION_BYTES", "BYTEPS_SCHEDULING_CREDIT", "BYTEPS_FUSION"):
        base.pop(var, None)
    if getattr(args, "partition_bytes", None):
        base["BYTEPS_PARTITION_BYTES"] = str(args.partition_bytes)
    if getattr(args, "credit", None) is not None:
        base["BYTEPS_SCHEDULING_CREDIT"] = str(args.credit)
    server_hosts = extras if system == "plain-ps" else workers + extras
    base["DMLC_NUM_SERVER"] = str(len(server_hosts))
    py = sys.executable
    procs = []
    logs = []

    def start(host, tag, argv, extra):
        log = open(os.path.join(rundir, f"{tag}.log"), "wb")
        logs.append((tag, log.name))
        env = dict(base, DMLC_NODE_HOST=net.addr[host], **extra)
        procs.append((tag, net.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)))
        log.close()

    worker_argv = [py, os.path.abspath(__file__), "--worker", "--system", system, "--rundir", rundir,
                   "--reps", str(args.reps), "--warmup", str(args.warmup), "--master", net.addr["w0"],
                   "--model-bytes", str(args.model_bytes or 0)] + (["--fuse"] if system in ("balanced", "plain-ps")
                                                                   else [])
    if system != "gloo":
        start("sched", "scheduler", [py, "-m", "byteps.scheduler"], {"DMLC_ROLE": "scheduler"})
        for i, host in enumerate(server_hosts):
            start(host, f"server{i}", [py, "-m", "byteps.server"], {"DMLC_ROLE": "server"})
    for i, host in enumerate(workers):
        start(host, f"worker{i}", worker_argv, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i), "BENCH_RANK": str(i)})
    only = [p for _, p in procs]
    marks = {}
    trace, stop = [], threading.Event()
    deadline = time.monotonic() + args.timeout + 60

    def fail(why):
        tails = []
        for tag, path in logs:
            with open(path, errors="replace") as f:
                tails.append(f"----- {tag}\n{f.read()[-1500:]}")
        raise JobFailed(f"{system}, k={k}: {why}\n" + "\n".join(tails))

    try:
        for what in ("start", "end"):
            mark = os.path.join(rundir, f"mark.{what}")
            while not os.path.exists(mark):
                bad = [(tag, p.returncode) for tag, p in procs if p.poll() not in (None, 0)]
                if bad:
                    fail(f"processes failed: {bad}")
                if time.monotonic() > deadline:
                    fail(f"no '{what}' mark within {args.timeout + 60} s")
                time.sleep(0.02)
            marks[what] = (net.counters(), _cpu_snapshot(only), time.monotonic())
            open(os.path.join(rundir, f"ack.{what}"), "w").close()
            if what == "start" and args.trace:
                tracer = threading.Thread(target=_trace, args=(net, trace, stop), daemon=True)
                tracer.start()
        stop.set()
        for tag, p in procs:
            try:
                p.wait(max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                fail(f"{tag} did not exit")
            if p.returncode != 0:
                fail(f"{tag} exited with {p.returncode}")
        results = [json.load(open(os.path.join(rundir, f"result.{r}.json"))) for r in range(n)]
    finally:
        for _, p in procs:  # anything still running (on failure) goes now; the network's close() repeats it
            if p.poll() is None:
                p.kill()
                p.wait(5)
    shutil.rmtree(rundir, ignore_errors=True)

    steps = [max(r["times"][i] for r in results) for i in range(args.reps)]
    (c0, cpu0, w0), (c1, cpu1, w1) = marks["start"], marks["end"]
    model = 4 * sum(numel for _, numel in model_layers(args.model_bytes))
    per_step = {h: ((c1[h][0] - c0[h][0]) / args.reps, (c1[h][1] - c0[h][1]) / args.reps)
                for h in workers + extras}
    # what the model predicts for this host per step
    if system == "gloo":
        plan_bytes = {h: 2 * (n - 1) * model / n for h in workers}
        placed = None
    elif system == "plain-ps":
        plan_bytes = {**{h: model for h in workers}, **{h: n * model / k for h in extras}}
    else:
        plan = placement.plan(n, k, model)
        plan_bytes = {h: plan.hosts[i].tx_bytes for i, h in enumerate(workers + extras)}
    if system != "gloo":
        p = results[0]["placed"]
        by_ip = placement.expected_traffic(p["server_bytes"], p["server_hosts"], p["worker_hosts"])
        names = {net.addr[h]: h for h in workers + extras}
        placed = {names[ip]: b for ip, b in by_ip.items()}
    busy = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
    tuned = [r.get("tuning") for r in results if r.get("tuning")]
    if len({t["partition_bytes"] for t in tuned}) > 1:
        raise JobFailed(f"{system}, k={k}: workers used different partition sizes: {tuned}")
    chosen = None
    if tuned:
        chosen = {"partition_bytes": tuned[0]["partition_bytes"], "source": tuned[0]["source"],
                  "credits": [t["credit"] for t in tuned], "text": tuned[0]["text"],
                  "init_probe_s": max(t.get("took_s") or 0 for t in tuned)}
        print(f"{system} k={k}: {tuned[0]['text']}; credits by rank {chosen['credits']}", file=sys.stderr)
    return {"system": system, "n": n, "k": k, "model_bytes": model, "steps_s": steps, "tuning": chosen,
            "time_s": statistics.median(steps), "correct": all(r["correct"] for r in results),
            "bytes_per_step": per_step, "plan_bytes": plan_bytes, "placed_bytes": placed,
            "machine_cpu_util": busy, "job_cpu_cores": (cpu1[2] - cpu0[2]) / (w1 - w0), "trace": trace,
            "links": [r.get("links") for r in results]}


def _trace(net, out, stop, every=0.1):
    """Sample every host's link counters (for --trace: link utilisation over time)."""
    while not stop.is_set():
        out.append((time.monotonic(), net.counters()))
        stop.wait(every)


def evaluate(results, rate_bytes):
    """Add t_opt, gammas and the target checks to every result; return the table rows."""
    from byteps import placement

    gloo = next((r for r in results if r["system"] == "gloo"), None)
    ps = {r["k"]: r for r in results if r["system"] == "plain-ps"}
    for r in results:
        n, k, m = r["n"], r["k"], r["model_bytes"]
        t_opt, t_ar, t_ps = placement.times(n, k, m, rate_bytes)
        ga, gp = placement.gammas(n, k)
        r.update(t_opt_s=t_opt, t_allreduce_s=t_ar, t_plain_ps_s=t_ps, gamma_a=ga, gamma_p=gp)
        r["vs_t_opt"] = r["time_s"] / (t_ar if r["system"] == "gloo" else t_ps if r["system"] == "plain-ps"
                                       else t_opt)
        worst = 0.0
        for h, (tx, rx) in r["bytes_per_step"].items():
            want = r["plan_bytes"].get(h, 0)
            if want:
                worst = max(worst, abs(tx / want - 1), abs(rx / want - 1))
        r["bytes_vs_plan"] = worst
        if r["placed_bytes"]:
            r["bytes_vs_placed"] = max(max(abs(tx / r["placed_bytes"][h] - 1), abs(rx / r["placed_bytes"][h] - 1))
                                       for h, (tx, rx) in r["bytes_per_step"].items() if r["placed_bytes"].get(h))
        if r["system"] in BYTEPS_SYSTEMS:
            r["speedup_vs_gloo"] = gloo["time_s"] / r["time_s"] if gloo else None
            r["speedup_vs_ps"] = ps[k]["time_s"] / r["time_s"] if k in ps else None
    return results


def _chosen(t):
    """The table's partition column: size (credits), and whether a variable forced it."""
    if not t:
        return "—"
    credits = sorted(set(t["credits"]))
    size = t["partition_bytes"]
    text = f"{size >> 10} KiB" if size % 1024 == 0 else f"{size} B"
    forced = " set" if t["source"] == "env" else " probed" if t["source"] == "probe" else f" {t['source']}"
    return f"{text}{forced} ({'/'.join(map(str, credits))})"


def table(results):
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)
    lines = ["| system | k | partition (credit) | time s | t_opt s | time / model | goodput MB/s | vs gloo (≥ 0.9 γa) | "
             "vs plain PS (≥ 0.9 γp) | bytes vs model | exact | machine CPU | job CPU cores |",
             "|---|---:|---|---:|---:|---:|---:|---|---|---:|---|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["k"], SYSTEMS.index(r["system"]))):
        ref = r["t_allreduce_s"] if r["system"] == "gloo" else r["t_plain_ps_s"] if r["system"] == "plain-ps" \
            else r["t_opt_s"]
        vs_g = vs_p = "—"
        if r.get("speedup_vs_gloo"):
            vs_g = f"{r['speedup_vs_gloo']:.2f} ({0.9 * r['gamma_a']:.2f})"
        if r.get("speedup_vs_ps"):
            vs_p = f"{r['speedup_vs_ps']:.2f} ({0.9 * r['gamma_p']:.2f})"
        lines.append(f"| {r['system']} | {r['k']} | {_chosen(r.get('tuning'))} | {r['time_s']:.3f} | {f(ref, '.3f')} | {r['vs_t_opt']:.3f} | "
                     f"{r['model_bytes'] / r['time_s'] / 1e6:.1f} | {vs_g} | {vs_p} | "
                     f"{100 * r['bytes_vs_plan']:+.1f}% | {'yes' if r['correct'] else 'NO'} | "
                     f"{100 * r['machine_cpu_util']:.0f}% | {r['job_cpu_cores']:.2f} |")
    return "\n".join(lines)


def plot(results, path, n, rate_mbit, model_bytes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from byteps import placement

    ks = sorted({r["k"] for r in results})
    fig, ax = plt.subplots(figsize=(8, 5))
    fine = [x / 10 for x in range(0, 10 * max(ks) + 1)]
    rate = rate_mbit * 1e6 / 8
    ax.plot(fine, [placement.times(n, x, model_bytes, rate)[0] if x <= n else None for x in fine], "k--",
            label="t_opt (Eq. 6)")
    styles = {"default": "-D", "balanced": "-o", "hash": "-s", "plain-ps": "-^"}
    for system, style in styles.items():
        pts = sorted((r["k"], r["time_s"]) for r in results if r["system"] == system)
        if pts:
            ax.plot(*zip(*pts), style, label={"default": "byteps, default settings",
                                              "balanced": "byteps, balanced + fusion",
                                              "hash": "byteps, hash (paper)",
                                              "plain-ps": "plain PS (servers on the k extra machines)"}[system])
    gloo = [r for r in results if r["system"] == "gloo"]
    if gloo:
        ax.axhline(gloo[0]["time_s"], color="gray", linestyle=":", label="gloo ring all_reduce")
    ax.set_xlabel(f"k (extra machines), n = {n} worker machines")
    ax.set_ylabel(f"time per push_pull of {model_bytes / 1e6:.1f} MB (s)")
    ax.set_xticks(ks)
    top = max(r["time_s"] for r in results)
    ax.set_ylim(0, min(top * 1.1, 3 * max(r["t_opt_s"] for r in results)))
    ax.set_title(f"Emulated cluster: {n} + k hosts, {rate_mbit:g} Mbit/s per host (cf. BytePS Fig. 12)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--rundir", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--fuse", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=4, help="worker machines (default 4)")
    ap.add_argument("--ks", default="0,1,2,3,4", help="extra machine counts (default 0,1,2,3,4)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--rate-mbit", type=float, default=200, help="per-host link rate B, Mbit/s (default 200)")
    ap.add_argument("--model-bytes", type=parse_bytes, default=0,
                    help="scale ResNet-18's layer sizes to this many bytes (default: as is, 46.8 MB)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per result (median; default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2; fusion's first step "
                                                          "is unfused)")
    ap.add_argument("--partition-bytes", type=int, default=None,
                    help="force BYTEPS_PARTITION_BYTES (and so the fusion buffer size); default: unset, the "
                         "workers choose it from the link they probe at start (byteps/autotune.py)")
    ap.add_argument("--credit", type=int, default=None,
                    help="force BYTEPS_SCHEDULING_CREDIT; default: unset, chosen at start like the partition size")
    ap.add_argument("--timeout", type=float, default=180, help="BYTEPS_TIMEOUT and per-job limit, s")
    ap.add_argument("--trace", action="store_true", help="sample link counters every 0.1 s into the JSON")
    ap.add_argument("--quick", action="store_true", help="n=2, k=0..2, 4 MB model, 1 step: a smoke run")
    ap.add_argument("--shapes", help="NxRATExMODEL,...: every k = 0..n on each cluster shape (see above)")
    ap.add_argument("--target", type=float, default=1.05, help="--shapes: largest time / t_opt (default 1.05)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "emulated_cluster.png"))
    ap.add_argument("--table", default=os.path.join(ROOT, "docs", "img", "emulated_cluster.md"))
    args = ap.parse_args()
    if args.worker:
        args.model_bytes = args.model_bytes or None
        return worker(args)
    if args.quick:
        args.n, args.ks, args.model_bytes, args.reps, args.warmup = 2, "0,1,2", 4_000_000, 1, 2
        quick = os.path.join(ROOT, "bench", "results", "emulated_cluster_quick")  # never over the docs' figures
        args.out, args.plot, args.table = quick + ".json", quick + ".png", quick + ".md"

    import netns

    why = netns.available()
    if why:
        print(f"emulated cluster unavailable: {why}", file=sys.stderr)
        return 2
    systems = args.systems.split(",")
    if args.shapes:
        return run_shapes(args, systems)
    n, ks = args.n, [int(k) for k in args.ks.split(",")]
    started = time.time()
    results = run_shape(n, ks, args.rate_mbit, args.model_bytes, systems, args)
    text = table(results)
    print(text)
    model = results[0]["model_bytes"]
    meta = {"n": n, "ks": ks, "rate_mbit": args.rate_mbit, "model_bytes": model, "reps": args.reps,
            "warmup": args.warmup, "partition_bytes": args.partition_bytes, "credit": args.credit,
            "command": " ".join(sys.argv), "wall_s": time.time() - started, "cpus": os.cpu_count(),
            "kernel": os.uname().release}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    os.makedirs(os.path.dirname(args.plot), exist_ok=True)
    with open(args.table, "w") as f:
        f.write(text + "\n")
    plot(results, args.plot, n, args.rate_mbit, model)
    print(f"\n{len(results)} results in {meta['wall_s']:.0f} s; results {args.out}, plot {args.plot}")
    return 0


def run_shape(n, ks, rate_mbit, model_bytes, systems, args):
    """Every (system, k) job on one network of n worker hosts, max(ks) extra hosts and a scheduler
    host at ``rate_mbit``; the evaluated results (gloo's, measured once, repeated for every k)."""
    import netns

    args.model_bytes = model_bytes  # the jobs' workers read it from args
    jobs = [("gloo", 0)] if "gloo" in systems else []
    jobs += [(s, k) for k in ks for s in SYSTEMS[:-1] if s in systems and not (s == "plain-ps" and k == 0)]
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    hosts = [f"w{i}" for i in range(n)] + [f"x{j}" for j in range(max(ks))] + ["sched"]
    results = []
    with netns.Network(hosts, rate_mbit=rate_mbit) as net:
        bar = tqdm(total=len(jobs), desc=f"emulated cluster n={n} {rate_mbit:g} Mbit/s") if tqdm else None
        for system, k in jobs:
            if bar:
                bar.set_postfix_str(f"{system} k={k}")
            results.append(run_job(net, system, n, k, args))
            if bar:
                bar.update(1)
            else:
                print(f"done: {system} k={k}: {results[-1]['time_s']:.3f} s", file=sys.stderr)
        if bar:
            bar.close()
    if "gloo" in systems:  # gloo uses only the worker machines: the same result for every k
        g = results[0]
        for k in ks[1:]:
            results.append(dict(g, k=k, measured_at_k=0))
    return evaluate(results, rate_mbit * 1e6 / 8)


def parse_bytes(text):
    """'96MiB', '46.8MB', '4KB' or a plain count of bytes, as an int."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * scale)
    return int(t)


def parse_shapes(text):
    """'3x1000x96MiB,2x200x46.8MB' -> [(n, rate_mbit, model_bytes), ...]."""
    shapes = []
    for spec in text.split(","):
        parts = spec.strip().lower().split("x", 2)
        if len(parts) != 3:
            raise SystemExit(f"--shapes wants NxRATExMODEL (e.g. 3x1000x96MiB), got {spec!r}")
        shapes.append((int(parts[0]), float(parts[1]), parse_bytes(parts[2])))
    return shapes


def run_shapes(args, systems):
    """--shapes: every k = 0..n on each cluster shape; time / t_opt per system and k, against --target."""
    started, everything, lines = time.time(), [], []
    for n, rate, model in parse_shapes(args.shapes):
        results = run_shape(n, list(range(n + 1)), rate, model, systems, args)
        everything += [dict(r, rate_mbit=rate) for r in results]
        print(f"\n### n = {n}, {rate:g} Mbit/s, {model} bytes\n\n{table(results)}", flush=True)
        for system in (s for s in BYTEPS_SYSTEMS if s in systems):
            got = sorted((r["k"], r["vs_t_opt"]) for r in results if r["system"] == system)
            ok = all(v <= args.target for _, v in got)
            lines.append(f"| {n} | {rate:g} | {model} | {system} | " + ", ".join(f"{k}: {v:.3f}" for k, v in got)
                         + f" | {'yes' if ok else 'NO'} |")
    print(f"\n## time / t_opt for every k (target {args.target:g})\n")
    print("| n | Mbit/s | model bytes | system | k: time / t_opt | all within target |\n|---:|---:|---:|---|---|---|")
    print("\n".join(lines))
    out = os.path.join(ROOT, "bench", "results", "emulated_cluster_shapes.json") if args.out == DEFAULT_OUT \
        else args.out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": {"shapes": args.shapes, "target": args.target, "reps": args.reps, "warmup": args.warmup,
                            "command": " ".join(sys.argv), "wall_s": time.time() - started,
                            "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                   "results": everything}, f, indent=1)
    print(f"\nJSON: {out}")
    return 0 if all(line.endswith("| yes |") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
