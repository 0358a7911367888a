"""The ctypes declarations of expert_cache.h: generated from them by
``python -m glm53.native.bindgen`` (``make bindings``); do not edit. A test checks that it is in step, and
``glm53.native.abi.bind`` checks it against the loaded library."""

import ctypes


# ---- native/ec/expert_cache.h

EC_MAX_EXPERTS = 512
EC_MAX_ADMIT = 16
C_PICKS = 0
C_HITS = 1
C_ADMITS = 2
C_EVICTS = 3
C_STEPS = 4
C_N = 8
PF_MAX_SLOTS = 16
PF_MAX_PREDICTED = 64
PF_COPIED = 0
PF_USED = 1
PF_WASTED = 2
PF_PLANS = 3
PF_N = 4
LE_MISSES = 0
LE_FALLBACK = 1
LE_ADMISSIONS = 2
LE_PREFETCH = 3
LE_TIER_IO = 4
LE_COPIES = 5
LE_PROBE = 6
LE_KINDS = 7
CT_EMPTY = 0
CT_PUBLISHED = 1
CT_CLAIMED = 2
CT_DONE = 3
CT_FAILED = 4
CT_TAKEN_BACK = 5
CT_SKIPPED = 6
CT_ACK = 64
CT_SUM = 24
CT_SUM_SEQ = 2177342782468422677
CT_OUT_NONE = 0
CT_OUT_DONE = 1
CT_OUT_FAILED = 2
CT_OUT_TAKEN_BACK_BEFORE_CLAIM = 3
CT_OUT_TAKEN_BACK_AFTER_CLAIM = 4
CT_C_PUBLISHED = 0
CT_C_BUSY = 1
CT_C_DONE = 2
CT_C_FAILED = 3
CT_C_TAKEN_BACK_BEFORE_CLAIM = 4
CT_C_TAKEN_BACK_AFTER_CLAIM = 5
CT_C_WAIT_NS = 6
CT_C_FALLBACK_JOBS = 7
CT_C_FALLBACK_EXPERTS = 8
CT_C_PROBES = 9
CT_N = 16
CT_SPLIT_MAX_PICKS = 64
CT_RECORD = 128

ec_counter = {
    "C_PICKS": 0,
    "C_HITS": 1,
    "C_ADMITS": 2,
    "C_EVICTS": 3,
    "C_STEPS": 4,
    "C_N": 8,
}

pf_counter = {
    "PF_COPIED": 0,
    "PF_USED": 1,
    "PF_WASTED": 2,
    "PF_PLANS": 3,
    "PF_N": 4,
}

le_kind = {
    "LE_MISSES": 0,
    "LE_FALLBACK": 1,
    "LE_ADMISSIONS": 2,
    "LE_PREFETCH": 3,
    "LE_TIER_IO": 4,
    "LE_COPIES": 5,
    "LE_PROBE": 6,
    "LE_KINDS": 7,
}

ct_state = {
    "CT_EMPTY": 0,
    "CT_PUBLISHED": 1,
    "CT_CLAIMED": 2,
    "CT_DONE": 3,
    "CT_FAILED": 4,
    "CT_TAKEN_BACK": 5,
    "CT_SKIPPED": 6,
}

ct_outcome = {
    "CT_OUT_NONE": 0,
    "CT_OUT_DONE": 1,
    "CT_OUT_FAILED": 2,
    "CT_OUT_TAKEN_BACK_BEFORE_CLAIM": 3,
    "CT_OUT_TAKEN_BACK_AFTER_CLAIM": 4,
}

ct_counter = {
    "CT_C_PUBLISHED": 0,
    "CT_C_BUSY": 1,
    "CT_C_DONE": 2,
    "CT_C_FAILED": 3,
    "CT_C_TAKEN_BACK_BEFORE_CLAIM": 4,
    "CT_C_TAKEN_BACK_AFTER_CLAIM": 5,
    "CT_C_WAIT_NS": 6,
    "CT_C_FALLBACK_JOBS": 7,
    "CT_C_FALLBACK_EXPERTS": 8,
    "CT_C_PROBES": 9,
    "CT_N": 16,
}


class EcState(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("freq", ctypes.c_void_p),
        ("slot_of", ctypes.c_void_p),
        ("owner", ctypes.c_void_p),
        ("picks", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("home", ctypes.c_void_p),
        ("slot_addr", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("off_up", ctypes.c_int64),
        ("off_down", ctypes.c_int64),
        ("jobs", ctypes.c_void_p),
        ("num_jobs", ctypes.c_void_p),
    ]


class EcRecency(ctypes.Structure):
    _fields_ = [
        ("recent", ctypes.c_void_p),
        ("prev", ctypes.c_void_p),
        ("reuse", ctypes.c_void_p),
        ("decay", ctypes.c_float),
        ("weight", ctypes.c_float),
        ("keep", ctypes.c_float),
    ]


class EcPool(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_int),
        ("slot_addr", ctypes.c_void_p),
        ("owner", ctypes.c_void_p),
        ("num", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
    ]


class LeLink(ctypes.Structure):
    _fields_ = [
        ("zero_copy_ns_per_byte", ctypes.c_double),
        ("copy_ns_per_byte", ctypes.c_double),
        ("counters", ctypes.c_void_p),
    ]


class CtRing(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("slots", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("max_picks", ctypes.c_uint32),
        ("slot_bytes", ctypes.c_uint64),
        ("slots_offset", ctypes.c_uint64),
        ("picks_offset", ctypes.c_uint64),
        ("x_offset", ctypes.c_uint64),
        ("out_offset", ctypes.c_uint64),
    ]


# restype and argtypes of every prototype of native/ec/expert_cache.h
FUNCTIONS = {
    # const char* ec_error(void)
    "ec_error": (ctypes.c_char_p, []),
    # int ec_abi(const char* name, int64_t* value)
    "ec_abi": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_void_p]),
    # int ec_step(const EcState* s, const EcRecency* rc, int layer, const int64_t* sel, int n, int row, float decay, float hysteresis, int max_admit, int64_t block_bytes, int copy_blocks, cudaStream_t stream)
    "ec_step": (ctypes.c_int, [
        ctypes.POINTER(EcState), ctypes.POINTER(EcRecency), ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    ]),
    # int ec_assign(const EcState* s, const int32_t* entries, int n, cudaStream_t stream)
    "ec_assign": (ctypes.c_int, [ctypes.POINTER(EcState), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
    # int ec_read_probe(const void* src, int64_t bytes, unsigned int* out, int blocks, cudaStream_t stream)
    "ec_read_probe": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
    # int ec_prefetch(const EcState* s, const EcPool* p, int layer, const int64_t* predicted, const float* scores, int rows, int n_pred, float min_score, int max_copies, int64_t block_bytes, int copy_blocks, cudaStream_t stream)
    "ec_prefetch": (ctypes.c_int, [
        ctypes.POINTER(EcState), ctypes.POINTER(EcPool), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    ]),
    # int ec_prefetch_release(const EcState* s, const EcPool* p, int layer, const int64_t* sel, int n_sel, cudaStream_t stream)
    "ec_prefetch_release": (ctypes.c_int, [
        ctypes.POINTER(EcState), ctypes.POINTER(EcPool), ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
    ]),
    # int le_picks(const LeLink* link, const EcState* s, int layer, const int64_t* sel, const void* rw, int n, int64_t block_bytes, int kind, int blocks, cudaStream_t stream)
    "le_picks": (ctypes.c_int, [
        ctypes.POINTER(LeLink), ctypes.POINTER(EcState), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p
    ]),
    # int le_counts(const LeLink* link, const EcState* s, int layer, const int64_t* count, int64_t block_bytes, int kind, int blocks, cudaStream_t stream)
    "le_counts": (ctypes.c_int, [
        ctypes.POINTER(LeLink), ctypes.POINTER(EcState), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p
    ]),
    # int le_units(const LeLink* link, const int32_t* units, int64_t unit_bytes, int64_t fixed_bytes, int copy_engine, int kind, int blocks, cudaStream_t stream)
    "le_units": (ctypes.c_int, [
        ctypes.POINTER(LeLink), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p
    ]),
    # int le_tier_io(const LeLink* link, const int64_t* status, const int32_t* outcome, int64_t in_bytes, int64_t out_bytes, int blocks, cudaStream_t stream)
    "le_tier_io": (ctypes.c_int, [
        ctypes.POINTER(LeLink), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
        ctypes.c_void_p
    ]),
    # int ct_split_publish(const CtRing* r, uint64_t* next_seq, int layer, int T, int topk, const int64_t* sel, void* rw, const uint16_t* y, const int32_t* slot_of, const float* freq, const uint8_t* table, int table_tokens, int table_experts, int probe_k, int64_t* status, int64_t* counters, int32_t* info, int32_t* record, cudaStream_t stream)
    "ct_split_publish": (ctypes.c_int, [
        ctypes.POINTER(CtRing), ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    ]),
    # int ct_publish(const CtRing* r, uint64_t* next_seq, int layer, int n_tokens, const int32_t* picks, int n_picks, const uint16_t* x, int64_t* status, int64_t* counters, cudaStream_t stream)
    "ct_publish": (ctypes.c_int, [
        ctypes.POINTER(CtRing), ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    ]),
    # int ct_collect(const CtRing* r, const int64_t* status, int64_t timeout_ns, const int32_t* info, int64_t per_expert_ns, int64_t floor_ns, int32_t* outcome, float* acc, int n_tokens, int add_blocks, int64_t* counters, cudaStream_t stream)
    "ct_collect": (ctypes.c_int, [
        ctypes.POINTER(CtRing), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
    ]),
    # int ct_fallback_plan(const int64_t* status, const int32_t* outcome, const int32_t* record, int n, int topk, int num_experts, int64_t* count, int64_t* token_sorted, void* weight_sorted, int64_t* counters, cudaStream_t stream)
    "ct_fallback_plan": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    ]),
    # int ct_device_pointer(void* host, void** device, int* native_atomics)
    "ct_device_pointer": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
}

# what each <prefix>_abi reports: the structs of its header, by name, and the header's numbers
ABI = {
    "ec_abi": (
        {
            "EcState": EcState,
            "EcRecency": EcRecency,
            "EcPool": EcPool,
            "LeLink": LeLink,
            "CtRing": CtRing,
        },
        {
            "EC_MAX_EXPERTS": EC_MAX_EXPERTS,
            "EC_MAX_ADMIT": EC_MAX_ADMIT,
            "C_PICKS": C_PICKS,
            "C_HITS": C_HITS,
            "C_ADMITS": C_ADMITS,
            "C_EVICTS": C_EVICTS,
            "C_STEPS": C_STEPS,
            "C_N": C_N,
            "PF_MAX_SLOTS": PF_MAX_SLOTS,
            "PF_MAX_PREDICTED": PF_MAX_PREDICTED,
            "PF_COPIED": PF_COPIED,
            "PF_USED": PF_USED,
            "PF_WASTED": PF_WASTED,
            "PF_PLANS": PF_PLANS,
            "PF_N": PF_N,
            "LE_MISSES": LE_MISSES,
            "LE_FALLBACK": LE_FALLBACK,
            "LE_ADMISSIONS": LE_ADMISSIONS,
            "LE_PREFETCH": LE_PREFETCH,
            "LE_TIER_IO": LE_TIER_IO,
            "LE_COPIES": LE_COPIES,
            "LE_PROBE": LE_PROBE,
            "LE_KINDS": LE_KINDS,
            "CT_EMPTY": CT_EMPTY,
            "CT_PUBLISHED": CT_PUBLISHED,
            "CT_CLAIMED": CT_CLAIMED,
            "CT_DONE": CT_DONE,
            "CT_FAILED": CT_FAILED,
            "CT_TAKEN_BACK": CT_TAKEN_BACK,
            "CT_SKIPPED": CT_SKIPPED,
            "CT_ACK": CT_ACK,
            "CT_SUM": CT_SUM,
            "CT_SUM_SEQ": CT_SUM_SEQ,
            "CT_OUT_NONE": CT_OUT_NONE,
            "CT_OUT_DONE": CT_OUT_DONE,
            "CT_OUT_FAILED": CT_OUT_FAILED,
            "CT_OUT_TAKEN_BACK_BEFORE_CLAIM": CT_OUT_TAKEN_BACK_BEFORE_CLAIM,
            "CT_OUT_TAKEN_BACK_AFTER_CLAIM": CT_OUT_TAKEN_BACK_AFTER_CLAIM,
            "CT_C_PUBLISHED": CT_C_PUBLISHED,
            "CT_C_BUSY": CT_C_BUSY,
            "CT_C_DONE": CT_C_DONE,
            "CT_C_FAILED": CT_C_FAILED,
            "CT_C_TAKEN_BACK_BEFORE_CLAIM": CT_C_TAKEN_BACK_BEFORE_CLAIM,
            "CT_C_TAKEN_BACK_AFTER_CLAIM": CT_C_TAKEN_BACK_AFTER_CLAIM,
            "CT_C_WAIT_NS": CT_C_WAIT_NS,
            "CT_C_FALLBACK_JOBS": CT_C_FALLBACK_JOBS,
            "CT_C_FALLBACK_EXPERTS": CT_C_FALLBACK_EXPERTS,
            "CT_C_PROBES": CT_C_PROBES,
            "CT_N": CT_N,
            "CT_SPLIT_MAX_PICKS": CT_SPLIT_MAX_PICKS,
            "CT_RECORD": CT_RECORD,
        },
    ),
}
