/* Whole-byte rows widened on the host: the numpy-array counterpart of widen_scatter.cu (host restores, and
   the in-place restores that read same-host arenas where they lie).

   numpy widens a plan row at a time, a call each, and a micro-batch of a
   pipeline stage's layers and a CP rank's chunks has dozens of short rows;
   this loop takes the whole plan in one call, each row's elements widened
   by a loop the compiler vectorises. kernels/reference.py stays the
   definition it is tested against. */

#include "host_codec.h"

/* `n` elements of `bytes` bytes each (1 or 2: unsigned; 4: copied as they are) from `s` into 32-bit `o`. */
static void widen_run(const uint8_t* s, int bytes, uint32_t* o, int64_t n) {
    if (bytes == 1) {
        for (int64_t k = 0; k < n; ++k) o[k] = s[k];
    } else if (bytes == 2) {
        const uint16_t* w = (const uint16_t*)s;  /* staging rows are aligned to their elements */
        for (int64_t k = 0; k < n; ++k) o[k] = w[k];
    } else {
        memcpy(o, s, (size_t)n * 4);
    }
}

/* The plan's rows (src_row, dst_row, rows: staging rows [src_row, src_row + rows) into dst rows from dst_row;
   src_row < 0 writes `fill`, a 32-bit pattern) of `width` elements: staging elements of `src_bytes` bytes
   (`src_rows` rows of them) widened into dst (`dst_rows` rows of 32-bit elements). Returns -1, or the index of
   the first plan row that reads or writes outside the buffers (nothing of it or after it is written). */
int64_t gputq_widen_scatter(const void* src, int src_bytes, int64_t src_rows, const int64_t* plan, int64_t nplan,
                            int64_t width, uint32_t* dst, int64_t dst_rows, uint32_t fill) {
    const uint8_t* staging = (const uint8_t*)src;
    for (int64_t i = 0; i < nplan; ++i) {
        const int64_t s = plan[3 * i], d = plan[3 * i + 1], n = plan[3 * i + 2];
        if (n < 0 || d < 0 || d > dst_rows - n || (s >= 0 && s > src_rows - n)) return i;
        uint32_t* o = dst + d * width;
        if (s < 0) {
            for (int64_t k = 0; k < n * width; ++k) o[k] = fill;
        } else {
            widen_run(staging + s * width * src_bytes, src_bytes, o, n * width);
        }
    }
    return -1;
}

/* gputq_widen_scatter with the staging bytes where they lie: `nseg` segments (see mapped_bytes). A copied
   plan row must lie inside one segment, its first element aligned to `src_bytes`. Returns -1, or the index
   of the first plan row that breaks a rule or writes outside dst (nothing of it or after it is written). */
int64_t gputq_widen_scatter_mapped(const int64_t* starts, const int64_t* addresses, const int64_t* lengths,
                                   int64_t nseg, int src_bytes, const int64_t* plan, int64_t nplan, int64_t width,
                                   uint32_t* dst, int64_t dst_rows, uint32_t fill) {
    const int64_t row_bytes = width * src_bytes;
    for (int64_t i = 0; i < nplan; ++i) {
        const int64_t s = plan[3 * i], d = plan[3 * i + 1], n = plan[3 * i + 2];
        if (n < 0 || d < 0 || d > dst_rows - n) return i;
        uint32_t* o = dst + d * width;
        if (s < 0) {
            for (int64_t k = 0; k < n * width; ++k) o[k] = fill;
            continue;
        }
        const uint8_t* from = mapped_bytes(starts, addresses, lengths, nseg, s * row_bytes, n * row_bytes);
        if (from == NULL || (uintptr_t)from % (uintptr_t)src_bytes) return i;
        widen_run(from, src_bytes, o, n * width);
    }
    return -1;
}
