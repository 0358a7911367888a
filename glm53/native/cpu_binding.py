"""The ctypes declarations of cpu_expert.h, cpu_tier.h, disk_reader.h: generated from them by
``python -m glm53.native.bindgen`` (``make bindings``); do not edit. A test checks that it is in step, and
``glm53.native.abi.bind`` checks it against the loaded library."""

import ctypes


# ---- native/cpu_expert/cpu_expert.h

GLM53_CE_OK = 0
GLM53_CE_EINVAL = -1
GLM53_CE_EISA = -2
GLM53_CE_ENOMEM = -3
GLM53_CE_ECPU = -4
GLM53_CE_ISA_BEST = -1
GLM53_CE_ISA_SCALAR = 0
GLM53_CE_ISA_AVX2 = 1
GLM53_CE_ISA_AVX512 = 2
GLM53_CE_ISA_AVX512VBMI = 3
GLM53_CE_ISA_COUNT = 4
GLM53_CE_MAX_ROWS = 8
GLM53_CE_CODEBOOK_FP16 = 0
GLM53_CE_CODEBOOK_FMA = 1
GLM53_CE_CODEBOOK_INT16 = 2
GLM53_CE_CODEBOOK_COUNT = 3

glm53_ce_status = {
    "GLM53_CE_OK": 0,
    "GLM53_CE_EINVAL": -1,
    "GLM53_CE_EISA": -2,
    "GLM53_CE_ENOMEM": -3,
    "GLM53_CE_ECPU": -4,
}

glm53_ce_isa = {
    "GLM53_CE_ISA_BEST": -1,
    "GLM53_CE_ISA_SCALAR": 0,
    "GLM53_CE_ISA_AVX2": 1,
    "GLM53_CE_ISA_AVX512": 2,
    "GLM53_CE_ISA_AVX512VBMI": 3,
    "GLM53_CE_ISA_COUNT": 4,
}

glm53_ce_codebook = {
    "GLM53_CE_CODEBOOK_FP16": 0,
    "GLM53_CE_CODEBOOK_FMA": 1,
    "GLM53_CE_CODEBOOK_INT16": 2,
    "GLM53_CE_CODEBOOK_COUNT": 3,
}


class glm53_ce_linear(ctypes.Structure):
    _fields_ = [
        ("trellis", ctypes.c_void_p),
        ("suh", ctypes.c_void_p),
        ("svh", ctypes.c_void_p),
        ("in_features", ctypes.c_int32),
        ("out_features", ctypes.c_int32),
        ("bits", ctypes.c_int32),
    ]


class glm53_ce_expert(ctypes.Structure):
    _fields_ = [
        ("gate", glm53_ce_linear),
        ("up", glm53_ce_linear),
        ("down", glm53_ce_linear),
    ]


# ---- native/cpu_tier/cpu_tier.h

GLM53_CT_MAGIC = 827605831
GLM53_CT_VERSION = 3
GLM53_CT_ALIGN = 128
GLM53_CT_RING_HEADER = 256
GLM53_CT_SUM = 24
GLM53_CT_SUM_WAIT_US = 200
GLM53_CT_SUM_SEQ = 2177342782468422677
GLM53_CT_EMPTY = 0
GLM53_CT_PUBLISHED = 1
GLM53_CT_CLAIMED = 2
GLM53_CT_DONE = 3
GLM53_CT_FAILED = 4
GLM53_CT_TAKEN_BACK = 5
GLM53_CT_SKIPPED = 6
GLM53_CT_EBUSY = -5
GLM53_CT_ESTATE = -6

glm53_ct_state = {
    "GLM53_CT_EMPTY": 0,
    "GLM53_CT_PUBLISHED": 1,
    "GLM53_CT_CLAIMED": 2,
    "GLM53_CT_DONE": 3,
    "GLM53_CT_FAILED": 4,
    "GLM53_CT_TAKEN_BACK": 5,
    "GLM53_CT_SKIPPED": 6,
}


class glm53_ct_layout(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("slots", ctypes.c_uint32),
        ("hidden", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint32),
        ("max_picks", ctypes.c_uint32),
        ("slot_bytes", ctypes.c_uint64),
        ("slots_offset", ctypes.c_uint64),
        ("picks_offset", ctypes.c_uint64),
        ("x_offset", ctypes.c_uint64),
        ("out_offset", ctypes.c_uint64),
        ("total_bytes", ctypes.c_uint64),
    ]


class glm53_ct_pick(ctypes.Structure):
    _fields_ = [
        ("token", ctypes.c_int32),
        ("expert", ctypes.c_int32),
        ("weight", ctypes.c_float),
    ]


class glm53_ct_counters(ctypes.Structure):
    _fields_ = [
        ("jobs", ctypes.c_uint64),
        ("done", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("experts", ctypes.c_uint64),
        ("picks", ctypes.c_uint64),
        ("tokens", ctypes.c_uint64),
        ("busy_ns", ctypes.c_uint64),
        ("taken_back_before_claim", ctypes.c_uint64),
        ("taken_back_after_claim", ctypes.c_uint64),
        ("max_queue_depth", ctypes.c_uint64),
        ("naps", ctypes.c_uint64),
        ("payload_rereads", ctypes.c_uint64),
        ("payload_failed", ctypes.c_uint64),
    ]


# ---- native/disk/disk_reader.h

GLM53_DR_PENDING = 0
GLM53_DR_DONE = 1
GLM53_DR_FAILED = 2
GLM53_DR_SHORT_READ = -1
GLM53_DR_SLOW_READ = -2
GLM53_DR_SLOW_READ_MS = 300
GLM53_DR_C_REQUESTS = 0
GLM53_DR_C_FAILED = 1
GLM53_DR_C_BYTES = 2
GLM53_DR_C_DISK_BYTES = 3
GLM53_DR_C_BOUNCED_BYTES = 4
GLM53_DR_C_STRAIGHT_BYTES = 5
GLM53_DR_C_RETRIES = 6
GLM53_DR_C_SHORT_READS = 7
GLM53_DR_C_FALLBACKS = 8
GLM53_DR_C_PIECES = 9
GLM53_DR_C_N = 10

glm53_dr_state = {
    "GLM53_DR_PENDING": 0,
    "GLM53_DR_DONE": 1,
    "GLM53_DR_FAILED": 2,
}

glm53_dr_counter = {
    "GLM53_DR_C_REQUESTS": 0,
    "GLM53_DR_C_FAILED": 1,
    "GLM53_DR_C_BYTES": 2,
    "GLM53_DR_C_DISK_BYTES": 3,
    "GLM53_DR_C_BOUNCED_BYTES": 4,
    "GLM53_DR_C_STRAIGHT_BYTES": 5,
    "GLM53_DR_C_RETRIES": 6,
    "GLM53_DR_C_SHORT_READS": 7,
    "GLM53_DR_C_FALLBACKS": 8,
    "GLM53_DR_C_PIECES": 9,
    "GLM53_DR_C_N": 10,
}


class glm53_dr_request(ctypes.Structure):
    _fields_ = [
        ("dest", ctypes.c_void_p),
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("file", ctypes.c_int32),
        ("state", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("error_offset", ctypes.c_uint64),
    ]


# restype and argtypes of every prototype of native/cpu_expert/cpu_expert.h, native/cpu_tier/cpu_tier.h, native/disk/disk_reader.h
FUNCTIONS = {
    # const char* glm53_ce_error(void)
    "glm53_ce_error": (ctypes.c_char_p, []),
    # int32_t glm53_ce_abi(const char* name, int64_t* value)
    "glm53_ce_abi": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_void_p]),
    # const char* glm53_ce_isa_name(int32_t isa)
    "glm53_ce_isa_name": (ctypes.c_char_p, [ctypes.c_int32]),
    # int32_t glm53_ce_isa_supported(int32_t isa)
    "glm53_ce_isa_supported": (ctypes.c_int32, [ctypes.c_int32]),
    # int32_t glm53_ce_isa_best(void)
    "glm53_ce_isa_best": (ctypes.c_int32, []),
    # glm53_ce_pool* glm53_ce_pool_start(const int32_t* cpus, int32_t n_cpus, int32_t threads, int32_t spin_us, int32_t units_per_thread)
    "glm53_ce_pool_start": (ctypes.c_void_p, [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32
    ]),
    # void glm53_ce_pool_stop(glm53_ce_pool* pool)
    "glm53_ce_pool_stop": (None, [ctypes.c_void_p]),
    # int32_t glm53_ce_pool_threads(const glm53_ce_pool* pool)
    "glm53_ce_pool_threads": (ctypes.c_int32, [ctypes.c_void_p]),
    # int32_t glm53_ce_experts(glm53_ce_pool* pool, const glm53_ce_expert* experts, int32_t n_experts, const void* x, int32_t x_fp16, int32_t rows, const float* weights, float act_limit, float* out, int32_t isa, int32_t codebook)
    "glm53_ce_experts": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.POINTER(glm53_ce_expert), ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
        ctypes.c_int32, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32
    ]),
    # int32_t glm53_ce_linear_forward(const glm53_ce_linear* linear, const float* x, int32_t rows, float* y, int32_t isa, int32_t codebook)
    "glm53_ce_linear_forward": (ctypes.c_int32, [
        ctypes.POINTER(glm53_ce_linear), ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32,
        ctypes.c_int32
    ]),
    # int32_t glm53_ce_mul1_values(const uint16_t* states, int32_t n, float* out, int32_t isa, int32_t codebook)
    "glm53_ce_mul1_values": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32
    ]),
    # uint64_t glm53_ce_read_bytes(glm53_ce_pool* pool, const void* buf, uint64_t bytes)
    "glm53_ce_read_bytes": (ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]),
    # const char* glm53_ct_error(void)
    "glm53_ct_error": (ctypes.c_char_p, []),
    # int32_t glm53_ct_abi(const char* name, int64_t* value)
    "glm53_ct_abi": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_void_p]),
    # uint64_t glm53_ct_payload_sum(const void* picks, int32_t n_picks, const void* x, int32_t n_tokens, int32_t hidden, uint64_t seq)
    "glm53_ct_payload_sum": (ctypes.c_uint64, [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64
    ]),
    # int32_t glm53_ct_ring_layout(int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks, glm53_ct_layout* out)
    "glm53_ct_ring_layout": (ctypes.c_int32, [
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(glm53_ct_layout)
    ]),
    # int32_t glm53_ct_ring_init(void* mem, uint64_t bytes, int32_t slots, int32_t hidden, int32_t max_tokens, int32_t max_picks)
    "glm53_ct_ring_init": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32
    ]),
    # uint64_t glm53_ct_slot_word(const void* ring, int32_t slot, int32_t which)
    "glm53_ct_slot_word": (ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    # glm53_ct_worker* glm53_ct_worker_start(void* ring, const glm53_ce_expert* table, int32_t n_layers, int32_t n_experts, float act_limit, glm53_ce_pool* pool, int32_t isa, int32_t codebook, int32_t cpu, int32_t spin_us, int32_t nap_us, int32_t park_us)
    "glm53_ct_worker_start": (ctypes.c_void_p, [
        ctypes.c_void_p, ctypes.POINTER(glm53_ce_expert), ctypes.c_int32, ctypes.c_int32, ctypes.c_float,
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32
    ]),
    # int32_t glm53_ct_worker_repoint(glm53_ct_worker* worker, const int64_t* entries, const uint64_t* trellises, int32_t n)
    "glm53_ct_worker_repoint": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]),
    # void glm53_ct_worker_wake(glm53_ct_worker* worker)
    "glm53_ct_worker_wake": (None, [ctypes.c_void_p]),
    # void glm53_ct_worker_rest(glm53_ct_worker* worker)
    "glm53_ct_worker_rest": (None, [ctypes.c_void_p]),
    # int32_t glm53_ct_worker_parked(const glm53_ct_worker* worker)
    "glm53_ct_worker_parked": (ctypes.c_int32, [ctypes.c_void_p]),
    # void glm53_ct_worker_stop(glm53_ct_worker* worker)
    "glm53_ct_worker_stop": (None, [ctypes.c_void_p]),
    # void glm53_ct_worker_counters(const glm53_ct_worker* worker, glm53_ct_counters* out)
    "glm53_ct_worker_counters": (None, [ctypes.c_void_p, ctypes.POINTER(glm53_ct_counters)]),
    # void glm53_ct_worker_debug_hold(glm53_ct_worker* worker, int32_t hold)
    "glm53_ct_worker_debug_hold": (None, [ctypes.c_void_p, ctypes.c_int32]),
    # int32_t glm53_ct_producer_publish(void* ring, uint64_t seq, int32_t layer, int32_t n_tokens, const glm53_ct_pick* picks, int32_t n_picks, const uint16_t* x)
    "glm53_ct_producer_publish": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(glm53_ct_pick), ctypes.c_int32,
        ctypes.c_void_p
    ]),
    # int32_t glm53_ct_producer_wait(void* ring, uint64_t seq, int64_t timeout_us, int32_t* after_claim)
    "glm53_ct_producer_wait": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p]),
    # int32_t glm53_ct_producer_take_back(void* ring, uint64_t seq, int32_t* after_claim)
    "glm53_ct_producer_take_back": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]),
    # int32_t glm53_dr_abi(const char* name, int64_t* value)
    "glm53_dr_abi": (ctypes.c_int32, [ctypes.c_char_p, ctypes.c_void_p]),
    # const char* glm53_dr_error(void)
    "glm53_dr_error": (ctypes.c_char_p, []),
    # void* glm53_dr_start(const char* const* paths, int32_t files, int32_t threads, int32_t direct, uint64_t align, uint64_t piece_bytes)
    "glm53_dr_start": (ctypes.c_void_p, [
        ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64,
        ctypes.c_uint64
    ]),
    # void glm53_dr_stop(void* reader)
    "glm53_dr_stop": (None, [ctypes.c_void_p]),
    # int32_t glm53_dr_submit(void* reader, glm53_dr_request* requests, int32_t n, uint64_t piece_bytes)
    "glm53_dr_submit": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.POINTER(glm53_dr_request), ctypes.c_int32, ctypes.c_uint64
    ]),
    # void glm53_dr_cancel(void* reader, glm53_dr_request* requests, int32_t n)
    "glm53_dr_cancel": (None, [ctypes.c_void_p, ctypes.POINTER(glm53_dr_request), ctypes.c_int32]),
    # int32_t glm53_dr_wait(void* reader, const glm53_dr_request* requests, int32_t n, int64_t timeout_us)
    "glm53_dr_wait": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.POINTER(glm53_dr_request), ctypes.c_int32, ctypes.c_int64
    ]),
    # int32_t glm53_dr_file_direct(void* reader, int32_t file)
    "glm53_dr_file_direct": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    # int32_t glm53_dr_file_fallback(void* reader, int32_t file, int64_t* offset)
    "glm53_dr_file_fallback": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]),
    # int32_t glm53_dr_file_alignment(void* reader, int32_t file, uint64_t* mem_align, uint64_t* offset_align)
    "glm53_dr_file_alignment": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]),
    # void glm53_dr_counters(void* reader, uint64_t* out)
    "glm53_dr_counters": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    # int32_t glm53_dr_set_cpus(void* reader, const int32_t* cpus, int32_t n)
    "glm53_dr_set_cpus": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]),
    # int32_t glm53_dr_thread_cpus(void* reader, int32_t thread, int32_t* cpus, int32_t capacity)
    "glm53_dr_thread_cpus": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32]),
    # int32_t glm53_dr_inject(void* reader, int32_t file, uint64_t offset, int32_t error, int32_t times)
    "glm53_dr_inject": (ctypes.c_int32, [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32
    ]),
}

# what each <prefix>_abi reports: the structs of its header, by name, and the header's numbers
ABI = {
    "glm53_ce_abi": (
        {
            "glm53_ce_linear": glm53_ce_linear,
            "glm53_ce_expert": glm53_ce_expert,
        },
        {
            "GLM53_CE_OK": GLM53_CE_OK,
            "GLM53_CE_EINVAL": GLM53_CE_EINVAL,
            "GLM53_CE_EISA": GLM53_CE_EISA,
            "GLM53_CE_ENOMEM": GLM53_CE_ENOMEM,
            "GLM53_CE_ECPU": GLM53_CE_ECPU,
            "GLM53_CE_ISA_BEST": GLM53_CE_ISA_BEST,
            "GLM53_CE_ISA_SCALAR": GLM53_CE_ISA_SCALAR,
            "GLM53_CE_ISA_AVX2": GLM53_CE_ISA_AVX2,
            "GLM53_CE_ISA_AVX512": GLM53_CE_ISA_AVX512,
            "GLM53_CE_ISA_AVX512VBMI": GLM53_CE_ISA_AVX512VBMI,
            "GLM53_CE_ISA_COUNT": GLM53_CE_ISA_COUNT,
            "GLM53_CE_MAX_ROWS": GLM53_CE_MAX_ROWS,
            "GLM53_CE_CODEBOOK_FP16": GLM53_CE_CODEBOOK_FP16,
            "GLM53_CE_CODEBOOK_FMA": GLM53_CE_CODEBOOK_FMA,
            "GLM53_CE_CODEBOOK_INT16": GLM53_CE_CODEBOOK_INT16,
            "GLM53_CE_CODEBOOK_COUNT": GLM53_CE_CODEBOOK_COUNT,
        },
    ),
    "glm53_ct_abi": (
        {
            "glm53_ct_layout": glm53_ct_layout,
            "glm53_ct_pick": glm53_ct_pick,
            "glm53_ct_counters": glm53_ct_counters,
        },
        {
            "GLM53_CT_MAGIC": GLM53_CT_MAGIC,
            "GLM53_CT_VERSION": GLM53_CT_VERSION,
            "GLM53_CT_ALIGN": GLM53_CT_ALIGN,
            "GLM53_CT_RING_HEADER": GLM53_CT_RING_HEADER,
            "GLM53_CT_SUM": GLM53_CT_SUM,
            "GLM53_CT_SUM_WAIT_US": GLM53_CT_SUM_WAIT_US,
            "GLM53_CT_SUM_SEQ": GLM53_CT_SUM_SEQ,
            "GLM53_CT_EMPTY": GLM53_CT_EMPTY,
            "GLM53_CT_PUBLISHED": GLM53_CT_PUBLISHED,
            "GLM53_CT_CLAIMED": GLM53_CT_CLAIMED,
            "GLM53_CT_DONE": GLM53_CT_DONE,
            "GLM53_CT_FAILED": GLM53_CT_FAILED,
            "GLM53_CT_TAKEN_BACK": GLM53_CT_TAKEN_BACK,
            "GLM53_CT_SKIPPED": GLM53_CT_SKIPPED,
            "GLM53_CT_EBUSY": GLM53_CT_EBUSY,
            "GLM53_CT_ESTATE": GLM53_CT_ESTATE,
        },
    ),
    "glm53_dr_abi": (
        {
            "glm53_dr_request": glm53_dr_request,
        },
        {
            "GLM53_DR_PENDING": GLM53_DR_PENDING,
            "GLM53_DR_DONE": GLM53_DR_DONE,
            "GLM53_DR_FAILED": GLM53_DR_FAILED,
            "GLM53_DR_SHORT_READ": GLM53_DR_SHORT_READ,
            "GLM53_DR_SLOW_READ": GLM53_DR_SLOW_READ,
            "GLM53_DR_SLOW_READ_MS": GLM53_DR_SLOW_READ_MS,
            "GLM53_DR_C_REQUESTS": GLM53_DR_C_REQUESTS,
            "GLM53_DR_C_FAILED": GLM53_DR_C_FAILED,
            "GLM53_DR_C_BYTES": GLM53_DR_C_BYTES,
            "GLM53_DR_C_DISK_BYTES": GLM53_DR_C_DISK_BYTES,
            "GLM53_DR_C_BOUNCED_BYTES": GLM53_DR_C_BOUNCED_BYTES,
            "GLM53_DR_C_STRAIGHT_BYTES": GLM53_DR_C_STRAIGHT_BYTES,
            "GLM53_DR_C_RETRIES": GLM53_DR_C_RETRIES,
            "GLM53_DR_C_SHORT_READS": GLM53_DR_C_SHORT_READS,
            "GLM53_DR_C_FALLBACKS": GLM53_DR_C_FALLBACKS,
            "GLM53_DR_C_PIECES": GLM53_DR_C_PIECES,
            "GLM53_DR_C_N": GLM53_DR_C_N,
        },
    ),
}
