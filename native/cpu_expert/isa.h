// What each instruction-set variant provides to the expert driver (expert.cpp). Every variant computes the same
// operations in the same order with fp32 roundings only, so that their results are identical bit for bit; they
// differ in speed only.
#pragma once

#include <stdint.h>
#include <xmmintrin.h>

#include "cpu_expert.h"
#include "format.h"

namespace glm53ce {

// A projection's input rows rounded for the INT16 codebook (format.h): row t's values at q + t * n and its
// 128-blocks' figures at k, offset and sum + t * (n / QUANT_BLOCK), n the projection's input width.
struct QuantizedRows {
    int16_t* q;
    float* k;        // 1774 scale
    float* offset;   // -476 scale Q_b
    int32_t* sum;    // Q_b
};

// A span of a projection: `tiles` tiles (an even number up to 8) of output columns from 16 * first_tile on, over
// all input tiles, for 1..8 rows. A column's sum does not depend on the span it is computed in. acc gets, per
// row and column, the sum over the input of x * W, W = 2^18 w with w the codebook value (format.h: the GPU's fp16
// weight, or its fused multiply-add before that rounding): the product with W_hat before its 2^-18 scale.
// FP16 and FMA: each 16-row tile is summed from zero with one fused multiply-add per weight, in row order, and
// added to the running total, tiles in input order. INT16: the product with the rounded input xq (format.h).
struct BandArgs {
    const uint8_t* trellis;  // tile (0, 0)
    int bits;
    int tiles_k;             // in_features / 16
    int tiles_n;             // out_features / 16
    int first_tile;          // output tile column
    int tiles;               // 1, 2, 4 or 8 (BAND_TILES / spans_per_block)
    const float* x;          // rotated input rows [rows][x_stride] (FP16, FMA)
    int x_stride;            // in_features
    int rows;
    float* acc;              // row 0, column 0 of the span in a [rows][acc_stride] buffer; 16 * tiles columns a row written
    int acc_stride;
    int codebook;            // GLM53_CE_CODEBOOK_*
    QuantizedRows xq;        // the input rows rounded (INT16)
};

namespace {

// A span's tiles of one input tile row, into L1 ahead of use (the vector variants' bands).
inline void prefetch_span(const uint8_t* row, int bytes)
{
    for (int off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
}

// INT16: the column-independent term of row t of a band, sum_b -476 scale Q_b, summed in block order (every
// variant adds it last).
inline float quantized_offset(const BandArgs& b, int t)
{
    const int blocks = b.tiles_k * 16 / QUANT_BLOCK;
    float offset = 0.0f;
    for (int kb = 0; kb < blocks; ++kb)
        offset = offset + b.xq.offset[t * blocks + kb];
    return offset;
}

}  // namespace

struct IsaOps {
    void (*band)(const BandArgs& args);
    // dst = H(x * suh) / sqrt(128) per 128-block, n elements; x fp16 when x_fp16, else fp32.
    void (*rotate)(const void* x, int x_fp16, int n, const uint16_t* suh, float* dst);
    // One 128-block of the intermediate: gate and up band sums (overwritten) to the down projection's rotated
    // input, H(min(silu(g), limit) * clamp(u, -limit, limit) * down_suh) / sqrt(128).
    void (*gate_up_block)(float* g, float* u, const uint16_t* g_svh, const uint16_t* u_svh, const uint16_t* d_suh,
                          float limit, float* dst);
    // One 128-block of a projection's output, in place: y = svh * H(band sum) * 2^-18 / sqrt(128).
    void (*out_block)(float* y, const uint16_t* svh);
    // W = 2^18 w of n states (n a multiple of 16) as band computes it with that codebook, for tests.
    void (*mul1_values)(const uint16_t* states, int n, bool fp16, float* dst);
    // One QUANT_BLOCK of a projection's input rounded for INT16 (format.h): q, and the block's k, offset and sum.
    void (*quantize)(const float* v, int16_t* q, float* k, float* offset, int32_t* sum);
};

extern const IsaOps OPS_SCALAR;
extern const IsaOps OPS_AVX2;
extern const IsaOps OPS_AVX512;
extern const IsaOps OPS_AVX512VBMI;

}  // namespace glm53ce
