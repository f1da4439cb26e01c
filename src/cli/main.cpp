// moekit: the command line. Parses, calls one layer, prints tables, JSON and plots.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "cli/interrupt.h"
#include "moekit/check.h"

int main(int argc, char** argv) {
  moekit::cli::start_interrupt_cleanup();
  CLI::App app{"moekit: MoE serving core for Hopper GPUs: planner, EPLB, FP8 grouped GEMMs, EP dispatch/combine"};
  app.require_subcommand(1);
  moekit::cli::add_spec_command(app);
  moekit::cli::add_plan_command(app);
  moekit::cli::add_simulate_command(app);
  moekit::cli::add_eplb_command(app);
  moekit::cli::add_run_command(app);
  moekit::cli::add_bench_command(app);
  moekit::cli::check_option_values(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Bad input has one exit status, whoever finds it (CLI11's own codes are 101..117).
    fmt::print(stderr, "moekit: error: {}\nRun with --help for more information.\n", e.what());
    return 2;
  } catch (const moekit::Error& e) {
    moekit::cli::wait_if_interrupted();
    fmt::print(stderr, "moekit: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    moekit::cli::wait_if_interrupted();
    fmt::print(stderr, "moekit: error: {}\n", e.what());
    return 2;
  }
  moekit::cli::wait_if_interrupted();
  return 0;
}
