// libFuzzer harness: the input is a model spec and a GPU spec (the same text read as both), read
// from a file as `--model FILE` / `--gpu FILE` are, then written back (docs/fuzzing.md).
#include "fuzz/fuzz_input.h"
#include "moekit/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moekit::fuzz::write_input("spec.json", moekit::fuzz::as_text(data, size));
  moekit::fuzz::expect_value_or_error([&] { (void)moekit::to_json(moekit::load_model_spec(path)); });
  moekit::fuzz::expect_value_or_error([&] { (void)moekit::to_json(moekit::load_gpu_spec(path)); });
  return 0;
}
