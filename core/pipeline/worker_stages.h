/* BpsWorkerCore, the stages: how a partition moves through the pipeline (docs/architecture.md).
 *
 * plan() gives each partition its stage list when its op starts (bps_stage_list()). step() alone
 * moves a partition into the next stage of its list; on byteps-net, advance() steps and starts the
 * new stage's work, and what ends each stage calls advance() again:
 *
 *     COORDINATE       ends: the owner's LOCAL_DONE (on_local)
 *     LOCAL_REDUCE     ends: the sum (after_task)
 *     STAGE, PUSH      wait for the credit; end: the copy (push) / the server's reply (on_message)
 *     PULL             ends: at once
 *     LOCAL_BROADCAST  ends: the copy into the tensor (after_task)
 *     COPYD2H/COPYH2D, NCCL_REDUCE, NCCL_BROADCAST  end: their event (byteps-gpu)
 *
 * A failed partition leaves its list at once. A direct call (worker_direct.h) steps through its
 * partition's list on the caller's thread; byteps-net takes over in the stage it is in.
 */
#ifndef BPS_WORKER_STAGES_H
#define BPS_WORKER_STAGES_H

#include "core/pipeline/bps_worker.h"

static inline int32_t bps_op_kind(uint8_t cmd) {
    if (cmd == BPS_CMD_BROADCAST) return BPS_OP_BROADCAST;
    if (cmd == BPS_CMD_ASYNC_PUSHPULL) return BPS_OP_ASYNC_PUSH_PULL;
    return BPS_OP_PUSH_PULL;
}

/* Partition ``i``'s stage list on this process; it is in none of them yet. */
inline void BpsWorkerCore::plan(BpsOp *op, int i) {
    BpsPart &p = op->parts[(size_t)i];
    bool local = p.owner >= 0;
    /* a colocated server reads a plain partition from our staging region (a non-root broadcast has none) */
    bool colocated = local ? p.colocated : p.staging != nullptr;
    if (op->nccl)
        p.stages = bps_nccl_stage_list(p.nccl_root == local_rank_, p.staging != nullptr, lone_machine_, op->divisor > 1);
    else
        p.stages = bps_stage_list(bps_op_kind(op->cmd), !local || p.owner == local_rank_, local, colocated,
                                  lone_machine_, op->gpu, op->root_self);
    p.at = -1;
}

/* A partition of an op byteps-net starts: its list, its round (a local reduce's ranks all take it
 * now), (a CUDA tensor that copies) its staging slot, then its first stage. A partition that waits for a slot
 * comes back from grant_slots(). */
inline void BpsWorkerCore::start(BpsOp *op, int i) {
    plan(op, i);
    BpsPart &p = op->parts[(size_t)i];
    p.abandon = op->abandons;
    if (op->local && !op->adds_nothing) p.rnd = next_round(p.key); /* a joined owner's: its peers' round */
    if (op->gpu && (p.stages.has(BPS_STAGE_COPYD2H) || p.stages.has(BPS_STAGE_COPYH2D))) {
        std::string err;
        if (!gpu_->take_slot(op, i, seq_++, &err)) {
            if (!err.empty()) fail(op, BPS_ERR_CUDA, err);
            return;
        }
    }
    advance(op, i);
}

/* Partitions of CUDA tensors that waited for a staging slot and have one now: into their first stage. */
inline void BpsWorkerCore::grant_slots() {
    std::vector<std::pair<BpsQueued, std::string>> got;
    gpu_->granted(&got);
    for (auto &g : got) {
        if (!g.second.empty()) fail(g.first.op, BPS_ERR_CUDA, g.second);
        else advance(g.first.op, g.first.part);
    }
}

/* The one place a partition moves on: into the next stage of its list (returned), or done after the
 * last (0). Called by the thread that runs the partition: byteps-net (advance()) or its direct caller. */
inline int32_t BpsWorkerCore::step(BpsOp *op, int i) {
    BpsPart &p = op->parts[(size_t)i];
    p.at++;
    int32_t stage = p.stage();
    entered_[stage].fetch_add(1, std::memory_order_relaxed); /* [0]: partitions done */
    return stage;
}

/* byteps-net: partition ``i`` into its next stage, whose work starts here; done after the last. */
inline void BpsWorkerCore::advance(BpsOp *op, int i) {
    if (op->done.load()) return; /* failed meanwhile (time-out, abort): fail() completed it */
    if (op->nccl && !nccl_.broken().empty()) { /* the machine's NCCL stages stopped: its data is not the sum */
        fail(op, BPS_ERR_CUDA, nccl_failure(op));
        return;
    }
    BpsPart &p = op->parts[(size_t)i];
    int32_t from = p.stage();
    int32_t stage = step(op, i);
    switch (stage) {
        case BPS_STAGE_COORDINATE:
            coordinate(op, i);
            return;
        case BPS_STAGE_LOCAL_REDUCE:
            local_reduce(op, i);
            return;
        case BPS_STAGE_STAGE: /* its copy runs when the credit lets it go (push()) */
            queue(op, i);
            return;
        case BPS_STAGE_PUSH:
            if (from == BPS_STAGE_STAGE) send_push(op, i); /* through the credit already */
            else queue(op, i);
            return;
        case BPS_STAGE_PULL:
            pull(op, i);
            return;
        case BPS_STAGE_LOCAL_BROADCAST:
            local_broadcast_result(op, i);
            return;
        case BPS_STAGE_COPYD2H:
            gpu_copy(op, i, true);
            return;
        case BPS_STAGE_COPYH2D:
            if (op->nccl && lone_machine_ && op->divisor > 1) /* the machine's sum, averaged on the host */
                bps_divide_copy(p.host, p.host, p.length / (uint64_t)bps_itemsize(op->dtype), op->dtype, op->divisor);
            gpu_copy(op, i, false);
            return;
        case BPS_STAGE_NCCL_REDUCE:
        case BPS_STAGE_NCCL_BROADCAST:
            nccl_enter(op, i, stage);
            return;
        default: { /* done: a CUDA tensor's slot goes to the next partition that waits for one */
            bool waiting = op->gpu && gpu_->release(p);
            part_done(op);
            if (waiting) grant_slots();
        }
    }
}

/* COPYD2H / COPYH2D: the copy is issued on the device's byteps stream; its event ends the stage
 * (take_gpu_done). */
inline void BpsWorkerCore::gpu_copy(BpsOp *op, int i, bool d2h) {
    std::string err = gpu_->copy(op, i, d2h);
    if (!err.empty()) fail(op, BPS_ERR_CUDA, "tensor '" + op->name + "': " + err);
}

/* Copies and collectives whose events completed (byteps-gpu): their spans, and their partitions on to
 * the next stage. */
inline void BpsWorkerCore::take_gpu_done() {
    if (!gpu_->enabled()) return;
    std::vector<BpsGpuCopy> done;
    gpu_->done(&done);
    for (BpsGpuCopy &c : done) {
        BpsOp *op = c.op;
        if (op->done.load()) { /* failed meanwhile: Python may free it once its tasks are 0 */
            op->tasks--;
            continue;
        }
        op->tasks--; /* not done: only this thread completes it, so it stays */
        const BpsPart &p = op->parts[(size_t)c.part];
        bps_span(c.stage, c.t_issued, p.key, p.rnd, p.length, p.server, op->priority);
        if (!c.error.empty()) fail(op, BPS_ERR_CUDA, "tensor '" + op->name + "': " + c.error);
        else advance(op, c.part);
    }
    grant_slots();
}

/* Wait for the send queue: by priority, within the byte credit (send_ready() calls push()). */
inline void BpsWorkerCore::queue(BpsOp *op, int i) {
    BpsPart &p = op->parts[(size_t)i];
    if (op->local) p.trace_t = bps_span_start(); /* a machine's sum: its QUEUE wait starts now */
    p.qseq = seq_;
    sendq_.add(BpsQueued{op->priority, seq_++, op, i, p.key});
}

/* PULL: the server's answer to partition ``i`` (reply_: the message on_message is handling). */
inline void BpsWorkerCore::pull(BpsOp *op, int i) {
    BpsPart &p = op->parts[(size_t)i];
    const BpsReply &r = reply_;
    if (op->local) { /* the owner: the machine's result, for LOCAL_BROADCAST */
        owner_pulled(op, i, r.server, *r.h, r.m);
        return;
    }
    uint64_t t_pull = bps_span_start();
    take_reply(op, p, r.server, *r.h, r.m);
    bps_span(BPS_STAGE_PULL, t_pull, p.key, r.h->round, p.length, r.server, op->priority);
    advance(op, i);
}

/* PULL without a copy: where server ``server``'s link may read frame ``frame`` (``len`` bytes) of the
 * message whose header is in ``head``: straight into its partition's bytes when it is the sum that
 * receive() would copy there (a plain REPLY of a partition we wait for, whole), else NULL. Not with
 * elastic servers: a link that breaks in mid-frame would leave part of a sum in a tensor whose
 * partition is then pushed again to the lost server's replacement. */
inline void *BpsWorkerCore::place_reply(int server, BpsMessage &head, int frame, uint64_t len) {
    BpsHeader h;
    if (frame != 1 || elastic_.retains() || !bps_parse_header(head.data(0), head.size(0), &h) ||
        h.cmd != BPS_CMD_REPLY || (h.flags & (BPS_FLAG_COMPRESSED | BPS_FLAG_SHM)) != 0)
        return nullptr;
    auto it = pending_.find(std::make_pair(h.key, h.round));
    if (it == pending_.end()) return nullptr;
    BpsOp *op = it->second.first;
    const BpsPart &p = op->parts[(size_t)it->second.second];
    if (p.server != server || op->done.load() || op->local || op->root_self || len != p.length ||
        (op->gpu && p.host == nullptr))
        return nullptr;
    placed_[(size_t)server] = Placed{h.key, h.round, op};
    return bps_host_bytes(op, p);
}

/* Before byteps-net reads server ``server``'s link again: a frame it was reading into a partition
 * that no longer waits for it (its op failed or timed out, and its caller may have the tensor back)
 * goes on into a buffer of its own. Only reads write the frame, so checking before each is enough. */
inline void BpsWorkerCore::check_placed(int server, BpsConn *l) {
    Placed &pl = placed_[(size_t)server];
    if (pl.op == nullptr) return;
    auto it = pending_.find(std::make_pair(pl.key, pl.round));
    if (it == pending_.end() || it->second.first != pl.op || pl.op->done.load()) {
        l->unplace();
        pl = Placed{};
    }
}

/* A server's REPLY or ERROR to a partition that is not a local reduce's, into the op. */
inline void BpsWorkerCore::take_reply(BpsOp *op, BpsPart &p, int server, const BpsHeader &h, BpsMessage *m) {
    if (h.cmd == BPS_CMD_REPLY) {
        receive(op, p, server, h, m);
    } else if (h.cmd == BPS_CMD_ERROR) {
        set_error(op, BPS_ERR_SERVER, m->count > 1 ? std::string((const char *)m->data(1), m->size(1)) : "{}");
    } else {
        set_error(op, BPS_ERR_PROTOCOL,
                  "unexpected command " + std::to_string(h.cmd) + " from server " + std::to_string(server));
    }
}

/* LOCAL_BROADCAST: the owner tells the others where the result is; every rank copies it into its
 * tensor (on the stage thread when large), which ends the stage (after_task). */
inline void BpsWorkerCore::local_broadcast_result(BpsOp *op, int i) {
    BpsPart &p = op->parts[(size_t)i];
    if (p.owner == local_rank_) local_broadcast(op, i, p.result_desc, "");
    if (op->adds_nothing) { /* a joined owner: its peers have the result; its own buffer stays zeros */
        advance(op, i);
        return;
    }
    stage_or_inline(BPS_TASK_COPY_OUT, op, i, bps_host_bytes(op, p), {p.result});
}

#endif
