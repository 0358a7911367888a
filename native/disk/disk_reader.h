/* The disk reader: (file, offset, length) requests read into caller memory by a pool of threads, several in flight.
 *
 * Each file is opened twice, with O_DIRECT and without. O_DIRECT's requirements are asked of the kernel per file
 * (statx, STATX_DIOALIGN): the alignment of file offsets and lengths (512 or 4096: the device's logical block) and
 * that of memory addresses (4 on many NVMe drives under ext4 or xfs, 512 on a virtio disk). Where the kernel reports
 * none, or one coarser than the reader's `align`, both are `align`.
 *
 * A request is cut into pieces when it is submitted, on its file's offset grid: its unaligned head alone (the
 * block its first byte is in, when that is not its start), then the whole blocks every `piece_bytes`, then its
 * unaligned tail alone (the block of its last byte, when it does not end on the grid). The threads take pieces, not
 * requests, from one queue, so a single request is read by as many threads as it has pieces; it finishes when its
 * last piece does.
 *
 * On a direct file a piece that lies inside the request (any but the head and tail) and whose destination address
 * is a multiple of the memory alignment is read straight into the caller's memory; any other piece is read into the
 * thread's aligned bounce buffer and its exact bytes copied out. So only the head and tail, a block each at most,
 * are copied when the destination allows (an address congruent to the file offset modulo the memory alignment:
 * where that is 4, any 4-byte-aligned destination for an offset that is a multiple of 4), and every byte otherwise.
 * The shard's last block may be partial: a read past the end of the file returns what there is, and only the bytes
 * the request wants must be there.
 *
 * Errors:
 *  - EINVAL from an O_DIRECT open or read (tmpfs on older kernels, some network and FUSE filesystems, an alignment
 *    reported wrong): the file falls back to buffered reads for good, counted, with the errno and offset kept for
 *    one warning;
 *  - a short read is continued where it stopped (after an unaligned short direct read, from the block it stopped
 *    in); the end of the file before the request's last byte fails the request (error 0, error_offset where the
 *    file ended);
 *  - any other errno (EIO) is retried once per piece, then fails the request with the errno and the file offset.
 * A request fails when any of its pieces does, with the failure of its lowest failing piece (a piece above a
 * failure already met is not read). A failed request's destination holds no defined bytes; the other requests of a submission are
 * not affected.
 *
 * Requests are caller memory: the reader writes each one's out fields, then its state last (a release store), so
 * a poller that sees DONE or FAILED (an acquire load) sees the rest. The caller keeps a request and its destination
 * alive until then. One reader may be used from several threads at once.
 */
#ifndef GLM53_DISK_READER_H
#define GLM53_DISK_READER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GLM53_DR_API __attribute__((visibility("default")))

enum glm53_dr_state { GLM53_DR_PENDING = 0, GLM53_DR_DONE = 1, GLM53_DR_FAILED = 2 };
/* injected faults other than an errno (glm53_dr_inject): a read that returns half the bytes asked; one that waits
 * GLM53_DR_SLOW_READ_MS first, then reads (a test's way to keep a thread busy) */
enum { GLM53_DR_SHORT_READ = -1, GLM53_DR_SLOW_READ = -2, GLM53_DR_SLOW_READ_MS = 300 };
enum glm53_dr_counter {
    GLM53_DR_C_REQUESTS, GLM53_DR_C_FAILED, GLM53_DR_C_BYTES, GLM53_DR_C_DISK_BYTES, GLM53_DR_C_BOUNCED_BYTES,
    GLM53_DR_C_STRAIGHT_BYTES, GLM53_DR_C_RETRIES, GLM53_DR_C_SHORT_READS, GLM53_DR_C_FALLBACKS, GLM53_DR_C_PIECES,
    GLM53_DR_C_N
};

typedef struct glm53_dr_request {
    void* dest;             /* length bytes of caller memory */
    uint64_t offset;        /* in the file */
    uint64_t length;        /* > 0 */
    int32_t file;           /* index into the paths the reader was started with */
    int32_t state;          /* out: PENDING until the request finishes */
    int32_t error;          /* out: the errno of a failed request, 0 when the file ended before its last byte */
    int32_t pad;
    uint64_t error_offset;  /* out: the file byte a failed request stopped at */
} glm53_dr_request;

GLM53_DR_API int32_t glm53_dr_abi(const char* name, int64_t* value);
GLM53_DR_API const char* glm53_dr_error(void);  /* this thread's last failure, in words */

/* NULL on failure (a path that cannot be opened, a bad argument: glm53_dr_error says which). direct = 0 opens
 * every file buffered; align is a power of two, piece_bytes a multiple of it: the coarsest grid the reader cuts a
 * file's reads on, and the alignment it assumes where the kernel reports none. The threads start on the CPUs of
 * the calling thread (those the process may use). */
GLM53_DR_API void* glm53_dr_start(const char* const* paths, int32_t files, int32_t threads, int32_t direct,
                                  uint64_t align, uint64_t piece_bytes);
GLM53_DR_API void glm53_dr_stop(void* reader);  /* waits for the requests in flight */

/* Queues n requests (their states set PENDING first), their whole blocks cut into pieces of piece_bytes (0: the
 * reader's; else a multiple of its align, at most its piece_bytes: small pieces keep what a cancelled read still has
 * in flight small); 0, or -1 for a request the reader cannot take (no file of that index, length 0) or a bad piece
 * size: nothing is queued. */
GLM53_DR_API int32_t glm53_dr_submit(void* reader, glm53_dr_request* requests, int32_t n, uint64_t piece_bytes);
/* Drops the pieces of the n requests that no thread has begun; a request with pieces dropped fails with ECANCELED once
 * its pieces in flight are done (glm53_dr_wait), and one that had finished is left as it is. */
GLM53_DR_API void glm53_dr_cancel(void* reader, glm53_dr_request* requests, int32_t n);
/* Waits until none of the n requests is PENDING: 0, or 1 when timeout_us (>= 0) passed first (-1: no limit). */
GLM53_DR_API int32_t glm53_dr_wait(void* reader, const glm53_dr_request* requests, int32_t n, int64_t timeout_us);

GLM53_DR_API int32_t glm53_dr_file_direct(void* reader, int32_t file);  /* 1 direct, 0 buffered, -1 no such file */
/* Why a file reads buffered: the errno O_DIRECT was refused with (0: it was never refused) and the offset of the
 * refused read (-1: at open). */
GLM53_DR_API int32_t glm53_dr_file_fallback(void* reader, int32_t file, int64_t* offset);
/* The memory and file-offset alignment of the file's O_DIRECT reads (the latter is the grid its requests are cut on):
 * 1 when the kernel reported them (statx STATX_DIOALIGN), 0 when they are the reader's align, -1 no such file. */
GLM53_DR_API int32_t glm53_dr_file_alignment(void* reader, int32_t file, uint64_t* mem_align, uint64_t* offset_align);
GLM53_DR_API void glm53_dr_counters(void* reader, uint64_t* out);  /* GLM53_DR_C_N values */

/* Moves every reader thread to the n CPUs (n = 0: back to those it started on), as far as the process may use them:
 * 0, or -1 (a CPU out of range, or none of them one the process may use: glm53_dr_error says which; the threads are
 * left where they were). */
GLM53_DR_API int32_t glm53_dr_set_cpus(void* reader, const int32_t* cpus, int32_t n);
/* Thread `thread`'s CPUs as the kernel has them, up to `capacity` into cpus, in increasing order: how many it has, or
 * -1 (no such thread). */
GLM53_DR_API int32_t glm53_dr_thread_cpus(void* reader, int32_t thread, int32_t* cpus, int32_t capacity);

/* Fault injection for tests: the next `times` reads of `file` whose range covers `offset` fail with errno `error`
 * (GLM53_DR_SHORT_READ: they return half the bytes asked instead; GLM53_DR_SLOW_READ: they wait, then read). */
GLM53_DR_API int32_t glm53_dr_inject(void* reader, int32_t file, uint64_t offset, int32_t error, int32_t times);

#ifdef __cplusplus
}
#endif

#endif
