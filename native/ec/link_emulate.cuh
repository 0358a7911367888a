// In-band emulation of a slower host link, for measurements (glm53/offload/link.py, GLM53_LINK_EMULATE_GBS): each
// host-to-GPU transfer of B bytes is followed, on the stream that made it, by a GPU-side hold of B x (1/W_target -
// 1/W_measured), so that whatever waits for the transfer waits as long as it would on the slower link. Nothing else
// runs: no extra link, DRAM or host-core load. A zero-copy read (decode misses, admissions, prefetch copies, the CPU
// tier's inputs and results) is held by a grid like the read's own, whose blocks would have stalled on the link
// that long; a copy-engine transfer (prefill staging, the elastic loan's return) by one block on the copy's stream,
// so no SM that compute could use is taken. What was read is decided on the device (the bytes are known there
// only), by the same rule the kernels follow: an expert is read over the link when its layer's pointer table points
// at its block in the host store. Included by expert_cache.cu (one CUDA library).

#define LE_THREADS 128

__device__ __forceinline__ uint64_t le_now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Every block holds its SM slot for `ns` from its own start (the blocks of one launch start together); block 0 counts.
__device__ void le_hold(const LeLink& link, int kind, uint64_t bytes, double ns_per_byte)
{
    const uint64_t ns = (uint64_t) ((double) bytes * ns_per_byte);
    if (blockIdx.x == 0 && threadIdx.x == 0 && bytes) {
        atomicAdd(&link.counters[2 * kind], (unsigned long long) bytes);
        atomicAdd(&link.counters[2 * kind + 1], (unsigned long long) ns);
    }
    if (threadIdx.x == 0 && ns) {
        const uint64_t t0 = le_now_ns();
        while (le_now_ns() - t0 < ns) __nanosleep(200);
    }
    __syncthreads();
}

// Whether expert e of `layer` is read from the host store: its gate table entry is its home block's address.
__device__ __forceinline__ bool le_at_home(const EcState& s, int layer, int e)
{
    const int64_t* gate = reinterpret_cast<const int64_t*>(s.tables[layer * 4]);
    return gate[e] == s.home[(int64_t) layer * s.num_experts + e];
}

// The distinct experts of `layer` among the picks `sel` (int64 [n]) that the experts' kernels read from the host
// store: a pick of weight 0 (rw fp16 [n]; null: none is 0) is skipped by exllamav3's fused decode kernels, and an
// expert in a VRAM slot, a staging buffer or the prefetch pool is not at home. Each is read once (a lower bound where
// a prefill kernel reads an expert once per row tile).
__global__ void __launch_bounds__(LE_THREADS) le_picks_kernel(LeLink link, EcState s, int layer, const int64_t* sel,
                                                             const __half* rw, int n, int64_t block_bytes, int kind)
{
    __shared__ int picked[EC_MAX_EXPERTS];
    __shared__ int read;
    const int E = s.num_experts;
    for (int e = threadIdx.x; e < E; e += blockDim.x) picked[e] = 0;
    if (threadIdx.x == 0) read = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t e = sel[i];
        if (e >= 0 && e < E && (rw == nullptr || __half2float(rw[i]) != 0.0f)) picked[e] = 1;
    }
    __syncthreads();
    int mine = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) mine += picked[e] && le_at_home(s, layer, e);
    if (mine) atomicAdd(&read, mine);
    __syncthreads();
    le_hold(link, kind, (uint64_t) read * (uint64_t) block_bytes, link.zero_copy_ns_per_byte);
}

// The experts of `layer` with picks in count (int64 [E + 1], the last bin unread: ct_fallback_plan_kernel's) that are
// read from the host store: the CPU tier's GPU fallback.
__global__ void __launch_bounds__(LE_THREADS) le_counts_kernel(LeLink link, EcState s, int layer, const int64_t* count,
                                                              int64_t block_bytes, int kind)
{
    __shared__ int read;
    if (threadIdx.x == 0) read = 0;
    __syncthreads();
    int mine = 0;
    for (int e = threadIdx.x; e < s.num_experts; e += blockDim.x) mine += count[e] > 0 && le_at_home(s, layer, e);
    if (mine) atomicAdd(&read, mine);
    __syncthreads();
    le_hold(link, kind, (uint64_t) read * (uint64_t) block_bytes, link.zero_copy_ns_per_byte);
}

// fixed_bytes, plus units (int32 [1], device: admissions or prefetch copies made; null: none) x unit_bytes.
__global__ void __launch_bounds__(LE_THREADS) le_units_kernel(LeLink link, const int32_t* units, int64_t unit_bytes,
                                                             int64_t fixed_bytes, int copy_engine, int kind)
{
    const int64_t n = units == nullptr ? 0 : *units;
    le_hold(link, kind, (uint64_t) (fixed_bytes + n * unit_bytes), copy_engine ? link.copy_ns_per_byte : link.zero_copy_ns_per_byte);
}

// A CPU-tier job's traffic once collected: its input rows written (in_bytes) when it was published (status != 0), its
// fp32 partial read (out_bytes) when it was delivered (outcome CT_OUT_DONE).
__global__ void __launch_bounds__(LE_THREADS) le_tier_io_kernel(LeLink link, const int64_t* status, const int32_t* outcome,
                                                               int64_t in_bytes, int64_t out_bytes, int kind)
{
    const int64_t bytes = (*status != 0 ? in_bytes : 0) + (*outcome == CT_OUT_DONE ? out_bytes : 0);
    le_hold(link, kind, (uint64_t) bytes, link.zero_copy_ns_per_byte);
}

#define LE_REQUIRE_KIND(kind) EC_REQUIRE((kind) >= 0 && (kind) < LE_KINDS, "kind is %d, not in 0..%d (an le_kind)", (kind), \
                                         LE_KINDS - 1)
#define LE_REQUIRE_BLOCKS(blocks) EC_REQUIRE((blocks) >= 1, "blocks is %d, below 1", (blocks))

extern "C" {

int le_picks(const LeLink* link, const EcState* s, int layer, const int64_t* sel, const void* rw, int n,
             int64_t block_bytes, int kind, int blocks, cudaStream_t stream)
{
    EC_REQUIRE(link != nullptr, "link is NULL");
    EC_REQUIRE_STATE(s);
    EC_REQUIRE_LAYER(s, layer);
    LE_REQUIRE_KIND(kind);
    LE_REQUIRE_BLOCKS(blocks);
    EC_REQUIRE(n >= 0 && (n == 0 || sel != nullptr), "sel is %s with n %d", sel ? "given" : "NULL", n);
    le_picks_kernel<<<blocks, LE_THREADS, 0, stream>>>(*link, *s, layer, sel, static_cast<const __half*>(rw), n, block_bytes, kind);
    return ec_result(__func__, cudaGetLastError());
}

int le_counts(const LeLink* link, const EcState* s, int layer, const int64_t* count, int64_t block_bytes, int kind,
              int blocks, cudaStream_t stream)
{
    EC_REQUIRE(link != nullptr, "link is NULL");
    EC_REQUIRE_STATE(s);
    EC_REQUIRE_LAYER(s, layer);
    LE_REQUIRE_KIND(kind);
    LE_REQUIRE_BLOCKS(blocks);
    EC_REQUIRE(count != nullptr, "count is NULL");
    le_counts_kernel<<<blocks, LE_THREADS, 0, stream>>>(*link, *s, layer, count, block_bytes, kind);
    return ec_result(__func__, cudaGetLastError());
}

int le_units(const LeLink* link, const int32_t* units, int64_t unit_bytes, int64_t fixed_bytes, int copy_engine, int kind,
             int blocks, cudaStream_t stream)
{
    EC_REQUIRE(link != nullptr, "link is NULL");
    LE_REQUIRE_KIND(kind);
    LE_REQUIRE_BLOCKS(blocks);
    EC_REQUIRE(fixed_bytes >= 0, "fixed_bytes is %lld, below 0", (long long) fixed_bytes);
    EC_REQUIRE(unit_bytes >= 0, "unit_bytes is %lld, below 0", (long long) unit_bytes);
    le_units_kernel<<<blocks, LE_THREADS, 0, stream>>>(*link, units, unit_bytes, fixed_bytes, copy_engine, kind);
    return ec_result(__func__, cudaGetLastError());
}

int le_tier_io(const LeLink* link, const int64_t* status, const int32_t* outcome, int64_t in_bytes, int64_t out_bytes,
               int blocks, cudaStream_t stream)
{
    EC_REQUIRE(link != nullptr, "link is NULL");
    LE_REQUIRE_BLOCKS(blocks);
    EC_REQUIRE(status != nullptr && outcome != nullptr, "status and outcome must not be NULL (status %p, outcome %p)",
               (const void*) status, (const void*) outcome);
    EC_REQUIRE(in_bytes >= 0, "in_bytes is %lld, below 0", (long long) in_bytes);
    EC_REQUIRE(out_bytes >= 0, "out_bytes is %lld, below 0", (long long) out_bytes);
    le_tier_io_kernel<<<blocks, LE_THREADS, 0, stream>>>(*link, status, outcome, in_bytes, out_bytes, LE_TIER_IO);
    return ec_result(__func__, cudaGetLastError());
}

}
