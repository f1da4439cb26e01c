// libFuzzer harness: a checkpoint directory. The input is split at each line "%%\n" into
// model.safetensors.index.json (absent when the first part is empty) and the files
// a.safetensors, b.safetensors; the checkpoint is opened, every tensor read, and one MoE layer
// of a small model loaded from it (docs/fuzzing.md).
#include <filesystem>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "moekit/safetensors.h"
#include "moekit/spec.h"
#include "moekit/weights.h"

namespace {

std::vector<std::string_view> split(std::string_view text) {
  std::vector<std::string_view> parts;
  for (size_t at; parts.size() < 2 && (at = text.find("\n%%\n")) != std::string_view::npos;) {
    parts.push_back(text.substr(0, at));
    text.remove_prefix(at + 4);
  }
  parts.push_back(text);
  return parts;
}

// hidden 128, 2 experts of inter 128, top-1: the smallest shapes the loader accepts.
const moekit::ModelSpec& small_spec() {
  static const moekit::ModelSpec spec = [] {
    moekit::ModelSpec s = moekit::load_model_spec("tiny-moe");
    s.hidden_size = 128;
    s.moe_intermediate_size = 128;
    s.num_routed_experts = 2;
    s.num_experts_per_token = 1;
    s.num_shared_experts = 0;
    s.shared_intermediate_size = 0;
    s.router.scoring = "softmax";
    s.router.num_groups = 1;
    s.router.topk_groups = 1;
    return s;
  }();
  return spec;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  const fs::path dir = moekit::fuzz::scratch_dir() / "ckpt";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto parts = split(moekit::fuzz::as_text(data, size));
  const char* names[] = {"ckpt/model.safetensors.index.json", "ckpt/a.safetensors", "ckpt/b.safetensors"};
  for (size_t i = 0; i < parts.size(); ++i)
    if (i > 0 || !parts[i].empty()) moekit::fuzz::write_input(names[i], parts[i]);
  moekit::fuzz::expect_value_or_error([&] {
    const moekit::Checkpoint c = moekit::Checkpoint::open(dir.string());
    volatile uint8_t sum = 0;
    for (const auto& name : c.tensor_names()) {
      moekit::fuzz::expect_value_or_error([&] {
        const moekit::TensorInfo& t = c.info(name);
        for (uint8_t b : c.bytes(name, t.dtype, t.shape)) sum = sum + b;
      });
    }
    (void)moekit::load_moe_layer(c, small_spec(), 0, 0, 2);
  });
  return 0;
}
