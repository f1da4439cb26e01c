// moekit/trace.h: a routing trace, the top-k expert indices of every token of every step.
//
// Written by `moekit simulate --save-trace` and by the layer runtime, read by `moekit eplb
// --trace`. Tokens of a step are spread evenly and contiguously over the ranks: token t of a
// step with T tokens lives on rank t / (T / num_ranks). File format (JSON):
//   {"format": "moekit-trace", "num_experts": E, "topk": k, "num_ranks": P,
//    "layers": [ [ step: [ token: [e_0, ..., e_{k-1}] ] ] ]}   // layers[l][s][t][j]
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moekit {

struct RoutingTrace {
  int num_experts = 0;
  int topk = 0;
  int num_ranks = 1;
  // layers[l][s] holds one step's top-k indices, row-major [tokens][topk].
  std::vector<std::vector<std::vector<int32_t>>> layers;

  int num_layers() const { return int(layers.size()); }
  int num_steps(int layer) const { return int(layers[layer].size()); }
  int num_tokens(int layer, int step) const { return int(layers[layer][step].size()) / topk; }
};

// Validates: E in [1, kMaxExperts], k in [1, E], P in [1, kMaxRanks], at least one layer and at
// most kMaxLayers, kMaxTableEntries layers x experts (moekit/limits.h); at least one step in
// every layer; every index in [0, E), the k indices of a token distinct; every step's size a
// multiple of k and of P tokens. Errors name the layer, step, token and value.
// read_trace() also names the file and the field; an id must be an integer-valued number.
void validate_trace(const RoutingTrace& trace);
RoutingTrace read_trace(const std::string& path);
void write_trace(const RoutingTrace& trace, const std::string& path);

}  // namespace moekit
