/* BpsWorkerCore, elastic servers: hold / commit on the tables and ops, a dead server's partitions
 * stranded until its replacement is known. BpsElasticRouter (elastic_router.h) keeps the routing. */
#ifndef BPS_WORKER_ELASTIC_H
#define BPS_WORKER_ELASTIC_H

#include "core/pipeline/bps_worker.h"

/* Elastic servers, step 1 (the scheduler's PREPARE): servers ``dead`` are gone. Ops submitted from
 * now on are held, not started; partitions owed by a dead server wait (stranded). Returns, per
 * table, how many ops were submitted on it: the scheduler makes the largest count of each tensor
 * over all workers the cut from which the new membership's partitions are used. */
inline std::vector<uint64_t> BpsWorkerCore::hold(const std::vector<int> &dead) {
    std::vector<uint64_t> counts;
    {
        std::lock_guard<std::mutex> lock(mu_);
        elastic_.hold(dead);
        for (auto &t : tables_) counts.push_back(t.count);
    }
    wake();
    return counts;
}

/* Elastic servers, step 2 (COMMIT): table ``tables[i]`` uses ``segs[i]`` from op number ``from[i]``
 * on; a dead server's partitions (stranded, queued, or in later ops of an older membership) go to
 * bps_replacement(alive, key) with their round kept; held ops start. */
inline void BpsWorkerCore::commit(const std::vector<int> &alive, const std::vector<int64_t> &tables,
                                  const std::vector<uint64_t> &from, std::vector<std::vector<BpsPart>> segs) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<BpsOp *> held = elastic_.commit(alive, tables_);
        for (size_t i = 0; i < tables.size(); ++i)
            tables_.at((size_t)tables[i]).later.push_back(std::make_pair(from[i], std::move(segs[i])));
        for (BpsOp *op : held) {
            if (op->done.load()) continue; /* failed meanwhile (the engine failed) */
            op->parts = tables_.at((size_t)op->table).parts_for(op->seq);
            op->parts_left = (int)op->parts.size();
            for (size_t i = 0; i < op->parts.size(); ++i) inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
        }
    }
    wake();
}

/* A table registered after servers changed (mu_ held): the partitions of membership ``members``
 * used from op number ``from`` on (core/engine.py replays the job's memberships for it). */
inline void BpsWorkerCore::add_segment(int64_t table, uint64_t from, std::vector<BpsPart> parts) {
    std::lock_guard<std::mutex> lock(mu_);
    elastic_.replay(parts);
    tables_.at((size_t)table).later.push_back(std::make_pair(from, std::move(parts)));
}

/* Elastic: partitions a dead server owes replies for wait for commit() (stranded). Its replies came
 * on its link, which byteps-net read until it broke. */
inline void BpsWorkerCore::strand_dead() {
    for (auto it = pending_.begin(); it != pending_.end();) {
        BpsOp *op = it->second.first;
        int index = it->second.second;
        BpsPart &p = op->parts[(size_t)index];
        if (!servers_.dead(p.server)) {
            ++it;
            continue;
        }
        release(op, index);
        op->owed[p.server]--;
        elastic_.strand(BpsQueued{op->priority, p.qseq, op, index});
        it = pending_.erase(it);
    }
}

#endif
