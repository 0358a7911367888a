// The EXL3 tile format (mul1 codebook), as exllamav3 1.6.5 stores it and glm53/tools/synth/exl3_reference.py
// decodes it:
//
// - trellis[kt][nt] is one 16x16 tile of K-bit codes: 16 K uint16 words, read as 8 K little-endian uint32 words
//   that form a tail-biting bit ring, most significant bit first.
// - State t (0..255) is the 16-bit window of the ring ending at bit (t + 1) K; it is the weight at tile row r
//   (along the input) and column c (along the output) where t = state_of(r, c), the tensor-core fragment order.
// - mul1: x = state * 0x83DCD12D (mod 2^32), s = the sum of x's four bytes (0..1020); the weight w is the fp16
//   value exllamav3's GPU kernels compute from s (below), not the exact codebook (s - 510) * fp16(0x1eee).
//
// The GPU's mul1 weight, exllamav3 1.6.5 (exllamav3_ext/quant/codebook.cuh: decode_3inst<2> lines 86-99,
// decode_mul1_product_2 lines 36-52; exl3_gemv_kernel.cuh: decode_pair_cb2_dp4a_ lines 82-94, which the fused
// MoE decode kernels exl3_moe_coop_kernel.cuh reach through dq8_regs_{2,3,4}bits, lines 472-491, and
// dq_dispatch -> exl3_dq.cuh -> decode_3inst_2 for other widths; the GEMM, reconstruct and quantiser kernels
// call decode_3inst / decode_3inst_2 directly):
//   1. x = state * 0x83DCD12D, uint32 wrap-around (state < 2^16).
//   2. sum = __dp4a(x, 0x01010101, 0x6400): unsigned byte sum plus 0x6400, exact integer arithmetic.
//   3. h = the fp16 whose bits are the low 16 bits of sum: 0x6400 is 1024.0 and an fp16 in [1024, 2048) has
//      ulp 1, so h = 1024 + s exactly (s <= 1020 < 1024).
//   4. w = __hfma(h, fp16 0x1eee, fp16 0xc931): one fp16 fused multiply-add, rounded once to nearest-even.
//      0x1eee = 1774 / 2^18 (0.00676727...) and 0xc931 = -2721792 / 2^18 (-10.3828125), so the exact result is
//      N / 2^18 with N = (1024 + s) 1774 - 2721792 = 1774 s - 905216, and w = fp16_rne(N / 2^18).
// |N| >= 476 for every s, so w is a normal fp16 (>= 1.8e-3 in magnitude), never zero or subnormal. The exact
// codebook is 1774 (s - 510) / 2^18 = (1774 s - 904740) / 2^18: 0xc931 is not -1534 * 0x1eee (-10.3809967), so
// every GPU weight sits 476 / 2^18 (1.816e-3) below it before the rounding to fp16 (at most 2^-10, half an ulp
// of |w| in [2, 4)). exllamav3's CPU kernel (cpu/moe_mul1.cpp) and its int8 GEMV (exl3_gemv_int8_kernel.cuh,
// dense mul1 linears only) use other forms; its fused MoE decode, GEMV, GEMM and reconstruct kernels use this one.
//
// Everything here has internal linkage: the header is compiled into every ISA's translation unit, each with
// its own instruction-set flags, and no copy may leak into another through a shared (weak) symbol.
#pragma once

#include <stdint.h>

namespace glm53ce {
namespace {

constexpr uint32_t MUL1_MULT = 0x83DCD12Du;
constexpr int MUL1_MAX_SUM = 1020;
constexpr int32_t MUL1_N_OFFSET = -905216;  // N = 1774 s + MUL1_N_OFFSET

// How the kernel computes it. A projection works with W = 2^18 w, w the codebook value. Two codebooks
// (cpu_expert.h, GLM53_CE_CODEBOOK_*):
//   - FP16, the GPU's weight: W = fp16_rne(N / 2^18) 2^18, which is N rounded to 11 significant bits, ties to
//     even (an integer; in fp32 exactly);
//   - FMA, the GPU's fused multiply-add before that rounding: W = N. It differs from the fp16 weight by at most
//     half an fp16 ulp (relative RMS 2.1e-4 over the states, mean 3e-6 of the RMS: no bias) and saves the
//     rounding's three vector operations of the ten a weight costs at one token (the kernel is compute-bound).
// OUT_SCALE (transforms.h) takes the 2^18 back out, exactly, at the end. The vector paths form N as an fp32 (exact,
// |N| < 2^20):
//   - AVX2 and AVX-512: the byte sum's last step, a multiply-add of 16-bit pairs, multiplies by 1774 instead of 1;
//     add MUL1_N_OFFSET and convert.
//   - VBMI: vpdpbusd, starting from MUL1_SUM_BITS, leaves the bits of the float 2^23 + s; one fused multiply-add
//     (2^23 + s) 1774 + MUL1_SUM_OFFSET is N exactly (its one rounding has nothing to round).
// and for FP16 round it to 11 significant bits with Veltkamp's split, c = N * 8193, W = c - (c - N), which rounds
// to nearest with ties to even on every one of the 1021 values (tests/native check all 65536 states on every
// path). The scalar path reads a table built by mul1_gpu_weight (FP16) or converts N. fp16 conversions (vcvtps2ph, vcvtph2ps) do the same
// rounding but measured slower on Zen 4.
//
// INT16 keeps FMA's W = N and rounds the projection's input instead, per 128-block b of it (QUANT_BLOCK): q = the
// nearest integer to v * (32767 / m) with m the block's largest |v|, scale = m / 32767. With N = 1774 (s - 510) -
// 476 (MUL1_CENTERED_OFFSET), a column's product over the block is
//     sum_r N_r v_r ~ scale (1774 I_b - 476 Q_b),   I_b = sum_r (s_r - 510) q_r,  Q_b = sum_r q_r,
// where I_b is exact in int32 (|s - 510| <= 510, |q| <= 32767, 128 rows: at most 2.14e9 < 2^31). Every path forms
// I_b exactly (any order, even through int32 wrap-around, gives the same value), then adds I_b * (1774 scale) to
// its fp32 total with one fused multiply-add, blocks in input order, and finally the column-independent
// sum_b -476 scale Q_b, summed in block order. The rounding of v moves a projection by 2.3e-5 to 3.2e-5 relative RMS (normal inputs).
constexpr int32_t MUL1_SUM_BITS = 0x4B000000;  // the float 2^23
constexpr float MUL1_SUM_OFFSET = -(8388608.0f * 1774.0f) + static_cast<float>(MUL1_N_OFFSET);
static_assert(static_cast<double>(MUL1_SUM_OFFSET) == -(8388608.0 * 1774.0 + 905216.0), "not exact in fp32");
constexpr float MUL1_SPLIT = 8193.0f;  // 2^(24 - 11) + 1
constexpr int MUL1_CENTER = 510;             // s - 510: the exact codebook's zero
constexpr int32_t MUL1_CENTERED_OFFSET = -476;  // N = 1774 (s - 510) + MUL1_CENTERED_OFFSET
static_assert(MUL1_CENTERED_OFFSET == 1774 * MUL1_CENTER + MUL1_N_OFFSET, "N's two forms differ");
constexpr int QUANT_BLOCK = 128;             // INT16: inputs rounded with one scale per 128
constexpr float QUANT_MAX = 32767.0f;
constexpr float MUL1_W_SCALE = 1.0f / 262144.0f;  // w = W / 2^18
constexpr float HAD_SCALE = 0.0883883476483184405f;  // 1/sqrt(128), rounded to fp32
constexpr int BAND_TILES = 8;              // 128 output columns: one Hadamard block
constexpr int BAND_COLS = 16 * BAND_TILES;

constexpr int tile_bytes(int bits) { return 32 * bits; }
constexpr int ring_words(int bits) { return 8 * bits; }

// State at tile row r, column c: the inverse of exl3_reference.tc_perm.
constexpr int state_of(int r, int c)
{
    return 32 * (c % 8) + 4 * ((r & 7) & ~1) + 4 * (c / 8) + (r & 1) + 2 * (r >> 3);
}

// End of state t's window, one ring length on so that the window start stays positive.
constexpr int state_end(int bits, int t) { return (t + 1) * bits + 256 * bits; }

// Where a window lies in the ring of uint32 words: the words holding its first and last bit, and the right
// shift of (first << 32 | last) that brings the window to bits 15..0.
struct WordWindow {
    int first;
    int last;
    int shift;
};

constexpr WordWindow word_window(int bits, int t)
{
    const int end = state_end(bits, t);
    return WordWindow{((end - 16) >> 5) % ring_words(bits), ((end - 1) >> 5) % ring_words(bits),
                      (((end - 1) >> 5) + 1) * 32 - end};
}

// The ring's byte i in stream order (the most significant byte of word 0 first) sits at this memory offset.
constexpr int stream_byte(int bits, int i)
{
    const int j = i % tile_bytes(bits);
    return (j & ~3) + 3 - (j & 3);
}

inline uint32_t state_at(const uint32_t* ring, int bits, int t)
{
    const WordWindow w = word_window(bits, t);
    const uint64_t merged = (static_cast<uint64_t>(ring[w.first]) << 32) | ring[w.last];
    return static_cast<uint32_t>(merged >> w.shift) & 0xFFFFu;
}

// The byte sum s of state * MUL1_MULT.
inline int mul1_sum(uint32_t state)
{
    const uint32_t x = state * MUL1_MULT;
    return static_cast<int>((x & 255u) + ((x >> 8) & 255u) + ((x >> 16) & 255u) + (x >> 24));
}

// W = 2^18 w for byte sum s (above) in integer arithmetic: N rounded to 11 significant bits, ties to even (fp16's
// rounding of N / 2^18, always to a normal fp16), as a float (exact).
constexpr float mul1_gpu_weight(int s)
{
    const int32_t n = 1774 * s + MUL1_N_OFFSET;
    const uint32_t m = static_cast<uint32_t>(n < 0 ? -n : n);
    int bits = 0;
    while ((m >> bits) != 0)
        ++bits;
    uint32_t rounded = m;
    if (bits > 11) {
        const int drop = bits - 11;
        const uint32_t half = 1u << (drop - 1), rest = m & ((1u << drop) - 1);
        uint32_t q = m >> drop;
        if (rest > half || (rest == half && (q & 1u)))
            ++q;
        rounded = q << drop;
    }
    return n < 0 ? -static_cast<float>(rounded) : static_cast<float>(rounded);
}

// W for every byte sum, indexed by s.
struct Mul1Table {
    float weight[MUL1_MAX_SUM + 1];
};

constexpr Mul1Table make_mul1_table()
{
    Mul1Table tab{};
    for (int s = 0; s <= MUL1_MAX_SUM; ++s)
        tab.weight[s] = mul1_gpu_weight(s);
    return tab;
}

}  // namespace
}  // namespace glm53ce
