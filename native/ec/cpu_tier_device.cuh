// The GPU side of the CPU tier's handoff (native/cpu_tier/cpu_tier.h has the ring layout and the protocol): the GPU
// publishes a job into a ring slot in page-locked, mapped host memory, the host worker computes it in fp32, and the
// GPU waits for it with a deadline and adds the fp32 partial into an fp32 accumulator; past the deadline it takes
// the job back (JOB = TAKEN_BACK) and the caller computes it. Each word has one writer: the GPU writes JOB, the
// worker ACK (a GPU's atomics on host memory are not atomic against the CPU's over PCIe). Included by
// expert_cache.cu (one CUDA library). No host synchronisation: every decision reads memory on the device or over
// the link.

__device__ __forceinline__ uint64_t ct_load_acquire(const uint64_t* p)
{
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ct_store_release(uint64_t* p, uint64_t v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ct_now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ char* ct_slot(const CtRing& r, uint64_t seq)
{
    return r.base + r.slots_offset + (seq % r.slots) * r.slot_bytes;
}

// The producer may fill job seq's slot: never used, or the worker has finished with the job it last held there
// (its ACK carries that job's number in a final state). The caller has collected that job already.
__device__ __forceinline__ bool ct_slot_free(const CtRing& r, uint64_t seq)
{
    const char* slot = ct_slot(r, seq);
    uint64_t j = ct_load_acquire(reinterpret_cast<const uint64_t*>(slot));
    uint64_t a = ct_load_acquire(reinterpret_cast<const uint64_t*>(slot + CT_ACK));
    uint64_t as = a & 0xFF;
    return (j >> 8) == 0 || ((a >> 8) == (j >> 8) && (as == CT_DONE || as == CT_FAILED || as == CT_SKIPPED));
}

// The payload checksum's terms (cpu_tier.h, SUM) of one int4 of the rows: words w at global index at .. at + 3.
__device__ __forceinline__ unsigned long long ct_sum4(int4 v, uint64_t at)
{
    return (uint64_t) (uint32_t) v.x * (2 * at + 1) + (uint64_t) (uint32_t) v.y * (2 * at + 3) +
           (uint64_t) (uint32_t) v.z * (2 * at + 5) + (uint64_t) (uint32_t) v.w * (2 * at + 7);
}

// The block's last step of a publish: the T input rows into the slot (contiguous on both sides, row t at 2 * t *
// hidden bytes; hidden a multiple of 128), their checksum terms (after the pick_words words of picks, whose terms
// the caller has added to *sum, a __shared__ 0 at first), every writer's fence, then thread 0 writes SUM and
// releases JOB = PUBLISHED(seq).
__device__ void ct_publish_rows(const CtRing& r, uint64_t seq, const uint16_t* x, int n_tokens, int pick_words,
                                unsigned long long* sum, uint64_t* next_seq, int64_t* status, int64_t* counters)
{
    char* slot = ct_slot(r, seq);
    const int4* src_x = reinterpret_cast<const int4*>(x);
    int4* dst_x = reinterpret_cast<int4*>(slot + r.x_offset);
    const int vecs = n_tokens * (int) r.hidden / 8;
    unsigned long long part = 0;
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
        const int4 v = src_x[i];
        dst_x[i] = v;
        part += ct_sum4(v, (uint64_t) pick_words + 4 * (uint64_t) i);
    }
    atomicAdd(sum, part);
    __threadfence_system();  // this thread's payload stores, before JOB
    __syncthreads();
    if (threadIdx.x == 0) {
        *reinterpret_cast<uint64_t*>(slot + CT_SUM) = *sum + seq * CT_SUM_SEQ;
        ct_store_release(reinterpret_cast<uint64_t*>(slot), seq << 8 | CT_PUBLISHED);
        *next_seq = seq + 1;
        *status = (int64_t) seq;
        counters[CT_C_PUBLISHED] += 1;
    }
}

// One block. Publishes job *next_seq (layer, n_tokens rows of x, n_picks picks as int32 [n, 3]: token, expert,
// float bits of the weight) into its slot when that slot is free (JOB never used, or ACK final for JOB's job);
// *status = the job's number, or 0 when the slot was busy or the sizes do not fit (then nothing is published, no
// number is used, and the caller computes the job itself). n_picks == 0 publishes nothing either (status 0).
// The caller has collected the slot's previous job (DeviceProducer enforces it).
__global__ void ct_publish_kernel(CtRing r, uint64_t* next_seq, int layer, int n_tokens, const int32_t* picks,
                                  int n_picks, const uint16_t* x, int64_t* status, int64_t* counters)
{
    __shared__ uint64_t seq_s;
    __shared__ int ok;
    __shared__ unsigned long long sum;
    if (threadIdx.x == 0) {
        sum = 0;
        uint64_t seq = *next_seq;
        bool fits = n_picks > 0 && n_tokens >= 1 && (uint32_t) n_tokens <= r.max_tokens &&
                    (uint64_t) n_picks <= (uint64_t) r.max_tokens * r.max_picks;
        ok = fits && ct_slot_free(r, seq);
        seq_s = seq;
        if (!ok) {
            *status = 0;
            if (fits) counters[CT_C_BUSY] += 1;
        }
    }
    __syncthreads();
    if (!ok) return;
    char* slot = ct_slot(r, seq_s);
    if (threadIdx.x == 0) {
        uint32_t* head = reinterpret_cast<uint32_t*>(slot + 8);
        head[0] = (uint32_t) layer;
        head[1] = (uint32_t) n_tokens;
        head[2] = (uint32_t) n_picks;
    }
    int32_t* dst_p = reinterpret_cast<int32_t*>(slot + r.picks_offset);
    unsigned long long part = 0;
    for (int i = threadIdx.x; i < 3 * n_picks; i += blockDim.x) {
        dst_p[i] = picks[i];
        part += (uint64_t) (uint32_t) picks[i] * (2 * (uint64_t) i + 1);
    }
    atomicAdd(&sum, part);
    ct_publish_rows(r, seq_s, x, n_tokens, 3 * n_picks, &sum, next_seq, status, counters);
}

// One thread. Waits for job *status until timeout_ns have passed since it started waiting, then takes it back.
// *outcome: CT_OUT_DONE (the partial is in the slot), CT_OUT_FAILED (the worker refused the job; the caller
// computes it), CT_OUT_TAKEN_BACK_BEFORE_CLAIM (the worker had not claimed it: it will skip it) or
// CT_OUT_TAKEN_BACK_AFTER_CLAIM (it had: its result is discarded), or CT_OUT_NONE for status 0. In every case but DONE
// the job's experts were not computed by the host as far as the caller is concerned.
// With info (a split's int32 [4], info[2] the experts it sent), the wait is a stop-loss: at most per_expert_ns for
// each of the job's experts (what the GPU would take to compute them itself), at least floor_ns, never over
// timeout_ns: a late job then costs the GPU about what computing it on its own would have.
__global__ void ct_wait_kernel(CtRing r, const int64_t* status, int64_t timeout_ns, const int32_t* info,
                               int64_t per_expert_ns, int64_t floor_ns, int32_t* outcome, int64_t* counters)
{
    uint64_t seq = (uint64_t) *status;
    if (seq == 0) {
        *outcome = CT_OUT_NONE;
        return;
    }
    if (info != nullptr) {
        const int64_t loss = per_expert_ns * (int64_t) info[2];
        const int64_t bound = loss > floor_ns ? loss : floor_ns;
        timeout_ns = bound < timeout_ns ? bound : timeout_ns;
    }
    char* slot = ct_slot(r, seq);
    const uint64_t* ack = reinterpret_cast<const uint64_t*>(slot + CT_ACK);
    const uint64_t t0 = ct_now_ns();
    int result;
    unsigned int nap = 32;
    for (;;) {
        uint64_t a = ct_load_acquire(ack);
        if (a == (seq << 8 | CT_DONE)) { result = CT_OUT_DONE; break; }
        if (a == (seq << 8 | CT_FAILED)) { result = CT_OUT_FAILED; break; }
        if (ct_now_ns() - t0 >= (uint64_t) timeout_ns) {
            ct_store_release(reinterpret_cast<uint64_t*>(slot), seq << 8 | CT_TAKEN_BACK);
            asm volatile("fence.sc.sys;" ::: "memory");  // the store, then the load: a claim cannot be missed both ways
            a = ct_load_acquire(ack);
            uint64_t as = a & 0xFF;
            bool claimed = (a >> 8) == seq && (as == CT_CLAIMED || as == CT_DONE || as == CT_FAILED);
            result = claimed ? CT_OUT_TAKEN_BACK_AFTER_CLAIM : CT_OUT_TAKEN_BACK_BEFORE_CLAIM;
            break;
        }
        __nanosleep(nap);
        if (nap < 1024) nap *= 2;
    }
    *outcome = result;
    counters[CT_C_WAIT_NS] += (int64_t) (ct_now_ns() - t0);
    counters[result == CT_OUT_DONE ? CT_C_DONE : result == CT_OUT_FAILED ? CT_C_FAILED
             : result == CT_OUT_TAKEN_BACK_BEFORE_CLAIM ? CT_C_TAKEN_BACK_BEFORE_CLAIM : CT_C_TAKEN_BACK_AFTER_CLAIM] += 1;
}

// Grid-stride: when the job is DONE, acc[t][h] += the slot's fp32 out[t][h] for its n_tokens rows (uncached loads:
// the host wrote them). Runs after ct_wait_kernel on the same stream.
__global__ void ct_add_kernel(CtRing r, const int64_t* status, const int32_t* outcome, float* acc, int n_tokens)
{
    if (*outcome != CT_OUT_DONE) return;
    const float4* src = reinterpret_cast<const float4*>(ct_slot(r, (uint64_t) *status) + r.out_offset);
    float4* dst = reinterpret_cast<float4*>(acc);
    int vecs = n_tokens * (int) r.hidden / 4;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs; i += gridDim.x * blockDim.x) {
        float4 a = dst[i], b = __ldcv(src + i);
        dst[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
}

// One block of CT_SPLIT_MAX_PICKS threads, after a MoE layer's routing in a decode step (fast mode): splits the
// step's T * topk picks (sel int64, rw fp16 [T, topk], exllamav3's own routing tensors) into hits (the expert has a
// VRAM slot: slot_of[e] >= 0), misses the GPU reads over the link and cold misses for the CPU tier. How many of the
// step's distinct missed experts go to the CPU is table[T][hits][misses] (uint8 [table_tokens + 1][table_experts +
// 1][table_experts + 1], the cost model's, see glm53/cpu_tier/split.py), and they are the coldest (the lowest
// freq[e]; ties: the lower expert index). When the job is published, every pick of a cold expert is written to it
// (token, expert, the weight as the GPU reads it: __half2float) in pick order, with the T input rows y, and its
// weight in rw is set to 0, which exllamav3's fused decode kernels skip (a zero-weight slot is inactive and reads
// no weights); *status = the job's number. Otherwise (nothing cold, sizes out of the table, the slot busy) nothing
// changes and *status = 0. info (int32 [4]): hits, misses, experts sent, picks sent. record (int32 [CT_RECORD]):
// which picks were moved to the CPU, with their weights (see CT_RECORD).
// probe_k > 0 publishes a SHADOW job instead, to time the host while the table sends it nothing: the probe_k coldest
// misses with their picks, no weight zeroed (the GPU computes every pick as in exact mode), nothing in the record
// or in info[2..3], counted in CT_C_PROBES; nobody collects it (the worker's ACK frees its slot).
__global__ void __launch_bounds__(CT_SPLIT_MAX_PICKS) ct_split_publish_kernel(
    CtRing r, uint64_t* next_seq, int layer, int T, int topk, const int64_t* sel, __half* rw, const uint16_t* y,
    const int32_t* slot_of, const float* freq, const uint8_t* table, int table_tokens, int table_experts,
    int probe_k, int64_t* status, int64_t* counters, int32_t* info, int32_t* record)
{
    __shared__ int s_e[CT_SPLIT_MAX_PICKS], s_first[CT_SPLIT_MAX_PICKS], s_miss[CT_SPLIT_MAX_PICKS];
    __shared__ int s_cold[CT_SPLIT_MAX_PICKS], s_pos[CT_SPLIT_MAX_PICKS];
    __shared__ float s_f[CT_SPLIT_MAX_PICKS];
    __shared__ int s_k, s_publish, s_picks;
    __shared__ uint64_t s_seq;
    __shared__ unsigned long long s_sum;
    const int n = T * topk, p = threadIdx.x;
    if (p < n) s_e[p] = (int) sel[p];
    record[p] = -1;  // blockDim == CT_SPLIT_MAX_PICKS: every entry, also past n
    record[CT_SPLIT_MAX_PICKS + p] = 0;
    __syncthreads();
    if (p < n) {
        int e = s_e[p];
        bool first = true;
        for (int q = 0; q < p; ++q) first = first && s_e[q] != e;
        s_first[p] = first;
        s_miss[p] = slot_of[e] < 0;
        s_f[p] = freq[e];
    }
    __syncthreads();
    if (p == 0) {
        int hits = 0, misses = 0;
        for (int q = 0; q < n; ++q)
            if (s_first[q]) (s_miss[q] ? misses : hits) += 1;
        int k = 0;
        if (probe_k > 0)
            k = probe_k;
        else if (T >= 1 && T <= table_tokens && hits + misses <= table_experts)
            k = table[((int64_t) T * (table_experts + 1) + hits) * (table_experts + 1) + misses];
        s_k = k < misses ? k : misses;
        info[0] = hits;
        info[1] = misses;
    }
    __syncthreads();
    // the k coldest distinct missed experts, decided at each expert's first pick
    if (p < n) {
        int cold = 0;
        if (s_first[p] && s_miss[p]) {
            int rank = 0;
            for (int q = 0; q < n; ++q)
                if (s_first[q] && s_miss[q] && (s_f[q] < s_f[p] || (s_f[q] == s_f[p] && s_e[q] < s_e[p]))) ++rank;
            cold = rank < s_k;
        }
        s_cold[p] = cold;
    }
    __syncthreads();
    if (p < n && !s_first[p]) {  // a later pick of the same expert follows its first
        int q = 0;
        while (s_e[q] != s_e[p]) ++q;
        s_pos[p] = s_cold[q];
    } else if (p < n) {
        s_pos[p] = s_cold[p];
    }
    __syncthreads();
    if (p < n) s_cold[p] = s_pos[p];
    __syncthreads();
    if (p == 0) {
        int picks = 0;
        for (int q = 0; q < n; ++q) s_pos[q] = s_cold[q] ? picks++ : -1;
        s_picks = picks;
        uint64_t seq = *next_seq;
        bool fits = T <= (int) r.max_tokens && (uint64_t) picks <= (uint64_t) r.max_tokens * r.max_picks;
        s_publish = picks > 0 && fits && ct_slot_free(r, seq);
        s_seq = seq;
        s_sum = 0;
        if (!s_publish) {
            *status = 0;
            if (picks > 0) counters[CT_C_BUSY] += 1;
        }
        const bool real = s_publish && probe_k <= 0;
        info[2] = real ? s_k : 0;
        info[3] = real ? picks : 0;
        if (s_publish && !real) counters[CT_C_PROBES] += 1;
    }
    __syncthreads();
    if (!s_publish) return;
    char* slot = ct_slot(r, s_seq);
    if (p == 0) {
        uint32_t* head = reinterpret_cast<uint32_t*>(slot + 8);
        head[0] = (uint32_t) layer;
        head[1] = (uint32_t) T;
        head[2] = (uint32_t) s_picks;
    }
    if (p < n && s_cold[p]) {
        int32_t* dst = reinterpret_cast<int32_t*>(slot + r.picks_offset) + 3 * s_pos[p];
        const int32_t words[3] = {p / topk, s_e[p], __float_as_int(__half2float(rw[p]))};
        const uint64_t at = 3 * (uint64_t) s_pos[p];
        dst[0] = words[0];
        dst[1] = words[1];
        dst[2] = words[2];
        atomicAdd(&s_sum, (uint64_t) (uint32_t) words[0] * (2 * at + 1) + (uint64_t) (uint32_t) words[1] * (2 * at + 3) +
                              (uint64_t) (uint32_t) words[2] * (2 * at + 5));
        if (probe_k <= 0) {
            record[p] = s_e[p];
            record[CT_SPLIT_MAX_PICKS + p] = (int32_t) __half_as_ushort(rw[p]);
            rw[p] = __float2half(0.0f);
        }
    }
    ct_publish_rows(r, s_seq, y, T, 3 * s_picks, &s_sum, next_seq, status, counters);
}

// One block, after ct_wait_kernel: the sort of one split's picks that exllamav3's fused expert kernel (exl3_moe,
// the prefill path's) takes, so that the GPU computes the job's experts itself when the host did not deliver them
// (status published, outcome not DONE: taken back at the deadline, or refused). count (int64 [num_experts + 1]):
// picks per expert, the last bin collecting the rest; token_sorted (int64 [n]) and weight_sorted (fp16 [n]) their
// tokens and weights, in expert order then pick order, the rest (weight 0) at the end. When the job was delivered,
// or never published, every pick is in the last bin: exl3_moe then computes nothing. n = T * topk <=
// CT_SPLIT_MAX_PICKS, num_experts <= EC_MAX_EXPERTS.
__global__ void ct_fallback_plan_kernel(const int64_t* status, const int32_t* outcome, const int32_t* record, int n,
                                        int topk, int num_experts, int64_t* count, int64_t* token_sorted,
                                        __half* weight_sorted, int64_t* counters)
{
    const bool fall = *status != 0 && *outcome != CT_OUT_DONE;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    if (threadIdx.x != 0) return;
    // a counting sort of at most CT_SPLIT_MAX_PICKS picks into the few experts they name, by one thread
    int bin[CT_SPLIT_MAX_PICKS], ids[CT_SPLIT_MAX_PICKS + 1], picks[CT_SPLIT_MAX_PICKS + 1];
    int experts = 0, rest = 0;
    for (int p = 0; p < n; ++p) {
        const int e = fall ? record[p] : -1;
        bin[p] = e >= 0 && e < num_experts ? e : num_experts;
        if (bin[p] == num_experts) {
            ++rest;
            continue;
        }
        int i = 0;
        while (i < experts && ids[i] != bin[p]) ++i;
        if (i == experts) {  // a new expert: kept in ascending order, as exl3_moe walks the bins
            while (i > 0 && ids[i - 1] > bin[p]) {
                ids[i] = ids[i - 1];
                picks[i] = picks[i - 1];
                --i;
            }
            ids[i] = bin[p];
            picks[i] = 0;
            ++experts;
        }
        ++picks[i];
    }
    int at = 0;
    for (int i = 0; i <= experts; ++i) {
        const int e = i < experts ? ids[i] : num_experts;
        count[e] = i < experts ? picks[i] : rest;
        for (int p = 0; p < n; ++p) {
            if (bin[p] != e) continue;
            token_sorted[at] = p / topk;
            weight_sorted[at] = e < num_experts ? __ushort_as_half((unsigned short) record[CT_SPLIT_MAX_PICKS + p])
                                                : __float2half(0.0f);
            ++at;
        }
    }
    if (experts > 0) {
        counters[CT_C_FALLBACK_JOBS] += 1;
        counters[CT_C_FALLBACK_EXPERTS] += experts;
    }
}

#define CT_REQUIRE_RING(r) do { \
        EC_REQUIRE((r) != nullptr, "r is NULL"); \
        EC_REQUIRE((r)->hidden % 128 == 0, "r->hidden is %u, not a multiple of 128", (r)->hidden); \
    } while (0)

extern "C" {

int ct_fallback_plan(const int64_t* status, const int32_t* outcome, const int32_t* record, int n, int topk,
                     int num_experts, int64_t* count, int64_t* token_sorted, void* weight_sorted, int64_t* counters,
                     cudaStream_t stream)
{
    EC_REQUIRE(n >= 1 && n <= CT_SPLIT_MAX_PICKS, "n is %d, not in 1..%d (CT_SPLIT_MAX_PICKS)", n, CT_SPLIT_MAX_PICKS);
    EC_REQUIRE(topk >= 1, "topk is %d, below 1", topk);
    EC_REQUIRE(num_experts >= 1 && num_experts <= EC_MAX_EXPERTS, "num_experts is %d, not in 1..%d (EC_MAX_EXPERTS)",
               num_experts, EC_MAX_EXPERTS);
    ct_fallback_plan_kernel<<<1, 256, 0, stream>>>(status, outcome, record, n, topk, num_experts, count, token_sorted,
                                                   reinterpret_cast<__half*>(weight_sorted), counters);
    return ec_result(__func__, cudaGetLastError());
}

int ct_split_publish(const CtRing* r, uint64_t* next_seq, int layer, int T, int topk, const int64_t* sel, void* rw,
                     const uint16_t* y, const int32_t* slot_of, const float* freq, const uint8_t* table,
                     int table_tokens, int table_experts, int probe_k, int64_t* status, int64_t* counters,
                     int32_t* info, int32_t* record, cudaStream_t stream)
{
    CT_REQUIRE_RING(r);
    EC_REQUIRE(T >= 1, "T is %d, below 1", T);
    EC_REQUIRE(topk >= 1, "topk is %d, below 1", topk);
    EC_REQUIRE(T * topk <= CT_SPLIT_MAX_PICKS, "T * topk is %d x %d, above %d (CT_SPLIT_MAX_PICKS)", T, topk,
               CT_SPLIT_MAX_PICKS);
    ct_split_publish_kernel<<<1, CT_SPLIT_MAX_PICKS, 0, stream>>>(*r, next_seq, layer, T, topk, sel,
        reinterpret_cast<__half*>(rw), y, slot_of, freq, table, table_tokens, table_experts, probe_k, status, counters,
        info, record);
    return ec_result(__func__, cudaGetLastError());
}

int ct_publish(const CtRing* r, uint64_t* next_seq, int layer, int n_tokens, const int32_t* picks, int n_picks,
               const uint16_t* x, int64_t* status, int64_t* counters, cudaStream_t stream)
{
    CT_REQUIRE_RING(r);
    ct_publish_kernel<<<1, 256, 0, stream>>>(*r, next_seq, layer, n_tokens, picks, n_picks, x, status, counters);
    return ec_result(__func__, cudaGetLastError());
}

int ct_collect(const CtRing* r, const int64_t* status, int64_t timeout_ns, const int32_t* info, int64_t per_expert_ns,
               int64_t floor_ns, int32_t* outcome, float* acc, int n_tokens, int add_blocks, int64_t* counters,
               cudaStream_t stream)
{
    CT_REQUIRE_RING(r);
    EC_REQUIRE(n_tokens >= 0 && (uint32_t) n_tokens <= r->max_tokens, "n_tokens is %d, not in 0..%u (r->max_tokens)",
               n_tokens, r->max_tokens);
    EC_REQUIRE(add_blocks >= 1, "add_blocks is %d, below 1", add_blocks);
    ct_wait_kernel<<<1, 1, 0, stream>>>(*r, status, timeout_ns, info, per_expert_ns, floor_ns, outcome, counters);
    ct_add_kernel<<<add_blocks, 256, 0, stream>>>(*r, status, outcome, acc, n_tokens);
    return ec_result(__func__, cudaGetLastError());
}

int ct_device_pointer(void* host, void** device, int* native_atomics)
{
    EC_REQUIRE(host != nullptr && device != nullptr && native_atomics != nullptr,
               "host, device and native_atomics must not be NULL");
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(native_atomics, cudaDevAttrHostNativeAtomicSupported, dev);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(device, host, 0);
    return ec_result(__func__, e);
}

}
