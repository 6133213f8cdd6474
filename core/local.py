"""Intra-machine aggregation: a machine's worker processes sum through shared memory, and only one
copy of each machine's sum crosses the network (the CPU analogue of the paper's §4.2 local
reduce, with §6.2's shared memory).

Partition ``i`` of tensor key ``t`` is owned by local rank ``(t + i) % L``, so the partitions of a
tensor, and single-partition tensors across a model, spread over the machine's processes (a
reduce-scatter at partition granularity); BYTEPS_LOCAL_PUSH=root makes local rank 0 own all. For each partition and round:

1. COORDINATE: every other local rank copies its partition into its shared staging region and
   sends the owner LOCAL_READY with a descriptor of it.
2. LOCAL_REDUCE: once all L copies are there, the owner sums them
   (``sum_many``, fp16/bf16 accumulated in fp32 and rounded once) into the owner's staging region.
3. PUSH / PULL: the owner pushes the machine's sum to the partition's server (shared memory if
   the server is on this machine, TCP otherwise); the server expects one push per machine.
4. LOCAL_BROADCAST: the owner sends LOCAL_DONE with a descriptor of the result (its staging
   region, or the colocated server's store) to the others; every process copies it into its tensor.

A staging region is reused by the next round only after everyone has moved on: a process sends
LOCAL_READY for round r+1 only once it has copied out round r.

The native core runs these steps (core/pipeline/worker_local_reduce.h): the network thread
byteps-net owns the local sockets, and the sums and copies of partitions >= 256 KB run on its
stage thread (byteps-reduce), by priority. A process in join() adds nothing but still owns its
partitions of its peers' ops: its core reduces their copies and hands the result back. This
module keeps the plan: which local rank owns each partition (the engine writes it into the
native core's tables).

With BYTEPS_LOCAL_STRATEGY=topology the machine's topology plan (docs/topology.md) names the owners
of host tensors' partitions, on the same native steps: ``reduce_broadcast`` gives every partition to
one of the plan's roots in turn (the other processes never push). ``reduce_scatter`` and
``cpu_assisted`` keep every local rank in turn: that is a reduce-scatter at partition granularity,
and on the CPU, where every group of the plan is the same memory, the owner sums all the machine's
copies at once (contiguous slices, which NCCL's reduce-scatter needs, gained nothing on the CPU:
docs/benchmarks.md). CUDA push_pulls on a machine whose plan has a GPU per process take the NCCL
stages instead (core/pipeline/nccl_stages.h), with these owners as their roots. Owners are a
machine's own choice: servers count one push per machine and key, whoever makes it, so machines of
other plans (or strategies) work together.
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

    def __init__(self, peers, my_local_rank, mode="owners", topology=None):
        self.peers = sorted(peers, key=lambda w: w["local_rank"])  # address-book entries, this machine
        self.size = len(self.peers)
        self.local_rank = my_local_rank
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
