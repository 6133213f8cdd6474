"""Partition size and scheduling credit from the job's link, measured at start instead of assumed.

A push_pull cuts each tensor into partitions of ``partition_bytes`` and keeps at most ``credit`` of
them on the network at once (core/_pipeline.pyx). Both used to be constants (4,096,000 bytes and
4), which suit fast links only: on the emulated cluster (docs/benchmarks.md, "Emulated cluster",
200 Mbit/s, n = 4, k = 2) a step took 1.36x the optimum with 4 MB partitions and 1.07x with 256
or 512 KB. :func:`choose` derives both from a small model; :func:`probe` measures the two inputs it
needs from one server with ``PROBE`` echoes (core/wire.py; the server answers in
summation/server.py ``_on_probe``); :func:`resolve` lets ``BYTEPS_PARTITION_BYTES`` and
``BYTEPS_SCHEDULING_CREDIT`` override either choice.

At ``init()`` the engine (core/engine.py ``Engine._tune``) probes one server on another host, proposes
the size its link calls for (:func:`propose`), and agrees with the other workers through the
scheduler (:func:`agree`: the median proposal, or BYTEPS_PARTITION_BYTES where set), so the whole
job uses one partition size; each worker keeps its own credit. ``byteps.common.tuning()`` returns
the result, which every worker also logs at INFO. ``BYTEPS_TEST_LINK=bytes_per_s,rtt_s`` (a test
hook, not a setting) replaces a worker's probe with that link.

The model (every constant is a module attribute, so tests and benchmarks can vary it):

* **Link.** ``B`` is the rate at which a worker moves partition bytes over its NIC. Bytes for a
  server on the worker's own machine (``colocated_fraction``) go through shared memory and take
  no NIC time, so ``B_eff = B / (1 - colocated_fraction)`` (at most ``LOCAL_BPS``); in a job
  whose servers are all local, ``B`` is what the probe measured to them.
* **Fixed cost: a lower bound.** Each partition is cut into one piece per server
  (``BYTEPS_PLACEMENT=balanced``), and each piece costs the worker about ``piece_cost`` of CPU
  whatever its size (30 us with the Python engine, about 5 us with the native core;
  docs/benchmarks.md, "Per-partition overhead"). For that to stay under ``OVERHEAD`` (5%) of the
  partition's time on the wire::

      P_min = pieces * piece_cost * B_eff / OVERHEAD

  More servers mean more pieces per partition, so a larger lower bound.
* **Pipeline fill and drain: an upper bound.** A server answers a piece only when every machine
  has pushed it, so each step pays a fill and a drain of about ``FILL_DRAIN`` partitions' time on
  the wire (fitted to the measurements: 1.07x t_opt at 512 KB, 1.15x at 1 MB and 1.36x at 4 MB
  for 46.8 MB per step at 200 Mbit/s, and 1.13x at 4 MB for 96 MiB at 1 Gbit/s: the
  excess is about 3.4 P / M whatever the rate). For that to stay under ``FILL_SHARE`` of a step
  that pushes M bytes (half the 5% the defaults aim for: fixed costs and the placement's balance
  take the rest), and for a partition to hold the wire at most ``GRANULARITY_S`` (an urgent
  tensor waits behind the credit's partitions; priority scheduling needs them short)::

      P_max = min(FILL_SHARE * M / FILL_DRAIN, GRANULARITY_S * B_eff)

  M is ``model_bytes`` when the caller knows it, else ``DEFAULT_MODEL_BYTES`` (about 570 MB: the
  model whose fill-and-drain bound is BytePS's 4 MB partitions, which fast links then get).
  ``init()`` cannot know M; the optimizers can. ``DistributedOptimizer`` (and the DDP wrapper)
  tell the engine the bytes of the gradients they push, and every worker
  recomputes the agreed choice from the same proposals with that M, so tensors first used after
  that are cut to the model's size (a 30 MB model at 500 Mbit/s: 128 KB instead of 512 KB).
* **Cut bound: balance.** ``balanced`` placement cuts a partition over the servers only when its
  smallest piece (the server with the smallest share) is at least ``MIN_PIECE`` (4 KB,
  byteps/placement.py); a smaller partition goes whole to one hashed server and the k/n balance
  that makes a step take t_opt is lost. So ``P >= min_cut = MIN_PIECE / (smallest share)``,
  rounded up to a power of two. Measured on the emulated cluster (n = 4, k = 3, 200 Mbit/s, where
  the colocated servers' share is 1/22 and min_cut was 352 KB with 16 KB pieces): 256 KB partitions
  went whole and took 2.21x t_opt (bytes 16% off Eq. 1-2), like ``hash``; 512 KB ones are cut.
* **The choice.** ``P = max(P_min, P_max)``: the largest partition the upper bound allows, or the
  fixed-cost bound when it is larger (throughput first). The upper bound is rounded down to a
  power of two at most ``OVERHEAD`` above it (the nearest one could exceed it by up to 41%: at 1 Gbit/s, n = 3, the 10 ms bound of
  1.9 MB became 2 MB partitions, and 96 MiB steps took 1.16-1.20x t_opt against 1.11-1.15x with 1 MB
  in three alternating pairs on the emulated cluster, docs/benchmarks.md); the fixed-cost bound is
  rounded to the nearest power of two. Both stay in
  ``[MIN_PARTITION, MAX_PARTITION]``, so workers whose measurements differ a little still tend to
  agree (the engine must use one value for the whole job).
* **Credit.** One partition's round trip is about ``rtt + 2P/B``; to keep the link busy the window
  must hold ``B * rtt + 2P`` bytes, plus two partitions for skew between workers::

      credit = clamp(MIN_CREDIT + round(B * rtt / P), MIN_CREDIT, MAX_CREDIT)

  On a LAN the bandwidth-delay product is far below one partition and the credit stays 4; a long
  link gets more. More is not free: the window W = credit x P is what the pushes run ahead of the
  replies, so a step of pure communication ends about W/B late (emulated cluster, k = 2, 200
  Mbit/s: W = 1 MB 1.059x t_opt, 4 MB 1.167x, 16 MB 1.28x; earlier 512 KB x 16 1.22x, x 64 1.33x).
  A training step, where workers' gradients arrive skewed and priorities preempt, once needed
  16-32 MB (1 Gbit/s) because less urgent bytes held the urgent tensor's credit; the queue now
  counts only bytes of the same or a more urgent priority (core/pipeline/bps_queue.h), and 2 MB x 4 reaches
  1.23x DDP-gloo (bench_users.py --cluster).

``bpslaunch --plan --bandwidth 1Gbit --latency 200us`` prints the choice for a job shape.
"""
import dataclasses
import math
import os
import time
import typing

from .placement import MIN_PIECE, at_least_cut

#: CPU a worker spends per partition piece with the Python engine (seconds; docs/benchmarks.md)
PIECE_COST_PYTHON = 30e-6
#: the same with the native core
PIECE_COST_NATIVE = 5e-6
#: fixed costs may take at most this fraction of the wire time
OVERHEAD = 0.05
#: the pipeline's fill and drain may take at most this fraction of a step
FILL_SHARE = 0.025
#: longest time one partition should hold the wire (seconds)
GRANULARITY_S = 0.010
#: partitions' wire time a step pays to fill and drain the pipeline (fitted; see above)
FILL_DRAIN = 3.4
#: bytes a step pushes, when the caller cannot say: the model whose fill-and-drain bound is BytePS's
#: 4 MB partitions (about 570 MB)
DEFAULT_MODEL_BYTES = int((4 << 20) * FILL_DRAIN / FILL_SHARE)
MIN_CREDIT = 4
MAX_CREDIT = 64
MIN_PARTITION = 64 << 10
MAX_PARTITION = 64 << 20
#: bytes/s through shared memory to a colocated server (a copy and a sum: a few GB/s)
LOCAL_BPS = 4e9
#: a probe that reads a link faster than this (800 Gbit/s, beyond any NIC and any copy through
#: loopback) measured its own process's delays, not the link: its fastest 1 MiB echo came back about
#: as fast as its fastest small one (on the 2-core VM, one of 4 workers starting next to 4 servers
#: once proposed 64 MB partitions and took credit 64 from such a probe)
MAX_PROBE_BPS = 100e9
#: rounds of echoes a probe may take before it gives up on such readings
PROBE_ATTEMPTS = 2
#: the defaults before this module (used when nothing can be measured)
DEFAULT_PARTITION = 4096000
DEFAULT_CREDIT = 4


class Choice(typing.NamedTuple):
    """What :func:`choose` returns; unpacks as ``(partition_bytes, credit, reason)``."""

    partition_bytes: int
    credit: int
    reason: str


def _pow2(x, lo, hi):
    """The power of two nearest to ``x`` in ratio, within [lo, hi]."""
    x = min(max(x, lo), hi)
    p = 2 ** round(math.log2(x))
    return int(min(max(p, lo), hi))


def _human(nbytes):
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _rate(bps):
    return f"{bps * 8 / 1e9:.3g} Gbit/s"


def choose(bandwidth_Bps, rtt_s, num_servers, colocated_fraction=0.0, piece_cost_s=PIECE_COST_PYTHON,
           placement="balanced", model_bytes=None, min_cut_bytes=0):
    """Partition size and credit for a link (see the module docstring for the model).

    Args:
        bandwidth_Bps: bytes per second a worker moves to its servers (one direction).
        rtt_s: round trip of a small message to a server, in seconds.
        num_servers: servers that sum something (S); with ``balanced`` placement each partition
            is cut into S pieces.
        colocated_fraction: fraction of a partition's bytes that goes to servers on the worker's
            own machine (shared memory, no NIC time); 1.0 when every server is local.
        piece_cost_s: the worker's fixed CPU cost per piece.
        placement: ``balanced`` or ``hash`` (whole partitions: one piece each).
        model_bytes: bytes a step pushes, if known (else :data:`DEFAULT_MODEL_BYTES`).
        min_cut_bytes: ``balanced`` only: the smallest partition the placement cuts over every
            server (``Placement.min_cut``: each piece >= MIN_PIECE); the choice is never below it.

    Returns:
        :class:`Choice` ``(partition_bytes, credit, reason)``.
    """
    if not bandwidth_Bps > 0 or rtt_s < 0 or num_servers < 1 or not 0 <= colocated_fraction <= 1:
        raise ValueError(f"choose: need bandwidth > 0, rtt >= 0, num_servers >= 1 and a colocated fraction in "
                         f"[0, 1]; got {bandwidth_Bps}, {rtt_s}, {num_servers}, {colocated_fraction}")
    pieces = num_servers if placement == "balanced" else 1
    b_eff = effective_bandwidth(bandwidth_Bps, colocated_fraction)
    model = DEFAULT_MODEL_BYTES if model_bytes is None else max(int(model_bytes), 1)
    p_min = pieces * piece_cost_s * b_eff / OVERHEAD
    p_fill = FILL_SHARE * model / FILL_DRAIN
    p_time = GRANULARITY_S * b_eff
    p_max = min(p_fill, p_time)
    if p_min > p_max:
        target, bound = p_min, "the fixed-cost bound (it exceeds the upper bound)"
    else:
        target, bound = p_max, "the upper bound"
    if p_min <= p_max:  # a bound not to exceed: the largest power of two at most OVERHEAD above it
        partition = _pow2(2 ** math.floor(math.log2(max(target * (1 + OVERHEAD), 1))), MIN_PARTITION, MAX_PARTITION)
    else:
        partition = _pow2(target, MIN_PARTITION, MAX_PARTITION)
    cut = min_cut_bytes if placement == "balanced" else 0
    if partition < cut:
        partition = at_least_cut(partition, cut)
        bound = f"the cut bound {_human(cut)} (smaller partitions are not cut over the servers)"
    bdp = b_eff * rtt_s
    credit = credit_for(b_eff, rtt_s, partition)
    reason = (f"link {_rate(bandwidth_Bps)}, rtt {rtt_s * 1e6:.0f} us, {num_servers} server(s), "
              f"{colocated_fraction:.0%} of bytes local -> effective {_rate(b_eff)}; "
              f"fixed cost {pieces} x {piece_cost_s * 1e6:.0f} us <= {OVERHEAD:.0%} of wire time needs "
              f">= {_human(p_min)}; fill and drain <= {FILL_SHARE:.1%} of a {_human(model)} step"
              f"{'' if model_bytes is not None else ' (assumed)'} needs <= {_human(p_fill)}, "
              f"{GRANULARITY_S * 1e3:g} ms on the wire <= {_human(p_time)}; {bound} -> {_human(partition)}; "
              f"bandwidth-delay product {_human(bdp)} -> credit {credit}")
    return Choice(partition, credit, reason)


def effective_bandwidth(bandwidth_Bps, colocated_fraction):
    """``B_eff``: bytes of a partition per second of NIC time when a fraction of them stays local."""
    if colocated_fraction >= 1:
        return bandwidth_Bps
    return min(bandwidth_Bps / (1 - colocated_fraction), max(LOCAL_BPS, bandwidth_Bps))


def credit_for(b_eff, rtt_s, partition_bytes):
    """Partitions in flight that cover the bandwidth-delay product, plus MIN_CREDIT for skew."""
    return int(min(max(MIN_CREDIT + round(b_eff * rtt_s / partition_bytes), MIN_CREDIT), MAX_CREDIT))


def _env_int(env, name, minimum):
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    from .config import _int

    return _int({name: raw}, name, minimum=minimum)


def resolve(choice, env=None):
    """Apply the environment's overrides to a :class:`Choice` (or None: nothing was measured).

    ``BYTEPS_PARTITION_BYTES`` and ``BYTEPS_SCHEDULING_CREDIT``, when set, win over the model, each
    on its own; without a choice the old defaults (4,096,000 bytes, credit 4) apply. Malformed values
    are a ConfigError naming the variable (byteps.config's rules).
    """
    env = os.environ if env is None else env
    part = _env_int(env, "BYTEPS_PARTITION_BYTES", 64)
    credit = _env_int(env, "BYTEPS_SCHEDULING_CREDIT", 0)
    if choice is None:
        choice = Choice(DEFAULT_PARTITION, DEFAULT_CREDIT, "nothing measured: the defaults")
    why = choice.reason
    if part is not None:
        why += f"; BYTEPS_PARTITION_BYTES={part} overrides the partition size"
    if credit is not None:
        why += f"; BYTEPS_SCHEDULING_CREDIT={credit} overrides the credit"
    return Choice(choice.partition_bytes if part is None else part,
                  choice.credit if credit is None else credit, why)


# ------------------------------------------------------------------------------------ the probe

@dataclasses.dataclass(frozen=True)
class Measurement:
    rtt_s: float
    bandwidth_Bps: float
    samples: dict   # size -> [seconds per echo]


def probe(send_recv, sizes=(64, 1 << 20), repeats=5, budget_s=1.0, clock=time.perf_counter):
    """Measure round trip and bandwidth to one server with echoes.

    Args:
        send_recv: ``send_recv(payload: bytes) -> bytes``: sends one PROBE with ``payload`` and
            returns the echoed body (see :func:`zmq_echo`); raises on a time-out or a wrong echo.
        sizes: payload sizes; the smallest gives the round trip, the largest the bandwidth.
        repeats: echoes per size, the sizes taking turns; the fastest is kept (others' traffic only
            slows an echo down).
        budget_s: stop repeating a size once its echoes took this long (a slow link).

    Returns:
        :class:`Measurement`: ``rtt_s`` = fastest small echo; ``bandwidth_Bps`` = ``2 * large /
        (fastest large echo - rtt)``, since the large payload crosses the link once each way.

    Raises:
        ValueError: an echo came back wrong, or in each of :data:`PROBE_ATTEMPTS` rounds the large
            echoes were so little slower than the small ones that the link would be faster than
            :data:`MAX_PROBE_BPS` (the small ones were delayed: the echoes timed the machine's load).
            The engine then proposes nothing, and its credit comes from its machine's or the job's
            median probe (:func:`agree`).
    """
    sizes = sorted(set(sizes))
    if len(sizes) < 2 or sizes[0] < 0:
        raise ValueError("probe needs at least two payload sizes (small, large)")
    payloads = {size: os.urandom(size) for size in sizes}
    small, large = sizes[0], sizes[-1]
    for _attempt in range(PROBE_ATTEMPTS):
        samples = {size: [] for size in sizes}
        spent = dict.fromkeys(sizes, 0.0)
        for _ in range(repeats):  # sizes in turn, so that a burst of load delays them alike
            for size in sizes:
                if spent[size] > budget_s:
                    continue
                start = clock()
                echo = send_recv(payloads[size])
                elapsed = clock() - start
                if len(echo) != size or bytes(echo) != payloads[size]:
                    raise ValueError(f"PROBE echo of {size} bytes came back as {len(echo)} different bytes")
                samples[size].append(elapsed)
                spent[size] += elapsed
        rtt = min(samples[small])
        transfer = min(samples[large]) - rtt
        bandwidth = 2 * (large - small) / transfer if transfer > 0 else math.inf
        if bandwidth <= MAX_PROBE_BPS:
            return Measurement(rtt, bandwidth, samples)
    raise ValueError(f"the fastest {large}-byte echo took {min(samples[large]) * 1e6:.0f} us, about as long as the "
                     f"fastest {small}-byte one ({rtt * 1e6:.0f} us), {PROBE_ATTEMPTS} times: that timed this "
                     f"machine's load, not the link")


def zmq_echo(sock, node_id=0, timeout_s=5.0, idle=None):
    """A ``send_recv`` for :func:`probe` over an authenticated DEALER socket to a server.

    Call it where the socket's owner runs (ZeroMQ sockets are not thread-safe), before the
    data plane carries partitions: replies are matched by order, anything else is an error.
    ``idle``: called every 100 ms while an echo is awaited (the engine's heartbeats to the scheduler)."""
    import zmq

    from byteps.core import wire
    from byteps.errors import BytePSTimeoutError, ProtocolError

    seq = [0]

    def send_recv(payload):
        seq[0] += 1
        sock.send_multipart([wire.pack(wire.Cmd.PROBE, sender=node_id, round=seq[0], length=len(payload)), payload])
        deadline = time.monotonic() + timeout_s
        while not sock.poll(max(1, min(100, int((deadline - time.monotonic()) * 1000))), zmq.POLLIN):
            if time.monotonic() >= deadline:
                raise BytePSTimeoutError(f"no PROBE echo within {timeout_s:g} s")
            if idle is not None:
                idle()
        frames = sock.recv_multipart(copy=False)
        header = wire.unpack(frames[0].bytes)
        if header.cmd != wire.Cmd.PROBE or header.round != seq[0]:
            raise ProtocolError(f"expected the PROBE echo {seq[0]}, got {header!r}")
        return frames[1].buffer if len(frames) > 1 else b""

    return send_recv


# ------------------------------------------------------------------ at job start (core/engine.py)
#
# Every worker must cut tensors the same way (wire keys and lengths are compared by the servers), so
# the partition size is agreed job-wide: each worker probes one server, proposes the size its own
# link calls for, and sends the proposal to the scheduler in a BARRIER named AGREE_BARRIER; the
# release carries every worker's proposal, and every worker applies :func:`agree` to the same list,
# so all get the same size. The credit stays per worker (its own link's bandwidth-delay product).

#: name of the control-plane barrier whose messages carry the proposals (scheduler/scheduler.py)
AGREE_BARRIER = "byteps.autotune"
#: test hook: ``bytes_per_s,rtt_s`` replaces this worker's probe (tests make workers disagree)
TEST_LINK_VAR = "BYTEPS_TEST_LINK"
#: the probe at start: small and 1 MiB echoes in turn, at most PROBE_REPEATS of each, and no more echoes
#: of a size once they took PROBE_BUDGET_S (about 0.4 s in all at 200 Mbit/s, a few ms on loopback;
#: a second round where the first timed the machine's load, see MAX_PROBE_BPS)
PROBE_SIZES = (64, 1 << 20)
PROBE_REPEATS = 5
PROBE_BUDGET_S = 0.2


class Agreement(typing.NamedTuple):
    """The job's partition size and this worker's credit, with where they came from."""

    partition_bytes: int
    credit: int
    source: str         # "probe", "env" (BYTEPS_PARTITION_BYTES) or "default" (nothing measured)
    text: str           # the log line's content: "partition size X (...), credit Y (...)"
    bandwidth_Bps: float = None   # the link this worker's credit came from (None: not measured)
    rtt_s: float = None
    took_s: float = None          # what the probe and the agreement added to init()

    def as_dict(self):
        return self._asdict()


def job_shape(servers, weights, my_host, min_cut=0):
    """(servers that sum something, fraction of a partition's bytes summed on this worker's host,
    the placement's cut bound) from the address book's servers, their placement weights and
    ``Placement.min_cut`` (byteps/placement.py): the inputs :func:`choose` takes, as
    :func:`for_plan` derives them for ``bpslaunch --plan``."""
    total = sum(weights)
    active = sum(1 for w in weights if w > 0)
    local = sum(w for s, w in zip(servers, weights) if s["host"] == my_host)
    return max(active, 1), (local / total if total else 0.0), min_cut


def probe_target(servers, weights, my_host, rank):
    """The server a worker probes: one on another host (the NIC is what the model needs), a different
    one per rank so the workers do not all time one server's link at once; a job whose servers are
    all on this host probes a local one."""
    remote = [i for i, (s, w) in enumerate(zip(servers, weights)) if w > 0 and s["host"] != my_host]
    pool = remote or [i for i, w in enumerate(weights) if w > 0] or list(range(len(servers)))
    return pool[rank % len(pool)] if pool else None


def test_link(env=None):
    """The Measurement the :data:`TEST_LINK_VAR` hook forces, or None when it is not set."""
    raw = ((os.environ if env is None else env).get(TEST_LINK_VAR) or "").strip()
    if not raw:
        return None
    try:
        bw, rtt = (float(x) for x in raw.split(","))
    except ValueError:
        from .errors import ConfigError

        raise ConfigError(f"{TEST_LINK_VAR}={raw!r}: expected 'bytes_per_second,rtt_seconds'") from None
    return Measurement(rtt, bw, {})


def propose(measurement, shape, placement="balanced", piece_cost_s=PIECE_COST_PYTHON, worker_id=0, env=None):
    """This worker's proposal (JSON): the partition size BYTEPS_PARTITION_BYTES sets, else the one its
    measurement calls for (``shape`` from :func:`job_shape`), else none (nothing measured)."""
    env = os.environ if env is None else env
    part = _env_int(env, "BYTEPS_PARTITION_BYTES", 64)
    out = {"worker_id": worker_id, "partition": part, "source": "env" if part is not None else "none"}
    if measurement is not None:
        # with what the choice took, so that every worker can choose again for a model (agree)
        out.update(bw=measurement.bandwidth_Bps, rtt=measurement.rtt_s, shape=list(shape), piece_cost=piece_cost_s,
                   placement=placement)
        if part is None:
            out.update(partition=_proposed(out), source="probe")
    return out


def _proposed(p, model_bytes=None):
    """The partition size a worker's proposal ``p`` calls for, for a step of ``model_bytes``."""
    servers, local, min_cut = p["shape"]
    return choose(p["bw"], p["rtt"], servers, local, p["piece_cost"], p["placement"], model_bytes,
                  min_cut).partition_bytes


def agree(proposals, rank, shape, env=None, model_bytes=None):
    """The job-wide partition size and this worker's credit from every worker's :func:`propose`.

    Every worker calls this with the same ``proposals`` ({rank: proposal}, as the scheduler's release
    carries them) and the same ``model_bytes`` (None at ``init()``; the gradients' bytes once an
    optimizer says: ``Engine.expect_model``), and so gets the same partition size:

    * BYTEPS_PARTITION_BYTES wins where it is set; workers that set different values are a
      ConfigError naming them (their servers would see mismatched lengths), and a worker without it
      takes the others' value (logged);
    * else the median of the probed proposals (the lower one of an even count): one worker whose
      probe was disturbed by its neighbours' cannot move the job;
    * else (no probe worked anywhere) the old default.

    The credit is this worker's (BYTEPS_SCHEDULING_CREDIT if set): the bandwidth-delay product of
    its own measurement, else of its machine's (only local rank 0 probes), else of the job's median.
    """
    from .errors import ConfigError

    env = os.environ if env is None else env
    props = {int(r): p for r, p in proposals.items()}
    mine = props.get(rank, {})
    forced = {r: p["partition"] for r, p in props.items() if p.get("source") == "env"}
    probed = sorted((p["partition"], r) for r, p in props.items() if p.get("source") == "probe")
    measured = sorted((p["bw"], r) for r, p in props.items() if p.get("bw"))
    if forced:
        if len(set(forced.values())) > 1:
            raise ConfigError("BYTEPS_PARTITION_BYTES differs across workers (every worker must cut tensors "
                              "the same way): " + ", ".join(f"rank {r}: {v}" for r, v in sorted(forced.items())))
        partition, source = next(iter(forced.values())), "env"
        why = "BYTEPS_PARTITION_BYTES"
        unset = sorted(set(props) - set(forced))
        if unset:
            why += f" (set on ranks {sorted(forced)}; ranks {unset} without it use it too)"
    elif probed:
        if model_bytes is not None:  # each worker's link, chosen again for the model's step
            probed = sorted((_proposed(props[r], model_bytes), r) for _, r in probed)
        partition, chosen = probed[(len(probed) - 1) // 2]
        source = "probe"
        p = props[chosen]
        why = (f"probed: {_rate(p['bw'])}, rtt {p['rtt'] * 1e6:.0f} us at rank {chosen}, the median of "
               f"{len(probed)} worker(s)' choices {sorted({q for q, _ in probed})}"
               + (f", for a model of {_human(model_bytes)}" if model_bytes is not None else ""))
    else:
        partition, source, why = DEFAULT_PARTITION, "default", "nothing measured: the default"
    # the credit: this worker's own link, its machine's (local rank 0 probed it), or the job's median
    link = mine if mine.get("bw") else None
    if link is None:
        same = [p for r, p in sorted(props.items()) if p.get("bw") and p.get("worker_id") == mine.get("worker_id")]
        link = same[0] if same else (props[measured[(len(measured) - 1) // 2][1]] if measured else None)
    credit = _env_int(env, "BYTEPS_SCHEDULING_CREDIT", 0)
    bw = rtt = None
    if link is not None:
        bw, rtt = link["bw"], link["rtt"]
    if credit is not None:
        credit_why = "BYTEPS_SCHEDULING_CREDIT"
    elif link is not None:
        b_eff = effective_bandwidth(bw, shape[1])
        credit = credit_for(b_eff, rtt, partition)
        credit_why = f"bandwidth-delay product {_human(b_eff * rtt)} at {_rate(b_eff)} effective, rtt {rtt * 1e6:.0f} us"
    else:
        credit, credit_why = DEFAULT_CREDIT, "nothing measured: the default"
    text = f"partition size {_human(partition)} ({partition} bytes; {why}), credit {credit} ({credit_why})"
    return Agreement(partition, credit, source, text, bw, rtt)


# ------------------------------------------------------------------------ bpslaunch --plan

def parse_duration(text):
    """Seconds from "200us", "0.5ms", "1s", "1e-4" (plain: seconds)."""
    import re

    m = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*(us|µs|ms|s)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a duration from {text!r} (examples: 200us, 0.5ms, 1e-4)")
    value = float(m.group(1)) * {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
    if value < 0:
        raise ValueError(f"duration {text!r} must be >= 0")
    return value


def for_plan(plan, rtt_s, piece_cost_s=PIECE_COST_PYTHON):
    """The choice for a job shape of :func:`byteps.placement.plan`: its servers that sum something,
    the share of a worker's bytes its own machine's server sums, the NIC bandwidth."""
    shares = [float(s.share) for s in plan.servers if s.share > 0]
    local = 1.0 if plan.n == 1 else float(plan.colocated_share)
    # Placement.min_cut: the smallest piece, at the smallest share, must reach MIN_PIECE
    cut = math.ceil(MIN_PIECE / min(shares)) if len(shares) > 1 else 0
    return choose(plan.bandwidth, rtt_s, len(shares) or 1, local, piece_cost_s=piece_cost_s, min_cut_bytes=cut)


def plan_text(plan, rtt_s):
    """What ``bpslaunch --plan`` prints about partitions and credit."""
    lines = [f"partition size and credit (byteps/autotune.py; a job probes its link at start, "
             f"here rtt {rtt_s * 1e6:g} us is assumed; BYTEPS_PARTITION_BYTES / BYTEPS_SCHEDULING_CREDIT override):"]
    for label, cost in (("python engine", PIECE_COST_PYTHON), ("native core", PIECE_COST_NATIVE)):
        c = for_plan(plan, rtt_s, cost)
        lines.append(f"  {label:<14} partition {_human(c.partition_bytes)} ({c.partition_bytes} bytes), "
                     f"credit {c.credit}")
        lines.append(f"      {c.reason}")
    return "\n".join(lines)
