/* BpsWorkerCore, the NCCL stages of CUDA push_pulls on a machine of several GPU processes (BpsNcclStages,
 * nccl_stages.h: the communicator and the machine's order of collectives; bps_nccl_stage_list()).
 *
 * One partition, every process of the machine:
 *     NCCL_REDUCE     NCCL_READY to local rank 0 (which orders the reduce once every rank's is in);
 *                     ncclReduce onto the root's GPU when its turn comes    ends: its event (byteps-gpu)
 *   the root only: COPYD2H, [STAGE,] PUSH, PULL, COPYH2D (worker_stages.h), as for one process
 *     NCCL_BROADCAST  the root: NCCL_READY to local rank 0, which orders the broadcast at once;
 *                     ncclBroadcast from the root when its turn comes       ends: its event
 */
#ifndef BPS_WORKER_NCCL_H
#define BPS_WORKER_NCCL_H

#include "core/pipeline/bps_worker.h"

/* NCCL_REDUCE / NCCL_BROADCAST: partition ``i`` is here in that stage; it is issued in its turn. */
inline void BpsWorkerCore::nccl_enter(BpsOp *op, int i, int32_t stage) {
    BpsPart &p = op->parts[(size_t)i];
    if (!nccl_.enabled()) {
        fail(op, BPS_ERR_CUDA, "tensor '" + op->name + "': NCCL is not loaded (enable_nccl)");
        return;
    }
    if (stage == BPS_STAGE_NCCL_REDUCE) {
        std::string id, err = nccl_.begin(op->device, gpu_->runtime(), &id);
        if (!err.empty()) {
            nccl_break("tensor '" + op->name + "': " + err);
            fail(op, BPS_ERR_CUDA, nccl_failure(op));
            return;
        }
        for (int r = 0; r < local_size_ && !id.empty(); ++r)
            if (r != local_rank_) nccl_send(r, BPS_CMD_NCCL_ID, 0, 0, 0, id);
    }
    BpsNcclStages::Entry e(stage, p.key, op->seq);
    nccl_.arrived(e, op, i);
    if (stage == BPS_STAGE_NCCL_REDUCE || p.nccl_root == local_rank_) {
        if (nccl_.coordinator()) nccl_ready(e, local_rank_);
        else nccl_send(0, BPS_CMD_NCCL_READY, stage, p.key, op->seq, "");
    }
    nccl_issue();
}

/* The coordinator: local rank ``from`` has ``e`` ready; once all do, it is the machine's next collective. */
inline void BpsWorkerCore::nccl_ready(const BpsNcclStages::Entry &e, int from) {
    if (!nccl_.ready_from(e, from)) return;
    for (int r = 1; r < local_size_; ++r)
        nccl_send(r, BPS_CMD_NCCL_ORDER, std::get<0>(e), std::get<1>(e), std::get<2>(e), "");
    nccl_.ordered(e);
}

/* Issue the collectives whose turn came and whose partitions are here, in the machine's order. */
inline void BpsWorkerCore::nccl_issue() {
    if (!nccl_.enabled() || !nccl_.broken().empty()) return;
    std::string failed = nccl_.init_failure();
    if (!failed.empty()) {
        nccl_break(failed);
        return;
    }
    if (!nccl_.ready()) return;
    for (;;) {
        std::pair<BpsOp *, int> next = nccl_.next();
        BpsOp *op = next.first;
        if (op == nullptr) return;
        BpsPart &p = op->parts[(size_t)next.second];
        int32_t stage = p.stage();
        unsigned char *dev = (unsigned char *)op->dev_ptr + p.offset;
        std::string err = gpu_->issue(op, next.second, stage, true, [&](bps_cuda_stream s) {
            return nccl_.collective(stage, dev, p.length, op->dtype, p.nccl_root, s);
        });
        if (!err.empty()) {
            nccl_break("tensor '" + op->name + "': " + err);
            if (!op->done.load()) fail(op, BPS_ERR_CUDA, nccl_failure(op));
            return;
        }
    }
}

/* A message of the NCCL stages from local rank ``from`` (on_local). */
inline void BpsWorkerCore::on_nccl(const BpsHeader &h, const void *body, size_t n) {
    int from = (int)h.arg;
    BpsNcclStages::Entry e((int32_t)h.length, h.key, h.round);
    switch (h.cmd) {
        case BPS_CMD_NCCL_ID:
            nccl_.take_id(body, n);
            break;
        case BPS_CMD_NCCL_READY:
            if (nccl_.coordinator() && nccl_.broken().empty()) nccl_ready(e, from);
            break;
        case BPS_CMD_NCCL_ORDER:
            if (nccl_.broken().empty()) nccl_.ordered(e);
            break;
        case BPS_CMD_NCCL_ABORT:
            nccl_break(std::string((const char *)body, n), false); /* it names where it stopped */
            return;
    }
    nccl_issue();
}

/* [header, body] of the NCCL stages to local rank ``r`` (a failure to send breaks them). */
inline void BpsWorkerCore::nccl_send(int r, uint8_t cmd, int32_t stage, uint64_t key, uint64_t seq,
                                     const std::string &body) {
    BpsHeader h = bps_header(cmd, node_id_, key, seq, (uint64_t)stage, BPS_NO_DTYPE, (uint32_t)local_rank_, 0);
    if (local_.send(r, &h, body.data(), body.size()) != 0 && cmd != BPS_CMD_NCCL_ABORT)
        nccl_break("sending to local rank " + std::to_string(r) + " failed: " + strerror(errno));
}

/* The machine's order of collectives cannot go on (``why``, which happened here, named so, or a peer's
 * NCCL_ABORT: ``here`` false): the communicator is aborted, the other processes told (by the process
 * where it happened), and every op of ours that waits for a collective fails; those with a collective
 * in flight fail at their next NCCL stage. */
inline void BpsWorkerCore::nccl_break(const std::string &why, bool here) {
    std::vector<std::pair<BpsOp *, int>> waiting = nccl_.waiting();
    std::string text = here ? "local rank " + std::to_string(local_rank_) + ": " + why : why;
    if (!nccl_.set_broken(text)) return;
    for (int r = 0; r < local_size_ && here; ++r)
        if (r != local_rank_) nccl_send(r, BPS_CMD_NCCL_ABORT, 0, 0, 0, text);
    for (auto &w : waiting)
        if (!w.first->done.load()) fail(w.first, BPS_ERR_CUDA, nccl_failure(w.first));
}

inline std::string BpsWorkerCore::nccl_failure(const BpsOp *op) const {
    return "tensor '" + op->name + "': the NCCL stages of this machine stopped: " + nccl_.broken();
}

/* For a time-out's message: what an op's partitions in their NCCL stages wait for ("" if none is). */
inline std::string BpsWorkerCore::nccl_waits(const BpsOp *op) const {
    std::set<std::string> names;
    for (const BpsPart &p : op->parts) {
        int32_t st = p.stage();
        if (st != BPS_STAGE_NCCL_REDUCE && st != BPS_STAGE_NCCL_BROADCAST) continue;
        std::string comm = nccl_.waiting_for();
        if (!comm.empty()) return comm;
        BpsNcclStages::Entry e(st, p.key, op->seq);
        if (!nccl_.is_here(e)) {
            names.insert("its NCCL collective on the GPU (issued; some local rank's GPU never reached it)");
        } else if (nccl_.was_ordered(e)) {
            names.insert("earlier collectives of the machine's NCCL order (their partitions not here yet)");
        } else if (nccl_.coordinator() && st == BPS_STAGE_NCCL_REDUCE) {
            for (int r : nccl_.missing(e)) names.insert("local rank " + std::to_string(r) + " (NCCL_REDUCE)");
        } else if (st == BPS_STAGE_NCCL_BROADCAST && p.nccl_root != local_rank_) {
            names.insert("local rank " + std::to_string(p.nccl_root) + " (the root's result, NCCL_BROADCAST)");
        } else {
            names.insert("local rank 0 (the order of the NCCL collectives)");
        }
    }
    std::string who;
    for (auto &n : names) who += (who.empty() ? "" : ", ") + n;
    return who;
}

#endif
