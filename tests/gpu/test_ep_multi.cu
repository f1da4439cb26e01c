// The cross-process transports (`nvlink`: CUDA IPC peer mapping; `nccl`: grouped send/receive)
// with one process per GPU, started by launch_ranks. Every rank draws every rank's inputs from the
// same seed, so each can compute the whole reference and check its own outputs: dispatch bit for
// bit, combine within BF16 rounding, over three steps with changing routing. Skipped where fewer
// than two GPUs exist. This process never initialises CUDA itself (it forks the ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "test_ep_reference.h"

using namespace ep_test;

namespace {

struct MultiArgs {
  Shape shape;
  EpTransport transport;
};

int rank_body(const EpProcessGroup& g, void* arg) {
  const MultiArgs& a = *static_cast<const MultiArgs*>(arg);
  const EpConfig c = make_config(a.shape);
  const int P = c.num_ranks, me = g.rank;
  std::unique_ptr<EpBuffer> buf = connect_ep(c, g, a.transport);
  cudaStream_t stream;
  MOEKIT_CUDA_CHECK(cudaStreamCreate(&stream));
  DeviceStep dev(c);  // only slot `me` is used
  std::mt19937 rng(777);
  int bad = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<RankInput> in;
    std::uniform_int_distribution<int> tokens(0, c.max_tokens);
    for (int r = 0; r < P; ++r) in.push_back(random_input(c, step == 0 ? c.max_tokens : tokens(rng), rng, step));
    dev.upload(me, in[me]);
    poison_masked(*buf);
    buf->dispatch_send(dev.x[me], dev.idx[me], dev.w[me], in[me].num_tokens, stream);
    buf->dispatch_recv(stream);
    buf->check(stream);
    const Reference ref = masked_reference(c, in);
    bad += compare_masked(*buf, ref.ranks[me], me);

    std::vector<std::vector<uint16_t>> y(P), add(P);
    for (int r = 0; r < P; ++r) y[r] = random_y(c, ref.ranks[r].count, rng);
    MOEKIT_CUDA_CHECK(cudaMemcpy(dev.y[me], y[me].data(), y[me].size() * 2, cudaMemcpyHostToDevice));
    buf->combine_send(dev.y[me], stream);
    buf->combine_recv(nullptr, dev.out[me], stream);
    buf->check(stream);
    const auto want = combine_reference(c, in, ref.row_of, y, add);
    compare_combine(to_host(dev.out[me], size_t(in[me].num_tokens) * c.hidden), want[me], me);
  }
  cudaStreamDestroy(stream);
  const bool failed = bad > 0 || ::testing::Test::HasFailure();
  std::printf("[ep] rank %d of %d (%s): %s\n", me, P, ep_transport_name(a.transport), failed ? "FAILED" : "ok");
  return failed ? 1 : 0;
}

void run_transport(EpTransport transport) {
  const int gpus = count_devices_in_child();
  if (gpus < 2) GTEST_SKIP() << gpus << " GPU(s): the cross-process transports need at least 2";
  const int P = std::min(gpus, 8);
  MultiArgs args{{P, 32, 512, 8 * P, 8}, transport};
  EXPECT_EQ(launch_ranks(P, 300.0, rank_body, &args), 0) << "ranks failed, see their messages above";
}

TEST(EpMulti, NvlinkMatchesReference) { run_transport(EpTransport::kNvlink); }
TEST(EpMulti, NcclMatchesReference) { run_transport(EpTransport::kNccl); }

}  // namespace
