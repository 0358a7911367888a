// The disk reader of disk_reader.h: a pread thread pool whose unit of work is a piece, not a request. A request is
// cut into its pieces when it is submitted and every thread takes pieces from one queue, so one expert's read (three
// projections of ~3 MB, what a decode layer's miss asks for) has as many preads in flight as there are threads,
// instead of one per projection: a drive's rate at one request is far below its rate at several
// (bench/disk_bw.py). io_uring would save a system call per piece, which is nothing beside a piece's megabyte, and
// liburing would be a new build dependency (and Docker's default seccomp profile refuses io_uring_setup).
#include "disk_reader.h"

#include "../abi.h"

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

thread_local std::string last_error;

struct File {
    std::string path;
    int direct_fd = -1;
    int buffered_fd = -1;
    // O_DIRECT's alignment of memory addresses and of file offsets and lengths (the grid its requests are cut on),
    // set at the open and never changed; reported: they are the kernel's, not the reader's align
    uint64_t mem_align = 0, grid = 0;
    bool reported = false;
    std::atomic<bool> direct{false};
    std::atomic<int32_t> fallback_errno{0};
    std::atomic<int64_t> fallback_offset{-1};
};

struct Fault {
    int32_t file;
    uint64_t offset;
    int32_t error;
    int32_t times;
};

enum class Read { ok, eof, refused, failed };

// A submitted request's progress: its pieces left, and the failure of the lowest piece that failed (so the error a
// request reports does not depend on which thread got where first).
struct Job {
    glm53_dr_request* q;
    std::atomic<int64_t> left;
    std::atomic<bool> cancelled{false};  // its pieces not yet begun are not read (glm53_dr_cancel)
    std::mutex failure_mutex;
    bool failed = false;
    int32_t error = 0;
    uint64_t error_offset = 0;

    Job(glm53_dr_request* request, int64_t pieces) : q(request), left(pieces) {}
};

// [p0, p1) of the file on its grid: the request's unaligned head or tail block, or whole blocks between (cut())
struct Piece {
    Job* job;
    uint64_t p0, p1;
};

struct Reader {
    std::vector<File> files;
    uint64_t align = 4096, piece = 4 << 20;
    std::mutex queue_mutex, done_mutex, fault_mutex;
    std::condition_variable queued, finished;
    std::deque<Piece> queue;
    bool stopping = false;
    std::vector<std::thread> threads;
    cpu_set_t started_on;  // the CPUs of the thread that started the reader, which its threads inherited
    std::atomic<uint64_t> counters[GLM53_DR_C_N] = {};
    std::vector<Fault> faults;
    std::atomic<int32_t> fault_count{0};  // lets reads skip the fault mutex when no fault is armed

    explicit Reader(size_t n) : files(n) {}
    void count(int c, uint64_t n = 1) { counters[c].fetch_add(n, std::memory_order_relaxed); }
};

uint64_t down(uint64_t n, uint64_t a) { return n & ~(a - 1); }
uint64_t up(uint64_t n, uint64_t a) { return (n + a - 1) & ~(a - 1); }

// pread, or the fault armed for a read covering this offset (a short one stays a multiple of `step`)
ssize_t read_at(Reader& r, int32_t file, int fd, char* buf, uint64_t n, uint64_t at, uint64_t step)
{
    bool slow = false;
    if (r.fault_count.load(std::memory_order_acquire) > 0) {
        std::lock_guard<std::mutex> lock(r.fault_mutex);
        for (Fault& f : r.faults)
            if (f.times > 0 && f.file == file && at <= f.offset && f.offset < at + n) {
                if (--f.times == 0)
                    r.fault_count.fetch_sub(1, std::memory_order_release);
                if (f.error == GLM53_DR_SLOW_READ) {
                    slow = true;
                } else if (f.error != GLM53_DR_SHORT_READ) {
                    errno = f.error;
                    return -1;
                } else if (down(n / 2, step) > 0) {
                    n = down(n / 2, step);
                }
                break;
            }
    }
    if (slow)
        std::this_thread::sleep_for(std::chrono::milliseconds(GLM53_DR_SLOW_READ_MS));
    return pread(fd, buf, n, static_cast<off_t>(at));
}

// Reads [at, at + size) into buf until at least `need` bytes are there (the rest may lie past the end of the file).
// `step` is the alignment reads keep (1: buffered). A failure other than EINTR is retried once per piece.
Read read_full(Reader& r, int32_t file, int fd, char* buf, uint64_t size, uint64_t at, uint64_t need, uint64_t step,
               bool& retried, int32_t& error, uint64_t& error_offset)
{
    uint64_t got = 0;
    while (got < need) {
        ssize_t n = read_at(r, file, fd, buf + got, size - got, at + got, step);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && step > 1)
                return Read::refused;
            if (!retried) {
                retried = true;
                r.count(GLM53_DR_C_RETRIES);
                continue;
            }
            error = errno;
            error_offset = at + got;
            return Read::failed;
        }
        got += static_cast<uint64_t>(n);
        r.count(GLM53_DR_C_DISK_BYTES, static_cast<uint64_t>(n));
        if (got >= need)
            break;
        // O_DIRECT returns a part of a block only where the file ends; a read of nothing is the end too
        if (n == 0 || got % step != 0) {
            error = 0;
            error_offset = at + got;
            return Read::eof;
        }
        r.count(GLM53_DR_C_SHORT_READS);
    }
    return Read::ok;
}

// The request's bytes that a piece covers: [want0, want1), at `to` in the destination.
struct Span {
    uint64_t want0, want1;
    char* to;
};

Span span_of(const Piece& piece)
{
    const glm53_dr_request* q = piece.job->q;
    const uint64_t begin = q->offset, end = q->offset + q->length;
    const uint64_t want0 = piece.p0 > begin ? piece.p0 : begin, want1 = piece.p1 < end ? piece.p1 : end;
    return {want0, want1, static_cast<char*>(q->dest) + (want0 - begin)};
}

Read read_buffered(Reader& r, const Piece& piece, File& f, bool& retried, int32_t& error, uint64_t& error_offset)
{
    const Span s = span_of(piece);
    return read_full(r, piece.job->q->file, f.buffered_fd, s.to, s.want1 - s.want0, s.want0, s.want1 - s.want0, 1,
                     retried, error, error_offset);
}

// Straight into the destination when the piece lies inside the request and the destination is aligned there for
// memory, else through the thread's bounce buffer (aligned to the reader's align, which no file's alignment exceeds).
Read read_direct(Reader& r, const Piece& piece, File& f, char* bounce, bool& retried, int32_t& error,
                 uint64_t& error_offset)
{
    const Span s = span_of(piece);
    const bool straight =
        s.want0 == piece.p0 && s.want1 == piece.p1 && reinterpret_cast<uintptr_t>(s.to) % f.mem_align == 0;
    Read got = read_full(r, piece.job->q->file, f.direct_fd, straight ? s.to : bounce, piece.p1 - piece.p0, piece.p0,
                         s.want1 - piece.p0, f.grid, retried, error, error_offset);
    if (got == Read::ok && !straight)
        memcpy(s.to, bounce + (s.want0 - piece.p0), s.want1 - s.want0);
    if (got == Read::ok)
        r.count(straight ? GLM53_DR_C_STRAIGHT_BYTES : GLM53_DR_C_BOUNCED_BYTES, s.want1 - s.want0);
    return got;
}

// The request's outcome, once its last piece is done: its out fields, then its state (a release store).
void finish(Reader& r, Job* job)
{
    glm53_dr_request* q = job->q;
    const bool ok = !job->failed;
    q->error = job->error;
    q->error_offset = job->error_offset;
    r.count(GLM53_DR_C_REQUESTS);
    r.count(ok ? GLM53_DR_C_BYTES : GLM53_DR_C_FAILED, ok ? q->length : 1);
    delete job;
    {
        std::lock_guard<std::mutex> lock(r.done_mutex);  // a waiter checks the states under it: no lost wake-up
        __atomic_store_n(&q->state, ok ? GLM53_DR_DONE : GLM53_DR_FAILED, __ATOMIC_RELEASE);
    }
    r.finished.notify_all();
}

void fail(Job* job, int32_t error, uint64_t error_offset)
{
    std::lock_guard<std::mutex> lock(job->failure_mutex);
    if (!job->failed || error_offset < job->error_offset) {
        job->failed = true;
        job->error = error;
        job->error_offset = error_offset;
    }
}

// Whether a piece starting at `p0` need not be read: a lower piece failed, so its failure is the request's. (One that
// failed above may still be beaten by this piece's, so this one is read: the reported failure is the lowest one
// whichever thread gets where first.)
bool failed_below(Job* job, uint64_t p0)
{
    std::lock_guard<std::mutex> lock(job->failure_mutex);
    return job->failed && job->error_offset < p0;
}

void perform(Reader& r, const Piece& piece, char* bounce)
{
    Job* job = piece.job;
    if (bounce == nullptr) {  // no bounce buffer: this thread's pieces fail rather than read into nothing
        fail(job, ENOMEM, piece.p0);
    } else if (job->cancelled.load(std::memory_order_acquire)) {
        fail(job, ECANCELED, piece.p0);
    } else if (!failed_below(job, piece.p0)) {  // else its bytes would not be used and its failure not reported
        r.count(GLM53_DR_C_PIECES);
        File& f = r.files[static_cast<size_t>(job->q->file)];
        bool retried = false;
        int32_t error = 0;
        uint64_t error_offset = 0;
        Read got = Read::refused;
        if (f.direct.load(std::memory_order_acquire))
            got = read_direct(r, piece, f, bounce, retried, error, error_offset);
        if (got == Read::refused) {
            if (f.direct.exchange(false, std::memory_order_acq_rel)) {
                f.fallback_errno.store(EINVAL);
                f.fallback_offset.store(static_cast<int64_t>(span_of(piece).want0));
                r.count(GLM53_DR_C_FALLBACKS);
            }
            got = read_buffered(r, piece, f, retried, error, error_offset);
        }
        if (got != Read::ok)
            fail(job, error, error_offset);
    }
    if (job->left.fetch_sub(1, std::memory_order_acq_rel) == 1)
        finish(r, job);
}

void work(Reader* r)
{
    char* bounce = static_cast<char*>(aligned_alloc(r->align, r->piece));
    for (;;) {
        Piece piece;
        {
            std::unique_lock<std::mutex> lock(r->queue_mutex);
            r->queued.wait(lock, [r] { return r->stopping || !r->queue.empty(); });
            if (r->queue.empty())
                break;
            piece = r->queue.front();
            r->queue.pop_front();
        }
        perform(*r, piece, bounce);
    }
    free(bounce);
}

bool pending(const glm53_dr_request* requests, int32_t n)
{
    for (int32_t i = 0; i < n; ++i)
        if (__atomic_load_n(&requests[i].state, __ATOMIC_ACQUIRE) == GLM53_DR_PENDING)
            return true;
    return false;
}

// A request's pieces on its file's grid g: the unaligned head alone [down(begin), up(begin)) when the request does
// not start on the grid, the whole blocks from there to down(end) every `piece` bytes, the unaligned tail alone
// [down(end), up(end)) when it does not end on it (a request within one block is one piece). The head and tail are
// a block each at most, so a request whose destination is aligned for memory copies at most two blocks; cutting the
// whole blocks from the head's end rather than from down(begin) keeps each of them wholly inside the request.
// Where the whole blocks cannot go straight (the destination is not aligned for memory there, or the file is read
// buffered), every byte goes through the bounce buffer anyway and a head and tail of their own would only add two
// preads (0-10 % on the development VM's disk): the request is then cut every `piece` bytes from down(begin).
void cut(Job* job, const File& f, uint64_t piece, std::vector<Piece>& out)
{
    const uint64_t g = f.grid, begin = job->q->offset, end = begin + job->q->length;
    const bool head = begin % g != 0;
    const uint64_t body0 = head ? up(begin, g) : begin, body1 = down(end, g);
    const uintptr_t body_at = reinterpret_cast<uintptr_t>(job->q->dest) + (body0 - begin);
    if (!f.direct.load(std::memory_order_acquire) || body_at % f.mem_align != 0) {
        for (uint64_t at = down(begin, g); at < up(end, g); at += piece)
            out.push_back({job, at, std::min(at + piece, up(end, g))});
        return;
    }
    if (head)
        out.push_back({job, down(begin, g), body0});
    for (uint64_t at = body0; at < body1; at += piece)
        out.push_back({job, at, std::min(at + piece, body1)});
    if (end % g != 0 && body1 >= body0)
        out.push_back({job, body1, up(end, g)});
}

// O_DIRECT's alignments for an open direct file, from the kernel (Linux 6.1: statx's STATX_DIOALIGN) when it
// reports them, both powers of two no coarser than the reader's align; else align for both. A file the kernel says
// has no direct I/O (zeros) keeps align too: such a read is either served buffered by the filesystem itself (ext4)
// or refused with EINVAL, which sends the file to buffered reads; a wrong report ends the same way, never in wrong
// bytes, since a read the alignment does not suit fails whole.
void find_alignment(File& f, uint64_t align)
{
#ifdef STATX_DIOALIGN
    struct statx sx;
    if (statx(f.direct_fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) != 0 || !(sx.stx_mask & STATX_DIOALIGN))
        return;
    const uint64_t mem = sx.stx_dio_mem_align, offset = sx.stx_dio_offset_align;
    const auto usable = [align](uint64_t a) { return a != 0 && (a & (a - 1)) == 0 && a <= align; };
    if (usable(mem) && usable(offset)) {
        f.mem_align = mem;
        f.grid = offset;
        f.reported = true;
    }
#endif
}

void close_files(Reader* r)
{
    for (File& f : r->files) {
        if (f.direct_fd >= 0)
            close(f.direct_fd);
        if (f.buffered_fd >= 0)
            close(f.buffered_fd);
    }
}

}  // namespace

extern "C" {

// glm53_dr_abi, over every struct and number of the header (generated from it by glm53/native/bindgen.py)
#include "disk_reader_abi.inc"

const char* glm53_dr_error(void) { return last_error.c_str(); }

void* glm53_dr_start(const char* const* paths, int32_t files, int32_t threads, int32_t direct, uint64_t align,
                     uint64_t piece_bytes)
{
    if (files < 1 || threads < 1 || !paths) {
        last_error = "files and threads are " + std::to_string(files) + " and " + std::to_string(threads) +
                     (paths ? "" : " and paths is NULL") + ": both must be >= 1, paths not NULL";
        return nullptr;
    }
    if (align == 0 || (align & (align - 1)) != 0 || piece_bytes < align || piece_bytes % align != 0) {
        last_error = "align and piece_bytes are " + std::to_string(align) + " and " + std::to_string(piece_bytes) +
                     ": align must be a power of two and piece_bytes a multiple of it";
        return nullptr;
    }
    Reader* r = new Reader(static_cast<size_t>(files));
    r->align = align;
    r->piece = piece_bytes;
    for (int32_t i = 0; i < files; ++i) {
        File& f = r->files[static_cast<size_t>(i)];
        f.path = paths[i];
        f.buffered_fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (f.buffered_fd < 0) {
            last_error = f.path + ": cannot open: " + strerror(errno);
            close_files(r);
            delete r;
            return nullptr;
        }
        f.mem_align = f.grid = align;
        if (direct) {
            f.direct_fd = open(paths[i], O_RDONLY | O_CLOEXEC | O_DIRECT);
            f.direct.store(f.direct_fd >= 0);
            if (f.direct_fd < 0) {
                f.fallback_errno.store(errno);
                r->count(GLM53_DR_C_FALLBACKS);
            } else {
                find_alignment(f, align);
            }
        }
    }
    if (sched_getaffinity(0, sizeof r->started_on, &r->started_on) != 0) {
        last_error = std::string("cannot read the calling thread's CPUs: ") + strerror(errno);
        close_files(r);
        delete r;
        return nullptr;
    }
    try {
        for (int32_t i = 0; i < threads; ++i)
            r->threads.emplace_back(work, r);
    } catch (const std::exception& e) {
        last_error = std::string("cannot start the reader's threads: ") + e.what();
        glm53_dr_stop(r);
        return nullptr;
    }
    return r;
}

void glm53_dr_stop(void* reader)
{
    Reader* r = static_cast<Reader*>(reader);
    if (r == nullptr)
        return;
    {
        std::lock_guard<std::mutex> lock(r->queue_mutex);
        r->stopping = true;
    }
    r->queued.notify_all();
    for (std::thread& t : r->threads)
        t.join();
    close_files(r);
    delete r;
}

int32_t glm53_dr_submit(void* reader, glm53_dr_request* requests, int32_t n, uint64_t piece_bytes)
{
    Reader* r = static_cast<Reader*>(reader);
    const uint64_t piece = piece_bytes == 0 ? r->piece : piece_bytes;
    if (piece % r->align != 0 || piece > r->piece) {
        last_error = "submit: piece_bytes is " + std::to_string(piece_bytes) + ": it must be 0, or a multiple of " +
                     std::to_string(r->align) + " up to the reader's " + std::to_string(r->piece);
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        const glm53_dr_request& q = requests[i];
        const std::string refused = q.file < 0 || static_cast<size_t>(q.file) >= r->files.size()
                                        ? "file is " + std::to_string(q.file) + ", not one of the reader's " +
                                              std::to_string(r->files.size()) + " files"
                                    : q.length == 0 ? std::string("length is 0")
                                    : q.dest == nullptr ? std::string("dest is NULL") : std::string();
        if (!refused.empty()) {
            last_error = "submit: requests[" + std::to_string(i) + "]." + refused;
            return -1;
        }
    }
    std::vector<Piece> pieces;
    std::vector<Job*> jobs;
    try {
        for (int32_t i = 0; i < n; ++i) {
            glm53_dr_request& q = requests[i];
            const size_t before = pieces.size();
            jobs.push_back(new Job(&q, 0));
            cut(jobs.back(), r->files[static_cast<size_t>(q.file)], piece, pieces);
            jobs.back()->left.store(static_cast<int64_t>(pieces.size() - before), std::memory_order_relaxed);
        }
    } catch (const std::bad_alloc&) {
        for (Job* job : jobs)
            delete job;
        last_error = "submit: out of memory for " + std::to_string(n) + " requests' pieces";
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        requests[i].error = 0;
        requests[i].error_offset = 0;
        __atomic_store_n(&requests[i].state, GLM53_DR_PENDING, __ATOMIC_RELEASE);
    }
    {
        std::lock_guard<std::mutex> lock(r->queue_mutex);
        r->queue.insert(r->queue.end(), pieces.begin(), pieces.end());
    }
    r->queued.notify_all();
    return 0;
}

void glm53_dr_cancel(void* reader, glm53_dr_request* requests, int32_t n)
{
    Reader* r = static_cast<Reader*>(reader);
    std::vector<Job*> emptied;  // jobs whose every piece left was still queued: finished here
    {
        std::lock_guard<std::mutex> lock(r->queue_mutex);
        std::deque<Piece> kept;
        for (const Piece& piece : r->queue) {
            const glm53_dr_request* q = piece.job->q;
            if (q < requests || q >= requests + n) {
                kept.push_back(piece);
                continue;
            }
            piece.job->cancelled.store(true, std::memory_order_release);
            fail(piece.job, ECANCELED, piece.p0);
            if (piece.job->left.fetch_sub(1, std::memory_order_acq_rel) == 1)
                emptied.push_back(piece.job);
        }
        r->queue.swap(kept);
    }
    for (Job* job : emptied)
        finish(*r, job);
}

int32_t glm53_dr_wait(void* reader, const glm53_dr_request* requests, int32_t n, int64_t timeout_us)
{
    Reader* r = static_cast<Reader*>(reader);
    std::unique_lock<std::mutex> lock(r->done_mutex);
    if (timeout_us < 0) {
        r->finished.wait(lock, [&] { return !pending(requests, n); });
        return 0;
    }
    return r->finished.wait_for(lock, std::chrono::microseconds(timeout_us), [&] { return !pending(requests, n); }) ? 0 : 1;
}

int32_t glm53_dr_file_direct(void* reader, int32_t file)
{
    Reader* r = static_cast<Reader*>(reader);
    if (file < 0 || static_cast<size_t>(file) >= r->files.size())
        return -1;
    return r->files[static_cast<size_t>(file)].direct.load() ? 1 : 0;
}

int32_t glm53_dr_file_fallback(void* reader, int32_t file, int64_t* offset)
{
    Reader* r = static_cast<Reader*>(reader);
    if (file < 0 || static_cast<size_t>(file) >= r->files.size())
        return -1;
    const File& f = r->files[static_cast<size_t>(file)];
    if (offset)
        *offset = f.fallback_offset.load();
    return f.fallback_errno.load();
}

int32_t glm53_dr_file_alignment(void* reader, int32_t file, uint64_t* mem_align, uint64_t* offset_align)
{
    Reader* r = static_cast<Reader*>(reader);
    if (file < 0 || static_cast<size_t>(file) >= r->files.size())
        return -1;
    const File& f = r->files[static_cast<size_t>(file)];
    if (mem_align)
        *mem_align = f.mem_align;
    if (offset_align)
        *offset_align = f.grid;
    return f.reported ? 1 : 0;
}

void glm53_dr_counters(void* reader, uint64_t* out)
{
    Reader* r = static_cast<Reader*>(reader);
    for (int i = 0; i < GLM53_DR_C_N; ++i)
        out[i] = r->counters[i].load(std::memory_order_relaxed);
}

int32_t glm53_dr_inject(void* reader, int32_t file, uint64_t offset, int32_t error, int32_t times)
{
    Reader* r = static_cast<Reader*>(reader);
    if (file < 0 || static_cast<size_t>(file) >= r->files.size() || times < 1) {
        last_error = "inject: " + (times < 1 ? "times is " + std::to_string(times) + ", below 1"
                                             : "file " + std::to_string(file) + " is not one of the reader's " +
                                                   std::to_string(r->files.size()) + " files");
        return -1;
    }
    std::lock_guard<std::mutex> lock(r->fault_mutex);
    r->faults.push_back({file, offset, error, times});
    r->fault_count.fetch_add(1, std::memory_order_release);
    return 0;
}

int32_t glm53_dr_set_cpus(void* reader, const int32_t* cpus, int32_t n)
{
    Reader* r = static_cast<Reader*>(reader);
    cpu_set_t set;
    if (n <= 0) {
        set = r->started_on;
    } else {
        CPU_ZERO(&set);
        for (int32_t i = 0; i < n; ++i) {
            if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) {
                last_error = "set_cpus: CPU " + std::to_string(cpus[i]) + " is out of range [0, " +
                             std::to_string(CPU_SETSIZE) + ")";
                return -1;
            }
            CPU_SET(cpus[i], &set);
        }
    }
    std::vector<cpu_set_t> was(r->threads.size());
    for (size_t i = 0; i < r->threads.size(); ++i) {
        pthread_t t = r->threads[i].native_handle();
        int rc = pthread_getaffinity_np(t, sizeof was[i], &was[i]);
        if (rc == 0)
            rc = pthread_setaffinity_np(t, sizeof set, &set);
        if (rc != 0) {
            last_error = std::string("set_cpus: cannot move the reader's threads there: ") + strerror(rc) +
                         (rc == EINVAL ? " (none of those CPUs is one this process may use)" : "");
            for (size_t j = 0; j < i; ++j)
                pthread_setaffinity_np(r->threads[j].native_handle(), sizeof was[j], &was[j]);
            return -1;
        }
    }
    return 0;
}

int32_t glm53_dr_thread_cpus(void* reader, int32_t thread, int32_t* cpus, int32_t capacity)
{
    Reader* r = static_cast<Reader*>(reader);
    if (thread < 0 || static_cast<size_t>(thread) >= r->threads.size())
        return -1;
    cpu_set_t set;
    if (pthread_getaffinity_np(r->threads[static_cast<size_t>(thread)].native_handle(), sizeof set, &set) != 0)
        return -1;
    int32_t count = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
        if (CPU_ISSET(cpu, &set)) {
            if (count < capacity)
                cpus[count] = cpu;
            ++count;
        }
    return count;
}
}
