/* The CPU tier's handoff: a job ring in memory both sides can reach (in production page-locked host memory
 * mapped into the GPU's address space; in tests plain host memory), a host worker that computes the jobs with the
 * expert kernel of cpu_expert.h, and reference host-side producer functions (what the GPU's kernel will do; the
 * tests use them in its place).
 *
 * A JOB is the cold missed experts of one MoE layer for one decode step: 1..max_tokens tokens, their fp16 input
 * rows, and up to max_tokens * max_picks picks (token, expert, router weight). The worker writes
 *     out[t] = sum over the job's picks (t, e, w) of w * expert_e(x[t])       (fp32, [tokens][hidden])
 * SUM ORDER: the job's distinct experts in the order they first appear in the pick list; each token's
 * contributions are added to 0.0f in that order, one at a time (out = out + w * y), which is what calling
 * glm53_ce_experts once per expert in that order on a zeroed out does. A job with a (token, expert) pair twice, a
 * token or expert out of range, or an expert with no registered trellis FAILS (see below).
 *
 * BYTE LAYOUT (all offsets in bytes, little-endian, the ring base aligned to GLM53_CT_ALIGN = 128; every section
 * starts on a 128-byte boundary so that no two writers share a cache line nor an adjacent-line prefetch pair):
 *   ring + 0    ring header, static (written by glm53_ct_ring_init, then read-only):
 *                 u32 magic 'GCT1' (0x31544347), u32 version (1), u32 slots, u32 hidden, u32 max_tokens,
 *                 u32 max_picks, u64 slot_bytes, u64 slots_offset (= 256), u64 picks_offset, u64 x_offset,
 *                 u64 out_offset, u64 total_bytes            (see glm53_ct_layout; offsets of sections in a slot)
 *   ring + 128  worker line: u64 worker_next, the sequence number the worker waits for next (written by the
 *                 worker only; a restarted worker resumes there; published - worker_next = jobs waiting)
 *   ring + 256 + i * slot_bytes   slot i (slot_bytes a multiple of 128):
 *     + 0             slot header (one 128-byte line):
 *                       u64 state word, u32 layer, u32 n_tokens, u32 n_picks, u32 reserved[27]
 *     + picks_offset  picks: [max_tokens * max_picks] of {i32 token, i32 expert, f32 weight} (12 bytes each)
 *     + x_offset      input rows: fp16 [max_tokens][hidden] (row t at x_offset + 2 * t * hidden)
 *     + out_offset    output: fp32 [max_tokens][hidden] (row t at out_offset + 4 * t * hidden)
 *   layer is the layer's row in the registered expert table (the host store's row), expert its expert index.
 *
 * THE STATE WORD: u64 = seq << 8 | state, seq >= 1 the job's sequence number (56 bits, never wraps in practice),
 * job seq lives in slot seq % slots. Carrying seq in the word makes every compare-and-swap specific to one job:
 * a stale party can never move a later job's slot.
 *   EMPTY 0       the slot is the producer's. Initial value EMPTY(seq 0).
 *   PUBLISHED 1   producer, from EMPTY, after writing layer, n_tokens, n_picks, picks and rows: release store.
 *   CLAIMED 2     worker, CAS PUBLISHED(s) -> CLAIMED(s) (acquire): it now reads the payload and writes out.
 *   DONE 3        worker, CAS CLAIMED(s) -> DONE(s) (release) after writing out[0..n_tokens).
 *   FAILED 4      worker, CAS CLAIMED(s) -> FAILED(s): an invalid job; out is not valid. The producer computes
 *                 the job itself, as after a take-back.
 *   TAKEN_BACK 5  producer, when its deadline passes: CAS PUBLISHED(s) -> TAKEN_BACK(s) (the worker will never
 *                 claim it: its claim CAS fails; the producer then stores EMPTY(s) at once) or CAS CLAIMED(s) ->
 *                 TAKEN_BACK(s) (the worker is computing: its CAS CLAIMED -> DONE fails, it discards its result,
 *                 counts it late and stores EMPTY(s) when it no longer touches the slot; until then the slot is
 *                 not the producer's).
 *   The producer consumes DONE(s) (reads out, acquire) or FAILED(s), then stores EMPTY(s) (release).
 *   Exactly one side contributes every job: the worker's result counts only if its CAS CLAIMED -> DONE wins,
 *   the producer computes the experts itself only if its take-back CAS wins (or the job FAILED); the two CASes
 *   are on the same word from the same value CLAIMED(s), so exactly one of them wins.
 * ORDER: the producer numbers jobs 1, 2, 3, ... in publish order and publishes job s only into an EMPTY slot
 * s % slots (when it is not EMPTY the producer computes that job itself without publishing and without using a
 * number). The worker takes s = worker_next, 1 at first, and looks at slot s % slots: seq < s: not yet published,
 * wait; seq == s and PUBLISHED: claim it; seq == s and EMPTY or TAKEN_BACK, or seq > s: job s was taken back
 * before the claim: count it, go on with s + 1. So the worker claims jobs in order and skips none it could claim.
 * GPU SIDE: payload stores, then a system-scope fence (__threadfence_system, or st.release.sys of the word) by
 * the thread that publishes, after the block's other writers have synchronised with it; ld.acquire.sys of the
 * word before reading out; atomicCAS_system (64-bit) for the take-back. One producer and one worker per ring.
 */
#ifndef GLM53_CPU_TIER_H
#define GLM53_CPU_TIER_H

#include <stdint.h>

#include "../cpu_expert/cpu_expert.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GLM53_CT_API __attribute__((visibility("default")))

enum { GLM53_CT_MAGIC = 0x31544347, GLM53_CT_VERSION = 1, GLM53_CT_ALIGN = 128, GLM53_CT_RING_HEADER = 256 };
enum { GLM53_CT_EMPTY = 0, GLM53_CT_PUBLISHED = 1, GLM53_CT_CLAIMED = 2, GLM53_CT_DONE = 3, GLM53_CT_FAILED = 4,
       GLM53_CT_TAKEN_BACK = 5 };
enum { GLM53_CT_EBUSY = -5, GLM53_CT_ESTATE = -6 };  /* also GLM53_CE_EINVAL, GLM53_CE_ENOMEM */

typedef struct glm53_ct_layout {
    uint32_t magic, version, slots, hidden, max_tokens, max_picks;
    uint64_t slot_bytes;    /* stride of the slots, a multiple of 128 */
    uint64_t slots_offset;  /* slot 0 from the ring base: GLM53_CT_RING_HEADER */
    uint64_t picks_offset;  /* sections inside a slot */
    uint64_t x_offset;
    uint64_t out_offset;
    uint64_t total_bytes;   /* the ring's size */
} glm53_ct_layout;

typedef struct glm53_ct_pick {
    int32_t token;
    int32_t expert;
    float weight;
} glm53_ct_pick;

typedef struct glm53_ct_counters {
    uint64_t jobs;              /* claimed */
    uint64_t done;              /* published DONE */
    uint64_t failed;            /* published FAILED (invalid jobs) */
    uint64_t experts;           /* distinct experts computed, over claimed jobs */
    uint64_t picks;
    uint64_t tokens;
    uint64_t busy_ns;           /* from claim to publish */
    uint64_t taken_back_before_claim;  /* counted when the worker reaches the job's number */
    uint64_t taken_back_after_claim;   /* late: the result was discarded */
    uint64_t max_queue_depth;   /* PUBLISHED slots seen at a claim, the claimed one included */
} glm53_ct_counters;

typedef struct glm53_ct_worker glm53_ct_worker;

/* What the last failing glm53_ct_ call of this thread said. */
GLM53_CT_API const char* glm53_ct_error(void);

/* The layout of a ring for these dims (hidden a multiple of 128, 1 <= max_tokens <= 8, 1 <= max_picks <= 64). */
GLM53_CT_API int32_t glm53_ct_ring_layout(int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks,
                                          glm53_ct_layout* out);
/* Writes the ring header into mem (bytes >= total_bytes, 128-byte aligned), every slot EMPTY(0), worker_next 1. */
GLM53_CT_API int32_t glm53_ct_ring_init(void* mem, uint64_t bytes, int32_t slots, int32_t hidden, int32_t max_tokens,
                                        int32_t max_picks);
/* The state word of slot `slot` (acquire). */
GLM53_CT_API uint64_t glm53_ct_slot_word(const void* ring, int32_t slot);

/* The worker: one thread (pinned to cpu unless cpu < 0) serving the ring with the expert kernel on pool (NULL:
 * the worker thread alone) and ISA isa. table: [n_layers * n_experts] experts, copied; an entry with a NULL gate
 * trellis is not registered. All registered experts have the same dims (hidden = the ring's). act_limit: GLM's
 * swiglu_limit (0: no clamp). Idle, it spins spin_us after its last job, then naps: 50 us, doubling up to
 * nap_us (the worst wake-up latency after a long idle; a GPU producer cannot wake a futex). NULL on
 * failure (glm53_ct_error says why). */
GLM53_CT_API glm53_ct_worker* glm53_ct_worker_start(void* ring, const glm53_ce_expert* table, int32_t n_layers,
                                                    int32_t n_experts, float act_limit, glm53_ce_pool* pool,
                                                    int32_t isa, int32_t cpu, int32_t spin_us, int32_t nap_us);
/* Returns once the worker has exited: it finishes (publishes) a job it has claimed and claims no more. */
GLM53_CT_API void glm53_ct_worker_stop(glm53_ct_worker* worker);
GLM53_CT_API void glm53_ct_worker_counters(const glm53_ct_worker* worker, glm53_ct_counters* out);
/* TEST HOOK: while hold is nonzero the worker, having claimed a job, waits before computing it (until released
 * or stopped). */
GLM53_CT_API void glm53_ct_worker_debug_hold(glm53_ct_worker* worker, int32_t hold);

/* ---- The reference host producer (tests; the GPU does the same with its own instructions). */

/* Publishes job seq into slot seq % slots: GLM53_CT_EBUSY when that slot is not EMPTY, EINVAL for bad sizes. */
GLM53_CT_API int32_t glm53_ct_producer_publish(void* ring, uint64_t seq, int32_t layer, int32_t n_tokens,
                                               const glm53_ct_pick* picks, int32_t n_picks, const uint16_t* x);
/* Waits up to timeout_us for job seq, then takes it back. Returns GLM53_CT_DONE (out valid until release),
 * GLM53_CT_FAILED, or GLM53_CT_TAKEN_BACK with *after_claim 0 (the slot is EMPTY again) or 1 (the worker
 * frees the slot later). The caller computes the job itself unless DONE. timeout_us < 0: wait forever. */
GLM53_CT_API int32_t glm53_ct_producer_wait(void* ring, uint64_t seq, int64_t timeout_us, int32_t* after_claim);
/* Takes job seq back now (the wait's last step): as glm53_ct_producer_wait with timeout 0, without waiting. */
GLM53_CT_API int32_t glm53_ct_producer_take_back(void* ring, uint64_t seq, int32_t* after_claim);
/* After DONE or FAILED: the slot is EMPTY again. GLM53_CT_ESTATE when job seq is in neither state. */
GLM53_CT_API int32_t glm53_ct_producer_release(void* ring, uint64_t seq);

#ifdef __cplusplus
}
#endif

#endif
