/* What the host codec's two files share: host_codec.c (unpacking, and which vector paths run) and
   host_pack.c (put's side: packing and whole-byte narrowing, each with its range check).

   The packed format is gputq/data/packing.py's (and unpack_scatter.cu's): a
   row of K IDs of `bits` bits (1..16) in ceil(K * bits / 8) bytes, least
   significant bit first. kernels/host_native.py builds both files into one
   library with the host's C compiler and falls back to numpy where there is
   none; kernels/reference.py stays the definition both are tested against.

   The vector paths are chosen at run time (the built library runs on any
   x86-64), and gputq_set_paths turns paths off for tests:
   - PATH_BMI2: eight IDs of up to 16 bits move as one group, narrowed into
     one 64-bit word (or two) and gathered into `bits * 8` packed bits by
     PEXT (scattered back by PDEP). Eight IDs are always whole bytes, so
     groups never share one.
   - PATH_VBMI: rows unpack sixteen IDs an instruction sequence (VPERMB).
   - PATH_AVX512: a tile's range check sixteen IDs an instruction, and
     whole-byte formats narrowed eight IDs at a time (VPMOVDB/VPMOVDW). */

#ifndef GPUTQ_HOST_CODEC_H
#define GPUTQ_HOST_CODEC_H

#include <stdint.h>
#include <string.h>

#define PATH_BMI2 1
#define PATH_VBMI 2
#define PATH_AVX512 4

/* Whether the vector path `path` (one PATH_*) runs: the CPU runs it well and gputq_set_paths allows it. */
int gputq_path_on(int path);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GROUPS 1  /* the vector paths are compiled */
#define BMI2 __attribute__((target("bmi2,sse4.1")))
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

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
static inline uint64_t lane_mask(int bits, int lane) {
    uint64_t m = 0;
    for (int i = 0; i < 64; i += lane) m |= ((1ull << bits) - 1ull) << i;
    return m;
}
#endif

/* Staging bytes [first, first + nbytes) where they lie in a mapped source's `nseg` segments (staging bytes
   [starts[j], starts[j] + lengths[j]) at host address addresses[j], `starts` ascending: a restore reading
   same-host arenas in place); NULL where no one segment holds them all. */
static inline const uint8_t* mapped_bytes(const int64_t* starts, const int64_t* addresses, const int64_t* lengths,
                                          int64_t nseg, int64_t first, int64_t nbytes) {
    int64_t lo = 0, hi = nseg;  /* the last segment starting at or before `first` */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= first) lo = mid; else hi = mid;
    }
    if (nseg == 0 || starts[lo] > first || first + nbytes > starts[lo] + lengths[lo]) return NULL;
    return (const uint8_t*)(intptr_t)(addresses[lo] + (first - starts[lo]));
}

#if defined(__SIZEOF_INT128__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define ROW_WORD 1  /* a row of up to 16 bytes is one 128-bit little-endian word: a shift and a mask an ID */
#endif

#endif
