/* The wire header (core/wire.py) and shared-memory descriptors (core/shm.py) for the native threads.
 *
 * The 40-byte little-endian header: magic "BP", version, command, dtype, flags, reserved u16,
 * sender u32, arg u32, key u64, round u64, length u64. core/wire.py is the reference; the values
 * below must stay equal to it (tests/test_native_core.py compares them).
 *
 * BpsPeerMaps maps other processes' memfd arenas named by 32-byte descriptors (pid, fd, inode,
 * offset, length), with the same checks and error texts as core/shm.py's PeerMaps.
 */
#ifndef BPS_WIRE_H
#define BPS_WIRE_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <string>
#include <tuple>

enum {
    BPS_HEADER_SIZE = 40,
    BPS_WIRE_VERSION = 1,
    BPS_DESCRIPTOR_SIZE = 32,
    BPS_FLAG_SHM = 1,
    BPS_FLAG_COMPRESSED = 2,
    BPS_FLAG_ABANDON = 4, /* core/wire.py: the sender refused this round's call; the body is its reason */
    BPS_FLAG_JOIN_EPOCH = 8, /* core/wire.py: a LOCAL_READY sent after an odd number of completed join()s */
    BPS_CMD_HELLO = 11,
    BPS_CMD_AUTH = 13,
    BPS_CMD_PUSHPULL = 20,
    BPS_CMD_BROADCAST = 21,
    BPS_CMD_REPLY = 22,
    BPS_CMD_ERROR = 23,
    BPS_CMD_LOCAL_READY = 24,
    BPS_CMD_LOCAL_DONE = 25,
    BPS_CMD_ASYNC_PUSHPULL = 26,
    BPS_CMD_LINK = 28, /* a link's token, and its answer (core/wire.py Cmd.LINK) */
    BPS_CMD_RESULT = 31, /* elastic: a worker's copy of a round's result a lost server sent it */
    BPS_CMD_NCCL_ID = 32,    /* local rank 0 -> the others: the machine's NCCL unique id (nccl_stages.h) */
    BPS_CMD_NCCL_READY = 33, /* -> local rank 0: a collective (stage in ``length``) is ready here */
    BPS_CMD_NCCL_ORDER = 34, /* local rank 0 -> the others: the next collective of the machine's order */
    BPS_CMD_NCCL_ABORT = 35, /* -> the others: the NCCL stages stopped here; the body says why */
    BPS_NO_DTYPE = 255,
};

#pragma pack(push, 1)
struct BpsHeader {
    char magic[2];
    uint8_t version;
    uint8_t cmd;
    uint8_t dtype;
    uint8_t flags;
    uint16_t reserved;
    uint32_t sender;
    uint32_t arg;
    uint64_t key;
    uint64_t round;
    uint64_t length;
};
struct BpsDescriptor {
    int32_t pid;
    int32_t fd;
    uint64_t inode;
    uint64_t offset;
    uint64_t length;
};
#pragma pack(pop)

static_assert(sizeof(BpsHeader) == BPS_HEADER_SIZE, "wire header is 40 bytes");
static_assert(sizeof(BpsDescriptor) == BPS_DESCRIPTOR_SIZE, "descriptor is 32 bytes");

static inline BpsHeader bps_header(uint8_t cmd, uint32_t sender, uint64_t key, uint64_t round, uint64_t length,
                                   uint8_t dtype, uint32_t arg, uint8_t flags) {
    return BpsHeader{{'B', 'P'}, BPS_WIRE_VERSION, cmd, dtype, flags, 0, sender, arg, key, round, length};
}

/* True if ``p`` (``n`` bytes) is a header of this wire version; the command is not checked here. */
static inline bool bps_parse_header(const void *p, size_t n, BpsHeader *out) {
    if (n != BPS_HEADER_SIZE) return false;
    memcpy(out, p, BPS_HEADER_SIZE);
    return out->magic[0] == 'B' && out->magic[1] == 'P' && out->version == BPS_WIRE_VERSION;
}

/* ``text`` as the inside of a JSON string, as core/wire.py's json.dumps writes it (ensure_ascii; invalid
 * UTF-8 as surrogateescape) */
static inline std::string bps_json_escape(const std::string &text) {
    std::string out;
    char buf[16];
    auto esc = [&](unsigned cp) {
        snprintf(buf, sizeof buf, "\\u%04x", cp);
        out += buf;
    };
    const unsigned char *p = (const unsigned char *)text.data();
    size_t n = text.size();
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        if (c == '"') { out += "\\\""; ++i; continue; }
        if (c == '\\') { out += "\\\\"; ++i; continue; }
        if (c == '\n') { out += "\\n"; ++i; continue; }
        if (c == '\r') { out += "\\r"; ++i; continue; }
        if (c == '\t') { out += "\\t"; ++i; continue; }
        if (c == '\b') { out += "\\b"; ++i; continue; }
        if (c == '\f') { out += "\\f"; ++i; continue; }
        if (c >= 0x20 && c < 0x7f) { out += (char)c; ++i; continue; }
        if (c < 0x80) { esc(c); ++i; continue; }
        int extra = c >= 0xf0 && c < 0xf5 ? 3 : c >= 0xe0 ? 2 : c >= 0xc2 && c < 0xe0 ? 1 : -1;
        unsigned cp = extra == 3 ? c & 7 : extra == 2 ? c & 15 : c & 31;
        bool ok = extra > 0 && i + (size_t)extra < n;
        for (int k = 1; ok && k <= extra; ++k) {
            if ((p[i + k] & 0xc0) != 0x80) ok = false;
            else cp = (cp << 6) | (p[i + k] & 0x3f);
        }
        if (ok && ((extra == 2 && (cp < 0x800 || (cp >= 0xd800 && cp < 0xe000))) ||
                   (extra == 3 && (cp < 0x10000 || cp > 0x10ffff))))
            ok = false;
        if (!ok) { esc(0xdc00 + c); ++i; continue; } /* os.fsdecode's surrogateescape */
        if (cp >= 0x10000) {
            cp -= 0x10000;
            esc(0xd800 + (cp >> 10));
            esc(0xdc00 + (cp & 0x3ff));
        } else {
            esc(cp);
        }
        i += extra + 1;
    }
    return out;
}

/* An ERROR's body: json.dumps({"error": text}, separators=(",", ":")) */
static inline std::string bps_error_json(const std::string &text) {
    return "{\"error\":\"" + bps_json_escape(text) + "\"}";
}

/* Wake the native thread that polls eventfd ``fd``, and (that thread) take the wake-up. */
static inline void bps_signal(int fd) {
    uint64_t one = 1;
    ssize_t rc = write(fd, &one, sizeof one);
    (void)rc;
}

static inline void bps_drain(int fd) {
    uint64_t n;
    ssize_t rc = read(fd, &n, sizeof n);
    (void)rc;
}

static inline BpsDescriptor bps_descriptor(int32_t pid, int32_t fd, uint64_t inode, uint64_t offset,
                                           uint64_t length) {
    return BpsDescriptor{pid, fd, inode, offset, length};
}

/* Mappings of other processes' arenas, opened once through /proc/<pid>/fd/<fd> (core/shm.py). */
class BpsPeerMaps {
  public:
    ~BpsPeerMaps() { close(); }

    /* The region a descriptor names: 0 and (*ptr, *len), or -1 and *err. */
    int view(const void *body, size_t n, unsigned char **ptr, uint64_t *len, std::string *err) {
        if (n != BPS_DESCRIPTOR_SIZE) {
            *err = "shared-memory descriptor of " + std::to_string(n) + " bytes, expected 32";
            return -1;
        }
        BpsDescriptor d;
        memcpy(&d, body, sizeof d);
        auto key = std::make_tuple(d.pid, d.fd, d.inode);
        auto it = maps_.find(key);
        if (it == maps_.end()) {
            Mapping m;
            if (open_arena(d, &m, err) != 0) return -1;
            it = maps_.emplace(key, m).first;
        }
        if (d.offset + d.length > it->second.size || d.offset + d.length < d.offset) {
            *err = "shared-memory region " + std::to_string(d.offset) + "+" + std::to_string(d.length) +
                   " is outside arena " + std::to_string(d.pid) + "/" + std::to_string(d.fd) + " of " +
                   std::to_string(it->second.size) + " bytes";
            return -1;
        }
        *ptr = it->second.base + d.offset;
        *len = d.length;
        return 0;
    }

    void close() {
        for (auto &kv : maps_) munmap(kv.second.base, kv.second.size);
        maps_.clear();
    }

  private:
    struct Mapping {
        unsigned char *base;
        uint64_t size;
    };

    /* str() of the OSError Python raises (core/shm.py's texts): "[Errno 2] No such file or directory: '/proc/..'" */
    static std::string os_error(int err, const char *path) {
        return "[Errno " + std::to_string(err) + "] " + strerror(err) + ": '" + path + "'";
    }

    static int open_arena(const BpsDescriptor &d, Mapping *m, std::string *err) {
        char path[64], target[256];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", d.pid, d.fd);
        std::string who = "pid " + std::to_string(d.pid) + " (fd " + std::to_string(d.fd) + ")";
        ssize_t got = readlink(path, target, sizeof target - 1);
        if (got < 0) {
            *err = "cannot open shared memory of " + who + ": " + os_error(errno, path);
            return -1;
        }
        target[got] = 0;
        /* only byteps's own memfd arenas: a descriptor must not map any file the peer has open */
        if (strncmp(target, "/memfd:byteps", 13) != 0) {
            *err = "fd " + std::to_string(d.fd) + " of pid " + std::to_string(d.pid) + " is '" + target +
                   "', not a byteps shared-memory arena";
            return -1;
        }
        int f = ::open(path, O_RDWR | O_CLOEXEC);
        if (f < 0) {
            *err = "cannot open shared memory of " + who + ": " + os_error(errno, path);
            return -1;
        }
        struct stat st;
        int rc = fstat(f, &st);
        if (rc != 0 || (uint64_t)st.st_ino != d.inode) {
            *err = "shared memory of " + who + " is no longer the arena named (inode " +
                   std::to_string(rc == 0 ? (uint64_t)st.st_ino : 0) + ", expected " + std::to_string(d.inode) + ")";
            ::close(f);
            return -1;
        }
        void *base = st.st_size > 0 ? mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0) : MAP_FAILED;
        int saved = errno;
        ::close(f);
        if (base == MAP_FAILED) {
            *err = "shared memory of " + who + " cannot be mapped: " +
                   (st.st_size > 0 ? "[Errno " + std::to_string(saved) + "] " + strerror(saved)
                                   : std::string("cannot mmap an empty file"));
            return -1;
        }
        m->base = (unsigned char *)base;
        m->size = (uint64_t)st.st_size;
        return 0;
    }

    std::map<std::tuple<int32_t, int32_t, uint64_t>, Mapping> maps_;
};

#endif
