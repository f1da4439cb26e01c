// `moekit eplb`: placeholder until its issue lands; it says so instead of pretending.
#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {

void add_eplb_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("eplb", "(not built yet)");
  cmd->callback([] { throw Error("'moekit eplb' is not built yet"); });
}

}  // namespace moekit::cli
