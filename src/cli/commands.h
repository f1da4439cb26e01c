// The `moekit` subcommands. Each lives in its own cmd_*.cpp and registers itself on the app;
// a command's callback throws moekit::Error on bad input (main prints it and exits 2).
#pragma once
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <string>

namespace moekit::cli {

// For a uint64_t option: CLI11 reads "-1" as 2^64 - 1 and saturates values past 2^64 - 1;
// this refuses both, before the conversion.
inline const CLI::Validator kUint64(
    [](std::string& s) {
      uint64_t v = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
      return ec == std::errc() && end == s.data() + s.size() && !s.empty()
                 ? std::string()
                 : "'" + s + "' is not an integer in [0, 18446744073709551615]";
    },
    "UINT64");

void add_spec_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_eplb_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_bench_command(CLI::App& app);
}  // namespace moekit::cli
