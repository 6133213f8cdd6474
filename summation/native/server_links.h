/* The server's transport seam: the data ROUTER, workers' direct links (a BpsConn: a TCP socket,
 * BpsLink, or a UCX endpoint, BpsUcxLink; core/transport/bps_link.h, core/transport/bps_ucx.h) and their accept loop.
 * A link is admitted once the worker presents the one-time token Python gave it (expect()); every
 * message out goes through send_to(), which picks that worker's link or the ROUTER. Serve-thread
 * state only, but for the counter. */
#ifndef BPS_SERVER_LINKS_H
#define BPS_SERVER_LINKS_H

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/transport/bps_link.h"
#include "core/transport/bps_ucx.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"
#include "summation/native/server_texts.h"
#include "summation/native/store.h"

using BpsServerLog = std::function<void(const std::string &)>;

class BpsServerLinks {
  public:
    /* ``node_id``: this server's, for the answer to a link's token (the address book sets it later) */
    BpsServerLinks(void *sock, const uint32_t &node_id, BpsServerLog log)
        : sock_(sock), node_id_(node_id), log_(std::move(log)) {}

    /* The links first (a queued zero-copy reply releases its arena), then the UCP worker; the stores
     * outlive the UCP worker that registered them. */
    void close(BpsStoreAllocator &alloc) {
        by_ident_.clear();
        conns_.clear();
        alloc.set_hooks(nullptr, nullptr);
        ucx_.reset();
        if (listen_fd_ >= 0) ::close(listen_fd_);
        listen_fd_ = -1;
    }

    /* A listening TCP socket for workers' direct links (before start()); this thread owns and closes it. */
    void set_listener(int fd) { listen_fd_ = fd; }

    /* Listen for workers' UCX endpoints on ``host`` (before start()): the port, or -1 with ``why``. */
    int ucx_listen(const std::string &host, std::string *why, BpsStoreAllocator &alloc) {
        if (!ucx_) {
            ucx_.reset(BpsUcxWorker::create(why));
            if (ucx_) /* the stores replies are sent from: registered once, for as long as they live */
                alloc.set_hooks([this](void *base, size_t len) { ucx_->register_region(base, len); },
                                [this](void *base) { ucx_->unregister_region(base); });
        }
        return ucx_ ? ucx_->listen(host, why) : -1;
    }

    /* Python gave ``ident`` (authenticated) this one-time token for a direct link. */
    void expect(const std::string &ident, const std::string &token) { expected_[ident] = token; }

    uint64_t accepted() const { return links_accepted_.load(); }

    std::vector<std::unique_ptr<BpsConn>> &conns() { return conns_; }

    /* The poll items after the ROUTER's and the wake-up's: listener, UCX wake-up, then one per link
     * (rebuilt each turn: links come and go). True when a link already holds whole messages. */
    static const size_t CONNS_AT = 4;
    bool poll_items(std::vector<bps_zmq_pollitem> &items) {
        items[2] = bps_zmq_pollitem{nullptr, listen_fd_, (short)(listen_fd_ >= 0 ? BPS_ZMQ_POLLIN : 0), 0};
        items[3] = bps_zmq_pollitem{nullptr, ucx_ ? ucx_->efd() : -1, (short)(ucx_ ? BPS_ZMQ_POLLIN : 0), 0};
        for (auto &c : conns_)
            items.push_back(bps_zmq_pollitem{nullptr, c->fd(),
                                             (short)(BPS_ZMQ_POLLIN | (c->wants_write() ? BPS_ZMQ_POLLOUT : 0)), 0});
        bool buffered = false; /* a link that stopped mid-burst has whole messages in hand: no sleep */
        for (auto &c : conns_) buffered |= c->pending_input();
        if (ucx_) buffered |= ucx_->prepare_sleep(); /* arms UCX's wake-up fd (new endpoints too) */
        return buffered;
    }

    void cork(bool on) {
        for (auto &c : conns_) c->cork(on);
    }

    /* After a turn: new TCP connections and UCX endpoints (unadmitted links), then the dead go. */
    void after_turn(bool listener_ready) {
        if (listener_ready) accept_links();
        if (ucx_) { /* endpoints the UCX listener accepted: unadmitted links, like accepted sockets */
            ucx_->progress();
            for (BpsUcxLink *l : ucx_->take_accepted()) conns_.emplace_back(l);
        }
        drop_dead_links();
    }

    /* Transport seam: one whole message from the ROUTER, without blocking (1: got one, 0: none). */
    int recv_message(BpsMessage *m) { return bps_recv_message(sock_, m); }

    /* Transport seam: one message to a worker, over its direct link if it has one, else the ROUTER. A
     * worker that is gone is skipped (ROUTER_MANDATORY says EHOSTUNREACH; the scheduler reports the
     * loss to everyone); its zero-copy frames are released either way. */
    void send_to(const std::string &ident, BpsFrames &f) {
        auto it = by_ident_.find(ident);
        if (it != by_ident_.end() && !it->second->dead()) {
            it->second->send(f);
            return;
        }
        bps_zmq_send_frames(sock_, f, &ident);
    }

    /* [header LINK, token (16 bytes) + identity]: admit the link if Python gave that identity the token. */
    void hello(BpsConn *c, BpsMessage *m) {
        BpsHeader h;
        bool ok = m->count == 2 && bps_parse_header(m->data(0), m->size(0), &h) && h.cmd == BPS_SERVER_CMD_LINK &&
                  m->size(1) > 16;
        std::string ident, token;
        if (ok) {
            token.assign((const char *)m->data(1), 16);
            ident.assign((const char *)m->data(1) + 16, m->size(1) - 16);
            auto it = expected_.find(ident);
            ok = it != expected_.end() && it->second == token;
            if (ok) expected_.erase(it); /* one use */
        }
        BpsHeader answer = bps_header(BPS_SERVER_CMD_LINK, node_id_, 0, 0, 0, BPS_SERVER_NO_DTYPE, ok ? 1 : 0, 0);
        BpsFrames f;
        f.copy(&answer, sizeof answer);
        c->send(f);
        if (!ok) {
            log_(std::string("refused a direct link (") + c->kind() + "): its token does not match one this server handed out");
            c->ident.clear();
            close_link_later(c);
            return;
        }
        c->ident = ident;
        auto old = by_ident_.find(ident);
        if (old != by_ident_.end()) close_link_later(old->second); /* a worker that reconnected */
        by_ident_[ident] = c;
        links_accepted_.fetch_add(1);
    }

  private:
    void accept_links() {
        for (;;) {
            int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) return; /* EAGAIN, or a connection that failed before we took it */
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            conns_.emplace_back(new BpsLink(fd));
        }
    }

    void close_link_later(BpsConn *c) { closing_.insert(c); }

    /* Links that broke, or were refused, go; their identities fall back to the ROUTER. */
    void drop_dead_links() {
        for (size_t i = 0; i < conns_.size();) {
            BpsConn *c = conns_[i].get();
            bool refused = closing_.count(c) > 0;
            if (!c->dead() && !refused) {
                ++i;
                continue;
            }
            if (refused && c->wants_write()) c->flush(); /* best effort: the refusal's answer */
            auto it = by_ident_.find(c->ident);
            if (it != by_ident_.end() && it->second == c) by_ident_.erase(it);
            closing_.erase(c);
            conns_.erase(conns_.begin() + (long)i);
        }
    }

    void *sock_;
    const uint32_t &node_id_;
    BpsServerLog log_;
    int listen_fd_ = -1;
    std::unique_ptr<BpsUcxWorker> ucx_; /* this thread's UCP worker and listener (BYTEPS_TRANSPORT=ucx) */
    std::vector<std::unique_ptr<BpsConn>> conns_;
    std::unordered_map<std::string, BpsConn *> by_ident_;
    std::map<std::string, std::string> expected_; /* identity -> its one-time token */
    std::set<BpsConn *> closing_;
    std::atomic<uint64_t> links_accepted_{0};
};

#endif
