"""Environment configuration: every DMLC_*/BYTEPS_* variable is parsed and validated here.

One place reads the environment so that a missing or malformed variable always gives the
same clear ConfigError naming the variable, and docs/env.md can be checked against
:data:`VARIABLES`.
"""
import dataclasses
import os
import socket

from . import cpus
from .errors import ConfigError
from .log import logger, parse_level

ROLES = ("scheduler", "server", "worker")

#: name -> (default, one-line meaning); the table in docs/env.md is written from this.
VARIABLES = {
    "DMLC_ROLE": ("worker", "scheduler | server | worker"),
    "DMLC_NUM_WORKER": (None, "number of worker machines"),
    "DMLC_NUM_SERVER": (None, "number of Summation Service servers"),
    "DMLC_PS_ROOT_URI": (None, "scheduler IP address or host name"),
    "DMLC_PS_ROOT_PORT": (None, "scheduler TCP port"),
    "DMLC_WORKER_ID": (None, "this worker machine's id, 0..DMLC_NUM_WORKER-1"),
    "DMLC_NODE_HOST": (None, "IP address this node binds to and announces"),
    "DMLC_INTERFACE": (None, "network interface whose IPv4 address this node uses"),
    "BYTEPS_LOCAL_RANK": ("0", "rank of this process on its machine"),
    "BYTEPS_LOCAL_SIZE": ("1", "worker processes on this machine"),
    "BYTEPS_PARTITION_BYTES": ("4096000", "largest partition of a tensor sent as one message"),
    "BYTEPS_LOG_LEVEL": ("WARNING", "TRACE | DEBUG | INFO | WARNING | ERROR | FATAL"),
    "BYTEPS_FORCE_DISTRIBUTED": ("0", "use the Summation Service even with a single worker process"),
    "BYTEPS_ENABLE_IPC": ("1", "exchange data with servers on the same machine through shared memory"),
    "BYTEPS_LOCAL_REDUCE": ("1", "a machine's worker processes sum locally; one copy per machine crosses the network"),
    "BYTEPS_LOCAL_PUSH": ("owners", "owners | root: which local processes sum and push a machine's partitions"),
    "BYTEPS_LOCAL_STRATEGY": ("owners", "owners | topology: local sums' owners in turn, or named by the machine's "
                                        "topology plan (core/local.py; CUDA push_pulls on a machine of GPUs: its NCCL stages)"),
    "BYTEPS_SCHEDULING_CREDIT": ("4", "partitions a worker may have on the wire at once (0: unlimited)"),
    "BYTEPS_TIMEOUT": ("300", "seconds any blocking wait (startup, declaration, push_pull) may last"),
    "BYTEPS_HEARTBEAT_INTERVAL": ("1", "seconds between heartbeats to and from the scheduler"),
    "BYTEPS_HEARTBEAT_TIMEOUT": ("15", "seconds of silence after which a peer is declared lost"),
    "BYTEPS_JOB_ID": ("", "job identifier used in logs and local resource names (bpslaunch sets it)"),
    "BYTEPS_JOB_SECRET": ("", "per-job secret every connection proves it knows (HMAC challenge-response)"),
    "BYTEPS_PLACEMENT": ("balanced", "balanced | hash: how partitions are split over servers (byteps/placement.py)"),
    "BYTEPS_SERVER_ROLE": ("auto", "auto | colocated | standalone: a server's role in the k/n workload split"),
    "BYTEPS_FUSION": ("0", "1: DistributedOptimizer sends gradients through balanced fusion buffers (byteps/fusion.py)"),
    "BYTEPS_SERVER_ENGINE_THREAD": ("0", "server threads that sum pushes (0: the network thread sums inline)"),
    "BYTEPS_ENABLE_ASYNC": ("0", "asynchronous training: servers keep the parameters, workers push deltas, no barrier"),
    "BYTEPS_ELASTIC": ("0", "1: the job survives losing Summation Service servers (not the last) and admits servers that join mid-job; set it on every node (docs/elastic.md)"),
    "BYTEPS_TRANSPORT": ("auto", "what carries a worker's direct links to servers: tcp (core/transport/bps_link.h), ucx (UCP Active Messages, core/transport/bps_ucx.h: verbs on an RDMA NIC) or auto (ucx when this machine has an RDMA device and UCX loads, else tcp); docs/ucx.md"),
    "BYTEPS_UCX_PEER_ERRORS": ("1", "with BYTEPS_TRANSPORT=ucx: 1 asks UCX to detect dead peers (endpoint error handling), which rules out its shared-memory transports; 0 lets UCX use sm too (a dead peer is then reported by the scheduler alone); docs/ucx.md"),
    "BYTEPS_SPIN_US": ("auto", "microseconds a synchronous call of one small partition polls for its reply (yielding its core between polls) before it sleeps; auto: 50 where this process may run on 2 or more CPUs, 200 where the job's worker processes on this host also outnumber those CPUs, else 0 (core/pipeline/bps_worker.h set_direct_spin)"),
    "BYTEPS_CUDART": (None, "path of the CUDA runtime library the native core copies CUDA tensors with (default: the libcudart of PyTorch's CUDA wheels, else the system's)"),
    "BYTEPS_NCCL": (None, "path of the NCCL library of the NCCL stages (BYTEPS_LOCAL_STRATEGY=topology on a machine of several GPUs; default: the libnccl of PyTorch's CUDA wheels, else the system's)"),
    "BYTEPS_GPU_STAGING_BYTES": ("67108864", "page-locked host memory for CUDA tensors' partitions in flight: slots of one partition each"),
    "BYTEPS_CPU_BIND": ("auto", "auto | 1 | 0: bind each worker process's training thread (the one that called init()) to one CPU, the host's i-th worker process of the job to the i-th CPU it may use; auto: only where the job's worker processes on this host (2 or more) are at least as many as those CPUs, so that threads that poll (BYTEPS_SPIN_US) are not left sharing one CPU by the kernel's scheduler (byteps/cpus.py)"),
    # the job timeline (docs/timeline.md)
    "BYTEPS_TIMELINE": ("", "path of one Chrome/Perfetto trace of the whole job, written by the scheduler (empty: off)"),
    "BYTEPS_TIMELINE_FLUSH_STEPS": ("50", "workers send their spans to the scheduler every N steps (0: only at the end)"),
    "BYTEPS_TIMELINE_BUFFER": ("250000", "spans each process holds between sends; more are dropped and counted"),
    "BYTEPS_TIMELINE_CLOCK_INTERVAL": ("2", "seconds between clock probes to the scheduler while tracing"),
    # read outside this module, listed so docs/env.md stays complete
    "BYTEPS_PIPELINE": ("", "optional pipeline stages to drop, e.g. -stage,-local_reduce (core/stages.py)"),
    # wire compression, read by byteps_py/compression.py (docs/compression.md)
    "BYTEPS_COMPRESSOR": ("none", "job-wide wire compressor: none | fp16 | bf16 | onebit | topk | randomk | dithering"),
    "BYTEPS_COMPRESSOR_K": ("0.01 / 7", "topk/randomk: fraction (<1) or count of elements sent; dithering: levels"),
    "BYTEPS_ERROR_FEEDBACK": ("0", "1: keep what compression lost on the worker and add it to the next round"),
    "BYTEPS_MOMENTUM_MU": ("0", "momentum correction on the worker before compressing (0: off)"),
    "BYTEPS_COMPRESSOR_SEED": ("0", "seed of randomk/dithering's random streams; the same on every worker"),
    "BYTEPS_MIN_COMPRESS_BYTES": ("65536", "tensors smaller than this are never compressed"),
    # intra-machine topology, read by topology/ (docs/topology.md)
    "BYTEPS_TOPOLOGY_FILE": ("", "machine description (JSON) to plan for instead of detecting this machine"),
    "BYTEPS_INTRA_STRATEGY": ("auto", "auto | reduce_broadcast | reduce_scatter | cpu_assisted: force the local strategy"),
    "BYTEPS_REDUCE_ROOTS": ("", "comma-separated local ranks used as reduce/broadcast roots (forces reduce_broadcast)"),
    "BYTEPS_PCIE_SWITCH_SIZE": ("", "GPUs (or processes) per PCIe switch group, overriding detection"),
    "BYTEPS_LOG_HIDE_TIME": ("0", "1 drops the timestamp from log lines"),
    "BYTEPS_OMP_THREAD_PER_GPU": ("clamp(cores // 4, 1, 4)", "threads of the summation kernels, 1..64 "
                                  "(core/_reduce.pyx default_threads)"),
    "BYTEPS_SCHEDULER_PORT_FILE": ("", "scheduler writes its bound port here (bpslaunch --local)"),
    # read by byteps_py/launch_env.py for torchrun / mpirun / horovodrun jobs (docs/launchers.md)
    "BYTEPS_SCHEDULER_URI": ("", "scheduler host for mpirun/horovodrun jobs (default MASTER_ADDR or rank 0's host)"),
    "BYTEPS_SERVICES_EXIT_TIMEOUT": ("30", "seconds rank 0 waits at exit for the scheduler/server it started"),
    "BYTEPS_LAUNCHER": ("", "set by byteps: which launcher's environment was translated (informational)"),
}

#: variables that chose between two data planes, each now the only one: a set one is ignored with a warning
REMOVED = {
    "BYTEPS_ZMQ_DIRECT": "ZeroMQ carries the control plane only, and partitions always go over direct links",
    "BYTEPS_NATIVE": "workers and servers always run plain push_pulls and broadcasts in their native cores",
    "BYTEPS_NATIVE_LOCAL": "the local reduce of plain push_pulls always runs in the native core",
    "BYTEPS_DIRECT_TCP": "workers' data to servers always goes over direct links (BYTEPS_TRANSPORT: tcp or ucx)",
    "BYTEPS_LOCAL_LINKS": "a machine's worker processes always send each other the local reduce's messages over direct links",
    "BYTEPS_LOCAL_RINGS": "a local link's bytes always go through shared-memory rings where they can be mapped",
}
_warned_removed = set()


def _warn_removed(env):
    """Say once per process that a removed variable is set and has no effect (the results were the same
    either way: the variables chose only which code moved the bytes)."""
    for name, now in REMOVED.items():
        if _get(env, name) is not None and name not in _warned_removed:
            _warned_removed.add(name)
            logger.warning("%s no longer exists and is ignored: %s (docs/env.md, \"Removed variables\")", name, now)


def _get(env, name, default=None):
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


def _int(env, name, default=None, minimum=None, maximum=None, required=False):
    raw = _get(env, name)
    if raw is None:
        if required:
            raise ConfigError(f"{name} is not set; it is required here ({VARIABLES[name][1]}). See docs/env.md.")
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer ({VARIABLES[name][1]})") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum} ({VARIABLES[name][1]})")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value} must be <= {maximum} ({VARIABLES[name][1]})")
    return value


def _float(env, name):
    """A number of seconds above 0; unset: its default in VARIABLES."""
    raw = _get(env, name, VARIABLES[name][0])
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number ({VARIABLES[name][1]})") from None
    if not value > 0:
        raise ConfigError(f"{name}={raw} must be > 0.0 ({VARIABLES[name][1]})")
    return value


#: BYTEPS_SPIN_US=auto where the process may run on 2 or more CPUs (docs/env.md has the measurements)
AUTO_SPIN_US = 50
#: ... and where the job's worker processes on this host outnumber its CPUs
AUTO_SPIN_SHARED_US = 200


def auto_spin_us(processes):
    """BYTEPS_SPIN_US=auto for ``processes`` worker processes on this host."""
    ncpus = len(cpus.usable_cpus())
    if ncpus < 2:
        return 0
    return AUTO_SPIN_SHARED_US if processes > ncpus else AUTO_SPIN_US


def _bool(env, name, default="0"):
    raw = (_get(env, name, default)).lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 0 or 1)")


def _choice(env, name, allowed):
    value = _get(env, name, allowed[0]).lower()
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} must be one of {', '.join(allowed)}")
    return value


def interface_address(name):
    """IPv4 address of network interface `name` (DMLC_INTERFACE)."""
    import psutil

    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise ConfigError(f"DMLC_INTERFACE={name!r}: no such interface (have: {', '.join(sorted(addrs))})")
    for a in addrs[name]:
        if a.family == socket.AF_INET:
            return a.address
    raise ConfigError(f"DMLC_INTERFACE={name!r} has no IPv4 address")


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated view of the environment for one byteps process."""

    role: str
    num_worker: int
    num_server: int
    root_uri: str
    root_port: int
    worker_id: int
    node_host: str
    local_rank: int
    local_size: int
    partition_bytes: int
    log_level: int
    force_distributed: bool
    scheduling_credit: int
    enable_ipc: bool
    local_reduce: bool
    local_push: str
    timeout: float
    heartbeat_interval: float
    heartbeat_timeout: float
    job_id: str
    placement: str = "balanced"
    server_role: str = "auto"
    enable_async: bool = False
    server_engine_threads: int = 0
    fusion: bool = False
    local_strategy: str = "owners"
    timeline: str = ""
    timeline_flush_steps: int = 50
    timeline_buffer: int = 250000
    timeline_clock_interval: float = 2.0
    transport: str = "auto"
    ucx_peer_errors: bool = True
    elastic: bool = False
    spin_us: int = 0
    spin_auto: bool = False
    cpu_bind: str = "auto"
    cudart: str = ""
    nccl: str = ""
    gpu_staging_bytes: int = 64 << 20

    @property
    def distributed(self):
        """True when push_pull goes through the Summation Service."""
        return self.force_distributed or self.num_worker * self.local_size > 1

    @property
    def scheduler_endpoint(self):
        return f"tcp://{self.root_uri}:{self.root_port}"


def load(env=None, role=None):
    """Parse and validate the environment; raise ConfigError naming the first bad variable.

    A worker started with no DMLC_* variable at all runs alone (rank 0 of 1), so a training
    script also runs unchanged with plain ``python train.py``.
    """
    env = os.environ if env is None else env
    from .launch_env import translate  # torchrun / mpirun / horovodrun variables -> DMLC_* (docs/launchers.md)
    env = translate(env, role)
    role = role or _get(env, "DMLC_ROLE", "worker").lower()
    if role not in ROLES:
        raise ConfigError(f"DMLC_ROLE={role!r} must be one of {', '.join(ROLES)}")
    try:
        log_level = parse_level(_get(env, "BYTEPS_LOG_LEVEL"))
    except ValueError as e:
        raise ConfigError(str(e)) from None

    standalone = role == "worker" and not any(k.startswith("DMLC_") and k != "DMLC_ROLE" for k in env)
    local_size = _int(env, "BYTEPS_LOCAL_SIZE", 1, minimum=1)
    local_rank = _int(env, "BYTEPS_LOCAL_RANK", 0, minimum=0)
    if local_rank >= local_size:
        raise ConfigError(f"BYTEPS_LOCAL_RANK={local_rank} must be < BYTEPS_LOCAL_SIZE={local_size}")
    force = _bool(env, "BYTEPS_FORCE_DISTRIBUTED")
    # a server learns the job's size from the scheduler's address book: it needs only the scheduler's
    # address (an elastic server joining a running job: bpslaunch --join)
    num_worker = 1 if standalone else _int(env, "DMLC_NUM_WORKER", required=role != "server", default=1, minimum=1)
    distributed = force or num_worker * local_size > 1 or role != "worker"
    if distributed:
        num_server = _int(env, "DMLC_NUM_SERVER", required=role != "server", default=1, minimum=1)
        root_uri = _get(env, "DMLC_PS_ROOT_URI")
        if root_uri is None:
            raise ConfigError("DMLC_PS_ROOT_URI is not set; it is required here (scheduler address). See docs/env.md.")
        # only the scheduler may be given port 0 (bind any free port; bpslaunch --local uses this)
        root_port = _int(env, "DMLC_PS_ROOT_PORT", required=True, minimum=0 if role == "scheduler" else 1,
                         maximum=65535)
    else:
        num_server = _int(env, "DMLC_NUM_SERVER", 0, minimum=0)
        root_uri, root_port = _get(env, "DMLC_PS_ROOT_URI", "127.0.0.1"), _int(env, "DMLC_PS_ROOT_PORT", 0,
                                                                             minimum=0, maximum=65535)
    worker_id = 0
    if role == "worker" and not standalone:
        worker_id = _int(env, "DMLC_WORKER_ID", required=distributed, default=0, minimum=0)
        if worker_id >= num_worker:
            raise ConfigError(f"DMLC_WORKER_ID={worker_id} must be < DMLC_NUM_WORKER={num_worker}")

    node_host = _get(env, "DMLC_NODE_HOST")
    if node_host is None and _get(env, "DMLC_INTERFACE"):
        node_host = interface_address(_get(env, "DMLC_INTERFACE"))
    if node_host is None:
        # Single-host jobs (the scheduler on loopback) stay on loopback; otherwise the address
        # that routes to the scheduler, never 0.0.0.0.
        node_host = _route_address(root_uri) if distributed else "127.0.0.1"

    from byteps.core.stages import parse_override
    parse_override(_get(env, "BYTEPS_PIPELINE", ""))  # fail at start-up, naming the bad stage
    # read by the kernels when they load (core/_reduce.pyx); checked here so a bad value stops start-up
    _int(env, "BYTEPS_OMP_THREAD_PER_GPU", None, minimum=1, maximum=64)

    timeout = _float(env, "BYTEPS_TIMEOUT")
    hb_interval = _float(env, "BYTEPS_HEARTBEAT_INTERVAL")
    hb_timeout = _float(env, "BYTEPS_HEARTBEAT_TIMEOUT")
    if hb_timeout <= hb_interval:
        raise ConfigError(f"BYTEPS_HEARTBEAT_TIMEOUT={hb_timeout} must exceed BYTEPS_HEARTBEAT_INTERVAL={hb_interval}")
    elastic = _bool(env, "BYTEPS_ELASTIC")
    if elastic and _bool(env, "BYTEPS_ENABLE_ASYNC"):
        # asynchronous servers hold the parameters: losing one would lose them (docs/elastic.md)
        raise ConfigError("BYTEPS_ELASTIC=1 cannot be combined with BYTEPS_ENABLE_ASYNC=1: in asynchronous training "
                          "the servers hold the model's parameters, so a lost server would lose them; use "
                          "synchronous training for elastic servers")
    _warn_removed(env)
    # auto: for the machine's local_size processes here, and again by the engine once it knows how many of
    # the job's worker processes share this host
    spin_auto = _get(env, "BYTEPS_SPIN_US", "auto").lower() == "auto"
    spin_us = auto_spin_us(local_size) if spin_auto else _int(env, "BYTEPS_SPIN_US", minimum=0, maximum=100_000)
    return Config(
        role=role, num_worker=num_worker, num_server=num_server, root_uri=root_uri, root_port=root_port,
        worker_id=worker_id, node_host=node_host, local_rank=local_rank, local_size=local_size,
        partition_bytes=_int(env, "BYTEPS_PARTITION_BYTES", 4096000, minimum=64),
        log_level=log_level, force_distributed=force,
        scheduling_credit=_int(env, "BYTEPS_SCHEDULING_CREDIT", 4, minimum=0),
        enable_ipc=_bool(env, "BYTEPS_ENABLE_IPC", default="1"),
        local_reduce=_bool(env, "BYTEPS_LOCAL_REDUCE", default="1"),
        local_push=_choice(env, "BYTEPS_LOCAL_PUSH", ("owners", "root")), timeout=timeout, heartbeat_interval=hb_interval,
        heartbeat_timeout=hb_timeout, job_id=_get(env, "BYTEPS_JOB_ID", ""),
        placement=_choice(env, "BYTEPS_PLACEMENT", ("balanced", "hash")),
        server_role=_choice(env, "BYTEPS_SERVER_ROLE", ("auto", "colocated", "standalone")),
        enable_async=_bool(env, "BYTEPS_ENABLE_ASYNC"),
        server_engine_threads=_int(env, "BYTEPS_SERVER_ENGINE_THREAD", 0, minimum=0, maximum=64),
        fusion=_bool(env, "BYTEPS_FUSION"),
        local_strategy=_choice(env, "BYTEPS_LOCAL_STRATEGY", ("owners", "topology")),
        timeline=_get(env, "BYTEPS_TIMELINE", ""),
        timeline_flush_steps=_int(env, "BYTEPS_TIMELINE_FLUSH_STEPS", 50, minimum=0),
        timeline_buffer=_int(env, "BYTEPS_TIMELINE_BUFFER", 250000, minimum=1),
        timeline_clock_interval=_float(env, "BYTEPS_TIMELINE_CLOCK_INTERVAL"),
        transport=_choice(env, "BYTEPS_TRANSPORT", ("auto", "tcp", "ucx")),
        ucx_peer_errors=_bool(env, "BYTEPS_UCX_PEER_ERRORS", default="1"),  # read by core/transport/bps_ucx.h
        elastic=elastic,
        spin_us=spin_us,
        spin_auto=spin_auto,
        cpu_bind=_choice(env, "BYTEPS_CPU_BIND", ["auto", "1", "0"]),
        cudart=_get(env, "BYTEPS_CUDART", ""),
        nccl=_get(env, "BYTEPS_NCCL", ""),
        gpu_staging_bytes=_int(env, "BYTEPS_GPU_STAGING_BYTES", 64 << 20, minimum=1),
    )


def _route_address(remote):
    """The local IPv4 address the kernel would use to reach `remote` (no packet is sent)."""
    try:
        remote_ip = socket.gethostbyname(remote)
    except OSError:
        raise ConfigError(f"DMLC_PS_ROOT_URI={remote!r} does not resolve") from None
    if remote_ip.startswith("127."):
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((remote_ip, 9))
        return s.getsockname()[0]
    except OSError:
        raise ConfigError(f"no route to the scheduler at DMLC_PS_ROOT_URI={remote!r}; "
                          "set DMLC_NODE_HOST or DMLC_INTERFACE") from None
    finally:
        s.close()
