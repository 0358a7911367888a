/* The CPU tier's expert kernel: routed experts of an EXL3 (mul1 codebook) MoE layer computed on host cores.
 *
 * One projection (gate, up or down) is an EXL3 linear: per 128-wide block on each side,
 *     y = svh * H(H(suh * x) @ W_hat) / 128,
 * H the 128-point Sylvester Hadamard transform and W_hat the trellis decode (K bits per weight, K = 1..8). An
 * expert is out[t] += w[t] * down(min(silu(gate(x[t])), L) * clamp(up(x[t]), -L, L)), the clamp only when
 * act_limit L is nonzero (exllamav3's convention for GLM's swiglu_limit: the activated gate is clamped from
 * above, the up projection symmetrically). Everything is accumulated in fp32; results do not depend on the ISA
 * nor on the number of threads (bit for bit).
 *
 * Plain C ABI for ctypes. Functions return GLM53_CE_OK or a negative code; glm53_ce_error() then describes the
 * problem (per calling thread).
 */
#ifndef GLM53_CPU_EXPERT_H
#define GLM53_CPU_EXPERT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GLM53_CE_API __attribute__((visibility("default")))

enum glm53_ce_status {
    GLM53_CE_OK = 0,
    GLM53_CE_EINVAL = -1,  /* a bad argument: shapes, bits, rows, pointers */
    GLM53_CE_EISA = -2,    /* the ISA is unknown or this CPU lacks it */
    GLM53_CE_ENOMEM = -3,
    GLM53_CE_ECPU = -4,    /* a pool thread could not be pinned to its CPU */
};

enum glm53_ce_isa { GLM53_CE_ISA_BEST = -1, GLM53_CE_ISA_SCALAR = 0, GLM53_CE_ISA_AVX2 = 1, GLM53_CE_ISA_AVX512 = 2,
       GLM53_CE_ISA_AVX512VBMI = 3, GLM53_CE_ISA_COUNT = 4 };

enum { GLM53_CE_MAX_ROWS = 8 };  /* tokens per expert call */

/* How a weight and its products are computed (format.h). FP16: exllamav3's GPU kernels' fp16 weight, bit for bit,
 * against fp32 inputs. FMA: the same fused multiply-add before its rounding to fp16 (relative RMS 2.1e-4 from the
 * fp16 weights, no bias), three vector operations fewer of the ten a weight costs at one token. INT16: the FMA
 * weight against each projection input rounded to 16 bits per 128 (one scale a block), the products summed
 * exactly in integers per block: 2.3e-5 to 3.2e-5 relative RMS from FMA's result per projection (4e-5 to 5e-5
 * per expert output), and a third to a half fewer vector operations again where the CPU has AVX-512 VNNI. */
enum glm53_ce_codebook { GLM53_CE_CODEBOOK_FP16 = 0, GLM53_CE_CODEBOOK_FMA = 1, GLM53_CE_CODEBOOK_INT16 = 2, GLM53_CE_CODEBOOK_COUNT = 3 };

/* One EXL3 linear in the on-disk layout. in_features and out_features are multiples of 128. */
typedef struct glm53_ce_linear {
    const int16_t* trellis;  /* [in/16][out/16][16 * bits] */
    const uint16_t* suh;     /* fp16 [in] */
    const uint16_t* svh;     /* fp16 [out] */
    int32_t in_features;
    int32_t out_features;
    int32_t bits;
} glm53_ce_linear;

typedef struct glm53_ce_expert {
    glm53_ce_linear gate;    /* hidden -> intermediate */
    glm53_ce_linear up;      /* hidden -> intermediate */
    glm53_ce_linear down;    /* intermediate -> hidden */
} glm53_ce_expert;

typedef struct glm53_ce_pool glm53_ce_pool;

GLM53_CE_API const char* glm53_ce_error(void);
/* The sizes and field offsets of the structs above and the numbers of the enums, by name (../abi.h): what the
 * Python side checks its mirrors against when it loads the library. 0 when the name is known, else -1. */
GLM53_CE_API int32_t glm53_ce_abi(const char* name, int64_t* value);

GLM53_CE_API const char* glm53_ce_isa_name(int32_t isa);
GLM53_CE_API int32_t glm53_ce_isa_supported(int32_t isa);
GLM53_CE_API int32_t glm53_ce_isa_best(void);

/* Worker threads, thread i pinned to cpus[i % n_cpus] (no pinning when n_cpus is 0). Idle workers spin for
 * spin_us microseconds after their last job, then sleep on a futex. A thread that calls into the pool takes
 * part in the work and waits the same way. A call's projection phases are cut into at least units_per_thread
 * units a thread where the columns allow (finer units: a shorter wait for the slowest thread, more claims; no bit
 * changes). NULL on failure. */
GLM53_CE_API glm53_ce_pool* glm53_ce_pool_start(const int32_t* cpus, int32_t n_cpus, int32_t threads, int32_t spin_us,
                                                int32_t units_per_thread);
GLM53_CE_API void glm53_ce_pool_stop(glm53_ce_pool* pool);
GLM53_CE_API int32_t glm53_ce_pool_threads(const glm53_ce_pool* pool);

/* Routed experts for 1..8 tokens: out[t] += sum over e of weights[e * rows + t] * expert_e(x[t]). A token whose
 * weight for an expert is 0 is not computed for it. x: [rows][hidden], fp16 when x_fp16 else fp32. out: fp32
 * [rows][hidden]. Experts are added in list order. pool NULL runs on the calling thread. codebook: a
 * GLM53_CE_CODEBOOK_* value (the other functions take it likewise). */
GLM53_CE_API int32_t glm53_ce_experts(glm53_ce_pool* pool, const glm53_ce_expert* experts, int32_t n_experts,
                                      const void* x, int32_t x_fp16, int32_t rows, const float* weights,
                                      float act_limit, float* out, int32_t isa, int32_t codebook);

/* One projection, for comparisons: y[t] = x[t] @ W, x fp32 [rows][in], y fp32 [rows][out] (overwritten). */
GLM53_CE_API int32_t glm53_ce_linear_forward(const glm53_ce_linear* linear, const float* x, int32_t rows, float* y,
                                             int32_t isa, int32_t codebook);

/* The mul1 codebook value of n 16-bit states as the projections decode them with this ISA and codebook, as fp32
 * (see format.h). For tests. */
GLM53_CE_API int32_t glm53_ce_mul1_values(const uint16_t* states, int32_t n, float* out, int32_t isa, int32_t codebook);

/* Reads bytes of buf once, split over the pool's threads (or the calling thread): a DRAM bandwidth probe.
 * Returns a checksum so that the reads cannot be optimised away. */
GLM53_CE_API uint64_t glm53_ce_read_bytes(glm53_ce_pool* pool, const void* buf, uint64_t bytes);

#ifdef __cplusplus
}
#endif

#endif
