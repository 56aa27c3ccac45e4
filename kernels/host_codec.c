/* Packed expert IDs unpacked on the host, one pass each (the format and the vector paths: host_codec.h).

   numpy moves a packed row one ID column at a time (a pass over the step
   per column); these loops take a row at a time, so every byte is read and
   written once. On x86-64 CPUs whose BMI2 runs in hardware, eight IDs move
   as one group (PDEP) instead of a shift and a mask an ID. Where AVX-512
   VBMI is present, rows unpack sixteen IDs an instruction sequence: VPERMB
   gathers the four bytes around each ID into its 32-bit lane, a variable
   shift and a mask leave the ID. This file also keeps which paths run. */

#include "host_codec.h"

#ifdef GROUPS
static int paths = -1;  /* the vector paths that run (PATH_*); -1: not decided yet */

/* The vector paths this CPU runs well: BMI2 unless microcoded (AMD before Zen 3 takes hundreds of cycles
   an instruction), AVX-512 VBMI, AVX-512 with byte and word lanes and 256-bit forms. */
static int cpu_paths(void) {
    __builtin_cpu_init();
    const int bmi2 = __builtin_cpu_supports("bmi2") && !__builtin_cpu_is("znver1") && !__builtin_cpu_is("znver2");
    const int vbmi = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512vl");
    return (bmi2 ? PATH_BMI2 : 0) | (vbmi ? PATH_VBMI : 0) | (avx512 ? PATH_AVX512 : 0);
}
#endif

/* Allow the vector paths in `allowed` (PATH_* bits; 0: an ID at a time) where the CPU runs them, or leave them
   (-1); returns the paths that run. */
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

int gputq_path_on(int path) {
    return gputq_set_paths(-1) & path;
}

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
    if (topk >= 8 && topk % 8 == 0 && bits <= 16 && gputq_path_on(PATH_VBMI) && gputq_path_on(PATH_BMI2)) {
        unpack_rows_vbmi(src, rows, topk, bits, dst, dst_stride);
        return;
    }
    if (topk > 1 && bits <= 16 && gputq_path_on(PATH_VBMI)) {
        unpack_rows_vbmi_masked(src, rows, topk, bits, dst, dst_stride);
        return;
    }
    if (topk >= 8 && bits <= 16 && gputq_path_on(PATH_BMI2)) {
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

/* gputq_unpack_scatter with the staging bytes where they lie: `nseg` segments (see mapped_bytes), `dst` of
   `dst_rows` rows. A copied plan row must lie inside one segment. Returns -1, or the index of the first plan row
   that breaks the rule or writes outside dst (nothing of it or after it is written). */
int64_t gputq_unpack_scatter_mapped(const int64_t* starts, const int64_t* addresses, const int64_t* lengths,
                                    int64_t nseg, const int64_t* plan, int64_t nplan, int topk, int bits,
                                    int32_t* dst, int64_t dst_rows, int32_t fill) {
    const int64_t row_bytes = (topk * bits + 7) >> 3;
    for (int64_t i = 0; i < nplan; ++i) {
        const int64_t s = plan[3 * i], d = plan[3 * i + 1], n = plan[3 * i + 2];
        if (n < 0 || d < 0 || d > dst_rows - n) return i;
        if (s < 0) {
            for (int64_t k = 0; k < n * topk; ++k) dst[d * topk + k] = fill;
            continue;
        }
        const uint8_t* from = mapped_bytes(starts, addresses, lengths, nseg, s * row_bytes, n * row_bytes);
        if (from == NULL) return i;
        gputq_unpack_rows(from, n, topk, bits, dst + d * topk, topk);
    }
    return -1;
}
