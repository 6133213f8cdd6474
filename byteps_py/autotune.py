"""Partition size and scheduling credit from the job's link, measured at start instead of assumed.

A push_pull cuts each tensor into partitions of ``partition_bytes`` and keeps at most ``credit`` of
them on the network at once (core/_pipeline.pyx). Both used to be constants (4,096,000 bytes and
4), which suit fast links only: on the emulated cluster (docs/benchmarks.md, "Emulated cluster",
200 Mbit/s, n = 4, k = 2) a step took 1.36x the optimum with 4 MB partitions and 1.07x with 256
or 512 KB. :func:`choose` derives both from a small model; :func:`probe` measures the two inputs it
needs from one server with ``PROBE`` echoes (core/wire.py; the server answers in
summation/server.py ``_on_probe``); :func:`resolve` lets ``BYTEPS_PARTITION_BYTES`` and
``BYTEPS_SCHEDULING_CREDIT`` override either choice.

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
  for 46.8 MB per step at 200 Mbit/s, and 1.13x at 4 MB for 96 MiB at 1 Gbit/s (issue 14): the
  excess is about 3.4 P / M whatever the rate). For that to stay under ``OVERHEAD`` of a step
  that pushes M bytes, and for a partition to hold the wire at most ``GRANULARITY_S`` (an urgent
  tensor waits behind the credit's partitions; priority scheduling needs them short)::

      P_max = min(OVERHEAD * M / FILL_DRAIN, GRANULARITY_S * B_eff)

  M is ``model_bytes`` when the caller knows it, else ``DEFAULT_MODEL_BYTES`` (256 MB, which
  gives BytePS's 4 MB partitions on fast links).
* **The choice.** ``P = max(P_min, P_max)``: the largest partition the upper bound allows, or the
  fixed-cost bound when it is larger (throughput first). Rounded to the nearest power of two in
  ``[MIN_PARTITION, MAX_PARTITION]``, so workers whose measurements differ a little still tend to
  agree (the engine must use one value for the whole job).
* **Credit.** One partition's round trip is about ``rtt + 2P/B``; to keep the link busy the window
  must hold ``B * rtt + 2P`` bytes, plus two partitions for skew between workers::

      credit = clamp(MIN_CREDIT + round(B * rtt / P), MIN_CREDIT, MAX_CREDIT)

  On a LAN the bandwidth-delay product is far below one partition and the credit stays 4 (more
  measured worse: 1.22x t_opt with 16, 1.33x with 64, at 512 KB); a long link gets more.

``bpslaunch --plan --bandwidth 1Gbit --latency 200us`` prints the choice for a job shape.
"""
import dataclasses
import math
import os
import time
import typing

#: CPU a worker spends per partition piece with the Python engine (seconds; docs/benchmarks.md)
PIECE_COST_PYTHON = 30e-6
#: the same with the native core (issue 15's target)
PIECE_COST_NATIVE = 5e-6
#: fixed costs, and fill and drain, may each take at most this fraction of the time
OVERHEAD = 0.05
#: partitions' wire time a step pays to fill and drain the pipeline (fitted; see above)
FILL_DRAIN = 3.4
#: longest time one partition should hold the wire (seconds)
GRANULARITY_S = 0.010
#: bytes a step pushes, when the caller cannot say
DEFAULT_MODEL_BYTES = 256 << 20
MIN_CREDIT = 4
MAX_CREDIT = 64
MIN_PARTITION = 64 << 10
MAX_PARTITION = 64 << 20
#: bytes/s through shared memory to a colocated server (a copy and a sum: a few GB/s)
LOCAL_BPS = 4e9
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
           placement="balanced", model_bytes=None):
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

    Returns:
        :class:`Choice` ``(partition_bytes, credit, reason)``.
    """
    if not bandwidth_Bps > 0 or rtt_s < 0 or num_servers < 1 or not 0 <= colocated_fraction <= 1:
        raise ValueError(f"choose: need bandwidth > 0, rtt >= 0, num_servers >= 1 and a colocated fraction in "
                         f"[0, 1]; got {bandwidth_Bps}, {rtt_s}, {num_servers}, {colocated_fraction}")
    pieces = num_servers if placement == "balanced" else 1
    if colocated_fraction >= 1:
        b_eff = bandwidth_Bps
    else:
        b_eff = min(bandwidth_Bps / (1 - colocated_fraction), max(LOCAL_BPS, bandwidth_Bps))
    model = DEFAULT_MODEL_BYTES if model_bytes is None else max(int(model_bytes), 1)
    p_min = pieces * piece_cost_s * b_eff / OVERHEAD
    p_fill = OVERHEAD * model / FILL_DRAIN
    p_time = GRANULARITY_S * b_eff
    p_max = min(p_fill, p_time)
    if p_min > p_max:
        target, bound = p_min, "the fixed-cost bound (it exceeds the upper bound)"
    else:
        target, bound = p_max, "the upper bound"
    partition = _pow2(target, MIN_PARTITION, MAX_PARTITION)
    bdp = b_eff * rtt_s
    credit = int(min(max(MIN_CREDIT + round(bdp / partition), MIN_CREDIT), MAX_CREDIT))
    reason = (f"link {_rate(bandwidth_Bps)}, rtt {rtt_s * 1e6:.0f} us, {num_servers} server(s), "
              f"{colocated_fraction:.0%} of bytes local -> effective {_rate(b_eff)}; "
              f"fixed cost {pieces} x {piece_cost_s * 1e6:.0f} us <= {OVERHEAD:.0%} of wire time needs "
              f">= {_human(p_min)}; fill and drain <= {OVERHEAD:.0%} of a {_human(model)} step"
              f"{'' if model_bytes is not None else ' (assumed)'} needs <= {_human(p_fill)}, "
              f"{GRANULARITY_S * 1e3:g} ms on the wire <= {_human(p_time)}; {bound} -> {_human(partition)}; "
              f"bandwidth-delay product {_human(bdp)} -> credit {credit}")
    return Choice(partition, credit, reason)


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
        repeats: echoes per size; the fastest is kept (others' traffic only slows an echo down).
        budget_s: stop repeating a size once its echoes took this long (a slow link).

    Returns:
        :class:`Measurement`: ``rtt_s`` = fastest small echo; ``bandwidth_Bps`` = ``2 * large /
        (fastest large echo - rtt)``, since the large payload crosses the link once each way.
    """
    sizes = sorted(set(sizes))
    if len(sizes) < 2 or sizes[0] < 0:
        raise ValueError("probe needs at least two payload sizes (small, large)")
    samples = {}
    for size in sizes:
        payload = os.urandom(size)
        took = []
        spent = 0.0
        for _ in range(repeats):
            start = clock()
            echo = send_recv(payload)
            elapsed = clock() - start
            if len(echo) != size or bytes(echo) != payload:
                raise ValueError(f"PROBE echo of {size} bytes came back as {len(echo)} different bytes")
            took.append(elapsed)
            spent += elapsed
            if spent > budget_s:
                break
        samples[size] = took
    rtt = min(samples[sizes[0]])
    large = sizes[-1]
    transfer = max(min(samples[large]) - rtt, 1e-9)
    return Measurement(rtt, 2 * (large - sizes[0]) / transfer, samples)


def zmq_echo(sock, node_id=0, timeout_s=5.0):
    """A ``send_recv`` for :func:`probe` over an authenticated DEALER socket to a server.

    Call it where the socket's owner runs (ZeroMQ sockets are not thread-safe), before the
    data plane carries partitions: replies are matched by order, anything else is an error."""
    import zmq

    from byteps.core import wire
    from byteps.errors import BytePSTimeoutError, ProtocolError

    seq = [0]

    def send_recv(payload):
        seq[0] += 1
        sock.send_multipart([wire.pack(wire.Cmd.PROBE, sender=node_id, round=seq[0], length=len(payload)), payload])
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise BytePSTimeoutError(f"no PROBE echo within {timeout_s:g} s")
        frames = sock.recv_multipart(copy=False)
        header = wire.unpack(frames[0].bytes)
        if header.cmd != wire.Cmd.PROBE or header.round != seq[0]:
            raise ProtocolError(f"expected the PROBE echo {seq[0]}, got {header!r}")
        return frames[1].buffer if len(frames) > 1 else b""

    return send_recv


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
    servers = sum(1 for s in plan.servers if s.share > 0) or 1
    local = 1.0 if plan.n == 1 else float(plan.colocated_share)
    return choose(plan.bandwidth, rtt_s, servers, local, piece_cost_s=piece_cost_s)


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
