// Checks shared by the commands (commands.h): output options before any work, and how every
// option's value is written.
#include <fmt/format.h>

#include <filesystem>

#include "cli/commands.h"
#include "io/file_io.h"
#include "moekit/check.h"

namespace moekit::cli {

void check_output_option(const std::string& path, std::string_view option,
                         std::initializer_list<std::pair<std::string_view, std::string_view>> inputs) {
  if (path.empty()) return;
  resolve_output_path(path, fmt::format("{} file", option));
  for (const auto& [input, input_option] : inputs)
    MOEKIT_CHECK(!same_file(path, std::string(input)),
                 fmt::format("{} '{}' is the file {} '{}' reads: writing it would replace the command's own input; "
                             "choose another path",
                             option, path, input_option, input));
}

namespace {

// CLI11 reads an integer with a leading 0 as octal ("010" is 8) and with 0x as hexadecimal, a
// float with 0x as a hexadecimal float, and an empty value as 0 or "not given"; and `--opt=`
// with nothing after the = takes the next argument ("--plot= --json": a folder named --json).
// Values are decimal, non-empty, and never an option name.
std::string value_error(const std::string& v, const std::string& type) {
  if (v.empty()) return "an empty value; expected a value";
  if (v.size() >= 2 && v[0] == '-' && v[1] == '-') return "'" + v + "' is an option, not a value (nothing after the =?)";
  const auto starts = [&](const char* prefix) { return type.rfind(prefix, 0) == 0; };
  const bool integer = starts("INT") || starts("UINT");
  if (!integer && !starts("FLOAT")) return {};
  if (v.find_first_of("xX") != std::string::npos) return "'" + v + "': write numbers in decimal";
  const size_t sign = v[0] == '-' || v[0] == '+' ? 1 : 0;
  if (integer && v.size() > sign + 1 && v[sign] == '0')
    return "'" + v + "': write integers in decimal, without leading zeros";
  return {};
}

}  // namespace

void check_option_values(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    for (CLI::Option* opt : sub->get_options([](CLI::Option*) { return true; })) {
      // Flags take no value; positionals (bench's pass-through arguments) are the tool's own.
      if (opt->get_expected_max() == 0 || !opt->nonpositional()) continue;
      const std::string type = opt->get_type_name();
      opt->check(CLI::Validator([type](std::string& v) { return value_error(v, type); }, "", "decimal"));
    }
}

}  // namespace moekit::cli
