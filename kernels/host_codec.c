/* Packed expert IDs on the host: packing (with the range check) and unpacking, one pass each.

   The format is gputq/data/packing.py's (and unpack_scatter.cu's): a row of
   K IDs of `bits` bits (1..16) in ceil(K * bits / 8) bytes, least
   significant bit first. numpy moves a packed row one ID column at a time (a
   pass over the step per column); these loops take a row at a time, so every
   byte is read and written once. kernels/host_native.py builds this file
   with the host's C compiler and falls back to numpy where there is none;
   kernels/reference.py stays the definition both are tested against. */

#include <stdint.h>
#include <string.h>

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

/* `rows` packed rows, one after the other, into rows of `dst` `dst_stride` int32 apart. */
void gputq_unpack_rows(const uint8_t* src, int64_t rows, int topk, int bits, int32_t* dst, int64_t dst_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    int64_t r = 0;
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

/* int32 IDs [rows, layers, topk] (C order) packed into dst: row r of layer l at
   dst + r * row_stride + l * layer_stride (bytes). Returns -1, or the flat index
   of the first ID outside [0, num_experts) (what was written by then is
   garbage: the caller drops it). A token's rows are checked together, without
   a branch per ID, and assembled in one 128-bit word where they fit. */
int64_t gputq_pack_rows(const int32_t* src, int64_t rows, int layers, int topk, int bits, int64_t num_experts,
                        uint8_t* dst, int64_t row_stride, int64_t layer_stride) {
    const int row_bytes = (topk * bits + 7) >> 3;
    const int64_t per_token = (int64_t)layers * topk;
    const uint32_t limit = (uint32_t)(num_experts > 0xFFFFFFFFLL ? 0xFFFFFFFFu : num_experts);
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t* token = src + r * per_token;
        uint32_t out_of_range = 0;  /* a negative ID is huge as unsigned */
        for (int64_t i = 0; i < per_token; ++i) out_of_range |= (uint32_t)token[i] >= limit;
        if (out_of_range) return r * per_token + first_bad(token, per_token, num_experts);
        for (int l = 0; l < layers; ++l) {
            const int32_t* ids = token + (int64_t)l * topk;
            uint8_t* o = dst + r * row_stride + l * layer_stride;
#ifdef ROW_WORD
            if (row_bytes <= 16) {
                unsigned __int128 w = 0;
                for (int j = 0; j < topk; ++j) w |= (unsigned __int128)(uint32_t)ids[j] << (j * bits);
                memcpy(o, &w, (size_t)row_bytes);
                continue;
            }
#endif
            uint64_t acc = 0;
            int filled = 0;
            for (int j = 0; j < topk; ++j) {
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
    }
    return -1;
}
