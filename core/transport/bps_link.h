/* The transport seam of the native threads: a message is up to 8 frames, sent over a ZeroMQ socket or
 * over a direct TCP link, which the native threads read and write themselves: a ZeroMQ message
 * crosses its I/O thread on both sides, two more wake-ups per hop (docs/architecture.md).
 *
 * Framing on a link (little-endian):
 *
 *     u32 magic "BPLK" | u32 frame count n (1..8) | n x u64 frame length | the frames, back to back
 *
 * Frames are what ZeroMQ would have carried (no ROUTER identity: the server knows who is on each
 * link), received as ZeroMQ messages so that BpsMessage works unchanged; a large frame is read
 * straight into its message, small ones are copied out of a 256 KB read buffer.
 *
 * Sends never block: what the socket does not take is queued and written on POLLOUT. A zero-copy
 * frame's free function runs on the sending thread once it is written, or if it never is.
 */
#ifndef BPS_LINK_H
#define BPS_LINK_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <string>
#include <vector>

#include "core/transport/bps_zmq.h"

static const uint32_t BPS_LINK_MAGIC = 0x4B4C5042u; /* "BPLK" */
static const int BPS_LINK_MAX_FRAMES = 8;
static const uint64_t BPS_LINK_MAX_FRAME = 1ull << 34; /* wire.MAX_BODY is 2^33: a bound, not a limit */
static const size_t BPS_LINK_READ_BUFFER = 256 << 10;
static const size_t BPS_LINK_DIRECT_READ = 64 << 10; /* larger frames are read straight into their message */

/* One frame to send: copied (ffn NULL) or read in place until ffn(data, hint) runs. */
struct BpsOutFrame {
    const void *data;
    size_t len;
    bps_zmq_free_fn *ffn;
    void *hint;
};

/* A message to send, built frame by frame. */
struct BpsFrames {
    BpsOutFrame f[BPS_LINK_MAX_FRAMES];
    int n = 0;

    void copy(const void *data, size_t len) { f[n++] = BpsOutFrame{data, len, nullptr, nullptr}; }
    void zero_copy(void *data, size_t len, bps_zmq_free_fn *ffn, void *hint) {
        f[n++] = BpsOutFrame{data, len, ffn, hint};
    }
    /* The frames from ``first`` on were never handed to a transport: their owners may have them back. */
    void release_from(int first) {
        for (int i = first; i < n; ++i)
            if (f[i].ffn != nullptr) f[i].ffn((void *)f[i].data, f[i].hint);
    }
};

/* The frames as one ZeroMQ multipart message, after ``ident`` (a ROUTER's routing frame) if given.
 * 0, or -1 with errno set; zero-copy frames ZeroMQ did not take are released. */
static inline int bps_zmq_send_frames(void *sock, BpsFrames &m, const std::string *ident = nullptr) {
    int rc = 0;
    if (ident != nullptr) rc = bps_send_copy(sock, ident->data(), ident->size(), m.n > 0);
    for (int i = 0; i < m.n; ++i) {
        bool more = i + 1 < m.n;
        if (rc != 0) {
            m.release_from(i);
            return rc;
        }
        if (m.f[i].ffn != nullptr) /* on failure ZeroMQ closes the message, which runs ffn */
            rc = bps_send_zero_copy(sock, (void *)m.f[i].data, m.f[i].len, more, m.f[i].ffn, m.f[i].hint);
        else
            rc = bps_send_copy(sock, m.f[i].data, m.f[i].len, more);
    }
    return rc;
}

/* Where a large frame may be read to instead of a message buffer of its own: the worker reads a
 * reply's sum straight into the partition's bytes (BpsWorkerCore::place_reply), saving PULL's copy.
 * place() is asked on the reading thread when frame ``frame`` of at least BPS_LINK_DIRECT_READ bytes
 * opens, with the frames before it complete in ``head``; it returns ``len`` bytes the frame is read
 * into (the message's frame then points there), or NULL for a buffer of the frame's own. The memory
 * must stay the frame's until the message is returned or unplace() is called. */
class BpsFrameSink {
  public:
    virtual ~BpsFrameSink() {}
    virtual void *place(BpsMessage &head, int frame, uint64_t len) = 0;
};

/* What the native threads need of a link to one peer, whatever carries it: a direct TCP socket
 * (BpsLink, below) or a UCX endpoint (BpsUcxLink, core/transport/bps_ucx.h). The worker's
 * BpsServerLinks::send() and the server's send_to() / serve_link() / link_hello() are written against
 * this alone. */
class BpsConn {
  public:
    virtual ~BpsConn() {}
    /* what to poll for input (a UCX link: its worker's wake-up fd, shared by the thread's links) */
    virtual int fd() const = 0;
    virtual bool dead() const = 0;
    /* bytes queued for the socket: poll for POLLOUT, then flush() */
    virtual bool wants_write() const = 0;
    /* Poll fd() for POLLOUT now (a shared-memory link never: its reader rings fd() when it made room). */
    virtual bool poll_for_write() const { return wants_write(); }
    /* A direct caller polls this link in a loop (on) or stops (off, before it sleeps or lets go): a
     * shared-memory link's writer then skips the wake-up write (BpsShmLink). */
    virtual void poll_ring(bool on) { (void)on; }
    /* Input already taken in but not yet returned by recv() (or, for UCX, events that came while
     * arming): poll() will not report it, so the owner calls recv() again before it sleeps. */
    virtual bool pending_input() = 0;
    /* Just before a thread that owns this link alone sleeps on fd() (a direct call's wait): true when
     * input for this link came meanwhile, so it must read first. A UCX link progresses its worker and
     * arms the wake-up fd, which reports only events that come after arming. */
    virtual bool arm_to_sleep() { return false; }
    /* why the link died ("" while it lives) */
    virtual const std::string &error() const = 0;
    /* Send one message; 0, or -1 once the link is dead (every zero-copy frame is released either way). */
    virtual int send(BpsFrames &m) = 0;
    /* Go on with what is queued; 0, or -1 once dead. */
    virtual int flush() = 0;
    /* One whole message into ``m`` (its frames replaced), after ``prefix`` as frame 0 if given (a
     * server puts the link's identity there, as a ROUTER would). 1: a message; 0: none complete
     * yet; -1: the link closed or broke (error() says how). */
    virtual int recv(BpsMessage *m, const std::string *prefix = nullptr) = 0;
    /* recv(), offering large frames to ``sink`` (BpsFrameSink). Transports that cannot read into
     * given memory (UCX) ignore it. */
    virtual int recv_into(BpsMessage *m, BpsFrameSink *sink) {
        (void)sink;
        return recv(m);
    }
    /* A frame is being read into memory a sink gave (placing), and stops going there (unplace: its
     * owner no longer waits for it; the rest of the frame goes to a buffer of its own). */
    virtual bool placing() const { return false; }
    virtual void unplace() {}
    /* "tcp" or "ucx" (logs; submit_direct takes a UCX link's whole worker, a TCP link's socket only) */
    virtual const char *kind() const = 0;
    /* While corked, send() only queues: the owner sends a burst of messages and then uncorks, and
     * they leave in as few writes as the socket takes (one sendmsg per message cost more CPU than
     * ZeroMQ's batching for small partitions). Uncorking flushes. Transports that queue by
     * themselves ignore it. */
    virtual void cork(bool on) { (void)on; }
    /* the server side: whose link this is, once its token was presented ("" before) */
    std::string ident;
};

/* A direct caller polls ``links`` for the scope (when ``on``): BpsConn::poll_ring. */
struct BpsPollingLinks {
    std::vector<BpsConn *> links;
    BpsPollingLinks(std::vector<BpsConn *> ls, bool on) {
        if (!on) return;
        links = std::move(ls);
        for (BpsConn *l : links) l->poll_ring(true);
    }
    ~BpsPollingLinks() { stop(); }
    void stop() {
        for (BpsConn *l : links) l->poll_ring(false);
        links.clear();
    }
};

/* One end of a direct TCP link; used by one thread at a time (the native thread that owns it). */
class BpsLink : public BpsConn {
  public:
    explicit BpsLink(int fd) : fd_(fd), buf_(BPS_LINK_READ_BUFFER) {}
    BpsLink(const BpsLink &) = delete;
    BpsLink &operator=(const BpsLink &) = delete;
    ~BpsLink() override {
        drop_queue();
        partial_.clear();
        if (fd_ >= 0) ::close(fd_);
    }

    int fd() const override { return fd_; }
    bool dead() const override { return dead_; }
    bool wants_write() const override { return !outq_.empty(); }
    /* bytes already read but not yet taken as messages */
    bool pending_input() override { return !dead_ && r_ < w_; }
    const std::string &error() const override { return error_; }
    const char *kind() const override { return "tcp"; }
    void cork(bool on) override {
        corked_ = on;
        if (!on) flush();
    }

    int send(BpsFrames &m) override {
        if (dead_) {
            m.release_from(0);
            return -1;
        }
        uint64_t prefix[1 + BPS_LINK_MAX_FRAMES];
        uint32_t head[2] = {BPS_LINK_MAGIC, (uint32_t)m.n};
        memcpy(&prefix[0], head, sizeof head);
        for (int i = 0; i < m.n; ++i) prefix[1 + i] = (uint64_t)m.f[i].len;
        struct iovec iov[1 + BPS_LINK_MAX_FRAMES];
        int cnt = 0;
        iov[cnt++] = iovec{prefix, sizeof(uint64_t) * (1 + m.n)};
        for (int i = 0; i < m.n; ++i) iov[cnt++] = iovec{(void *)m.f[i].data, m.f[i].len};
        size_t written = 0;
        if (outq_.empty() && !corked_) { /* nothing ahead of it: straight to the socket */
            ssize_t w = write_iov(iov, cnt);
            if (w < 0) {
                m.release_from(0);
                return -1;
            }
            written = (size_t)w;
        }
        /* queue what the socket did not take: copied pieces into owned chunks, zero-copy frames by reference */
        size_t at = 0;
        Chunk *run = nullptr; /* the owned chunk that consecutive copied pieces go into */
        for (int i = 0; i < cnt; ++i) {
            size_t start = at, len = iov[i].iov_len;
            at += len;
            const BpsOutFrame *zc = (i > 0 && m.f[i - 1].ffn != nullptr) ? &m.f[i - 1] : nullptr;
            if (written >= start + len) { /* already on the wire */
                if (zc != nullptr) zc->ffn((void *)zc->data, zc->hint);
                continue;
            }
            size_t skip = written > start ? written - start : 0;
            const char *p = (const char *)iov[i].iov_base + skip;
            if (zc != nullptr) {
                outq_.push_back(Chunk{p, len - skip, std::string(), zc->ffn, zc->hint, zc->data});
                run = nullptr;
            } else {
                if (run == nullptr) { /* deque::push_back keeps references to the other chunks valid */
                    outq_.push_back(Chunk{nullptr, 0, std::string(), nullptr, nullptr, nullptr});
                    run = &outq_.back();
                }
                run->own.append(p, len - skip);
            }
        }
        return 0;
    }

    /* Write what is queued, as far as the socket takes it; 0, or -1 once dead. */
    int flush() override {
        while (!outq_.empty() && !dead_) {
            struct iovec iov[64];
            int cnt = 0;
            for (auto it = outq_.begin(); it != outq_.end() && cnt < 64; ++it) iov[cnt++] = it->iov();
            ssize_t w = write_iov(iov, cnt);
            if (w < 0) return -1;
            if (w == 0) return 0; /* the socket is full: POLLOUT says when to go on */
            size_t left = (size_t)w;
            while (left > 0 && !outq_.empty()) {
                Chunk &c = outq_.front();
                size_t rest = c.size() - c.off;
                if (left < rest) {
                    c.off += left;
                    left = 0;
                    break;
                }
                left -= rest;
                if (c.ffn != nullptr) c.ffn((void *)c.zc_base, c.hint);
                outq_.pop_front();
            }
        }
        return dead_ ? -1 : 0;
    }

    int recv(BpsMessage *m, const std::string *prefix = nullptr) override { return read_message(m, prefix, nullptr); }
    int recv_into(BpsMessage *m, BpsFrameSink *sink) override { return read_message(m, nullptr, sink); }

    bool placing() const override { return placed_; }
    void unplace() override {
        if (!placed_) return;
        placed_ = false;
        int slot = base_ + cur_; /* its bytes so far are not kept: nobody waits for them */
        bps_zmq.msg_close(&partial_.frames[slot]);
        bps_zmq.msg_init_size(&partial_.frames[slot], (size_t)lens_[cur_]);
    }

  protected:
    int read_message(BpsMessage *m, const std::string *prefix, BpsFrameSink *sink) {
        if (dead_) return -1;
        for (;;) {
            int got = parse(prefix, sink);
            if (got < 0) return -1;
            if (got > 0) {
                m->clear();
                for (int i = 0; i < partial_.count; ++i) partial_.take(i, &m->frames[i]);
                m->count = partial_.count;
                partial_.clear();
                nframes_ = -1;
                return 1;
            }
            int more = fill();
            if (more <= 0) return more;
        }
    }

    struct Chunk {
        const char *ref;        /* a zero-copy frame's bytes (ffn set), else NULL: ``own`` holds them */
        size_t len;
        std::string own;
        bps_zmq_free_fn *ffn;
        void *hint;
        const void *zc_base;    /* what ffn is called with */
        size_t off = 0;         /* bytes of it already written */
        size_t size() const { return ref != nullptr ? len : own.size(); }
        struct iovec iov() const {
            const char *base = ref != nullptr ? ref : own.data();
            return iovec{(void *)(base + off), size() - off};
        }
    };

    /* Write without blocking; bytes written (0: would block), or -1 once dead. */
    virtual ssize_t write_iov(struct iovec *iov, int cnt) {
        for (;;) {
            struct msghdr mh;
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = iov;
            mh.msg_iovlen = (size_t)cnt;
            ssize_t w = ::sendmsg(fd_, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w >= 0) return w;
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            die(std::string("send: ") + strerror(errno));
            return -1;
        }
    }

    void die(const std::string &why) {
        if (dead_) return;
        dead_ = true;
        error_ = why;
        drop_queue();
    }

    void drop_queue() {
        for (Chunk &c : outq_)
            if (c.ffn != nullptr) c.ffn((void *)c.zc_base, c.hint);
        outq_.clear();
    }

    size_t avail() const { return w_ - r_; }

    /* Read what the socket has into the buffer; 1: got bytes, 0: nothing now, -1: closed or broken. */
    int fill() {
        if (r_ == w_) r_ = w_ = 0;
        if (w_ == buf_.size()) { /* compact: the unparsed tail to the front */
            memmove(buf_.data(), buf_.data() + r_, w_ - r_);
            w_ -= r_;
            r_ = 0;
        }
        /* a large frame in progress with nothing buffered: straight into its message */
        if (nframes_ > 0 && cur_ < nframes_ && avail() == 0) {
            uint64_t rest = lens_[cur_] - off_;
            if (rest >= BPS_LINK_DIRECT_READ) {
                ssize_t got = read_some((char *)partial_.mutable_data(base_ + cur_) + off_, (size_t)rest);
                if (got > 0) off_ += (uint64_t)got;
                return got > 0 ? 1 : (int)got;
            }
        }
        ssize_t got = read_some((char *)buf_.data() + w_, buf_.size() - w_);
        if (got > 0) w_ += (size_t)got;
        return got > 0 ? 1 : (int)got;
    }

    /* >0 bytes, 0 would block, -1 closed or broken (the link is dead then) */
    virtual ssize_t read_some(char *dst, size_t n) { return socket_recv(dst, n); }

    /* The socket's bytes, as read_some() */
    ssize_t socket_recv(char *dst, size_t n) {
        for (;;) {
            ssize_t got = ::recv(fd_, dst, n, MSG_DONTWAIT);
            if (got > 0) return got;
            if (got == 0) {
                die("closed by the peer");
                return -1;
            }
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            die(std::string("recv: ") + strerror(errno));
            return -1;
        }
    }

    /* Advance the message being assembled with what is buffered: 1 complete, 0 needs bytes, -1 bad. */
    int parse(const std::string *prefix, BpsFrameSink *sink) {
        if (nframes_ < 0) {
            if (avail() < 8) return 0;
            uint32_t head[2];
            memcpy(head, buf_.data() + r_, 8);
            int limit = BPS_LINK_MAX_FRAMES - (prefix != nullptr ? 1 : 0);
            if (head[0] != BPS_LINK_MAGIC || head[1] == 0 || (int)head[1] > limit) {
                die("malformed link message (magic or frame count)");
                return -1;
            }
            if (avail() < 8 + 8 * (size_t)head[1]) return 0;
            memcpy(lens_, buf_.data() + r_ + 8, 8 * (size_t)head[1]);
            for (uint32_t i = 0; i < head[1]; ++i) {
                if (lens_[i] > BPS_LINK_MAX_FRAME) {
                    die("malformed link message (frame of " + std::to_string(lens_[i]) + " bytes)");
                    return -1;
                }
            }
            r_ += 8 + 8 * (size_t)head[1];
            partial_.clear();
            base_ = 0;
            if (prefix != nullptr) {
                bps_zmq.msg_init_size(&partial_.frames[0], prefix->size());
                memcpy(partial_.mutable_data(0), prefix->data(), prefix->size());
                partial_.count = base_ = 1;
            }
            nframes_ = (int)head[1];
            cur_ = 0;
            off_ = 0;
            opened_ = false;
        }
        while (cur_ < nframes_) {
            int slot = base_ + cur_;
            if (!opened_) {
                void *dst = nullptr;
                if (sink != nullptr && lens_[cur_] >= BPS_LINK_DIRECT_READ) {
                    partial_.count = slot; /* the frames before it, complete */
                    dst = sink->place(partial_, slot, lens_[cur_]);
                }
                if (dst != nullptr) bps_zmq.msg_init_data(&partial_.frames[slot], dst, (size_t)lens_[cur_], nullptr, nullptr);
                else bps_zmq.msg_init_size(&partial_.frames[slot], (size_t)lens_[cur_]);
                placed_ = dst != nullptr;
                partial_.count = slot + 1;
                opened_ = true;
            }
            uint64_t rest = lens_[cur_] - off_;
            size_t n = (size_t)std::min<uint64_t>(rest, avail());
            if (n > 0) {
                memcpy((char *)partial_.mutable_data(slot) + off_, buf_.data() + r_, n);
                r_ += n;
                off_ += n;
            }
            if (off_ < lens_[cur_]) return 0;
            cur_++;
            off_ = 0;
            opened_ = placed_ = false;
        }
        return 1;
    }

    int fd_;
    bool dead_ = false;
    bool corked_ = false;
    std::string error_;
    std::deque<Chunk> outq_;
    std::vector<unsigned char> buf_;
    size_t r_ = 0, w_ = 0;
    /* the message being assembled */
    BpsMessage partial_;
    int nframes_ = -1, cur_ = 0, base_ = 0;
    uint64_t off_ = 0;
    bool opened_ = false;
    bool placed_ = false; /* the frame being read goes into a sink's memory (recv_into) */
    uint64_t lens_[BPS_LINK_MAX_FRAMES];
};

/* Shared-memory local links: two worker processes of one machine write their link's bytes into rings
 * in shared memory instead of the TCP socket (docs/architecture.md, "Local reduce in the native
 * core"). The socket stays only to ring a bell that wakes a reader sleeping in poll, and for the
 * peer's EOF. Framing, queueing and zero-copy frames are BpsLink's: only write_iov / read_some change.
 *
 * Layout (one memfd per pair of local ranks, made by the higher rank; core/engine.py
 * _open_local_links): [ring low -> high][ring high -> low], each a BpsRingHead followed by
 * BPS_RING_BYTES of data. Each ring has one writing and one reading process, and within a process one
 * thread at a time (the link's lock): head and tail are a single-producer / single-consumer pair.
 *
 * No lost wake-up: the writer publishes its bytes, then reads ``reader_polls``; the reader clears
 * ``reader_polls`` (or ``rung``), then reads the ring again before it sleeps. Both are sequentially
 * consistent, so at least one of them sees the other. */
struct BpsRingHead {
    alignas(64) std::atomic<uint64_t> tail;         /* bytes ever written (the writer's) */
    alignas(64) std::atomic<uint64_t> head;         /* bytes ever read (the reader's) */
    alignas(64) std::atomic<uint32_t> reader_polls; /* the reader polls the ring: no bell needed */
    std::atomic<uint32_t> rung;                     /* a bell is in the socket, not yet drained */
    std::atomic<uint32_t> writer_waits;             /* the ring was full: the reader rings once it reads */
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory rings need lock-free atomics");
static const size_t BPS_RING_BYTES = 128 << 10;
static const size_t BPS_RING_REGION = 2 * (sizeof(BpsRingHead) + BPS_RING_BYTES);

class BpsShmLink : public BpsLink {
  public:
    /* ``fd``: the connected socket (bells, EOF); ``region``: BPS_RING_REGION bytes mapped shared (owned
     * from now on); ``low``: we are the lower local rank of the pair. */
    BpsShmLink(int fd, void *region, bool low) : BpsLink(fd), region_(region) {
        char *a = (char *)region, *b = a + sizeof(BpsRingHead) + BPS_RING_BYTES;
        out_ = (BpsRingHead *)(low ? a : b);
        in_ = (BpsRingHead *)(low ? b : a);
        out_data_ = (char *)out_ + sizeof(BpsRingHead);
        in_data_ = (char *)in_ + sizeof(BpsRingHead);
    }
    ~BpsShmLink() override {
        poll_ring(false);
        munmap(region_, BPS_RING_REGION);
    }

    const char *kind() const override { return "shm"; }
    bool poll_for_write() const override { return false; }
    bool pending_input() override { return !dead_ && (r_ < w_ || ring_input()); }

    /* While a direct caller polls this end, the peer writes no bells to it, and it defers its own
     * bells until it stops (a caller that polls for its answer usually finds it before then, and its
     * peer's direct caller reads the ring without one): no system call on either side. */
    void poll_ring(bool on) override {
        if (on == polling_) return;
        polling_ = on;
        in_->reader_polls.store(on ? 1 : 0, std::memory_order_seq_cst);
        if (!on && bell_deferred_) {
            bell_deferred_ = false;
            /* the peer has not read all we wrote meanwhile: the bell it would have had */
            if (out_->head.load(std::memory_order_seq_cst) != out_->tail.load(std::memory_order_relaxed)) ring();
        }
    }
    /* Stop polling before a sleep: true when bytes came meanwhile (read them first). */
    bool arm_to_sleep() override {
        poll_ring(false);
        return pending_input();
    }
    /* A bell may also mean "the ring has room again": go on with what is queued. */
    int recv(BpsMessage *m, const std::string *prefix = nullptr) override {
        if (wants_write() && !dead_) flush();
        return BpsLink::recv(m, prefix);
    }
    int recv_into(BpsMessage *m, BpsFrameSink *sink) override {
        if (wants_write() && !dead_) flush();
        return BpsLink::recv_into(m, sink);
    }

  protected:
    bool ring_input() const {
        return in_->tail.load(std::memory_order_acquire) != in_->head.load(std::memory_order_relaxed);
    }

    /* As much of the iovecs as the ring takes. What does not fit stays queued (BpsLink::send), and the
     * reader is asked to ring once it has read (writer_waits): nothing else would flush the queue. */
    ssize_t write_iov(struct iovec *iov, int cnt) override {
        if (dead_) return -1;
        uint64_t tail = out_->tail.load(std::memory_order_relaxed); /* ours alone */
        uint64_t total = 0, put = 0;
        for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
        int i = 0;
        size_t off = 0; /* into iov[i] */
        for (;;) {
            uint64_t room = BPS_RING_BYTES - (tail + put - out_->head.load(std::memory_order_acquire));
            for (; i < cnt && room > 0; ++i, off = 0) {
                size_t n = (size_t)std::min<uint64_t>(iov[i].iov_len - off, room);
                ring_copy_in((const char *)iov[i].iov_base + off, tail + put, n);
                put += n;
                room -= n;
                if (off + n < iov[i].iov_len) {
                    off += n;
                    break;
                }
            }
            if (put == total) break;
            /* full: ask the reader to ring once it has read, then look again (it may have read meanwhile) */
            out_->writer_waits.store(1, std::memory_order_seq_cst);
            if (out_->head.load(std::memory_order_seq_cst) == tail + put - BPS_RING_BYTES) break;
        }
        if (put == 0) return 0;
        out_->tail.store(tail + put, std::memory_order_seq_cst);
        if (polling_) bell_deferred_ = true;
        else if (ring() < 0) return -1;
        return (ssize_t)put;
    }

    /* After a write: a bell unless the reader polls or one is pending already. 0, or -1 once dead. */
    int ring() {
        if (out_->reader_polls.load(std::memory_order_seq_cst) != 0 ||
            out_->rung.exchange(1, std::memory_order_seq_cst) != 0)
            return 0;
        return bell();
    }

    ssize_t read_some(char *dst, size_t n) override {
        for (int pass = 0; pass < 2; ++pass) {
            uint64_t head = in_->head.load(std::memory_order_relaxed); /* ours alone */
            uint64_t have = in_->tail.load(std::memory_order_acquire) - head;
            if (have > 0) {
                size_t take = (size_t)std::min<uint64_t>(have, n);
                ring_copy_out(dst, head, take);
                in_->head.store(head + take, std::memory_order_seq_cst);
                if (in_->writer_waits.load(std::memory_order_seq_cst) != 0 &&
                    in_->writer_waits.exchange(0, std::memory_order_seq_cst) != 0 && bell() < 0)
                    return -1;
                return (ssize_t)take;
            }
            /* Empty. While polling, nobody rings and the caller sleeps on the socket (which then says
             * if the peer went) within BYTEPS_SPIN_US: no system call here. */
            if (pass == 1 || polling_) return 0;
            if (drain_bells() < 0) return -1;
            in_->rung.store(0, std::memory_order_seq_cst); /* then look again: a write may have skipped its bell */
        }
        return 0;
    }

  private:
    void ring_copy_in(const char *src, uint64_t at, size_t n) {
        size_t off = (size_t)(at % BPS_RING_BYTES), first = std::min(n, BPS_RING_BYTES - off);
        memcpy(out_data_ + off, src, first);
        if (n > first) memcpy(out_data_, src + first, n - first);
    }
    void ring_copy_out(char *dst, uint64_t at, size_t n) {
        size_t off = (size_t)(at % BPS_RING_BYTES), first = std::min(n, BPS_RING_BYTES - off);
        memcpy(dst, in_data_ + off, first);
        if (n > first) memcpy(dst + first, in_data_, n - first);
    }
    /* One byte on the socket: wakes the peer if it sleeps in poll. 0, or -1 once dead. */
    int bell() {
        char b = 1;
        for (;;) {
            ssize_t w = ::send(fd_, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w == 1 || (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) return 0; /* full: bells wait there */
            if (w < 0 && errno == EINTR) continue;
            die(std::string("send: ") + strerror(errno));
            return -1;
        }
    }
    /* Read the bells out of the socket; -1 once the peer closed it (dead). */
    int drain_bells() {
        char sink[256];
        ssize_t got;
        while ((got = socket_recv(sink, sizeof sink)) > 0) {
        }
        return got < 0 ? -1 : 0;
    }

    void *region_;
    BpsRingHead *out_, *in_;
    char *out_data_, *in_data_;
    bool polling_ = false;
    bool bell_deferred_ = false; /* wrote while polling: ring() when polling stops */
};

#endif
