// The GPU MoE layer (layer.h) with one process per GPU over the cross-process transports (`nvlink`:
// CUDA IPC peer mapping; `nccl`: grouped send/receive), P = the number of GPUs (2..8; skipped under
// 2). Tiny-moe weights are written and read once by this process, which never touches CUDA, and
// shared by the rank processes launch_ranks forks. Every rank draws every rank's tokens and routing
// from one seed, so each checks its own step against two references computed in its own process:
//   - the CPU layer (layer_cpu.h) of all P ranks, same weights, placement and routing: routing and
//     recv_count equal, the output within test_layer's tolerance;
//   - the `local` transport: the same layer as P virtual ranks on this rank's own GPU, same inputs:
//     this rank's output, routing, slots and recv_count the same bits. The kernels are the ones the
//     local transport runs and every sum has a fixed order, so the transport must not change a bit.
// Decode and prefill over both transports, fresh tokens every step (the router's routing, then a
// caller's hot-spot routing), a placement with redundant experts, and over nvlink steps replayed
// from CUDA Graphs (one captured with the router, one with caller routing) with new data.
// Staged weight moves while serving (layer.h begin_moves .. commit_moves): over nvlink from the
// peers' slots (mapped with CUDA IPC), over nccl from the host weights; every step before the
// switch equals the CPU layer under the old placement, every step after it under the new one; and
// a rank that stops stepping while the copies run: the others end in the EP's named timeout and
// keep the old placement's weights, bit for bit.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "moekit/bf16.h"
#include "moekit/cuda_check.h"
#include "moekit/cuda_graph.h"
#include "moekit/ep.h"
#include "moekit/eplb.h"
#include "moekit/layer.h"
#include "moekit/layer_cpu.h"
#include "moekit/rebalance.h"
#include "test_layer_reference.h"

using namespace moekit;
using namespace layer_test;

namespace {

constexpr double kWaitTimeout = 10.0;     // s, every GPU wait on a peer (EpConfig::timeout_s)
constexpr double kBarrierTimeout = 60.0;  // s, the host barrier before a step
constexpr double kRankTimeout = 120.0;    // s, one case's rank processes, then they are killed

// Host-side state the rank processes share (a page mapped before the fork). Ranks pass the
// barrier before every step, so no rank's receive kernel waits on a peer still busy with its host
// references; a rank that fails raises `failed` so that its peers stop at their next barrier.
struct RankSync {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  std::atomic<int> failed{0};
  std::atomic<int> released{0};  // moves: the stalled rank may leave
  int num_ranks = 0;

  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == num_ranks) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kBarrierTimeout);
    while (generation.load(std::memory_order_acquire) == gen) {
      MOEKIT_CHECK(failed.load(std::memory_order_acquire) == 0,
                   std::string("a peer rank failed (its message is above)"));
      MOEKIT_CHECK(std::chrono::steady_clock::now() < deadline,
                   "rank barrier: not every rank arrived within " + std::to_string(kBarrierTimeout) + " s");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

struct MultiCase {
  gpu::EpTransport transport;
  bool decode;
  bool redundant;
  bool graph;  // after two eager steps, four steps replayed from CUDA Graphs
  bool fused = false;  // GpuPipeline::kFused (decode), for the layer and its local twin
};

std::string case_name(const MultiCase& c) {
  return std::string(c.transport == gpu::EpTransport::kNvlink ? "Nvlink" : "Nccl") + (c.decode ? "Decode" : "Prefill") +
         (c.redundant ? "Redundant" : "") + (c.graph ? "Graph" : "") + (c.fused ? "Fused" : "");
}

// What launch_case hands every rank process: its case and the page the ranks share.
template <class Case>
struct CaseArgs {
  Case c;
  RankSync* sync;
};

struct Stream {
  cudaStream_t s{};
  Stream() { MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

template <class T>
size_t count_different_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

int run_rank(const gpu::EpProcessGroup& g, const MultiCase& c, RankSync& sync) {
  const Fixture& f = fixture();  // loaded by the parent before the fork
  const int P = g.num_ranks, me = g.rank;
  const int d = int(f.model.hidden_size), k = f.model.num_experts_per_token, E = f.model.num_routed_experts;
  const gpu::EpMode mode = c.decode ? gpu::EpMode::kLowLatency : gpu::EpMode::kNormal;
  const EpProtocol protocol = c.decode ? EpProtocol::kLowLatency : EpProtocol::kNormal;
  const Placement placement = make_placement(P, c.redundant);
  const uint64_t seed = 17;
  const int t_max = (kBatch + P - 1) / P;
  const int t0 = first_token(me, P, kBatch), T = first_token(me + 1, P, kBatch) - t0;
  const std::string name = case_name(c) + " P=" + std::to_string(P) + " rank " + std::to_string(me);

  const gpu::GpuPipeline pipeline = c.fused ? gpu::GpuPipeline::kFused : gpu::GpuPipeline::kStaged;
  gpu::EpConfig ec = gpu::layer_ep_config(f.model, placement.num_slots, P, t_max, mode, pipeline);
  ec.timeout_s = kWaitTimeout;
  std::unique_ptr<gpu::EpBuffer> ep = gpu::connect_ep(ec, g, c.transport);  // selects device g.device
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = t_max;
  cfg.replica_seed = seed;
  cfg.pipeline = pipeline;
  gpu::GpuMoeLayer layer(f.model, f.weights, placement, 0, *ep, cfg);
  GpuRig local(P, mode, placement, seed, nullptr, pipeline);  // the same layer as P virtual ranks on this GPU
  const int e_loc = layer.num_local_experts();
  DeviceArray<uint16_t> x(size_t(t_max) * d), out(size_t(t_max) * d);
  DeviceArray<int32_t> idx(size_t(t_max) * k);
  DeviceArray<float> w(size_t(t_max) * k);
  Stream stream;
  auto issue = [&](bool caller) {
    const int32_t* ri = caller ? idx.ptr : nullptr;
    const float* rw = caller ? w.ptr : nullptr;
    if (c.decode)
      layer.forward_decode(x.ptr, T, t0, out.ptr, stream.s, ri, rw);
    else
      layer.forward_prefill(x.ptr, T, t0, out.ptr, stream.s, ri, rw);
  };
  // Graph steps replay what was captured with the router (index 0) or caller routing (index 1).
  std::unique_ptr<CapturedGraph> graphs[2];

  struct Step {
    bool caller, graph;
  };
  std::vector<Step> steps = {{false, false}, {true, false}};
  if (c.graph) steps.insert(steps.end(), {{false, true}, {false, true}, {true, true}, {true, true}});
  std::mt19937 rng(1000 + int(c.transport) * 10 + (c.decode ? 1 : 2) + (c.redundant ? 4 : 0));
  for (size_t s = 0; s < steps.size(); ++s) {
    const Step st = steps[s];
    const std::string what =
        name + " step " + std::to_string(s) + (st.caller ? " caller routing" : " router") + (st.graph ? " graph" : "");
    // Every rank draws the whole batch, so the references see every rank's tokens.
    const std::vector<uint16_t> x_all = random_tokens(kBatch, d, rng);
    std::vector<int32_t> idx_all;
    std::vector<float> w_all;
    if (st.caller) random_routing(kBatch, E, k, rng, idx_all, w_all);
    x.upload(x_all.data() + size_t(t0) * d, size_t(T) * d);
    if (st.caller) {
      idx.upload(idx_all.data() + size_t(t0) * k, size_t(T) * k);
      w.upload(w_all.data() + size_t(t0) * k, size_t(T) * k);
    }
    const std::vector<uint16_t> poison(out.count, kPoison);
    out.upload(poison.data(), poison.size());
    if (st.graph && !graphs[st.caller])
      graphs[st.caller] = std::make_unique<CapturedGraph>(stream.s, [&] { issue(st.caller); });

    sync.wait();
    if (st.graph)
      graphs[st.caller]->launch(stream.s);
    else
      issue(st.caller);
    layer.check(stream.s);
    const std::vector<uint16_t> got = out.download(size_t(T) * d);
    const auto got_idx = download(layer.topk_idx(), size_t(T) * k);
    const auto got_w = download(layer.topk_weights(), size_t(T) * k);
    const auto got_slot = download(layer.topk_slot(), size_t(T) * k);
    const auto got_count = download(ep->recv_count(), size_t(e_loc));
    size_t poisoned = 0;
    for (uint16_t v : got) poisoned += std::isnan(bf16_to_float(v));
    EXPECT_EQ(poisoned, 0u) << what << ": outputs left poisoned or NaN";

    // The local transport, same inputs: this rank's results bit for bit.
    local.load(x_all, st.caller ? &idx_all : nullptr, st.caller ? &w_all : nullptr);
    local.issue(st.caller);
    local.check();
    const size_t diff_out = count_different_bits(got, local.out[me].download(size_t(T) * d));
    const size_t diff_idx = count_different_bits(got_idx, download(local.layers[me]->topk_idx(), size_t(T) * k));
    const size_t diff_w = count_different_bits(got_w, download(local.layers[me]->topk_weights(), size_t(T) * k));
    const size_t diff_slot = count_different_bits(got_slot, download(local.layers[me]->topk_slot(), size_t(T) * k));
    const size_t diff_count =
        count_different_bits(got_count, download(local.group->rank(me).recv_count(), size_t(e_loc)));
    EXPECT_EQ(diff_out, 0u) << what << ": outputs differ from the local transport's";
    EXPECT_EQ(diff_idx + diff_w + diff_slot, 0u) << what << ": routing differs from the local transport's (" << diff_idx
                                                 << " experts, " << diff_w << " weights, " << diff_slot << " slots)";
    EXPECT_EQ(diff_count, 0u) << what << ": recv_count differs from the local transport's";

    // The CPU layer of all ranks: routing and recv_count equal, the output within tolerance.
    const CpuResult cpu =
        run_cpu(P, protocol, placement, x_all, st.caller ? &idx_all : nullptr, st.caller ? &w_all : nullptr, seed);
    const std::vector<int32_t> cpu_idx(cpu.topk_idx.begin() + size_t(t0) * k,
                                       cpu.topk_idx.begin() + size_t(t0 + T) * k);
    EXPECT_EQ(got_idx, cpu_idx) << what << ": routing differs from the CPU layer's";
    EXPECT_EQ(got_count, cpu.recv_count[me]) << what << ": recv_count differs from the CPU layer's";
    const std::vector<uint16_t> cpu_out(cpu.out.begin() + size_t(t0) * d, cpu.out.begin() + size_t(t0 + T) * d);
    const double err = rel_error(got, to_double(cpu_out));
    size_t same = 0;
    for (size_t i = 0; i < got.size(); ++i) same += got[i] == cpu_out[i];
    EXPECT_LE(err, kLayerTolerance) << what << ": output against the CPU layer";
    int rows = 0;
    for (int v : got_count) rows += v;
    std::printf(
        "[layer-multi] %s: %d tokens, %d rows received; vs local transport %zu outputs differ; vs CPU layer "
        "%.3e (%zu/%zu the same bits)\n",
        what.c_str(), T, rows, diff_out, err, same, got.size());
  }
  sync.wait();  // no rank tears its buffers down while a peer may still write into them
  return ::testing::Test::HasFailure() ? 1 : 0;
}

// A rank process's body: runs Run(g, case, sync) and prints its verdict; a rank that fails raises
// `failed`, so its peers stop at their next barrier.
template <class Case, int (*Run)(const gpu::EpProcessGroup&, const Case&, RankSync&), std::string (*Name)(const Case&)>
int case_body(const gpu::EpProcessGroup& g, void* arg) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines appear even if the rank is killed
  const CaseArgs<Case>& a = *static_cast<const CaseArgs<Case>*>(arg);
  try {
    const int rc = Run(g, a.c, *a.sync);
    std::printf("[layer-multi] %s rank %d of %d: %s\n", Name(a.c).c_str(), g.rank, g.num_ranks, rc ? "FAILED" : "ok");
    if (rc) a.sync->failed.store(1, std::memory_order_release);
    return rc;
  } catch (...) {
    a.sync->failed.store(1, std::memory_order_release);
    throw;  // launch_ranks prints it
  }
}

// Forks P rank processes running `body` on case `c` with one RankSync page between them (mapped
// before the fork); returns how many failed.
template <class Case>
int launch_case(int P, const Case& c, int (*body)(const gpu::EpProcessGroup&, void*)) {
  fixture();  // written and read here, before the fork: the ranks share it
  void* page = mmap(nullptr, sizeof(RankSync), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  MOEKIT_CHECK(page != MAP_FAILED, std::string("mmap of the shared page failed"));
  RankSync* sync = new (page) RankSync();
  sync->num_ranks = P;
  CaseArgs<Case> args{c, sync};
  std::fflush(nullptr);  // nothing buffered here is printed again by the ranks
  const int failed = gpu::launch_ranks(P, kRankTimeout, body, &args);
  sync->~RankSync();
  munmap(page, sizeof(RankSync));
  return failed;
}

class GpuLayerMulti : public ::testing::TestWithParam<MultiCase> {};

TEST_P(GpuLayerMulti, EqualsCpuLayerAndLocalTransport) {
  static const int gpus = gpu::count_devices_in_child();
  if (gpus < 2) GTEST_SKIP() << gpus << " GPU(s): one process per GPU needs at least 2";
  const int P = std::min(gpus, 8);
  const int failed = launch_case(P, GetParam(), case_body<MultiCase, run_rank, case_name>);
  EXPECT_EQ(failed, 0) << failed << " of " << P << " ranks failed, see their messages above";
}

// ---- Staged weight moves across processes ---------------------------------------------------

struct MoveCase {
  gpu::EpTransport transport;
  bool stall;  // the last rank stops stepping once the copies are under way
};

std::string move_case_name(const MoveCase& c) {
  return std::string(c.transport == gpu::EpTransport::kNvlink ? "Nvlink" : "Nccl") + (c.stall ? "RankStalls" : "");
}

int run_moves_rank(const gpu::EpProcessGroup& g, const MoveCase& c, RankSync& sync) {
  const Fixture& f = fixture();
  const int P = g.num_ranks, me = g.rank, d = int(f.model.hidden_size), k = f.model.num_experts_per_token;
  const auto placements = drifted_placements(P);
  const Placement &a = placements.first, &b = placements.second;
  const uint64_t seed = 23;
  const int t_max = (kBatch + P - 1) / P, t0 = first_token(me, P, kBatch), T = first_token(me + 1, P, kBatch) - t0;
  const std::string name = "moves " + move_case_name(c) + " P=" + std::to_string(P) + " rank " + std::to_string(me);
  gpu::EpConfig ec = gpu::layer_ep_config(f.model, a.num_slots, P, t_max, gpu::EpMode::kLowLatency);
  ec.timeout_s = kWaitTimeout;
  std::unique_ptr<gpu::EpBuffer> ep = gpu::connect_ep(ec, g, c.transport);
  gpu::GpuLayerConfig cfg;
  cfg.max_tokens = t_max;
  cfg.replica_seed = seed;
  cfg.staging_slots = a.slots_per_gpu();
  cfg.move_chunk_bytes = size_t(64) << 10;
  gpu::GpuMoeLayer layer(f.model, f.weights, a, 0, *ep, cfg);
  if (c.transport == gpu::EpTransport::kNvlink) layer.set_peer_slots(layer.map_peer_slots());  // collective
  DeviceArray<uint16_t> x(size_t(t_max) * d), out(size_t(t_max) * d);
  Stream stream;
  std::mt19937 rng(300 + int(c.transport));  // the same tokens on every rank
  auto step = [&](const Placement& want, const std::string& what, bool barrier) {
    const std::vector<uint16_t> x_all = random_tokens(kBatch, d, rng);
    x.upload(x_all.data() + size_t(t0) * d, size_t(T) * d);
    if (barrier) sync.wait();
    layer.forward_decode(x.ptr, T, t0, out.ptr, stream.s);
    layer.check(stream.s);
    const CpuResult cpu = run_cpu(P, EpProtocol::kLowLatency, want, x_all, nullptr, nullptr, seed);
    const std::vector<int32_t> cpu_idx(cpu.topk_idx.begin() + size_t(t0) * k, cpu.topk_idx.begin() + size_t(t0 + T) * k);
    EXPECT_EQ(download(layer.topk_idx(), size_t(T) * k), cpu_idx) << what;
    EXPECT_EQ(download(ep->recv_count(), size_t(layer.num_local_experts())), cpu.recv_count[me]) << what;
    const std::vector<uint16_t> cpu_out(cpu.out.begin() + size_t(t0) * d, cpu.out.begin() + size_t(t0 + T) * d);
    const double err = rel_error(out.download(size_t(T) * d), to_double(cpu_out));
    EXPECT_LE(err, kLayerTolerance) << what;
    std::printf("[layer-moves-multi] %s: vs the CPU layer %.3e\n", what.c_str(), err);
  };
  step(a, name + ": before the moves", true);

  const std::vector<ExpertMove> moves = plan_moves(a, b);
  const size_t budget = size_t(512) << 10;
  layer.begin_moves(b, 0, moves, &f.weights, stream.s);
  int calls = 0;
  for (int r = 0; r < P; ++r) calls = std::max(calls, layer.advance_calls(r, moves, 0, budget));
  if (c.stall && me == P - 1) {
    // This rank's copies start, then it serves no more steps until the others are done.
    layer.advance_moves(budget);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kBarrierTimeout);
    while (!sync.released.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    layer.abort_moves();
    return 0;
  }
  if (c.stall) {
    // The next step waits for the stalled rank's send: the EP's named timeout, and no switch.
    layer.advance_moves(budget);
    try {
      step(a, name + ": copies in flight, a peer stalled", false);
      ADD_FAILURE() << name << ": a step with a stalled peer completed";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("timed out after"), std::string::npos) << msg;
      EXPECT_NE(msg.find("waiting for rank " + std::to_string(P - 1)), std::string::npos) << msg;
    }
    layer.abort_moves();
    EXPECT_FALSE(layer.moving()) << name;
    EXPECT_EQ(slots_not_holding(layer, a, me), 0) << name << ": the old placement's weights were touched";
    sync.released.store(1, std::memory_order_release);
    return ::testing::Test::HasFailure() ? 1 : 0;
  }
  for (int i = 0; i < calls; ++i) {
    layer.advance_moves(budget);
    step(a, name + ": copies in flight, step " + std::to_string(i), true);
  }
  EXPECT_TRUE(layer.moves_issued()) << name;
  layer.wait_moves(stream.s);
  step(a, name + ": the barrier step", true);
  const int switched = layer.commit_moves(stream.s);
  int mine = 0;
  for (const ExpertMove& m : moves) mine += m.dst_gpu == me;
  EXPECT_EQ(switched, mine) << name;
  EXPECT_EQ(slots_not_holding(layer, b, me), 0) << name << ": after the switch";
  for (int i = 0; i < 2; ++i) step(b, name + ": after the switch", true);
  sync.wait();
  return ::testing::Test::HasFailure() ? 1 : 0;
}

class GpuLayerMultiMoves : public ::testing::TestWithParam<MoveCase> {};

TEST_P(GpuLayerMultiMoves, SwitchAtTheCommitOrKeepTheOldPlacement) {
  static const int gpus = gpu::count_devices_in_child();
  if (gpus < 2) GTEST_SKIP() << gpus << " GPU(s): one process per GPU needs at least 2";
  const int P = std::min(gpus, 8);
  const int failed = launch_case(P, GetParam(), case_body<MoveCase, run_moves_rank, move_case_name>);
  EXPECT_EQ(failed, 0) << failed << " of " << P << " ranks failed, see their messages above";
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuLayerMultiMoves,
                         ::testing::Values(MoveCase{gpu::EpTransport::kNvlink, false},
                                           MoveCase{gpu::EpTransport::kNccl, false},
                                           MoveCase{gpu::EpTransport::kNvlink, true}),
                         [](const ::testing::TestParamInfo<MoveCase>& info) { return move_case_name(info.param); });

using gpu::EpTransport;
INSTANTIATE_TEST_SUITE_P(Transports, GpuLayerMulti,
                         ::testing::Values(MultiCase{EpTransport::kNvlink, true, false, false},
                                           MultiCase{EpTransport::kNvlink, false, false, false},
                                           MultiCase{EpTransport::kNccl, true, false, false},
                                           MultiCase{EpTransport::kNccl, false, false, false},
                                           MultiCase{EpTransport::kNvlink, true, true, true},
                                           MultiCase{EpTransport::kNccl, false, true, false},
                                           MultiCase{EpTransport::kNvlink, true, false, false, true},
                                           MultiCase{EpTransport::kNccl, true, false, false, true},
                                           MultiCase{EpTransport::kNvlink, true, true, true, true}),
                         [](const ::testing::TestParamInfo<MultiCase>& info) { return case_name(info.param); });

}  // namespace
