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
 *                 u32 magic 'GCT1' (0x31544347), u32 version (2), u32 slots, u32 hidden, u32 max_tokens,
 *                 u32 max_picks, u64 slot_bytes, u64 slots_offset (= 256), u64 picks_offset, u64 x_offset,
 *                 u64 out_offset, u64 total_bytes            (see glm53_ct_layout; offsets of sections in a slot)
 *   ring + 128  worker line: u64 worker_next, the sequence number the worker waits for next (written by the
 *                 worker only; a restarted worker resumes there)
 *   ring + 256 + i * slot_bytes   slot i (slot_bytes a multiple of 128):
 *     + 0             the producer's line: u64 JOB word, u32 layer, u32 n_tokens, u32 n_picks, (+ 24) u64 SUM
 *     + 64            the worker's line: u64 ACK word
 *     + picks_offset  picks: [max_tokens * max_picks] of {i32 token, i32 expert, f32 weight} (12 bytes each)
 *     + x_offset      input rows: fp16 [max_tokens][hidden] (row t at x_offset + 2 * t * hidden)
 *     + out_offset    output: fp32 [max_tokens][hidden] (row t at out_offset + 4 * t * hidden)
 *   layer is the layer's row in the registered expert table (the host store's row), expert its expert index.
 *
 * SUM (version 3): the payload's checksum, written with it, before JOB: over its 32-bit words w_i, the picks'
 * 3 * n_picks first, then the rows' n_tokens * hidden / 2, sum of w_i * (2 i + 1) plus seq * GLM53_CT_SUM_SEQ, mod
 * 2^64 (glm53_ct_payload_sum). The worker computes it over what it reads after claiming and computes only on a
 * match: it reads the payload again (its lines flushed from the CPU's caches first) until it matches, for at most
 * GLM53_CT_SUM_WAIT_US, else FAILS the job (the producer then computes it). The flag's release and acquire make
 * this unnecessary in principle. It was added when DONE partials came back wrong on the GPU host; the cause was the
 * expert kernel's, not the ring's (AVX-512 bands of one-tile spans raced between pool threads, fixed 2026-12-02),
 * and no re-read has been counted on any run. It stays as a guard of a few microseconds a job against a host whose
 * PCIe writes land out of order, with payload_rereads / payload_failed saying whether it ever acts.
 * THE TWO WORDS: u64 = seq << 8 | state, seq >= 1 the job's sequence number (56 bits, never wraps in practice);
 * job seq lives in slot seq % slots. Each word has ONE writer: the producer writes JOB, the worker writes ACK. No
 * read-modify-write is shared: a GPU's atomics on host memory are not atomic against the CPU's over PCIe
 * (cudaDevAttrHostNativeAtomicSupported is 0 there; a CAS race between them was seen to lose an update).
 *   JOB: PUBLISHED 1 (after layer, n_tokens, n_picks, picks and rows: release store), TAKEN_BACK 5 (the producer's
 *        deadline passed: it computes the job itself and will never read this job's out).
 *   ACK: CLAIMED 2, DONE 3 (out[0..n_tokens) written: release store), FAILED 4 (an invalid job: out not valid),
 *        SKIPPED 6 (the job was taken back before the worker claimed it; it did nothing).
 *   Both start as 0 (EMPTY, seq 0).
 * The worker claims job s by storing ACK = CLAIMED(s) and then, after a full fence, loading JOB again: if it is
 * TAKEN_BACK(s) it stores SKIPPED(s) and does nothing; otherwise it computes and stores DONE(s) or FAILED(s).
 * The producer takes job s back by storing JOB = TAKEN_BACK(s) and then, after a full fence, loading ACK (which
 * only tells it whether the worker had claimed: a counter). The two store-fence-load pairs make a claim and a
 * take-back impossible to miss both, so the worker skips a job taken back before its claim; and whatever the
 * timing, what counts is decided by the producer alone: it uses the worker's out only if it saw ACK = DONE(s)
 * before it took s back. Exactly one side contributes every job.
 * SLOT REUSE: the producer may publish into a slot whose JOB is EMPTY(0), or whose ACK carries the JOB's seq in a
 * final state (DONE, FAILED, SKIPPED), and only after it has finished with that earlier job (read its out, or
 * taken it back). A slot whose taken-back job the worker still computes (or has not reached) is busy: the
 * producer computes that job itself without publishing it and without using a number.
 * ORDER: the producer numbers jobs 1, 2, 3, ... in publish order. The worker takes s = worker_next, 1 at first,
 * and looks at JOB of slot s % slots: seq < s: not yet published, wait; seq == s and PUBLISHED: claim it;
 * TAKEN_BACK(s): store SKIPPED(s); then s + 1. So it claims jobs in order and skips none it could claim.
 * GPU SIDE (native/ec/cpu_tier_device.cuh): payload stores, __threadfence_system by every writer, then a
 * st.release.sys of JOB; ld.acquire.sys of ACK before reading out; the take-back's fence is fence.sc.sys.
 * One producer and one worker per ring.
 */
#ifndef GLM53_CPU_TIER_H
#define GLM53_CPU_TIER_H

#include <stdint.h>

#include "../cpu_expert/cpu_expert.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GLM53_CT_API __attribute__((visibility("default")))

enum { GLM53_CT_MAGIC = 0x31544347, GLM53_CT_VERSION = 3, GLM53_CT_ALIGN = 128, GLM53_CT_RING_HEADER = 256 };
enum { GLM53_CT_SUM = 24, GLM53_CT_SUM_WAIT_US = 200 };  /* the producer line's checksum word; the worker's longest re-read */
#define GLM53_CT_SUM_SEQ 0x1E3779B97F4A7C15ull            /* the job number's weight in it (an odd constant) */
enum glm53_ct_state { GLM53_CT_EMPTY = 0, GLM53_CT_PUBLISHED = 1, GLM53_CT_CLAIMED = 2, GLM53_CT_DONE = 3, GLM53_CT_FAILED = 4,
       GLM53_CT_TAKEN_BACK = 5, GLM53_CT_SKIPPED = 6 };
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
    uint64_t naps;              /* idle naps taken: none while a decode step is in flight (wake .. rest) */
    uint64_t payload_rereads;   /* claimed jobs whose payload's checksum did not match at first (read again) */
    uint64_t payload_failed;    /* ... nor within GLM53_CT_SUM_WAIT_US (FAILED) */
} glm53_ct_counters;

typedef struct glm53_ct_worker glm53_ct_worker;

/* What the last failing glm53_ct_ call of this thread said. */
GLM53_CT_API const char* glm53_ct_error(void);

/* The sizes and field offsets of the structs above and the numbers of the enums, by name (../abi.h). 0 when the
 * name is known, else -1. */
GLM53_CT_API int32_t glm53_ct_abi(const char* name, int64_t* value);

/* The payload checksum of SUM (the byte layout's description) over picks (3 * n_picks words) and x (n_tokens *
 * hidden / 2 words) for job seq. */
GLM53_CT_API uint64_t glm53_ct_payload_sum(const void* picks, int32_t n_picks, const void* x, int32_t n_tokens, int32_t hidden,
                                           uint64_t seq);

/* The layout of a ring for these dims (hidden a multiple of 128, 1 <= max_tokens <= 8, 1 <= max_picks <= 64). */
GLM53_CT_API int32_t glm53_ct_ring_layout(int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks,
                                          glm53_ct_layout* out);
/* Writes the ring header into mem (bytes >= total_bytes, 128-byte aligned), every slot EMPTY(0), worker_next 1. */
GLM53_CT_API int32_t glm53_ct_ring_init(void* mem, uint64_t bytes, int32_t slots, int32_t hidden, int32_t max_tokens,
                                        int32_t max_picks);
/* Slot `slot`'s JOB word (which = 0) or ACK word (which = 1), acquire. */
GLM53_CT_API uint64_t glm53_ct_slot_word(const void* ring, int32_t slot, int32_t which);

/* The worker: one thread (pinned to cpu unless cpu < 0) serving the ring with the expert kernel on pool (NULL:
 * the worker thread alone), ISA isa and codebook (GLM53_CE_CODEBOOK_*). table: [n_layers * n_experts] experts, copied; an entry with a NULL gate
 * trellis is not registered. All registered experts have the same dims (hidden = the ring's). act_limit: GLM's
 * swiglu_limit (0: no clamp). Idle, it spins spin_us after its last job (or its last wake-up or rest), then naps: 50 us,
 * doubling up to nap_us (a GPU producer cannot wake a futex); idle for park_us (0: never), it parks: asleep until
 * glm53_ct_worker_wake, looking at the ring every 100 ms even unwoken, so that an idle server costs no CPU. NULL on
 * failure (glm53_ct_error says why). */
GLM53_CT_API glm53_ct_worker* glm53_ct_worker_start(void* ring, const glm53_ce_expert* table, int32_t n_layers,
                                                    int32_t n_experts, float act_limit, glm53_ce_pool* pool,
                                                    int32_t isa, int32_t codebook, int32_t cpu, int32_t spin_us,
                                                    int32_t nap_us, int32_t park_us);
/* Points the trellises of n registered experts at new addresses, where a RAM tier moved their bytes:
 * entries[i] = layer * n_experts + expert, trellises[3 i .. 3 i + 2] its gate, up and down trellis. Each pointer is
 * stored atomically and a job loads it atomically when it takes the expert, so a job reads an old or a new address of
 * each projection, never a torn one. The caller re-points an expert only while no job it will collect reads it (a job
 * taken back after its claim may still read either address: every address given must stay mapped for the worker's
 * life, and that job's result is discarded). An entry out of range or not registered at start, or a NULL address:
 * EINVAL, and nothing is changed. */
GLM53_CT_API int32_t glm53_ct_worker_repoint(glm53_ct_worker* worker, const int64_t* entries, const uint64_t* trellises,
                                             int32_t n);
/* A decode step is about to start (the host that launches it calls this): a napping or parked worker spins again,
 * and it takes no nap until glm53_ct_worker_rest: the GPU publishes a layer's job with no notice, and a job that
 * finds the worker napping waits for the nap's end (up to nap_us), past the GPU's wait for it. */
GLM53_CT_API void glm53_ct_worker_wake(glm53_ct_worker* worker);
/* The decode step is over (its host synchronised): the worker spins spin_us more, then naps and parks as above. */
GLM53_CT_API void glm53_ct_worker_rest(glm53_ct_worker* worker);
/* Whether the worker is parked now (for tests and /stats). */
GLM53_CT_API int32_t glm53_ct_worker_parked(const glm53_ct_worker* worker);
/* Returns once the worker has exited: it finishes (publishes) a job it has claimed and claims no more. */
GLM53_CT_API void glm53_ct_worker_stop(glm53_ct_worker* worker);
GLM53_CT_API void glm53_ct_worker_counters(const glm53_ct_worker* worker, glm53_ct_counters* out);
/* TEST HOOK: while hold is nonzero the worker, having claimed a job, waits before computing it (until released
 * or stopped). */
GLM53_CT_API void glm53_ct_worker_debug_hold(glm53_ct_worker* worker, int32_t hold);

/* ---- The reference host producer (tests; the GPU does the same with its own instructions). */

/* Publishes job seq into slot seq % slots: GLM53_CT_EBUSY when that slot is not free, EINVAL for bad sizes. */
GLM53_CT_API int32_t glm53_ct_producer_publish(void* ring, uint64_t seq, int32_t layer, int32_t n_tokens,
                                               const glm53_ct_pick* picks, int32_t n_picks, const uint16_t* x);
/* Waits up to timeout_us for job seq, then takes it back. Returns GLM53_CT_DONE (out valid until the slot is
 * reused), GLM53_CT_FAILED, or GLM53_CT_TAKEN_BACK with *after_claim 0 (the worker will skip it) or 1 (the worker
 * had claimed it; its result is discarded). The caller computes the job itself unless DONE. timeout_us < 0: wait
 * forever. */
GLM53_CT_API int32_t glm53_ct_producer_wait(void* ring, uint64_t seq, int64_t timeout_us, int32_t* after_claim);
/* Takes job seq back now (the wait's last step): as glm53_ct_producer_wait with timeout 0, without waiting. */
GLM53_CT_API int32_t glm53_ct_producer_take_back(void* ring, uint64_t seq, int32_t* after_claim);

#ifdef __cplusplus
}
#endif

#endif
