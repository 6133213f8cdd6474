"""push_pull against torch.distributed gloo, measured the way users run them.

What it measures
----------------
Every job is started with ``bpslaunch --local`` in the **default environment**: the driver
removes every byteps/ps-lite/OpenMP tuning variable it inherited (``BYTEPS_*``, ``DMLC_*``,
``OMP_*``, ``MKL_NUM_THREADS``, ...; it prints the ones it removed) and sets none; the workers never
call ``torch.set_num_threads``. Whatever bpslaunch itself sets (it defaults ``OMP_NUM_THREADS`` to
cores / processes, as torchrun does) is recorded in the JSON as the children saw it.

Each worker process joins byteps and a gloo process group (the same ranks). For every size and
call pattern, byteps and gloo run in alternating blocks (a barrier before each block; the order
rotates every repetition); a block is several synchronous calls, each timed on its own (every call
waits for its result; the peers are synchronous too). A block's value is the median of its calls,
taken on the slowest rank; the table shows the median over the repetitions and, in brackets, the
spread (min-max of the repetitions' medians). Every result is checked (sum of ``rank + 1``).

* call patterns (the same three for gloo):
  - ``inplace``: the same tensor every call: ``bps.push_pull_inplace(t)`` / ``dist.all_reduce(t)``;
  - ``fresh``: a new tensor every call (``torch.empty`` + ``fill_``, allocated before the timer),
    as ``optimizer.zero_grad()`` gives by default since torch 2.0;
  - ``outofplace``: ``out = bps.push_pull(t)`` / for gloo ``out = t.clone(); dist.all_reduce(out)``
    (gloo has no out-of-place all_reduce, so that is what a gloo user writes);
  - ``batched`` (sizes up to 1 MB only, labelled "batched async"): 20 operations started
    asynchronously, then all awaited; per-operation time = batch time / 20; gloo with
    ``async_op=True``;
* byteps names (``--names``): ``fixed`` passes one ``name=`` per size and pattern (what
  ``DistributedOptimizer`` does); ``auto`` passes none, as a script calling ``bps.push_pull(t)``
  does, and byteps names the call (a new name and key per call in earlier versions, which is
  what the "MB kept per call" column caught);
* all calls sum (``average=False``, gloo's default SUM), or with ``--average`` average, the default
  of ``bps.push_pull`` and Horovod's ``allreduce`` (gloo: ``dist.all_reduce(t)`` then ``t.div_(size)``,
  as a gloo user or DDP averages); goodput = tensor bytes / time per call;
  "byteps / gloo" = gloo's time / byteps' time in the same repetition (> 1: byteps is faster);
* synchronous latency at 4 KB, 64 KB and 1 MB next to a **raw TCP round trip** of the same size,
  measured in the same job between worker ranks 0 and 1 (over loopback; between hosts in ``hosts``) (plain ``socket``,
  TCP_NODELAY, rank 0 sends N bytes, rank 1 echoes N bytes; median of ``--rtts`` round trips,
  measured before and after the collectives), and a **ZeroMQ round trip** of the same size
  (DEALER -> ROUTER echo through pyzmq, one message in flight): the carrier byteps used before
  its direct TCP links (core/transport/bps_link.h);
  and, since the machine's round trip drifts during a job (17-67 us on the 2-core VM), a **round
  trip beside each block**: in every repetition a block of as many raw round trips as a byteps
  block has calls, on the same connection, takes its turn with the byteps and gloo blocks, and
  "byteps / RTT beside" is byteps' block over that one, per repetition, median [min-max]; and, since
  those are measured by the job's own processes (whose training threads may be bound to CPUs), the
  round trip **between two fresh processes bound to nothing** (bench/raw_exchange.py, started by
  the driver before and after the job), the one a user measuring a round trip would get;
* per byteps block: minor page faults per call in the worker (``getrusage``, around each call)
  and in the servers (/proc), and memory each call left behind (RSS growth per call, workers and
  servers). If the job's processes would hold more than ``--mem-budget`` or the machine's available
  memory would fall under ``--mem-floor``, byteps is shut down and re-initialised (which frees what
  it kept) before the block (its first call is then untimed), and if the floor still cannot be kept
  the block is skipped; both are recorded under ``memory_events`` (unnamed calls keep their
  tensors' memory, so they trigger this);
* ``--device cuda``: every tensor (and with ``--train`` the model) on the GPU of local rank r mod the
  GPUs there are, gloo working on the same CUDA tensors; each call is timed until
  ``torch.cuda.synchronize()`` returns;
* layouts: ``local`` = one worker machine with N processes (``bpslaunch --local --workers 1
  --local-size N``); ``hosts`` = N hosts, each a Linux network namespace with one worker process and
  one colocated server (k = 0), started by ``bpslaunch`` in role mode (bench/users_hosts.py), so that
  every byte between workers and servers of different hosts crosses a TCP stack, unshaped and at
  each rate of ``--host-rates`` (tc tbf; needs root; the namespaces are always removed); these two
  are what users run. ``machines`` = N single-process "machines" that are processes of this host
  (``bpslaunch --local --workers N``): every worker reaches every server through **shared memory**
  while gloo goes through loopback TCP, so it is a test layout, not a figure between machines.
  ``--servers`` servers if given, else bpslaunch's default (one per worker machine);
* CPU: per block, the CPU seconds (user + system, every thread) of each worker process over the
  timed calls and of the servers, printed as CPU seconds per GB of tensor reduced; in the hosts
  layout also the whole job's CPU seconds by role (worker, server, scheduler, launcher);

Training step (``--train``): an MLP of large Linear layers (default 4 layers, 1024-2560-2560-2560-
1024, 73.7 MB of float32 parameters; batch 32 per process) trained with ``bps.DistributedOptimizer``
and the default ``optimizer.zero_grad()`` (set_to_none=True), against
``torch.nn.parallel.DistributedDataParallel`` over gloo, in the same processes: same initial
weights (same seed, and ``broadcast_parameters`` as users do), same data per step and rank, SGD.
Blocks of ``--steps`` steps alternate between the two; samples/s = steps x batch x processes /
block time (slowest rank). Losses are compared step by step (``--loss-rtol``) and the final
parameters are compared too. ``--bps-api ddp-hook``: byteps' side is DDP too (over the same gloo
group), its buckets averaged by ``bps.ddp_comm_hook`` instead of gloo. ``--cluster``: the same comparison on an emulated cluster
(bench/netns.py: n worker hosts, each with one worker process and a colocated server, k extra
hosts with a standalone server each, a scheduler host, every link rate-limited to ``--rate-mbit``;
each host's processes started by ``bpslaunch`` in role mode as on real machines). Needs root; the
namespaces are always removed.

Commands
--------
    .venv/bin/python bench/bench_users.py                       # both layouts, 2 and 4 processes, 4KB-64MB
    .venv/bin/python bench/bench_users.py --sizes 4KB,64KB,1MB,16MB,64MB,256MB --repeat 7
    .venv/bin/python bench/bench_users.py --quick               # smoke run (3 sizes, 2 repetitions)
    sudo .venv/bin/python bench/bench_users.py --layouts hosts --procs 2,3   # between hosts, unshaped and 1 Gbit/s
    .venv/bin/python bench/bench_users.py --layouts local --procs 2 --sizes 4KB,1MB --patterns inplace \\
        --names fixed --repeat 1 --quick                         # the tiny config of tests/test_bench_smoke.py
    .venv/bin/python bench/bench_users.py --env BYTEPS_SPIN_US=0 # an A/B with a variable set: printed as such
    python bench/bench_users.py --device cuda --layouts machines --procs 2   # CUDA tensors, on a GPU machine
    .venv/bin/python bench/bench_users.py --train               # training step, one machine (bpslaunch --local)
    .venv/bin/python bench/bench_users.py --train --quick
    sudo .venv/bin/python bench/bench_users.py --cluster        # training step, emulated cluster n=4, k=4, 1 Gbit/s
    sudo .venv/bin/python bench/bench_users.py --cluster --n 2 --k 2 --quick

Output: markdown tables on stdout, JSON in bench/results/users-<mode>-<date>.json (``--json``).
"""
import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from users_common import (LATENCY_SIZES, SIZES, bpslaunch_argv, child_env_info,
                          clean_env, device, free_port, machine_meta, parse_env)
from users_report import NOTES, collectives_tables, summarize_collectives
from users_rtt import fresh_rtt, fresh_rtt_of, raw_rtt, round_trips, rtt_connection, zmq_rtt
from users_train import summarize_train, train_table, train_worker

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
LAYOUTS = ("local", "machines", "hosts")
PATTERNS = ("inplace", "fresh", "outofplace", "batched")
BATCH = 20  #: operations per "batched async" block
BATCH_MAX = 1 << 20  #: batched async only up to this size
# =================================================================================== process statistics

def _proc_stat(pid):
    """(minor faults, RSS bytes, CPU seconds) of a process, from /proc; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
    except OSError:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return int(fields[7]), rss_pages * os.sysconf("SC_PAGE_SIZE"), cpu


def _server_pids():
    """The byteps servers of the job: on hosts, every host's (users_hosts.py names them), else those
    started by this worker's bpslaunch (its siblings)."""
    import psutil

    import users_hosts

    on_hosts = users_hosts.server_pids()
    if on_hosts is not None:
        return on_hosts

    try:
        return [p.pid for p in psutil.Process(os.getppid()).children()
                if "byteps.server" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def _servers_stat(pids):
    """(total minor faults, total RSS, total CPU seconds) of the servers, or None."""
    stats = [s for s in (_proc_stat(p) for p in pids) if s is not None]
    if not stats:
        return None
    return tuple(sum(column) for column in zip(*stats))


def _job_rss():
    """Total RSS of this worker's bpslaunch children (workers, servers, scheduler; shared pages counted
    in every process that maps them, so an over-estimate)."""
    import psutil

    total = 0
    try:
        for p in psutil.Process(os.getppid()).children():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def _self_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# =================================================================================== worker: collectives

def calls_for(nbytes):
    """Synchronous calls per block, by size."""
    if nbytes < (1 << 20):
        return 20
    if nbytes < (16 << 20):
        return 10
    if nbytes < (64 << 20):
        return 5
    if nbytes < (256 << 20):
        return 3
    return 2


class Collectives:
    """One worker's side of the collective benchmark (every rank runs the same sequence)."""

    def __init__(self, args, bps, dist, torch, rtt_conn=None):
        self.args, self.bps, self.dist, self.torch = args, bps, dist, torch
        self.rtt_conn = rtt_conn  # ranks 0 and 1: raw round trips beside each latency block
        self.rank, self.size = bps.rank(), bps.size()
        self.want = float(self.size * (self.size + 1) // 2)
        self.average = args.average
        if self.average:
            self.want /= self.size  # (size + 1) / 2: exact in float32
        self.servers = _server_pids() if self.rank == 0 else []
        self.blocks = {}  # (label, pattern, impl, names) -> {rep: {...}}
        self.device = device(args, torch)
        self.errors = []
        self.memory_events = []

    # ------------------------------------------------------------------ one call

    def _call(self, impl, pattern, t, name):
        bps, dist = self.bps, self.dist
        if impl == "byteps":
            if pattern == "outofplace":
                return bps.push_pull(t, average=self.average, name=name)
            return bps.push_pull_inplace(t, average=self.average, name=name)
        out = t.clone() if pattern == "outofplace" else t
        dist.all_reduce(out)
        if self.average:
            out.div_(self.size)
        return out

    def _check(self, what, out, t_in, pattern):
        ok = float(out[0]) == self.want and float(out[-1]) == self.want
        if pattern == "outofplace":
            ok = ok and float(t_in[0]) == self.rank + 1  # the input is left alone
        if not ok and len(self.errors) < 20:
            self.errors.append(f"rank {self.rank} {what}: got {float(out[0])}..{float(out[-1])}, want {self.want}")

    def block(self, label, pattern, impl, names, base, warm_call):
        """A block of synchronous calls; returns per-rank stats."""
        torch = self.torch
        n = SIZES[label] // 4
        calls = self.args.calls or calls_for(SIZES[label])
        name = f"users.{pattern}.{label}" if names == "fixed" else None
        times, faults, cpu = [], 0, 0.0
        for i in range(calls + (1 if warm_call else 0)):
            if i == (1 if warm_call else 0):  # after the untimed call: memory it set up is not "kept"
                srv0 = _servers_stat(self.servers) if impl == "byteps" else None
                rss0 = _self_rss()
            if pattern == "fresh":
                t = torch.empty(n, device=self.device)
            else:
                t = base
            t.fill_(self.rank + 1)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0 = time.process_time()  # every thread of this process: byteps' and gloo's included
            t0 = time.perf_counter()
            out = self._call(impl, pattern, t, name)
            if self.device.type == "cuda":  # the result is usable once the GPU's queued work is done
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - t0
            c1 = time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self._check(f"{impl} {pattern} {label}", out, t, pattern)
            if warm_call and i == 0:
                continue
            times.append(elapsed)
            faults += f1 - f0
            cpu += c1 - c0
            del out
        rss1 = _self_rss()
        srv1 = _servers_stat(self.servers) if impl == "byteps" else None
        stats = {"median_s": statistics.median(times), "calls": calls, "worker_faults_per_call": faults / calls,
                 "worker_rss_growth_per_call": (rss1 - rss0) / calls, "worker_cpu_per_call": cpu / calls}
        if srv0 and srv1:
            stats["server_faults_per_call"] = (srv1[0] - srv0[0]) / calls
            stats["server_rss_growth_per_call"] = (srv1[1] - srv0[1]) / calls
            stats["server_rss"] = srv1[1]
            stats["server_cpu_per_call"] = (srv1[2] - srv0[2]) / calls
        return stats

    def rtt_block(self, label):
        """A raw TCP round-trip block of ``label``'s size between ranks 0 and 1, as many round trips as a
        byteps block has calls: the round trip at the same moment as the byteps and gloo blocks beside
        it. Rank 0 returns its stats, the other ranks None."""
        if self.rtt_conn is None:
            return None
        times = round_trips(self.rtt_conn, self.rank, SIZES[label], self.args.calls or calls_for(SIZES[label]), warm=2)
        return {"median_s": statistics.median(times), "calls": len(times)} if self.rank == 0 else None

    def batched(self, label, impl, names, tensors):
        """BATCH asynchronous operations, then wait for all; per-operation time."""
        bps, dist = self.bps, self.dist
        for t in tensors:
            t.fill_(self.rank + 1)
        srv0 = _servers_stat(self.servers) if impl == "byteps" else None
        rss0 = _self_rss()
        t0 = time.perf_counter()
        if impl == "byteps":
            hs = [bps.push_pull_async_inplace(t, average=self.average,
                                              name=f"users.batched.{label}.{j}" if names == "fixed" else None)
                  for j, t in enumerate(tensors)]
            for h in hs:
                bps.synchronize(h)
        else:
            works = [dist.all_reduce(t, async_op=True) for t in tensors]
            for w in works:
                w.wait()
            if self.average:
                for t in tensors:
                    t.div_(self.size)
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        rss1 = _self_rss()
        srv1 = _servers_stat(self.servers) if impl == "byteps" else None
        for t in tensors:
            self._check(f"{impl} batched {label}", t, t, "batched")
        stats = {"median_s": elapsed / len(tensors), "calls": len(tensors), "batch_s": elapsed,
                 "worker_rss_growth_per_call": (rss1 - rss0) / len(tensors)}
        if srv0 and srv1:
            stats["server_faults_per_call"] = (srv1[0] - srv0[0]) / len(tensors)
            stats["server_rss_growth_per_call"] = (srv1[1] - srv0[1]) / len(tensors)
            stats["server_rss"] = srv1[1]
        return stats

    # ------------------------------------------------------------------ memory guard

    def _guard(self, label, pattern, names, rep):
        """Collective: 'run', or 'skip' when even a fresh byteps would not leave --mem-floor free."""
        import psutil

        decision = ["run"]
        if self.rank == 0:
            calls = BATCH if pattern == "batched" else (self.args.calls or calls_for(SIZES[label])) + 1
            # what one block may keep if every call leaks (measured with unnamed calls: 2 copies per
            # worker process and 3 on the servers): an over-estimate otherwise
            need = SIZES[label] * calls * (2 * self.size + 3)
            avail = psutil.virtual_memory().available
            job = _job_rss()
            if avail - need < self.args.mem_floor or job + need > self.args.mem_budget:
                decision = ["reset"]
                self.memory_events.append({"size": label, "pattern": pattern, "names": names, "rep": rep,
                                           "available": avail, "job_rss": job, "need": need, "action": "reset"})
        self.dist.broadcast_object_list(decision, src=0)
        if decision[0] == "reset":
            self.bps.shutdown()
            self.bps.init()
            assert self.bps.rank() == self.rank, "rank changed across bps.shutdown()/bps.init()"
            decision = ["run"]
            if self.rank == 0:
                avail = psutil.virtual_memory().available
                self.memory_events[-1]["available_after_reset"] = avail
                if avail - self.memory_events[-1]["need"] < self.args.mem_floor:
                    decision = ["skip"]
                    self.memory_events[-1]["action"] = "reset, then skipped"
            self.dist.broadcast_object_list(decision, src=0)
            return decision[0], True
        return decision[0], False

    # ------------------------------------------------------------------ the sequence

    def run(self):
        args, torch, dist = self.args, self.torch, self.dist
        variants = [("byteps", nm) for nm in args.names.split(",")] + [("gloo", None)]
        warm = 1
        for label in args.sizes.split(","):
            nbytes = SIZES[label]
            for pattern in args.patterns.split(","):
                if pattern == "batched" and nbytes > BATCH_MAX:
                    continue
                base = torch.empty(nbytes // 4, device=self.device)
                batch = ([torch.empty(nbytes // 4, device=self.device) for _ in range(BATCH)]
                         if pattern == "batched" else None)
                paired = pattern != "batched" and label in LATENCY_SIZES and self.size > 1
                here = variants + [("rtt", None)] if paired else variants
                for rep in range(warm + args.repeat):
                    order = here[rep % len(here):] + here[:rep % len(here)]
                    for impl, names in order:
                        reset = False
                        if impl == "byteps":
                            action, reset = self._guard(label, pattern, names, rep)
                            if action == "skip":
                                continue
                        dist.barrier()
                        if impl == "rtt":
                            stats = self.rtt_block(label)
                            if stats is None:
                                continue
                        elif pattern == "batched":
                            stats = self.batched(label, impl, names, batch)
                        else:
                            stats = self.block(label, pattern, impl, names, base, warm_call=reset)
                        if rep >= warm:
                            self.blocks.setdefault((label, pattern, impl, names or ""), {})[rep - warm] = stats
                del base, batch
                if self.rank == 0:
                    print(f"BENCH-PROGRESS {label} {pattern}", flush=True)
        return {"blocks": {"|".join(k): v for k, v in self.blocks.items()}, "errors": self.errors,
                "memory_events": self.memory_events}


def worker_main(args):
    import torch
    import torch.distributed as dist

    import byteps.torch as bps

    bps.init()
    rank, size = bps.rank(), bps.size()
    if args.device == "cuda":
        torch.cuda.set_device(device(args, torch))
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.gloo_port}", rank=rank,
                            world_size=size)
    info = child_env_info() if rank == 0 else None
    if info is not None and args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device(args, torch))
        info["gpus"] = torch.cuda.device_count()
    if args.mode == "train":
        mine = train_worker(args, bps, dist, torch)
    else:
        rtt_labels = [s for s in args.sizes.split(",") if s in LATENCY_SIZES]
        conn = rtt_connection(dist, rank, args.master, args.rtt_port) if size > 1 else None
        rtt = raw_rtt(dist, conn, rank, rtt_labels, args.rtts) if size > 1 else {}
        mine = Collectives(args, bps, dist, torch, rtt_conn=conn).run()
        if size > 1:
            after = raw_rtt(dist, conn, rank, rtt_labels, args.rtts)
            rtt = {k: v + after.get(k, []) for k, v in rtt.items()}
            if conn is not None:
                conn.close()
        mine["rtt"] = {k: statistics.median(v) for k, v in rtt.items()}
        zrtt = zmq_rtt(dist, rank, args.master, rtt_labels, args.rtts) if size > 1 else {}
        mine["zmq_rtt"] = {k: statistics.median(v) for k, v in zrtt.items()}
    import byteps.common as common

    mine["tuning"] = common.tuning()  # the partition size and credit this worker chose at init()
    everyone = [None] * size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": everyone, "child": info, "size": size}, f)
    dist.barrier()
    dist.destroy_process_group()
    bps.shutdown()
    return 0


# =================================================================================== driver: one job

def run_job(layout, procs, args, mode):
    """One ``bpslaunch --local`` job; returns the gathered JSON of its workers."""
    out = tempfile.mktemp(prefix="bench-users-", suffix=".json")
    env, _ = clean_env(parse_env(args.env), quiet=True)
    shape = ["--workers", "1", "--local-size", str(procs)] if layout == "local" else ["--workers", str(procs)]
    servers = [] if args.servers is None else ["--servers", str(args.servers)]
    cmd = [*bpslaunch_argv(), "--local", *shape, *servers, "--no-prefix",
           "--timeout", str(args.job_timeout), "--",
           sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out,
           "--master", "127.0.0.1", "--gloo-port", str(free_port()), "--rtt-port", str(free_port()),
           *worker_args(args)]
    labels = latency_labels(args, procs) if mode == "collectives" else []
    before = fresh_rtt(labels)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        if line.startswith("BENCH-PROGRESS"):
            print(f"  [{layout} {procs}] {line.split(' ', 1)[1].strip()}", file=sys.stderr, flush=True)
            continue
        tail = (tail + [line])[-60:]
    if proc.wait() != 0 or not os.path.exists(out):
        raise SystemExit(f"benchmark job {layout}/{procs} failed (exit {proc.returncode}):\n{''.join(tail)}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    res["log_tail"] = [line.rstrip() for line in tail if line.strip()][-10:]
    res["fresh_rtt"] = fresh_rtt_of(before, fresh_rtt(labels))
    return res


def latency_labels(args, procs):
    """The sizes whose latency is compared with round trips (none in a one-process job)."""
    return [s for s in args.sizes.split(",") if s in LATENCY_SIZES] if procs > 1 else []


def worker_args(args):
    keep = ["device", "sizes", "patterns", "names", "repeat", "calls", "rtts", "mem_floor", "mem_budget", "width",
            "hidden", "layers", "batch", "steps", "lr", "seed", "bps_api"]
    out = ["--average"] if args.average else []
    for k in keep:
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


# =================================================================================== driver: hosts

def run_hosts(n, k, rate_mbit, args, mode):
    """One job on ``n`` worker hosts (one worker and one colocated server each) and ``k`` server hosts,
    network namespaces whose links are unshaped (rate 0) or limited to ``rate_mbit`` (users_hosts.py)."""
    import netns
    import users_hosts

    why = netns.available()
    if why:
        raise SystemExit(f"the hosts layout needs network namespaces: {why}")
    env, _ = clean_env(parse_env(args.env), quiet=True)

    def argv(out, master):
        return ["--worker", "--mode", mode, "--out", out, "--master", master, "--gloo-port",
                str(users_hosts.GLOO_PORT), "--rtt-port", str(users_hosts.RTT_PORT), *worker_args(args)]

    def between_w0_w1(net):  # the fresh-process round trip between the hosts of ranks 0 and 1
        return fresh_rtt(latency_labels(args, n), server_prefix=("ip", "netns", "exec", net.ns["w0"]),
                         bind=net.addr["w0"], client_netns=net.ns["w1"])

    res, cpu, left = users_hosts.run(os.path.abspath(__file__), argv, env, n, k, rate_mbit, args.job_timeout,
                                     bpslaunch_argv(), around=between_w0_w1 if mode == "collectives" else None)
    if res["around"]:
        res["fresh_rtt"] = fresh_rtt_of(*res["around"])
    if left:
        print(f"WARNING: namespaces left behind: {left}", file=sys.stderr)
    res["cpu_by_role"], res["namespaces_left"] = cpu, left
    print(f"  CPU seconds by role over the whole job: "
          f"{', '.join(f'{r} {v:.1f}' for r, v in sorted(cpu.items()))}", file=sys.stderr)
    return res


def hosts_label(rate_mbit):
    return f"hosts {rate_mbit:g}Mbit" if rate_mbit else "hosts"


def each_job(layouts, counts, args, mode):
    """(layout label, processes, job result) of every job of the run: every process count, every layout,
    and in the hosts layout every rate of ``--host-rates``."""
    for procs in counts:
        for layout in layouts:
            if layout != "hosts":
                print(f"job: {mode}, layout {layout}, {procs} processes", file=sys.stderr, flush=True)
                yield layout, procs, run_job(layout, procs, args, mode)
                continue
            for rate in (float(r) for r in args.host_rates.split(",")):
                print(f"job: {mode}, {procs} hosts, {f'{rate:g} Mbit/s' if rate else 'unshaped'}", file=sys.stderr,
                      flush=True)
                yield hosts_label(rate), procs, run_hosts(procs, 0, rate, args, mode)


# =================================================================================== main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="collectives", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rtt-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default="local,machines",
                    help="local, machines and/or hosts (default local,machines; hosts needs root)")
    ap.add_argument("--host-rates", default="0,1000",
                    help="hosts layout: each host's link rate(s), Mbit/s, 0 = unshaped (default 0,1000)")
    ap.add_argument("--procs", default="2,4", help="worker process counts (default 2,4)")
    ap.add_argument("--servers", type=int, default=None,
                    help="servers per job (default: bpslaunch's, one per worker machine)")
    ap.add_argument("--sizes", default="4KB,64KB,1MB,16MB,64MB", help=f"subset of {','.join(SIZES)}")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the tensors live (default cpu); cuda: local rank r on GPU r mod the GPUs there "
                         "are, gloo all-reducing the same CUDA tensors (--train: the model on that GPU, DDP over "
                         "gloo); every call is timed to torch.cuda.synchronize()")
    ap.add_argument("--patterns", default="inplace,fresh,outofplace,batched", help=f"subset of {','.join(PATTERNS)}")
    ap.add_argument("--names", default="fixed,auto", help="byteps naming: fixed (name= per tensor), auto (none)")
    ap.add_argument("--average", action="store_true",
                    help="average (push_pull's default; gloo: all_reduce, then div_) instead of summing")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions of every block (default 5)")
    ap.add_argument("--calls", type=int, default=None, help="calls per block (default by size: 20 ... 2)")
    ap.add_argument("--rtts", type=int, default=200, help="raw TCP round trips per size, twice (default 200)")
    ap.add_argument("--mem-floor", type=float, default=3 * 2**30,
                    help="bytes of the machine's available memory to keep free (default 3 GiB; see memory_events)")
    ap.add_argument("--mem-budget", type=float, default=6 * 2**30,
                    help="bytes (RSS) one job may hold before byteps is re-initialised (default 6 GiB)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4KB,1MB,16MB (unless --sizes), 2 repetitions, "
                                                         "2 processes; --train: small model")
    ap.add_argument("--job-timeout", type=float, default=1800, help="bpslaunch --timeout per job, s")
    ap.add_argument("--json", help="JSON path (default bench/results/users-<mode>-<date>.json)")
    ap.add_argument("--env", action="append", metavar="KEY=VALUE",
                    help="set a variable in every job (repeatable): for a labelled A/B only, printed with the "
                         "results; the default sets nothing")
    tr = ap.add_argument_group("training step (--train, --cluster)")
    tr.add_argument("--train", action="store_true", help="training-step benchmark (bpslaunch --local)")
    tr.add_argument("--width", type=int, default=1024, help="MLP input/output width (default 1024)")
    tr.add_argument("--hidden", type=int, default=2560, help="MLP hidden width (default 2560: 73.7 MB)")
    tr.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    tr.add_argument("--batch", type=int, default=32, help="samples per process per step (default 32)")
    tr.add_argument("--steps", type=int, default=3, help="steps per timed block (default 3)")
    tr.add_argument("--lr", type=float, default=0.01)
    tr.add_argument("--bps-api", choices=["optimizer", "ddp-hook"], default="optimizer",
                    help="byteps' side: bps.DistributedOptimizer (default) or DDP with bps.ddp_comm_hook")
    tr.add_argument("--seed", type=int, default=1234)
    tr.add_argument("--loss-rtol", type=float, default=1e-4, help="largest relative loss difference (default 1e-4)")
    cl = ap.add_argument_group("emulated cluster (--cluster; root)")
    cl.add_argument("--cluster", action="store_true", help="training step on network namespaces (bench/netns.py)")
    cl.add_argument("--n", type=int, default=4, help="worker hosts (default 4)")
    cl.add_argument("--k", type=int, default=4, help="extra server hosts (default 4: k = n)")
    cl.add_argument("--rate-mbit", type=float, default=1000, help="each host's link rate, Mbit/s (default 1000)")
    args = ap.parse_args()

    if args.worker:
        return worker_main(args)

    explicit = set(a.split("=")[0] for a in sys.argv[1:])
    if args.quick:
        if "--sizes" not in explicit:
            args.sizes = "4KB,1MB,16MB"
        if "--repeat" not in explicit:
            args.repeat = 2
        if "--procs" not in explicit:
            args.procs = "2"
        if "--rtts" not in explicit:
            args.rtts = 100
        if "--hidden" not in explicit:
            args.hidden = 1024
        if "--steps" not in explicit:
            args.steps = 2
        if args.cluster and "--n" not in explicit:
            args.n, args.k = 2, 2 if "--k" not in explicit else args.k
    for s in args.sizes.split(","):
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; choose from {','.join(SIZES)}")
    for p in args.patterns.split(","):
        if p not in PATTERNS:
            ap.error(f"unknown pattern {p!r}; choose from {','.join(PATTERNS)}")
    for nm in args.names.split(","):
        if nm not in ("fixed", "auto"):
            ap.error(f"unknown naming {nm!r}; choose fixed and/or auto")
    layouts = args.layouts.split(",")
    for lay in layouts:
        if lay not in LAYOUTS:
            ap.error(f"unknown layout {lay!r}; choose from {','.join(LAYOUTS)}")
    if args.device == "cuda" and ("hosts" in layouts or args.cluster):
        ap.error("--device cuda runs on one machine (not with the hosts layout or --cluster)")
    counts = [int(p) for p in args.procs.split(",")]

    _, stripped = clean_env()
    explicit_env = parse_env(args.env)
    if explicit_env:
        print(f"NOT the default environment: every job gets {explicit_env}", file=sys.stderr)
    mode = "cluster" if args.cluster else "train" if args.train else "collectives"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    meta = dict(machine_meta(), mode=mode, stripped_env=stripped, explicit_env=explicit_env, servers=args.servers,
                args=vars(args))
    started = time.time()
    doc = {"meta": meta}
    if mode == "collectives":
        rows, ratios, latency, children = [], [], [], {}
        for layout, procs, job in each_job(layouts, counts, args, mode):
            r, q, lat = summarize_collectives(layout, procs, job)
            rows += r
            ratios += q
            latency += lat
            children[f"{layout},{procs}"] = dict(job["child"], tuning=job["ranks"][0].get("tuning"))
            errs = [e for rk in job["ranks"] for e in rk["errors"]]
            mem = [e for rk in job["ranks"] for e in rk["memory_events"]]
            doc.setdefault("errors", []).extend(errs)
            doc.setdefault("memory_events", []).extend(dict(e, layout=layout, procs=procs) for e in mem)
            if job.get("cpu_by_role"):
                doc.setdefault("cpu_by_role", {})[f"{layout},{procs}"] = job["cpu_by_role"]
                doc.setdefault("namespaces_left", {})[f"{layout},{procs}"] = job["namespaces_left"]
        doc.update(results=rows, ratios=ratios, latency=latency, child=children)
        main_t, lat_t = collectives_tables(rows, ratios, latency)
        where = "" if args.device == "cpu" else f", CUDA tensors ({children[next(iter(children))].get('gpu')})"
        what = "averages (push_pull's default; gloo: all_reduce + div_)" if args.average else "sums"
        print(f"## push_pull vs gloo all_reduce, synchronous calls, {what}, default environment{where}\n")
        print(main_t)
        print()
        print("## Synchronous latency of one call vs a raw TCP round trip (in the job, and between two fresh processes)\n")
        print(lat_t)
        print()
        print(NOTES)
        if doc.get("memory_events"):
            print(f"\nmemory: byteps re-initialised or skipped {len(doc['memory_events'])} times to keep "
                  f"{args.mem_floor / 2**30:.1f} GiB free (memory_events in the JSON)")
        if doc.get("errors"):
            print(f"\nWRONG RESULTS: {len(doc['errors'])}, e.g. {doc['errors'][:3]}")
    else:
        rows, children = [], {}
        if mode == "train":
            for layout, procs, job in each_job(layouts, counts, args, mode):
                rows.append(summarize_train(layout, procs, job, args))
                children[f"{layout},{procs}"] = job["child"]
        else:
            print(f"job: training on an emulated cluster, n={args.n} worker hosts, k={args.k} server hosts, "
                  f"{args.rate_mbit:g} Mbit/s", file=sys.stderr, flush=True)
            job = run_hosts(args.n, args.k, args.rate_mbit, args, "train")
            rows.append(summarize_train(f"cluster n={args.n} k={args.k} {args.rate_mbit:g}Mbit", args.n, job, args))
            children["cluster"] = job["child"]
            meta["namespaces_left"] = job["namespaces_left"]
        doc.update(results=rows, child=children)
        where = "" if args.device == "cpu" else ", model on the GPU"
        api = "DDP with bps.ddp_comm_hook" if args.bps_api == "ddp-hook" else "bps.DistributedOptimizer"
        print(f"## Training step: {api} vs DDP (gloo), default zero_grad(), default environment{where}\n")
        print(train_table(rows))
        print("\nsamples/s = steps x batch x processes / block time (slowest rank), median over repetitions; "
              "[min-max] = spread; byteps / DDP per repetition.")
    meta["wall_s"] = time.time() - started
    meta["loadavg_end"] = os.getloadavg()
    first = next(iter(children.values()), None) if children else None
    if first:
        layout_vars = ("DMLC_", "BYTEPS_JOB_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE")
        tuned = {k: v for k, v in first["env"].items() if not k.startswith(layout_vars)}
        if explicit_env:
            print(f"\nSET BY --env (not the default environment): {explicit_env}")
        print(f"\nchildren ran with {tuned or 'no thread or tuning variables'} (set by bpslaunch), "
              f"torch threads {first['torch_threads']}; removed from the inherited environment: "
              f"{', '.join(stripped) or 'nothing'}; load average {meta['loadavg'][0]:.1f} -> "
              f"{meta['loadavg_end'][0]:.1f}")
        chose = {job: c["tuning"] for job, c in children.items() if c.get("tuning")}
        if chose:  # what init() probed and agreed: the figures' partition size and credit
            print("autotune chose: " + "; ".join(f"{job}: {t['partition_bytes']} B partitions, credit {t['credit']}"
                                                 f" ({t.get('source', '?')})" for job, t in chose.items()))
    path = args.json or os.path.join(RESULTS, f"users-{mode}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"JSON: {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}")
    failed = bool(doc.get("errors")) or any(not r.get("losses_equal", True) for r in doc["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
