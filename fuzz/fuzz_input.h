// What the harnesses share: the input as a file (the readers take paths, and the path is the
// code users run), and the rule that decides a finding.
//
// A harness calls one reader on the input. A moekit::Error is the expected answer to bad input;
// anything else escaping (another exception, a crash, an ASan or UBSan report, a hang past
// -timeout) is a finding: libFuzzer stops and writes the input to crash-<sha1>.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

#include "moekit/check.h"

namespace moekit::fuzz {

// This process's scratch directory under TMPDIR, removed at a normal exit (libFuzzer's own exits
// skip that; fuzz/run empties its TMPDIR after each harness).
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/moekit-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) std::abort();
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

// Writes `bytes` to scratch_dir()/name and returns the path.
inline std::string write_input(std::string_view name, std::string_view bytes) {
  const std::string path = (scratch_dir() / name).string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
  return path;
}

inline std::string_view as_text(const uint8_t* data, size_t size) { return {reinterpret_cast<const char*>(data), size}; }

// Runs `read`; a moekit::Error is the expected refusal.
template <class F>
void expect_value_or_error(F&& read) {
  try {
    read();
  } catch (const moekit::Error&) {
  }
}

}  // namespace moekit::fuzz
