// The `moekit` subcommands. Each lives in its own cmd_*.cpp and registers itself on the app;
// a command's callback throws moekit::Error on bad input (main prints it and exits 2).
#pragma once
#include <CLI/CLI.hpp>

namespace moekit::cli {
void add_spec_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_eplb_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_bench_command(CLI::App& app);
}  // namespace moekit::cli
