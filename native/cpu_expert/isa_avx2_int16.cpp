// AVX2 + FMA: the INT16 codebook's band (format.h), eight columns of one tile row per vector (avx2_tiles.h).
#include <immintrin.h>
#include <string.h>

#include "avx2_tiles.h"

namespace glm53ce {
namespace {

// INT16 (format.h). Up to two rows: a row's byte-pair sums (two 16-bit lanes a column) times the rounded input in
// both lanes is s q in one multiply-add of 16-bit pairs; a block's sums of s q, less 510 Q_b (exact through the wrap-around),
// are I_b. Tiles add into `sums` in memory, flushed into the fp32 total at the end of every block.
template <int K, int T, int H0, int HI, int R>
inline void int_rows(const __m256i* planes, const int16_t* q, int q_stride, __m256i (*sums)[T])
{
    if constexpr (R < 16) {
        for (int h = 0; h < HI; ++h) {
            const __m256i states = h == 0 ? row_states<K, R, H0>(planes) : row_states<K, R, 1>(planes);
            const __m256i x = _mm256_mullo_epi32(states, _mm256_set1_epi32(static_cast<int>(MUL1_MULT)));
            const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi8(1));
            for (int t = 0; t < T; ++t)
                sums[h][t] = _mm256_add_epi32(sums[h][t], _mm256_madd_epi16(pairs, _mm256_set1_epi16(q[t * q_stride + R])));
        }
        int_rows<K, T, H0, HI, R + 1>(planes, q, q_stride, sums);
    }
}

// From three rows on, rows R and R + 1 go together: their byte sums s (at most 1020) packed as 16-bit pairs cost
// three operations, and then one multiply-add of pairs serves both rows of a token.
template <int K, int R, int H>
inline __m256i byte_sum(const __m256i* planes)
{
    const __m256i x = _mm256_mullo_epi32(row_states<K, R, H>(planes), _mm256_set1_epi32(static_cast<int>(MUL1_MULT)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(x, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
}

template <int K, int T, int H0, int HI, int R>
inline void int_row_pairs(const __m256i* planes, const int16_t* q, int q_stride, __m256i (*sums)[T])
{
    if constexpr (R < 16) {
        for (int h = 0; h < HI; ++h) {
            const __m256i low = h == 0 ? byte_sum<K, R, H0>(planes) : byte_sum<K, R, 1>(planes);
            const __m256i high = h == 0 ? byte_sum<K, R + 1, H0>(planes) : byte_sum<K, R + 1, 1>(planes);
            const __m256i pair = _mm256_or_si256(low, _mm256_slli_epi32(high, 16));
            for (int t = 0; t < T; ++t) {
                int32_t inputs;  // q[R] low, q[R + 1] high
                memcpy(&inputs, q + t * q_stride + R, sizeof inputs);
                sums[h][t] = _mm256_add_epi32(sums[h][t], _mm256_madd_epi16(pair, _mm256_set1_epi32(inputs)));
            }
        }
        int_row_pairs<K, T, H0, HI, R + 2>(planes, q, q_stride, sums);
    }
}

template <int K, int T, int H0, int HI>
inline void int_half_tile(const __m256i* planes, const int16_t* q, int q_stride, int32_t* sums_mem, int sums_stride)
{
    __m256i sums[HI][T];
    for (int h = 0; h < HI; ++h)
        for (int t = 0; t < T; ++t)
            sums[h][t] = _mm256_setzero_si256();
    if constexpr (T >= 3)
        int_row_pairs<K, T, H0, HI, 0>(planes, q, q_stride, sums);
    else
        int_rows<K, T, H0, HI, 0>(planes, q, q_stride, sums);
    for (int h = 0; h < HI; ++h)
        for (int t = 0; t < T; ++t) {
            __m256i* total = reinterpret_cast<__m256i*>(sums_mem + t * sums_stride + 8 * (H0 + h));
            _mm256_storeu_si256(total, _mm256_add_epi32(_mm256_loadu_si256(total), sums[h][t]));
        }
}

template <int K, int T>
void band_int16_kt(const BandArgs& b)
{
    constexpr int bytes = tile_bytes(K);
    constexpr int HI = halves_interleaved<T>();
    constexpr int SUMS_STRIDE = 16 * BAND_TILES;
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    const int blocks = b.tiles_k * 16 / QUANT_BLOCK, tiles_per_block = QUANT_BLOCK / 16;
    alignas(32) int32_t sums[T][SUMS_STRIDE] = {};
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < 16 * b.tiles; c += 8)
            _mm256_storeu_ps(b.acc + t * b.acc_stride + c, _mm256_setzero_ps());
    for (int kt = 0; kt < b.tiles_k; ++kt) {
        const uint8_t* row = first + kt * row_stride;
        if (kt + PREFETCH_ROWS < b.tiles_k)
            prefetch_span(row + PREFETCH_ROWS * row_stride, b.tiles * bytes);
        const int16_t* q = b.xq.q + kt * 16;
        for (int j = 0; j < b.tiles; ++j) {
            __m256i planes[K];
            load_planes<K>(row + j * bytes, planes);
            int_half_tile<K, T, 0, HI>(planes, q, b.x_stride, sums[0] + j * 16, SUMS_STRIDE);
            if constexpr (HI == 1)
                int_half_tile<K, T, 1, 1>(planes, q, b.x_stride, sums[0] + j * 16, SUMS_STRIDE);
        }
        if (kt % tiles_per_block == tiles_per_block - 1) {
            const int kb = kt / tiles_per_block;
            for (int t = 0; t < T; ++t) {
                const __m256i centre = _mm256_set1_epi32(MUL1_CENTER * b.xq.sum[t * blocks + kb]);
                const __m256 k = _mm256_set1_ps(b.xq.k[t * blocks + kb]);
                for (int c = 0; c < 16 * b.tiles; c += 8) {
                    __m256i* block = reinterpret_cast<__m256i*>(sums[t] + c);
                    float* total = b.acc + t * b.acc_stride + c;
                    const __m256 exact = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_load_si256(block), centre));
                    _mm256_storeu_ps(total, _mm256_fmadd_ps(exact, k, _mm256_loadu_ps(total)));
                    _mm256_store_si256(block, _mm256_setzero_si256());
                }
            }
        }
    }
    for (int t = 0; t < T; ++t) {
        const float offset = quantized_offset(b, t);
        for (int c = 0; c < 16 * b.tiles; c += 8) {
            float* total = b.acc + t * b.acc_stride + c;
            _mm256_storeu_ps(total, _mm256_add_ps(_mm256_loadu_ps(total), _mm256_set1_ps(offset)));
        }
    }
}

using BandFn = void (*)(const BandArgs&);

template <int K, int T = 1>
BandFn pick_rows(int rows)
{
    if constexpr (T > MAX_ROWS)
        return nullptr;
    else
        return rows == T ? &band_int16_kt<K, T> : pick_rows<K, T + 1>(rows);
}

template <int K = 1>
BandFn pick(int bits, int rows)
{
    if constexpr (K > 8)
        return nullptr;
    else
        return bits == K ? pick_rows<K>(rows) : pick<K + 1>(bits, rows);
}

}  // namespace

void band_int16_avx2(const BandArgs& b) { pick(b.bits, b.rows)(b); }

}  // namespace glm53ce
