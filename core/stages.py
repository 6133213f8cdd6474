"""The pipeline's stage lists: which stages one partition of a tensor goes through, in order.

A list follows from the process's role for the partition (owner or not), the local size, whether
its server is colocated, the operation and the device, by one rule: ``bps_stage_list()`` in
core/pipeline/bps_stages.h, which :func:`stage_list` calls; the stages are numbered there too.
Lists are plain data: ``BYTEPS_PIPELINE`` drops optional stages without recompiling, and
``bpslaunch --stages`` prints them. The stages, their threads and the NCCL variant are in
docs/architecture.md, "The pipeline of one partition".
"""
import enum
import os

from byteps.errors import ConfigError

from . import _pipeline


class Stage(enum.IntEnum):
    """Every stage and span kind, numbered as core/pipeline/bps_stages.h numbers them (a test keeps the two
    equal); the timeline's spans carry these codes. QUEUE, RECV, SUM, ROUND and REPLY are span
    kinds only (:data:`SPAN_ONLY`): waits and the server's side of a round, not steps of a list."""
    QUEUE = 1
    STAGE = 2
    PUSH = 3
    PULL = 4
    COORDINATE = 5
    LOCAL_REDUCE = 6
    LOCAL_BROADCAST = 7
    RECV = 8
    SUM = 9
    ROUND = 10
    REPLY = 11
    COPYD2H = 12
    NCCL_REDUCE = 13
    PCIE_REDUCE = 14
    NCCL_BROADCAST = 15
    COPYH2D = 16

    @property
    def label(self):
        """The lower-case name BYTEPS_PIPELINE and the logs use."""
        return self.name.lower()


#: span kinds that are not steps of a partition's stage list
SPAN_ONLY = frozenset({Stage.QUEUE, Stage.RECV, Stage.SUM, Stage.ROUND, Stage.REPLY})
#: the server's span kinds
SERVER_STAGES = (Stage.RECV, Stage.SUM, Stage.ROUND, Stage.REPLY)


#: stages a user may leave out with BYTEPS_PIPELINE=-name (they are optimisations, not steps of the sum)
OPTIONAL = {Stage.STAGE: "copy into shared memory for a colocated server (without it: TCP loopback)",
            Stage.LOCAL_REDUCE: "sum a machine's copies first (without it: every process pushes its own)"}


def stage_list(*, owner, local_size, local_reduce, colocated, kind="push_pull", device="cpu", machines=None,
               root=False):
    """The ordered stages of one partition of a tensor on this process.

    ``owner``: this process reduces and pushes the partition for its machine (core/local.py);
    ``local_size``: worker processes on this machine; ``local_reduce``: they sum locally first;
    ``colocated``: the partition's server shares memory with us; ``kind``: "push_pull", "broadcast" or
    "async push_pull" (the last two never reduce locally); ``device``: "cpu" or "cuda" (a CUDA
    partition is copied off the GPU first, COPYD2H, and its result back last, COPYH2D);
    ``machines``: worker machines in the job (with one, the local reduce is the whole sum: no server
    round trip); ``root``: this process is a broadcast's root (a CUDA root copies nothing back, the
    others nothing off).
    """
    codes = _pipeline.stage_codes(kind, owner, bool(local_reduce and local_size > 1), colocated, machines == 1,
                                  device == "cuda", root)
    return tuple(Stage(code) for code in codes)


def nccl_stage_list(root, *, colocated=False, machines=None, average=False):
    """The ordered stages of one partition of a CUDA push_pull on the NCCL stages (several GPU processes
    on a machine, BYTEPS_LOCAL_STRATEGY=topology). ``root``: this process's GPU gets the machine's sum
    and pushes it; ``colocated``: the root stages its push in shared memory; ``machines``: with one, the
    machine's sum is the result; ``average``: an averaged push_pull (on one machine the root divides it
    on the host, between copies)."""
    codes = _pipeline.nccl_stage_codes(root, colocated, machines == 1, average)
    return tuple(Stage(code) for code in codes)


def parse_override(raw):
    """BYTEPS_PIPELINE: a comma-separated list of optional stages to drop (``-stage``), e.g.
    ``-stage`` (push colocated partitions over TCP), ``-local_reduce``. Returns the set dropped."""
    dropped = set()
    if not raw:
        return dropped
    for item in raw.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if not item.startswith("-"):
            raise ConfigError(f"BYTEPS_PIPELINE={raw!r}: {item!r} must name a stage to drop, like '-stage' "
                              f"(optional stages: {', '.join('-' + s.label for s in OPTIONAL)})")
        try:
            stage = Stage[item[1:].upper()]
        except KeyError:
            raise ConfigError(f"BYTEPS_PIPELINE={raw!r}: unknown stage {item[1:]!r} (stages: "
                              f"{', '.join(s.label for s in Stage if s not in SPAN_ONLY)})") from None
        if stage not in OPTIONAL:
            raise ConfigError(f"BYTEPS_PIPELINE={raw!r}: stage {stage.label!r} cannot be dropped; optional stages: "
                              + "; ".join(f"{s.label} ({why})" for s, why in OPTIONAL.items()))
        dropped.add(stage)
    return dropped


def from_env(env=None):
    """The stages dropped by BYTEPS_PIPELINE in ``env`` (default: this process's environment)."""
    return parse_override((os.environ if env is None else env).get("BYTEPS_PIPELINE", ""))


def describe(stages):
    return " -> ".join(s.name for s in stages)


def situations(local_size=2, dropped=frozenset()):
    """[(situation, stage list)] for every case the engine builds a list for (``bpslaunch --stages``).

    ``local_size``: processes of a machine for the local-reduce rows; ``dropped``: the stages
    BYTEPS_PIPELINE switches off (:func:`from_env`), applied as the engine applies them: without
    STAGE a colocated server is reached over TCP like a remote one, without LOCAL_REDUCE every
    process pushes its own copy."""
    rows = []
    for colocated in (False, True):
        where = "colocated server" if colocated else "remote server"
        shm = colocated and Stage.STAGE not in dropped
        rows.append((f"one process per machine, {where}",
                     stage_list(owner=True, local_size=1, local_reduce=False, colocated=shm)))
    local = local_size > 1 and Stage.LOCAL_REDUCE not in dropped
    for owner in (True, False):
        rows.append((f"{local_size} processes per machine, push_pull, {'partition owner' if owner else 'not the owner'}",
                     stage_list(owner=owner, local_size=local_size, local_reduce=local, colocated=False)))
    if local:
        rows.append((f"one worker machine of {local_size} processes, push_pull, partition owner",
                     stage_list(owner=True, local_size=local_size, local_reduce=local, colocated=False, machines=1)))
    for kind, who in (("broadcast", " (root)"), ("broadcast", " (other ranks: empty body)"), ("async push_pull", "")):
        for colocated in (False, True):
            shm = colocated and Stage.STAGE not in dropped and "other" not in who
            rows.append((f"{kind}{who}, {'colocated' if colocated else 'remote'} server",
                         stage_list(owner=True, local_size=local_size, local_reduce=local, colocated=shm, kind=kind)))
    return rows


def situations_text(local_size=2, env=None):
    """The table ``bpslaunch --stages`` prints, with BYTEPS_PIPELINE from ``env`` applied."""
    dropped = from_env(env)
    head = f"pipeline stage lists (core/stages.py), {local_size} processes per machine for the local-reduce rows"
    if dropped:
        head += ", BYTEPS_PIPELINE drops " + ", ".join(sorted(s.label for s in dropped))
    rows = situations(local_size, dropped)
    width = max(len(what) for what, _ in rows)
    lines = [head + ":"] + [f"  {what:<{width}}  {describe(st)}" for what, st in rows]
    lines.append("  CUDA tensors add COPYD2H before and COPYH2D after these (a broadcast's root copies nothing back, "
                 "the other ranks nothing off the GPU); with "
                 "BYTEPS_LOCAL_STRATEGY=topology the machine's plan picks the partitions' owners, and CUDA push_pulls "
                 "on a machine of one GPU per process take the NCCL stages: "
                 + describe(nccl_stage_list(True)) + " (the partition's root), "
                 + describe(nccl_stage_list(False)) + " (the other local ranks)")
    return "\n".join(lines)
