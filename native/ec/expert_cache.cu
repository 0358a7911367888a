// Device side of the GPU expert cache (glm53/offload/cache.py): per-layer decode steps that decide hits,
// misses and admissions on the device, rewrite exllamav3's expert pointer tables, and copy admitted experts
// from the pinned host store into VRAM slots. No host synchronisation: every decision reads device memory.
//
// The library's structs, numbers and entry points are declared once, in expert_cache.h.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "../abi.h"
#include "expert_cache.h"

#define EC_THREADS 512

static thread_local char ec_last_error[512];

// Refuses a call for one of its arguments: the call returns cudaErrorInvalidValue and ec_error() names the argument.
static int ec_refuse(const char* function, const char* format, ...)
{
    const int n = snprintf(ec_last_error, sizeof ec_last_error, "%s: ", function);
    va_list args;
    va_start(args, format);
    vsnprintf(ec_last_error + n, sizeof ec_last_error - n, format, args);
    va_end(args);
    return (int) cudaErrorInvalidValue;
}

// What a call's CUDA work returned: 0, or the error, with CUDA's description of it for ec_error().
static int ec_result(const char* function, cudaError_t e)
{
    if (e != cudaSuccess)
        snprintf(ec_last_error, sizeof ec_last_error, "%s: %s (%s)", function, cudaGetErrorString(e), cudaGetErrorName(e));
    return (int) e;
}

#define EC_REQUIRE(ok, ...) do { if (!(ok)) return ec_refuse(__func__, __VA_ARGS__); } while (0)
// The cache state every kernel reads: present, and no more experts per layer than the kernels' shared arrays hold.
#define EC_REQUIRE_STATE(s) do { \
        EC_REQUIRE((s) != nullptr, "s is NULL"); \
        EC_REQUIRE((s)->num_experts >= 1 && (s)->num_experts <= EC_MAX_EXPERTS, \
                   "s->num_experts is %d, not in 1..%d (EC_MAX_EXPERTS)", (s)->num_experts, EC_MAX_EXPERTS); \
    } while (0)
#define EC_REQUIRE_LAYER(s, layer) EC_REQUIRE((layer) >= 0 && (layer) < (s)->num_layers, \
                                              "layer is %d, not in 0..%d (s->num_layers - 1)", (layer), (s)->num_layers - 1)

__device__ __forceinline__ void point_tables(const EcState& s, int layer, int e, int64_t base)
{
    int64_t* const* tabs = reinterpret_cast<int64_t* const*>(s.tables + layer * 4);
    int64_t g = base, u = base + s.off_up, d = base + s.off_down;
    tabs[0][e] = g;
    tabs[1][e] = u;
    tabs[2][e] = d;
    tabs[3][2 * e] = g;
    tabs[3][2 * e + 1] = u;
}

// Block-wide arg-extreme over values in shared memory; ties go to the lower index so runs are deterministic.
// want_max: largest value; otherwise smallest. Elements with ok == false are skipped. Returns -1 when none.
__device__ int block_arg_extreme(const float* v, const bool* ok, int n, bool want_max, float* red_v, int* red_i)
{
    int t = threadIdx.x;
    float best = want_max ? -INFINITY : INFINITY;
    int bi = -1;
    for (int i = t; i < n; i += blockDim.x) {
        if (!ok[i]) continue;
        float x = v[i];
        if (bi < 0 || (want_max ? x > best : x < best)) { best = x; bi = i; }
    }
    red_v[t] = best;
    red_i[t] = bi;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (t < stride) {
            float a = red_v[t], b = red_v[t + stride];
            int ia = red_i[t], ib = red_i[t + stride];
            bool take_b = ib >= 0 && (ia < 0 || (want_max ? b > a : b < a) || (b == a && ib < ia));
            if (take_b) { red_v[t] = b; red_i[t] = ib; }
        }
        __syncthreads();
    }
    int r = red_i[0];
    __syncthreads();
    return r;
}

// One decode step of one MoE layer: count the picks, update both scores and the layer's reuse lift (measured on the
// first `row` entries of sel, one stream), then admit up to max_admit missed experts whose score beats the weakest
// resident (not picked this step) by the hysteresis factor. Every float operation is an explicitly rounded
// intrinsic: the NumPy reference rounds after each one, and a fused multiply-add would not.
__global__ void __launch_bounds__(EC_THREADS) ec_step_kernel(EcState s, EcRecency rc, int layer, const int64_t* sel,
                                                             int n, int row, float decay, float hysteresis, int max_admit)
{
    __shared__ float f[EC_MAX_EXPERTS];
    __shared__ float r[EC_MAX_EXPERTS];
    __shared__ float score[EC_MAX_EXPERTS];
    __shared__ int cnt[EC_MAX_EXPERTS];
    __shared__ int slot[EC_MAX_EXPERTS];
    __shared__ bool cand[EC_MAX_EXPERTS];
    __shared__ bool vict[EC_MAX_EXPERTS];
    __shared__ bool first[EC_MAX_EXPERTS];
    __shared__ float red_v[EC_THREADS];
    __shared__ int red_i[EC_THREADS];
    __shared__ int hits, n_prev, again, now;
    __shared__ float weight;

    const int E = s.num_experts;
    const int t = threadIdx.x;
    float* freq = s.freq + (int64_t) layer * E;
    float* recent = rc.recent + (int64_t) layer * E;
    uint8_t* prev = rc.prev + (int64_t) layer * E;
    float* reuse = rc.reuse + 2 * layer;
    int32_t* slot_of = s.slot_of + (int64_t) layer * E;

    if (t == 0) { hits = 0; n_prev = 0; again = 0; now = 0; }
    for (int e = t; e < E; e += blockDim.x) {
        f[e] = __fmul_rn(freq[e], decay);
        r[e] = __fmul_rn(recent[e], rc.decay);
        cnt[e] = 0;
        first[e] = false;
        slot[e] = slot_of[e];
    }
    __syncthreads();
    for (int i = t; i < n; i += blockDim.x) {
        int64_t e = sel[i];
        if (e >= 0 && e < E) {
            atomicAdd(&cnt[e], 1);
            if (i < row) first[e] = true;
        }
    }
    __syncthreads();
    for (int e = t; e < E; e += blockDim.x) {
        int c = cnt[e];
        bool was = prev[e] != 0;
        if (c) {
            f[e] = __fadd_rn(f[e], (float) c);
            r[e] = __fadd_rn(r[e], (float) c);
            s.picks[(int64_t) layer * E + e] += c;
            if (slot[e] >= 0) atomicAdd(&hits, c);
        }
        if (first[e]) {
            atomicAdd(&now, 1);
            if (was) atomicAdd(&again, 1);
        }
        if (was) atomicAdd(&n_prev, 1);
        prev[e] = first[e];
        cand[e] = c > 0 && slot[e] < 0;
        vict[e] = c == 0 && slot[e] >= 0;
    }
    __syncthreads();
    if (t == 0) {
        float lift = reuse[0];
        if (n_prev > 0 && n_prev < E) {
            float rate = __fsub_rn(__fdiv_rn((float) again, (float) n_prev), __fdiv_rn((float) (now - again), (float) (E - n_prev)));
            lift = __fadd_rn(__fmul_rn(lift, rc.keep), __fmul_rn(__fsub_rn(1.0f, rc.keep), rate));
            reuse[0] = lift;
        }
        float excess = __fsub_rn(lift, reuse[1]);
        weight = __fmul_rn(rc.weight, excess > 0.0f ? excess : 0.0f);
    }
    __syncthreads();
    for (int e = t; e < E; e += blockDim.x) score[e] = __fadd_rn(f[e], __fmul_rn(weight, r[e]));
    __syncthreads();

    int admitted = 0;
    for (int k = 0; k < max_admit; ++k) {
        int c = block_arg_extreme(score, cand, E, true, red_v, red_i);
        if (c < 0) break;
        int v = block_arg_extreme(score, vict, E, false, red_v, red_i);
        if (v < 0) break;
        if (!(score[c] > __fmul_rn(hysteresis, score[v]))) break;
        if (t == 0) {
            int sl = slot[v];
            slot[v] = -1;
            slot[c] = sl;
            cand[c] = false;
            vict[v] = false;
            s.owner[sl] = layer * E + c;
            point_tables(s, layer, v, s.home[(int64_t) layer * E + v]);
            point_tables(s, layer, c, s.slot_addr[sl]);
            s.jobs[2 * k] = layer * E + c;
            s.jobs[2 * k + 1] = sl;
        }
        admitted = k + 1;
        __syncthreads();
    }

    for (int e = t; e < E; e += blockDim.x) { freq[e] = f[e]; recent[e] = r[e]; slot_of[e] = slot[e]; }
    if (t == 0) {
        int64_t* ctr = s.counters + (int64_t) layer * C_N;
        ctr[C_PICKS] += n;
        ctr[C_HITS] += hits;
        ctr[C_ADMITS] += admitted;
        ctr[C_EVICTS] += admitted;
        ctr[C_STEPS] += 1;
        *s.num_jobs = admitted;
    }
}

// Copy the blocks of the experts that ec_step admitted from the host store into their slots: a grid-stride
// 16-byte copy issued by the SMs (the number of jobs is only known on the device).
__global__ void ec_copy_kernel(EcState s, int64_t block_bytes)
{
    const int njobs = *s.num_jobs;
    if (njobs == 0) return;
    const int64_t vecs = block_bytes / 16;
    const int64_t total = vecs * njobs;
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t) gridDim.x * blockDim.x) {
        int j = (int) (i / vecs);
        int64_t off = i - (int64_t) j * vecs;
        int le = s.jobs[2 * j], sl = s.jobs[2 * j + 1];
        const int4* src = reinterpret_cast<const int4*>(s.home[le]);
        int4* dst = reinterpret_cast<int4*>(s.slot_addr[sl]);
        dst[off] = src[off];
    }
}

// Point experts at slots (or back home with slot -1) from a list: warm start, elastic restore and eviction.
// entries: [n, 3] (layer, expert, slot). Bytes are copied separately (by DMA: the host knows the addresses).
__global__ void ec_assign_kernel(EcState s, const int32_t* entries, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int layer = entries[3 * i], e = entries[3 * i + 1], sl = entries[3 * i + 2];
    int64_t le = (int64_t) layer * s.num_experts + e;
    int old = s.slot_of[le];
    if (sl >= 0) {
        s.slot_of[le] = sl;
        s.owner[sl] = (int) le;
        point_tables(s, layer, e, s.slot_addr[sl]);
    } else {
        s.slot_of[le] = -1;
        if (old >= 0) s.owner[old] = -1;
        point_tables(s, layer, e, s.home[le]);
    }
}

extern "C" {

const char* ec_error(void)
{
    return ec_last_error;
}

// row: the entries of sel's first row (its routing's top-k), on which the reuse lift is measured.
int ec_step(const EcState* s, const EcRecency* rc, int layer, const int64_t* sel, int n, int row, float decay,
            float hysteresis, int max_admit, int64_t block_bytes, int copy_blocks, cudaStream_t stream)
{
    EC_REQUIRE_STATE(s);
    EC_REQUIRE(rc != nullptr, "rc is NULL (the recency state)");
    EC_REQUIRE_LAYER(s, layer);
    EC_REQUIRE(n >= 0 && (n == 0 || sel != nullptr), "sel is %s with n %d (n must be >= 0, sel not NULL when n > 0)",
               sel ? "given" : "NULL", n);
    EC_REQUIRE(max_admit >= 0 && max_admit <= EC_MAX_ADMIT, "max_admit is %d, not in 0..%d (EC_MAX_ADMIT)", max_admit,
               EC_MAX_ADMIT);
    EC_REQUIRE(max_admit == 0 || copy_blocks >= 1, "copy_blocks is %d: the admissions' copy needs at least 1 block",
               copy_blocks);
    EC_REQUIRE(row >= 0 && (row <= n || n == 0), "row is %d, not in 0..n (n is %d)", row, n);
    ec_step_kernel<<<1, EC_THREADS, 0, stream>>>(*s, *rc, layer, sel, n, row, decay, hysteresis, max_admit);
    if (max_admit > 0) ec_copy_kernel<<<copy_blocks, 256, 0, stream>>>(*s, block_bytes);
    return ec_result(__func__, cudaGetLastError());
}

int ec_assign(const EcState* s, const int32_t* entries, int n, cudaStream_t stream)
{
    EC_REQUIRE_STATE(s);
    if (n <= 0) return 0;
    EC_REQUIRE(entries != nullptr, "entries is NULL with n %d", n);
    ec_assign_kernel<<<(n + 255) / 256, 256, 0, stream>>>(*s, entries, n);
    return ec_result(__func__, cudaGetLastError());
}

// SM-issued read of mapped host memory (the zero-copy path's bandwidth): sums 16-byte words into *out.
__global__ void read_probe_kernel(const int4* src, int64_t vecs, unsigned int* out)
{
    unsigned int acc = 0;
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += (int64_t) gridDim.x * blockDim.x) {
        int4 v = src[i];
        acc ^= (unsigned int) (v.x ^ v.y ^ v.z ^ v.w);
    }
    if (acc == 0x9e3779b9u) atomicAdd(out, 1u);  // keeps the loads alive
}

int ec_read_probe(const void* src, int64_t bytes, unsigned int* out, int blocks, cudaStream_t stream)
{
    EC_REQUIRE(src != nullptr && out != nullptr, "src and out must not be NULL (src %p, out %p)", src, (void*) out);
    EC_REQUIRE(bytes >= 0, "bytes is %lld, below 0", (long long) bytes);
    EC_REQUIRE(blocks >= 1, "blocks is %d, below 1", blocks);
    read_probe_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const int4*>(src), bytes / 16, out);
    return ec_result(__func__, cudaGetLastError());
}

}

// Predictive prefetch into a pool of VRAM slots (same library: it rewrites the same tables)
#include "prefetch.cuh"

// The CPU tier's handoff, device side (same library)
#include "cpu_tier_device.cuh"

// The in-band emulation of a slower host link, for measurements (same library)
#include "link_emulate.cuh"

// ec_abi, over every struct and number of expert_cache.h (generated from it by glm53/native/bindgen.py)
#include "expert_cache_abi.inc"
