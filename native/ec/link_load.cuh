// A slower host link for measurements (bench/link_limiter.py): a host thread keeps SM reads of mapped host memory
// going on a stream of its own, paced to a duty cycle, so that the zero-copy reads of expert misses
// share the link with it as they would have a slower link to themselves. Copy-engine traffic alone cannot do this
// on the test host (its copies leave SM reads about three quarters of the link). The thread waits on events created
// with blocking sync (it sleeps in the driver while the GPU reads), and each kernel is short, so that it never
// holds SM slots that another kernel's co-resident launch waits for longer than one chunk. Included by
// expert_cache.cu (one CUDA library).

#include <time.h>

#include <atomic>
#include <chrono>
#include <new>
#include <thread>

struct EcLinkLoad {
    const char* src;       // device address of mapped host memory
    int64_t bytes, chunk;  // the region read round-robin, and one kernel's share of it
    int blocks, device;
    double duty;           // fraction of time a kernel is in flight
    std::atomic<bool> stop{false};
    std::atomic<int64_t> read{0};  // bytes read so far
    unsigned int* sink = nullptr;
    std::thread thread;
};

static void ec_link_load_run(EcLinkLoad* L)
{
    cudaSetDevice(L->device);
    cudaStream_t stream;  // the default priority: a lower one would let a kernel that fills the GPU keep it waiting
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaEvent_t done[2];
    for (auto& e : done) cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming);
    int64_t offset = 0;
    auto launch = [&](int i) {
        const int64_t n = offset + L->chunk <= L->bytes ? L->chunk : L->bytes - offset;
        read_probe_kernel<<<L->blocks, 256, 0, stream>>>(reinterpret_cast<const int4*>(L->src + offset), n / 16, L->sink);
        cudaEventRecord(done[i], stream);
        offset = offset + n >= L->bytes ? 0 : offset + n;
        return n;
    };
    int64_t pending[2] = {launch(0), 0};
    for (int i = 1; !L->stop.load(std::memory_order_acquire); i ^= 1) {
        const auto t0 = std::chrono::steady_clock::now();
        pending[i] = launch(i);  // two in flight: the GPU never waits for this thread at full duty
        cudaEventSynchronize(done[i ^ 1]);
        L->read.fetch_add(pending[i ^ 1], std::memory_order_relaxed);
        if (L->duty < 1.0) {
            const double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const double idle = busy * (1.0 - L->duty) / L->duty;
            timespec ts{static_cast<time_t>(idle), static_cast<long>((idle - static_cast<time_t>(idle)) * 1e9)};
            nanosleep(&ts, nullptr);
        }
    }
    cudaStreamSynchronize(stream);
    for (auto& e : done) cudaEventDestroy(e);
    cudaStreamDestroy(stream);
}

extern "C" {

// Starts the reader over [src, src + bytes) (a device alias of pinned host memory), `blocks` blocks per kernel,
// chunk bytes per kernel (a multiple of 16), in flight `duty` of the time. NULL when it cannot start.
void* ec_link_load_start(const void* src, int64_t bytes, int blocks, int64_t chunk, double duty, int device)
{
    if (!src || bytes < 16 || chunk < 16 || chunk % 16 || blocks < 1 || !(duty > 0.0 && duty <= 1.0)) return nullptr;
    EcLinkLoad* L = new (std::nothrow) EcLinkLoad;
    if (!L) return nullptr;
    L->src = static_cast<const char*>(src);
    L->bytes = bytes / 16 * 16;
    L->chunk = chunk < L->bytes ? chunk : L->bytes;
    L->blocks = blocks;
    L->duty = duty;
    L->device = device;
    if (cudaMalloc(&L->sink, sizeof(unsigned int)) != cudaSuccess) {
        delete L;
        return nullptr;
    }
    L->thread = std::thread(ec_link_load_run, L);
    return L;
}

// Stops the reader (after its kernels in flight) and returns the bytes it read.
int64_t ec_link_load_stop(void* handle)
{
    EcLinkLoad* L = static_cast<EcLinkLoad*>(handle);
    if (!L) return 0;
    L->stop.store(true, std::memory_order_release);
    L->thread.join();
    const int64_t read = L->read.load();
    cudaFree(L->sink);
    delete L;
    return read;
}

}
