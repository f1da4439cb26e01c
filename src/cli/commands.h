// The `moekit` subcommands. Each lives in its own cmd_*.cpp and registers itself on the app;
// a command's callback throws moekit::Error on bad input (main prints it and exits 2).
#pragma once
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

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

// An output option's path, checked before any work, so that a bad one costs nothing and prints
// nothing: a folder that does not exist, a directory or a device where a file goes
// (resolve_output_path), or one of the command's own input files (inputs: {path, option}) is an
// Error naming the option. Nothing is checked for an empty path (the option was not given).
void check_output_option(const std::string& path, std::string_view option,
                         std::initializer_list<std::pair<std::string_view, std::string_view>> inputs = {});

// Adds to every option of every subcommand of `app` the checks CLI11 does not make: a value is
// not empty, not an option name, and a number is decimal (no octal "010", no "0x"). Call it once
// every command is added.
void check_option_values(CLI::App& app);

void add_spec_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_eplb_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_bench_command(CLI::App& app);
}  // namespace moekit::cli
