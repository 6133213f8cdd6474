"""Intra-machine aggregation: which local rank owns each partition of a machine's local reduce.

A machine's worker processes sum their copies through shared memory, and only one copy of each
machine's sum crosses the network (the CPU analogue of the paper's §4.2 local reduce). The native
core runs the steps (COORDINATE, LOCAL_REDUCE, PUSH/PULL, LOCAL_BROADCAST:
core/pipeline/worker_local_reduce.h; docs/architecture.md, "Local reduce in the native core"); this
module keeps the plan of owners, which the engine writes into the native core's tables. Owners are
a machine's own choice: servers count one push per machine and key, whoever makes it. With
BYTEPS_LOCAL_STRATEGY=topology the machine's topology plan names them (docs/topology.md).
"""
import dataclasses


def machine_plan(local_size, env=None):
    """This machine's topology plan for ``local_size`` processes (BYTEPS_TOPOLOGY_FILE, the overrides,
    or detection). More processes than GPUs: the CPU analogue's plan (processes by NUMA node)."""
    import byteps.topology as topology

    machine = topology.resolve_machine(env=env)
    if machine.gpus and local_size > len(machine.gpus):
        machine = dataclasses.replace(machine, gpus=(), links=tuple(ln for ln in machine.links if ln.kind == "qpi"))
    return topology.plan(machine=machine, local_size=local_size, env=env)


class LocalPlan:
    """Who owns what on this machine: every local rank in turn ("owners"), local rank 0 ("root",
    BytePS's choice; BYTEPS_LOCAL_PUSH=root; docs/benchmarks.md compares the two), or the machine's
    topology plan (``topology``: a :class:`byteps.topology.strategy.Plan` of this machine's size)."""

    def __init__(self, peers, mode="owners", topology=None):
        self.peers = sorted(peers, key=lambda w: w["local_rank"])  # address-book entries, this machine
        self.size = len(self.peers)
        self.root_only = mode == "root"
        self.topology = topology if topology is not None and topology.local_size == self.size else None

    def owner(self, tkey, partition):
        """The local rank that reduces and pushes partition ``partition`` (its wire index) of tensor
        ``tkey``. Tensors rotate by key, so a model's one-partition tensors spread over the owners."""
        if self.root_only:
            return 0
        if self.topology is not None and self.topology.strategy == "reduce_broadcast":
            return self.topology.root_for(tkey + partition)
        return (tkey + partition) % self.size
