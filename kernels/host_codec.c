/* Packed expert IDs on the host: packing (with the range check) and unpacking, one pass each.

   The format is gputq/data/packing.py's (and unpack_scatter.cu's): a row of
   K IDs of `bits` bits (1..16) in ceil(K * bits / 8) bytes, least
   significant bit first. numpy moves a packed row one ID column at a time (a
   pass over the step per column); these loops take a row at a time, so every
   byte is read and written once. kernels/host_native.py builds this file
   with the host's C compiler and falls back to numpy where there is none;
   kernels/reference.py stays the definition both are tested against.

   On x86-64 CPUs whose BMI2 runs in hardware, eight IDs of up to 16 bits
   move as one group: narrowed into one 64-bit word (or two), then
   gathered into `bits * 8` packed bits by PEXT (scattered back by PDEP),
   instead of a shift and a mask an ID. Eight IDs are always whole bytes,
   so groups never share one. Where AVX-512 VBMI is present, rows of a
   multiple of eight IDs unpack sixteen IDs an instruction sequence: VPERMB
   gathers the four bytes around each ID into its 32-bit lane, a variable
   shift and a mask leave the ID. The choice is made at run time (the built
   file runs on any x86-64), and gputq_set_paths turns paths off for tests. */

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GROUPS 1  /* the BMI2 group paths are compiled */
#define BMI2 __attribute__((target("bmi2,sse4.1")))
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
#define PATH_BMI2 1
#define PATH_VBMI 2
static int paths = -1;  /* the vector paths that run (PATH_*); -1: not decided yet */

/* The vector paths this CPU runs well: BMI2 unless microcoded (AMD before Zen 3 takes hundreds of cycles
   an instruction), AVX-512 VBMI. */
static int cpu_paths(void) {
    __builtin_cpu_init();
    const int bmi2 = __builtin_cpu_supports("bmi2") && !__builtin_cpu_is("znver1") && !__builtin_cpu_is("znver2");
    const int vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
    return (bmi2 ? PATH_BMI2 : 0) | (vbmi ? PATH_VBMI : 0);
}

static int bmi2_enabled(void) {
    if (paths < 0) paths = cpu_paths();
    return paths & PATH_BMI2;
}

static int vbmi_enabled(void) {
    if (paths < 0) paths = cpu_paths();
    return paths & PATH_VBMI;
}

/* `n` (1..16) bytes of `w`, little-endian, to `o`: a copy of constant size per case (no call, no loop). */
static inline void store_bytes(uint8_t* o, unsigned __int128 w, int n) {
    switch (n) {
#define CASE(k) case k: memcpy(o, &w, k); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
}

/* `n` (1..16) bytes from `s`, little-endian, the rest zero. */
static inline unsigned __int128 load_bytes(const uint8_t* s, int n) {
    unsigned __int128 w = 0;
    switch (n) {
#define CASE(k) case k: memcpy(&w, s, k); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
    return w;
}

/* The low `bits` bits of each of the 64-bit word's lanes of `lane` bits. */
static uint64_t lane_mask(int bits, int lane) {
    uint64_t m = 0;
    for (int i = 0; i < 64; i += lane) m |= ((1ull << bits) - 1ull) << i;
    return m;
}
#endif

/* Allow the vector paths in `allowed` (1: BMI2, 2: AVX-512 VBMI; 0: an ID at a time) where the CPU runs them,
   or leave them (-1); returns the paths that run. */
int gputq_set_paths(int allowed) {
#ifdef GROUPS
    if (allowed >= 0) paths = cpu_paths() & allowed;
    else if (paths < 0) paths = cpu_paths();
    return paths;
#else
    (void)allowed;
    return 0;
#endif
}

#if defined(__SIZEOF_INT128__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define ROW_WORD 1  /* a row of up to 16 bytes is one 128-bit little-endian word: a shift and a mask an ID */
#endif

/* One packed row of `topk` IDs into `dst` (int32, `topk` of them), a byte at a time. */
static inline void unpack_row(const uint8_t* s, int topk, int bits, int32_t* d) {
    const uint32_t mask = (1u << bits) - 1u;
    for (int j = 0; j < topk; ++j) {
        const int bit = j * bits, at = bit >> 3, off = bit & 7;
        uint32_t v = s[at];
        if (off + bits > 8) v |= (uint32_t)s[at + 1] << 8;
        if (off + bits > 16) v |= (uint32_t)s[at + 2] << 16;
        d[j] = (int32_t)((v >> off) & mask);
    }
}

#ifdef ROW_WORD
/* Rows [0, whole) as 128-bit words, 16 bytes loaded at a time (bytes past a row are never shifted into an ID). */
static void unpack_words(const uint8_t* src, int64_t whole, int topk, int bits, int32_t* dst, int64_t dst_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t r = 0; r < whole; ++r) {
        unsigned __int128 w;
        memcpy(&w, src + r * row_bytes, 16);
        int32_t* d = dst + r * dst_stride;
        for (int j = 0; j < topk; ++j) d[j] = (int32_t)((uint32_t)(w >> (j * bits)) & mask);
    }
}
#endif

#ifdef GROUPS
/* `bits` bytes (a group) at `s`: one whole load masked where 16 bytes from `s` are inside the buffer (`end`),
   else byte copies (a short copy into a word read back whole stalls the load on most CPUs). */
static inline unsigned __int128 load_group(const uint8_t* s, int bits, const uint8_t* end) {
    if (end - s >= 16) {
        unsigned __int128 w;
        memcpy(&w, s, 16);
        return bits == 16 ? w : w & (((unsigned __int128)1 << (8 * bits)) - 1);
    }
    return load_bytes(s, bits);
}

/* A row's whole groups of eight IDs, `bits` bytes each, into int32 `d`; its last `topk % 8` IDs are the caller's.
   `end`: the end of the packed buffer. */
BMI2 static void unpack_groups(const uint8_t* s, int groups, int bits, int32_t* d, const uint8_t* end) {
    if (bits <= 8) {
        const uint64_t mask = lane_mask(bits, 8);
        for (int g = 0; g < groups; ++g, s += bits, d += 8) {
            const __m128i b = _mm_cvtsi64_si128((long long)_pdep_u64((uint64_t)load_group(s, bits, end), mask));
            const __m128i w = _mm_unpacklo_epi8(b, _mm_setzero_si128());
            _mm_storeu_si128((__m128i*)d, _mm_unpacklo_epi16(w, _mm_setzero_si128()));
            _mm_storeu_si128((__m128i*)(d + 4), _mm_unpackhi_epi16(w, _mm_setzero_si128()));
        }
        return;
    }
    const uint64_t mask = lane_mask(bits, 16), half = bits == 16 ? ~0ull : (1ull << (4 * bits)) - 1ull;
    for (int g = 0; g < groups; ++g, s += bits, d += 8) {
        const unsigned __int128 packed = load_group(s, bits, end);
        const __m128i w = _mm_set_epi64x((long long)_pdep_u64((uint64_t)(packed >> (4 * bits)) & half, mask),
                                         (long long)_pdep_u64((uint64_t)packed & half, mask));
        _mm_storeu_si128((__m128i*)d, _mm_unpacklo_epi16(w, _mm_setzero_si128()));
        _mm_storeu_si128((__m128i*)(d + 4), _mm_unpackhi_epi16(w, _mm_setzero_si128()));
    }
}

/* The VPERMB indices and shifts that leave ID j of sixteen packed ones (from a byte boundary) in 32-bit lane j. */
VBMI static void vbmi_gather(int bits, __m512i* gather, __m512i* shifts) {
    uint8_t index[64];
    uint32_t shift[16];
    for (int j = 0; j < 16; ++j) {
        for (int k = 0; k < 4; ++k) index[4 * j + k] = (uint8_t)((j * bits >> 3) + k);
        shift[j] = (uint32_t)(j * bits & 7);
    }
    *gather = _mm512_loadu_si512(index);
    *shifts = _mm512_loadu_si512(shift);
}

/* The sixteen int32 IDs of `v` (packed bytes from a byte boundary), by vbmi_gather's indices and shifts. */
VBMI static inline __m512i vbmi_ids(__m512i v, __m512i gather, __m512i shifts, __m512i mask) {
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(gather, v), shifts), mask);
}

/* Rows of any `topk`, a row at a time: sixteen IDs (2 * bits bytes, from a byte boundary) a step, the row's
   last ones under a mask (a row starts on a byte: rows are whole bytes). */
VBMI static void unpack_rows_vbmi_masked(const uint8_t* src, int64_t rows, int topk, int bits, int32_t* dst,
                                         int64_t dst_stride) {
    __m512i gather, shifts;
    vbmi_gather(bits, &gather, &shifts);
    const __m512i mask = _mm512_set1_epi32((int)((1u << bits) - 1u));
    const int row_bytes = (topk * bits + 7) >> 3;
    if (topk <= 16) {  /* one step a row: its masks are the same for every row */
        const __mmask64 load = (__mmask64)((1ull << row_bytes) - 1ull);
        const __mmask16 store = (__mmask16)((1u << topk) - 1u);
        for (int64_t r = 0; r < rows; ++r) {
            const __m512i v = _mm512_maskz_loadu_epi8(load, src + r * row_bytes);
            _mm512_mask_storeu_epi32(dst + r * dst_stride, store, vbmi_ids(v, gather, shifts, mask));
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* s = src + r * row_bytes;
        int32_t* d = dst + r * dst_stride;
        for (int j = 0; j < topk; j += 16, s += 2 * bits, d += 16) {
            const int n = topk - j < 16 ? topk - j : 16;
            const int nbytes = (n * bits + 7) >> 3;
            const __m512i v = _mm512_maskz_loadu_epi8((__mmask64)((1ull << nbytes) - 1ull), s);
            _mm512_mask_storeu_epi32(d, (__mmask16)((1u << n) - 1u), vbmi_ids(v, gather, shifts, mask));
        }
    }
}

/* Rows of `topk` (a multiple of 8) IDs, sixteen IDs (two groups, 2 * bits bytes) at a time: group g of the
   rows lands at row g / (topk / 8), ID (g % (topk / 8)) * 8 of dst. An odd last group goes to `unpack_groups`. */
VBMI static void unpack_rows_vbmi(const uint8_t* src, int64_t rows, int topk, int bits, int32_t* dst,
                                  int64_t dst_stride) {
    __m512i gather, shifts;
    vbmi_gather(bits, &gather, &shifts);
    const __m512i mask = _mm512_set1_epi32((int)((1u << bits) - 1u));
    const __mmask64 bytes = (__mmask64)((1ull << (2 * bits)) - 1ull);  /* 2 * bits <= 32 */
    const int64_t per_row = topk / 8, groups = rows * per_row;
    const int contiguous = dst_stride == topk;
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        const __m512i v = _mm512_maskz_loadu_epi8(bytes, src + g * bits);  /* masked bytes are never read */
        const __m512i ids = vbmi_ids(v, gather, shifts, mask);
        if (contiguous) {
            _mm512_storeu_si512(dst + g * 8, ids);
            continue;
        }
        int32_t* d0 = dst + g / per_row * dst_stride + g % per_row * 8;
        int32_t* d1 = dst + (g + 1) / per_row * dst_stride + (g + 1) % per_row * 8;
        _mm256_storeu_si256((__m256i*)d0, _mm512_castsi512_si256(ids));
        _mm256_storeu_si256((__m256i*)d1, _mm512_extracti64x4_epi64(ids, 1));
    }
    if (g < groups)
        unpack_groups(src + g * bits, 1, bits, dst + g / per_row * dst_stride + g % per_row * 8,
                      src + groups * bits);
}

/* Rows by groups of eight IDs: the tail of each row a byte at a time. */
static void unpack_rows_grouped(const uint8_t* src, int64_t rows, int topk, int bits, int32_t* dst,
                                int64_t dst_stride) {
    const int row_bytes = (topk * bits + 7) >> 3, groups = topk / 8, tail = topk % 8;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* s = src + r * row_bytes;
        int32_t* d = dst + r * dst_stride;
        unpack_groups(s, groups, bits, d, src + rows * row_bytes);
        if (tail) unpack_row(s + groups * bits, tail, bits, d + groups * 8);
    }
}
#endif

/* `rows` packed rows, one after the other, into rows of `dst` `dst_stride` int32 apart. */
void gputq_unpack_rows(const uint8_t* src, int64_t rows, int topk, int bits, int32_t* dst, int64_t dst_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    int64_t r = 0;
#ifdef GROUPS
    if (topk >= 8 && topk % 8 == 0 && bits <= 16 && vbmi_enabled() && bmi2_enabled()) {
        unpack_rows_vbmi(src, rows, topk, bits, dst, dst_stride);
        return;
    }
    if (topk > 1 && bits <= 16 && vbmi_enabled()) {
        unpack_rows_vbmi_masked(src, rows, topk, bits, dst, dst_stride);
        return;
    }
    if (topk >= 8 && bits <= 16 && bmi2_enabled()) {
        unpack_rows_grouped(src, rows, topk, bits, dst, dst_stride);
        return;
    }
#endif
#ifdef ROW_WORD
    if (row_bytes <= 16 && rows * row_bytes >= 16) {
        r = rows - (16 + row_bytes - 1) / row_bytes;
        unpack_words(src, r, topk, bits, dst, dst_stride);
    }
#endif
    for (; r < rows; ++r) unpack_row(src + r * row_bytes, topk, bits, dst + r * dst_stride);
}

/* Rows [src_row, src_row + rows) of a layer-major blob [layers, blob_rows, row_bytes] into token-major int32
   dst [rows, layers, topk]: a chunk of tokens at a time, every layer of it, so that the chunk's output rows
   stay in cache while each layer writes its IDs into them. */
void gputq_unpack_token_major(const uint8_t* blob, int64_t blob_rows, int64_t src_row, int64_t rows, int layers,
                              int topk, int bits, int32_t* dst) {
    const int row_bytes = (topk * bits + 7) >> 3;
    const int64_t chunk = 256;
    for (int64_t c = 0; c < rows; c += chunk) {
        const int64_t n = rows - c < chunk ? rows - c : chunk;
        for (int l = 0; l < layers; ++l)
            gputq_unpack_rows(blob + ((int64_t)l * blob_rows + src_row + c) * row_bytes, n, topk, bits,
                              dst + (c * layers + l) * topk, (int64_t)layers * topk);
    }
}

/* The plan's rows (src_row, dst_row, rows; src_row < 0 writes `fill`), validated by the caller. */
void gputq_unpack_scatter(const uint8_t* src, const int64_t* plan, int64_t nplan, int topk, int bits,
                          int32_t* dst, int32_t fill) {
    const int row_bytes = (topk * bits + 7) >> 3;
    for (int64_t i = 0; i < nplan; ++i) {
        const int64_t s = plan[3 * i], d = plan[3 * i + 1], n = plan[3 * i + 2];
        if (s < 0) {
            for (int64_t k = 0; k < n * topk; ++k) dst[d * topk + k] = fill;
        } else {
            gputq_unpack_rows(src + s * row_bytes, n, topk, bits, dst + d * topk, topk);
        }
    }
}

/* The flat index of the first ID of `ids` [n] outside [0, num_experts). */
static int64_t first_bad(const int32_t* ids, int64_t n, int64_t num_experts) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || (int64_t)ids[i] >= num_experts) return i;
    return -1;
}

/* A row's last IDs (fewer than eight after whole groups, or all of them), a byte at a time from `o`. */
static void pack_tail(const int32_t* ids, int n, int bits, uint8_t* o) {
    uint64_t acc = 0;
    int filled = 0;
    for (int j = 0; j < n; ++j) {
        acc |= (uint64_t)(uint32_t)ids[j] << filled;
        filled += bits;
        while (filled >= 8) {
            *o++ = (uint8_t)acc;
            acc >>= 8;
            filled -= 8;
        }
    }
    if (filled) *o = (uint8_t)acc;
}

#ifdef GROUPS
/* Eight checked IDs into `bits` bytes at `o`; `mask` is lane_mask(bits, 8) or, above 8 bits, (bits, 16).
   With `wide`, a whole 8 (16) byte word is stored: the caller rewrites the bytes past the group later. */
BMI2 static inline void pack_group(const int32_t* ids, int bits, uint64_t mask, uint8_t* o, int wide) {
    if (bits <= 8) {
        /* IDs below 2^bits <= 256: the saturating packs keep them as they are */
        const __m128i w = _mm_packs_epi32(_mm_loadu_si128((const __m128i*)ids),
                                          _mm_loadu_si128((const __m128i*)(ids + 4)));
        const uint64_t packed = _pext_u64((uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(w, w)), mask);
        if (wide)
            memcpy(o, &packed, 8);
        else
            store_bytes(o, packed, bits);
        return;
    }
    /* IDs below 2^bits <= 65536: the unsigned saturating pack keeps them as they are */
    const __m128i w = _mm_packus_epi32(_mm_loadu_si128((const __m128i*)ids),
                                       _mm_loadu_si128((const __m128i*)(ids + 4)));
    const uint64_t lo = (uint64_t)_mm_cvtsi128_si64(w), hi = (uint64_t)_mm_extract_epi64(w, 1);
    const unsigned __int128 packed = (unsigned __int128)_pext_u64(lo, mask)
                                     | (unsigned __int128)_pext_u64(hi, mask) << (4 * bits);
    if (wide)
        memcpy(o, &packed, 16);
    else
        store_bytes(o, packed, bits);
}

/* Checked tokens [r0, r0 + n) of `rows` packed layer by layer, eight IDs at a time (each row's last ones a
   byte at a time); one function, so that the group code is inlined and its mask worked out once. A group
   stores a whole word where what it writes past its bytes is rewritten later: the rest of its row, and where
   a layer's rows follow each other (layer-major) the layer's later rows, never past the layer's last row
   (the next layer's first, written before). */
BMI2 static void pack_tile_groups(const int32_t* src, int64_t rows, int64_t r0, int64_t n, int layers, int topk,
                                  int bits, uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int64_t per_token = (int64_t)layers * topk;
    const int groups = topk / 8, tail = topk % 8, row_bytes = (topk * bits + 7) >> 3;
    const uint64_t mask = lane_mask(bits, bits <= 8 ? 8 : 16);
    const int runs = row_stride == row_bytes, word = bits <= 8 ? 8 : 16;
    for (int l = 0; l < layers; ++l)
        for (int64_t r = r0; r < r0 + n; ++r) {
            const int32_t* ids = src + r * per_token + (int64_t)l * topk;
            uint8_t* o = dst + r * row_stride + l * layer_stride;
            const int64_t room = runs ? (rows - r) * row_bytes : row_bytes;  /* bytes from o rewritten later */
            for (int g = 0; g < groups; ++g)
                pack_group(ids + 8 * g, bits, mask, o + g * bits, (int64_t)g * bits + word <= room);
            if (tail) pack_tail(ids + groups * 8, tail, bits, o + groups * bits);
        }
}
#endif

/* One checked row of `topk` IDs packed at `o`, an ID at a time. */
static inline void pack_one(const int32_t* ids, int topk, int bits, int row_bytes, uint8_t* o) {
#ifdef ROW_WORD
    if (row_bytes <= 16) {
        unsigned __int128 w = 0;
        for (int j = 0; j < topk; ++j) w |= (unsigned __int128)(uint32_t)ids[j] << (j * bits);
        memcpy(o, &w, (size_t)row_bytes);
        return;
    }
#else
    (void)row_bytes;
#endif
    pack_tail(ids, topk, bits, o);
}

/* Tokens checked, then packed layer by layer, at a time: their IDs stay in cache while each layer's rows are
   written as one run (a token at a time, each row went to another of L streams). */
#define PACK_TILE 64

/* int32 IDs [rows, layers, topk] (C order) packed into dst: row r of layer l at
   dst + r * row_stride + l * layer_stride (bytes). Returns -1, or the flat index
   of the first ID outside [0, num_experts) (what was written by then is
   garbage: the caller drops it). A tile's IDs are checked together, without
   a branch per ID. */
int64_t gputq_pack_rows(const int32_t* src, int64_t rows, int layers, int topk, int bits, int64_t num_experts,
                        uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    const int64_t per_token = (int64_t)layers * topk;
    const uint32_t limit = (uint32_t)(num_experts > 0xFFFFFFFFLL ? 0xFFFFFFFFu : num_experts);
#ifdef GROUPS
    const int grouped = topk >= 8 && bits <= 16 && num_experts <= (1LL << bits) && bmi2_enabled();
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += PACK_TILE) {
        const int64_t n = rows - r0 < PACK_TILE ? rows - r0 : PACK_TILE;
        const int32_t* tile = src + r0 * per_token;
        uint32_t out_of_range = 0;  /* a negative ID is huge as unsigned */
        for (int64_t i = 0; i < n * per_token; ++i) out_of_range |= (uint32_t)tile[i] >= limit;
        if (out_of_range) return r0 * per_token + first_bad(tile, n * per_token, num_experts);
#ifdef GROUPS
        if (grouped) {
            pack_tile_groups(src, rows, r0, n, layers, topk, bits, dst, row_stride, layer_stride);
            continue;
        }
#endif
        for (int l = 0; l < layers; ++l)
            for (int64_t r = r0; r < r0 + n; ++r)
                pack_one(src + r * per_token + (int64_t)l * topk, topk, bits, row_bytes,
                         dst + r * row_stride + l * layer_stride);
    }
    return -1;
}
