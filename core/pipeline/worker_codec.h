/* The worker core's wire codec (docs/compression.md): a compressed push_pull's partition is encoded
 * here just before its PUSH to a server on another machine (send_push, worker_send_queue.h), and a
 * compressed REPLY is decoded straight into the partition's destination (receive, worker_loop.h; an
 * owner's shared region, owner_pulled, worker_local_reduce.h), with the kernels of
 * core/kernels/bps_codecs.h. The bytes, the seeds and the state's rules are those of
 * byteps.compression.WireCompressor.encode, which stays the Python API of the same kernels. */
#ifndef BPS_WORKER_CODEC_H
#define BPS_WORKER_CODEC_H

#include <stdint.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "core/kernels/bps_codecs.h"
#include "core/transport/bps_wire.h"

/* One partition's state across its rounds: momentum, the error-feedback residual, the corrected input
 * (work) and the blob, sized at its first encoding and reused by later rounds (doubles: aligned for
 * float32 and float64 values alike). */
struct BpsCodecState {
    std::vector<double> momentum, residual, work;
    std::vector<uint8_t> blob;
    uint64_t n = 0;
    int dtype = -1;
    bool has_residual = false; /* the first round has no residual to add yet */
};

/* A table's wire codec: WireCompressor's options (method 0: none), and each of its partitions' state by
 * wire key (byteps-net only), as WireCompressor keeps it. A joined process's table of a partition it
 * reduces for its peers shares the codec of that tensor's table (add_table's ``codec_of``), so the
 * partition's pushes continue one state whichever table sends them. Which partitions it encodes is
 * BpsPart::compress, decided by Python (WireCompressor.applies: a pure function of the sizes). */
struct BpsTableCodec {
    int method = 0, flags = 0, levels = 0;
    double k = 0;        /* topk, randomk: a fraction (< 1) or a count per partition (bps_cz_k_for) */
    uint64_t seed = 0;
    double mu = 0;       /* momentum correction (0: off) */
    bool nesterov = false;
    uint32_t stream = 0; /* this worker's rank: the workers' dithering draws are independent */
    std::unordered_map<uint64_t, BpsCodecState> state;
};

/* The blob of the partition of wire key ``key`` (round ``rnd``: ``nbytes`` of float32/float64 at
 * ``data``): its state restarts at round 0 or when its size changes, randomk's index seed is derived
 * from (seed, key, round) and dithering's draws from (seed, key, round, rank), as in
 * WireCompressor.encode. The blob lives in the partition's state until its next encoding. */
static inline const std::vector<uint8_t> &bps_codec_encode(BpsTableCodec &c, uint64_t key, uint64_t rnd,
                                                           int dtype, const unsigned char *data, uint64_t nbytes) {
    BpsCodecState &st = c.state[key];
    uint64_t n = nbytes / (dtype ? 8 : 4);
    bool ef = (c.flags & BPS_CZ_F_EF) != 0;
    if (rnd == 0 || st.n != n || st.dtype != dtype) {
        size_t words = (size_t)((nbytes + 7) / 8);
        st.n = n;
        st.dtype = dtype;
        st.has_residual = false;
        if (c.mu != 0) st.momentum.assign(words, 0.0);
        if (ef) st.residual.resize(words);
        if (c.mu != 0 || ef) st.work.resize(words);
    }
    BpsCodecParams p;
    p.method = c.method;
    p.dtype = dtype;
    p.flags = c.flags;
    p.levels = c.levels;
    p.k = c.method == BPS_CZ_TOPK || c.method == BPS_CZ_RANDOMK ? bps_cz_k_for(c.k, n) : 0;
    p.seed = c.method == BPS_CZ_RANDOMK ? bps_cz_derive_seed(c.seed, key, rnd, 0, 0) : c.seed;
    p.dither_seed = c.method == BPS_CZ_DITHERING ? bps_cz_derive_seed(c.seed, key, rnd, 1, c.stream) : 0;
    st.blob.resize(bps_cz_encoded_size(p, n));
    bps_cz_compress(&p, data, n, c.mu != 0 ? st.momentum.data() : nullptr, c.mu, c.nesterov,
                    ef ? st.residual.data() : nullptr, st.has_residual, st.work.data(), st.blob.data());
    st.has_residual = ef;
    return st.blob;
}

/* A compressed REPLY's body decoded into ``dst``, the partition's ``expect`` bytes of ``dtype``: "" or
 * what is wrong with it (the checks and texts of a blob's parse, then its dense length and dtype). */
static inline std::string bps_codec_decode_reply(const BpsHeader &h, const void *body, size_t size, int dtype,
                                                 uint64_t expect, void *dst) {
    BpsCodecInfo info;
    char err[BPS_CZ_ERRLEN];
    if (bps_cz_parse((const uint8_t *)body, size, &info, err) != 0) return err;
    uint64_t nbytes = info.n * (info.dtype ? 8 : 4);
    if (h.length != expect || nbytes != expect || info.dtype != dtype)
        return "it decodes to " + std::to_string(nbytes) + " bytes of dtype code " + std::to_string(info.dtype) +
               ", the partition is " + std::to_string(expect) + " bytes of " + bps_dtype_name(dtype);
    if (bps_cz_decode(&info, dst, 0, err) != 0) return err;
    return "";
}

#endif
