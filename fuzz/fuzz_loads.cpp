// libFuzzer harness: the input is a load file, JSON or CSV (`moekit eplb --load FILE`)
// (docs/fuzzing.md).
#include "fuzz/fuzz_input.h"
#include "moekit/eplb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moekit::fuzz::write_input("loads", moekit::fuzz::as_text(data, size));
  moekit::fuzz::expect_value_or_error([&] { (void)moekit::read_loads(path); });
  return 0;
}
