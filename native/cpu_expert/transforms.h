// The element-wise side of an expert: Hadamard rotations, sign/scale vectors, the clamped SwiGLU. Plain C++ that
// each ISA's translation unit compiles with its own flags (the compiler vectorises it); the build forbids FMA
// contraction, so every variant rounds the same way. Before including this header a translation unit defines
// halves_to_floats(src, dst, n), an exact fp16 -> fp32 conversion, inside namespace glm53ce { namespace { } }.
#pragma once

#include <string.h>

#include "format.h"
#include "isa.h"

namespace glm53ce {
namespace {

constexpr int BLOCK = 128;
constexpr float OUT_SCALE = HAD_SCALE * MUL1_W_SCALE;  // 1/sqrt(128) / 2^18, exactly HAD_SCALE's bits scaled

template <int H>
inline void fwht_stage(float* v)
{
    for (int i = 0; i < BLOCK; i += 2 * H)
        for (int j = i; j < i + H; ++j) {
            const float a = v[j], b = v[j + H];
            v[j] = a + b;
            v[j + H] = a - b;
        }
}

// Unnormalised Sylvester-ordered Walsh-Hadamard transform of 128 values (exl3_reference.hadamard_128 @ v).
inline void fwht128(float* v)
{
    fwht_stage<1>(v);
    fwht_stage<2>(v);
    fwht_stage<4>(v);
    fwht_stage<8>(v);
    fwht_stage<16>(v);
    fwht_stage<32>(v);
    fwht_stage<64>(v);
}

inline float min_f(float a, float b) { return a < b ? a : b; }
inline float max_f(float a, float b) { return a > b ? a : b; }

// exp(z) for z in [-87, 88] to about 2 ulp: z = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor polynomial in r
// (truncation below 6e-9 relative), 2^n built from its exponent bits. Written out so that every variant
// computes it identically (libm's expf is not vectorised and differs between implementations).
inline float exp_f(float z)
{
    z = max_f(min_f(z, 88.0f), -87.0f);
    const float round_bias = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
    const float n = (z * 1.44269504088896341f + round_bias) - round_bias;
    const float r = (z - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 split so that n * hi is exact
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int>(n) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// min(silu(g), limit) * clamp(u, -limit, limit): exllamav3 1.6.5's act_limit for silu (act_gate in
// exl3_moe_coop_kernel.cuh, act_mul_kernel_* in activation_kernels.cuh). limit is +inf for no clamp.
inline float clamped_swiglu(float g, float u, float limit)
{
    const float silu = g / (1.0f + exp_f(-g));
    return min_f(silu, limit) * max_f(min_f(u, limit), -limit);
}

// v (a band sum, of W = 2^18 w) = svh * H(v) / 2^18 / sqrt(128)
inline void output_transform(float* v, const uint16_t* svh)
{
    float s[BLOCK];
    halves_to_floats(svh, s, BLOCK);
    fwht128(v);
    for (int i = 0; i < BLOCK; ++i)
        v[i] = v[i] * OUT_SCALE * s[i];
}

void rotate(const void* x, int x_fp16, int n, const uint16_t* suh, float* dst)
{
    for (int b = 0; b < n; b += BLOCK) {
        float s[BLOCK];
        float* v = dst + b;
        halves_to_floats(suh + b, s, BLOCK);
        if (x_fp16)
            halves_to_floats(static_cast<const uint16_t*>(x) + b, v, BLOCK);
        else
            memcpy(v, static_cast<const float*>(x) + b, sizeof(float) * BLOCK);
        for (int i = 0; i < BLOCK; ++i)
            v[i] = v[i] * s[i];
        fwht128(v);
        for (int i = 0; i < BLOCK; ++i)
            v[i] = v[i] * HAD_SCALE;
    }
}

void gate_up_block(float* g, float* u, const uint16_t* g_svh, const uint16_t* u_svh, const uint16_t* d_suh,
                   float limit, float* dst)
{
    output_transform(g, g_svh);
    output_transform(u, u_svh);
    float s[BLOCK];
    halves_to_floats(d_suh, s, BLOCK);
    for (int i = 0; i < BLOCK; ++i)
        dst[i] = clamped_swiglu(g[i], u[i], limit) * s[i];
    fwht128(dst);
    for (int i = 0; i < BLOCK; ++i)
        dst[i] = dst[i] * HAD_SCALE;
}

void out_block(float* y, const uint16_t* svh) { output_transform(y, svh); }

// format.h's INT16 rounding of one block. The nearest integer by the 1.5 * 2^23 trick (ties to even, |v * inv| <=
// 32767), so that every variant rounds alike. A block with a non-finite value gives NaN figures (the output is
// NaN, as the float paths' would be).
void quantize(const float* v, int16_t* q, float* k, float* offset, int32_t* sum)
{
    float m = 0.0f;
    for (int i = 0; i < QUANT_BLOCK; ++i) {
        const float a = v[i] < 0.0f ? -v[i] : v[i];
        m = a > m || a != a ? a : m;
    }
    if (!(m <= 3.4028234663852886e38f)) {  // inf or NaN
        memset(q, 0, sizeof(int16_t) * QUANT_BLOCK);
        *k = *offset = __builtin_nanf("");
        *sum = 0;
        return;
    }
    // below 1e-30 the block rounds to zero (and its 1 / m would overflow): at most 1e-30 off an element
    const float inv = m > 1e-30f ? QUANT_MAX / m : 0.0f, scale = m / QUANT_MAX;
    const float round_bias = 12582912.0f;
    int32_t total = 0;
    for (int i = 0; i < QUANT_BLOCK; ++i) {
        const float r = max_f(min_f((v[i] * inv + round_bias) - round_bias, QUANT_MAX), -QUANT_MAX);
        q[i] = static_cast<int16_t>(r);
        total += q[i];
    }
    *k = 1774.0f * scale;
    *offset = (static_cast<float>(total) * scale) * static_cast<float>(MUL1_CENTERED_OFFSET);
    *sum = total;
}

}  // namespace
}  // namespace glm53ce
