// The reference variant: one weight at a time, straight from the format description. It defines the order of
// operations the vector variants reproduce: per output column and input tile, rows 0..15 summed from zero with
// one fused multiply-add per weight, then that tile's sum added to the running total, input tiles in order.
// (Summing per tile first divides the rounding error of a 4096-long sum by about three, for one add per tile.)
#include <string.h>

#include "format.h"
#include "isa.h"

namespace glm53ce {
namespace {

float half_to_float(uint16_t h)
{
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1Fu;
    const uint32_t mantissa = h & 0x3FFu;
    uint32_t bits;
    if (exponent == 0x1Fu) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
        const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24, exact
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void halves_to_floats(const uint16_t* src, float* dst, int n)
{
    for (int i = 0; i < n; ++i)
        dst[i] = half_to_float(src[i]);
}

}  // namespace
}  // namespace glm53ce

#include "transforms.h"

namespace glm53ce {
namespace {

constexpr Mul1Table MUL1_TABLE = make_mul1_table();

inline float codebook(uint32_t state, bool fp16)
{
    const int s = mul1_sum(state);
    return fp16 ? MUL1_TABLE.weight[s] : static_cast<float>(1774 * s + MUL1_N_OFFSET);  // exact: |N| < 2^20
}

// INT16 (format.h): per 128-row block, I_b = sum (s - 510) q exactly, then total = fma(I_b, k_b, total), blocks in
// order, and the offsets' sum (in block order) added last.
void band_int16(const BandArgs& b)
{
    const int bytes = tile_bytes(b.bits);
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    const int blocks = b.tiles_k * 16 / QUANT_BLOCK, tiles_per_block = QUANT_BLOCK / 16;
    for (int t = 0; t < b.rows; ++t)
        for (int c = 0; c < 16 * b.tiles; ++c)
            b.acc[t * b.acc_stride + c] = 0.0f;
    for (int kb = 0; kb < blocks; ++kb)
        for (int j = 0; j < b.tiles; ++j) {
            int32_t sums[GLM53_CE_MAX_ROWS][16] = {};
            for (int kt = kb * tiles_per_block; kt < (kb + 1) * tiles_per_block; ++kt) {
                uint32_t ring[8 * 8];
                memcpy(ring, first + kt * row_stride + j * bytes, bytes);
                for (int r = 0; r < 16; ++r)
                    for (int c = 0; c < 16; ++c) {
                        const int32_t centered = mul1_sum(state_at(ring, b.bits, state_of(r, c))) - MUL1_CENTER;
                        for (int t = 0; t < b.rows; ++t)
                            sums[t][c] += centered * b.xq.q[static_cast<size_t>(t) * b.x_stride + kt * 16 + r];
                    }
            }
            for (int t = 0; t < b.rows; ++t) {
                const float k = b.xq.k[t * blocks + kb];
                float* acc = b.acc + t * b.acc_stride + j * 16;
                for (int c = 0; c < 16; ++c)
                    acc[c] = __builtin_fmaf(static_cast<float>(sums[t][c]), k, acc[c]);
            }
        }
    for (int t = 0; t < b.rows; ++t) {
        const float offset = quantized_offset(b, t);
        for (int c = 0; c < 16 * b.tiles; ++c)
            b.acc[t * b.acc_stride + c] = b.acc[t * b.acc_stride + c] + offset;
    }
}

void band(const BandArgs& b)
{
    if (b.codebook == GLM53_CE_CODEBOOK_INT16) {
        band_int16(b);
        return;
    }
    const int bytes = tile_bytes(b.bits);
    const size_t row_stride = static_cast<size_t>(b.tiles_n) * bytes;
    const uint8_t* first = b.trellis + static_cast<size_t>(b.first_tile) * bytes;
    for (int t = 0; t < b.rows; ++t)
        for (int c = 0; c < 16 * b.tiles; ++c)
            b.acc[t * b.acc_stride + c] = 0.0f;
    for (int kt = 0; kt < b.tiles_k; ++kt)
        for (int j = 0; j < b.tiles; ++j) {
            uint32_t ring[8 * 8];
            memcpy(ring, first + kt * row_stride + j * bytes, bytes);
            float w[256];
            for (int r = 0; r < 16; ++r)
                for (int c = 0; c < 16; ++c)
                    w[r * 16 + c] = codebook(state_at(ring, b.bits, state_of(r, c)), b.codebook == GLM53_CE_CODEBOOK_FP16);
            for (int t = 0; t < b.rows; ++t) {
                float tile[16] = {};
                for (int r = 0; r < 16; ++r) {
                    const float x = b.x[t * b.x_stride + kt * 16 + r];
                    for (int c = 0; c < 16; ++c)
                        tile[c] = __builtin_fmaf(w[r * 16 + c], x, tile[c]);
                }
                float* acc = b.acc + t * b.acc_stride + j * 16;
                for (int c = 0; c < 16; ++c)
                    acc[c] = acc[c] + tile[c];
            }
        }
}

void mul1_values(const uint16_t* states, int n, bool fp16, float* dst)
{
    for (int i = 0; i < n; ++i)
        dst[i] = codebook(states[i], fp16);
}

}  // namespace

extern const IsaOps OPS_SCALAR = {band, rotate, gate_up_block, out_block, mul1_values, quantize};

}  // namespace glm53ce
