/* BpsWorkerCore, server links: DEALERs, direct links (TCP or UCX), the ZeroMQ fallback. */
#ifndef BPS_WORKER_LINKS_H
#define BPS_WORKER_LINKS_H

#include "core/pipeline/bps_worker.h"

/* Server number nservers()'s DEALER (before start(); add_server_live() after). False: too many. */
inline bool BpsWorkerCore::add_server(void *sock) {
    if (socks_.size() >= (size_t)BPS_MAX_SERVERS) return false;
    socks_.push_back(sock);
    nservers_.store((int)socks_.size());
    return true;
}

/* A server that joined the running job (elastic): its authenticated DEALER and, if it has one, its
 * direct TCP link (fd, else -1). byteps-net adopts both at its next turn, as server nservers(). */
inline bool BpsWorkerCore::add_server_live(void *sock, int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    if (nservers_.load() + (int)new_servers_.size() >= BPS_MAX_SERVERS) return false;
    new_servers_.push_back(std::make_pair(sock, fd));
    wake();
    return true;
}

/* Whether server ``server`` is on this machine (its partitions may go through shared memory). */
inline void BpsWorkerCore::set_colocated(int server, bool on) {
    if (server >= 0 && server < BPS_MAX_SERVERS) colocated_[(size_t)server].store(on);
}

/* Servers whose direct link broke since the last call (Python tells the scheduler: elastic servers). */
inline void BpsWorkerCore::lost_links(std::vector<int> *out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->swap(lost_);
    lost_.clear();
}

/* A UCX endpoint to server ``server``'s listener at host:port (before start()), admitted by the
 * one-time ``token`` Python got for ``ident``: "" once it is up, else why not (ZeroMQ stays). */
inline std::string BpsWorkerCore::add_ucx_link(int server, const std::string &host, int port, const std::string &token,
                                               const std::string &ident, double timeout) {
    std::string why;
    if (!ucx_) ucx_.reset(BpsUcxWorker::create(&why));
    if (!ucx_) return why;
    BpsHeader h = bps_header(BPS_CMD_LINK, node_id_, 0, 0, token.size() + ident.size(), BPS_NO_DTYPE, 0, 0);
    BpsUcxLink *l = ucx_->connect(host, port, std::string((const char *)&h, sizeof h), token + ident, timeout, &why);
    if (l != nullptr) links_.at((size_t)server).reset(l);
    return why;
}

/* Which transports server ``server``'s link uses: "tcp", "ucx: tcp/lo, ..." ("" without a link). */
inline std::string BpsWorkerCore::link_transport(int server) {
    std::unique_lock<std::mutex> ucx_lock(ucx_mu_, std::defer_lock); /* ucp_ep_query: the worker's user */
    if (ucx_) ucx_lock.lock();
    BpsConn *l = links_.at((size_t)server).get();
    if (l == nullptr) return "";
    if (std::string(l->kind()) != "ucx") return l->kind();
    return std::string("ucx: ") + ((BpsUcxLink *)l)->transports();
}

/* Servers reached over a direct link (tests and logs check the path really ran). */
inline int BpsWorkerCore::links_up() const {
    int n = 0;
    for (auto &l : links_) n += l && !l->dead();
    return n;
}

/* Server ``server``'s direct link while it works, else NULL (ZeroMQ then carries its messages:
 * a link breaks only when the server goes, and the scheduler reports that loss to everyone). */
inline BpsConn *BpsWorkerCore::live_link(int server) {
    BpsConn *l = links_[(size_t)server].get();
    return l != nullptr && !l->dead() ? l : nullptr;
}

/* Transport seam: one message to server ``server``. 0, or -1 with errno set. */
inline int BpsWorkerCore::send_server(int server, BpsFrames &f) {
    BpsConn *l = live_link(server);
    if (l == nullptr) return bps_zmq_send_frames(socks_[(size_t)server], f);
    std::lock_guard<std::mutex> link_lock(*link_mu_[(size_t)server]); /* a direct caller may hold it briefly */
    if (l->send(f) == 0) return 0;
    errno = ECONNRESET;
    return -1;
}

inline void BpsWorkerCore::cork_links(bool on) {
    for (size_t i = 0; i < socks_.size(); ++i) {
        BpsConn *l = live_link((int)i);
        if (l == nullptr) continue;
        std::lock_guard<std::mutex> link_lock(*link_mu_[i]);
        l->cork(on);
    }
}

#endif
