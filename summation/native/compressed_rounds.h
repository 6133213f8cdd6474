/* The compressed round policy: what a round does with pushes that crossed the network compressed
 * (FLAG_COMPRESSED; the codecs and their format: core/kernels/bps_codecs.h, docs/compression.md).
 *
 *     parse()    a compressed body: its header checked, and its dense size against the frame's
 *     check()    every network push of a round is compressed alike (or none is): the codec header
 *                fields of the round's first network push against this one's
 *     decode     (BpsSyncRounds::decode) the body into the round's store: written by the round's
 *                first push, added by later ones (a held plain first push is copied in first)
 *     reply()    once every pusher is in: the sum re-encoded once, for every waiter that pushed
 *                compressed (error feedback of the server's own kept per key across rounds)
 *
 * Plain pushes from colocated workers (shared memory) add into the same store, so the store stays
 * in the tensor's dtype. */
#ifndef BPS_SERVER_COMPRESSED_ROUNDS_H
#define BPS_SERVER_COMPRESSED_ROUNDS_H

#include <stdio.h>

#include <string>
#include <vector>

#include "core/kernels/bps_codecs.h"
#include "summation/native/round.h"

/* A push's codec as the server's errors name it: "onebit(scaling, error feedback)", or "no compression" (NULL) */
static inline std::string bps_cz_describe(const BpsCodecInfo *info) {
    if (info == nullptr) return "no compression";
    std::vector<std::string> opts;
    int m = info->method;
    if (m == BPS_CZ_TOPK || m == BPS_CZ_RANDOMK || m == BPS_CZ_SPARSE) {
        opts.push_back("k=" + std::to_string(info->k) + " of " + std::to_string(info->n));
    }
    if (m == BPS_CZ_RANDOMK) {
        char hex[32];
        snprintf(hex, sizeof hex, "%#llx", (unsigned long long)info->seed);
        opts.push_back(std::string("index seed ") + (info->seed ? hex : "0x0"));
    }
    if (m == BPS_CZ_ONEBIT) opts.push_back(info->flags & BPS_CZ_F_SCALING ? "scaling" : "no scaling");
    if (m == BPS_CZ_DITHERING) {
        opts.push_back("levels=" + std::to_string(info->levels));
        opts.push_back(info->flags & BPS_CZ_F_NATURAL ? "natural" : "linear");
        opts.push_back(info->flags & BPS_CZ_F_L2 ? "l2" : "max");
        opts.push_back("seed=" + std::to_string(info->seed));
    }
    if (info->flags & BPS_CZ_F_EF) opts.push_back("error feedback");
    std::string s = bps_cz_name(m);
    s += "(";
    for (size_t i = 0; i < opts.size(); ++i) s += (i ? ", " : "") + opts[i];
    return s + ")";
}

struct BpsCompressedRounds {
    /* A compressed push's body into ``info``; "" or why it cannot join the round. */
    static std::string parse(const BpsHeader &h, int64_t rank, const unsigned char *body, size_t len,
                             BpsCodecInfo *info) {
        std::string name = bps_key_name(h.key), who = bps_rank_str(rank);
        if (h.cmd != BPS_CMD_PUSHPULL || (h.flags & BPS_FLAG_SHM)) {
            return name + ": rank " + who + " sent a compressed " +
                   (h.cmd == BPS_CMD_BROADCAST ? "BROADCAST" : "PUSHPULL") + "; only push_pull is compressed";
        }
        char err[BPS_CZ_ERRLEN];
        if (bps_cz_parse(body, len, info, err) != 0) return name + ": rank " + who + "'s compressed push: " + err;
        uint64_t nbytes = info->n * (info->dtype ? 8 : 4);
        if (nbytes != h.length || info->dtype != h.dtype) {
            return name + ": rank " + who + "'s compressed push decodes to " + std::to_string(nbytes) +
                   " bytes of dtype code " + std::to_string(info->dtype) + " but its header says " +
                   std::to_string(h.length) + " bytes of " + bps_dtype_name(h.dtype);
        }
        return "";
    }

    /* Every network push of a round compressed alike: ``info`` NULL for a plain one. */
    static std::string check(BpsRound &st, const BpsHeader &h, int64_t rank, const BpsCodecInfo *info) {
        if (!st.has_codec) {
            st.has_codec = true;
            st.codec_rank = rank;
            st.codec_compressed = info != nullptr;
            if (info != nullptr) st.codec_info = *info;
            return "";
        }
        const BpsCodecInfo *first = st.codec_compressed ? &st.codec_info : nullptr;
        bool same = (first == nullptr) == (info == nullptr);
        if (same && info != nullptr) {
            same = first->method == info->method && first->dtype == info->dtype && first->flags == info->flags &&
                   first->levels == info->levels && first->k == info->k && first->seed == info->seed;
        }
        if (same) return "";
        return bps_key_name(h.key) + ": compression differs across workers: rank " + bps_rank_str(st.codec_rank) +
               " pushed " + bps_cz_describe(first) + ", rank " + bps_rank_str(rank) + " pushed " +
               bps_cz_describe(info) + "; every worker must compress this tensor alike (same method, options, "
               "seed and BYTEPS_MIN_COMPRESS_BYTES)";
    }

    /* The reply to the waiters that pushed compressed: the round's sum (``store``, nbytes) re-encoded
     * into ``blob``; false: send the raw sum (top-k's sparse sum would not be smaller). ``stream``
     * (this server's node id) keeps its dithering draws apart from the workers'. */
    static bool reply(BpsRound &st, const unsigned char *store, uint64_t nbytes, uint32_t stream,
                      std::string *blob) {
        uint64_t n = nbytes / (st.codec_info.dtype ? 8 : 4);
        BpsCodecParams p = bps_cz_reply(&st.codec_info, store, n, st.key, st.round, stream);
        if (p.method == 0) return false;
        bool ef = (p.flags & BPS_CZ_F_EF) != 0;
        if (ef && st.residual.size() != nbytes) {
            st.residual.assign(nbytes, 0);
            st.has_residual = false;
        }
        std::vector<unsigned char> work(ef && st.has_residual ? nbytes : 0);
        blob->resize(bps_cz_encoded_size(p, n));
        bps_cz_compress(&p, store, n, nullptr, 0.0, 0, ef ? st.residual.data() : nullptr, st.has_residual,
                        work.data(), (uint8_t *)&(*blob)[0]);
        st.has_residual = ef;
        return true;
    }
};

#endif
