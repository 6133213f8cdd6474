/* The pipeline's stages: one list for the native cores, core/stages.py (``Stage``) and the job
 * timeline's span kinds (byteps_py/timeline/spans.py); tests/test_stages_cli.py keeps the three equal.
 *
 * Each partition goes through an ordered list of these, built by bps_stage_list() (the rule
 * ``bpslaunch --stages`` prints). The span-only kinds (QUEUE and the server's RECV, SUM, ROUND,
 * REPLY) time waits and the server's side of a round, which are not steps of a partition's list.
 */
#pragma once

#include <cstdint>

enum BpsStage : int32_t {
    BPS_STAGE_QUEUE = 1,            /* span: submitted -> taken off the priority queue (credit) */
    BPS_STAGE_STAGE = 2,            /* copy into the shared staging region of a colocated server */
    BPS_STAGE_PUSH = 3,             /* handed to the transport -> the server's reply arrived */
    BPS_STAGE_PULL = 4,             /* the reply copied into the tensor */
    BPS_STAGE_COORDINATE = 5,       /* not the owner: copy to shm + LOCAL_READY -> LOCAL_DONE */
    BPS_STAGE_LOCAL_REDUCE = 6,     /* the owner sums the machine's copies */
    BPS_STAGE_LOCAL_BROADCAST = 7,  /* the machine's result copied back into every tensor */
    BPS_STAGE_RECV = 8,             /* span, server: one push taken in (checks, held or summed inline) */
    BPS_STAGE_SUM = 9,              /* span, server: one summation into the round's store */
    BPS_STAGE_ROUND = 10,           /* span, server: first push of a round -> last push summed */
    BPS_STAGE_REPLY = 11,           /* span, server: replies of a round handed to the transport */
    BPS_STAGE_COPYD2H = 12,         /* GPU -> page-locked host buffer */
    BPS_STAGE_NCCL_REDUCE = 13,     /* the machine's GPUs reduce onto the partition's root over NCCL */
    BPS_STAGE_PCIE_REDUCE = 14,     /* reserved, not built: the CPU sums the copies of PCIe switches' groups */
    BPS_STAGE_NCCL_BROADCAST = 15,  /* the result from the root to every GPU of the machine over NCCL */
    BPS_STAGE_COPYH2D = 16,         /* page-locked host buffer -> GPU */
};

/* (code, name) in code order, for the Python side's equality test */
struct BpsStageName {
    int32_t code;
    const char *name;
};
static const BpsStageName BPS_STAGE_NAMES[] = {
    {BPS_STAGE_QUEUE, "QUEUE"}, {BPS_STAGE_STAGE, "STAGE"}, {BPS_STAGE_PUSH, "PUSH"}, {BPS_STAGE_PULL, "PULL"},
    {BPS_STAGE_COORDINATE, "COORDINATE"}, {BPS_STAGE_LOCAL_REDUCE, "LOCAL_REDUCE"},
    {BPS_STAGE_LOCAL_BROADCAST, "LOCAL_BROADCAST"}, {BPS_STAGE_RECV, "RECV"}, {BPS_STAGE_SUM, "SUM"},
    {BPS_STAGE_ROUND, "ROUND"}, {BPS_STAGE_REPLY, "REPLY"}, {BPS_STAGE_COPYD2H, "COPYD2H"},
    {BPS_STAGE_NCCL_REDUCE, "NCCL_REDUCE"}, {BPS_STAGE_PCIE_REDUCE, "PCIE_REDUCE"},
    {BPS_STAGE_NCCL_BROADCAST, "NCCL_BROADCAST"}, {BPS_STAGE_COPYH2D, "COPYH2D"},
};
static const int BPS_STAGE_COUNT = sizeof(BPS_STAGE_NAMES) / sizeof(BPS_STAGE_NAMES[0]);

/* What a partition is part of (the scheduler compares it across workers with the tensor's name) */
enum BpsOpKind : int32_t { BPS_OP_PUSH_PULL = 0, BPS_OP_BROADCAST = 1, BPS_OP_ASYNC_PUSH_PULL = 2 };

/* One partition's stages, in order: at most 5 host stages plus the GPU stages around them */
struct BpsStageList {
    int32_t n = 0;
    int32_t stage[12];
    void add(int32_t s) { stage[n++] = s; }
    bool has(int32_t s) const {
        for (int32_t k = 0; k < n; ++k)
            if (stage[k] == s) return true;
        return false;
    }
};

/* The host stages of one partition on this process, appended to ``l``.
 *   owner:        this process reduces and pushes the partition for its machine
 *   local_reduce: the machine's processes sum locally first (several processes, not switched off)
 *   colocated:    the partition's server is on this machine and shares memory with this process
 *   lone_machine: the job has one worker machine: the local sum is the whole sum, so the owner
 *                 broadcasts it at once, without a server round trip (BytePS needs no server there)
 * Broadcasts and asynchronous push_pulls never reduce locally. */
static inline void bps_host_stages(BpsStageList &l, int32_t kind, bool owner, bool local_reduce, bool colocated,
                                   bool lone_machine) {
    if (kind == BPS_OP_PUSH_PULL && local_reduce) {
        if (!owner) {
            l.add(BPS_STAGE_COORDINATE);
            l.add(BPS_STAGE_LOCAL_BROADCAST);
            return;
        }
        l.add(BPS_STAGE_LOCAL_REDUCE);  /* the sum is already in the owner's shared region: no STAGE */
        if (!lone_machine) {
            l.add(BPS_STAGE_PUSH);
            l.add(BPS_STAGE_PULL);
        }
        l.add(BPS_STAGE_LOCAL_BROADCAST);
        return;
    }
    if (colocated)
        l.add(BPS_STAGE_STAGE);
    l.add(BPS_STAGE_PUSH);
    l.add(BPS_STAGE_PULL);
}

/* One partition of a CUDA push_pull on the NCCL stages (nccl_stages.h), on this process: every local rank
 * reduces it onto the root's GPU (NCCL_REDUCE) and gets the result from there (NCCL_BROADCAST); in
 * between, the ``root`` copies the machine's sum off its GPU, pushes and pulls it (STAGE first for a
 * ``colocated`` server) and copies the result back. On a ``lone_machine`` the sum is the result: the root
 * does nothing in between, except to divide an average (``divides``) on the host, between its copies. */
static inline BpsStageList bps_nccl_stage_list(bool root, bool colocated, bool lone_machine, bool divides) {
    BpsStageList l;
    l.add(BPS_STAGE_NCCL_REDUCE);
    if (root && (!lone_machine || divides)) {
        l.add(BPS_STAGE_COPYD2H);
        if (!lone_machine) bps_host_stages(l, BPS_OP_PUSH_PULL, true, false, colocated, false);
        l.add(BPS_STAGE_COPYH2D);
    }
    l.add(BPS_STAGE_NCCL_BROADCAST);
    return l;
}

/* One partition's stages on this process, in order: the host stages (above), and for a CUDA tensor
 * (``gpu``) COPYD2H before them and COPYH2D after them (core/pipeline/gpu_copier.h), except where a
 * broadcast needs no copy: a non-root sends nothing (no COPYD2H), the root gets nothing back (no
 * COPYH2D); ``root``: this process is a broadcast's root. */
static inline BpsStageList bps_stage_list(int32_t kind, bool owner, bool local_reduce, bool colocated,
                                          bool lone_machine, bool gpu = false, bool root = false) {
    BpsStageList l;
    if (gpu && !(kind == BPS_OP_BROADCAST && !root)) l.add(BPS_STAGE_COPYD2H);
    bps_host_stages(l, kind, owner, local_reduce, colocated, lone_machine);
    if (gpu && !(kind == BPS_OP_BROADCAST && root)) l.add(BPS_STAGE_COPYH2D);
    return l;
}
