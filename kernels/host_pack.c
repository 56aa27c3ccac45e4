/* put's side of the host codec: int32 IDs checked and stored, packed (1..16 bits an ID) or narrowed to
   whole bytes (1, 2 or 4), in one pass, in the layer-major order they are stored in (the format and the vector
   paths: host_codec.h).

   A tile of tokens goes through at a time: read once in order for the
   range check (which brings it into cache), then written layer by layer,
   so that each layer's rows are one run and the tile's IDs are read from
   cache (a token at a time, each of its rows would go to another of L
   streams). numpy's transposing copy moves an element at a time. */

#include "host_codec.h"

/* Tokens a tile: the tile's IDs stay in a core's cache between the check and the writes. */
#define TILE 64
/* Output bytes from which narrowing writes past the caches. */
#define STREAM_BYTES (1 << 20)

/* The flat index of the first ID of `ids` [n] outside [0, limit), or -1. */
static int64_t first_bad(const int32_t* ids, int64_t n, uint32_t limit) {
    for (int64_t i = 0; i < n; ++i)
        if ((uint32_t)ids[i] >= limit) return i;
    return -1;
}

#ifdef GROUPS
/* Whether any of `n` IDs is at or above `limit` as unsigned (a negative one is huge), sixteen at a time. */
AVX512 static int any_above_avx512(const int32_t* ids, int64_t n, uint32_t limit) {
    __m512i high = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) high = _mm512_max_epu32(high, _mm512_loadu_si512(ids + i));
    if (i < n) high = _mm512_max_epu32(high, _mm512_maskz_loadu_epi32((__mmask16)((1u << (n - i)) - 1u), ids + i));
    return _mm512_reduce_max_epu32(high) >= limit;
}
#endif

/* -1 where the `n` IDs at `ids` are in [0, limit), else the index of the first that is not; without a branch
   per ID. */
static int64_t check_tile(const int32_t* ids, int64_t n, uint32_t limit) {
#ifdef GROUPS
    if (gputq_path_on(PATH_AVX512))
        return any_above_avx512(ids, n, limit) ? first_bad(ids, n, limit) : -1;
#endif
    uint32_t above = 0;
    for (int64_t i = 0; i < n; ++i) above |= (uint32_t)ids[i] >= limit;
    return above ? first_bad(ids, n, limit) : -1;
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
/* Eight checked IDs (two vectors of four, lanes to be left out zero) packed into their 8 * bits bits: the
   words' low and high halves. `mask` is lane_mask(bits, 8) or, above 8 bits, (bits, 16). */
typedef struct { uint64_t lo, hi; } packed_words;

BMI2 static inline __attribute__((always_inline)) packed_words group_words(__m128i a, __m128i b, int bits,
                                                                            uint64_t mask) {
    packed_words w;
    if (bits <= 8) {
        /* IDs below 2^bits <= 256: the saturating packs keep them as they are */
        const __m128i h = _mm_packs_epi32(a, b);
        w.lo = _pext_u64((uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(h, h)), mask);
        w.hi = 0;
        return w;
    }
    /* IDs below 2^bits <= 65536: the unsigned saturating pack keeps them as they are. The halves' 4 * bits
       bits each are joined without a 128-bit shift by a variable, which compiles to a branch. */
    const __m128i h = _mm_packus_epi32(a, b);
    const uint64_t lo = _pext_u64((uint64_t)_mm_cvtsi128_si64(h), mask);
    const uint64_t hi = _pext_u64((uint64_t)_mm_extract_epi64(h, 1), mask);
    const int split = 4 * bits;
    w.lo = split == 64 ? lo : lo | hi << split;
    w.hi = split == 64 ? hi : hi >> (64 - split);
    return w;
}

/* `n` bytes of `w` at `o`; with `wide`, the whole 8 (16) byte word: the caller rewrites the bytes past later. */
static inline __attribute__((always_inline)) void store_words(uint8_t* o, packed_words w, int bits, int n,
                                                              int wide) {
    if (!wide) {
        store_bytes(o, (unsigned __int128)w.hi << 64 | w.lo, n);
        return;
    }
    memcpy(o, &w.lo, 8);
    if (bits > 8) memcpy(o + 8, &w.hi, 8);
}

/* Eight checked IDs into `bits` bytes at `o` (see store_words for `wide`). */
BMI2 static inline __attribute__((always_inline)) void pack_group(const int32_t* ids, int bits, uint64_t mask,
                                                                   uint8_t* o, int wide) {
    const packed_words w = group_words(_mm_loadu_si128((const __m128i*)ids),
                                       _mm_loadu_si128((const __m128i*)(ids + 4)), bits, mask);
    store_words(o, w, bits, bits, wide);
}

/* A row's last `n` (1..7) checked IDs after its groups (see store_words for `wide`): up to 64 bits of them
   shifted into a word, more as a group whose other lanes `keep` zeroes. The group's load reads the IDs after
   them, or where that would pass `end` (the last row), a copy. */
BMI2 static inline __attribute__((always_inline)) void pack_tail_group(const int32_t* ids, int n, int bits,
                                                                        uint64_t mask, const __m128i keep[2],
                                                                        const int32_t* end, uint8_t* o, int wide) {
    if (n * bits <= 64) {  /* a short tail (K = 10's two IDs): shifts into one word, nothing read past it */
        uint64_t w = 0;
        for (int j = 0; j < n; ++j) w |= (uint64_t)(uint32_t)ids[j] << (j * bits);
        store_words(o, (packed_words){w, 0}, 8, (n * bits + 7) >> 3, wide);
        return;
    }
    int32_t copy[8] = {0};
    if (end - ids < 8) {
        memcpy(copy, ids, sizeof(int32_t) * (size_t)n);
        ids = copy;
    }
    const packed_words w = group_words(_mm_and_si128(_mm_loadu_si128((const __m128i*)ids), keep[0]),
                                       _mm_and_si128(_mm_loadu_si128((const __m128i*)(ids + 4)), keep[1]),
                                       bits, mask);
    store_words(o, w, bits, (n * bits + 7) >> 3, wide);
}

/* Checked tokens [r0, r0 + n) of `rows` packed layer by layer, eight IDs at a time (a row's last ones as
   a group under a mask); one function, so that the group code is inlined and its mask worked out once. A group
   stores a whole word where what it writes past its bytes is rewritten later: the rest of its row, and where
   a layer's rows follow each other (layer-major) the layer's later rows, never past the layer's last row
   (the next layer's first, written before). */
BMI2 static void pack_tile_groups(const int32_t* src, int64_t rows, int64_t r0, int64_t n, int layers, int topk,
                                  int bits, uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int64_t per_token = (int64_t)layers * topk;
    const int groups = topk / 8, tail = topk % 8, row_bytes = (topk * bits + 7) >> 3;
    const uint64_t mask = lane_mask(bits, bits <= 8 ? 8 : 16);
    const int word = bits <= 8 ? 8 : 16;
    const int32_t* end = src + rows * per_token;
    const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3);
    const __m128i keep[2] = {_mm_cmplt_epi32(lanes, _mm_set1_epi32(tail)),
                             _mm_cmplt_epi32(_mm_add_epi32(lanes, _mm_set1_epi32(4)), _mm_set1_epi32(tail))};
    int inside = 0;  /* groups whose whole word ends inside their row */
    while (inside < groups && inside * bits + word <= row_bytes) ++inside;
    /* Rows reached by the row's last word (its tail's, or its last group's): the next ones of its layer
       (layer-major) or of its token */
    const int reach = ((tail ? groups : groups - 1) * bits + word + row_bytes - 1) / row_bytes;
    for (int l = 0; l < layers; ++l) {
        /* rows of the tile whose groups all store whole words: those whose reach is still to be written */
        int64_t wide_rows = 0;
        if (row_stride == row_bytes) wide_rows = rows - reach + 1 - r0;
        else if (layer_stride == row_bytes && l + reach <= layers) wide_rows = n;
        wide_rows = wide_rows < 0 ? 0 : wide_rows > n ? n : wide_rows;
        const int32_t* ids = src + r0 * per_token + (int64_t)l * topk;
        uint8_t* o = dst + r0 * row_stride + l * layer_stride;
        int64_t r = 0;
        /* the common rows (K a multiple of eight, whole words) in loops of their own: the compiler keeps
           them in registers */
        if (groups == 1 && !tail)
            for (; r < wide_rows; ++r, ids += per_token, o += row_stride) pack_group(ids, bits, mask, o, 1);
        else if (groups == 1 && tail * bits <= 64)  /* K = 9..15 with a short tail: K = 10 at 9 bits */
            for (; r < wide_rows; ++r, ids += per_token, o += row_stride) {
                pack_group(ids, bits, mask, o, 1);
                pack_tail_group(ids + 8, tail, bits, mask, keep, end, o + bits, 1);
            }
        for (; r < wide_rows; ++r, ids += per_token, o += row_stride) {
            for (int g = 0; g < groups; ++g) pack_group(ids + 8 * g, bits, mask, o + g * bits, 1);
            if (tail) pack_tail_group(ids + groups * 8, tail, bits, mask, keep, end, o + groups * bits, 1);
        }
        for (; r < n; ++r, ids += per_token, o += row_stride) {
            for (int g = 0; g < groups; ++g) pack_group(ids + 8 * g, bits, mask, o + g * bits, g < inside);
            if (tail) pack_tail_group(ids + groups * 8, tail, bits, mask, keep, end, o + groups * bits, 0);
        }
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

/* int32 IDs [rows, layers, topk] (C order) packed into dst: row r of layer l at
   dst + r * row_stride + l * layer_stride (bytes). Returns -1, or the flat index
   of the first ID outside [0, num_experts) (what was written by then is
   garbage: the caller drops it). */
int64_t gputq_pack_rows(const int32_t* src, int64_t rows, int layers, int topk, int bits, int64_t num_experts,
                        uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    const int64_t per_token = (int64_t)layers * topk;
    const uint32_t limit = (uint32_t)(num_experts > 0xFFFFFFFFLL ? 0xFFFFFFFFu : num_experts);
#ifdef GROUPS
    const int grouped = topk >= 8 && bits <= 16 && num_experts <= (1LL << bits) && gputq_path_on(PATH_BMI2);
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int64_t n = rows - r0 < TILE ? rows - r0 : TILE;
        const int64_t bad = check_tile(src + r0 * per_token, n * per_token, limit);
        if (bad >= 0) return r0 * per_token + bad;
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

/* One row of `topk` checked IDs stored in `width` bytes each (1, 2 or 4), in the host's byte order as numpy's. */
static inline void narrow_one(const int32_t* ids, int topk, int width, uint8_t* o) {
    if (width == 4) {
        memcpy(o, ids, 4 * (size_t)topk);
        return;
    }
    for (int j = 0; j < topk; ++j) {
        const uint16_t v = (uint16_t)ids[j];
        if (width == 1) o[j] = (uint8_t)v;
        else memcpy(o + 2 * j, &v, 2);
    }
}

#ifdef GROUPS
/* Eight checked IDs stored in `width` bytes each at `o` (`width` a constant where inlined). */
AVX512 static inline __attribute__((always_inline)) void narrow8(const int32_t* ids, int width, uint8_t* o) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)ids);
    if (width == 1) _mm_storel_epi64((__m128i*)o, _mm256_cvtepi32_epi8(v));
    else if (width == 2) _mm_storeu_si128((__m128i*)o, _mm256_cvtepi32_epi16(v));
    else _mm256_storeu_si256((__m256i*)o, v);
}

/* Two rows of eight checked IDs (at `a` and `b`) stored one after the other at `o`, in `width` (1 or 2) bytes
   each; with `stream`, past the caches (`o` aligned to the store). */
AVX512 static inline __attribute__((always_inline)) void narrow16(const int32_t* a, const int32_t* b, int width,
                                                                 uint8_t* o, int stream) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                         _mm256_loadu_si256((const __m256i*)b), 1);
    if (width == 1 && stream) _mm_stream_si128((__m128i*)o, _mm512_cvtepi32_epi8(v));
    else if (width == 1) _mm_storeu_si128((__m128i*)o, _mm512_cvtepi32_epi8(v));
    else if (stream) {  /* two 16-byte halves: a buffer is only sure to be aligned to 16 */
        const __m256i w = _mm512_cvtepi32_epi16(v);
        _mm_stream_si128((__m128i*)o, _mm256_castsi256_si128(w));
        _mm_stream_si128((__m128i*)(o + 16), _mm256_extracti128_si256(w, 1));
    }
    else _mm256_storeu_si256((__m256i*)o, _mm512_cvtepi32_epi16(v));
}

/* A tile's checked rows narrowed layer by layer, eight IDs a step (the row's last ones under a mask). Rows of
   eight IDs, the common case, go in a loop of their own: the compiler keeps it in registers. */
AVX512 static inline __attribute__((always_inline)) void narrow_tile_avx512(
        const int32_t* src, int64_t r0, int64_t n, int layers, int topk, int width, uint8_t* dst,
        int64_t row_stride, int64_t layer_stride, int stream) {
    const int64_t per_token = (int64_t)layers * topk;
    const int whole = topk & ~7;
    const __mmask8 last = (__mmask8)((1u << (topk & 7)) - 1u);
    for (int l = 0; l < layers; ++l) {
        const int32_t* ids = src + r0 * per_token + (int64_t)l * topk;
        uint8_t* o = dst + r0 * row_stride + l * layer_stride;
        if (topk == 8) {
            int64_t r = 0;
            if (width < 4 && row_stride == 8 * width)  /* a layer's run: two rows an instruction, one store */
                for (; r + 2 <= n; r += 2, ids += 2 * per_token, o += 2 * row_stride)
                    narrow16(ids, ids + per_token, width, o, stream);
            for (; r < n; ++r, ids += per_token, o += row_stride) narrow8(ids, width, o);
            continue;
        }
        for (int64_t r = 0; r < n; ++r, ids += per_token, o += row_stride) {
            for (int j = 0; j < whole; j += 8) narrow8(ids + j, width, o + j * width);
            if (!last) continue;
            const __m256i v = _mm256_maskz_loadu_epi32(last, ids + whole);
            if (width == 1) _mm_mask_storeu_epi8(o + whole, last, _mm256_cvtepi32_epi8(v));
            else if (width == 2) _mm_mask_storeu_epi16(o + 2 * whole, last, _mm256_cvtepi32_epi16(v));
            else _mm256_mask_storeu_epi32(o + 4 * whole, last, v);
        }
    }
}

AVX512 static void narrow_tile_vector(const int32_t* src, int64_t r0, int64_t n, int layers, int topk, int width,
                                      uint8_t* dst, int64_t row_stride, int64_t layer_stride, int stream) {
    if (width == 1 && stream) narrow_tile_avx512(src, r0, n, layers, topk, 1, dst, row_stride, layer_stride, 1);
    else if (width == 1) narrow_tile_avx512(src, r0, n, layers, topk, 1, dst, row_stride, layer_stride, 0);
    else if (width == 2 && stream) narrow_tile_avx512(src, r0, n, layers, topk, 2, dst, row_stride, layer_stride, 1);
    else if (width == 2) narrow_tile_avx512(src, r0, n, layers, topk, 2, dst, row_stride, layer_stride, 0);
    else narrow_tile_avx512(src, r0, n, layers, topk, 4, dst, row_stride, layer_stride, 0);
}
#endif

/* int32 IDs [rows, layers, topk] (C order) stored in `width` bytes each (1, 2 or 4: uint8, uint16, int32) into
   dst, laid out as gputq_pack_rows lays out rows. Every ID is checked below `limit` as unsigned (a negative
   one is refused) unless `limit` is 0, which stores any int32. Returns -1, or the flat index of the first ID
   out of range (what was written by then is garbage). */
int64_t gputq_narrow_rows(const int32_t* src, int64_t rows, int layers, int topk, int64_t limit, int width,
                          uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int64_t per_token = (int64_t)layers * topk;
    /* Large layer-major outputs of eight-ID rows go past the caches: a fresh line written whole is not read
       from memory first (the step is bigger than a cache would keep for its send anyway). */
    const int stream = topk == 8 && width < 4 && row_stride == 8 * width
                       && ((uintptr_t)dst | (uintptr_t)layer_stride) % 16 == 0 && rows * per_token * width >= STREAM_BYTES;
#ifndef GROUPS
    (void)stream;  /* no vector paths compiled: nothing streams */
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int64_t n = rows - r0 < TILE ? rows - r0 : TILE;
        const int32_t* tile = src + r0 * per_token;
        if (!limit)  /* nothing to check: the tile is still brought into cache in order before its writes */
            for (int64_t i = 0; i < n * per_token; i += 64 / sizeof(int32_t)) __builtin_prefetch(tile + i);
        const int64_t bad = limit ? check_tile(tile, n * per_token, (uint32_t)limit) : -1;
        if (bad >= 0) return r0 * per_token + bad;
#ifdef GROUPS
        if (gputq_path_on(PATH_AVX512)) {
            narrow_tile_vector(src, r0, n, layers, topk, width, dst, row_stride, layer_stride, stream);
            continue;
        }
#endif
        for (int l = 0; l < layers; ++l)
            for (int64_t r = r0; r < r0 + n; ++r)
                narrow_one(src + r * per_token + (int64_t)l * topk, topk, width, dst + r * row_stride + l * layer_stride);
    }
#ifdef GROUPS
    if (stream) _mm_sfence();  /* the streamed stores are seen before the caller hands the buffer on */
#endif
    return -1;
}
