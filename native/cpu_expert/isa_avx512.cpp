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

// The lanes of a 64-byte permute index that `keep` keeps, split by the ring register pair they read (K > 4).
constexpr void split_ring_halves(const uint8_t* index, uint64_t keep, uint64_t& low, uint64_t& high)
{
    for (int i = 0; i < 64; ++i)
        if ((keep >> i) & 1)
            (index[i] < 128 ? low : high) |= uint64_t(1) << i;
}

// The ring's bytes at `index` (zero where `keep` is clear): one permute for K <= 4 (a ring of up to 128 bytes),
// two for larger rings.
template <int K>
inline __m512i ring_bytes(const __m512i* ring, __m512i index, uint64_t keep, uint64_t low, uint64_t high)
{
    if constexpr (K <= 2)
        return _mm512_maskz_permutexvar_epi8(keep, index, ring[0]);
    else if constexpr (K <= 4)
        return _mm512_maskz_permutex2var_epi8(keep, ring[0], index, ring[1]);
    else
        return _mm512_or_si512(_mm512_maskz_permutex2var_epi8(low, ring[0], index, ring[1]),
                               _mm512_maskz_permutex2var_epi8(high, ring[2], index, ring[3]));
}

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
        split_ring_halves(tab.index[r], KEEP, tab.low[r], tab.high[r]);
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
    const __m512i bytes = ring_bytes<K>(ring, _mm512_load_si512(tab.index[R]), KEEP, tab.low[R], tab.high[R]);
    return _mm512_multishift_epi64_epi8(_mm512_load_si512(tab.control[R]), bytes);
}

// INT16: rows 2p and 2p + 1 of a column are windows K bits apart, both inside the four ring bytes from the first
// one's first byte. One byte permute gathers those four bytes a column, and two multishifts (the high bytes
// masked off) cut out the two states.
struct PairTables {
    alignas(64) uint8_t index[8][64];
    alignas(64) uint8_t control[8][2][64];
    uint64_t low[8];   // bytes from ring bytes 0..127 (K > 4 only)
    uint64_t high[8];  // bytes from ring bytes 128..255
};

constexpr uint64_t STATE_BYTES = 0x3333333333333333ull;  // bytes 0 and 1 of every dword

constexpr PairTables make_pair_tables(int bits)
{
    PairTables tab{};
    for (int p = 0; p < 8; ++p) {
        for (int c = 0; c < 16; ++c) {
            const int start = state_end(bits, state_of(2 * p, c)) - 16;
            const int first = start >> 3, offset = start & 7, base = 32 * (c & 1);
            for (int i = 0; i < 4; ++i)  // the dword is the four bytes in stream order from the high byte down
                tab.index[p][4 * c + i] = static_cast<uint8_t>(stream_byte(bits, first + 3 - i));
            for (int h = 0; h < 2; ++h) {
                uint8_t* control = tab.control[p][h] + 4 * c;
                control[0] = static_cast<uint8_t>(base + 16 - offset - h * bits);
                control[1] = static_cast<uint8_t>(base + 24 - offset - h * bits);
            }
        }
        split_ring_halves(tab.index[p], ~uint64_t(0), tab.low[p], tab.high[p]);
    }
    return tab;
}

template <int K>
struct PairTablesOf {
    static constexpr PairTables tab = make_pair_tables(K);
};

// s of rows 2p and 2p + 1, as 16-bit pairs (row 2p low): vpdpbusd from zero sums the bytes of each hash (510 Q_b
// comes off at the flush, as on every path).
template <int K>
inline __m512i row_pair_sums(const __m512i* ring, int p)
{
    const PairTables& tab = PairTablesOf<K>::tab;
    const __m512i bytes = ring_bytes<K>(ring, _mm512_load_si512(tab.index[p]), ~uint64_t(0), tab.low[p], tab.high[p]);
    __m512i sums[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i states = _mm512_maskz_multishift_epi64_epi8(STATE_BYTES, _mm512_load_si512(tab.control[p][h]), bytes);
        const __m512i x = _mm512_mullo_epi32(states, _mm512_set1_epi32(static_cast<int>(MUL1_MULT)));
        sums[h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_set1_epi8(1));
    }
    const __m512i interleave = _mm512_set_epi16(62, 30, 60, 28, 58, 26, 56, 24, 54, 22, 52, 20, 50, 18, 48, 16,
                                                46, 14, 44, 12, 42, 10, 40, 8, 38, 6, 36, 4, 34, 2, 32, 0);
    return _mm512_permutex2var_epi16(sums[0], interleave, sums[1]);
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

// INT16: a row's state hashes, and their byte sums s (at most 1020, one dword a column).
template <int K>
inline __m512i hash(const __m512i* ring, int R)
{
    return _mm512_mullo_epi32(row_states<K>(ring, R), _mm512_set1_epi32(static_cast<int>(MUL1_MULT)));
}

template <int K>
inline __m512i byte_sum(const __m512i* ring, int R)
{
    return _mm512_madd_epi16(_mm512_maddubs_epi16(hash<K>(ring, R), _mm512_set1_epi8(1)), _mm512_set1_epi16(1));
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

// Tiles j .. j + G - 1 of input tile row kt (row: its first tile in the span's trellis), added into the span's
// totals. A tile's sums do not depend on the group it is computed in, so G changes no bit.
template <int K, int T, bool FP16, int G>
__attribute__((always_inline)) inline void band_group(const BandArgs& b, const uint8_t* row, const float* x, int j)
{
    constexpr int bytes = tile_bytes(K);
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
            prefetch_span(row + PREFETCH_ROWS * row_stride, b.tiles * bytes);
        const float* x = b.x + kt * 16;
        int j = 0;
        for (; j + G <= b.tiles; j += G)
            band_group<K, T, FP16, G>(b, row, x, j);
        if (j < b.tiles)  // a one-tile span (spans_per_block 8): never a pair, which would write the next span's columns
            band_group<K, T, FP16, 1>(b, row, x, j);
    }
}

// INT16: tiles j .. j + G - 1 of input tile row kt (row: its first tile in the span's trellis; q: the row's rounded
// inputs) added into the block's integer sums.
template <int K, int T, int G>
__attribute__((always_inline)) inline void band_int16_group(const BandArgs& b, const uint8_t* row, const int16_t* q, int j,
                                                            int32_t (*sums)[16 * BAND_TILES])
{
    constexpr int bytes = tile_bytes(K);
    __m512i ring[G][4];
    __m512i tile_sums[G][T];
    for (int g = 0; g < G; ++g) {
        load_ring<K>(row + (j + g) * bytes, ring[g]);
        for (int t = 0; t < T; ++t)
            tile_sums[g][t] = _mm512_setzero_si512();
    }
#if GLM53_VBMI
#pragma GCC unroll 2
    for (int p = 0; p < 8; ++p)
        for (int g = 0; g < G; ++g) {
            const __m512i pair = row_pair_sums<K>(ring[g], p);
            for (int t = 0; t < T; ++t)  // the two rows' inputs, one dword broadcast from memory
                tile_sums[g][t] = _mm512_dpwssd_epi32(tile_sums[g][t], pair,
                                                      _mm512_broadcastd_epi32(_mm_loadu_si32(q + t * b.x_stride + 2 * p)));
        }
#else
    if constexpr (T >= 3) {
        // rows r and r + 1 together: their byte sums packed as 16-bit pairs, one multiply-add a token
#pragma GCC unroll 2
        for (int r = 0; r < 16; r += 2)
            for (int g = 0; g < G; ++g) {
                const __m512i pair = _mm512_or_si512(byte_sum<K>(ring[g], r), _mm512_slli_epi32(byte_sum<K>(ring[g], r + 1), 16));
                for (int t = 0; t < T; ++t) {
                    int32_t inputs;  // q[r] low, q[r + 1] high
                    memcpy(&inputs, q + t * b.x_stride + r, sizeof inputs);
                    tile_sums[g][t] = _mm512_add_epi32(tile_sums[g][t], _mm512_madd_epi16(pair, _mm512_set1_epi32(inputs)));
                }
            }
    } else {
#pragma GCC unroll 2
        for (int r = 0; r < 16; ++r)
            for (int g = 0; g < G; ++g) {
                const __m512i pairs = _mm512_maddubs_epi16(hash<K>(ring[g], r), _mm512_set1_epi8(1));
                for (int t = 0; t < T; ++t)
                    tile_sums[g][t] = _mm512_add_epi32(tile_sums[g][t],
                                                       _mm512_madd_epi16(pairs, _mm512_set1_epi16(q[t * b.x_stride + r])));
            }
    }
#endif
    for (int g = 0; g < G; ++g)
        for (int t = 0; t < T; ++t) {
            int32_t* total = sums[t] + (j + g) * 16;
            _mm512_store_si512(total, _mm512_add_epi32(_mm512_load_si512(total), tile_sums[g][t]));
        }
}

// INT16 (format.h). Tiles add into `sums` in memory, flushed into the fp32 total at the end of every block, less
// 510 Q_b there (exact through the int32 wrap-around). VBMI: a row pair's s as 16-bit pairs against the two rows'
// rounded inputs (one dword), one vpdpwssd a pair and token. Otherwise, up to two rows, a row's byte-pair sums
// against its input in both 16-bit lanes, one multiply-add of 16-bit pairs a row and token; from three rows on,
// two rows' byte sums packed as 16-bit pairs, one multiply-add a row pair and token.
template <int K, int T>
void band_int16_kt(const BandArgs& b)
{
    constexpr int bytes = tile_bytes(K);
    constexpr int G = tile_group<T>();
    constexpr int SUMS_STRIDE = 16 * BAND_TILES;
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    const int blocks = b.tiles_k * 16 / QUANT_BLOCK, tiles_per_block = QUANT_BLOCK / 16;
    alignas(64) int32_t sums[T][SUMS_STRIDE] = {};
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < 16 * b.tiles; c += 16)
            _mm512_storeu_ps(b.acc + t * b.acc_stride + c, _mm512_setzero_ps());
    for (int kt = 0; kt < b.tiles_k; ++kt) {
        const uint8_t* row = first + kt * row_stride;
        if (kt + PREFETCH_ROWS < b.tiles_k)
            prefetch_span(row + PREFETCH_ROWS * row_stride, b.tiles * bytes);
        const int16_t* q = b.xq.q + kt * 16;
        int j = 0;
        for (; j + G <= b.tiles; j += G)
            band_int16_group<K, T, G>(b, row, q, j, sums);
        if (j < b.tiles)  // a one-tile span: a pair would read the tile past it (past the trellis at its end)
            band_int16_group<K, T, 1>(b, row, q, j, sums);
        if (kt % tiles_per_block == tiles_per_block - 1) {
            const int kb = kt / tiles_per_block;
            for (int t = 0; t < T; ++t) {
                const __m512i centre = _mm512_set1_epi32(MUL1_CENTER * b.xq.sum[t * blocks + kb]);
                const __m512 k = _mm512_set1_ps(b.xq.k[t * blocks + kb]);
                for (int c = 0; c < 16 * b.tiles; c += 16) {
                    float* total = b.acc + t * b.acc_stride + c;
                    const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sums[t] + c), centre));
                    _mm512_storeu_ps(total, _mm512_fmadd_ps(exact, k, _mm512_loadu_ps(total)));
                    _mm512_store_si512(sums[t] + c, _mm512_setzero_si512());
                }
            }
        }
    }
    for (int t = 0; t < T; ++t) {
        const float offset = quantized_offset(b, t);
        for (int c = 0; c < 16 * b.tiles; c += 16) {
            float* total = b.acc + t * b.acc_stride + c;
            _mm512_storeu_ps(total, _mm512_add_ps(_mm512_loadu_ps(total), _mm512_set1_ps(offset)));
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
    for (int i = 0; i < n; i += 16) {
        const __m512i s = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(states + i)));
        _mm512_storeu_ps(dst + i, fp16 ? codebook<true>(s) : codebook<false>(s));
    }
}

}  // namespace

#if GLM53_VBMI
extern const IsaOps OPS_AVX512VBMI = {band, rotate, gate_up_block, out_block, mul1_values, quantize};
#else
extern const IsaOps OPS_AVX512 = {band, rotate, gate_up_block, out_block, mul1_values, quantize};
#endif

}  // namespace glm53ce
