// The C API: argument checks, ISA choice, and an expert call as five parallel phases over independent units:
//
//   rotate   (expert, gate|up, 128-block of hidden)  x rows * suh, Hadamard: the projections' rotated inputs
//                                                    (INT16: also rounded, format.h)
//   bands    (expert, gate|up, span of I)            the gate and up products with W_hat
//   act      (expert, 128-block of I)                output rotations, clamped SwiGLU, down's input rotation
//                                                    (INT16: and its rounding, the block being the rounding's)
//   down     (expert, span of the hidden)            the down product
//   sum      (128-block of the hidden)               down's output rotation, out += w * y, experts in list order
//
// A unit's result depends on nothing but its inputs, and every output block belongs to one unit, so neither the
// thread count nor the order in which threads take units changes a single bit. A span is 128 output columns (one
// Hadamard block) or, when a call has too few experts to keep every thread busy, a half or a quarter of one
// (spans_per_block): a column's sum is the same in any span, so this changes no bit either.
#include "cpu_expert.h"

#include <cpuid.h>
#include <math.h>
#include <sched.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../abi.h"
#include "format.h"
#include "isa.h"
#include "pool.h"

struct glm53_ce_pool {
    glm53ce::Pool* pool;
};

namespace glm53ce {
namespace {

thread_local std::string last_error;
thread_local std::vector<float> local_scratch;

int fail(int code, const std::string& message)
{
    last_error = message;
    return code;
}

bool has_f16c()
{
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}

bool detect(int isa)
{
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    switch (isa) {
    case GLM53_CE_ISA_SCALAR:
        return true;
    case GLM53_CE_ISA_AVX2:
        return avx2;
    case GLM53_CE_ISA_AVX512:
        return avx512;
    case GLM53_CE_ISA_AVX512VBMI:
        return avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("avx512vbmi2");
    default:
        return false;
    }
}

// Detected once: cpuid traps to the hypervisor in a virtual machine, microseconds per call.
bool isa_supported(int isa)
{
    static const unsigned supported = [] {
        unsigned mask = 0;
        for (int i = 0; i < GLM53_CE_ISA_COUNT; ++i)
            mask |= detect(i) ? 1u << i : 0u;
        return mask;
    }();
    return isa >= 0 && isa < GLM53_CE_ISA_COUNT && ((supported >> isa) & 1);
}

const char* const ISA_NAMES[GLM53_CE_ISA_COUNT] = {"scalar", "avx2", "avx512", "avx512vbmi"};
const IsaOps* const ISA_OPS[GLM53_CE_ISA_COUNT] = {&OPS_SCALAR, &OPS_AVX2, &OPS_AVX512, &OPS_AVX512VBMI};

int best_isa()
{
    for (int isa = GLM53_CE_ISA_COUNT - 1; isa > 0; --isa)
        if (isa_supported(isa))
            return isa;
    return GLM53_CE_ISA_SCALAR;
}

int resolve_isa(int isa, const IsaOps** ops)
{
    if (isa == GLM53_CE_ISA_BEST)
        isa = best_isa();
    if (isa < 0 || isa >= GLM53_CE_ISA_COUNT)
        return fail(GLM53_CE_EISA, "unknown ISA id " + std::to_string(isa));
    if (!isa_supported(isa))
        return fail(GLM53_CE_EISA, std::string("this CPU lacks the instructions of ISA ") + ISA_NAMES[isa]);
    *ops = ISA_OPS[isa];
    return GLM53_CE_OK;
}

std::string check_linear(const glm53_ce_linear& l, const std::string& name)
{
    if (!l.trellis || !l.suh || !l.svh)
        return name + ": null trellis, suh or svh";
    if (l.bits < 1 || l.bits > 8)
        return name + ": bits must be 1..8, got " + std::to_string(l.bits);
    if (l.in_features <= 0 || l.in_features % 128 || l.out_features <= 0 || l.out_features % 128)
        return name + ": in and out features must be positive multiples of 128, got " +
               std::to_string(l.in_features) + " x " + std::to_string(l.out_features);
    return "";
}

// The ISA's operations for a known codebook; an unknown codebook is refused.
int resolve_kernel(int isa, int codebook, const IsaOps** ops)
{
    if (codebook < 0 || codebook >= GLM53_CE_CODEBOOK_COUNT)
        return fail(GLM53_CE_EINVAL, "codebook must be GLM53_CE_CODEBOOK_FP16 (0), _FMA (1) or _INT16 (2), got " +
                                         std::to_string(codebook));
    return resolve_isa(isa, ops);
}

// Span `span` of l's output columns, BAND_TILES / spans_per_block tiles each, written to acc (rows of acc_stride)
// at those columns; xq: the input rows rounded (INT16).
BandArgs span_args(const glm53_ce_linear& l, int span, int spans_per_block, const float* x, const QuantizedRows& xq,
                   int rows, float* acc, int acc_stride, int codebook)
{
    const int tiles = BAND_TILES / spans_per_block;
    return BandArgs{reinterpret_cast<const uint8_t*>(l.trellis), l.bits, l.in_features / 16, l.out_features / 16,
                    span * tiles, tiles, x, l.in_features, rows, acc + span * tiles * 16, acc_stride, codebook, xq};
}

// INT16 scratch for `rows` rows of width n, carved from floats at `next` (advanced): the rounded values and the
// blocks' figures.
QuantizedRows carve_quantized(float*& next, int rows, int n)
{
    const size_t blocks = static_cast<size_t>(rows) * (n / QUANT_BLOCK);
    QuantizedRows q{reinterpret_cast<int16_t*>(next), next + static_cast<size_t>(rows) * n / 2, nullptr, nullptr};
    q.offset = q.k + blocks;
    q.sum = reinterpret_cast<int32_t*>(q.offset + blocks);
    next = reinterpret_cast<float*>(q.sum + blocks);
    return q;
}

size_t quantized_floats(int rows, int n) { return static_cast<size_t>(rows) * (n / 2 + 3 * (n / QUANT_BLOCK)); }

// Row i's blocks from column `col` on, `n` values, rounded (INT16); `width` is the row's full width.
void quantize_row(const IsaOps* ops, const float* v, const QuantizedRows& q, int i, int width, int col, int n)
{
    const size_t blocks = static_cast<size_t>(width / QUANT_BLOCK);
    for (int c = col; c < col + n; c += QUANT_BLOCK) {
        const size_t b = i * blocks + c / QUANT_BLOCK;
        ops->quantize(v + c, q.q + static_cast<size_t>(i) * width + c, q.k + b, q.offset + b, q.sum + b);
    }
}

// Spans per 128-column block (1, 2, 4 or 8 of its 16-column tiles) for a projection phase of `blocks` blocks: the
// fewest that give every thread `units` units (a phase waits for its slowest thread, and a thread that shares its
// core runs at about half speed, so a coarse last unit holds the whole job: a quarter block of a 4096-input
// projection holds 48 kB of 3-bit weights, an eighth 24 kB).
int spans_per_block(int blocks, int threads, int units)
{
    int spans = 1;
    while (spans < BAND_TILES && blocks * spans < units * threads)
        spans *= 2;
    return spans;
}

// One expert's share of a call: the tokens routed to it and its scratch rows.
struct Slot {
    const glm53_ce_expert* expert;
    int rows;
    int token[GLM53_CE_MAX_ROWS];
    float weight[GLM53_CE_MAX_ROWS];
    float* rotated[2];  // gate and up inputs [rows][hidden]
    float* gate_up[2];  // gate and up band sums [rows][intermediate]
    float* act;         // down input [rows][intermediate]
    float* y;           // down output [rows][hidden]
    QuantizedRows rotated_q[2], act_q;  // INT16: rotated and act rounded
};

constexpr int SCRATCH_ROWS_HIDDEN = 3;  // rotated[2], y
constexpr int SCRATCH_ROWS_INTER = 3;   // gate_up[2], act

struct Call {
    const IsaOps* ops;
    int codebook;  // GLM53_CE_CODEBOOK_*
    std::vector<Slot> slots;
    const uint8_t* x;
    int x_fp16;
    size_t x_row_bytes;
    int hidden;
    int inter;
    float limit;
    float* out;
    int spans;  // per 128-column block in the bands and down phases (spans_per_block)
};

// Unit (expert, gate|up, 128-block of the hidden): the rotation and its rounding are per block, so a one-expert
// call spreads over every thread instead of two.
void rotate_unit(void* ctx, int unit)
{
    const Call& call = *static_cast<const Call*>(ctx);
    const int blocks = call.hidden / 128;
    const Slot& s = call.slots[unit / (2 * blocks)];
    const int p = unit / blocks % 2, col = unit % blocks * 128;
    const glm53_ce_linear& lin = p ? s.expert->up : s.expert->gate;
    const size_t x_col_bytes = static_cast<size_t>(col) * (call.x_fp16 ? 2 : 4);
    for (int i = 0; i < s.rows; ++i) {
        float* rotated = s.rotated[p] + static_cast<size_t>(i) * call.hidden;
        call.ops->rotate(call.x + s.token[i] * call.x_row_bytes + x_col_bytes, call.x_fp16, 128, lin.suh + col, rotated + col);
        if (call.codebook == GLM53_CE_CODEBOOK_INT16)
            quantize_row(call.ops, rotated, s.rotated_q[p], i, call.hidden, col, 128);
    }
}

void band_unit(void* ctx, int unit)
{
    const Call& call = *static_cast<const Call*>(ctx);
    const int spans = call.inter / 128 * call.spans;
    const Slot& s = call.slots[unit / (2 * spans)];
    const int p = unit / spans % 2;
    const glm53_ce_linear& lin = p ? s.expert->up : s.expert->gate;
    call.ops->band(span_args(lin, unit % spans, call.spans, s.rotated[p], s.rotated_q[p], s.rows, s.gate_up[p],
                             call.inter, call.codebook));
}

void act_unit(void* ctx, int unit)
{
    const Call& call = *static_cast<const Call*>(ctx);
    const int blocks = call.inter / 128;
    const Slot& s = call.slots[unit / blocks];
    const glm53_ce_expert& e = *s.expert;
    const int col = unit % blocks * 128;
    for (int i = 0; i < s.rows; ++i) {
        const size_t row = static_cast<size_t>(i) * call.inter + col;
        call.ops->gate_up_block(s.gate_up[0] + row, s.gate_up[1] + row, e.gate.svh + col, e.up.svh + col,
                                e.down.suh + col, call.limit, s.act + row);
        if (call.codebook == GLM53_CE_CODEBOOK_INT16)
            quantize_row(call.ops, s.act + static_cast<size_t>(i) * call.inter, s.act_q, i, call.inter, col, 128);
    }
}

void down_unit(void* ctx, int unit)
{
    const Call& call = *static_cast<const Call*>(ctx);
    const int spans = call.hidden / 128 * call.spans;
    const Slot& s = call.slots[unit / spans];
    call.ops->band(span_args(s.expert->down, unit % spans, call.spans, s.act, s.act_q, s.rows, s.y, call.hidden,
                             call.codebook));
}

void sum_unit(void* ctx, int block)
{
    const Call& call = *static_cast<const Call*>(ctx);
    for (const Slot& s : call.slots)
        for (int i = 0; i < s.rows; ++i) {
            float* out = call.out + static_cast<size_t>(s.token[i]) * call.hidden + block * 128;
            float* y = s.y + static_cast<size_t>(i) * call.hidden + block * 128;
            call.ops->out_block(y, s.expert->down.svh + block * 128);
            for (int c = 0; c < 128; ++c)
                out[c] = out[c] + s.weight[i] * y[c];
        }
}

void run_units(Pool* pool, int units, Pool::UnitFn fn, void* ctx)
{
    if (pool) {
        pool->run(units, fn, ctx);
        return;
    }
    for (int u = 0; u < units; ++u)
        fn(ctx, u);
}

// Scratch of at least n floats; new memory is NaN so that a read before a write cannot pass unnoticed.
float* scratch(std::vector<float>& v, size_t n)
{
    if (v.size() < n)
        v.assign(n, NAN);
    return v.data();
}

std::string check_experts(const glm53_ce_expert* experts, int n_experts)
{
    const int hidden = experts[0].gate.in_features, inter = experts[0].gate.out_features;
    for (int i = 0; i < n_experts; ++i) {
        const glm53_ce_expert& e = experts[i];
        const std::string name = "expert " + std::to_string(i);
        const glm53_ce_linear* parts[3] = {&e.gate, &e.up, &e.down};
        const char* part_names[3] = {".gate", ".up", ".down"};
        for (int p = 0; p < 3; ++p) {
            const std::string problem = check_linear(*parts[p], name + part_names[p]);
            if (!problem.empty())
                return problem;
        }
        if (e.gate.in_features != hidden || e.up.in_features != hidden || e.down.out_features != hidden ||
            e.gate.out_features != inter || e.up.out_features != inter || e.down.in_features != inter)
            return name + ": gate and up must be " + std::to_string(hidden) + " -> " + std::to_string(inter) +
                   " and down the reverse (as expert 0)";
    }
    return "";
}

struct ReadJob {
    const uint8_t* buf;
    uint64_t bytes;
    int units;
    std::vector<uint64_t> sums;
};

void read_unit(void* ctx, int unit)
{
    ReadJob& job = *static_cast<ReadJob*>(ctx);
    const uint64_t words = job.bytes / 8;
    const uint64_t begin = words * unit / job.units, end = words * (unit + 1) / job.units;
    const uint64_t* p = reinterpret_cast<const uint64_t*>(job.buf);
    uint64_t a = 0, b = 0, c = 0, d = 0;
    uint64_t i = begin;
    for (; i + 4 <= end; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    for (; i < end; ++i)
        a += p[i];
    job.sums[unit] = a + b + c + d;
}

}  // namespace
}  // namespace glm53ce

using namespace glm53ce;

extern "C" {

const char* glm53_ce_error(void) { return last_error.c_str(); }

// glm53_ce_abi, over every struct and number of the header (generated from it by glm53/native/bindgen.py)
#include "cpu_expert_abi.inc"

const char* glm53_ce_isa_name(int32_t isa)
{
    return isa >= 0 && isa < GLM53_CE_ISA_COUNT ? ISA_NAMES[isa] : "";
}

int32_t glm53_ce_isa_supported(int32_t isa) { return isa_supported(isa) ? 1 : 0; }

int32_t glm53_ce_isa_best(void) { return best_isa(); }

glm53_ce_pool* glm53_ce_pool_start(const int32_t* cpus, int32_t n_cpus, int32_t threads, int32_t spin_us,
                                   int32_t units_per_thread)
{
    std::string refused;
    if (threads < 1)
        refused = "threads is " + std::to_string(threads) + ", below 1";
    else if (units_per_thread < 1)
        refused = "units_per_thread is " + std::to_string(units_per_thread) + ", below 1";
    else if (n_cpus < 0 || (n_cpus > 0 && !cpus))
        refused = "cpus is " + std::string(cpus ? "given" : "NULL") + " with n_cpus " + std::to_string(n_cpus) +
                  " (n_cpus >= 0, cpus not NULL when n_cpus > 0)";
    else if (spin_us < 0)
        refused = "spin_us is " + std::to_string(spin_us) + ", below 0";
    if (!refused.empty()) {
        fail(GLM53_CE_EINVAL, "pool: " + refused);
        return nullptr;
    }
    std::vector<int> cpu_list(cpus, cpus + n_cpus);
    for (int cpu : cpu_list)
        if (cpu < 0 || cpu >= CPU_SETSIZE) {
            fail(GLM53_CE_EINVAL, "pool: no CPU " + std::to_string(cpu));
            return nullptr;
        }
    std::string error;
    Pool* pool = Pool::start(cpu_list, threads, spin_us, error);
    if (!pool) {
        fail(GLM53_CE_ECPU, error);
        return nullptr;
    }
    pool->units_per_thread = units_per_thread;
    return new glm53_ce_pool{pool};
}

void glm53_ce_pool_stop(glm53_ce_pool* pool)
{
    if (!pool)
        return;
    delete pool->pool;
    delete pool;
}

int32_t glm53_ce_pool_threads(const glm53_ce_pool* pool) { return pool ? pool->pool->threads() : 0; }

int32_t glm53_ce_experts(glm53_ce_pool* pool, const glm53_ce_expert* experts, int32_t n_experts, const void* x,
                         int32_t x_fp16, int32_t rows, const float* weights, float act_limit, float* out, int32_t isa,
                         int32_t codebook)
{
    if (n_experts < 1)
        return fail(GLM53_CE_EINVAL, "experts: n_experts is " + std::to_string(n_experts) + ", below 1");
    if (!experts || !x || !weights || !out)
        return fail(GLM53_CE_EINVAL, std::string("experts: ") + (!experts ? "experts" : !x ? "x" : !weights ? "weights" : "out") +
                                         " is NULL");
    if (rows < 1 || rows > GLM53_CE_MAX_ROWS)
        return fail(GLM53_CE_EINVAL, "experts: rows must be 1.." + std::to_string(GLM53_CE_MAX_ROWS) + ", got " +
                                         std::to_string(rows));
    if (!(act_limit >= 0.0f))
        return fail(GLM53_CE_EINVAL, "experts: act_limit must be >= 0 (0: no clamp)");
    const std::string problem = check_experts(experts, n_experts);
    if (!problem.empty())
        return fail(GLM53_CE_EINVAL, problem);
    Call call;
    const int rc = resolve_kernel(isa, codebook, &call.ops);
    if (rc != GLM53_CE_OK)
        return rc;
    call.codebook = codebook;
    const bool quantized = codebook == GLM53_CE_CODEBOOK_INT16;
    call.hidden = experts[0].gate.in_features;
    call.inter = experts[0].gate.out_features;
    call.x = static_cast<const uint8_t*>(x);
    call.x_fp16 = x_fp16 ? 1 : 0;
    call.x_row_bytes = static_cast<size_t>(call.hidden) * (x_fp16 ? 2 : 4);
    call.limit = act_limit > 0.0f ? act_limit : INFINITY;
    call.out = out;

    size_t floats = 0;
    for (int i = 0; i < n_experts; ++i) {
        Slot s{};
        s.expert = &experts[i];
        for (int t = 0; t < rows; ++t)
            if (weights[i * rows + t] != 0.0f) {
                s.token[s.rows] = t;
                s.weight[s.rows++] = weights[i * rows + t];
            }
        if (s.rows) {
            call.slots.push_back(s);
            floats += static_cast<size_t>(s.rows) * (SCRATCH_ROWS_HIDDEN * call.hidden + SCRATCH_ROWS_INTER * call.inter);
            if (quantized)
                floats += 2 * quantized_floats(s.rows, call.hidden) + quantized_floats(s.rows, call.inter);
        }
    }
    if (call.slots.empty())
        return GLM53_CE_OK;

    Pool* workers = pool ? pool->pool : nullptr;
    std::unique_lock<std::mutex> lock;
    if (workers)
        lock = std::unique_lock<std::mutex>(workers->call_mutex());
    float* next = scratch(workers ? workers->scratch() : local_scratch, floats);
    for (Slot& s : call.slots) {
        const size_t hidden_rows = static_cast<size_t>(s.rows) * call.hidden;
        const size_t inter_rows = static_cast<size_t>(s.rows) * call.inter;
        s.rotated[0] = next, s.rotated[1] = next + hidden_rows, s.y = next + 2 * hidden_rows;
        next += SCRATCH_ROWS_HIDDEN * hidden_rows;
        s.gate_up[0] = next, s.gate_up[1] = next + inter_rows, s.act = next + 2 * inter_rows;
        next += SCRATCH_ROWS_INTER * inter_rows;
        if (quantized) {
            s.rotated_q[0] = carve_quantized(next, s.rows, call.hidden);
            s.rotated_q[1] = carve_quantized(next, s.rows, call.hidden);
            s.act_q = carve_quantized(next, s.rows, call.inter);
        }
    }
    const int n = static_cast<int>(call.slots.size());
    const int inter_blocks = call.inter / 128, hidden_blocks = call.hidden / 128;
    // the smaller of the two projection phases sets the spans (the caller takes part: threads + 1)
    call.spans = spans_per_block(std::min(2 * n * inter_blocks, n * hidden_blocks), workers ? workers->threads() + 1 : 1,
                                 workers ? workers->units_per_thread : 1);
    run_units(workers, 2 * n * hidden_blocks, rotate_unit, &call);
    run_units(workers, 2 * n * inter_blocks * call.spans, band_unit, &call);
    run_units(workers, n * inter_blocks, act_unit, &call);
    run_units(workers, n * hidden_blocks * call.spans, down_unit, &call);
    run_units(workers, hidden_blocks, sum_unit, &call);
    return GLM53_CE_OK;
}

int32_t glm53_ce_linear_forward(const glm53_ce_linear* linear, const float* x, int32_t rows, float* y, int32_t isa,
                                int32_t codebook)
{
    if (!linear || !x || !y)
        return fail(GLM53_CE_EINVAL, std::string("linear: ") + (!linear ? "linear" : !x ? "x" : "y") + " is NULL");
    if (rows < 1)
        return fail(GLM53_CE_EINVAL, "linear: rows is " + std::to_string(rows) + ", below 1");
    const std::string problem = check_linear(*linear, "linear");
    if (!problem.empty())
        return fail(GLM53_CE_EINVAL, problem);
    const IsaOps* ops = nullptr;
    const int rc = resolve_kernel(isa, codebook, &ops);
    if (rc != GLM53_CE_OK)
        return rc;
    const int n_in = linear->in_features, n_out = linear->out_features;
    const bool quantized = codebook == GLM53_CE_CODEBOOK_INT16;
    const size_t rotated_floats = static_cast<size_t>(GLM53_CE_MAX_ROWS) * n_in;
    float* rotated = scratch(local_scratch, rotated_floats + (quantized ? quantized_floats(GLM53_CE_MAX_ROWS, n_in) : 0));
    float* next = rotated + rotated_floats;
    const QuantizedRows xq = quantized ? carve_quantized(next, GLM53_CE_MAX_ROWS, n_in) : QuantizedRows{};
    for (int r0 = 0; r0 < rows; r0 += GLM53_CE_MAX_ROWS) {
        const int n = rows - r0 < GLM53_CE_MAX_ROWS ? rows - r0 : GLM53_CE_MAX_ROWS;
        float* yr = y + static_cast<size_t>(r0) * n_out;
        for (int i = 0; i < n; ++i) {
            float* row = rotated + static_cast<size_t>(i) * n_in;
            ops->rotate(x + static_cast<size_t>(r0 + i) * n_in, 0, n_in, linear->suh, row);
            if (quantized)
                quantize_row(ops, row, xq, i, n_in, 0, n_in);
        }
        for (int block = 0; block < n_out / 128; ++block) {
            ops->band(span_args(*linear, block, 1, rotated, xq, n, yr, n_out, codebook));
            for (int i = 0; i < n; ++i)
                ops->out_block(yr + static_cast<size_t>(i) * n_out + block * 128, linear->svh + block * 128);
        }
    }
    return GLM53_CE_OK;
}

int32_t glm53_ce_mul1_values(const uint16_t* states, int32_t n, float* out, int32_t isa, int32_t codebook)
{
    if (!states || !out)
        return fail(GLM53_CE_EINVAL, std::string("mul1_values: ") + (!states ? "states" : "out") + " is NULL");
    if (n < 0)
        return fail(GLM53_CE_EINVAL, "mul1_values: n is " + std::to_string(n) + ", below 0");
    const IsaOps* ops = nullptr;
    const int rc = resolve_kernel(isa, codebook, &ops);
    if (rc != GLM53_CE_OK)
        return rc;
    const bool fp16 = codebook == GLM53_CE_CODEBOOK_FP16;  // INT16's weights are FMA's
    constexpr int CHUNK = 256;  // a multiple of every variant's vector width
    uint16_t in[CHUNK];
    float values[CHUNK];
    for (int32_t i = 0; i < n; i += CHUNK) {
        const int m = n - i < CHUNK ? n - i : CHUNK;
        memset(in, 0, sizeof in);
        memcpy(in, states + i, sizeof(uint16_t) * m);
        ops->mul1_values(in, CHUNK, fp16, values);
        for (int j = 0; j < m; ++j)
            out[i + j] = values[j] * MUL1_W_SCALE;  // exact
    }
    return GLM53_CE_OK;
}

uint64_t glm53_ce_read_bytes(glm53_ce_pool* pool, const void* buf, uint64_t bytes)
{
    Pool* workers = pool ? pool->pool : nullptr;
    ReadJob job{static_cast<const uint8_t*>(buf), bytes, workers ? 8 * workers->threads() : 1, {}};
    job.sums.assign(job.units, 0);
    std::unique_lock<std::mutex> lock;
    if (workers)
        lock = std::unique_lock<std::mutex>(workers->call_mutex());
    run_units(workers, job.units, read_unit, &job);
    uint64_t sum = 0;
    for (uint64_t s : job.sums)
        sum += s;
    return sum;
}

}  // extern "C"
