// `moekit simulate`: placeholder until its issue lands; it says so instead of pretending.
#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {

void add_simulate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("simulate", "(not built yet)");
  cmd->callback([] { throw Error("'moekit simulate' is not built yet"); });
}

}  // namespace moekit::cli
