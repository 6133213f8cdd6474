/* Wire compression codecs: fp16, bf16, onebit, top-k, random-k, dithering (docs/compression.md).
 *
 * The one implementation of the wire format that byteps/compression.py documents: a 32-byte
 * little-endian header, then the payload. Workers encode a partition just before its push (with
 * momentum and error feedback), servers decode every push into the round's store and re-encode the
 * sum for the reply. byteps.core._reduce wraps these functions for Python (byteps.compression).
 *
 * Everything is static inline and touches no Python object: callable without the GIL from any
 * thread. Arithmetic is IEEE in the values' dtype, one rounding per operation (build with
 * -ffp-contract=off: a fused multiply-add would change the bits that every process must agree on).
 *
 * The random streams are numpy's, so that they are documented by a public algorithm and a test can
 * check them against numpy itself: SeedSequence (O'Neill's seed_seq_fe hash, pool of four 32-bit
 * words) seeds PCG64 (128-bit LCG, XSL-RR output), as np.random.PCG64(seed).random_raw() does.
 */
#ifndef BPS_CODECS_H_
#define BPS_CODECS_H_

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/kernels/bps_reduce.h" /* the scalar fp16/bf16 conversions the sum kernels use */

/* method ids, flags and the header (byteps/compression.py's METHODS, F_*, HEADER) */
enum {
  BPS_CZ_FP16 = 1, BPS_CZ_BF16 = 2, BPS_CZ_ONEBIT = 3, BPS_CZ_TOPK = 4, BPS_CZ_RANDOMK = 5,
  BPS_CZ_DITHERING = 6, BPS_CZ_SPARSE = 7 /* a server's top-k reply */
};
enum { BPS_CZ_F_EF = 1, BPS_CZ_F_SCALING = 2, BPS_CZ_F_NATURAL = 4, BPS_CZ_F_L2 = 8 };
#define BPS_CZ_HEADER 32
#define BPS_CZ_VERSION 1
#define BPS_CZ_MAX_COUNT (1ull << 32) /* indices travel as uint32 */
#define BPS_CZ_MAX_LEVELS 0x7FFF
#define BPS_CZ_ERRLEN 256

/* One blob's header fields (and, once parsed, its payload). dtype: 0 float32, 1 float64. */
struct BpsCodecInfo {
  int method, dtype, flags, levels;
  uint64_t n, k, seed;
  const uint8_t *payload;
};

static inline const char *bps_cz_name(int method) {
  static const char *names[] = {"?", "fp16", "bf16", "onebit", "topk", "randomk", "dithering", "sparse"};
  return method >= 1 && method <= BPS_CZ_SPARSE ? names[method] : "?";
}

/* Bits per dithering level: -s..s stored as 0..2s in the smallest of 2, 4, 8, 16 that holds 2s. */
static inline int bps_cz_level_bits(int levels) {
  int need = 0;
  for (unsigned v = 2u * (unsigned)levels; v; v >>= 1) need++;
  return need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : 16;
}

/* Exact payload bytes (header excluded); 0 for an unknown method. 128-bit: n comes off the wire. */
static inline unsigned __int128 bps_cz_payload_size(int method, uint64_t n, int itemsize, uint64_t k, int levels) {
  typedef unsigned __int128 u128;
  switch (method) {
    case BPS_CZ_FP16: case BPS_CZ_BF16: return 2 * (u128)n;
    case BPS_CZ_ONEBIT: return 8 + ((u128)n + 7) / 8;
    case BPS_CZ_TOPK: case BPS_CZ_SPARSE: return (u128)k * (4 + itemsize);
    case BPS_CZ_RANDOMK: return (u128)k * itemsize;
    case BPS_CZ_DITHERING: return 8 + ((u128)n * bps_cz_level_bits(levels) + 7) / 8;
    default: return 0;
  }
}

/* BytePS's compressor_k: below 1 a fraction of n (rounded up), from 1 a count; within 1..n. */
static inline uint64_t bps_cz_k_for(double k, uint64_t n) {
  double want = k < 1 ? std::ceil(k * (double)n) : std::floor(k);
  uint64_t c = want >= (double)n ? n : (uint64_t)want;
  return c < 1 ? 1 : c;
}

/* ------------------------------------------------------------------------------------------ */
/* Random streams                                                                               */

/* numpy's SeedSequence(entropy words).generate_state(n_out, uint32) */
static inline void bps_seed_sequence(const uint32_t *entropy, size_t n_entropy, uint32_t *out, size_t n_out) {
  const uint32_t MULT_A = 0x931e8875u, MULT_B = 0x58f38dedu, MIX_L = 0xca01f9ddu, MIX_R = 0x4973f715u;
  uint32_t hash_a = 0x43b0d7e5u;
  auto hashmix = [&hash_a, MULT_A](uint32_t v) {
    v ^= hash_a;
    hash_a *= MULT_A;
    v *= hash_a;
    return v ^ (v >> 16);
  };
  auto mix = [=](uint32_t x, uint32_t y) {
    uint32_t r = MIX_L * x - MIX_R * y;
    return r ^ (r >> 16);
  };
  uint32_t pool[4];
  for (size_t i = 0; i < 4; i++) pool[i] = hashmix(i < n_entropy ? entropy[i] : 0);
  for (size_t src = 0; src < 4; src++)
    for (size_t dst = 0; dst < 4; dst++)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  for (size_t src = 4; src < n_entropy; src++)
    for (size_t dst = 0; dst < 4; dst++) pool[dst] = mix(pool[dst], hashmix(entropy[src]));
  uint32_t hash_b = 0x8b51f9ddu;
  for (size_t i = 0; i < n_out; i++) {
    uint32_t v = pool[i % 4] ^ hash_b;
    hash_b *= MULT_B;
    v *= hash_b;
    out[i] = v ^ (v >> 16);
  }
}

/* 64-bit seed of one message's stream from (seed, wire key, round[, stream]) (compression.derive_seed) */
static inline uint64_t bps_cz_derive_seed(uint64_t seed, uint64_t key, uint64_t rnd, int has_stream,
                                          uint32_t stream) {
  uint32_t words[7] = {(uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)key, (uint32_t)(key >> 32),
                       (uint32_t)rnd,  (uint32_t)(rnd >> 32),  stream};
  uint32_t st[2];
  bps_seed_sequence(words, has_stream ? 7 : 6, st, 2);
  return st[0] | (uint64_t)st[1] << 32;
}

/* np.random.PCG64(seed64): the state and increment from SeedSequence(seed64), then random_raw() */
struct BpsPcg64 {
  unsigned __int128 state, inc;

  explicit BpsPcg64(uint64_t seed64) {
    uint32_t entropy[2] = {(uint32_t)seed64, (uint32_t)(seed64 >> 32)};
    uint32_t w[8];
    bps_seed_sequence(entropy, seed64 >> 32 ? 2 : 1, w, 8);
    uint64_t v[4];
    for (int i = 0; i < 4; i++) v[i] = w[2 * i] | (uint64_t)w[2 * i + 1] << 32;
    unsigned __int128 initstate = (unsigned __int128)v[0] << 64 | v[1];
    unsigned __int128 initseq = (unsigned __int128)v[2] << 64 | v[3];
    state = 0;
    inc = initseq << 1 | 1;
    step();
    state += initstate;
    step();
  }
  void step() {
    const unsigned __int128 mult = (unsigned __int128)2549297995355413924ull << 64 | 4865540595714422341ull;
    state = state * mult + inc;
  }
  uint64_t next() {
    step();
    uint64_t hi = (uint64_t)(state >> 64), x = hi ^ (uint64_t)state;
    unsigned rot = (unsigned)(hi >> 58);
    return (x >> rot) | (x << ((64 - rot) & 63));
  }
};

/* k distinct indices in [0, n), increasing, into out: candidates floor((r >> 11) * n / 2^53) of the
 * stream PCG64(seed64), the first k distinct ones kept. k >= n: all of 0..n-1. Every process that
 * knows (seed64, n, k) gets the same indices, so randomk sends no indices. */
static inline void bps_cz_random_indices(uint64_t seed64, uint64_t n, uint64_t k, uint32_t *out) {
  if (k >= n) {
    for (uint64_t i = 0; i < n; i++) out[i] = (uint32_t)i;
    return;
  }
  std::vector<uint64_t> seen((n + 63) / 64, 0);
  BpsPcg64 g(seed64);
  const double scale = (double)n / 9007199254740992.0; /* n / 2^53 */
  for (uint64_t found = 0; found < k;) {
    uint64_t c = (uint64_t)((double)(g.next() >> 11) * scale);
    if (c > n - 1) c = n - 1;
    uint64_t bit = 1ull << (c & 63);
    if (!(seen[c >> 6] & bit)) {
      seen[c >> 6] |= bit;
      found++;
    }
  }
  uint64_t j = 0;
  for (uint64_t w = 0; w < seen.size(); w++)
    for (uint64_t bits = seen[w]; bits; bits &= bits - 1) out[j++] = (uint32_t)(w * 64 + __builtin_ctzll(bits));
}

/* ------------------------------------------------------------------------------------------ */
/* Casts                                                                                        */

/* double -> IEEE half, round to nearest even, in one rounding (float32 input: bps_f32_to_f16);
 * overflow to inf, NaN stays a quiet NaN with the top of its payload. */
static inline uint16_t bps_cz_to_half(double d) {
  uint64_t b;
  memcpy(&b, &d, 8);
  uint16_t sign = (uint16_t)((b >> 48) & 0x8000);
  int exp = (int)((b >> 52) & 0x7ff);
  uint64_t frac = b & ((1ull << 52) - 1);
  if (exp == 0x7ff) return frac ? (uint16_t)(sign | 0x7e00 | (frac >> 42)) : (uint16_t)(sign | 0x7c00);
  int e = exp - 1023;
  if (e > 15) return sign | 0x7c00;
  if (exp == 0 || e < -25) return sign; /* below half the smallest subnormal, 2^-25: zero */
  uint64_t m = frac | 1ull << 52;
  int shift = 42 + (e < -14 ? -14 - e : 0);
  uint64_t r = m >> shift, rem = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (r & 1))) r++;
  uint32_t bits = ((uint32_t)((e < -14 ? -14 : e) + 14) << 10) + (uint32_t)r; /* r carries into the exponent */
  return (uint16_t)(sign | (bits >= 0x7c00 ? 0x7c00 : bits));
}

/* float64 -> float32 rounded to odd (truncate, then set the last bit if inexact): rounding that to
 * bfloat16 equals one correct rounding of the double, with no double-rounding error. */
static inline float bps_cz_round_to_odd(double x) {
  float y = (float)x;
  uint32_t bits;
  memcpy(&bits, &y, 4);
  if (std::fabs((double)y) > std::fabs(x)) bits -= 1; /* rounded away from zero: one ulp back */
  if ((double)y != x && !std::isnan(x)) bits |= 1;
  memcpy(&y, &bits, 4);
  return y;
}

static inline uint16_t bps_cz_bf16_of(float v) { return bps_f32_to_bf16(v); }
static inline uint16_t bps_cz_bf16_of(double v) { return bps_f32_to_bf16(bps_cz_round_to_odd(v)); }
static inline uint16_t bps_cz_half_of(float v) { return bps_f32_to_f16(v); }
static inline uint16_t bps_cz_half_of(double v) { return bps_cz_to_half(v); }

/* ------------------------------------------------------------------------------------------ */
/* Header                                                                                       */

static inline void bps_cz_put_header(uint8_t *out, const BpsCodecInfo &h) {
  out[0] = 'C';
  out[1] = 'Z';
  out[2] = BPS_CZ_VERSION;
  out[3] = (uint8_t)h.method;
  out[4] = (uint8_t)h.dtype;
  out[5] = (uint8_t)h.flags;
  uint16_t levels = (uint16_t)h.levels;
  memcpy(out + 6, &levels, 2); /* little-endian hosts only (x86-64, aarch64) */
  memcpy(out + 8, &h.n, 8);
  memcpy(out + 16, &h.k, 8);
  memcpy(out + 24, &h.seed, 8);
}

/* Python's repr() of the two magic bytes, for the error text */
static inline void bps_cz_bytes_repr(const uint8_t *b, size_t len, char *out, size_t cap) {
  bool sq = memchr(b, '\'', len) != NULL, dq = memchr(b, '"', len) != NULL;
  char q = sq && !dq ? '"' : '\'';
  size_t o = (size_t)snprintf(out, cap, "b%c", q);
  for (size_t i = 0; i < len && o + 5 < cap; i++) {
    uint8_t c = b[i];
    if (c == '\\' || c == (uint8_t)q) o += (size_t)snprintf(out + o, cap - o, "\\%c", c);
    else if (c == '\t') o += (size_t)snprintf(out + o, cap - o, "\\t");
    else if (c == '\n') o += (size_t)snprintf(out + o, cap - o, "\\n");
    else if (c == '\r') o += (size_t)snprintf(out + o, cap - o, "\\r");
    else if (c < 0x20 || c >= 0x7f) o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    else out[o++] = (char)c;
  }
  snprintf(out + o, cap > o ? cap - o : 0, "%c", q);
}

static inline void bps_cz_u128_text(unsigned __int128 v, char *out) {
  char tmp[48];
  int i = 0;
  do {
    tmp[i++] = (char)('0' + (int)(v % 10));
    v /= 10;
  } while (v);
  for (int j = 0; j < i; j++) out[j] = tmp[i - 1 - j];
  out[i] = 0;
}

/* Parse and validate a blob; 0, or -1 with the reason in err (compression.parse's texts). */
static inline int bps_cz_parse(const uint8_t *buf, size_t len, BpsCodecInfo *info, char *err) {
  if (len < BPS_CZ_HEADER) {
    snprintf(err, BPS_CZ_ERRLEN, "compressed body of %zu bytes is shorter than its %d-byte header", len,
             BPS_CZ_HEADER);
    return -1;
  }
  if (buf[0] != 'C' || buf[1] != 'Z') {
    char magic[24];
    bps_cz_bytes_repr(buf, 2, magic, sizeof magic);
    snprintf(err, BPS_CZ_ERRLEN, "bad compression magic %s", magic);
    return -1;
  }
  if (buf[2] != BPS_CZ_VERSION) {
    snprintf(err, BPS_CZ_ERRLEN, "compression version %d is not supported (this build speaks %d)", buf[2],
             BPS_CZ_VERSION);
    return -1;
  }
  uint16_t levels;
  memcpy(&levels, buf + 6, 2);
  info->method = buf[3];
  info->dtype = buf[4];
  info->flags = buf[5];
  info->levels = levels;
  memcpy(&info->n, buf + 8, 8);
  memcpy(&info->k, buf + 16, 8);
  memcpy(&info->seed, buf + 24, 8);
  info->payload = buf + BPS_CZ_HEADER;
  int m = info->method;
  if (m < BPS_CZ_FP16 || m > BPS_CZ_SPARSE) {
    snprintf(err, BPS_CZ_ERRLEN, "unknown compression method %d", m);
    return -1;
  }
  if (info->dtype > 1) {
    snprintf(err, BPS_CZ_ERRLEN,
             "compressed values of dtype code %d; only float32 and float64 are compressed", info->dtype);
    return -1;
  }
  if ((m == BPS_CZ_TOPK || m == BPS_CZ_RANDOMK || m == BPS_CZ_SPARSE) &&
      (info->k > info->n || info->n > BPS_CZ_MAX_COUNT)) {
    snprintf(err, BPS_CZ_ERRLEN, "%s sends k=%llu of n=%llu elements", bps_cz_name(m),
             (unsigned long long)info->k, (unsigned long long)info->n);
    return -1;
  }
  if (m == BPS_CZ_DITHERING && (levels < 1 || levels > BPS_CZ_MAX_LEVELS)) {
    snprintf(err, BPS_CZ_ERRLEN, "dithering with %d levels", levels);
    return -1;
  }
  unsigned __int128 want = bps_cz_payload_size(m, info->n, info->dtype ? 8 : 4, info->k, levels);
  if (len - BPS_CZ_HEADER != want) {
    char total[48];
    bps_cz_u128_text(want + BPS_CZ_HEADER, total);
    snprintf(err, BPS_CZ_ERRLEN, "%s body of n=%llu elements should be %s bytes, got %zu", bps_cz_name(m),
             (unsigned long long)info->n, total, len);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Encoders                                                                                     */

/* What to encode: the method and its options. k: elements sent (topk, randomk, sparse). seed: the
 * header's (randomk: the derived index seed; dithering: the configured seed). dither_seed: the
 * stream of dithering's draws (derived from seed, key, round and sender). */
struct BpsCodecParams {
  int method, dtype, flags, levels;
  uint64_t k, seed, dither_seed;
};

/* Exact blob bytes (header included) of an encoding of n elements */
static inline size_t bps_cz_encoded_size(const BpsCodecParams &p, uint64_t n) {
  return BPS_CZ_HEADER + (size_t)bps_cz_payload_size(p.method, n, p.dtype ? 8 : 4, p.k, p.levels);
}

template <class T>
static inline double bps_cz_abs_sum(const T *v, uint64_t n, bool squares) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* eight lanes: fast, and within 1e-15 of the exact sum */
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) {
      double a = std::fabs((double)v[i + j]);
      acc[j] += squares ? a * a : a;
    }
  for (; i < n; i++) {
    double a = std::fabs((double)v[i]);
    acc[0] += squares ? a * a : a;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* IEEE layout of T: the unsigned integer of its bits, the exponent's bias and the mantissa's bits */
template <class T>
struct BpsFloatBits {
  typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
  static const int bias = sizeof(T) == 4 ? 127 : 1023, mantissa = sizeof(T) == 4 ? 23 : 52;
};

/* floor(log2 p) of a finite p > 0 (frexp's exponent - 1), from its bits when it is normal */
template <class T>
static inline int bps_cz_floor_log2(T p) {
  typename BpsFloatBits<T>::U u;
  memcpy(&u, &p, sizeof u);
  int ex;
  if (u >> BpsFloatBits<T>::mantissa) return (int)(u >> BpsFloatBits<T>::mantissa) - BpsFloatBits<T>::bias;
  (void)std::frexp(p, &ex);
  return ex - 1;
}

/* 2^e exactly (ldexp(1, e)), from its bits when it is normal */
template <class T>
static inline T bps_cz_pow2(int e) {
  const int bias = BpsFloatBits<T>::bias;
  if (e < 1 - bias || e > bias) return std::ldexp((T)1, e);
  typename BpsFloatBits<T>::U u = (typename BpsFloatBits<T>::U)(e + bias) << BpsFloatBits<T>::mantissa;
  T f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Dithering's levels q = level + s (0..2s) by stochastic rounding of |v| / norm; returns the norm.
 * The draws are u = (w >> 8) / 2^24 for the 32-bit words w of PCG64's output, low word first, and
 * every step runs in T. A non-finite norm is returned as is (every value decodes to NaN). */
template <class T>
static inline double bps_cz_dither(const T *v, uint64_t n, int levels, bool natural, bool l2, uint64_t seed64,
                                   uint16_t *q) {
  double norm;
  if (l2) {
    norm = std::sqrt(bps_cz_abs_sum(v, n, true));
  } else {
    T m = 0;
    for (uint64_t i = 0; i < n && !std::isnan(m); i++) {
      T a = std::fabs(v[i]);
      if (!(a <= m)) m = a; /* a NaN sticks, as in numpy's max */
    }
    norm = (double)m;
  }
  if (!(norm > 0) || !std::isfinite(norm)) {
    for (uint64_t i = 0; i < n; i++) q[i] = (uint16_t)levels;
    return std::isfinite(norm) ? 0.0 : norm;
  }
  BpsPcg64 g(seed64);
  const T unit = (T)(1.0 / (1 << 24)), tnorm = (T)norm, ratio = (T)(levels / norm), tlevels = (T)levels;
  const T smallest_step = bps_cz_pow2<T>(1 - levels);
  uint64_t word = 0;
  for (uint64_t i = 0; i < n; i++) {
    if (!(i & 1)) word = g.next();
    T u = (T)(uint32_t)((i & 1 ? word >> 32 : word & 0xffffffffu) >> 8) * unit;
    T a = std::fabs(v[i]);
    T lv;
    if (natural) { /* levels 0, 2^(1-s), ..., 1/2, 1: index l > 0 stands for 2^(l - s) */
      T p = a / tnorm;
      int e = p == 0 ? 0 : std::max(bps_cz_floor_log2(p), -levels);
      bool small = e < 1 - levels || p == 0;
      T lo_val = small ? (T)0 : bps_cz_pow2<T>(e);
      T step = small ? smallest_step : lo_val;
      long l = p == 0 ? 0 : (small ? 0 : e + levels) + (u < (p - lo_val) / step ? 1 : 0);
      lv = (T)std::min<long>(l, levels);
    } else { /* sp = |v| s / norm; level = floor(sp) + (u < frac(sp)) */
      T sp = a * ratio;
      T fl = (T)(int64_t)sp; /* floor: sp >= 0, at most s + 1 */
      lv = std::min(fl + (u < sp - fl ? (T)1 : (T)0), tlevels); /* an l2 norm rounded below |v| */
    }
    q[i] = (uint16_t)((v[i] < 0 ? -lv : lv) + tlevels);
  }
  return norm;
}

/* q as b-bit fields, first element in the most significant bits (b < 8), or little-endian bytes */
static inline void bps_cz_pack_levels(const uint16_t *q, uint64_t n, int levels, uint8_t *out) {
  int bits = bps_cz_level_bits(levels);
  if (bits == 16) {
    memcpy(out, q, n * 2);
    return;
  }
  if (bits == 8) {
    for (uint64_t i = 0; i < n; i++) out[i] = (uint8_t)q[i];
    return;
  }
  int per = 8 / bits;
  uint64_t nbytes = (n * bits + 7) / 8;
  memset(out, 0, nbytes);
  for (uint64_t i = 0; i < n; i++) out[i / per] |= (uint8_t)(q[i] << (8 - bits * (int)(i % per + 1)));
}

/* Indices of the k largest |v| (NaN counts as largest, ties go to the lower index), increasing.
 * The key of a value is its bit pattern without the sign: as an unsigned integer it orders
 * magnitudes, with NaN above infinity. The k-th largest key is found 16 bits at a time from the
 * top (a histogram pass per digit over the values that share the digits found so far), so the
 * selection reads the values a few times and sorts nothing. */
template <class T, class U>
static inline void bps_cz_topk_keyed(const T *v, uint64_t n, uint64_t k, uint32_t *out) {
  if (k == 0 || k > n) return;
  const U nosign = ~((U)1 << (sizeof(U) * 8 - 1));
  auto key = [v, nosign](uint64_t i) {
    U u;
    memcpy(&u, &v[i], sizeof u);
    return u & nosign;
  };
  U cut = 0, mask = 0;
  uint64_t need = k; /* rank of the cut among the values that share its digits so far, from the top */
  std::vector<uint64_t> hist(1 << 16);
  for (int shift = (int)sizeof(U) * 8 - 16; shift >= 0; shift -= 16) {
    std::fill(hist.begin(), hist.end(), 0);
    for (uint64_t i = 0; i < n; i++) {
      U x = key(i);
      if ((x & mask) == cut) hist[(x >> shift) & 0xffff]++;
    }
    int digit = 0xffff;
    for (; digit > 0 && hist[digit] < need; digit--) need -= hist[digit];
    cut |= (U)digit << shift;
    mask |= (U)0xffff << shift;
  }
  uint64_t j = 0; /* keys above the cut, and the first ``need`` equal to it */
  for (uint64_t i = 0; i < n && j < k; i++) {
    U x = key(i);
    if (x > cut || (x == cut && need && need--)) out[j++] = (uint32_t)i;
  }
}

static inline void bps_cz_topk_indices(const float *v, uint64_t n, uint64_t k, uint32_t *out) {
  bps_cz_topk_keyed<float, uint32_t>(v, n, k, out);
}
static inline void bps_cz_topk_indices(const double *v, uint64_t n, uint64_t k, uint32_t *out) {
  bps_cz_topk_keyed<double, uint64_t>(v, n, k, out);
}

template <class T>
static inline uint64_t bps_cz_count_nonzero(const T *v, uint64_t n) {
  uint64_t c = 0;
  for (uint64_t i = 0; i < n; i++) c += v[i] != 0;
  return c;
}

/* Encode n values of v into out (bps_cz_encoded_size bytes); returns the bytes written, 0 for a
 * sparse encoding whose k is not the values' count of non-zeros (nothing past the header written). */
template <class T>
static inline size_t bps_cz_encode_t(const BpsCodecParams &p, const T *v, uint64_t n, uint8_t *out) {
  BpsCodecInfo h = {p.method, p.dtype, p.flags, p.levels, n, p.k, p.seed, NULL};
  if (p.method != BPS_CZ_TOPK && p.method != BPS_CZ_RANDOMK && p.method != BPS_CZ_SPARSE) h.k = 0;
  if (p.method != BPS_CZ_RANDOMK && p.method != BPS_CZ_DITHERING) h.seed = 0;
  if (p.method != BPS_CZ_DITHERING) h.levels = 0;
  bps_cz_put_header(out, h);
  uint8_t *pay = out + BPS_CZ_HEADER;
  switch (p.method) {
    case BPS_CZ_FP16:
    case BPS_CZ_BF16:
      for (uint64_t i = 0; i < n; i++) {
        uint16_t b = p.method == BPS_CZ_FP16 ? bps_cz_half_of(v[i]) : bps_cz_bf16_of(v[i]);
        memcpy(pay + 2 * i, &b, 2);
      }
      break;
    case BPS_CZ_ONEBIT: {
      double scale = (p.flags & BPS_CZ_F_SCALING) && n ? bps_cz_abs_sum(v, n, false) / (double)n : 1.0;
      memcpy(pay, &scale, 8);
      uint8_t *bits = pay + 8;
      for (uint64_t j = 0; j < (n + 7) / 8; j++) { /* first element in the most significant bit */
        unsigned b = 0;
        for (uint64_t t = 0; t < 8; t++) b = b << 1 | (8 * j + t < n && v[8 * j + t] < 0);
        bits[j] = (uint8_t)b;
      }
      break;
    }
    case BPS_CZ_TOPK:
    case BPS_CZ_SPARSE:
    case BPS_CZ_RANDOMK: {
      std::vector<uint32_t> own;
      uint32_t *idx = (uint32_t *)(void *)pay; /* topk/sparse: the indices travel first */
      if (p.method == BPS_CZ_RANDOMK) {
        own.resize(p.k);
        idx = own.data();
        bps_cz_random_indices(p.seed, n, p.k, idx);
      } else if (p.method == BPS_CZ_TOPK) {
        own.resize(p.k);
        bps_cz_topk_indices(v, n, p.k, own.data());
        memcpy(pay, own.data(), p.k * 4);
        idx = own.data();
      } else {
        own.reserve(p.k);
        for (uint64_t i = 0; i < n; i++)
          if (v[i] != 0) own.push_back((uint32_t)i);
        if (own.size() != p.k) return 0; /* k must be the count of non-zeros (bps_cz_reply_params) */
        memcpy(pay, own.data(), p.k * 4);
        idx = own.data();
      }
      uint8_t *vals = pay + (p.method == BPS_CZ_RANDOMK ? 0 : 4 * p.k);
      for (uint64_t j = 0; j < p.k; j++) memcpy(vals + j * sizeof(T), &v[idx[j]], sizeof(T));
      break;
    }
    case BPS_CZ_DITHERING: {
      std::vector<uint16_t> q(n);
      double norm = bps_cz_dither(v, n, p.levels, p.flags & BPS_CZ_F_NATURAL, p.flags & BPS_CZ_F_L2,
                                  p.dither_seed, q.data());
      memcpy(pay, &norm, 8);
      bps_cz_pack_levels(q.data(), n, p.levels, pay + 8);
      break;
    }
    default:
      return 0;
  }
  return bps_cz_encoded_size(p, n);
}

/* ------------------------------------------------------------------------------------------ */
/* Decoder                                                                                      */

/* Write (accumulate: add) the values of a parsed blob into out (info.n values of its dtype).
 * 0, or -1 with the reason in err (indices not increasing, dithering level out of range). */
template <class T>
static inline int bps_cz_decode_t(const BpsCodecInfo &info, T *out, bool accumulate, char *err) {
  const uint8_t *p = info.payload;
  const uint64_t n = info.n;
  switch (info.method) {
    case BPS_CZ_TOPK:
    case BPS_CZ_SPARSE:
    case BPS_CZ_RANDOMK: {
      std::vector<uint32_t> drawn;
      const uint8_t *idx_bytes = p, *vals = p + 4 * info.k;
      if (info.method == BPS_CZ_RANDOMK) {
        drawn.resize(info.k);
        bps_cz_random_indices(info.seed, n, info.k, drawn.data());
        idx_bytes = (const uint8_t *)drawn.data();
        vals = p;
      } else { /* increasing and in range: a repeated index would be silently added twice */
        uint32_t prev = 0;
        for (uint64_t j = 0; j < info.k; j++) {
          uint32_t i;
          memcpy(&i, idx_bytes + 4 * j, 4);
          if (i >= n || (j && i <= prev)) {
            snprintf(err, BPS_CZ_ERRLEN, "%s indices are not increasing within 0..%lld", bps_cz_name(info.method),
                     (long long)n - 1);
            return -1;
          }
          prev = i;
        }
      }
      if (!accumulate) std::fill(out, out + n, (T)0);
      for (uint64_t j = 0; j < info.k; j++) {
        uint32_t i;
        T x;
        memcpy(&i, idx_bytes + 4 * j, 4);
        memcpy(&x, vals + j * sizeof(T), sizeof(T));
        out[i] = accumulate ? out[i] + x : x;
      }
      return 0;
    }
    case BPS_CZ_FP16:
    case BPS_CZ_BF16:
      for (uint64_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        T x = (T)(info.method == BPS_CZ_FP16 ? bps_f16_to_f32(b) : bps_bf16_to_f32(b));
        out[i] = accumulate ? out[i] + x : x;
      }
      return 0;
    case BPS_CZ_ONEBIT: {
      double scale;
      memcpy(&scale, p, 8);
      const T sel[2] = {(T)scale, -(T)scale}; /* bit 0: +scale, 1: -scale */
      const uint8_t *bits = p + 8;
      if (accumulate) {
        for (uint64_t i = 0; i < n; i++) out[i] += sel[(bits[i >> 3] >> (7 - (i & 7))) & 1];
      } else {
        for (uint64_t i = 0; i < n; i++) out[i] = sel[(bits[i >> 3] >> (7 - (i & 7))) & 1];
      }
      return 0;
    }
    case BPS_CZ_DITHERING: {
      double norm;
      memcpy(&norm, p, 8);
      const int s = info.levels, bits = bps_cz_level_bits(s);
      std::vector<T> table(2 * (size_t)s + 1); /* value of every q: decoding is one lookup */
      for (int q = 0; q <= 2 * s; q++) {
        int mag = q > s ? q - s : s - q;
        double unit = info.flags & BPS_CZ_F_NATURAL ? (mag ? std::ldexp(1.0, mag - s) : 0.0) : (double)mag / s;
        double sign = q > s ? 1.0 : q < s ? -1.0 : 0.0; /* 0 * an infinite norm: NaN, as numpy's table */
        table[q] = (T)(sign * unit * norm);
      }
      const uint8_t *lv = p + 8;
      const int per = bits < 8 ? 8 / bits : 1;
      const unsigned mask = (1u << bits) - 1;
      for (uint64_t i = 0; i < n; i++) {
        unsigned q;
        if (bits == 16) {
          uint16_t w;
          memcpy(&w, lv + 2 * i, 2);
          q = w;
        } else if (bits == 8) {
          q = lv[i];
        } else {
          q = (lv[i / per] >> (8 - bits * (int)(i % per + 1))) & mask;
        }
        if (q > (unsigned)(2 * s)) {
          snprintf(err, BPS_CZ_ERRLEN, "dithering level out of range 0..%d", 2 * s);
          return -1;
        }
        out[i] = accumulate ? out[i] + table[q] : table[q];
      }
      return 0;
    }
    default:
      snprintf(err, BPS_CZ_ERRLEN, "unknown compression method %d", info.method);
      return -1;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Compressing with state: a worker's push, a server's reply                                    */

/* Encode what a worker sends for input (n values): with momentum (m = mu m + g; nesterov: send
 * g + mu m, else m), plus the error-feedback residual when residual_valid, then residual =
 * sent - decode(blob) when residual is given. momentum/residual may be NULL; work (n values) holds
 * the corrected input when it differs from input. Returns the blob's bytes. */
template <class T>
static inline size_t bps_cz_compress_t(const BpsCodecParams &p, const T *input, uint64_t n, T *momentum, double mu,
                                       bool nesterov, T *residual, bool residual_valid, T *work, uint8_t *out) {
  const T *v = input;
  if (momentum) {
    const T tmu = (T)mu;
    for (uint64_t i = 0; i < n; i++) {
      T m = momentum[i] * tmu;
      momentum[i] = m + input[i];
    }
    if (nesterov) {
      for (uint64_t i = 0; i < n; i++) {
        T corr = tmu * momentum[i];
        work[i] = input[i] + corr;
      }
      v = work;
    } else {
      v = momentum;
    }
  }
  if (residual && residual_valid) {
    for (uint64_t i = 0; i < n; i++) work[i] = v[i] + residual[i];
    v = work;
  }
  size_t size = bps_cz_encode_t(p, v, n, out);
  if (size && residual) {
    BpsCodecInfo info;
    char err[BPS_CZ_ERRLEN];
    bps_cz_parse(out, size, &info, err); /* our own blob: valid */
    bps_cz_decode_t(info, residual, false, err);
    for (uint64_t i = 0; i < n; i++) residual[i] = v[i] - residual[i];
  }
  return size;
}

/* The parameters of a server's reply to pushes compressed like push, for the sum total: method 0
 * when the raw sum is to be sent (topk's sparse sum would not be smaller). fp16/bf16, onebit and
 * dithering re-encode the sum (with the server's own error feedback when the pushes use it: see
 * bps_cz_compress_t); randomk takes the same indices (exact); topk sends the sum's non-zeros, the
 * union of the pushed indices, as a sparse blob (exact). */
template <class T>
static inline BpsCodecParams bps_cz_reply_params(const BpsCodecInfo &push, const T *total, uint64_t n,
                                                 uint64_t key, uint64_t rnd, uint32_t stream) {
  BpsCodecParams p = {push.method, push.dtype, push.flags, push.levels, push.k, push.seed, 0};
  if (push.method == BPS_CZ_TOPK || push.method == BPS_CZ_SPARSE) {
    p.method = BPS_CZ_SPARSE;
    p.flags &= ~BPS_CZ_F_EF;
    p.k = bps_cz_count_nonzero(total, n);
    if (bps_cz_encoded_size(p, n) >= n * sizeof(T)) p.method = 0;
  } else if (push.method == BPS_CZ_RANDOMK) {
    p.flags &= ~BPS_CZ_F_EF;
  } else if (push.method == BPS_CZ_DITHERING) {
    p.dither_seed = bps_cz_derive_seed(push.seed, key, rnd, 1, stream);
  }
  return p;
}

/* dtype dispatch for callers that hold raw bytes (Cython, the native cores) */
static inline size_t bps_cz_compress(const BpsCodecParams *p, const void *input, uint64_t n, void *momentum,
                                     double mu, int nesterov, void *residual, int residual_valid, void *work,
                                     uint8_t *out) {
  if (p->dtype)
    return bps_cz_compress_t(*p, (const double *)input, n, (double *)momentum, mu, nesterov, (double *)residual,
                             residual_valid, (double *)work, out);
  return bps_cz_compress_t(*p, (const float *)input, n, (float *)momentum, mu, nesterov, (float *)residual,
                           residual_valid, (float *)work, out);
}

static inline int bps_cz_decode(const BpsCodecInfo *info, void *out, int accumulate, char *err) {
  if (info->dtype) return bps_cz_decode_t(*info, (double *)out, accumulate, err);
  return bps_cz_decode_t(*info, (float *)out, accumulate, err);
}

static inline BpsCodecParams bps_cz_reply(const BpsCodecInfo *push, const void *total, uint64_t n, uint64_t key,
                                          uint64_t rnd, uint32_t stream) {
  if (push->dtype) return bps_cz_reply_params(*push, (const double *)total, n, key, rnd, stream);
  return bps_cz_reply_params(*push, (const float *)total, n, key, rnd, stream);
}

#endif /* BPS_CODECS_H_ */
