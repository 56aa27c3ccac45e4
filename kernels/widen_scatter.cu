// Widen + scatter: copy element ranges of a compact source into an int32
// (or float32) output, widening each element, in one launch for a whole plan.
//
// The host (kernels/cupy_backend.py) turns the plan into a table of
// fragments, 3 long longs each, in elements:
//   [0] source element offset from src (negative: a fill fragment)
//   [1] destination element offset from dst
//   [2] element count n (>= 0)
// followed by nfrag long longs: the first block index of each fragment.
// The source may be device memory or page-locked host memory mapped into
// the device's address space (zero-copy: the loads then cross PCIe).
//
// Every thread moves WS_STEPS groups of VEC = 16 / sizeof(In) elements per
// block: one 16-byte load each (16 uint8, 8 uint16 or 4 int32 elements) and
// VEC / 4 16-byte stores, all loads issued before any store. A block thus
// reads the same 16 * WS_STEPS * WS_THREADS source bytes whatever the dtype,
// so the per-block cost (finding the fragment) is spread over as many bytes
// for uint8 as for int32. A fragment's elements before its first 16-byte
// aligned destination element (its head, < 4) and after its last whole group
// (its tail, < VEC) are moved one by one. A source that is not 16-byte
// aligned where the destination is falls back to 4-byte loads (or 1- and
// 2-byte loads where even that is misaligned).
//
// Offsets are 64-bit (outputs pass 2^31 elements); the per-thread loop uses
// 32-bit indices within a chunk and never divides.

#ifndef WS_STEPS
#define WS_STEPS 4
#endif
#ifndef WS_THREADS
#define WS_THREADS 256
#endif
static_assert(WS_STEPS >= 1, "every thread moves at least one group");

template <typename T> struct Vec4;
template <> struct Vec4<int> { typedef int4 type; };
template <> struct Vec4<float> { typedef float4 type; };

// 16 source bytes seen as a vector, as 32-bit words, or as elements.
template <typename In> union Group {
    uint4 v;
    unsigned int w[4];
    In e[16 / sizeof(In)];
};

// Alignment of a fragment's grouped part in the source.
enum { SRC_ALIGN_16 = 0, SRC_ALIGN_4 = 1, SRC_ALIGN_ELEM = 2 };

template <typename In>
__device__ __forceinline__ void load_group(Group<In>& g, const In* __restrict__ p, int align) {
    constexpr int VEC = 16 / sizeof(In);
    if (align == SRC_ALIGN_16) {
        g.v = *reinterpret_cast<const uint4*>(p);
    } else if (align == SRC_ALIGN_4) {
        const unsigned int* q = reinterpret_cast<const unsigned int*>(p);
#pragma unroll
        for (int j = 0; j < 4; ++j) g.w[j] = q[j];
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) g.e[j] = p[j];
    }
}

template <typename In, typename Out>
__device__ __forceinline__ void widen_scatter_body(const unsigned char* __restrict__ src,
                                                   Out* __restrict__ dst,
                                                   const long long* __restrict__ table,
                                                   int nfrag, Out fill) {
    typedef typename Vec4<Out>::type Out4;
    constexpr int VEC = 16 / sizeof(In);  // elements per group
    constexpr int OUT_VECS = VEC / 4;     // 16-byte stores per group
    constexpr int CHUNK = WS_STEPS * WS_THREADS * VEC;
    const long long* __restrict__ first_block = table + 3LL * nfrag;
    const long long b = blockIdx.x;

    // The fragment of this block: the last one whose first block is <= b.
    int lo = 0, hi = nfrag - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_block[mid] <= b) lo = mid; else hi = mid - 1;
    }
    const long long* __restrict__ frag = table + 3LL * lo;
    const long long src_off = frag[0];
    const long long n = frag[2];
    const bool is_fill = src_off < 0;
    const long long chunk = b - first_block[lo];

    Out* __restrict__ d = dst + frag[1];
    const In* __restrict__ s = reinterpret_cast<const In*>(src) + (is_fill ? 0 : src_off);
    // Elements before the first 16-byte-aligned destination element.
    const long long to_aligned = ((16 - (reinterpret_cast<unsigned long long>(d) & 15)) & 15) / sizeof(Out);
    const int head = static_cast<int>(n < to_aligned ? n : to_aligned);
    const int t = threadIdx.x;
    if (chunk == 0 && t < head) {
        d[t] = is_fill ? fill : static_cast<Out>(s[t]);
    }

    // This block's part: [begin, begin + len) of the fragment; begin is
    // 16-byte aligned in dst. The host sizes the grid from n alone, so a
    // fragment may get one block more than its grouped part needs: len <= 0.
    const long long begin = head + chunk * CHUNK;
    const long long left = n - begin;
    const int len = left <= 0 ? 0 : (left < CHUNK ? static_cast<int>(left) : CHUNK);
    d += begin;
    s += begin;
    Out4* __restrict__ d4 = reinterpret_cast<Out4*>(d);
    const int ngroups = len / VEC;

    if (is_fill) {
        Out4 f4;
        f4.x = fill; f4.y = fill; f4.z = fill; f4.w = fill;
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < ngroups) {
#pragma unroll
                for (int j = 0; j < OUT_VECS; ++j) d4[i * OUT_VECS + j] = f4;
            }
        }
    } else {
        const unsigned long long addr = reinterpret_cast<unsigned long long>(s);
        const int align = (addr & 15) == 0 ? SRC_ALIGN_16 : ((addr & 3) == 0 ? SRC_ALIGN_4 : SRC_ALIGN_ELEM);
        // All loads first, then all stores: WS_STEPS 16-byte loads in flight per thread.
        Group<In> g[WS_STEPS];
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < ngroups) load_group<In>(g[k], s + i * VEC, align);
        }
#pragma unroll
        for (int k = 0; k < WS_STEPS; ++k) {
            const int i = t + k * WS_THREADS;
            if (i < ngroups) {
#pragma unroll
                for (int j = 0; j < OUT_VECS; ++j) {
                    Out4 o;
                    o.x = static_cast<Out>(g[k].e[4 * j]);
                    o.y = static_cast<Out>(g[k].e[4 * j + 1]);
                    o.z = static_cast<Out>(g[k].e[4 * j + 2]);
                    o.w = static_cast<Out>(g[k].e[4 * j + 3]);
                    d4[i * OUT_VECS + j] = o;
                }
            }
        }
    }

    const int tail = len - ngroups * VEC;  // non-zero only in a fragment's last chunk
    if (t < tail) {
        const int i = ngroups * VEC + t;
        d[i] = is_fill ? fill : static_cast<Out>(s[i]);
    }
}

#define WS_KERNEL(name, In, Out)                                                      \
    extern "C" __global__ void __launch_bounds__(WS_THREADS)                          \
        name(const unsigned char* __restrict__ src, Out* __restrict__ dst,            \
             const long long* __restrict__ table, int nfrag, Out fill) {             \
        widen_scatter_body<In, Out>(src, dst, table, nfrag, fill);                    \
    }

WS_KERNEL(widen_scatter_u8_i32, unsigned char, int)
WS_KERNEL(widen_scatter_u16_i32, unsigned short, int)
WS_KERNEL(widen_scatter_i32_i32, int, int)
WS_KERNEL(widen_scatter_f32_f32, float, float)
