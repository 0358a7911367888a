/* The project's CUDA library (expert_cache.cu and the files it includes): its structs, numbers and entry points,
 * the one declaration of each. glm53/native/bindgen.py generates the Python binding (glm53/native/cuda_binding.py)
 * and ec_abi's definition (expert_cache_abi.inc) from this file.
 *
 * Plain C ABI (loaded with ctypes); every launcher takes the CUDA stream to run on. An entry point returns 0, or a
 * CUDA error code: cudaErrorInvalidValue for an argument it refuses, after which ec_error() says which argument
 * and why; for an error of the launch, ec_error() is CUDA's own description of it.
 */
#ifndef GLM53_EXPERT_CACHE_H
#define GLM53_EXPERT_CACHE_H

#include <cuda_runtime.h>
#include <stdint.h>

#define EC_MAX_EXPERTS 512   /* exllamav3's own limit per MoE layer (BC_BlockSparseMLP MAX_EXPERTS) */
#define EC_MAX_ADMIT 16      /* admissions per layer and decode step */

/* Counters per layer (int64 [L, C_N]): decode picks, hits, admissions, evictions, decode steps */
enum ec_counter { C_PICKS = 0, C_HITS, C_ADMITS, C_EVICTS, C_STEPS, C_N = 8 };

/* The GPU expert cache's state on the device, passed by value to its kernels. */
struct EcState {
    int num_layers;
    int num_experts;
    float* freq;           /* [L, E] decayed pick frequency (the replacement score) */
    int32_t* slot_of;      /* [L, E] slot holding the expert, -1 when it is read from the host store */
    int32_t* owner;        /* [S] l * E + e of the expert in the slot, -1 when free */
    int64_t* picks;        /* [L, E] decode picks per expert since start (oracle and learned profile) */
    int64_t* counters;     /* [L, C_N] */
    const int64_t* home;   /* [L, E] device address (UVA) of the expert's [gate | up | down] block in host memory */
    const int64_t* slot_addr;  /* [S] device address of each VRAM slot */
    const int64_t* tables; /* [L, 4] addresses of exllamav3's tables: gate (E), up (E), down (E), gate/up (E, 2) */
    int64_t off_up;        /* byte offset of up and down inside an expert block (the same in host store and slots) */
    int64_t off_down;
    int32_t* jobs;         /* [EC_MAX_ADMIT, 2] (l * E + e, slot) of the copies the next ec_copy runs */
    int32_t* num_jobs;     /* [1] */
};

/* The fast half of the cache's score and its per-layer weight (glm53/offload/cache_policy.py, Recency), by value. */
struct EcRecency {
    float* recent;        /* [L, E] fast decayed pick count */
    uint8_t* prev;        /* [L, E] 1: picked by the first row of the layer's previous decode step */
    float* reuse;         /* [L, 2] measured reuse lift (running average), the lift popularity alone gives */
    float decay;          /* of recent */
    float weight;         /* recency weight per unit of lift above popularity's */
    float keep;           /* of the running average */
};

/* ---- predictive prefetch (prefetch.cuh) */

#define PF_MAX_SLOTS 16
#define PF_MAX_PREDICTED 64  /* predicted experts per row */

/* Counters per layer (int64 [L, PF_N]): experts copied, copied and picked (prefetch hits, counted once per expert and
 * step), copied and not picked, plans made */
enum pf_counter { PF_COPIED = 0, PF_USED, PF_WASTED, PF_PLANS, PF_N = 4 };

struct EcPool {
    int slots;                 /* VRAM slots of the pool */
    const int64_t* slot_addr;  /* [slots] device address of each */
    int32_t* owner;            /* [slots] l * E + e of the expert copied there for the layer in flight, -1 when free */
    int32_t* num;              /* [1] slots in use */
    int64_t* counters;         /* [L, PF_N] */
};

/* ---- the in-band emulation of a slower link (link_emulate.cuh) */

/* What each kind of transfer is counted as (int64 [LE_KINDS][2] counters: bytes, emulated nanoseconds). */
enum le_kind { LE_MISSES = 0, LE_FALLBACK, LE_ADMISSIONS, LE_PREFETCH, LE_TIER_IO, LE_COPIES, LE_PROBE, LE_KINDS };

struct LeLink {
    double zero_copy_ns_per_byte;  /* added per byte of an SM-issued read of host memory (0: the link's own rate) */
    double copy_ns_per_byte;       /* added per byte of a copy-engine transfer */
    unsigned long long* counters;  /* [LE_KINDS * 2] on the device */
};

/* ---- the CPU tier's handoff, device side (cpu_tier_device.cuh; the protocol is ../cpu_tier/cpu_tier.h's) */

/* The ring's geometry (glm53_ct_layout) and its device address, passed by value. */
struct CtRing {
    char* base;            /* device address of the ring (the mapped alias of the host memory) */
    uint32_t slots, hidden, max_tokens, max_picks;
    uint64_t slot_bytes, slots_offset, picks_offset, x_offset, out_offset;
};

/* A word's states: GLM53_CT_* of cpu_tier.h */
enum ct_state { CT_EMPTY = 0, CT_PUBLISHED = 1, CT_CLAIMED = 2, CT_DONE = 3, CT_FAILED = 4, CT_TAKEN_BACK = 5, CT_SKIPPED = 6 };
#define CT_ACK 64  /* byte offset of the worker's ACK word in a slot (JOB at 0) */
#define CT_SUM 24  /* byte offset of the payload's checksum in a slot (cpu_tier.h's GLM53_CT_SUM, SUM) */
#define CT_SUM_SEQ 0x1E3779B97F4A7C15ull  /* the job number's weight in it (GLM53_CT_SUM_SEQ) */
/* What ct_wait decided for a job (*outcome) */
enum ct_outcome { CT_OUT_NONE = 0, CT_OUT_DONE = 1, CT_OUT_FAILED = 2, CT_OUT_TAKEN_BACK_BEFORE_CLAIM = 3,
                  CT_OUT_TAKEN_BACK_AFTER_CLAIM = 4 };
/* The counters the kernels keep (int64 [CT_N]): jobs published, publishes refused for a busy slot, outcomes, the
 * GPU's total wait, jobs (and their experts) the GPU computed itself after all (ct_fallback_plan), shadow jobs
 * published to time the host (probes). */
enum ct_counter { CT_C_PUBLISHED = 0, CT_C_BUSY, CT_C_DONE, CT_C_FAILED, CT_C_TAKEN_BACK_BEFORE_CLAIM,
                  CT_C_TAKEN_BACK_AFTER_CLAIM, CT_C_WAIT_NS, CT_C_FALLBACK_JOBS, CT_C_FALLBACK_EXPERTS, CT_C_PROBES,
                  CT_N = 16 };
#define CT_SPLIT_MAX_PICKS 64  /* tokens * top-k of one decode step (8 x 8 for GLM-5.3-Flash) */
/* A split's record of the picks it moved to the CPU, for the fallback (int32 [CT_RECORD]): [p] the expert of pick p
 * when its weight was zeroed for the CPU's job, else -1; [CT_SPLIT_MAX_PICKS + p] that pick's fp16 weight bits. */
#define CT_RECORD (2 * CT_SPLIT_MAX_PICKS)

#ifdef __cplusplus
extern "C" {
#endif

/* Why this thread's last call returned an error: the argument it refused and why, or CUDA's description. */
const char* ec_error(void);
/* The sizes and field offsets of the structs above and the numbers of this file, by name (../abi.h): what the
 * Python side checks its mirrors against when it loads the library. 0 when the name is known, else -1. */
int ec_abi(const char* name, int64_t* value);

/* One decode step of one MoE layer over its picks sel (int64 [n]; its first row, the reuse lift's, is the first `row`
 * entries): both scores, up to max_admit admissions, their copies. */
int ec_step(const EcState* s, const EcRecency* rc, int layer, const int64_t* sel, int n, int row, float decay,
            float hysteresis, int max_admit, int64_t block_bytes, int copy_blocks, cudaStream_t stream);
/* Points experts at slots or home from entries (int32 [n, 3]: layer, expert, slot or -1). */
int ec_assign(const EcState* s, const int32_t* entries, int n, cudaStream_t stream);
/* SM-issued read of bytes of mapped host memory (the zero-copy path's bandwidth). */
int ec_read_probe(const void* src, int64_t bytes, unsigned int* out, int blocks, cudaStream_t stream);

/* Plans and copies layer `layer`'s prefetch from predicted (int64 [rows, n_pred]) on the side stream: at most
 * max_copies of the entries whose scores (float32 [rows, n_pred], or NULL: all) are >= min_score. */
int ec_prefetch(const EcState* s, const EcPool* p, int layer, const int64_t* predicted, const float* scores, int rows,
                int n_pred, float min_score, int max_copies, int64_t block_bytes, int copy_blocks, cudaStream_t stream);
/* After layer `layer`'s experts, on the compute stream: counts, points home, frees the pool. */
int ec_prefetch_release(const EcState* s, const EcPool* p, int layer, const int64_t* sel, int n_sel, cudaStream_t stream);

int le_picks(const LeLink* link, const EcState* s, int layer, const int64_t* sel, const void* rw, int n,
             int64_t block_bytes, int kind, int blocks, cudaStream_t stream);
int le_counts(const LeLink* link, const EcState* s, int layer, const int64_t* count, int64_t block_bytes, int kind,
              int blocks, cudaStream_t stream);
int le_units(const LeLink* link, const int32_t* units, int64_t unit_bytes, int64_t fixed_bytes, int copy_engine, int kind,
             int blocks, cudaStream_t stream);
int le_tier_io(const LeLink* link, const int64_t* status, const int32_t* outcome, int64_t in_bytes, int64_t out_bytes,
               int blocks, cudaStream_t stream);

int ct_split_publish(const CtRing* r, uint64_t* next_seq, int layer, int T, int topk, const int64_t* sel, void* rw,
                     const uint16_t* y, const int32_t* slot_of, const float* freq, const uint8_t* table,
                     int table_tokens, int table_experts, int probe_k, int64_t* status, int64_t* counters,
                     int32_t* info, int32_t* record, cudaStream_t stream);
int ct_publish(const CtRing* r, uint64_t* next_seq, int layer, int n_tokens, const int32_t* picks, int n_picks,
               const uint16_t* x, int64_t* status, int64_t* counters, cudaStream_t stream);
/* ct_wait + ct_add: the whole collection of one job into acc (fp32 [n_tokens, hidden]); info may be NULL (no
 * stop-loss: timeout_ns). */
int ct_collect(const CtRing* r, const int64_t* status, int64_t timeout_ns, const int32_t* info, int64_t per_expert_ns,
               int64_t floor_ns, int32_t* outcome, float* acc, int n_tokens, int add_blocks, int64_t* counters,
               cudaStream_t stream);
int ct_fallback_plan(const int64_t* status, const int32_t* outcome, const int32_t* record, int n, int topk,
                     int num_experts, int64_t* count, int64_t* token_sorted, void* weight_sorted, int64_t* counters,
                     cudaStream_t stream);
/* The device address of host memory registered with cudaHostRegisterMapped; also whether this GPU's link does
 * atomics on host memory natively (cudaDevAttrHostNativeAtomicSupported; reported, not relied on). */
int ct_device_pointer(void* host, void** device, int* native_atomics);

#ifdef __cplusplus
}
#endif

#endif
