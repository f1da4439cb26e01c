// libFuzzer harness: the input is a .safetensors file (docs/fuzzing.md).
#include "fuzz/fuzz_input.h"
#include "moekit/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moekit::fuzz::write_input("input.safetensors", moekit::fuzz::as_text(data, size));
  moekit::fuzz::expect_value_or_error([&] {
    const moekit::SafetensorsFile f = moekit::SafetensorsFile::open(path);
    // Touch every byte of every tensor, so that an offset past the mapping is an ASan report.
    volatile uint8_t sum = 0;
    for (const auto& t : f.tensors()) {
      for (uint8_t b : f.bytes(t.name)) sum = sum + b;
      (void)t.num_elements();
    }
    for (const auto& [k, v] : f.metadata()) sum = sum + uint8_t(k.size() + v.size());
  });
  return 0;
}
