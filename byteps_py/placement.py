"""Which server sums which bytes: the paper's optimal k/n workload split (BytePS §4.1, Eq. 1-7).

:func:`plan` evaluates the model for a job shape (``bpslaunch --plan``); :func:`weights_for_book`
turns an address book into integer server weights; :class:`Placement` cuts each partition over the
servers in those proportions (``BYTEPS_PLACEMENT``: ``balanced`` or ``hash``), as a pure function
of the book, the tensor key and the partition index, so every worker agrees without messages. The
model, both modes and their measurements: docs/placement.md.
"""
import dataclasses
import math
import re
from fractions import Fraction

#: bytes: pieces are cut at multiples of this (a multiple of every element size; a cache line)
ALIGN = 64
#: bytes: smaller pieces of a partition are pooled onto fewer servers (Placement._piece_weights)
MIN_PIECE = 4 << 10
MODES = ("balanced", "hash")
ROLES = ("colocated", "standalone")


# ------------------------------------------------------------------------------------- the model

def shares(n, k):
    """Fractions of the model each standalone and each colocated server sums: (Eq. 1, Eq. 2).

    Edge cases: ``k = 0`` -> (0, 1/n); ``k >= n`` -> (1/k, 0), plain PS; ``n = 1`` -> (0, 1), the
    lone worker's own server sums everything. ``k·standalone + n·colocated == 1`` always.
    """
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 worker machines and k >= 0 extra machines, got n={n}, k={k}")
    cpu, gpu, total = slots(n, k)  # k = n: 2(n-1) slots of 2n(n-1) each, i.e. 1/k
    return Fraction(cpu, total), Fraction(gpu, total)


def slots(n, k):
    """Integer weights of the hash ranges: (per standalone, per colocated, total) with the paper's
    total ``n² + kn - 2k`` when ``1 <= k <= n`` (``n`` for k = 0, ``k`` for k > n, ``1`` for n = 1)."""
    if n == 1:
        return 0, 1, 1
    if k == 0:
        return 0, 1, n
    if k > n:
        return 1, 0, k
    return 2 * (n - 1), n - k, n * n + k * n - 2 * k


def times(n, k, model_bytes, bandwidth):
    """(t_opt, t_allreduce, t_plain_ps) in seconds for one push_pull of ``model_bytes``.

    ``bandwidth`` is each machine's NIC rate, bytes per second, in each direction. t_plain_ps is
    None for k = 0 (no extra machine to run it on). For k > n, t_opt is the k = n value, M/B.
    """
    m, b = float(model_bytes), float(bandwidth)
    if n == 1:
        return 0.0, 0.0, (m / b if k else None)
    ke = min(k, n)
    t_opt = 2 * n * (n - 1) * m / ((n * n + ke * n - 2 * ke) * b)
    t_ar = 2 * (n - 1) * m / (n * b)
    t_ps = max(m / b, n * m / (k * b)) if k else None
    return t_opt, t_ar, t_ps


def gammas(n, k):
    """(γ_a, γ_p) of Eq. 7: speed-up of the optimum over ring all-reduce and over plain PS with
    the same k. γ_p is None for k = 0; for n = 1 γ_a is 1 (nobody needs the network) and γ_p inf."""
    if n == 1:
        return 1.0, (math.inf if k else None)
    ke = min(k, n)
    d = n * n + ke * n - 2 * ke
    ga = d / (n * n)
    gp = None if k == 0 else (d / (2 * ke * (n - 1)) if k <= n else 1.0)
    return ga, gp


@dataclasses.dataclass(frozen=True)
class ServerLoad:
    name: str        #: "worker 0" (colocated) or "extra 0" (standalone)
    role: str        #: "colocated" | "standalone"
    share: float     #: fraction of the model this server sums
    bytes: int       #: model bytes it sums per push_pull (rounded)


@dataclasses.dataclass(frozen=True)
class HostTraffic:
    name: str        #: "worker i" or "extra i"
    tx_bytes: int    #: bytes this machine sends per push_pull of the model (payload only)
    rx_bytes: int    #: bytes it receives


@dataclasses.dataclass(frozen=True)
class Plan:
    """The optimal placement of one job; see :func:`plan`."""

    n: int
    k: int
    model_bytes: int
    bandwidth: float                 #: bytes/s per machine and direction
    standalone_share: float          #: Eq. 1
    colocated_share: float           #: Eq. 2
    servers: tuple                   #: ServerLoad per server, colocated first
    hosts: tuple                     #: HostTraffic per machine
    t_opt: float                     #: seconds, Eq. 6
    t_allreduce: float               #: seconds, ring all-reduce (Table 1)
    t_plain_ps: float                #: seconds, plain PS on the k extra machines (None for k = 0)
    gamma_a: float                   #: Eq. 7
    gamma_p: float                   #: Eq. 7 (None for k = 0)

    def table(self):
        """The plan as text (what ``bpslaunch --plan`` prints)."""
        def f(x, unit=""):
            return "n/a" if x is None else f"{x:.3f}{unit}"
        lines = [f"BytePS placement for n={self.n} worker machines, k={self.k} extra machines, "
                 f"model {_human(self.model_bytes)}, {self.bandwidth * 8 / 1e9:g} Gbit/s per machine",
                 f"  standalone server share (Eq. 1): {float(self.standalone_share):.6f}",
                 f"  colocated server share  (Eq. 2): {float(self.colocated_share):.6f}",
                 "  server        role         share      bytes summed"]
        for s in self.servers:
            lines.append(f"  {s.name:<13} {s.role:<12} {s.share:<10.6f} {s.bytes:>14}")
        lines.append("  machine       sends/push_pull  receives/push_pull")
        for h in self.hosts:
            lines.append(f"  {h.name:<13} {h.tx_bytes:>15} {h.rx_bytes:>19}")
        lines += [f"  t_opt (Eq. 6): {f(self.t_opt, ' s')}   ring all-reduce: {f(self.t_allreduce, ' s')}   "
                  f"plain PS: {f(self.t_plain_ps, ' s')}",
                  f"  gamma_a (vs all-reduce): {f(self.gamma_a)}   gamma_p (vs plain PS): {f(self.gamma_p)}"]
        return "\n".join(lines)


def plan(n, k, model_bytes, bandwidth=1.25e9):
    """The optimal summation workload of a job with ``n`` worker machines (each running a colocated
    server) and ``k`` extra machines (each running a standalone server).

    Args:
        n: worker machines, >= 1.
        k: extra machines, >= 0.
        model_bytes: bytes pushed and pulled by each worker machine per step (M).
        bandwidth: each machine's NIC rate in bytes per second, each direction (B; default 10 Gbit/s).
            :func:`parse_rate` reads "100Mbit", "25Gbit", "1.25GB".

    Returns:
        A :class:`Plan`: per-server share and bytes (Eq. 1-2), per-machine bytes sent and received
        per push_pull, t_opt (Eq. 6), the ring all-reduce and plain PS times of Table 1, and
        γ_a, γ_p (Eq. 7).
    """
    if model_bytes < 0 or not bandwidth > 0:
        raise ValueError("model_bytes must be >= 0 and bandwidth > 0")
    cpu, gpu = shares(n, k)
    m = int(model_bytes)
    servers = [ServerLoad(f"worker {i}", "colocated", float(gpu), round(gpu * m)) for i in range(n)]
    servers += [ServerLoad(f"extra {j}", "standalone", float(cpu), round(cpu * m)) for j in range(k)]
    worker_traffic = round(m + (n - 2) * gpu * m) if n > 1 else 0
    hosts = [HostTraffic(f"worker {i}", worker_traffic, worker_traffic) for i in range(n)]
    hosts += [HostTraffic(f"extra {j}", round(n * cpu * m), round(n * cpu * m)) for j in range(k)]
    t_opt, t_ar, t_ps = times(n, k, m, bandwidth)
    ga, gp = gammas(n, k)
    return Plan(n=n, k=k, model_bytes=m, bandwidth=float(bandwidth), standalone_share=float(cpu),
                colocated_share=float(gpu), servers=tuple(servers), hosts=tuple(hosts), t_opt=t_opt,
                t_allreduce=t_ar, t_plain_ps=t_ps, gamma_a=ga, gamma_p=gp)


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text):
    """Bytes per second from "100Mbit", "10gbit", "1.25GB", "125000000" (plain: bytes/s)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|b|byte|bps)?(?:/s)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a rate from {text!r} (examples: 100Mbit, 25Gbit, 1.25GB)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if m.group(3) in ("bit", "bps"):
        value /= 8
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return value


def parse_bytes(text):
    """Bytes from "64MB", "256MiB", "4096" (decimal and binary suffixes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if not m:
        raise ValueError(f"cannot read a size from {text!r} (examples: 64MB, 256MiB, 4096)")
    power = " kmgt".index(m.group(2) or " ")
    return int(float(m.group(1)) * ((1024 if m.group(3) else 1000) ** power))


def _human(nbytes):
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000


# ------------------------------------------------------------------------- the address book

def server_roles(book):
    """Role of each server of an address book: its BYTEPS_SERVER_ROLE if set, else "colocated"
    when some worker announced the same host address, else "standalone"."""
    worker_hosts = {w["host"] for w in book["workers"]}
    roles = []
    for s in book["servers"]:
        forced = s.get("ss_role", "auto")
        roles.append(forced if forced in ROLES else ("colocated" if s["host"] in worker_hosts else "standalone"))
    return roles


def host_shares(n, colocated_hosts, k):
    """Model share of each colocated host and each standalone host: (standalone, colocated).

    The equal-time solution of §4.1.1 for ``n`` worker machines of which ``colocated_hosts`` run
    servers, and ``k`` server-only machines. With every worker machine serving this is Eq. 1-2.
    """
    c = colocated_hosts
    if c == 0:  # only standalone servers: share evenly
        return Fraction(1, k), Fraction(0)
    if c == n or n == 1:
        return shares(n, k)
    if k == 0:  # only colocated servers
        return Fraction(0), Fraction(1, c)
    if k >= n or n == 2:
        return Fraction(1, k), Fraction(0)
    # hosts without a server move M anyway; standalone n·s = colocated M + (n-2)·s_c, k·s + c·s_c = M
    cpu = Fraction(n - 2 + c, c * n + k * (n - 2))
    gpu = (n * cpu - 1) / (n - 2)
    if gpu < 0:
        return Fraction(1, k), Fraction(0)
    return cpu, gpu


def weights_for_book(book, roles=None):
    """Integer weight of each server (the hash slots it owns; piece sizes are proportional).

    When the book is the paper's layout (one server on each worker machine, k standalone ones),
    these are exactly ``2(n-1)`` per standalone and ``n-k`` per colocated server, total
    ``n² + kn - 2k``. Several servers on one host split that host's share evenly.
    """
    roles = roles or server_roles(book)
    worker_hosts = {w["host"] for w in book["workers"]}
    per_host = {}
    for s, role in zip(book["servers"], roles):
        per_host.setdefault((role, s["host"]), []).append(s)
    n = len(worker_hosts)
    coloc_hosts = {h for (role, h) in per_host if role == "colocated"}
    stand_hosts = {h for (role, h) in per_host if role == "standalone"}
    k = len(stand_hosts)
    if all(len(v) == 1 for v in per_host.values()) and coloc_hosts == worker_hosts:
        cpu_w, gpu_w, _ = slots(n, k)
        return [cpu_w if role == "standalone" else gpu_w for role in roles]
    cpu, gpu = host_shares(n, len(coloc_hosts), k)
    fracs = [(cpu if role == "standalone" else gpu) / len(per_host[(role, s["host"])])
             for s, role in zip(book["servers"], roles)]
    denom = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * denom) for f in fracs]
    g = math.gcd(*ints)
    return [w // g for w in ints]


# ---------------------------------------------------------------------- placing partitions

def at_least_cut(partition_bytes, min_cut_bytes):
    """``partition_bytes``, or the power of two at or above ``min_cut_bytes`` when it is smaller: a balanced
    placement cuts a partition in the exact Eq. 1-2 proportions only from ``Placement.min_cut`` up."""
    if partition_bytes >= min_cut_bytes:
        return partition_bytes
    return 1 << math.ceil(math.log2(min_cut_bytes))


def _mix64(x):
    """splitmix64's finalizer: a fixed 64-bit hash, the same in every process (unlike hash())."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def apportion(nbytes, weights, align=ALIGN):
    """Split ``nbytes`` into ``len(weights)`` consecutive lengths proportional to ``weights``.

    Each cut between two pieces is the exact proportional position rounded to the nearest
    multiple of ``align`` (so on an element boundary for every dtype), hence off by at most half a
    unit, and each length is within one unit of ``nbytes·w/W``. Zero weights get zero bytes; the
    last nonempty piece ends at ``nbytes``, which need not be a multiple of ``align``.
    """
    total = sum(weights)
    lengths, prev, cum = [], 0, 0
    for w in weights:
        cum += w
        # round(nbytes·cum/total / align)·align in integers (half up), never past the end
        cut = min(nbytes, (2 * nbytes * cum + total * align) // (2 * total * align) * align)
        if cum == total:
            cut = nbytes
        lengths.append(cut - prev if w else 0)
        prev = cut if w else prev
    return lengths


class Placement:
    """Where each partition of each tensor goes: built once per epoch from the address book.

    ``partitions(tkey, nbytes, itemsize)`` lists ``(partition index, byte offset, length, server)``
    in the order this worker sends them; ``server(tkey, index)`` names the server of any partition
    index. Both depend only on the book, the mode, the tensor key and the sizes (and, for the
    sending order only, on this worker's rank).
    """

    def __init__(self, weights, mode="balanced", partition_bytes=4096000, rank=0, roles=None, hosts=None,
                 indices=None):
        if mode not in MODES:
            raise ValueError(f"placement mode {mode!r} must be one of {', '.join(MODES)}")
        if not weights or min(weights) < 0 or sum(weights) == 0:
            raise ValueError(f"placement weights {weights} need a positive total")
        self.weights = list(weights)
        self.total = sum(weights)
        self.mode = mode
        self.partition_bytes = partition_bytes
        self.rank = rank
        self.roles = roles or ["colocated"] * len(weights)
        self.hosts = hosts or [""] * len(weights)
        # each position's server index in the job (elastic servers: indices outlive positions), for logs
        self.indices = list(indices) if indices is not None else list(range(len(weights)))
        self.num_servers = len(weights)
        self.active = [s for s, w in enumerate(weights) if w > 0]
        # hash slots: server s owns weights[s] consecutive slots of [0, total)
        self._slot_owner = [s for s, w in enumerate(weights) for _ in range(w)]
        # balanced: partitions this large or larger are cut into one piece per server; below it the
        # smallest piece would be under MIN_PIECE (a message costs more than it balances)
        smallest = min(weights[s] for s in self.active)
        self.min_cut = -(-MIN_PIECE * self.total // smallest)
        self._cache = {}

    @classmethod
    def from_book(cls, book, mode="balanced", partition_bytes=4096000, rank=0):
        roles = server_roles(book)
        return cls(weights_for_book(book, roles), mode, partition_bytes, rank, roles,
                   [s["host"] for s in book["servers"]], [s.get("index", i) for i, s in enumerate(book["servers"])])

    def resized(self, partition_bytes):
        """The same servers and shares with partitions of ``partition_bytes``, or of the power of two at
        or above ``min_cut`` where that is larger (balanced mode; docs/placement.md)."""
        if self.mode == "balanced" and partition_bytes < self.min_cut:
            partition_bytes = at_least_cut(partition_bytes, self.min_cut)
        if partition_bytes == self.partition_bytes:
            return self
        return Placement(self.weights, self.mode, partition_bytes, self.rank, self.roles, self.hosts, self.indices)

    def describe(self):
        parts = [f"server {self.indices[s]} ({self.hosts[s] or '?'}, {self.roles[s]}): {self.weights[s]}/{self.total}"
                 for s in range(self.num_servers)]
        return f"{self.mode} placement: " + ", ".join(parts)

    def shares(self):
        """Fraction of the model each server sums under exact proportions."""
        return [w / self.total for w in self.weights]

    def server(self, tkey, index):
        """The server of partition ``index`` of tensor ``tkey``."""
        if self.mode == "balanced":
            return index % self.num_servers
        return self._slot_owner[_mix64((tkey << 32) | index) % self.total]

    def _piece_weights(self, tkey, j, size):
        """Weights to cut partition j (``size`` bytes) by: the servers' own weights when every piece reaches
        MIN_PIECE; else the servers whose pieces would be smaller pool their bytes into r pieces of about
        MIN_PIECE each (r >= 1), given to r of them picked by systematic sampling over their hash slots
        from an offset hashed from (tensor key, partition): each server's expected bytes stay its
        Eq. 1-2 share, and a small partition's bytes no longer land whole on one server."""
        if size >= self.min_cut:
            return self.weights
        small = [s for s in self.active if size * self.weights[s] < MIN_PIECE * self.total]
        pooled = sum(self.weights[s] for s in small)
        r = max(1, size * pooled // (self.total * MIN_PIECE))
        out = [w * r for w in self.weights]
        slot_owner = [s for s in small for _ in range(self.weights[s])]
        u = _mix64((tkey << 32) | (j ^ 0xFFFFFFFF)) % pooled
        for s in small:
            out[s] = 0
        for i in range(r):  # point i lies in [i*pooled, (i+1)*pooled) of r*pooled units, r units a slot
            out[slot_owner[(u + i * pooled) // r]] += pooled
        return out

    def partitions(self, tkey, nbytes, itemsize):
        """[(index, offset, length, server)] of a tensor of ``nbytes`` bytes (elements of ``itemsize``)."""
        ident = (tkey, nbytes, itemsize)
        got = self._cache.get(ident)
        if got is None:
            got = self._cache[ident] = self._cut(tkey, nbytes, itemsize)
        return got

    def _cut(self, tkey, nbytes, itemsize):
        step = max(itemsize, self.partition_bytes // itemsize * itemsize)
        if self.mode == "hash":
            return [(i, off, min(step, nbytes - off), self.server(tkey, i))
                    for i, off in enumerate(range(0, max(nbytes, 1), step))]
        s_count = self.num_servers
        out = []
        for j, start in enumerate(range(0, max(nbytes, 1), step)):
            size = min(step, nbytes - start)
            lengths = apportion(size, self._piece_weights(tkey, j, size))
            offs = [start + sum(lengths[:s]) for s in range(s_count)]
            # the same order on every worker, never rotated by rank: the credit may let the most urgent
            # tensor out one piece at a time, and rank-rotated orders deadlocked (docs/placement.md)
            first = (tkey + j) % s_count
            for s in (*range(first, s_count), *range(first)):
                if lengths[s]:
                    out.append((j * s_count + s, offs[s], lengths[s], s))
        return out

    def server_bytes(self, tensors):
        """Bytes each server sums for tensors given as (tkey, nbytes, itemsize)."""
        load = [0] * self.num_servers
        for tkey, nbytes, itemsize in tensors:
            for _, _, length, s in self.partitions(tkey, nbytes, itemsize):
                load[s] += length
        return load


def expected_traffic(server_bytes, server_hosts, worker_hosts):
    """Bytes each host sends (= receives) per push_pull, from the bytes each server sums.

    A worker pushes every byte not summed on its own host and pulls it back; a server receives
    its bytes from every worker host but its own and answers each. ``server_hosts[s]`` is server
    s's host; ``worker_hosts`` lists the worker machines' hosts (one worker machine per host; a host
    listed once per process counts once).
    """
    worker_hosts = list(dict.fromkeys(worker_hosts))
    model = sum(server_bytes)
    traffic = {h: 0 for h in [*worker_hosts, *server_hosts]}
    for h in worker_hosts:
        traffic[h] += model - sum(b for b, sh in zip(server_bytes, server_hosts) if sh == h)
    for b, sh in zip(server_bytes, server_hosts):
        traffic[sh] += b * sum(1 for h in worker_hosts if h != sh)
    return traffic
