// moekit/limits.h: the largest count and size moekit accepts from a file or a flag.
//
// A spec, a trace, a load file, a placement or a command-line flag may come from anyone, and
// a 1 KB file can declare two billion experts. Every count and size read from outside is
// checked against the bound here, in its final type, before anything is allocated from it,
// and an Error names the value and the bound. The bounds are generous for real models
// (DeepSeek-V3: 61 layers, 256 experts, 288 slots on 8 GPUs; Kimi-K2: 384 experts) and keep
// every table moekit builds below a few GB. docs/design.md lists them with their reasons.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moekit {

inline constexpr int kMaxExperts = 1 << 16;     // routed experts E (spec, trace, loads, placement, --experts)
inline constexpr int kMaxSlots = 1 << 18;       // physical expert slots per layer (--slots, placements)
inline constexpr int kMaxLayers = 4096;         // layers of a model, trace, load file or placement
inline constexpr int kMaxRanks = 4096;          // GPUs / EP ranks / nodes (--ep, --ranks, --gpus, gpus_per_node)
inline constexpr int kMaxHiddenSize = 1 << 20;  // hidden_size and the expert intermediate sizes
inline constexpr int64_t kMaxBatch = int64_t(1) << 24;      // tokens of one step (simulate, run)
inline constexpr int64_t kMaxPlanBatch = int64_t(1) << 53;  // plan --batch: doubles count integers exactly to here
inline constexpr int64_t kMaxContext = int64_t(1) << 30;    // plan --context, tokens of KV cache per sequence
inline constexpr int64_t kMaxTrials = int64_t(1) << 22;     // simulate --trials and --steps
inline constexpr int kMaxThreads = 1024;                    // simulate --threads
// simulate's work, trials x batch x topk expert picks: each flag is bounded alone, but
// kMaxTrials x kMaxBatch picks would take weeks. 2^34 picks take minutes on one core.
inline constexpr int64_t kMaxSimulatePicks = int64_t(1) << 34;
// Entries of one per-layer table: layers x experts of a load matrix, layers x slots of phy2log,
// layers x experts x replicas of log2phy, tokens x GPUs of the dual-load search. 2^26 entries
// are 256 MB of int32.
inline constexpr int64_t kMaxTableEntries = int64_t(1) << 26;
// One expert's load (tokens, or any unit proportional to them): sums over every expert of
// every layer stay far from overflowing a double.
inline constexpr double kMaxLoad = 1e18;
// Nesting of JSON arrays and objects, the top level counting as 1: serde_json's limit, which
// the safetensors package applies to a header, so both accept the same files.
inline constexpr int kMaxJsonDepth = 127;
// Characters of a bad value quoted in an error message; longer values are cut with "...".
// Names (tensor names, JSON keys) are quoted up to kMaxQuotedNameChars, longer than any real one.
inline constexpr size_t kMaxQuotedChars = 64;
inline constexpr size_t kMaxQuotedNameChars = 256;

}  // namespace moekit
