#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <new>
#include <system_error>

namespace glm53ce {
namespace {

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected)
{
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word)
{
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// The word's value once it differs from old: spins for spin_us, then sleeps. A thread that changes a word wakes
// sleepers only when `sleepers` says there may be some; the seq_cst order of (sleepers++, load word) here against
// (change word, load sleepers) there makes sure that a sleeper either sees the change or gets the wake-up.
uint32_t wait_change(std::atomic<uint32_t>& word, uint32_t old, int spin_us, std::atomic<int>& sleepers)
{
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::microseconds(spin_us);
    for (int i = 1;; ++i) {
        const uint32_t value = word.load(std::memory_order_acquire);
        if (value != old)
            return value;
        __builtin_ia32_pause();
        if (i % 64 == 0 && clock::now() >= deadline)
            break;
    }
    for (;;) {
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (word.load(std::memory_order_seq_cst) == old)
            futex_wait(word, old);
        sleepers.fetch_sub(1, std::memory_order_seq_cst);
        const uint32_t value = word.load(std::memory_order_acquire);
        if (value != old)
            return value;
    }
}

void publish(std::atomic<uint32_t>& word, uint32_t value, std::atomic<int>& sleepers)
{
    word.store(value, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0)
        futex_wake_all(word);
}

}  // namespace

Pool* Pool::start(const std::vector<int>& cpus, int threads, int spin_us, std::string& error)
{
    Pool* pool = new (std::nothrow) Pool(spin_us);
    if (!pool) {
        error = "out of memory";
        return nullptr;
    }
    try {
        for (int i = 0; i < threads; ++i)
            pool->workers_.emplace_back(&Pool::work, pool, cpus.empty() ? -1 : cpus[i % cpus.size()]);
    } catch (const std::system_error& e) {
        error = std::string("cannot start a CPU-tier thread: ") + e.what();
        delete pool;
        return nullptr;
    }
    while (pool->ready_.load(std::memory_order_acquire) < threads)
        std::this_thread::yield();
    if (pool->pin_failures_.load()) {
        error = pool->pin_error_;
        delete pool;
        return nullptr;
    }
    return pool;
}

Pool::~Pool()
{
    stop_.store(true, std::memory_order_seq_cst);
    job_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(job_);
    for (std::thread& worker : workers_)
        worker.join();
}

void Pool::work(int cpu)
{
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
        if (rc != 0) {
            std::lock_guard<std::mutex> lock(pin_error_mutex_);
            pin_error_ = "cannot pin a CPU-tier thread to CPU " + std::to_string(cpu) + ": " + strerror(rc);
            pin_failures_.fetch_add(1);
        }
    }
    ready_.fetch_add(1, std::memory_order_release);
    uint32_t seen = 0;
    for (;;) {
        seen = wait_change(job_, seen, spin_us_, sleepers_);
        if (stop_.load(std::memory_order_acquire))
            return;
        for (int unit; (unit = next_unit_.fetch_add(1, std::memory_order_relaxed)) < units_;)
            fn_(ctx_, unit);
        if (working_.fetch_sub(1, std::memory_order_acq_rel) == 1)
            publish(finished_, seen, sleepers_);
    }
}

void Pool::run(int units, UnitFn fn, void* ctx)
{
    units_ = units;
    fn_ = fn;
    ctx_ = ctx;
    next_unit_.store(0, std::memory_order_relaxed);
    working_.store(threads(), std::memory_order_relaxed);
    const uint32_t job = job_.load(std::memory_order_relaxed) + 1;
    publish(job_, job, sleepers_);
    // The caller takes units too rather than spin idle: where it shares a core with a worker, that core still
    // does the job's work, and where the workers are asleep, the units start before they wake.
    for (int unit; (unit = next_unit_.fetch_add(1, std::memory_order_relaxed)) < units_;)
        fn_(ctx_, unit);
    uint32_t done = finished_.load(std::memory_order_acquire);
    while (done != job)
        done = wait_change(finished_, done, spin_us_, sleepers_);
}

}  // namespace glm53ce
