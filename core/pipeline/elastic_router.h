/* Elastic servers on the worker: which server each partition goes to while the servers change, and
 * the results a lost server's replacement needs (docs/elastic.md).
 *
 * hold() marks servers dead and holds the ops submitted from then on; commit() moves every dead
 * server's partitions to its replacement and keeps the change, so that a table registered later is
 * rerouted the same way (replay). Between the two, byteps-net strands the dead servers' partitions.
 * Each key's latest result is retained and sent to its server's replacement before any push of the
 * new membership.
 *
 * Threads: the membership side (hold, commit, holding, held ops, take_turn) is guarded by the core's
 * mu_, which its callers hold. The turn side (awaiting_commit, replacement, stranded partitions,
 * send_results) is byteps-net's. Retained results have their own mutex (byteps-net, direct callers).
 */
#ifndef BPS_ELASTIC_ROUTER_H
#define BPS_ELASTIC_ROUTER_H

#include <atomic>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/pipeline/server_links.h"
#include "core/pipeline/worker_types.h"

class BpsElasticRouter {
  public:
    BpsElasticRouter(BpsServerLinks &servers, uint32_t node_id) : servers_(servers), node_id_(node_id) {}

    /* hold() (the core's mu_ held): servers ``dead`` are gone; ops submitted from now on are held. */
    void hold(const std::vector<int> &dead) {
        holding_ = true;
        holds_.fetch_add(1); /* before any server reads as dead: see awaiting_commit() */
        for (int d : dead) servers_.set_dead(d);
        dead_in_ = true;
    }

    /* The core's mu_ held: ops submitted now wait for commit() (holding); a direct call, which has no
     * way to wait, is not taken while a change is under way (changing). */
    bool holding() const { return holding_; }
    bool changing() const { return holding_ || commit_in_; }
    void hold_op(BpsOp *op) { held_.push_back(op); }
    bool is_held(const BpsOp *op) const {
        for (BpsOp *h : held_)
            if (h == op) return true;
        return false;
    }

    /* commit() (the core's mu_ held): membership ``alive`` replaces the servers dead by now in every
     * table's partitions (its current ones and later segments); returns the held ops, to start. */
    std::vector<BpsOp *> commit(const std::vector<int> &alive, std::deque<BpsTable> &tables) {
        alive_ = alive;
        std::set<int> dead;
        for (int i = 0; i < BPS_MAX_SERVERS; ++i)
            if (servers_.dead(i)) dead.insert(i);
        reroutes_.push_back(std::make_pair(dead, alive));
        for (auto &t : tables) {
            reroute(t.parts, dead, alive);
            for (auto &seg : t.later) reroute(seg.second, dead, alive);
        }
        holding_ = false;
        commit_in_ = true;
        commits_++;
        std::vector<BpsOp *> held;
        held.swap(held_);
        return held;
    }

    /* Every change so far, on the partitions of a table registered after it (the core's mu_ held), so
     * that every worker's n-th op of a tensor uses the same servers however late it first used it. */
    void replay(std::vector<BpsPart> &parts) const {
        for (auto &r : reroutes_) reroute(parts, r.first, r.second);
    }

    /* byteps-net's turn (the core's mu_ held): whether servers died (strand their partitions) and whether
     * a commit() came (its membership is byteps-net's from now on). */
    void take_turn(bool *dead_now, bool *commit_now) {
        *dead_now = dead_in_;
        *commit_now = commit_in_;
        dead_in_ = commit_in_ = false;
        if (*commit_now) {
            alive_net_ = alive_;
            commits_net_ = commits_;
        }
    }

    /* byteps-net: a server reads as dead from hold() on, but its replacement is known only once
     * byteps-net has taken the commit() that follows; until then its partitions wait (stranded). */
    bool awaiting_commit() const { return commits_net_ < holds_.load(); }
    int replacement(uint64_t key) const { return bps_replacement(alive_net_, key); }

    /* A partition goes to server ``to`` instead: through shared memory only if ``to`` is on this machine. */
    void move_part(BpsPart &p, int to) const {
        p.server = to;
        bool shared = servers_.colocated(to);
        if (p.owner >= 0) p.colocated = shared; /* local reduce: the owner's region, as a descriptor or bytes */
        else if (!shared) p.staging = nullptr;  /* the bytes go from the tensor */
    }

    /* byteps-net: partitions waiting for a dead server's replacement. */
    void strand(const BpsQueued &q) { stranded_.push_back(q); }
    bool is_stranded(const BpsOp *op) const {
        for (auto &q : stranded_)
            if (q.op == op) return true;
        return false;
    }
    std::vector<BpsQueued> take_stranded() {
        std::vector<BpsQueued> out;
        out.swap(stranded_);
        return out;
    }

    /* Each key's latest result, with the server that sent it (BYTEPS_ELASTIC=1, before start()). If that
     * server is lost, its replacement gets it (RESULT, send_results()): another worker may not have got
     * its reply before the server went, and we will not push that round again. One copy per partition
     * key, kept until the next round's result replaces it (docs/elastic.md says what that costs). */
    void set_retain(bool on) { retain_ = on; }
    bool retains() const { return retain_; }
    void retain(const BpsPart &p, uint64_t round, uint8_t dtype, const void *data, size_t n) {
        if (!retain_) return;
        std::lock_guard<std::mutex> lock(retain_mu_);
        BpsRetained &r = retained_[p.key];
        r.round = round;
        r.server = p.server;
        r.dtype = dtype;
        r.data.assign((const char *)data, n);
    }

    /* byteps-net, at commit(): the results we hold from servers now dead, to their replacements, before
     * any push. */
    void send_results() {
        std::lock_guard<std::mutex> lock(retain_mu_);
        for (auto &kv : retained_) {
            BpsRetained &r = kv.second;
            if (r.server < 0 || !servers_.dead(r.server)) continue;
            int to = replacement(kv.first);
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

    /* RESULTs sent to lost servers' replacements (tests check the path ran). */
    uint64_t results_sent() const { return results_sent_.load(); }

  private:
    /* a partition of a server in ``dead`` goes to its replacement in membership ``alive`` */
    void reroute(std::vector<BpsPart> &parts, const std::set<int> &dead, const std::vector<int> &alive) const {
        for (auto &p : parts)
            if (dead.count(p.server)) move_part(p, bps_replacement(alive, p.key));
    }

    BpsServerLinks &servers_; /* whether a server is dead or colocated; RESULTs go through it */
    uint32_t node_id_;

    /* the membership side: the core's mu_ */
    bool holding_ = false;                /* ops submitted now wait in held_ */
    std::vector<BpsOp *> held_;
    bool dead_in_ = false, commit_in_ = false; /* for byteps-net's next turn */
    std::vector<int> alive_;                   /* the membership's servers, in order */
    std::vector<std::pair<std::set<int>, std::vector<int>>> reroutes_; /* each commit(): (dead, alive) */
    uint64_t commits_ = 0;                                             /* commit() calls */
    std::atomic<uint64_t> holds_{0};                                   /* hold() calls */

    /* the turn side: byteps-net */
    uint64_t commits_net_ = 0;        /* commit()s byteps-net has taken (awaiting_commit()) */
    std::vector<int> alive_net_;      /* commit()'s membership */
    std::vector<BpsQueued> stranded_; /* partitions waiting for a dead server's replacement */

    /* retained results */
    bool retain_ = false; /* set_retain(): keep each key's latest result */
    std::mutex retain_mu_;
    std::unordered_map<uint64_t, BpsRetained> retained_;
    std::atomic<uint64_t> results_sent_{0};
};

#endif
