// Predictive prefetch, device side (glm53/offload/prefetch.py; the policy written out in
// glm53/offload/prefetch_policy.py): after layer l's experts, the host predicts layer l+1's picks on a side stream
// and ec_prefetch copies the predicted experts that are not resident into a small pool of VRAM slots while layer
// l+1's attention runs (the link is idle then), pointing their table entries at the pool; the main stream waits for
// that before layer l+1's cache step, and ec_prefetch_release points them home again after layer l+1's experts ran.
// Only where bytes are read from changes, never the arithmetic. One pool serves every layer in turn: a layer's plan
// starts after the previous layer's release (the host orders the two streams). Included by expert_cache.cu.

// Points the pool's experts home again, unless the cache admitted one meanwhile (its entries are its slot's then),
// and frees the pool. Thread t handles slot t.
__device__ __forceinline__ void pool_release(const EcState& s, const EcPool& p, int n)
{
    const int t = threadIdx.x;
    if (t < n) {
        const int le = p.owner[t];
        if (le >= 0 && s.slot_of[le] < 0) point_tables(s, le / s.num_experts, le % s.num_experts, s.home[le]);
        p.owner[t] = -1;
    }
}

// Whether entry i of the prediction clears the threshold: float32 scores[i] >= min_score, as fill_pool compares
// (no scores: every entry clears; a NaN score never does).
__device__ __forceinline__ bool pf_clears(const float* scores, int64_t i, float min_score)
{
    return scores == nullptr || scores[i] >= min_score;
}

// One block: the plan of prefetch_policy.fill_pool for `layer` from `predicted` (int64 [rows, n_pred], each row
// best first) and its `scores` (float32 [rows, n_pred] or NULL): the predicted experts not resident in the cache
// whose score clears min_score, by the number of rows predicting them (more first), their best position in a row
// (lower first), their id (lower first), at most min(max_copies, slots); each is pointed at its pool slot (its
// bytes follow in ec_prefetch_copy_kernel, before anything reads the tables). max_copies is the layer's link
// budget (prefetch_policy.budget_copies). A pool left in use (a forward that stopped between a plan and its
// release) is released first.
__global__ void __launch_bounds__(EC_THREADS) ec_prefetch_plan_kernel(EcState s, EcPool p, int layer,
                                                                      const int64_t* predicted, const float* scores,
                                                                      int rows, int n_pred, float min_score,
                                                                      int max_copies)
{
    __shared__ float key[EC_MAX_EXPERTS];
    __shared__ int rows_of[EC_MAX_EXPERTS];
    __shared__ int best[EC_MAX_EXPERTS];
    __shared__ bool cand[EC_MAX_EXPERTS];
    __shared__ float red_v[EC_THREADS];
    __shared__ int red_i[EC_THREADS];

    const int E = s.num_experts, t = threadIdx.x;
    pool_release(s, p, *p.num);
    const int32_t* slot_of = s.slot_of + (int64_t) layer * E;
    for (int e = t; e < E; e += blockDim.x) { rows_of[e] = 0; best[e] = n_pred; }
    __syncthreads();
    // a repeat within a row counts once, at its best position that clears: the entry with no equal that clears
    // before it in its row
    for (int i = t; i < rows * n_pred; i += blockDim.x) {
        const int r = i / n_pred, pos = i % n_pred;
        const int64_t e = predicted[i];
        if (e < 0 || e >= E || !pf_clears(scores, i, min_score)) continue;
        bool first = true;
        for (int q = 0; q < pos; ++q) {
            const int64_t j = (int64_t) r * n_pred + q;
            first = first && !(predicted[j] == e && pf_clears(scores, j, min_score));
        }
        if (first) {
            atomicAdd(&rows_of[e], 1);
            atomicMin(&best[e], pos);
        }
    }
    __syncthreads();
    for (int e = t; e < E; e += blockDim.x) {
        cand[e] = rows_of[e] > 0 && slot_of[e] < 0;
        // more rows first, then the better position: exact in float (rows <= 8, n_pred <= 64)
        key[e] = (float) (rows_of[e] * (n_pred + 1) - best[e]);
    }
    __syncthreads();
    const int cap = max_copies < p.slots ? max_copies : p.slots;
    int n = 0;
    while (n < cap) {
        const int c = block_arg_extreme(key, cand, E, true, red_v, red_i);  // ties: the lower id
        if (c < 0) break;
        if (t == 0) {
            cand[c] = false;
            p.owner[n] = layer * E + c;
            point_tables(s, layer, c, p.slot_addr[n]);
        }
        ++n;
        __syncthreads();
    }
    if (t == 0) {
        *p.num = n;
        int64_t* ctr = p.counters + (int64_t) layer * PF_N;
        ctr[PF_COPIED] += n;
        ctr[PF_PLANS] += 1;
    }
}

// The planned experts' blocks from the host store into their pool slots: a grid-stride 16-byte copy by the SMs
// (the plan is only known on the device), as ec_copy_kernel does for admissions.
__global__ void ec_prefetch_copy_kernel(EcState s, EcPool p, int64_t block_bytes)
{
    const int n = *p.num;
    if (n == 0) return;
    const int64_t vecs = block_bytes / 16;
    const int64_t total = vecs * n;
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t) gridDim.x * blockDim.x) {
        const int j = (int) (i / vecs);
        const int64_t off = i - (int64_t) j * vecs;
        const int4* src = reinterpret_cast<const int4*>(s.home[p.owner[j]]);
        int4* dst = reinterpret_cast<int4*>(p.slot_addr[j]);
        dst[off] = src[off];
    }
}

// After the layer's experts: counts which pool experts its picks `sel` (int64 [n_sel]) used, points them home
// again (unless admitted) and frees the pool. One block of PF_MAX_SLOTS threads.
__global__ void ec_prefetch_release_kernel(EcState s, EcPool p, int layer, const int64_t* sel, int n_sel)
{
    __shared__ int used;
    const int t = threadIdx.x, n = *p.num;
    if (t == 0) used = 0;
    __syncthreads();
    if (t < n) {
        const int e = p.owner[t] - layer * s.num_experts;
        bool picked = false;
        for (int i = 0; i < n_sel; ++i) picked = picked || sel[i] == e;
        if (picked) atomicAdd(&used, 1);
    }
    __syncthreads();
    pool_release(s, p, n);
    if (t == 0) {
        int64_t* ctr = p.counters + (int64_t) layer * PF_N;
        ctr[PF_USED] += used;
        ctr[PF_WASTED] += n - used;
        *p.num = 0;
    }
}

extern "C" {

int ec_prefetch(const EcState* s, const EcPool* p, int layer, const int64_t* predicted, const float* scores, int rows,
                int n_pred, float min_score, int max_copies, int64_t block_bytes, int copy_blocks, cudaStream_t stream)
{
    EC_REQUIRE_STATE(s);
    EC_REQUIRE_LAYER(s, layer);
    EC_REQUIRE(p != nullptr, "p is NULL");
    EC_REQUIRE(p->slots >= 1 && p->slots <= PF_MAX_SLOTS, "p->slots is %d, not in 1..%d (PF_MAX_SLOTS)", p->slots,
               PF_MAX_SLOTS);
    EC_REQUIRE(n_pred >= 1 && n_pred <= PF_MAX_PREDICTED, "n_pred is %d, not in 1..%d (PF_MAX_PREDICTED)", n_pred,
               PF_MAX_PREDICTED);
    EC_REQUIRE(rows >= 1, "rows is %d, below 1", rows);
    EC_REQUIRE(predicted != nullptr, "predicted is NULL");
    EC_REQUIRE(max_copies >= 0, "max_copies is %d, below 0", max_copies);
    EC_REQUIRE(copy_blocks >= 1, "copy_blocks is %d, below 1", copy_blocks);
    ec_prefetch_plan_kernel<<<1, EC_THREADS, 0, stream>>>(*s, *p, layer, predicted, scores, rows, n_pred, min_score,
                                                          max_copies);
    ec_prefetch_copy_kernel<<<copy_blocks, 256, 0, stream>>>(*s, *p, block_bytes);
    return ec_result(__func__, cudaGetLastError());
}

int ec_prefetch_release(const EcState* s, const EcPool* p, int layer, const int64_t* sel, int n_sel, cudaStream_t stream)
{
    EC_REQUIRE_STATE(s);
    EC_REQUIRE_LAYER(s, layer);
    EC_REQUIRE(p != nullptr, "p is NULL");
    EC_REQUIRE(p->slots >= 1 && p->slots <= PF_MAX_SLOTS, "p->slots is %d, not in 1..%d (PF_MAX_SLOTS)", p->slots,
               PF_MAX_SLOTS);
    EC_REQUIRE(n_sel >= 0 && (n_sel == 0 || sel != nullptr), "sel is %s with n_sel %d", sel ? "given" : "NULL", n_sel);
    ec_prefetch_release_kernel<<<1, PF_MAX_SLOTS, 0, stream>>>(*s, *p, layer, sel, n_sel);
    return ec_result(__func__, cudaGetLastError());
}

}
