// AVX2 + FMA + F16C: eight columns of one tile row per vector.
//
// Within a tile row r, the states of columns m and m + 8 (m = 0..7) are t = 32 m + b(r, h) with h = 0 or 1, so
// column m's window lies m K ring words after column 0's, at the same bit offset. Regrouping the tile's 8 K words
// "planar" (plane j, lane m = word K m + j, one gather per plane and tile) turns every row's window words into
// one plane rotated by a constant number of lanes, and the shift into a constant: two permutes and two shifts
// per eight weights, all fixed at compile time. (The rows are unrolled for that: the same loop reading its
// permutes and shifts from tables measured 15 to 40 % slower on Zen 4, at a third of the compile time.)
#include <immintrin.h>
#include <string.h>

#include "format.h"
#include "isa.h"

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

constexpr int MAX_ROWS = 8;
constexpr int PREFETCH_ROWS = 4;  // input tiles ahead

// A span's tiles of one input tile row, into L1 ahead of use.
inline void prefetch_span(const uint8_t* row, int bytes)
{
    for (int off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
}

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
BandFn pick_rows(int rows, int codebook)
{
    if constexpr (T > MAX_ROWS)
        return nullptr;
    else if (rows != T)
        return pick_rows<K, T + 1>(rows, codebook);
    else
        return codebook == GLM53_CE_CODEBOOK_INT16 ? &band_int16_kt<K, T>
               : codebook == GLM53_CE_CODEBOOK_FP16 ? &band_kt<K, T, true>
                                                    : &band_kt<K, T, false>;
}

template <int K = 1>
BandFn pick(int bits, int rows, int codebook)
{
    if constexpr (K > 8)
        return nullptr;
    else
        return bits == K ? pick_rows<K>(rows, codebook) : pick<K + 1>(bits, rows, codebook);
}

void band(const BandArgs& b) { pick(b.bits, b.rows, b.codebook)(b); }

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
