// libFuzzer harness: the input is a placement (`moekit eplb --current FILE`) (docs/fuzzing.md).
#include "fuzz/fuzz_input.h"
#include "moekit/eplb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moekit::fuzz::write_input("placement.json", moekit::fuzz::as_text(data, size));
  moekit::fuzz::expect_value_or_error([&] { (void)moekit::read_placement(path); });
  return 0;
}
