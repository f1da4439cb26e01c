// `moekit bench gemm|ep|layer [ARGS...]`: runs the GPU benchmark program of that name
// (bench_gemm, bench_ep, bench_layer, built beside `moekit` when CUDA is on) with ARGS.
// The benchmarks stay separate programs so each can be copied to a GPU host alone; this
// command is the one door to them.
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "moekit/check.h"

namespace moekit::cli {

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Run a GPU benchmark: gemm | ep | layer, with its own flags after it");
  static std::string which;
  static std::vector<std::string> args;
  cmd->add_option("which", which, "gemm, ep or layer")->required()->check(CLI::IsMember({"gemm", "ep", "layer"}));
  cmd->add_option("args", args, "flags passed to the benchmark (e.g. --json FILE); put them after --");
  cmd->callback([] {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    MOEKIT_CHECK(!ec, fmt::format("moekit bench: cannot find the moekit executable: {}", ec.message()));
    const std::filesystem::path program = self.parent_path() / ("bench_" + which);
    MOEKIT_CHECK(std::filesystem::exists(program),
                 fmt::format("moekit bench {}: '{}' does not exist: the GPU benchmarks are built only with CUDA "
                             "(MOEKIT_WITH_CUDA=ON), and run only where a GPU is visible",
                             which, program.string()));
    std::vector<std::string> argv_strings{program.string()};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    ::execv(program.c_str(), argv.data());
    throw Error(fmt::format("moekit bench {}: cannot run '{}'", which, program.string()));
  });
}

}  // namespace moekit::cli
