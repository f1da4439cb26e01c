// libFuzzer harness: the input is a routing trace (`moekit eplb --trace FILE`), read and turned
// into per-expert loads as eplb does (docs/fuzzing.md).
#include "fuzz/fuzz_input.h"
#include "moekit/eplb.h"
#include "moekit/trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moekit::fuzz::write_input("trace.json", moekit::fuzz::as_text(data, size));
  moekit::fuzz::expect_value_or_error([&] {
    const moekit::RoutingTrace t = moekit::read_trace(path);
    (void)moekit::trace_loads(t);
  });
  return 0;
}
