// AVX2 + FMA + F16C: eight columns of one tile row per vector (avx2_tiles.h). FP16 and FMA; INT16 is in
// isa_avx2_int16.cpp.
#include <immintrin.h>
#include <string.h>

#include "avx2_tiles.h"

namespace glm53ce {
namespace {

void halves_to_floats(const uint16_t* src, float* dst, int n)
{
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
}

}  // namespace
}  // namespace glm53ce

#include "transforms.h"

namespace glm53ce {
namespace {

// W = 2^18 w (format.h): N = 1774 s - 905216 from the byte sum's last step, converted (exact); FP16: the GPU's
// codebook value, N rounded to 11 significant bits by Veltkamp's split.
template <bool FP16>
inline __m256 codebook(__m256i states)
{
    const __m256i x = _mm256_mullo_epi32(states, _mm256_set1_epi32(static_cast<int>(MUL1_MULT)));
    const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi8(1));
    const __m256i n1774 = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1774));
    const __m256 exact = _mm256_cvtepi32_ps(_mm256_add_epi32(n1774, _mm256_set1_epi32(MUL1_N_OFFSET)));
    if constexpr (!FP16)
        return exact;
    const __m256 split = _mm256_mul_ps(exact, _mm256_set1_ps(MUL1_SPLIT));
    return _mm256_sub_ps(split, _mm256_sub_ps(split, exact));
}

// Rows R..15 of one tile, for column halves H0 .. H0 + HI - 1 (interleaved: independent chains of multiply-adds).
template <int K, int T, int H0, int HI, int R, bool FP16>
inline void rows(const __m256i* planes, const float* x, int x_stride, __m256 (*acc)[T])
{
    if constexpr (R < 16) {
        for (int h = 0; h < HI; ++h) {
            const __m256 w = codebook<FP16>(h == 0 ? row_states<K, R, H0>(planes) : row_states<K, R, 1>(planes));
            for (int t = 0; t < T; ++t)
                acc[h][t] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + t * x_stride + R), acc[h][t]);
        }
        rows<K, T, H0, HI, R + 1, FP16>(planes, x, x_stride, acc);
    }
}

template <int K, int T, int H0, int HI, bool FP16>
inline void half_tile(const __m256i* planes, const float* x, int x_stride, float* acc_mem, int acc_stride)
{
    __m256 acc[HI][T];  // this tile's sums
    for (int h = 0; h < HI; ++h)
        for (int t = 0; t < T; ++t)
            acc[h][t] = _mm256_setzero_ps();
    rows<K, T, H0, HI, 0, FP16>(planes, x, x_stride, acc);
    for (int h = 0; h < HI; ++h)
        for (int t = 0; t < T; ++t) {
            float* total = acc_mem + t * acc_stride + 8 * (H0 + h);
            _mm256_storeu_ps(total, _mm256_add_ps(_mm256_loadu_ps(total), acc[h][t]));
        }
}

template <int K, int T, bool FP16>
void band_kt(const BandArgs& b)
{
    constexpr int bytes = tile_bytes(K);
    constexpr int HI = halves_interleaved<T>();
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < 16 * b.tiles; c += 8)
            _mm256_storeu_ps(b.acc + t * b.acc_stride + c, _mm256_setzero_ps());
    for (int kt = 0; kt < b.tiles_k; ++kt) {
        const uint8_t* row = first + kt * row_stride;
        if (kt + PREFETCH_ROWS < b.tiles_k)
            prefetch_span(row + PREFETCH_ROWS * row_stride, b.tiles * bytes);
        const float* x = b.x + kt * 16;
        for (int j = 0; j < b.tiles; ++j) {
            __m256i planes[K];
            load_planes<K>(row + j * bytes, planes);
            half_tile<K, T, 0, HI, FP16>(planes, x, b.x_stride, b.acc + j * 16, b.acc_stride);
            if constexpr (HI == 1)
                half_tile<K, T, 1, 1, FP16>(planes, x, b.x_stride, b.acc + j * 16, b.acc_stride);
        }
    }
}

using BandFn = void (*)(const BandArgs&);

template <int K, int T = 1>
BandFn pick_rows(int rows, int codebook)
{
    if constexpr (T > MAX_ROWS)
        return nullptr;
    else if (rows != T)
        return pick_rows<K, T + 1>(rows, codebook);
    else
        return codebook == GLM53_CE_CODEBOOK_FP16 ? &band_kt<K, T, true> : &band_kt<K, T, false>;
}

template <int K = 1>
BandFn pick(int bits, int rows, int codebook)
{
    if constexpr (K > 8)
        return nullptr;
    else
        return bits == K ? pick_rows<K>(rows, codebook) : pick<K + 1>(bits, rows, codebook);
}

void band(const BandArgs& b)
{
    if (b.codebook == GLM53_CE_CODEBOOK_INT16)
        band_int16_avx2(b);
    else
        pick(b.bits, b.rows, b.codebook)(b);
}

void mul1_values(const uint16_t* states, int n, bool fp16, float* dst)
{
    for (int i = 0; i < n; i += 8) {
        const __m256i s = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(states + i)));
        _mm256_storeu_ps(dst + i, fp16 ? codebook<true>(s) : codebook<false>(s));
    }
}

}  // namespace

extern const IsaOps OPS_AVX2 = {band, rotate, gate_up_block, out_block, mul1_values, quantize};

}  // namespace glm53ce
