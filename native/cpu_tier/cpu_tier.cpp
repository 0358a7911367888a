// The CPU tier's job ring, its host worker and the reference host producer; cpu_tier.h has the layout and the
// protocol. The ring is caller memory that another agent (the GPU) writes too, so its words are accessed with
// the __atomic builtins rather than through std::atomic objects; each word has one writer (no read-modify-write
// crosses the link: the GPU's atomics on host memory are not atomic against the CPU's over PCIe).
#include "cpu_tier.h"

#include "../abi.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace {

thread_local std::string last_error;

int32_t fail(int32_t code, const std::string& message)
{
    last_error = message;
    return code;
}

constexpr uint64_t align_up(uint64_t n) { return (n + GLM53_CT_ALIGN - 1) / GLM53_CT_ALIGN * GLM53_CT_ALIGN; }
constexpr uint64_t word_of(uint64_t seq, uint32_t state) { return seq << 8 | state; }
constexpr uint64_t seq_of(uint64_t word) { return word >> 8; }
constexpr uint32_t state_of(uint64_t word) { return static_cast<uint32_t>(word & 0xff); }
constexpr uint64_t WORKER_NEXT = 128;  // byte offset of worker_next in the ring
constexpr int FIRST_NAP_US = 50;
// A step that has not ended (glm53_ct_worker_rest) this long after its wake-up is taken as over: a host that
// never says so (a failed step) must not keep the worker spinning
constexpr int MAX_STEP_MS = 1000;
constexpr int PARK_CHECK_MS = 100;  // a parked worker looks at the ring this often even unwoken

using clock_type = std::chrono::steady_clock;

uint64_t now_ns()
{
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch()).count());
}

void nap(int us)
{
    timespec ts{0, static_cast<long>(us) * 1000};
    nanosleep(&ts, nullptr);
}

// Sleeps while word == expected, at most timeout_ms (a wake-up or a timeout both return).
void futex_wait_ms(std::atomic<uint32_t>& word, uint32_t expected, int timeout_ms)
{
    timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word)
{
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Evicts [p, p + n) from this CPU's caches (a later read goes to memory).
void flush_lines(const uint8_t* p, uint64_t n)
{
    for (uint64_t at = 0; at < n; at += 64)
        __builtin_ia32_clflush(p + at);
}

struct SlotHeader {
    uint64_t job;  // the producer's word
    uint32_t layer, n_tokens, n_picks, unused;
    uint64_t sum;  // the payload's checksum (glm53_ct_payload_sum)
};
static_assert(offsetof(SlotHeader, sum) == GLM53_CT_SUM, "SUM's offset in the producer's line");
constexpr uint64_t ACK = 64;  // byte offset of the worker's word in a slot

const glm53_ct_layout& layout_of(const void* ring) { return *static_cast<const glm53_ct_layout*>(ring); }

uint8_t* slot_base(void* ring, uint64_t slot)
{
    const glm53_ct_layout& L = layout_of(ring);
    return static_cast<uint8_t*>(ring) + L.slots_offset + slot * L.slot_bytes;
}

uint64_t* job_ptr(void* ring, uint64_t slot) { return reinterpret_cast<uint64_t*>(slot_base(ring, slot)); }
uint64_t* ack_ptr(void* ring, uint64_t slot) { return reinterpret_cast<uint64_t*>(slot_base(ring, slot) + ACK); }

uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
// A store, then a load of the other side's word, never reordered (x86: the store drains before the load):
// with the other side doing the same, at least one of the two loads sees the other's store.
uint64_t store_then_load(uint64_t* mine, uint64_t v, const uint64_t* theirs)
{
    __atomic_store_n(mine, v, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(theirs, __ATOMIC_SEQ_CST);
}

bool terminal(uint32_t ack_state)
{
    return ack_state == GLM53_CT_DONE || ack_state == GLM53_CT_FAILED || ack_state == GLM53_CT_SKIPPED;
}

// The producer may fill the slot: never used, or the worker has finished with the job it last held.
bool slot_free(void* ring, uint64_t slot)
{
    const uint64_t j = load(job_ptr(ring, slot)), a = load(ack_ptr(ring, slot));
    return seq_of(j) == 0 || (seq_of(a) == seq_of(j) && terminal(state_of(a)));
}

int32_t check_ring(const void* ring)
{
    if (!ring || reinterpret_cast<uintptr_t>(ring) % GLM53_CT_ALIGN)
        return fail(GLM53_CE_EINVAL, "ring: need a non-null, 128-byte aligned ring");
    const glm53_ct_layout& L = layout_of(ring);
    if (L.magic != GLM53_CT_MAGIC || L.version != GLM53_CT_VERSION)
        return fail(GLM53_CE_EINVAL, "ring: no ring header (glm53_ct_ring_init) at this address");
    return GLM53_CE_OK;
}

// The trellis pointers of a table entry, which glm53_ct_worker_repoint may store while a job reads them: each is
// loaded atomically, so a job sees an old or a new address of each projection, never a torn one.
void load_trellises(const glm53_ce_expert& from, glm53_ce_expert& to)
{
    to.gate.trellis = __atomic_load_n(&from.gate.trellis, __ATOMIC_ACQUIRE);
    to.up.trellis = __atomic_load_n(&from.up.trellis, __ATOMIC_ACQUIRE);
    to.down.trellis = __atomic_load_n(&from.down.trellis, __ATOMIC_ACQUIRE);
}

}  // namespace

#define COUNT(field, n) counter(offsetof(glm53_ct_counters, field)).fetch_add((n), std::memory_order_relaxed)

struct glm53_ct_worker {
    void* ring = nullptr;
    glm53_ct_layout L{};
    std::vector<glm53_ce_expert> table;
    int n_layers = 0, n_experts = 0;
    float act_limit = 0.0f;
    glm53_ce_pool* pool = nullptr;
    int isa = GLM53_CE_ISA_BEST, codebook = GLM53_CE_CODEBOOK_FP16, spin_us = 0, nap_us = 0, park_us = 0;
    std::atomic<bool> stop{false};
    // glm53_ct_worker_wake bumps wake_gen: an idle worker spins again from then; a parked one (parked != 0, asleep
    // on wake_gen) is woken. The seq_cst order of (parked = 1, load wake_gen) here against (bump wake_gen, load
    // parked) there makes sure a parking worker either sees the bump or gets the wake-up.
    std::atomic<uint32_t> wake_gen{0};
    std::atomic<int> parked{0};
    std::atomic<int> in_step{0};  // between glm53_ct_worker_wake and glm53_ct_worker_rest: no naps
    std::atomic<int> hold{0};
    std::thread thread;
    // indexed like the fields of glm53_ct_counters
    std::atomic<uint64_t> counters[sizeof(glm53_ct_counters) / sizeof(uint64_t)] = {};
    // per job, reused
    std::vector<int> index_of;  // expert -> position in `list`, -1 otherwise
    std::vector<glm53_ce_expert> list;
    std::vector<int> ids;
    std::vector<uint8_t> token_mask;
    std::vector<float> weights;

    std::atomic<uint64_t>& counter(size_t offset) { return counters[offset / sizeof(uint64_t)]; }

    void run();
    void park(uint32_t gen);
    uint32_t compute(uint8_t* slot, uint64_t seq);
    bool payload_arrived(uint8_t* slot, uint64_t seq);
    void process(uint64_t seq);
};

// Whether the slot's payload is job seq's as its checksum says, reading it again (its lines flushed from this CPU's
// caches, so that a re-read goes to memory) until it is or GLM53_CT_SUM_WAIT_US have passed.
bool glm53_ct_worker::payload_arrived(uint8_t* slot, uint64_t seq)
{
    const uint64_t t0 = now_ns();
    for (bool first = true;; first = false) {
        SlotHeader h;
        memcpy(&h, slot, sizeof h);
        const bool sizes = h.n_tokens >= 1 && h.n_tokens <= L.max_tokens && h.n_picks >= 1 && h.n_picks <= L.max_tokens * L.max_picks;
        if (sizes && glm53_ct_payload_sum(slot + L.picks_offset, static_cast<int32_t>(h.n_picks), slot + L.x_offset,
                                          static_cast<int32_t>(h.n_tokens), static_cast<int32_t>(L.hidden), seq) == h.sum)
            return true;
        if (first)
            COUNT(payload_rereads, 1);
        if (now_ns() - t0 > GLM53_CT_SUM_WAIT_US * 1000ull) {
            COUNT(payload_failed, 1);
            return false;
        }
        const uint64_t n_tokens = sizes ? h.n_tokens : L.max_tokens, n_picks = sizes ? h.n_picks : L.max_tokens * L.max_picks;
        flush_lines(slot, 64);
        flush_lines(slot + L.picks_offset, sizeof(glm53_ct_pick) * n_picks);
        flush_lines(slot + L.x_offset, 2 * n_tokens * L.hidden);
        __builtin_ia32_mfence();
        __builtin_ia32_pause();
    }
}

// Checks and computes job seq in slot; returns DONE or FAILED.
uint32_t glm53_ct_worker::compute(uint8_t* slot, uint64_t seq)
{
    if (!payload_arrived(slot, seq))
        return GLM53_CT_FAILED;
    SlotHeader h;
    memcpy(&h, slot, sizeof h);
    const glm53_ct_pick* picks = reinterpret_cast<const glm53_ct_pick*>(slot + L.picks_offset);
    if (h.layer >= static_cast<uint32_t>(n_layers) || h.n_tokens < 1 || h.n_tokens > L.max_tokens || h.n_picks < 1 ||
        h.n_picks > L.max_tokens * L.max_picks)
        return GLM53_CT_FAILED;
    const int T = static_cast<int>(h.n_tokens);
    list.clear();
    ids.clear();
    token_mask.clear();
    bool ok = true;
    for (uint32_t i = 0; i < h.n_picks && ok; ++i) {
        const glm53_ct_pick p = picks[i];
        if (p.token < 0 || p.token >= T || p.expert < 0 || p.expert >= n_experts) {
            ok = false;
            break;
        }
        int& at = index_of[p.expert];
        if (at < 0) {
            glm53_ce_expert e = table[static_cast<size_t>(h.layer) * n_experts + p.expert];
            load_trellises(table[static_cast<size_t>(h.layer) * n_experts + p.expert], e);  // glm53_ct_worker_repoint's
            if (!e.gate.trellis) {
                ok = false;
                break;
            }
            at = static_cast<int>(list.size());
            list.push_back(e);
            ids.push_back(p.expert);
            token_mask.push_back(0);
            weights.resize(list.size() * T);
            for (int t = 0; t < T; ++t)
                weights[at * T + t] = 0.0f;
        }
        if (token_mask[at] & (1u << p.token)) {
            ok = false;  // the same (token, expert) twice
            break;
        }
        token_mask[at] |= static_cast<uint8_t>(1u << p.token);
        weights[at * T + p.token] = p.weight;
    }
    for (int e : ids)
        index_of[e] = -1;
    if (!ok)
        return GLM53_CT_FAILED;
    float* out = reinterpret_cast<float*>(slot + L.out_offset);
    memset(out, 0, sizeof(float) * T * L.hidden);
    while (hold.load(std::memory_order_acquire) && !stop.load(std::memory_order_acquire))
        nap(200);
    const int rc = glm53_ce_experts(pool, list.data(), static_cast<int32_t>(list.size()), slot + L.x_offset, 1, T,
                                    weights.data(), act_limit, out, isa, codebook);
    if (rc != GLM53_CE_OK)
        return GLM53_CT_FAILED;
    COUNT(experts, list.size());
    COUNT(picks, h.n_picks);
    COUNT(tokens, T);
    return GLM53_CT_DONE;
}

void glm53_ct_worker::process(uint64_t seq)
{
    const uint64_t t0 = now_ns();
    COUNT(jobs, 1);
    uint64_t depth = 1;
    for (uint64_t i = 0; i < L.slots; ++i) {  // other jobs published and not yet claimed
        const uint64_t j = load(job_ptr(ring, i));
        if (i != seq % L.slots && state_of(j) == GLM53_CT_PUBLISHED && seq_of(load(ack_ptr(ring, i))) < seq_of(j))
            ++depth;
    }
    auto& max_depth = counter(offsetof(glm53_ct_counters, max_queue_depth));
    for (uint64_t seen = max_depth.load(std::memory_order_relaxed); depth > seen && !max_depth.compare_exchange_weak(seen, depth);) {
    }
    uint8_t* slot = slot_base(ring, seq % L.slots);
    const uint32_t result = compute(slot, seq);
    // The result is published either way; whether it counts is the producer's decision alone: a producer that took
    // the job back computes it itself and never reads this one.
    const uint64_t job = store_then_load(ack_ptr(ring, seq % L.slots), word_of(seq, result), job_ptr(ring, seq % L.slots));
    if (job == word_of(seq, GLM53_CT_TAKEN_BACK))
        COUNT(taken_back_after_claim, 1);
    else if (result == GLM53_CT_DONE)
        COUNT(done, 1);
    else
        COUNT(failed, 1);
    COUNT(busy_ns, now_ns() - t0);
}

// Asleep until glm53_ct_worker_wake, a stop, or PARK_CHECK_MS (after which the caller looks at the ring again: a
// producer that never wakes the worker finds its jobs late, not lost).
void glm53_ct_worker::park(uint32_t gen)
{
    parked.store(1, std::memory_order_seq_cst);
    if (wake_gen.load(std::memory_order_seq_cst) == gen && !stop.load(std::memory_order_acquire))
        futex_wait_ms(wake_gen, gen, PARK_CHECK_MS);
    parked.store(0, std::memory_order_seq_cst);
}

void glm53_ct_worker::run()
{
    uint64_t* next = reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(ring) + WORKER_NEXT);
    uint64_t seq = load(next);
    auto idle_since = clock_type::now(), woken = idle_since;
    const auto spin = std::chrono::microseconds(spin_us), park_after = std::chrono::microseconds(park_us);
    const auto max_step = std::chrono::milliseconds(MAX_STEP_MS);
    int polls = 0;
    int nap_now = FIRST_NAP_US < nap_us ? FIRST_NAP_US : nap_us;
    uint32_t gen = wake_gen.load(std::memory_order_acquire);
    while (!stop.load(std::memory_order_acquire)) {
        uint64_t* job = job_ptr(ring, seq % L.slots);
        const uint64_t v = load(job);
        const uint64_t q = seq_of(v);
        const uint32_t st = state_of(v);
        if (q < seq) {  // not published yet
            const uint32_t g = wake_gen.load(std::memory_order_acquire);
            if (g != gen) {  // a decode step starts (or ends): spin again
                gen = g;
                idle_since = woken = clock_type::now();
                nap_now = FIRST_NAP_US < nap_us ? FIRST_NAP_US : nap_us;
            }
            if (++polls % 64 == 0) {
                const auto now = clock_type::now();
                if (in_step.load(std::memory_order_relaxed) && now - woken < max_step)
                    idle_since = now;  // a step in flight: spin (its jobs come with no notice)
                const auto idle = now - idle_since;
                if (park_us > 0 && idle >= park_after)
                    park(gen);  // no decode in flight: no wake-ups at all until the next one
                else if (idle >= spin) {
                    COUNT(naps, 1);
                    nap(nap_now);  // naps double up to nap_us: a long idle costs few wake-ups
                    nap_now = nap_now * 2 < nap_us ? nap_now * 2 : nap_us;
                }
            } else
                __builtin_ia32_pause();
            continue;
        }
        uint64_t* ack = ack_ptr(ring, seq % L.slots);
        if (q == seq && st == GLM53_CT_PUBLISHED &&
            store_then_load(ack, word_of(seq, GLM53_CT_CLAIMED), job) == word_of(seq, GLM53_CT_PUBLISHED)) {
            process(seq);  // claimed, and the producer had not taken it back when we looked after claiming
            idle_since = clock_type::now();
            nap_now = FIRST_NAP_US < nap_us ? FIRST_NAP_US : nap_us;
        } else {
            // taken back before the claim (or a later job: an earlier life of a worker on this ring left this one)
            if (q == seq)
                store(ack, word_of(seq, GLM53_CT_SKIPPED));
            COUNT(taken_back_before_claim, 1);
        }
        store(next, ++seq);
    }
}

extern "C" {

uint64_t glm53_ct_payload_sum(const void* picks, int32_t n_picks, const void* x, int32_t n_tokens, int32_t hidden, uint64_t seq)
{
    // words in two runs with their global index i: the picks' (i from 0), then the rows' (i from 3 * n_picks); the
    // device kernels sum the same terms in another order (the sum is commutative mod 2^64)
    uint64_t sum = seq * GLM53_CT_SUM_SEQ;
    const uint32_t* p = static_cast<const uint32_t*>(picks);
    const uint64_t np = 3ull * (n_picks > 0 ? n_picks : 0);
    for (uint64_t i = 0; i < np; ++i)
        sum += static_cast<uint64_t>(p[i]) * (2 * i + 1);
    const uint32_t* w = static_cast<const uint32_t*>(x);
    const uint64_t nx = static_cast<uint64_t>(n_tokens > 0 ? n_tokens : 0) * static_cast<uint64_t>(hidden > 0 ? hidden : 0) / 2;
    for (uint64_t i = 0; i < nx; ++i)
        sum += static_cast<uint64_t>(w[i]) * (2 * (np + i) + 1);
    return sum;
}

const char* glm53_ct_error(void) { return last_error.c_str(); }

// glm53_ct_abi, over every struct and number of the header (generated from it by glm53/native/bindgen.py)
#include "cpu_tier_abi.inc"

int32_t glm53_ct_ring_layout(int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks, glm53_ct_layout* out)
{
    if (!out)
        return fail(GLM53_CE_EINVAL, "ring_layout: out is NULL");
    if (slots < 1)
        return fail(GLM53_CE_EINVAL, "ring_layout: slots is " + std::to_string(slots) + ", below 1");
    if (hidden < 128 || hidden % 128)
        return fail(GLM53_CE_EINVAL, "ring_layout: hidden is " + std::to_string(hidden) + ", not a positive multiple of 128");
    if (max_tokens < 1 || max_tokens > GLM53_CE_MAX_ROWS)
        return fail(GLM53_CE_EINVAL, "ring_layout: max_tokens is " + std::to_string(max_tokens) + ", not in 1.." +
                                         std::to_string(GLM53_CE_MAX_ROWS) + " (GLM53_CE_MAX_ROWS)");
    if (max_picks < 1 || max_picks > 64)
        return fail(GLM53_CE_EINVAL, "ring_layout: max_picks is " + std::to_string(max_picks) + ", not in 1..64");
    glm53_ct_layout L{};
    L.magic = GLM53_CT_MAGIC;
    L.version = GLM53_CT_VERSION;
    L.slots = slots;
    L.hidden = hidden;
    L.max_tokens = max_tokens;
    L.max_picks = max_picks;
    L.slots_offset = GLM53_CT_RING_HEADER;
    L.picks_offset = GLM53_CT_ALIGN;
    L.x_offset = L.picks_offset + align_up(sizeof(glm53_ct_pick) * max_tokens * max_picks);
    L.out_offset = L.x_offset + align_up(2ull * max_tokens * hidden);
    L.slot_bytes = L.out_offset + align_up(4ull * max_tokens * hidden);
    L.total_bytes = L.slots_offset + L.slot_bytes * slots;
    *out = L;
    return GLM53_CE_OK;
}

int32_t glm53_ct_ring_init(void* mem, uint64_t bytes, int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks)
{
    glm53_ct_layout L;
    const int32_t rc = glm53_ct_ring_layout(slots, hidden, max_tokens, max_picks, &L);
    if (rc != GLM53_CE_OK)
        return rc;
    if (!mem || reinterpret_cast<uintptr_t>(mem) % GLM53_CT_ALIGN)
        return fail(GLM53_CE_EINVAL, std::string("ring_init: mem is ") + (mem ? "not 128-byte aligned" : "NULL"));
    if (bytes < L.total_bytes)
        return fail(GLM53_CE_EINVAL, "ring_init: bytes is " + std::to_string(bytes) + ", below the ring's total_bytes " +
                                         std::to_string(L.total_bytes));
    memset(mem, 0, L.total_bytes);  // every slot EMPTY(0)
    memcpy(mem, &L, sizeof L);
    store(reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(mem) + WORKER_NEXT), 1);
    return GLM53_CE_OK;
}

uint64_t glm53_ct_slot_word(const void* ring, int32_t slot, int32_t which)
{
    void* r = const_cast<void*>(ring);
    return load(which ? ack_ptr(r, static_cast<uint64_t>(slot)) : job_ptr(r, static_cast<uint64_t>(slot)));
}

int32_t glm53_ct_worker_repoint(glm53_ct_worker* worker, const int64_t* entries, const uint64_t* trellises, int32_t n)
{
    if (!worker || n < 0 || (n > 0 && (!entries || !trellises)))
        return fail(GLM53_CE_EINVAL, "worker_repoint: need a worker, n >= 0 and, for n > 0, entries and trellises");
    const int64_t size = static_cast<int64_t>(worker->n_layers) * worker->n_experts;
    for (int32_t i = 0; i < n; ++i) {  // all checked before any is stored: a refused call changes nothing
        const int64_t at = entries[i];
        if (at < 0 || at >= size || !worker->table[static_cast<size_t>(at)].gate.trellis)
            return fail(GLM53_CE_EINVAL, "worker_repoint: entry " + std::to_string(at) + " is not a registered expert of " +
                                             std::to_string(worker->n_layers) + " layers x " +
                                             std::to_string(worker->n_experts) + " experts");
        if (!trellises[3 * i] || !trellises[3 * i + 1] || !trellises[3 * i + 2])
            return fail(GLM53_CE_EINVAL, "worker_repoint: entry " + std::to_string(at) + " gets a NULL trellis");
    }
    for (int32_t i = 0; i < n; ++i) {
        glm53_ce_expert& e = worker->table[static_cast<size_t>(entries[i])];
        __atomic_store_n(&e.gate.trellis, reinterpret_cast<const int16_t*>(trellises[3 * i]), __ATOMIC_RELEASE);
        __atomic_store_n(&e.up.trellis, reinterpret_cast<const int16_t*>(trellises[3 * i + 1]), __ATOMIC_RELEASE);
        __atomic_store_n(&e.down.trellis, reinterpret_cast<const int16_t*>(trellises[3 * i + 2]), __ATOMIC_RELEASE);
    }
    return GLM53_CE_OK;
}

glm53_ct_worker* glm53_ct_worker_start(void* ring, const glm53_ce_expert* table, int32_t n_layers, int32_t n_experts,
                                       float act_limit, glm53_ce_pool* pool, int32_t isa, int32_t codebook, int32_t cpu,
                                       int32_t spin_us, int32_t nap_us, int32_t park_us)
{
    if (check_ring(ring) != GLM53_CE_OK)
        return nullptr;
    const glm53_ct_layout& L = layout_of(ring);
    std::string refused;
    if (!table)
        refused = "table is NULL";
    else if (n_layers < 1 || n_experts < 1)
        refused = "n_layers and n_experts are " + std::to_string(n_layers) + " and " + std::to_string(n_experts) +
                  ": both must be >= 1";
    else if (!(act_limit >= 0.0f))
        refused = "act_limit is " + std::to_string(act_limit) + ": it must be >= 0 (0: no clamp)";
    else if (spin_us < 0 || nap_us < 1 || park_us < 0)
        refused = "spin_us, nap_us and park_us are " + std::to_string(spin_us) + ", " + std::to_string(nap_us) + " and " +
                  std::to_string(park_us) + ": they must be >= 0, >= 1 and >= 0";
    else if (codebook < 0 || codebook >= GLM53_CE_CODEBOOK_COUNT)
        refused = "codebook is " + std::to_string(codebook) + ", not a GLM53_CE_CODEBOOK_* (0.." +
                  std::to_string(GLM53_CE_CODEBOOK_COUNT - 1) + ")";
    if (!refused.empty()) {
        fail(GLM53_CE_EINVAL, "worker_start: " + refused);
        return nullptr;
    }
    const size_t n = static_cast<size_t>(n_layers) * n_experts;
    for (size_t i = 0; i < n; ++i) {
        const glm53_ce_expert& e = table[i];
        if (!e.gate.trellis)
            continue;
        const int32_t hidden = static_cast<int32_t>(L.hidden), inter = e.gate.out_features;
        if (e.gate.in_features != hidden || e.up.in_features != hidden || e.up.out_features != inter ||
            e.down.in_features != inter || e.down.out_features != hidden || !e.up.trellis || !e.down.trellis ||
            !e.gate.suh || !e.gate.svh || !e.up.suh || !e.up.svh || !e.down.suh || !e.down.svh ||
            inter != table[0].gate.out_features) {
            fail(GLM53_CE_EINVAL, "worker_start: table entry " + std::to_string(i) + " (layer " +
                                      std::to_string(i / n_experts) + ", expert " + std::to_string(i % n_experts) +
                                      ") is incomplete or its dims differ from the ring's hidden " +
                                      std::to_string(hidden) + " and the other experts'");
            return nullptr;
        }
    }
    glm53_ct_worker* w = new (std::nothrow) glm53_ct_worker;
    if (!w) {
        fail(GLM53_CE_ENOMEM, "out of memory");
        return nullptr;
    }
    w->ring = ring;
    w->L = L;
    w->table.assign(table, table + n);
    w->n_layers = n_layers;
    w->n_experts = n_experts;
    w->act_limit = act_limit;
    w->pool = pool;
    w->isa = isa;
    w->codebook = codebook;
    w->spin_us = spin_us;
    w->nap_us = nap_us;
    w->park_us = park_us;
    w->index_of.assign(n_experts, -1);
    try {
        w->thread = std::thread([w] { w->run(); });
    } catch (const std::system_error& e) {
        fail(GLM53_CE_ENOMEM, std::string("cannot start the CPU-tier worker thread: ") + e.what());
        delete w;
        return nullptr;
    }
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        const int rc = pthread_setaffinity_np(w->thread.native_handle(), sizeof set, &set);
        if (rc != 0) {
            fail(GLM53_CE_ECPU, "cannot pin the CPU-tier worker to CPU " + std::to_string(cpu) + ": " + strerror(rc));
            glm53_ct_worker_stop(w);
            return nullptr;
        }
    }
    return w;
}

void glm53_ct_worker_stop(glm53_ct_worker* worker)
{
    if (!worker)
        return;
    worker->stop.store(true, std::memory_order_release);
    glm53_ct_worker_wake(worker);
    if (worker->thread.joinable())
        worker->thread.join();
    delete worker;
}

void glm53_ct_worker_counters(const glm53_ct_worker* worker, glm53_ct_counters* out)
{
    uint64_t* fields = reinterpret_cast<uint64_t*>(out);
    for (size_t i = 0; i < sizeof(glm53_ct_counters) / sizeof(uint64_t); ++i)
        fields[i] = worker->counters[i].load(std::memory_order_relaxed);
}

void glm53_ct_worker_wake(glm53_ct_worker* worker)
{
    worker->in_step.store(1, std::memory_order_relaxed);
    worker->wake_gen.fetch_add(1, std::memory_order_seq_cst);
    if (worker->parked.load(std::memory_order_seq_cst))
        futex_wake_all(worker->wake_gen);
}

void glm53_ct_worker_rest(glm53_ct_worker* worker)
{
    worker->in_step.store(0, std::memory_order_relaxed);
    worker->wake_gen.fetch_add(1, std::memory_order_seq_cst);  // the spin_us tail counts from here
}

int32_t glm53_ct_worker_parked(const glm53_ct_worker* worker) { return worker->parked.load(std::memory_order_acquire); }

void glm53_ct_worker_debug_hold(glm53_ct_worker* worker, int32_t hold)
{
    worker->hold.store(hold, std::memory_order_release);
}

int32_t glm53_ct_producer_publish(void* ring, uint64_t seq, int32_t layer, int32_t n_tokens, const glm53_ct_pick* picks,
                                  int32_t n_picks, const uint16_t* x)
{
    if (check_ring(ring) != GLM53_CE_OK)
        return GLM53_CE_EINVAL;
    const glm53_ct_layout& L = layout_of(ring);
    if (seq < 1 || seq >= (1ull << 56))
        return fail(GLM53_CE_EINVAL, "publish: seq is " + std::to_string(seq) + ", not in 1..2^56 - 1");
    if (layer < 0)
        return fail(GLM53_CE_EINVAL, "publish: layer is " + std::to_string(layer) + ", below 0");
    if (n_tokens < 1 || static_cast<uint32_t>(n_tokens) > L.max_tokens)
        return fail(GLM53_CE_EINVAL, "publish: n_tokens is " + std::to_string(n_tokens) + ", not in 1.." +
                                         std::to_string(L.max_tokens) + " (the ring's max_tokens)");
    if (n_picks < 1 || static_cast<uint32_t>(n_picks) > L.max_tokens * L.max_picks)
        return fail(GLM53_CE_EINVAL, "publish: n_picks is " + std::to_string(n_picks) + ", not in 1.." +
                                         std::to_string(L.max_tokens * L.max_picks) + " (max_tokens * max_picks)");
    if (!picks || !x)
        return fail(GLM53_CE_EINVAL, std::string("publish: ") + (!picks ? "picks" : "x") + " is NULL");
    uint8_t* slot = slot_base(ring, seq % L.slots);
    if (!slot_free(ring, seq % L.slots))
        return fail(GLM53_CT_EBUSY, "publish: the worker still holds slot " + std::to_string(seq % L.slots));
    if (seq_of(load(job_ptr(ring, seq % L.slots))) >= seq)
        return fail(GLM53_CE_EINVAL, "publish: job numbers must grow (the slot held job " +
                                         std::to_string(seq_of(load(job_ptr(ring, seq % L.slots)))) + ")");
    const uint32_t fields[3] = {static_cast<uint32_t>(layer), static_cast<uint32_t>(n_tokens), static_cast<uint32_t>(n_picks)};
    memcpy(slot + offsetof(SlotHeader, layer), fields, sizeof fields);
    memcpy(slot + L.picks_offset, picks, sizeof(glm53_ct_pick) * n_picks);
    memcpy(slot + L.x_offset, x, 2ull * n_tokens * L.hidden);
    const uint64_t sum = glm53_ct_payload_sum(picks, n_picks, x, n_tokens, static_cast<int32_t>(L.hidden), seq);
    memcpy(slot + GLM53_CT_SUM, &sum, sizeof sum);
    store(job_ptr(ring, seq % L.slots), word_of(seq, GLM53_CT_PUBLISHED));
    return GLM53_CE_OK;
}

int32_t glm53_ct_producer_take_back(void* ring, uint64_t seq, int32_t* after_claim)
{
    if (check_ring(ring) != GLM53_CE_OK)
        return GLM53_CE_EINVAL;
    const uint64_t slot = seq % layout_of(ring).slots;
    uint64_t* job = job_ptr(ring, slot);
    if (load(job) != word_of(seq, GLM53_CT_PUBLISHED))
        return fail(GLM53_CT_ESTATE, "take_back: job " + std::to_string(seq) + " is not outstanding");
    const uint64_t a = store_then_load(job, word_of(seq, GLM53_CT_TAKEN_BACK), ack_ptr(ring, slot));
    // Not claimed when we looked: the worker, which looks again after claiming, will skip it. Claimed (or even
    // finished): its result is discarded, since only this side decides what counts.
    if (after_claim)
        *after_claim = seq_of(a) == seq;
    return GLM53_CT_TAKEN_BACK;
}

int32_t glm53_ct_producer_wait(void* ring, uint64_t seq, int64_t timeout_us, int32_t* after_claim)
{
    if (check_ring(ring) != GLM53_CE_OK)
        return GLM53_CE_EINVAL;
    const uint64_t slot = seq % layout_of(ring).slots;
    if (load(job_ptr(ring, slot)) != word_of(seq, GLM53_CT_PUBLISHED))
        return fail(GLM53_CT_ESTATE, "wait: job " + std::to_string(seq) + " is not outstanding");
    uint64_t* ack = ack_ptr(ring, slot);
    const uint64_t t0 = now_ns();
    const uint64_t spin_until = t0 + 20000;
    for (;;) {
        const uint64_t a = load(ack);
        if (a == word_of(seq, GLM53_CT_DONE) || a == word_of(seq, GLM53_CT_FAILED))
            return static_cast<int32_t>(state_of(a));
        const uint64_t t = now_ns();
        if (timeout_us >= 0 && t - t0 >= static_cast<uint64_t>(timeout_us) * 1000)
            return glm53_ct_producer_take_back(ring, seq, after_claim);
        if (t < spin_until)
            __builtin_ia32_pause();
        else
            nap(10);  // the host stand-in for the GPU does not spin for long: tests share few cores
    }
}

}  // extern "C"
