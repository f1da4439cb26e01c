// `moekit spec`: list the embedded specs, or print and validate one (embedded name or file).
#include <fmt/format.h>

#include "cli/commands.h"
#include "moekit/spec.h"

namespace moekit::cli {

void add_spec_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("spec", "List embedded model and GPU specs, or validate and print one");
  static std::string model, gpu;
  cmd->add_option("--model", model, "model name or JSON file to validate and print");
  cmd->add_option("--gpu", gpu, "GPU name or JSON file to validate and print");
  cmd->callback([] {
    if (!model.empty()) fmt::print("{}\n", to_json(load_model_spec(model)));
    if (!gpu.empty()) fmt::print("{}\n", to_json(load_gpu_spec(gpu)));
    if (model.empty() && gpu.empty()) {
      fmt::print("models: {}\n", fmt::join(embedded_model_names(), ", "));
      fmt::print("gpus:   {}\n", fmt::join(embedded_gpu_names(), ", "));
    }
  });
}

}  // namespace moekit::cli
