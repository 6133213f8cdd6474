/* The worker's paths to the other worker processes of its machine (the local reduce): our ROUTER (what
 * they send us), a DEALER to each of them, and a direct link to each (BpsLink on 127.0.0.1, or
 * BpsShmLink over shared-memory rings) once Python opened it; who may talk to us on the ROUTER.
 *
 * A message on a link is taken as if it came on the ROUTER from that peer's DEALER identity, so that
 * what Python gets (forwarded) looks the same either way; send() uses the link while it works, else
 * the DEALER.
 *
 * Threads: Python's, before start() (setup, add_link), for admissions (allow) and the counters;
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
#include <set>
#include <string>
#include <vector>

#include "core/pipeline/worker_types.h"
#include "core/transport/bps_link.h"
#include "core/transport/bps_wire.h"
#include "core/transport/bps_zmq.h"

class BpsLocalPeers {
  public:
    /* Our ROUTER and a DEALER per other local rank (NULL for ourselves), authenticated by Python (before
     * start()); ``open`` when the job has no secret (every peer admitted). */
    void setup(void *router, std::vector<void *> peers, bool open) {
        router_ = router;
        peers_ = std::move(peers);
        links_.resize(peers_.size());
        ident_.resize(peers_.size());
        for (size_t r = 0; r < peers_.size(); ++r) link_mu_.emplace_back(new std::recursive_mutex());
        direct_owned_.resize(peers_.size());
        open_ = open;
    }

    /* A direct link to local rank ``r`` (before start(), after setup()): a connected socket whose
     * token was checked; ``ident`` is r's DEALER identity toward our ROUTER. This object owns and closes
     * the fd. ``ring_fd`` >= 0: the pair's shared-memory rings (BpsShmLink; the caller keeps the fd),
     * ``low``: we are the lower local rank. "" or why the ring could not be mapped: the socket is then
     * closed, so that both ends fall back to the DEALER. */
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

    /* Local ranks (0 before setup()): a link and a DEALER each, but ours. */
    size_t size() const { return links_.size(); }
    void *router() const { return router_; }

    /* Local rank ``r``'s direct link (NULL: none), and the same while it works, else NULL (its DEALER
     * then). */
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

    /* [header, body] to local rank ``r``: on its link while it works, else on its DEALER. 0, or
     * non-zero with errno set. */
    int send(int r, const BpsHeader *h, const void *body, size_t n) {
        std::unique_lock<std::recursive_mutex> link_lock(link_mu(r)); /* a direct caller may hold it briefly */
        BpsConn *l = live(r);
        if (l != nullptr) {
            BpsFrames f;
            f.copy(h, sizeof *h);
            f.copy(body, n);
            if (l->send(f) == 0) {
                sent_.fetch_add(1);
                return 0;
            }
            /* it broke just now: the DEALER takes this one */
        }
        void *sock = peers_[(size_t)r];
        int rc = bps_send_copy(sock, h, sizeof *h, true);
        if (rc == 0) rc = bps_send_copy(sock, body, n, false);
        return rc;
    }

    /* A link a direct caller sent on: counted as send() counts. */
    void count_sent() { sent_.fetch_add(1); }

    /* Python's message ``f`` (send_raw) to local rank ``r``, by the same path as ours, so that one peer's
     * messages stay in order; a link that broke just now leaves a copied body (``m``) to the DEALER. */
    void send_raw(int r, BpsFrames &f, const BpsRawSend &m) {
        std::unique_lock<std::recursive_mutex> link_lock(link_mu(r));
        BpsConn *l = live(r);
        if (l == nullptr) {
            bps_zmq_send_frames(peers_[(size_t)r], f);
        } else if (l->send(f) == 0) {
            sent_.fetch_add(1);
        } else if (m.zc_data == nullptr) {
            BpsFrames again;
            again.copy(m.header.data(), m.header.size());
            again.copy(m.body.data(), m.body.size());
            bps_zmq_send_frames(peers_[(size_t)r], again);
        }
    }

    /* Python's message ``f`` on our ROUTER, to the peer ``ident`` (a handshake's answer). */
    void send_router(BpsFrames &f, const std::string &ident) { bps_zmq_send_frames(router_, f, &ident); }

    /* Admission: a peer that passed Python's handshake on our ROUTER (core/auth.py Gate), handed to
     * byteps-net (take_allowed). A message is ours if the job is open, it came on a link (authenticated
     * by its token, the identity frame put there by us), or its identity was admitted. */
    void allow(const std::string &identity) {
        std::lock_guard<std::mutex> lock(allow_mu_);
        allow_in_.push_back(identity);
    }
    void take_allowed() {
        std::vector<std::string> in;
        {
            std::lock_guard<std::mutex> lock(allow_mu_);
            in.swap(allow_in_);
        }
        for (auto &a : in) allowed_.insert(a);
    }
    bool admitted(const std::string &ident, bool linked) const {
        return open_ || linked || allowed_.count(ident) != 0;
    }

    /* Messages sent and received on local links (byteps.metrics(); tests check the path really ran). */
    uint64_t sent() const { return sent_.load(); }
    uint64_t received() const { return received_.load(); }

  private:
    void *router_ = nullptr;
    std::vector<void *> peers_;                   /* per local rank: its DEALER (NULL: ours) */
    std::vector<std::unique_ptr<BpsConn>> links_; /* per local rank: its direct link, or NULL */
    std::vector<std::string> ident_;              /* per local rank: its DEALER identity (frame 0) */
    std::vector<std::unique_ptr<std::recursive_mutex>> link_mu_; /* per local rank: who uses its link */
    std::deque<std::atomic<bool>> direct_owned_;                 /* per local rank: a direct caller holds it */
    std::atomic<uint64_t> sent_{0}, received_{0};
    bool open_ = false;              /* no secret: every peer admitted */
    std::set<std::string> allowed_;  /* byteps-net: identities admitted */
    std::mutex allow_mu_;            /* guards allow_in_ */
    std::vector<std::string> allow_in_; /* identities Python admitted, for byteps-net */
};

#endif
