// Unpack + scatter: rows of packed expert IDs into an int32 output of K IDs
// per row, in one launch for a whole plan.
//
// A packed row holds K IDs of `bits` bits (1..16) in ceil(K * bits / 8)
// bytes, least significant bit first: ID j is bits [j * bits, (j+1) * bits)
// of the row, and bit n of the row is bit n % 8 of its byte n / 8
// (gputq/data/packing.py states the format; kernels/reference.py is this
// kernel's numpy reference).
//
// The host (kernels/cupy_backend.py) turns the plan into the widen kernel's
// fragment table, in rows: per fragment [source row, or negative for fill;
// destination row; rows], then each fragment's first block. A block unpacks
// UP_THREADS rows of one fragment, one row per thread: its row's bytes are
// adjacent to its neighbours', so a warp reads one contiguous run.
//
// An ID starts at bit offset o = (j * bits) % 8 of its first byte and spans
// at most three bytes (o + bits <= 7 + 16); only bytes of the row are read.

#ifndef UP_THREADS
#define UP_THREADS 256
#endif

extern "C" __global__ void __launch_bounds__(UP_THREADS)
    unpack_scatter_i32(const unsigned char* __restrict__ src, int* __restrict__ dst,
                       const long long* __restrict__ table, int nfrag, int fill, int topk, int bits) {
    const long long* __restrict__ first_block = table + 3LL * nfrag;
    const long long b = blockIdx.x;
    int lo = 0, hi = nfrag - 1;  // the fragment of this block: the last whose first block is <= b
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_block[mid] <= b) lo = mid; else hi = mid - 1;
    }
    const long long* __restrict__ frag = table + 3LL * lo;
    const long long row = (b - first_block[lo]) * UP_THREADS + threadIdx.x;
    if (row >= frag[2]) return;
    int* __restrict__ d = dst + (frag[1] + row) * topk;
    if (frag[0] < 0) {
        for (int j = 0; j < topk; ++j) d[j] = fill;
        return;
    }
    const int row_bytes = (topk * bits + 7) >> 3;
    const unsigned char* __restrict__ s = src + (frag[0] + row) * row_bytes;
    const unsigned int mask = (1u << bits) - 1u;
    for (int j = 0; j < topk; ++j) {
        const int bit = j * bits;
        const int at = bit >> 3, off = bit & 7;
        unsigned int v = s[at];
        if (off + bits > 8) v |= static_cast<unsigned int>(s[at + 1]) << 8;
        if (off + bits > 16) v |= static_cast<unsigned int>(s[at + 2]) << 16;
        d[j] = static_cast<int>((v >> off) & mask);
    }
}
