// Worker threads pinned to CPUs that run "units" (independent pieces of one job) claimed from a shared counter.
// Waiting, both for workers between jobs and for the caller until a job is done, spins for a bounded time and
// then sleeps on a futex, so that the CPU tier answers within microseconds while decode runs and frees its cores
// when it is idle.
#pragma once

#include <stdint.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace glm53ce {

class Pool {
public:
    using UnitFn = void (*)(void* ctx, int unit);

    // threads workers, worker i pinned to cpus[i % cpus.size()] (not pinned when cpus is empty). On failure
    // returns nullptr and sets error.
    static Pool* start(const std::vector<int>& cpus, int threads, int spin_us, std::string& error);
    ~Pool();

    int threads() const { return static_cast<int>(workers_.size()); }
    // The fewest units a thread should get in a call's projection phases (glm53_ce_pool_start's)
    int units_per_thread = 4;

    // Runs fn(ctx, u) for u in 0..units-1 on the workers and the calling thread, and returns when all are done.
    // One job at a time.
    void run(int units, UnitFn fn, void* ctx);

    // Held by a caller across the run() of one call (one caller at a time), also guarding the scratch memory.
    std::mutex& call_mutex() { return call_mutex_; }
    std::vector<float>& scratch() { return scratch_; }

private:
    Pool(int spin_us) : spin_us_(spin_us) {}
    void work(int cpu);

    std::vector<std::thread> workers_;
    const int spin_us_;
    std::atomic<uint32_t> job_{0};       // bumped for every job (and at stop); workers wait on it
    std::atomic<uint32_t> finished_{0};  // set to the job number when its last worker is done; the caller waits on it
    std::atomic<int> next_unit_{0};
    std::atomic<int> working_{0};        // workers still inside the current job
    std::atomic<int> sleepers_{0};       // threads asleep (or about to sleep) on job_ or finished_
    std::atomic<int> ready_{0};
    std::atomic<int> pin_failures_{0};
    std::atomic<bool> stop_{false};
    int units_ = 0;
    UnitFn fn_ = nullptr;
    void* ctx_ = nullptr;
    std::mutex call_mutex_;
    std::vector<float> scratch_;
    std::string pin_error_;
    std::mutex pin_error_mutex_;
};

}  // namespace glm53ce
