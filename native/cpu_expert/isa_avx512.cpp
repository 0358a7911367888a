// AVX-512: a whole tile row (16 columns) per vector. Built twice:
//
// - avx512 (F, BW, VL): the row's window words are picked from the tile's ring (two registers for K <= 4) with
//   one two-source dword permute each, for the first and last word of every window, then shifted together.
// - avx512vbmi (GLM53_VBMI; adds VBMI, VBMI2, VNNI): one byte permute gathers the three ring bytes under each
//   window, one multishift cuts the 16-bit window out of them, and one vpdpbusd forms the byte sum (as 2^23 + s).
//
// The permute indices, shifts and byte controls are per (bits, row) tables built at compile time.
#include <immintrin.h>
#include <string.h>

#include "format.h"
#include "isa.h"

namespace glm53ce {
namespace {

// maskz: GCC 12's _mm512_cvtph_ps reads an undefined register (a -Wuninitialized false positive)
void halves_to_floats(const uint16_t* src, float* dst, int n)
{
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
}

}  // namespace
}  // namespace glm53ce

#include "transforms.h"

namespace glm53ce {
namespace {

constexpr int MAX_ROWS = 8;
constexpr int PREFETCH_ROWS = 4;  // input tiles ahead

#if GLM53_VBMI

// Every dword lane takes three ring bytes (the window's, in stream order from the high byte down) and a zero
// byte; the multishift control then cuts bits 8 - o .. 23 - o (o the window's offset in its first byte).
constexpr uint64_t KEEP = 0x7777777777777777ull;  // byte 3 of every dword is zero

struct ByteTables {
    alignas(64) uint8_t index[16][64];
    alignas(64) uint8_t control[16][64];
    uint64_t low[16];   // bytes from ring bytes 0..127 (K > 4 only)
    uint64_t high[16];  // bytes from ring bytes 128..255
};

constexpr ByteTables make_tables(int bits)
{
    ByteTables tab{};
    for (int r = 0; r < 16; ++r) {
        for (int c = 0; c < 16; ++c) {
            const int start = state_end(bits, state_of(r, c)) - 16;
            const int first = start >> 3, offset = start & 7, base = 32 * (c & 1);
            uint8_t* index = tab.index[r] + 4 * c;
            uint8_t* control = tab.control[r] + 4 * c;
            index[0] = static_cast<uint8_t>(stream_byte(bits, first + 2));
            index[1] = static_cast<uint8_t>(stream_byte(bits, first + 1));
            index[2] = static_cast<uint8_t>(stream_byte(bits, first));
            control[0] = static_cast<uint8_t>(base + 8 - offset);
            control[1] = static_cast<uint8_t>(base + 16 - offset);
            control[2] = control[3] = static_cast<uint8_t>(base + 24);
        }
        for (int i = 0; i < 64; ++i)
            if ((KEEP >> i) & 1)
                (tab.index[r][i] < 128 ? tab.low[r] : tab.high[r]) |= uint64_t(1) << i;
    }
    return tab;
}

template <int K>
struct Tables {
    static constexpr ByteTables tab = make_tables(K);
};

template <int K>
inline __m512i row_states(const __m512i* ring, int R)
{
    const ByteTables& tab = Tables<K>::tab;
    const __m512i index = _mm512_load_si512(tab.index[R]);
    __m512i bytes;
    if constexpr (K <= 2)
        bytes = _mm512_maskz_permutexvar_epi8(KEEP, index, ring[0]);
    else if constexpr (K <= 4)
        bytes = _mm512_maskz_permutex2var_epi8(KEEP, ring[0], index, ring[1]);
    else
        bytes = _mm512_or_si512(_mm512_maskz_permutex2var_epi8(tab.low[R], ring[0], index, ring[1]),
                                _mm512_maskz_permutex2var_epi8(tab.high[R], ring[2], index, ring[3]));
    return _mm512_multishift_epi64_epi8(_mm512_load_si512(tab.control[R]), bytes);
}

// N = 1774 s - 905216 (format.h): the byte sum s as the float 2^23 + s, then one exact fused multiply-add
inline __m512 exact_n(__m512i states)
{
    const __m512i x = _mm512_mullo_epi32(states, _mm512_set1_epi32(static_cast<int>(MUL1_MULT)));
    const __m512i biased = _mm512_dpbusd_epi32(_mm512_set1_epi32(MUL1_SUM_BITS), x, _mm512_set1_epi8(1));
    return _mm512_fmadd_ps(_mm512_castsi512_ps(biased), _mm512_set1_ps(1774.0f), _mm512_set1_ps(MUL1_SUM_OFFSET));
}

#else

struct WordTables {
    alignas(64) int32_t first[16][16];
    alignas(64) int32_t last[16][16];
    alignas(64) int32_t right[16][16];  // shift of the last word
    alignas(64) int32_t left[16][16];   // shift of the first word (32: none)
    uint16_t first_high[16];            // lanes whose first word is ring word 32.. (K > 4 only)
    uint16_t last_high[16];
};

constexpr WordTables make_tables(int bits)
{
    WordTables tab{};
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
            const WordWindow w = word_window(bits, state_of(r, c));
            tab.first[r][c] = w.first;
            tab.last[r][c] = w.last;
            tab.right[r][c] = w.shift;
            tab.left[r][c] = 32 - w.shift;
            tab.first_high[r] |= static_cast<uint16_t>((w.first >= 32 ? 1 : 0) << c);
            tab.last_high[r] |= static_cast<uint16_t>((w.last >= 32 ? 1 : 0) << c);
        }
    return tab;
}

template <int K>
struct Tables {
    static constexpr WordTables tab = make_tables(K);
};

template <int K>
inline __m512i ring_words_at(const __m512i* ring, __m512i index, __mmask16 high)
{
    if constexpr (K <= 2)
        return _mm512_permutexvar_epi32(index, ring[0]);
    else if constexpr (K <= 4)
        return _mm512_permutex2var_epi32(ring[0], index, ring[1]);
    else
        return _mm512_or_si512(_mm512_maskz_permutex2var_epi32(static_cast<__mmask16>(~high), ring[0], index, ring[1]),
                               _mm512_maskz_permutex2var_epi32(high, ring[2], index, ring[3]));
}

template <int K>
inline __m512i row_states(const __m512i* ring, int R)
{
    const WordTables& tab = Tables<K>::tab;
    const __m512i first = ring_words_at<K>(ring, _mm512_load_si512(tab.first[R]), tab.first_high[R]);
    const __m512i last = ring_words_at<K>(ring, _mm512_load_si512(tab.last[R]), tab.last_high[R]);
    const __m512i right = _mm512_srlv_epi32(last, _mm512_load_si512(tab.right[R]));
    const __m512i left = _mm512_sllv_epi32(first, _mm512_load_si512(tab.left[R]));
    return _mm512_ternarylogic_epi32(right, left, _mm512_set1_epi32(0xFFFF), 0xA8);  // (right | left) & 0xFFFF
}

// N = 1774 s - 905216 (format.h): the byte sum's last step multiplies by 1774, then add and convert (exact)
inline __m512 exact_n(__m512i states)
{
    const __m512i x = _mm512_mullo_epi32(states, _mm512_set1_epi32(static_cast<int>(MUL1_MULT)));
    const __m512i pairs = _mm512_maddubs_epi16(x, _mm512_set1_epi8(1));
    const __m512i n1774 = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1774));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(n1774, _mm512_set1_epi32(MUL1_N_OFFSET)));
}

#endif

// W = 2^18 w (format.h). FP16: the GPU's codebook value, N rounded to 11 significant bits by Veltkamp's split;
// else N itself (three vector operations fewer of the ten a weight takes at one token).
template <bool FP16>
inline __m512 codebook(__m512i states)
{
    const __m512 exact = exact_n(states);
    if constexpr (!FP16)
        return exact;
    const __m512 split = _mm512_mul_ps(exact, _mm512_set1_ps(MUL1_SPLIT));
    return _mm512_sub_ps(split, _mm512_sub_ps(split, exact));
}

// The tile's bytes in one register per 64, the rest zero: both registers of a two-source permute are read.
template <int K>
inline void load_ring(const uint8_t* tile, __m512i* ring)
{
    constexpr int bytes = tile_bytes(K);
    for (int p = 0; p < (K <= 4 ? 2 : 4); ++p) {
        const int left = bytes - 64 * p;
        ring[p] = left >= 64 ? _mm512_loadu_si512(tile + 64 * p)
                  : left > 0 ? _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (left / 4)) - 1), tile + 64 * p)
                             : _mm512_setzero_si512();
    }
}

// Two tiles side by side for up to three rows: with one row, a tile's 16 multiply-adds are one dependent chain
// (four cycles each) and the decode would wait on it.
template <int T>
constexpr int tile_group() { return T <= 3 ? 2 : 1; }

template <int K, int T, bool FP16>
void band_kt(const BandArgs& b)
{
    constexpr int bytes = tile_bytes(K);
    constexpr int G = tile_group<T>();
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < 16 * b.tiles; c += 16)
            _mm512_storeu_ps(b.acc + t * b.acc_stride + c, _mm512_setzero_ps());
    for (int kt = 0; kt < b.tiles_k; ++kt) {
        const uint8_t* row = first + kt * row_stride;
        if (kt + PREFETCH_ROWS < b.tiles_k)
            for (int off = 0; off < b.tiles * bytes; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(row + PREFETCH_ROWS * row_stride + off), _MM_HINT_T0);
        const float* x = b.x + kt * 16;
        for (int j = 0; j < b.tiles; j += G) {
            __m512i ring[G][4];
            __m512 acc[G][T];  // this tile's sums
            for (int g = 0; g < G; ++g) {
                load_ring<K>(row + (j + g) * bytes, ring[g]);
                for (int t = 0; t < T; ++t)
                    acc[g][t] = _mm512_setzero_ps();
            }
#pragma GCC unroll 2
            for (int r = 0; r < 16; ++r)
                for (int g = 0; g < G; ++g) {
                    const __m512 w = codebook<FP16>(row_states<K>(ring[g], r));
                    for (int t = 0; t < T; ++t)
                        acc[g][t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[t * b.x_stride + r]), acc[g][t]);
                }
            for (int g = 0; g < G; ++g)
                for (int t = 0; t < T; ++t) {
                    float* total = b.acc + t * b.acc_stride + (j + g) * 16;
                    _mm512_storeu_ps(total, _mm512_add_ps(_mm512_loadu_ps(total), acc[g][t]));
                }
        }
    }
}

using BandFn = void (*)(const BandArgs&);

template <int K, int T = 1>
BandFn pick_rows(int rows, bool fp16)
{
    if constexpr (T > MAX_ROWS)
        return nullptr;
    else if (rows != T)
        return pick_rows<K, T + 1>(rows, fp16);
    else
        return fp16 ? &band_kt<K, T, true> : &band_kt<K, T, false>;
}

template <int K = 1>
BandFn pick(int bits, int rows, bool fp16)
{
    if constexpr (K > 8)
        return nullptr;
    else
        return bits == K ? pick_rows<K>(rows, fp16) : pick<K + 1>(bits, rows, fp16);
}

void band(const BandArgs& b) { pick(b.bits, b.rows, b.fp16_codebook)(b); }

void mul1_values(const uint16_t* states, int n, bool fp16, float* dst)
{
    for (int i = 0; i < n; i += 16) {
        const __m512i s = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(states + i)));
        _mm512_storeu_ps(dst + i, fp16 ? codebook<true>(s) : codebook<false>(s));
    }
}

}  // namespace

#if GLM53_VBMI
extern const IsaOps OPS_AVX512VBMI = {band, rotate, gate_up_block, out_block, mul1_values};
#else
extern const IsaOps OPS_AVX512 = {band, rotate, gate_up_block, out_block, mul1_values};
#endif

}  // namespace glm53ce
