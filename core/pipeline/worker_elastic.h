/* BpsWorkerCore, elastic routing: hold / commit, replacements of lost servers, retained results. */
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
        holding_ = true;
        holds_.fetch_add(1); /* before any server reads as dead: see awaiting_commit() */
        for (int d : dead) servers_.set_dead(d);
        dead_in_ = true;
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
        alive_ = alive;
        std::set<int> dead;
        for (int i = 0; i < BPS_MAX_SERVERS; ++i)
            if (servers_.dead(i)) dead.insert(i);
        reroutes_.push_back(std::make_pair(dead, alive));
        for (auto &t : tables_) {
            reroute(t.parts, dead, alive);
            for (auto &seg : t.later) reroute(seg.second, dead, alive);
        }
        for (size_t i = 0; i < tables.size(); ++i)
            tables_.at((size_t)tables[i]).later.push_back(std::make_pair(from[i], std::move(segs[i])));
        holding_ = false;
        commit_in_ = true;
        commits_++;
        for (BpsOp *op : held_) {
            if (op->done.load()) continue; /* failed meanwhile (the engine failed) */
            op->parts = tables_.at((size_t)op->table).parts_for(op->seq);
            op->parts_left = (int)op->parts.size();
            for (size_t i = 0; i < op->parts.size(); ++i) inbox_.push_back(BpsQueued{op->priority, 0, op, (int)i});
        }
        held_.clear();
    }
    wake();
}

/* A table registered after servers changed (mu_ held): the partitions of membership ``members``
 * used from op number ``from`` on (core/engine.py replays the job's memberships for it). */
inline void BpsWorkerCore::add_segment(int64_t table, uint64_t from, std::vector<BpsPart> parts) {
    std::lock_guard<std::mutex> lock(mu_);
    replay_reroutes(parts);
    tables_.at((size_t)table).later.push_back(std::make_pair(from, std::move(parts)));
}

/* commit()'s rerouting: partitions of servers dead by then go to their replacements in that
 * membership. Every change is kept and replayed on tables registered later, so that every worker's
 * n-th op of a tensor uses the same servers however late it first used the tensor (mu_ held). */
inline void BpsWorkerCore::reroute(std::vector<BpsPart> &parts, const std::set<int> &dead,
                                   const std::vector<int> &alive) {
    for (auto &p : parts)
        if (dead.count(p.server)) move_part(p, bps_replacement(alive, p.key));
}

/* A partition goes to server ``to`` instead: through shared memory only if ``to`` is on this machine. */
inline void BpsWorkerCore::move_part(BpsPart &p, int to) {
    p.server = to;
    bool shared = servers_.colocated(to);
    if (p.owner >= 0) p.colocated = shared; /* local reduce: the owner's region, as a descriptor or bytes */
    else if (!shared) p.staging = nullptr;  /* the bytes go from the tensor */
}

inline void BpsWorkerCore::replay_reroutes(std::vector<BpsPart> &parts) {
    for (auto &r : reroutes_) reroute(parts, r.first, r.second);
}

/* Elastic: partitions a dead server owes replies for wait for commit() (stranded), after any whole
 * messages it sent before it went are taken. */
inline void BpsWorkerCore::strand_dead() {
    BpsMessage msg;
    for (size_t s = 0; s < servers_.size(); ++s) {
        if (!servers_.dead((int)s)) continue;
        for (int k = 0; k < 4096; ++k) { /* what ZeroMQ already holds from it */
            if (bps_recv_message(servers_.sock(s), &msg) <= 0) break;
            on_message((int)s, &msg);
        }
    }
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
        stranded_.push_back(BpsQueued{op->priority, p.qseq, op, index});
        it = pending_.erase(it);
    }
}

/* Elastic servers: the result of each key's latest round, with the server that sent it. If that
 * server is lost, its replacement gets it (RESULT, send_results()): another worker may not have got
 * its reply before the server went, and we will not push that round again. One copy per partition
 * key, kept until the next round's result replaces it (docs/elastic.md says what that costs). */
inline void BpsWorkerCore::retain(const BpsPart &p, uint64_t round, uint8_t dtype, const void *data, size_t n) {
    if (!retain_) return;
    std::lock_guard<std::mutex> lock(retain_mu_);
    BpsRetained &r = retained_[p.key];
    r.round = round;
    r.server = p.server;
    r.dtype = dtype;
    r.data.assign((const char *)data, n);
}

/* At commit(): the results we hold from servers now dead, to their replacements, before any push. */
inline void BpsWorkerCore::send_results() {
    std::lock_guard<std::mutex> lock(retain_mu_);
    for (auto &kv : retained_) {
        BpsRetained &r = kv.second;
        if (r.server < 0 || !servers_.dead(r.server)) continue;
        int to = bps_replacement(alive_net_, kv.first);
        if (to < 0) continue;
        BpsHeader h = bps_header(BPS_CMD_RESULT, node_id_, kv.first, r.round, r.data.size(), r.dtype, 0, 0);
        BpsFrames f;
        f.copy(&h, sizeof h);
        f.copy(r.data.data(), r.data.size());
        servers_.send(to, f);
        servers_.count_sent(to, sizeof h + r.data.size());
        r.server = to;
        results_sent_.fetch_add(1);
    }
}

#endif
