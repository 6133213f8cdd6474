"""Partition size and scheduling credit from the job's link, measured at start instead of assumed.

:func:`choose` derives both from a small model of the link (bandwidth, round trip) and the job's
shape; :func:`probe` measures the link with PROBE echoes to one server; :func:`propose` and
:func:`agree` make the partition size job-wide at ``init()`` (core/engine.py); :func:`resolve`
applies ``BYTEPS_PARTITION_BYTES`` / ``BYTEPS_SCHEDULING_CREDIT``. The model, its constants and the
measurements they were fitted to: docs/autotune.md.
"""
import dataclasses
import math
import os
import time
import typing

from .config import _int
from .errors import ConfigError
from .placement import MIN_PIECE, at_least_cut

#: CPU a worker spends per partition piece (seconds; docs/benchmarks.md, "Per-partition overhead"): on a
#: machine that reduces locally (the figure measured when the Python engine ran that reduce; not measured
#: again on the native one), and without a local reduce
PIECE_COST_LOCAL_REDUCE = 30e-6
PIECE_COST_NATIVE = 5e-6
#: fixed costs may take at most this fraction of the wire time
OVERHEAD = 0.05
#: the pipeline's fill and drain may take at most this fraction of a step
FILL_SHARE = 0.025
#: longest time one partition should hold the wire (seconds)
GRANULARITY_S = 0.010
#: partitions' wire time a step pays to fill and drain the pipeline (fitted: docs/autotune.md)
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
#: a probe that reads a link faster than this (800 Gbit/s) timed its own process's delays, not the link
MAX_PROBE_BPS = 100e9
#: rounds of echoes a probe may take before it gives up on such readings
PROBE_ATTEMPTS = 2
#: the defaults when nothing can be measured
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


def choose(bandwidth_Bps, rtt_s, num_servers, colocated_fraction=0.0, piece_cost_s=PIECE_COST_LOCAL_REDUCE,
           placement="balanced", model_bytes=None, min_cut_bytes=0):
    """Partition size and credit for a link (the model: docs/autotune.md).

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
        bound = "the fixed-cost bound (it exceeds the upper bound)"
        partition = _pow2(p_min, MIN_PARTITION, MAX_PARTITION)
    else:  # a bound not to exceed: the largest power of two at most OVERHEAD above it
        bound = "the upper bound"
        partition = _pow2(2 ** math.floor(math.log2(max(p_max * (1 + OVERHEAD), 1))), MIN_PARTITION, MAX_PARTITION)
    cut = min_cut_bytes if placement == "balanced" else 0
    if partition < cut:
        partition = at_least_cut(partition, cut)
        bound = f"the cut bound {_human(cut)} (smaller partitions are not cut over the servers)"
    credit = credit_for(b_eff, rtt_s, partition)
    reason = (f"link {_rate(bandwidth_Bps)}, rtt {rtt_s * 1e6:.0f} us, {num_servers} server(s), "
              f"{colocated_fraction:.0%} of bytes local -> effective {_rate(b_eff)}; "
              f"fixed cost {pieces} x {piece_cost_s * 1e6:.0f} us <= {OVERHEAD:.0%} of wire time needs "
              f">= {_human(p_min)}; fill and drain <= {FILL_SHARE:.1%} of a {_human(model)} step"
              f"{'' if model_bytes is not None else ' (assumed)'} needs <= {_human(p_fill)}, "
              f"{GRANULARITY_S * 1e3:g} ms on the wire <= {_human(p_time)}; {bound} -> {_human(partition)}; "
              f"bandwidth-delay product {_human(b_eff * rtt_s)} -> credit {credit}")
    return Choice(partition, credit, reason)


def effective_bandwidth(bandwidth_Bps, colocated_fraction):
    """``B_eff``: bytes of a partition per second of NIC time when a fraction of them stays local."""
    if colocated_fraction >= 1:
        return bandwidth_Bps
    return min(bandwidth_Bps / (1 - colocated_fraction), max(LOCAL_BPS, bandwidth_Bps))


def credit_for(b_eff, rtt_s, partition_bytes):
    """Partitions in flight that cover the bandwidth-delay product, plus MIN_CREDIT for skew."""
    return int(min(max(MIN_CREDIT + round(b_eff * rtt_s / partition_bytes), MIN_CREDIT), MAX_CREDIT))


def resolve(choice, env=None):
    """Apply the environment's overrides to a :class:`Choice` (or None: nothing was measured).

    ``BYTEPS_PARTITION_BYTES`` and ``BYTEPS_SCHEDULING_CREDIT``, when set, win over the model, each
    on its own; without a choice the old defaults (4,096,000 bytes, credit 4) apply. Malformed values
    are a ConfigError naming the variable (byteps.config's rules).
    """
    env = os.environ if env is None else env
    part = _int(env, "BYTEPS_PARTITION_BYTES", minimum=64)
    credit = _int(env, "BYTEPS_SCHEDULING_CREDIT", minimum=0)
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
# Every worker proposes a partition size in the barrier AGREE_BARRIER and applies agree() to every
# proposal the release carries, so all cut tensors alike (docs/autotune.md, "At `init()`").

#: name of the control-plane barrier whose messages carry the proposals (scheduler/scheduler.py)
AGREE_BARRIER = "byteps.autotune"
#: test hook: ``bytes_per_s,rtt_s`` replaces this worker's probe (tests make workers disagree)
TEST_LINK_VAR = "BYTEPS_TEST_LINK"
#: the probe at start: small and 1 MiB echoes in turn, at most PROBE_REPEATS of each, and no more echoes
#: of a size once they took PROBE_BUDGET_S
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
        raise ConfigError(f"{TEST_LINK_VAR}={raw!r}: expected 'bytes_per_second,rtt_seconds'") from None
    return Measurement(rtt, bw, {})


def propose(measurement, shape, placement="balanced", piece_cost_s=PIECE_COST_LOCAL_REDUCE, worker_id=0, env=None):
    """This worker's proposal (JSON): the partition size BYTEPS_PARTITION_BYTES sets, else the one its
    measurement calls for (``shape`` from :func:`job_shape`), else none (nothing measured)."""
    env = os.environ if env is None else env
    part = _int(env, "BYTEPS_PARTITION_BYTES", minimum=64)
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
    optimizer says: ``Engine.expect_model``), and so gets the same partition size: the one
    BYTEPS_PARTITION_BYTES sets (ConfigError where workers set different values), else the median of
    the probed proposals, else the default. The credit is this worker's (docs/autotune.md).
    """
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
    credit = _int(env, "BYTEPS_SCHEDULING_CREDIT", minimum=0)
    bw, rtt = (link["bw"], link["rtt"]) if link is not None else (None, None)
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


def for_plan(plan, rtt_s, piece_cost_s=PIECE_COST_LOCAL_REDUCE):
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
    for label, cost in (("native core, local reduce", PIECE_COST_LOCAL_REDUCE), ("native core", PIECE_COST_NATIVE)):
        c = for_plan(plan, rtt_s, cost)
        lines.append(f"  {label:<26} partition {_human(c.partition_bytes)} ({c.partition_bytes} bytes), "
                     f"credit {c.credit}")
        lines.append(f"      {c.reason}")
    return "\n".join(lines)
