/* The stores rounds are summed into: memfd arenas named "byteps-server" that colocated workers read
 * through descriptors (BYTEPS_ENABLE_IPC=1), or private mappings with transparent huge pages. */
#ifndef BPS_SERVER_STORE_H
#define BPS_SERVER_STORE_H

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "summation/native/server_texts.h"


/* One mapping stores are cut from: a shared memfd arena (bump-allocated, reused after a reset), or
 * a private anonymous mapping holding one store. ``replies`` counts zero-copy replies ZeroMQ still
 * reads from it: it is reused or unmapped only at zero. */
struct BpsArena {
    unsigned char *base = nullptr;
    uint64_t size = 0, used = 0;
    int fd = -1;
    uint64_t inode = 0;
    std::atomic<int64_t> replies{0};
};

struct BpsStore {
    unsigned char *data = nullptr;
    BpsArena *arena = nullptr;
    uint64_t offset = 0;
};

class BpsStoreAllocator {
  public:
    explicit BpsStoreAllocator(bool shared) : shared_(shared) {}

    ~BpsStoreAllocator() {
        for (BpsArena *a : arenas_) release(a);
        for (BpsArena *a : retired_) release(a);
    }

    bool shared() const { return shared_; }

    /* Told of every arena made and of every arena about to be unmapped, on the thread that allocates
     * (byteps-serve): UCX registers the stores replies are sent from (BpsUcxWorker::register_region).
     * Arenas made before the hooks are told at once; empty functions stop the telling. */
    void set_hooks(std::function<void(void *, size_t)> made, std::function<void(void *)> gone) {
        made_ = std::move(made);
        gone_ = std::move(gone);
        if (made_)
            for (BpsArena *a : arenas_) made_(a->base, a->size);
    }

    /* A fresh page-aligned, pre-faulted store of ``nbytes``; false and *err if memory ran out. */
    bool alloc(uint64_t nbytes, BpsStore *out, std::string *err) {
        uint64_t want = std::max<uint64_t>(page(), (nbytes + page() - 1) / page() * page());
        BpsArena *arena = nullptr;
        if (shared_) {
            for (BpsArena *a : arenas_) {
                if (a->used + want <= a->size) {
                    arena = a;
                    break;
                }
            }
        }
        if (arena == nullptr) {
            arena = create(shared_ ? std::max(want, BPS_ARENA_BYTES) : want, err);
            if (arena == nullptr) return false;
            arenas_.push_back(arena);
        }
        out->arena = arena;
        out->offset = arena->used;
        out->data = arena->base + arena->used;
        arena->used += want;
        /* Shared: fault the pages in now, once per key, not in the first round's sum (core/shm.py's
         * prefault). Private: huge pages fault cheaply, and a store a key never uses (the second one of a
         * tensor pushed once, a 2 GB partition's) must not take memory (aligned_empty's behaviour). */
        if (shared_) madvise(out->data, want, 23 /* MADV_POPULATE_WRITE, Linux 5.14; best effort */);
        return true;
    }

    /* Every store is dropped (LEAVE, join done): arenas no reply reads are reused or unmapped now,
     * the others once ZeroMQ has released their last reply (collect()). */
    void reset() {
        std::vector<BpsArena *> keep;
        for (BpsArena *a : arenas_) {
            if (shared_ && a->replies.load() == 0) {
                a->used = 0;
                keep.push_back(a);
            } else {
                retired_.push_back(a);
            }
        }
        arenas_.swap(keep);
        collect();
    }

    void collect() {
        for (auto it = retired_.begin(); it != retired_.end();) {
            if ((*it)->replies.load() == 0) {
                release(*it);
                it = retired_.erase(it);
            } else {
                ++it;
            }
        }
    }

    static uint64_t page() {
        static const uint64_t p = (uint64_t)sysconf(_SC_PAGESIZE);
        return p;
    }

  private:
    BpsArena *create(uint64_t size, std::string *err) {
        BpsArena *a = new BpsArena();
        a->size = size;
        void *base = MAP_FAILED;
        if (shared_) {
            a->fd = memfd_create("byteps-server", MFD_CLOEXEC); /* peers map only /memfd:byteps* */
            struct stat st;
            if (a->fd >= 0 && ftruncate(a->fd, size) == 0 && fstat(a->fd, &st) == 0) {
                a->inode = st.st_ino;
                base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
            }
        } else {
            base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            /* transparent huge pages where the kernel allows them: one fault per 2 MB (aligned_empty) */
            if (base != MAP_FAILED && size >= BPS_HUGEPAGE_BYTES) madvise(base, size, MADV_HUGEPAGE);
        }
        if (base == MAP_FAILED) {
            *err = std::string("cannot allocate ") + std::to_string(size) + " bytes for the stores: " + strerror(errno);
            if (a->fd >= 0) ::close(a->fd);
            delete a;
            return nullptr;
        }
        a->base = (unsigned char *)base;
        if (made_) made_(a->base, a->size);
        return a;
    }

    void release(BpsArena *a) {
        if (a->replies.load() != 0) return; /* ZeroMQ still reads it (shutdown): the kernel frees it at exit */
        if (gone_) gone_(a->base);
        munmap(a->base, a->size);
        if (a->fd >= 0) ::close(a->fd);
        delete a;
    }

    bool shared_;
    std::vector<BpsArena *> arenas_;
    std::vector<BpsArena *> retired_;
    std::function<void(void *, size_t)> made_;
    std::function<void(void *)> gone_;
};
#endif
