// The AVX2 variant's tile machinery, shared by its two translation units (isa_avx2.cpp: FP16 and FMA;
// isa_avx2_int16.cpp: INT16, apart so that the two compile in parallel). Internal linkage, as format.h.
//
// Within a tile row r, the states of columns m and m + 8 (m = 0..7) are t = 32 m + b(r, h) with h = 0 or 1, so
// column m's window lies m K ring words after column 0's, at the same bit offset. Regrouping the tile's 8 K words
// "planar" (plane j, lane m = word K m + j, one gather per plane and tile) turns every row's window words into
// one plane rotated by a constant number of lanes, and the shift into a constant: two permutes and two shifts
// per eight weights, all fixed at compile time. (The rows are unrolled for that: the same loop reading its
// permutes and shifts from tables measured 15 to 40 % slower on Zen 4, at a third of the compile time.)
#pragma once

#include <immintrin.h>

#include "format.h"
#include "isa.h"

namespace glm53ce {

// INT16's band (isa_avx2_int16.cpp).
void band_int16_avx2(const BandArgs& b);

namespace {

constexpr int MAX_ROWS = 8;
constexpr int PREFETCH_ROWS = 4;  // input tiles ahead

template <int Q>
inline __m256i rotate_lanes(__m256i v)
{
    if constexpr (Q == 0)
        return v;
    else
        return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(Q & 7, (Q + 1) & 7, (Q + 2) & 7, (Q + 3) & 7,
                                                                 (Q + 4) & 7, (Q + 5) & 7, (Q + 6) & 7, (Q + 7) & 7));
}

// The states of columns 8 h .. 8 h + 7 of tile row R.
template <int K, int R, int H>
inline __m256i row_states(const __m256i* planes)
{
    constexpr WordWindow w = word_window(K, state_of(R, 8 * H));
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i last = rotate_lanes<w.last / K>(planes[w.last % K]);
    if constexpr (w.shift == 0) {
        return _mm256_and_si256(last, low16);
    } else {
        const __m256i first = rotate_lanes<w.first / K>(planes[w.first % K]);
        const __m256i merged = _mm256_or_si256(_mm256_srli_epi32(last, w.shift), _mm256_slli_epi32(first, 32 - w.shift));
        return _mm256_and_si256(merged, low16);
    }
}

template <int K>
inline void load_planes(const uint8_t* tile, __m256i* planes)
{
    const int* words = reinterpret_cast<const int*>(tile);
    if constexpr (K == 1) {
        planes[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile));
    } else {
        const __m256i index = _mm256_setr_epi32(0, K, 2 * K, 3 * K, 4 * K, 5 * K, 6 * K, 7 * K);
        for (int j = 0; j < K; ++j)
            planes[j] = _mm256_i32gather_epi32(words + j, index, 4);
    }
}

// Up to two rows the two column halves of a tile run interleaved; more rows fill the registers on their own.
template <int T>
constexpr int halves_interleaved() { return T <= 2 ? 2 : 1; }

}  // namespace
}  // namespace glm53ce
