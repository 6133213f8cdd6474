/* The worker's links to the servers: per server its direct link (a BpsConn: TCP, or a UCX endpoint of
 * this process's one UCP worker), which carries all its partitions and replies, and what is known of it
 * (on this machine, left the job, link broken, bytes each way). ZeroMQ carries none of them: the
 * servers' DEALERs stay Python's, for the control plane.
 *
 * Threads: Python's, before start() (add, add_link, add_ucx_link) and for the counters at any time;
 * byteps-net, which polls and sends (BpsWorkerCore::run, send()); a direct caller
 * (BpsWorkerCore::submit_direct), which holds one server's link for a round trip: it takes lock_ucx()
 * (when there is a UCP worker) and then link_mu(server), in the order byteps-net takes them, and marks
 * the link direct_owned() so that byteps-net does not poll it meanwhile.
 *
 * Per-server state is sized once, at BPS_MAX_SERVERS: a server that joins mid-job (elastic) never moves
 * what other threads are reading. The UCP worker is declared before the links: it outlives them.
 */
#ifndef BPS_SERVER_LINKS_H
#define BPS_SERVER_LINKS_H

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/pipeline/worker_types.h"
#include "core/transport/bps_link.h"
#include "core/transport/bps_ucx.h"
#include "core/transport/bps_wire.h"

class BpsServerLinks {
  public:
    explicit BpsServerLinks(uint32_t node_id) : node_id_(node_id) {
        links_.resize(BPS_MAX_SERVERS);
        for (int i = 0; i < BPS_MAX_SERVERS; ++i) link_mu_.emplace_back(new std::mutex());
        direct_owned_.resize(BPS_MAX_SERVERS);
        sent_.resize(BPS_MAX_SERVERS);
        received_.resize(BPS_MAX_SERVERS);
        dead_.resize(BPS_MAX_SERVERS);
        colocated_.resize(BPS_MAX_SERVERS);
        reported_.resize(BPS_MAX_SERVERS, false);
    }

    /* Server number count() (before start(); add_live() after), its link to come. False: too many. */
    bool add() {
        if (nservers_.load() >= BPS_MAX_SERVERS) return false;
        nservers_.fetch_add(1);
        return true;
    }

    /* A server that joined the running job (elastic): its direct TCP link's fd. byteps-net adopts it
     * (adopt_joined) as server count(). */
    bool add_live(int fd) {
        std::lock_guard<std::mutex> lock(mu_);
        if (nservers_.load() + (int)joined_.size() >= BPS_MAX_SERVERS) return false;
        joined_.push_back(fd);
        return true;
    }

    /* byteps-net: the servers add_live() handed over; each is polled from the next turn on. */
    void adopt_joined() {
        std::vector<int> joined;
        {
            std::lock_guard<std::mutex> lock(mu_);
            joined.swap(joined_);
        }
        for (int fd : joined) {
            links_[(size_t)nservers_.load()].reset(new BpsLink(fd));
            nservers_.fetch_add(1);
        }
    }

    /* A direct TCP link to server ``server`` (before start()): a connected socket whose token the server
     * accepted (core/engine_setup.py _open_links). This object owns and closes it. */
    void add_link(int server, int fd) { links_.at((size_t)server).reset(new BpsLink(fd)); }

    /* A UCX endpoint to server ``server``'s listener at host:port (before start()), admitted by the
     * one-time ``token`` Python got for ``ident``: "" once it is up, else why not. */
    std::string add_ucx_link(int server, const std::string &host, int port, const std::string &token,
                             const std::string &ident, double timeout) {
        std::string why;
        if (!ucx_) ucx_.reset(BpsUcxWorker::create(&why));
        if (!ucx_) return why;
        BpsHeader h = bps_header(BPS_CMD_LINK, node_id_, 0, 0, token.size() + ident.size(), BPS_NO_DTYPE, 0, 0);
        BpsUcxLink *l =
            ucx_->connect(host, port, std::string((const char *)&h, sizeof h), token + ident, timeout, &why);
        if (l != nullptr) links_.at((size_t)server).reset(l);
        return why;
    }

    /* Which transports server ``server``'s link uses: "tcp", "ucx: tcp/lo, ..." ("" without a link). */
    std::string transport(int server) {
        std::unique_lock<std::mutex> ucx_lock = lock_ucx(); /* ucp_ep_query: the worker's user */
        BpsConn *l = links_.at((size_t)server).get();
        if (l == nullptr) return "";
        if (std::string(l->kind()) != "ucx") return l->kind();
        return std::string("ucx: ") + ((BpsUcxLink *)l)->transports();
    }

    /* Servers reached over a direct link (tests and logs check the path really ran). */
    int up() const {
        int n = 0;
        for (auto &l : links_) n += l && !l->dead();
        return n;
    }

    /* Servers known: any thread (count()), or byteps-net, which alone adds to them once started (size()). */
    int count() const { return nservers_.load(); }
    size_t size() const { return (size_t)nservers_.load(); }

    /* Server ``server``'s direct link (NULL: none: a server lost before its link opened), and the same
     * while it works, else NULL (a link breaks only when the server goes, and the scheduler reports that
     * loss to everyone). */
    BpsConn *link(int server) const { return links_[(size_t)server].get(); }
    BpsConn *live(int server) const {
        BpsConn *l = link(server);
        return l != nullptr && !l->dead() ? l : nullptr;
    }

    /* Who writes or reads server ``server``'s link now: byteps-net, or a direct caller, which also marks
     * it owned while it waits on it (byteps-net does not poll it then). */
    std::mutex &link_mu(int server) { return *link_mu_[(size_t)server]; }
    bool direct_owned(int server) const { return direct_owned_[(size_t)server].load(); }
    void set_direct_owned(int server, bool on) { direct_owned_[(size_t)server].store(on); }

    /* The UCP worker's user: byteps-net, except while it sleeps in poll, or a direct caller. The lock is
     * held on return only when there is a UCP worker (there is none without UCX links). */
    bool has_ucx() const { return ucx_ != nullptr; }
    std::unique_lock<std::mutex> lock_ucx() {
        std::unique_lock<std::mutex> lock(ucx_mu_, std::defer_lock);
        if (ucx_) lock.lock();
        return lock;
    }

    /* Transport seam: one message to server ``server``. 0, or -1 with errno set. To a server whose link
     * is gone the message is dropped: what the server owes waits for its loss to be handled (elastic:
     * re-sent to its replacement at commit(); else the scheduler's report fails the job). */
    int send(int server, BpsFrames &f) {
        BpsConn *l = live(server);
        if (l == nullptr) {
            f.release_from(0);
            return 0;
        }
        std::lock_guard<std::mutex> link_lock(link_mu(server)); /* a direct caller may hold it briefly */
        if (l->send(f) == 0) return 0;
        errno = ECONNRESET;
        return -1;
    }

    /* A burst of messages leaves in as few writes as the sockets take (on), then goes (off). */
    void cork(bool on) {
        for (size_t i = 0; i < size(); ++i) {
            BpsConn *l = live((int)i);
            if (l == nullptr) continue;
            std::lock_guard<std::mutex> link_lock(*link_mu_[i]);
            l->cork(on);
        }
    }

    /* Bytes of messages to and from server ``server`` (byteps.metrics()). */
    void count_sent(int server, uint64_t n) { sent_[(size_t)server] += n; }
    void count_received(int server, uint64_t n) { received_[(size_t)server] += n; }
    uint64_t bytes_sent(int server) const { return server < (int)sent_.size() ? sent_[(size_t)server].load() : 0; }
    uint64_t bytes_received(int server) const {
        return server < (int)received_.size() ? received_[(size_t)server].load() : 0;
    }

    /* Whether server ``server`` is on this machine (its partitions may go through shared memory). */
    void set_colocated(int server, bool on) {
        if (server >= 0 && server < BPS_MAX_SERVERS) colocated_[(size_t)server].store(on);
    }
    bool colocated(int server) const { return server >= 0 && colocated_[(size_t)server].load(); }

    /* Elastic: server ``server`` left the job (hold()); it stays dead. */
    void set_dead(int server) {
        if (server >= 0 && server < BPS_MAX_SERVERS) dead_[(size_t)server].store(true);
    }
    bool dead(int server) const { return dead_[(size_t)server].load(); }

    /* byteps-net: links that broke (here or under a direct caller) since the last call are kept for
     * Python (lost()); true when there are new ones to tell it of. */
    bool report_broken() {
        bool any = false;
        for (size_t i = 0; i < size(); ++i) {
            BpsConn *l = links_[i].get();
            if (l == nullptr || !l->dead() || reported_[i]) continue;
            reported_[i] = true; /* the server went (or closed it): Python tells the scheduler (elastic) */
            std::lock_guard<std::mutex> lock(mu_);
            lost_.push_back((int)i);
            any = true;
        }
        return any;
    }

    /* Servers whose direct link broke since the last call (Python tells the scheduler: elastic servers). */
    void lost(std::vector<int> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(lost_);
        lost_.clear();
    }

  private:
    uint32_t node_id_;
    std::unique_ptr<BpsUcxWorker> ucx_;           /* this process's UCP worker (UCX links); outlives links_ */
    std::mutex ucx_mu_;                           /* the UCP worker's user (lock_ucx) */
    std::vector<std::unique_ptr<BpsConn>> links_; /* per server: its direct link (TCP or UCX), or NULL */
    std::vector<std::unique_ptr<std::mutex>> link_mu_; /* per server: who writes or reads its link now */
    std::deque<std::atomic<bool>> direct_owned_;       /* per server: a direct caller holds its link */
    std::deque<std::atomic<uint64_t>> sent_, received_;
    std::deque<std::atomic<bool>> colocated_; /* per server: on this machine (shared memory) */
    std::deque<std::atomic<bool>> dead_;      /* per server: left the job */
    std::atomic<int> nservers_{0};
    std::vector<bool> reported_; /* byteps-net: per server, its broken link was reported */

    std::mutex mu_; /* guards the two hand-overs below */
    std::vector<int> joined_; /* link fds of servers that joined, for byteps-net */
    std::vector<int> lost_;   /* servers whose link broke, for Python */
};

#endif
