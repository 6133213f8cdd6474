/* The Summation Service server's native data plane: receive, check, sum and reply without the GIL
 * (docs/architecture.md, byteps-serve). After the first address book summation/server.py hands the
 * data ROUTER to BpsServerCore, whose thread byteps-serve owns it from then on; its parts are in
 * the headers it includes.
 *
 * This file: what Python calls (commands through an inbox, from any thread), the thread's loop, and
 * who handles each message. Every push is served here; everything else goes to Python unchanged, in
 * arrival order, through forwarded() and a notify eventfd (handshakes, identities not admitted yet,
 * PROBE, LINK, anything malformed). Python's own replies go out through send() on this thread.
 */
#ifndef BPS_SERVER_H
#define BPS_SERVER_H

#include <malloc.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/transport/bps_link.h"
#include "core/kernels/bps_reduce.h"
#include "core/pipeline/bps_trace.h"
#include "core/transport/bps_ucx.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"
#include "summation/native/async_rounds.h"
#include "summation/native/elastic_rounds.h"
#include "summation/native/replies.h"
#include "summation/native/round.h"
#include "summation/native/server_links.h"
#include "summation/native/sync_rounds.h"

/* A message for Python: its frames (moved, no copy), and whether Python must answer admit() for its
 * identity afterwards. */
struct BpsServerForward {
    BpsMessage *msg = nullptr;
    bool auth = false;

    ~BpsServerForward() { delete msg; }
};

/* A message Python sends through this thread: copied frames, the last one zero-copy with a token
 * Python keeps its buffer alive for until released() returns it. */
struct BpsServerSend {
    std::vector<std::string> frames;
    void *zc_data = nullptr;
    size_t zc_len = 0;
    int64_t token = -1;
};

class BpsServerCore;

struct BpsServerZcHint {
    BpsServerCore *core;
    int64_t token;
};

class BpsServerCore {
  public:
    BpsServerCore(void *sock, bool auth_on, bool shared_stores, int sum_threads, int kernel_threads)
        : sock_(sock), auth_on_(auth_on), rounds_(shared_stores, sum_threads, kernel_threads),
          links_(sock, book_.node_id, logger()), replies_(links_, book_, rounds_.alloc()),
          sync_(rounds_, book_, replies_, logger()), async_(rounds_, book_, replies_, logger()),
          elastic_(rounds_, book_, replies_, logger()) {
        /* Every push's body arrives in a fresh message of its partition's size, freed once summed: keep
         * freed partitions in the heap for the next round, not a new mapping that faults per 4 KB page
         * (docs/benchmarks.md). */
        mallopt(M_MMAP_THRESHOLD, 32 << 20);  /* glibc's largest; partitions are 4 MB by default */
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        notify_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    }

    /* BYTEPS_ENABLE_ASYNC (docs/async.md): asynchronous push_pulls are served (before start()); a
     * synchronous server refuses them rather than sum parameters. */
    void set_async(bool on) { async_on_ = on; }

    /* BYTEPS_ELASTIC (docs/elastic.md): a key's first push sets its round (before start()). */
    void set_adopt_rounds(bool on) {
        adopt_rounds_ = on;
        sync_.set_elastic(on ? &elastic_ : nullptr);
    }

    ~BpsServerCore() {
        stop();
        links_.close(rounds_.alloc()); /* before the stores: a queued zero-copy reply releases its arena */
        rounds_.clear();
        for (auto &kv : parked_) {
            for (BpsMessage *m : kv.second) delete m;
        }
        parked_.clear();
        {
            std::lock_guard<std::mutex> lock(mu_);
            for (BpsServerForward *f : forward_) delete f;
            forward_.clear();
        }
        ::close(wake_fd_);
        ::close(notify_fd_);
    }

    /* Python's side (any thread, short locks) ------------------------------------------------ */

    void start() {
        std::lock_guard<std::mutex> lock(mu_); /* the full barrier that hands the socket over */
        rounds_.start_sums(wake_fd_);
        thread_ = std::thread([this] { run(); });
    }

    void stop() {
        if (!thread_.joinable()) return;
        stopping_ = true;
        wake();
        thread_.join();
    }

    /* A listening TCP socket for workers' direct links (before start()); this thread owns and closes it. */
    void set_listener(int fd) { links_.set_listener(fd); }

    /* Listen for workers' UCX endpoints on ``host`` (before start()): the port, or -1 with ``why``. */
    int ucx_listen(const std::string &host, std::string *why) { return links_.ucx_listen(host, why, rounds_.alloc()); }

    /* Python gave ``ident`` (authenticated) this one-time token for a direct link. */
    void expect_link(const std::string &ident, const std::string &token) {
        Command c(Command::LINK);
        c.ident = ident;
        c.token = token;
        post(std::move(c));
    }

    uint64_t links_accepted() const { return links_.accepted(); }

    /* An eventfd that is readable while forwarded messages, log lines or released tokens wait. */
    int notify_fd() const { return notify_fd_; }

    /* The address book: who pushes, and the ranks error messages name. num_workers < 0: no book
     * (after LEAVE): data goes to Python, which says "data arrived before the address book". */
    void set_book(int64_t num_workers, int64_t pushers, uint32_t node_id, const std::vector<uint32_t> &nodes,
                  const std::vector<int64_t> &ranks) {
        Command c(Command::BOOK);
        c.a = num_workers;
        c.b = pushers;
        c.node = node_id;
        c.nodes = nodes;
        c.ranks = ranks;
        post(std::move(c));
    }

    /* join(): ``done`` restarts every key (a sync point); else ranks in join() and machines still pushing. */
    void set_join(bool done, const std::vector<int64_t> &joined, int64_t active_pushers) {
        Command c(Command::JOIN);
        c.a = done;
        c.b = active_pushers;
        c.ranks = joined;
        post(std::move(c));
    }

    /* A process set's tensor key: its rounds complete with its ``members``' pushes (posted before any is
     * sent: the scheduler gives the members the key only once every server has answered). */
    void set_pushers(uint32_t tensor_key, int64_t members) {
        Command c(Command::SET_PUSHERS);
        c.a = tensor_key;
        c.b = members;
        post(std::move(c));
    }

    /* LEAVE: every key restarts at round 0; stores and peers' mappings are dropped. */
    void reset() { post(Command(Command::RESET)); }

    /* Python's verdict on an identity after a forwarded message marked ``auth``. */
    void admit(const std::string &ident, bool ok) {
        Command c(Command::ADMIT);
        c.ident = ident;
        c.a = ok;
        post(std::move(c));
    }

    void send(BpsServerSend *m) {
        Command c(Command::SEND);
        c.send = m;
        post(std::move(c));
    }

    void forwarded(std::vector<BpsServerForward *> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(forward_);
    }

    void logs(std::vector<std::string> *out) {
        std::lock_guard<std::mutex> lock(mu_);
        out->swap(logs_);
    }

    void released(std::vector<int64_t> *out) {
        std::lock_guard<std::mutex> lock(zc_mu_);
        out->swap(released_);
    }

    /* counters (tests and logs prove the native path ran) */
    uint64_t pushes() const { return sync_.pushes() + async_.pushes(); }
    uint64_t rounds() const { return sync_.completed(); }
    uint64_t forwards() const { return forwards_.load(); }

    static void raw_released(void *, void *hint) {
        BpsServerZcHint *h = (BpsServerZcHint *)hint;
        {
            std::lock_guard<std::mutex> lock(h->core->zc_mu_);
            h->core->released_.push_back(h->token);
        }
        h->core->notify();
        delete h;
    }

  private:
    struct Command {
        enum Kind { BOOK, JOIN, SET_PUSHERS, RESET, ADMIT, SEND, LINK } kind;
        int64_t a = 0, b = 0;
        uint32_t node = 0;
        std::vector<uint32_t> nodes;
        std::vector<int64_t> ranks;
        std::string ident, token;
        BpsServerSend *send = nullptr;
        explicit Command(Kind k) : kind(k) {}
    };

    void post(Command &&c) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            inbox_.push_back(std::move(c));
            inbox_ready_.store(true, std::memory_order_release);
        }
        wake();
    }

    void wake() { bps_signal(wake_fd_); }

    void notify() { bps_signal(notify_fd_); }

    /* The parts' warnings go to Python with this thread's own (logs()). */
    BpsServerLog logger() {
        return [this](const std::string &line) { log(line); };
    }

    void log(const std::string &line) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            logs_.push_back(line);
        }
        notify_pending_ = true;
    }

    /* ---------------------------------------------------------------- the thread */

    void run() {
        prctl(PR_SET_NAME, "byteps-serve", 0, 0, 0);
        std::vector<bps_zmq_pollitem> items;
        BpsMessage msg;
        double next_check = 0;
        while (!stopping_) {
            /* ROUTER, wake-up, then the links' (listener, UCX wake-up, one item per link) */
            const size_t conns_at = BpsServerLinks::CONNS_AT;
            items.assign(conns_at, bps_zmq_pollitem{nullptr, -1, 0, 0});
            items[0] = bps_zmq_pollitem{sock_, 0, BPS_ZMQ_POLLIN, 0};
            items[1] = bps_zmq_pollitem{nullptr, wake_fd_, BPS_ZMQ_POLLIN, 0};
            bool buffered = links_.poll_items(items);
            int rc = bps_zmq.poll(items.data(), (int)items.size(), buffered ? 0 : 100);
            if (rc < 0 && bps_zmq.errno_() != EINTR) break; /* the context was terminated */
            if (items[1].revents) bps_drain(wake_fd_);
            take_inbox();
            links_.cork(true); /* this turn's replies leave in as few writes as possible */
            sync_.take_sums();
            if (items[0].revents) {
                for (int k = 0; k < 256 && !stopping_; ++k) { /* a burst, then the inbox and sums again */
                    /* a command Python posted before this message arrived is applied first: Python acknowledges
                     * a join()'s end to the scheduler right after posting it, and workers then push at once */
                    if (inbox_ready_.load(std::memory_order_acquire)) take_inbox();
                    int got = links_.recv_message(&msg);
                    if (got <= 0) break;
                    on_message(&msg);
                    msg.clear();
                    if (k % 32 == 31) sync_.take_sums();
                }
            }
            auto &conns = links_.conns();
            size_t nconns = items.size() - conns_at; /* links accepted below wait for the next turn */
            for (size_t i = 0; i < nconns && !stopping_; ++i) {
                if (items[conns_at + i].revents || conns[i]->pending_input())
                    serve_link(conns[i].get(), items[conns_at + i].revents, &msg);
            }
            links_.cork(false);
            links_.after_turn(items[2].revents != 0);
            if (notify_pending_) {
                notify_pending_ = false;
                notify();
            }
            double now = bps_server_now();
            if (now >= next_check) { /* walks every key: not once per message */
                sync_.warn_stalls(now);
                rounds_.alloc().collect();
                next_check = now + 1.0;
            }
        }
    }

    /* ---------------------------------------------------------------- a direct link's messages */

    void serve_link(BpsConn *c, short revents, BpsMessage *msg) {
        if (revents & BPS_ZMQ_POLLOUT) c->flush();
        for (int k = 0; k < 256 && !c->dead() && !stopping_; ++k) {
            if (c->ident.empty()) { /* the first message must present a token */
                if (c->recv(msg) <= 0) return;
                links_.hello(c, msg);
                if (c->ident.empty()) return; /* refused: it goes after this turn */
            } else {
                if (inbox_ready_.load(std::memory_order_acquire)) take_inbox(); /* as for the ROUTER's messages */
                if (c->recv(msg, &c->ident) <= 0) return;
                on_message(msg, true);
            }
            msg->clear();
            if (k % 32 == 31) sync_.take_sums();
        }
    }

    void take_inbox() {
        std::vector<Command> in;
        {
            std::lock_guard<std::mutex> lock(mu_);
            in.swap(inbox_);
            inbox_ready_.store(false, std::memory_order_relaxed);
        }
        for (Command &c : in) {
            switch (c.kind) {
                case Command::BOOK:
                    book_.have = c.a >= 0;
                    book_.num_workers = c.a;
                    book_.pushers = c.b;
                    book_.node_id = c.node;
                    book_.ranks.clear();
                    for (size_t i = 0; i < c.nodes.size() && i < c.ranks.size(); ++i)
                        book_.ranks[c.nodes[i]] = c.ranks[i];
                    break;
                case Command::JOIN:
                    if (c.a != 0) { /* everyone joined: a sync point, every key restarts at round 0 */
                        book_.joined.clear();
                        reset_keys();
                    } else {
                        book_.joined = c.ranks;
                        book_.active_pushers = c.b;
                        sync_.on_join();
                    }
                    break;
                case Command::SET_PUSHERS:
                    book_.set_pushers[(uint32_t)c.a] = c.b;
                    break;
                case Command::RESET:
                    reset_keys();
                    break;
                case Command::ADMIT:
                    on_admit(c.ident, c.a != 0);
                    break;
                case Command::SEND:
                    send_frames(c.send);
                    delete c.send;
                    break;
                case Command::LINK:
                    links_.expect(c.ident, c.token);
                    break;
            }
        }
    }

    /* ---------------------------------------------------------------- who handles a message */

    /* ``m``: [identity, header, body...], from the ROUTER or (``linked``) from that identity's link. */
    void on_message(BpsMessage *m, bool linked = false) {
        if (m->count < 1) return;
        std::string ident((const char *)m->data(0), m->size(0));
        if (auth_on_) {
            auto parked = parked_.find(ident);
            if (parked != parked_.end()) { /* Python has not decided on this identity's AUTH yet */
                park(parked->second, m);
                return;
            }
        }
        BpsHeader h;
        bool parsed = m->count >= 2 && bps_parse_header(m->data(1), m->size(1), &h);
        if (parsed && h.cmd == BPS_CMD_AUTH && h.length <= BPS_MAX_CONTROL_BODY && auth_on_) {
            parked_[ident]; /* hold what follows until admit() */
            forward(m, true);
            return;
        }
        if (!parsed || h.cmd == BPS_CMD_HELLO || h.cmd == BPS_CMD_AUTH ||
            (auth_on_ && admitted_.find(ident) == admitted_.end())) {
            forward(m); /* handshakes, malformed, strangers: Python answers, ignores or logs */
            return;
        }
        bool data = h.cmd == BPS_CMD_PUSHPULL || h.cmd == BPS_CMD_BROADCAST || h.cmd == BPS_CMD_ASYNC_PUSHPULL;
        if ((data || h.cmd == BPS_CMD_RESULT) && !linked) { /* ZeroMQ is the control plane only */
            replies_.reply_error(ident, h, bps_key_name(h.key) + ": rank " + bps_rank_str(book_.rank_of(h.sender)) +
                                               " sent a " + (data ? "push" : "RESULT") +
                                               " over ZeroMQ: partitions travel over direct links only");
            return;
        }
        if (h.cmd == BPS_CMD_RESULT && adopt_rounds_ && book_.have && m->count >= 3 && h.length <= BPS_MAX_BODY) {
            elastic_.on_result(h, m);
            return;
        }
        if (!(data && book_.have && m->count >= 3 && h.length <= BPS_MAX_BODY)) {
            forward(m); /* PROBE, LINK, or a data message Python refuses with the reason */
            return;
        }
        if (h.cmd != BPS_CMD_ASYNC_PUSHPULL) {
            sync_.on_push(ident, h, m);
        } else if (async_on_) {
            async_.on_push(ident, h, m);
        } else { /* the scheduler refuses such jobs; never sum parameters */
            replies_.reply_error(ident, h, "asynchronous push_pull sent to a synchronous server "
                                           "(BYTEPS_ENABLE_ASYNC differs)");
        }
    }

    void forward(BpsMessage *m, bool auth = false) {
        BpsServerForward *f = new BpsServerForward();
        f->msg = m->moved();
        f->auth = auth;
        {
            std::lock_guard<std::mutex> lock(mu_);
            forward_.push_back(f);
        }
        forwards_.fetch_add(1);
        notify_pending_ = true;
    }

    void park(std::deque<BpsMessage *> &queue, BpsMessage *m) {
        if (queue.size() >= BPS_MAX_PARKED) {
            if (queue.size() == BPS_MAX_PARKED) log("dropped messages from a peer whose authentication is still open");
            return;
        }
        queue.push_back(m->moved());
    }

    /* Python checked an AUTH of ``ident``: admit it or not, then handle what it sent meanwhile, in order. */
    void on_admit(const std::string &ident, bool ok) {
        if (ok) admitted_.insert(ident);
        auto it = parked_.find(ident);
        if (it == parked_.end()) return;
        std::deque<BpsMessage *> queue;
        queue.swap(it->second);
        parked_.erase(it);
        while (!queue.empty()) {
            BpsMessage *m = queue.front();
            queue.pop_front();
            on_message(m); /* another AUTH parks the rest again */
            delete m;
            auto again = parked_.find(ident);
            if (again != parked_.end()) {
                for (BpsMessage *rest : queue) again->second.push_back(rest);
                return;
            }
        }
    }

    /* Python's message [identity, frames...]: every frame copied but a zero-copy last one. */
    void send_frames(BpsServerSend *m) {
        size_t n = m->frames.size();
        bool zc = m->zc_data != nullptr;
        BpsFrames f;
        for (size_t i = 1; i < n && f.n < BPS_LINK_MAX_FRAMES - 1; ++i) f.copy(m->frames[i].data(), m->frames[i].size());
        if (zc) f.zero_copy(m->zc_data, m->zc_len, &BpsServerCore::raw_released, new BpsServerZcHint{this, m->token});
        if (n == 0) { /* nobody to send to: Python may drop its buffer now */
            f.release_from(0);
            return;
        }
        links_.send_to(m->frames[0], f);
    }

    /* LEAVE, or everyone joined: every key restarts at round 0. */
    void reset_keys() { rounds_.reset(); }

    void *sock_; /* the data ROUTER (polled here; links_ reads and writes it) */
    bool auth_on_;
    int wake_fd_, notify_fd_;
    std::thread thread_;
    std::atomic<bool> stopping_{false};

    std::mutex mu_; /* guards what Python touches: the inbox and the queues below */
    std::vector<Command> inbox_;
    std::atomic<bool> inbox_ready_{false}; /* inbox_ is not empty (read without the lock per message) */
    std::vector<BpsServerForward *> forward_;
    std::vector<std::string> logs_;

    std::mutex zc_mu_;
    std::vector<int64_t> released_;

    std::atomic<uint64_t> forwards_{0};
    bool adopt_rounds_ = false;
    bool async_on_ = false;

    /* serve-thread state */
    bool notify_pending_ = false;
    BpsBook book_;
    std::set<std::string> admitted_;
    std::map<std::string, std::deque<BpsMessage *>> parked_;
    BpsRounds rounds_;
    BpsServerLinks links_;
    BpsServerReplies replies_;
    BpsSyncRounds sync_;
    BpsAsyncRounds async_;
    BpsElasticRounds elastic_;
};

#endif
