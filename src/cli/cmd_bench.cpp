// `moekit bench`: placeholder until its issue lands; it says so instead of pretending.
#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "(not built yet)");
  cmd->callback([] { throw Error("'moekit bench' is not built yet"); });
}

}  // namespace moekit::cli
