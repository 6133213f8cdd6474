/* The worker's paths to the other worker processes of its machine (the local reduce): our ROUTER, whose
 * messages (late peers' handshakes and link offers: the control plane) all go to Python, and a direct
 * link to each (BpsLink on 127.0.0.1, or BpsShmLink over shared-memory rings), authenticated by its
 * one-time token, which carries every partition. The DEALERs to the peers stay Python's.
 *
 * A message on a link is taken as if it came on the ROUTER from that peer's DEALER identity, so that
 * what Python gets (forwarded) looks the same either way.
 *
 * Threads: Python's, before start() (setup, add_link) and for the counters;
 * byteps-net, which polls, reads and sends; a direct local caller (BpsWorkerCore::submit_local_direct,
 * submit_owner_direct), which holds links for a round trip: it takes link_mu(r) and marks the link
 * direct_owned(r) so that byteps-net does not poll it meanwhile. link_mu(r) is recursive: byteps-net
 * sends on a link while it reads it.
 */
#ifndef BPS_LOCAL_PEERS_H
#define BPS_LOCAL_PEERS_H

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/pipeline/worker_types.h"
#include "core/transport/bps_link.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"

class BpsLocalPeers {
  public:
    /* Our ROUTER and the machine's ``nranks`` local ranks (before start()). */
    void setup(void *router, size_t nranks) {
        router_ = router;
        links_.resize(nranks);
        ident_.resize(nranks);
        for (size_t r = 0; r < nranks; ++r) link_mu_.emplace_back(new std::recursive_mutex());
        direct_owned_.resize(nranks);
    }

    /* A direct link to local rank ``r`` (before start(), after setup()): a connected socket whose
     * token was checked; ``ident`` is r's DEALER identity toward our ROUTER. This object owns and closes
     * the fd. ``ring_fd`` >= 0: the pair's shared-memory rings (BpsShmLink; the caller keeps the fd),
     * ``low``: we are the lower local rank. "" or why the ring could not be mapped (the socket is then
     * closed: the peer's end breaks too). */
    std::string add_link(int r, int fd, const std::string &ident, int ring_fd, bool low) {
        if (ring_fd >= 0) {
            void *region = mmap(nullptr, BPS_RING_REGION, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
            if (region == MAP_FAILED) {
                std::string why = std::string("mmap: ") + strerror(errno);
                ::close(fd);
                return why;
            }
            links_.at((size_t)r).reset(new BpsShmLink(fd, region, low));
        } else {
            links_.at((size_t)r).reset(new BpsLink(fd));
        }
        ident_.at((size_t)r) = ident;
        return "";
    }

    /* Local ranks reached over a working link, and those whose link runs over shared-memory rings
     * (tests check the path really ran). */
    int links_up() const {
        int n = 0;
        for (auto &l : links_) n += l && !l->dead();
        return n;
    }
    int rings_up() const {
        int n = 0;
        for (auto &l : links_) n += l && !l->dead() && strcmp(l->kind(), "shm") == 0;
        return n;
    }

    /* Local ranks (0 before setup()): a link each, but ours. */
    size_t size() const { return links_.size(); }
    void *router() const { return router_; }

    /* Local rank ``r``'s direct link (NULL: none), and the same while it works, else NULL. */
    BpsConn *link(int r) const { return links_[(size_t)r].get(); }
    BpsConn *live(int r) const {
        if (r < 0 || (size_t)r >= links_.size()) return nullptr;
        BpsConn *l = links_[(size_t)r].get();
        return l != nullptr && !l->dead() ? l : nullptr;
    }

    /* Who writes or reads local rank ``r``'s link now, and whether a direct caller holds it. */
    std::recursive_mutex &link_mu(int r) { return *link_mu_[(size_t)r]; }
    bool direct_owned(int r) const { return direct_owned_[(size_t)r].load(); }
    void set_direct_owned(int r, bool on) { direct_owned_[(size_t)r].store(on); }

    /* A message from local rank ``r``'s link (its lock held): [identity, header, body], as on the
     * ROUTER. > 0: one came. */
    int recv(int r, BpsMessage *msg) {
        int got = links_[(size_t)r]->recv(msg, &ident_[(size_t)r]);
        if (got > 0) received_.fetch_add(1);
        return got;
    }

    /* [header, body] to local rank ``r`` on its link. 0, or -1 with errno set (ECONNRESET: the link
     * is gone, with the process at its other end). */
    int send(int r, const BpsHeader *h, const void *body, size_t n) {
        std::unique_lock<std::recursive_mutex> link_lock(link_mu(r)); /* a direct caller may hold it briefly */
        BpsConn *l = live(r);
        BpsFrames f;
        f.copy(h, sizeof *h);
        f.copy(body, n);
        if (l == nullptr || l->send(f) != 0) {
            errno = ECONNRESET;
            return -1;
        }
        sent_.fetch_add(1);
        return 0;
    }

    /* A link a direct caller sent on: counted as send() counts. */
    void count_sent() { sent_.fetch_add(1); }

    /* Python's message ``f`` on our ROUTER, to the peer ``ident`` (a handshake's answer). */
    void send_router(BpsFrames &f, const std::string &ident) { bps_zmq_send_frames(router_, f, &ident); }

    /* Messages sent and received on local links (byteps.metrics(); tests check the path really ran). */
    uint64_t sent() const { return sent_.load(); }
    uint64_t received() const { return received_.load(); }

  private:
    void *router_ = nullptr;
    std::vector<std::unique_ptr<BpsConn>> links_; /* per local rank: its direct link, or NULL */
    std::vector<std::string> ident_;              /* per local rank: its DEALER identity (frame 0) */
    std::vector<std::unique_ptr<std::recursive_mutex>> link_mu_; /* per local rank: who uses its link */
    std::deque<std::atomic<bool>> direct_owned_;                 /* per local rank: a direct caller holds it */
    std::atomic<uint64_t> sent_{0}, received_{0};
};

#endif
