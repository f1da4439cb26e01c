// `moekit run`: placeholder until its issue lands; it says so instead of pretending.
#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {

void add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "(not built yet)");
  cmd->callback([] { throw Error("'moekit run' is not built yet"); });
}

}  // namespace moekit::cli
