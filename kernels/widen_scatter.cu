// Widen + scatter: copy row ranges of a compact staging buffer into an int32
// (or float32) output, widening each element, in one launch for a whole plan.
//
// The host (kernels/cupy_backend.py) turns the plan into a table of
// fragments, 4 long longs each:
//   [0] source element offset     [1] destination element offset
//   [2] element count n (> 0)     [3] meta: bits 0-1 head, bit 2 fill,
//                                       bit 3 source vector-aligned
// followed by nfrag long longs: the first block index of each fragment.
// A fragment's elements [0, head) are the scalar part before the first
// 16-byte-aligned destination element; the rest is cut into chunks of
// WS_CHUNK elements, one block each, so every block but the fragment's last
// stores whole 16-byte vectors only. The last chunk ends in a scalar tail
// of fewer than 4 elements. Loads take 4 source elements at once (what one
// 16-byte store consumes: 4, 8 or 16 bytes) where the source is aligned
// for it, and 4 scalar loads where it is not.
//
// Offsets are 64-bit (outputs pass 2^31 elements); the per-thread loop uses
// 32-bit indices within a chunk and never divides.

#ifndef WS_CHUNK
#define WS_CHUNK 4096
#endif
#ifndef WS_THREADS
#define WS_THREADS 256
#endif

// Vectors of 4 elements each thread moves per step of its loop.
#define WS_STEPS (WS_CHUNK / (4 * WS_THREADS))
static_assert(WS_CHUNK % (4 * WS_THREADS) == 0, "a chunk must be whole steps of the block");
static_assert(WS_STEPS >= 1, "a chunk must give every thread work");

template <typename T> struct Vec4;
template <> struct Vec4<unsigned char> { typedef uchar4 type; };
template <> struct Vec4<unsigned short> { typedef ushort4 type; };
template <> struct Vec4<int> { typedef int4 type; };
template <> struct Vec4<float> { typedef float4 type; };

template <typename In, typename Out>
__device__ __forceinline__ typename Vec4<Out>::type load_widen4(const In* __restrict__ p,
                                                                bool aligned) {
    typename Vec4<Out>::type r;
    if (aligned) {
        const typename Vec4<In>::type v = *reinterpret_cast<const typename Vec4<In>::type*>(p);
        r.x = static_cast<Out>(v.x);
        r.y = static_cast<Out>(v.y);
        r.z = static_cast<Out>(v.z);
        r.w = static_cast<Out>(v.w);
    } else {
        r.x = static_cast<Out>(p[0]);
        r.y = static_cast<Out>(p[1]);
        r.z = static_cast<Out>(p[2]);
        r.w = static_cast<Out>(p[3]);
    }
    return r;
}

template <typename In, typename Out>
__device__ __forceinline__ void widen_scatter_body(const In* __restrict__ src,
                                                   Out* __restrict__ dst,
                                                   const long long* __restrict__ table,
                                                   int nfrag, Out fill) {
    typedef typename Vec4<Out>::type Out4;
    const long long* __restrict__ first_block = table + 4LL * nfrag;
    const long long b = blockIdx.x;

    // The fragment of this block: the last one whose first block is <= b.
    int lo = 0, hi = nfrag - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_block[mid] <= b) lo = mid; else hi = mid - 1;
    }
    const long long* __restrict__ frag = table + 4LL * lo;
    const long long n = frag[2];
    const int meta = static_cast<int>(frag[3]);
    const int head = meta & 3;
    const bool is_fill = (meta & 4) != 0;
    const bool src_aligned = (meta & 8) != 0;
    const long long chunk = b - first_block[lo];

    Out* __restrict__ d = dst + frag[1];
    const In* __restrict__ s = src + frag[0];
    const int t = threadIdx.x;
    if (chunk == 0 && t < head) {
        d[t] = is_fill ? fill : static_cast<Out>(s[t]);
    }

    // This block's part: [begin, begin + len) of the fragment; begin is
    // 16-byte aligned in dst. The host guarantees len >= 0 (len > 0 unless
    // the fragment is all head).
    const long long begin = head + chunk * WS_CHUNK;
    const long long left = n - begin;
    const int len = left < WS_CHUNK ? static_cast<int>(left) : WS_CHUNK;
    d += begin;
    s += begin;
    Out4* __restrict__ d4 = reinterpret_cast<Out4*>(d);
    const int nvec = len >> 2;

    if (is_fill) {
        Out4 f4;
        f4.x = fill; f4.y = fill; f4.z = fill; f4.w = fill;
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < nvec) d4[i] = f4;
        }
    } else {
        // All loads first, then all stores: WS_STEPS loads in flight per thread.
        Out4 v[WS_STEPS];
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < nvec) v[k] = load_widen4<In, Out>(s + 4 * i, src_aligned);
        }
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < nvec) d4[i] = v[k];
        }
    }

    const int tail = len & 3;  // non-zero only in a fragment's last chunk
    if (t < tail) {
        const int i = (nvec << 2) + t;
        d[i] = is_fill ? fill : static_cast<Out>(s[i]);
    }
}

#define WS_KERNEL(name, In, Out)                                                      \
    extern "C" __global__ void __launch_bounds__(WS_THREADS)                          \
        name(const In* __restrict__ src, Out* __restrict__ dst,                       \
             const long long* __restrict__ table, int nfrag, Out fill) {             \
        widen_scatter_body<In, Out>(src, dst, table, nfrag, fill);                    \
    }

WS_KERNEL(widen_scatter_u8_i32, unsigned char, int)
WS_KERNEL(widen_scatter_u16_i32, unsigned short, int)
WS_KERNEL(widen_scatter_i32_i32, int, int)
WS_KERNEL(widen_scatter_f32_f32, float, float)
