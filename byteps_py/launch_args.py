"""bpslaunch's command line: its options, their checks, and the help text of its modes."""
# Licensed under the Apache License, Version 2.0.
import argparse

_EPILOG = """\
modes:
  local    Run a complete job on this machine: 1 scheduler, S servers (default W: a
           Summation Service per worker machine) and W worker machines of L processes
           each running CMD (W*L processes of CMD in all).
           Every child gets DMLC_* and BYTEPS_* variables, including DMLC_WORKER_ID,
           BYTEPS_LOCAL_RANK and BYTEPS_LOCAL_SIZE for the workers.
             bpslaunch --local --workers 2 --servers 1 --local-size 2 -- python train.py --lr 0.1

  role     BytePS-compatible: one bpslaunch per role per machine, configured by the
           environment (see docs/env.md). DMLC_ROLE=scheduler or server runs that service
           (CMD is ignored); DMLC_ROLE=worker runs BYTEPS_LOCAL_SIZE local processes of CMD
           (default: the number of NVIDIA_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES, else 1).
             DMLC_ROLE=worker DMLC_WORKER_ID=0 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 \\
             DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 bpslaunch python train.py

  slurm    Under srun (one task per node, or one per worker process): roles, ranks and the
           scheduler address come from SLURM_*; the last K nodes run only a server.
             srun --ntasks-per-node=1 bpslaunch --slurm --server-nodes 1 -- python train.py

  k8s      In a pod of examples/kubernetes/: DMLC_WORKER_ID from the pod's index, DMLC_NODE_HOST
           from POD_IP, the rest from the manifest; then as role mode.

  join     An extra Summation Service server for a running elastic job (BYTEPS_ELASTIC=1), e.g.
           on a spot CPU machine: it needs the scheduler's address and the job's secret only.
             BYTEPS_JOB_SECRET=... bpslaunch --join 10.0.0.1:9000

CMD runs directly as an argument list, without a shell; write `--` before it to end
bpslaunch's own options (`bpslaunch --local --workers 2 -- python train.py`). A single quoted
CMD with spaces or shell syntax (`bpslaunch "python3 train.py --lr 0.1"`, as BytePS's docs
write it) runs through /bin/sh -c, as BytePS's launcher does. Each output line is prefixed
with its process, e.g. "[worker 0.1] ", "[server 0] ", "[scheduler] ", unless --no-prefix.

exit status: 0 on success; the first failing process's code (128+N if killed by signal N);
124 on --timeout; 130/143 on SIGINT/SIGTERM; 2 on a usage or environment error.
"""


def _positive(kind):
    """An argparse type: a ``kind`` (int or float) above 0."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>= 1' if kind is int else '> 0'}")
        return value

    return parse


def _parser():
    p = argparse.ArgumentParser(
        prog="bpslaunch", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Launch the processes of a byteps job: a whole job on one machine (--local), "
                    "or this machine's part of a multi-machine job, by DMLC_ROLE (role mode).")
    p.add_argument("--local", action="store_true",
                   help="run scheduler, servers and workers on this machine")
    p.add_argument("--workers", type=_positive(int), metavar="W",
                   help="worker machines to simulate (--local only; required there)")
    p.add_argument("--servers", type=_positive(int), metavar="S",
                   help="Summation Service servers (--local only; default W, one per worker machine)")
    p.add_argument("--local-size", type=_positive(int), metavar="L",
                   help="processes of CMD per worker machine (default 1 with --local; in role "
                        "mode overrides BYTEPS_LOCAL_SIZE)")
    p.add_argument("--slurm", action="store_true",
                   help="run this Slurm task's part of the job (under srun): roles, ranks and the scheduler "
                        "address from SLURM_* (docs/slurm.md)")
    p.add_argument("--server-nodes", type=int, default=0, metavar="K",
                   help="--slurm: the step's last K nodes run only a standalone server (default 0)")
    p.add_argument("--k8s", action="store_true",
                   help="run this Kubernetes pod's role: DMLC_WORKER_ID from the pod index, DMLC_NODE_HOST "
                        "from POD_IP (docs/kubernetes.md)")
    p.add_argument("--join", metavar="HOST:PORT",
                   help="run a Summation Service server that joins the running elastic job whose scheduler is at "
                        "HOST:PORT (BYTEPS_ELASTIC=1 there); it needs only the job's BYTEPS_JOB_SECRET "
                        "(docs/elastic.md)")
    p.add_argument("--timeout", type=_positive(float), metavar="SEC",
                   help="wall-clock limit for the whole job; on expiry everything is stopped "
                        "and bpslaunch exits 124")
    p.add_argument("--grace", type=float, default=30.0, metavar="SEC",
                   help="after all workers succeeded, how long the scheduler and servers may "
                        "take to exit on their own before they are terminated (default 30)")
    p.add_argument("--timeline", metavar="PATH",
                   help="write one Chrome/Perfetto trace of the whole job to PATH (sets BYTEPS_TIMELINE for every "
                        "process; docs/timeline.md)")
    p.add_argument("--no-prefix", dest="prefix", action="store_false",
                   help="pass the children's output through unchanged instead of prefixing "
                        "each line with its process tag")
    diag = p.add_argument_group("placement diagnostics (byteps.placement.plan; starts nothing)")
    diag.add_argument("--plan", action="store_true",
                      help="print the optimal k/n split of the BytePS paper (Eq. 1-7): bytes each server "
                           "sums, bytes each machine sends and receives, t_opt, gamma_a, gamma_p")
    diag.add_argument("--worker-machines", type=_positive(int), default=None, metavar="N",
                      help="worker machines, each with a colocated server (--plan; default DMLC_NUM_WORKER)")
    diag.add_argument("--extra", type=int, default=0, metavar="K",
                      help="extra machines, each with a standalone server (--plan; default 0)")
    diag.add_argument("--model-bytes", default="256MB", metavar="SIZE",
                      help="bytes pushed per step, e.g. 64MB, 256MiB (--plan; default 256MB)")
    diag.add_argument("--bandwidth", default="10Gbit", metavar="RATE",
                      help="each machine's NIC rate per direction, e.g. 100Mbit, 25Gbit (--plan; default 10Gbit)")
    diag.add_argument("--latency", default="100us", metavar="TIME",
                      help="round trip between machines, e.g. 50us, 2ms (--plan: the partition size and "
                           "credit of byteps/autotune.py; default 100us)")
    p.add_argument("--stages", action="store_true",
                   help="print the pipeline stage list of a partition in each situation (core/stages.py), "
                        "with BYTEPS_PIPELINE applied; --local-size sets the processes per machine (default 2)")
    p.add_argument("--topology", nargs="?", const="", default=None, metavar="FILE",
                   help="print the intra-machine aggregation plan of docs/topology.md (strategy and why, "
                        "per-link traffic, J, x*, ring all-reduce) for this machine, or for a machine "
                        "description FILE or fixture name, and exit; --local-size sets the processes")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="the worker command and its arguments (put -- before it)")
    return p


#: a lone CMD containing one of these is a shell command line (BytePS's ``bpslaunch "python3 train.py"``)
_SHELL_CHARS = frozenset(" \t\n;&|<>()$`'\"*?~")


def parse(argv):
    """(options, worker command) from bpslaunch's arguments; argparse exits 2 on a usage error."""
    parser = _parser()
    opts = parser.parse_args(argv)
    command = list(opts.command)
    if command and command[0] == "--":
        command = command[1:]
    if len(command) == 1 and any(c in command[0] for c in _SHELL_CHARS):
        command = ["/bin/sh", "-c", command[0]]  # BytePS: one quoted command string, run by a shell
    if sum((opts.local, opts.slurm, opts.k8s, opts.join is not None)) > 1:
        parser.error("--local, --slurm, --k8s and --join are different modes; give one")
    if opts.join is not None:
        host, _, port = opts.join.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--join {opts.join!r}: expected the scheduler's HOST:PORT, e.g. 10.0.0.1:9000")
    if opts.server_nodes and not opts.slurm:
        parser.error("--server-nodes only applies with --slurm")
    if opts.server_nodes < 0:
        parser.error("--server-nodes must be >= 0")
    if opts.local and opts.workers is None:
        parser.error("--local needs --workers W")
    if not opts.local and (opts.workers is not None or opts.servers is not None):
        parser.error("--workers/--servers only apply with --local (role mode reads DMLC_NUM_WORKER/"
                     "DMLC_NUM_SERVER)")
    if opts.grace < 0:
        parser.error("--grace must be >= 0")
    return opts, command

