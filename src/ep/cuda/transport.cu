// Transports across processes (one per GPU) and the launcher that starts them.
//
// nvlink: every rank allocates its symmetric region with cudaMalloc, all ranks exchange CUDA IPC
// handles through one all-gather (the caller's EpProcessGroup::all_gather, else NCCL's) and open
// their peers' regions; the kernels then write straight into peer memory (the same device code as
// `local`). NCCL 2.28's symmetric windows
// (ncclCommWindowRegister + ncclGetLsaPointer) would give the same pointers; IPC keeps the
// kernels free of NCCL's device headers.
// nccl: no peer mapping. The send kernels write each peer's inbox into a local staging area laid
// out exactly like that inbox (flag included), and a grouped ncclSend/ncclRecv right after each
// send kernel moves every staged inbox into the peer's real one, in stream order. Sizes are fixed
// (T_max messages per peer), so the step stays graph-capturable; the receive kernels are unchanged
// (their flags are already there when NCCL completes). Single-buffered: stream order already keeps
// a step's data from overwriting the previous one.
//
// NCCL is opened at run time (dlopen), so moekit links no NCCL and the local transport runs
// where NCCL is absent. MOEKIT_NCCL_LIBRARY names the library; the default is libnccl.so.2 on the
// loader's path (a system NCCL, or PyTorch's nvidia/nccl/lib, which scripts/gpu-host puts on
// LD_LIBRARY_PATH when the loader has none).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "ep_format.h"
#include "ep_state.cuh"
#include "moekit/check.h"
#include "moekit/cuda_check.h"
#include "moekit/ep.h"

namespace moekit::gpu {
namespace {

// The NCCL entry points moekit uses, resolved once.
struct Nccl {
  ncclResult_t (*get_unique_id)(ncclUniqueId*);
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*comm_destroy)(ncclComm_t);
  ncclResult_t (*comm_abort)(ncclComm_t);
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*group_start)();
  ncclResult_t (*group_end)();
  const char* (*error_string)(ncclResult_t);
};

template <class F>
void resolve(void* lib, const char* name, F& fn) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  MOEKIT_CHECK(fn != nullptr, fmtr("NCCL: symbol {} not found in the loaded library", name));
}

const Nccl& nccl() {
  static const Nccl table = [] {
    const char* path = std::getenv("MOEKIT_NCCL_LIBRARY");
    if (!path) path = "libnccl.so.2";
    void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    MOEKIT_CHECK(lib != nullptr, fmtr("NCCL: cannot load {} ({}); set MOEKIT_NCCL_LIBRARY or LD_LIBRARY_PATH", path,
                                      dlerror()));
    Nccl n{};
    resolve(lib, "ncclGetUniqueId", n.get_unique_id);
    resolve(lib, "ncclCommInitRank", n.comm_init_rank);
    resolve(lib, "ncclCommDestroy", n.comm_destroy);
    resolve(lib, "ncclCommAbort", n.comm_abort);
    resolve(lib, "ncclAllGather", n.all_gather);
    resolve(lib, "ncclSend", n.send);
    resolve(lib, "ncclRecv", n.recv);
    resolve(lib, "ncclGroupStart", n.group_start);
    resolve(lib, "ncclGroupEnd", n.group_end);
    resolve(lib, "ncclGetErrorString", n.error_string);
    return n;
  }();
  return table;
}

void nccl_check(ncclResult_t r, const char* what) {
  MOEKIT_CHECK(r == ncclSuccess, fmtr("NCCL: {} failed: {}", what, nccl().error_string(r)));
}

// Owns everything a cross-process rank holds: the communicator, its own regions, the opened
// peer regions, and (nccl) moves the staged inboxes after each send kernel.
class ProcessTransport : public EpExchange {
 public:
  ProcessTransport(const EpConfig& config, const EpProcessGroup& group, EpTransport kind)
      : kind_(kind), rank_(group.rank), num_ranks_(group.num_ranks), sizes_(ep_sizes(config)) {
    try {
      // nvlink with the caller's all-gather needs no communicator.
      if (kind == EpTransport::kNccl || !group.all_gather) init_comm(group.nccl_unique_id);
      MOEKIT_CUDA_CHECK(cudaMalloc(&symmetric_, sizes_.symmetric_bytes));
      MOEKIT_CUDA_CHECK(cudaMemset(symmetric_, 0, sizes_.symmetric_bytes));
      if (kind == EpTransport::kNccl) {
        const size_t staging = size_t(num_ranks_) * (sizes_.dispatch_inbox_bytes + sizes_.combine_inbox_bytes);
        MOEKIT_CUDA_CHECK(cudaMalloc(&staging_, staging));
        MOEKIT_CUDA_CHECK(cudaMemset(staging_, 0, staging));
      } else {
        open_peers(group);
      }
      MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
    } catch (...) {
      release();  // a failed set-up (a bad all-gather, a peer that never came) leaks nothing
      throw;
    }
  }

  ~ProcessTransport() override { release(); }

  EpPeers peers() const {
    EpPeers p;
    p.symmetric = symmetric_;
    p.symmetric_bytes = sizes_.symmetric_bytes;
    p.double_buffered = kind_ != EpTransport::kNccl;
    const size_t P = size_t(num_ranks_), di = sizes_.dispatch_inbox_bytes, ci = sizes_.combine_inbox_bytes;
    for (int r = 0; r < num_ranks_; ++r) {
      if (kind_ == EpTransport::kNccl) {
        uint8_t* s = static_cast<uint8_t*>(staging_);
        p.peer_dispatch.push_back(s + r * di);
        p.peer_combine.push_back(s + P * di + r * ci);
      } else {
        uint8_t* base = static_cast<uint8_t*>(peer_base_[r]);
        p.peer_dispatch.push_back(base + rank_ * di);
        p.peer_combine.push_back(base + 2 * P * di + rank_ * ci);
      }
    }
    return p;
  }

  void after_dispatch_send(cudaStream_t stream) override {
    if (kind_ == EpTransport::kNccl) exchange(0, 0, sizes_.dispatch_inbox_bytes, stream);
  }
  void after_combine_send(cudaStream_t stream) override {
    const size_t P = size_t(num_ranks_);
    if (kind_ == EpTransport::kNccl)
      exchange(P * sizes_.dispatch_inbox_bytes, 2 * P * sizes_.dispatch_inbox_bytes, sizes_.combine_inbox_bytes, stream);
  }
  // NCCL's send/receive kernels wait for a dead peer forever; nvlink's waits are moekit's own,
  // with their timeout.
  bool needs_watchdog() const override { return kind_ == EpTransport::kNccl; }
  void abort() override {
    MOEKIT_CHECK(comm_ != nullptr, fmtr("EP rank {}: the NCCL communicator was already aborted", rank_));
    ncclComm_t comm = comm_;
    comm_ = nullptr;  // aborted communicators are not destroyed
    nccl_check(nccl().comm_abort(comm), "ncclCommAbort");
  }

 private:
  // Staged inbox for peer r at staging + staged_at + r * bytes goes to r's inbox for this rank;
  // peer r's staged inbox for this rank lands at symmetric + inbox_at + r * bytes (parity 0).
  void exchange(size_t staged_at, size_t inbox_at, size_t bytes, cudaStream_t stream) {
    MOEKIT_CHECK(comm_ != nullptr, fmtr("EP rank {}: the NCCL communicator was aborted after a timeout (a peer was "
                                        "gone): this buffer cannot exchange again; connect a new one", rank_));
    const Nccl& n = nccl();
    nccl_check(n.group_start(), "ncclGroupStart");
    for (int r = 0; r < num_ranks_; ++r) {
      nccl_check(n.send(static_cast<uint8_t*>(staging_) + staged_at + r * bytes, bytes, ncclUint8, r, comm_, stream),
                 "ncclSend");
      nccl_check(n.recv(static_cast<uint8_t*>(symmetric_) + inbox_at + r * bytes, bytes, ncclUint8, r, comm_, stream),
                 "ncclRecv");
    }
    nccl_check(n.group_end(), "ncclGroupEnd");
  }

  void init_comm(const std::vector<uint8_t>& unique_id) {
    MOEKIT_CHECK(unique_id.size() == sizeof(ncclUniqueId),
                 fmtr("connect_ep: the NCCL unique id has {} bytes, expected {}", unique_id.size(), sizeof(ncclUniqueId)));
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nccl_check(nccl().comm_init_rank(&comm_, num_ranks_, id, rank_), "ncclCommInitRank");
  }

  // Idempotent: the destructor and a failed constructor both end here.
  void release() {
    for (int r = 0; r < int(peer_base_.size()); ++r)
      if (r != rank_ && peer_base_[r]) cudaIpcCloseMemHandle(peer_base_[r]);
    peer_base_.clear();
    if (staging_) cudaFree(staging_);
    if (symmetric_) cudaFree(symmetric_);
    staging_ = symmetric_ = nullptr;
    if (comm_) nccl().comm_destroy(comm_);
    comm_ = nullptr;
  }

  // Every rank's `mine`, in rank order, through the caller's all-gather or NCCL's. A result that is
  // not P pieces with this rank's own at position rank means the group's ranks are not moekit's.
  std::vector<uint8_t> all_gather(const EpProcessGroup& group, const std::vector<uint8_t>& mine) {
    const size_t n = mine.size(), P = size_t(num_ranks_);
    std::vector<uint8_t> all;
    if (group.all_gather) {
      all = group.all_gather(mine);
    } else {
      void* dev = nullptr;
      MOEKIT_CUDA_CHECK(cudaMalloc(&dev, n * (P + 1)));
      uint8_t* gathered = static_cast<uint8_t*>(dev) + n;
      all.resize(n * P);
      MOEKIT_CUDA_CHECK(cudaMemcpy(dev, mine.data(), n, cudaMemcpyHostToDevice));
      nccl_check(nccl().all_gather(dev, gathered, n, ncclUint8, comm_, nullptr), "ncclAllGather");
      MOEKIT_CUDA_CHECK(cudaMemcpy(all.data(), gathered, n * P, cudaMemcpyDeviceToHost));
      MOEKIT_CUDA_CHECK(cudaFree(dev));
    }
    MOEKIT_CHECK(all.size() == n * P, fmtr("connect_ep: rank {}: the all-gather returned {} bytes, expected {} ranks x {} "
                                           "bytes = {}", rank_, all.size(), P, n, n * P));
    MOEKIT_CHECK(std::memcmp(all.data() + size_t(rank_) * n, mine.data(), n) == 0,
                 fmtr("connect_ep: rank {}: the all-gather does not hold this rank's own bytes at position {} (the "
                      "group's rank order must be moekit's)", rank_, rank_));
    return all;
  }

  void open_peers(const EpProcessGroup& group) {
    cudaIpcMemHandle_t mine;
    MOEKIT_CUDA_CHECK(cudaIpcGetMemHandle(&mine, symmetric_));
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&mine);
    const std::vector<uint8_t> all = all_gather(group, std::vector<uint8_t>(bytes, bytes + sizeof(mine)));
    peer_base_.assign(num_ranks_, nullptr);
    for (int r = 0; r < num_ranks_; ++r) {
      if (r == rank_) {
        peer_base_[r] = symmetric_;
        continue;
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, all.data() + size_t(r) * sizeof(handle), sizeof(handle));
      MOEKIT_CUDA_CHECK(cudaIpcOpenMemHandle(&peer_base_[r], handle, cudaIpcMemLazyEnablePeerAccess));
    }
  }

  EpTransport kind_;
  int rank_, num_ranks_;
  EpSizes sizes_;
  ncclComm_t comm_ = nullptr;
  void* symmetric_ = nullptr;
  void* staging_ = nullptr;
  std::vector<void*> peer_base_;
};

}  // namespace

std::unique_ptr<EpBuffer> connect_ep(const EpConfig& config, const EpProcessGroup& group, EpTransport transport) {
  config.validate();
  MOEKIT_CHECK(transport == EpTransport::kNvlink || transport == EpTransport::kNccl,
               fmtr("connect_ep: transport {} is not a cross-process transport (use EpLocalGroup)",
                    ep_transport_name(transport)));
  MOEKIT_CHECK(group.num_ranks == config.num_ranks && group.rank >= 0 && group.rank < group.num_ranks,
               fmtr("connect_ep: process group rank {} of {}, but the config has num_ranks = {}", group.rank,
                    group.num_ranks, config.num_ranks));
  MOEKIT_CUDA_CHECK(cudaSetDevice(group.device));
  auto t = std::make_shared<ProcessTransport>(config, group, transport);
  return std::make_unique<EpBuffer>(config, group.rank, transport, t->peers(), t);
}

std::vector<uint8_t> make_nccl_unique_id() {
  ncclUniqueId id;
  nccl_check(nccl().get_unique_id(&id), "ncclGetUniqueId");
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(bytes, bytes + sizeof(id));
}

int count_devices_in_child() {
  const pid_t pid = fork();
  MOEKIT_CHECK(pid >= 0, "count_devices_in_child: fork failed");
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 250 ? 250 : n);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

int launch_ranks(int num_ranks, double timeout_s, int (*body)(const EpProcessGroup& group, void* arg), void* arg) {
  MOEKIT_CHECK(num_ranks >= 1 && num_ranks <= kEpMaxRanks, fmtr("launch_ranks: num_ranks = {}, expected 1..{}", num_ranks,
                                                                kEpMaxRanks));
  MOEKIT_CHECK(timeout_s > 0, fmtr("launch_ranks: timeout_s = {}, expected > 0", timeout_s));
  // Rank 0 makes the unique id (its process then hosts NCCL's bootstrap root) and publishes it in
  // a shared page; the parent never loads NCCL or CUDA, so forking stays safe.
  struct Shared {
    std::atomic<int> ready;
    uint8_t id[sizeof(ncclUniqueId)];
  };
  void* page = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  MOEKIT_CHECK(page != MAP_FAILED, "launch_ranks: mmap of the shared page failed");
  Shared* shared = new (page) Shared{};
  std::vector<pid_t> pids;
  for (int r = 0; r < num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) break;
    if (pid > 0) {
      pids.push_back(pid);
      continue;
    }
    setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (see the device notes)
    int rc = 1;
    try {
      EpProcessGroup g;
      g.rank = r;
      g.num_ranks = num_ranks;
      g.device = r;
      if (r == 0) {
        const std::vector<uint8_t> id = make_nccl_unique_id();
        std::memcpy(shared->id, id.data(), id.size());
        shared->ready.store(1, std::memory_order_release);
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
      while (!shared->ready.load(std::memory_order_acquire)) {
        MOEKIT_CHECK(std::chrono::steady_clock::now() < deadline, fmtr("rank {}: no NCCL unique id from rank 0", r));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      g.nccl_unique_id.assign(shared->id, shared->id + sizeof(shared->id));
      rc = body(g, arg);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "moekit: rank %d: %s\n", r, e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  int failed = num_ranks - int(pids.size());  // ranks that could not be forked
  std::vector<bool> done(pids.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (size_t left = pids.size(); left > 0;) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) != pids[i]) continue;
      done[i] = true;
      --left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) {
          std::fprintf(stderr, "moekit: rank %zu passed the %.1f s limit and was killed\n", i, timeout_s);
          kill(pids[i], SIGKILL);
          waitpid(pids[i], nullptr, 0);
          done[i] = true;
          ++failed;
        }
      left = 0;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  munmap(page, sizeof(Shared));
  return failed;
}

}  // namespace moekit::gpu
