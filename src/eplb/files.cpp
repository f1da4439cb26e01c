// Load files (JSON or CSV) and placement JSON, as `moekit eplb` reads them.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "io/file_io.h"
#include "io/json_read.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/limits.h"

namespace moekit {
namespace {

using nlohmann::json;

std::string read_text(const std::string& path, const char* what) {
  return read_regular_file(path, fmt::format("{} file", what));
}

// The whitespace a load file may hold around its values: spaces and tabs in a line, and the
// line ends ("\n", "\r\n"). Other control bytes (NUL, form feed, ESC, ...) are refused.
bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && is_blank(s[b])) ++b;
  while (e > b && is_blank(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// `s` cut to kMaxQuotedChars bytes, each byte outside printable ASCII written as \xNN, so that an
// error message shows exactly what is in the file and prints nothing raw to the terminal.
std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMaxQuotedChars; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out += c >= 0x20 && c < 0x7f ? std::string(1, char(c)) : fmt::format("\\x{:02X}", unsigned(c));
  }
  return s.size() > kMaxQuotedChars ? out + "..." : out;
}

// Line and column (both from 1) of byte `pos` of `text`.
std::pair<int64_t, int64_t> line_and_column(const std::string& text, size_t pos) {
  const size_t line_start = pos == 0 ? 0 : text.rfind('\n', pos - 1) + 1;  // npos + 1 = 0 on the first line
  return {int64_t(std::count(text.begin(), text.begin() + pos, '\n')) + 1, int64_t(pos - line_start) + 1};
}

// A CSV load file is printable text: strtod would stop at a NUL byte without a word ("5\0abc"
// read as 5, a file of NULs as one load), and no other control byte belongs in a number.
void check_csv_bytes(const std::string& text, const std::string& path) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const bool line_end = c == '\n' || (c == '\r' && (i + 1 == text.size() || text[i + 1] == '\n'));
    if ((c >= 0x20 && c != 0x7f) || c == '\t' || line_end) continue;
    const auto [line, column] = line_and_column(text, i);
    throw Error(fmt::format("'{}' line {} column {}: control byte \\x{:02X}, expected printable text (numbers, commas, "
                            "spaces, tabs, '#' comments and line ends)",
                            path, line, column, unsigned(c)));
  }
}

// Whether `s` is [+-]digits[.digits][(e|E)[+-]digits] with digits on at least one side of the
// point, or nan / inf / infinity in any case with an optional sign: the numbers strtod reads,
// less hexadecimal ("0x10", "0x1p3"). NaN and inf are let through for validate_loads() to
// refuse by name, as it refuses them in JSON.
bool is_decimal_number(std::string_view s) {
  size_t i = 0;
  auto digits = [&] {
    const size_t from = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    return i - from;
  };
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  std::string word(s.substr(i));
  std::transform(word.begin(), word.end(), word.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (word == "nan" || word == "inf" || word == "infinity") return true;
  size_t n = digits();
  if (i < s.size() && s[i] == '.') ++i, n += digits();
  if (n == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == s.size();
}

// The load in `field` (trimmed, non-empty); `where()` (called on failure only) names it.
template <class Where>
double parse_csv_load(const std::string& field, Where&& where) {
  MOEKIT_CHECK(is_decimal_number(field),
               fmt::format("{} is '{}', expected a number (decimal digits with an optional sign, decimal point and "
                           "exponent, as 12, 0.5 or 1e6)",
                           where(), printable(field)));
  return std::strtod(field.c_str(), nullptr);  // the whole field: it holds no NUL and no hex
}

std::vector<std::vector<double>> loads_from_json(const std::string& text, const std::string& path) {
  json j = parse_json(text, fmt::format("'{}'", path));
  MOEKIT_CHECK(j.is_object() && j.contains("layers") && j["layers"].is_array(),
               fmt::format("'{}': expected {{\"layers\": [[load, ...], ...]}}", path));
  {
    // Refuse other keys, as a spec does: a typo such as "layer" next to "layers" is a mistake.
    JsonFields f(j, fmt::format("'{}'", path));
    f.at("layers");
    f.reject_unknown();
  }
  const json& layers = j["layers"];
  MOEKIT_CHECK(layers.size() <= size_t(kMaxLayers),
               fmt::format("'{}': {} layers exceed the limit of {}", path, layers.size(), kMaxLayers));
  std::vector<std::vector<double>> w;
  for (size_t l = 0; l < layers.size(); ++l) {
    const json& row = layers[l];
    MOEKIT_CHECK(row.is_array(), fmt::format("'{}': layer {} is {}, expected an array of loads", path, l, quote(row)));
    MOEKIT_CHECK(row.size() <= size_t(kMaxExperts),
                 fmt::format("'{}': layer {} holds {} loads, more than the limit of {} experts", path, l, row.size(),
                             kMaxExperts));
    auto& out = w.emplace_back();
    for (size_t e = 0; e < row.size(); ++e) {
      MOEKIT_CHECK(row[e].is_number(), fmt::format("'{}': load of layer {} expert {} is {}, expected a number (missing "
                                                   "or malformed load)",
                                                   path, l, e, quote(row[e])));
      out.push_back(row[e].get<double>());
    }
  }
  return w;
}

// One layer per line, loads separated by commas, spaces and tabs around a load ignored; blank
// lines and lines starting with '#' skipped. Errors name the line, the column and the field.
std::vector<std::vector<double>> loads_from_csv(const std::string& text, const std::string& path) {
  check_csv_bytes(text, path);
  std::vector<std::vector<double>> w;
  size_t line_start = 0;
  for (int64_t line_no = 1; line_start < text.size(); ++line_no) {
    size_t line_end = text.find('\n', line_start);
    if (line_end == std::string::npos) line_end = text.size();
    const std::string_view line(text.data() + line_start, line_end - line_start);
    line_start = line_end + 1;
    const std::string trimmed = trim(std::string(line));
    if (trimmed.empty() || trimmed[0] == '#') continue;
    MOEKIT_CHECK(w.size() < size_t(kMaxLayers),
                 fmt::format("'{}' line {}: more than the limit of {} layers", path, line_no, kMaxLayers));
    auto& row = w.emplace_back();
    for (size_t from = 0;;) {
      const size_t comma = std::min(line.find(',', from), line.size());
      const std::string field = trim(std::string(line.substr(from, comma - from)));
      MOEKIT_CHECK(row.size() < size_t(kMaxExperts), fmt::format("'{}' line {}: layer {} holds more than the limit of {} "
                                                               "expert loads",
                                                               path, line_no, w.size() - 1, kMaxExperts));
      auto where = [&] {
        size_t column = from;
        while (column < comma && is_blank(line[column])) ++column;
        return fmt::format("'{}' line {} column {} (field {}): load of layer {} expert {}", path, line_no, column + 1,
                           row.size(), w.size() - 1, row.size());
      };
      MOEKIT_CHECK(!field.empty(), fmt::format("{} is missing{}", where(), comma == line.size() && from > 0
                                                                               ? " (trailing comma)"
                                                                               : ""));
      row.push_back(parse_csv_load(field, where));
      if (comma == line.size()) break;
      from = comma + 1;
    }
  }
  return w;
}

// A placement's optional summary fields must agree with its phy2log, from which the placement
// is built: a file whose fields disagree was edited by hand or is not what it claims to be.
void check_declared(JsonFields& f, const char* key, int64_t actual, const char* actual_is) {
  if (!f.has(key)) return;
  const int64_t declared = f.integer<int64_t>(key, 0, std::numeric_limits<int64_t>::max());
  MOEKIT_CHECK(declared == actual, fmt::format("{} = {} does not match the data: {} {}", f.field_name(key), declared,
                                               actual_is, actual));
}

void check_replica_count(JsonFields& f, const Placement& p) {
  if (!f.has("replica_count")) return;
  const json& rows = f.array("replica_count", kMaxLayers);
  MOEKIT_CHECK(int(rows.size()) == p.num_layers, fmt::format("{} holds {} layers, phy2log {}", f.field_name("replica_count"),
                                                             rows.size(), p.num_layers));
  for (int l = 0; l < p.num_layers; ++l) {
    const int32_t* count = p.replica_count_row(l);
    const std::vector<int32_t> want(count, count + p.num_experts);
    MOEKIT_CHECK(rows[l].is_array() && rows[l] == json(want),
                 fmt::format("{} layer {} = {} does not match phy2log, which gives {}", f.field_name("replica_count"), l,
                             quote(rows[l]), quote(json(want))));
  }
}

}  // namespace

std::vector<std::vector<double>> read_loads(const std::string& path) {
  const std::string text = read_text(path, "load");
  const std::string content = trim(text);
  MOEKIT_CHECK(!content.empty(), fmt::format("load file '{}' is empty", path));
  // The whole text either way, so that a CSV error's line and column are the file's.
  auto w = content[0] == '{' ? loads_from_json(text, path) : loads_from_csv(text, path);
  try {
    validate_loads(w);
  } catch (const Error& e) {
    throw Error(fmt::format("'{}': {}", path, e.what()));
  }
  return w;
}

Placement read_placement(const std::string& path) {
  const std::string origin = fmt::format("placement '{}'", path);
  json j = parse_json(read_text(path, "placement"), origin);
  JsonFields f(j, origin);
  // "format" is optional (placements written by hand may lack it), but another kind of file is
  // refused, as read_trace() refuses one that is not "moekit-trace".
  if (f.has("format")) {
    const std::string format = f.str("format");
    MOEKIT_CHECK(format == "moekit-placement", fmt::format("{}: field 'format' = \"{}\" must be \"moekit-placement\"",
                                                           origin, quote_text(format)));
  }
  const int num_experts = f.integer<int>("num_experts", 1, kMaxExperts);
  const int num_groups = f.integer<int>("num_groups", 1, kMaxExperts);
  const int num_nodes = f.integer<int>("num_nodes", 1, kMaxRanks);
  const int num_gpus = f.integer<int>("num_gpus", 1, kMaxRanks);
  const json& rows = f.array("phy2log", kMaxLayers);
  MOEKIT_CHECK(!rows.empty() && rows[0].is_array() && !rows[0].empty(), fmt::format("{}: phy2log is empty", origin));
  const int num_layers = int(rows.size());
  const size_t num_slots = rows[0].size();
  check_declared(f, "num_layers", num_layers, "phy2log holds");
  check_declared(f, "num_slots", int64_t(num_slots), "phy2log layer 0 holds");
  MOEKIT_CHECK(num_slots <= size_t(kMaxSlots),
               fmt::format("{}: phy2log layer 0 has {} slots, more than the limit of {}", origin, num_slots, kMaxSlots));
  MOEKIT_CHECK(int64_t(num_layers) * int64_t(num_slots) <= kMaxTableEntries,
               fmt::format("{}: phy2log holds {} layers x {} slots, more than the limit of {} entries", origin, num_layers,
                           num_slots, kMaxTableEntries));
  std::vector<int32_t> flat;
  flat.reserve(size_t(num_layers) * num_slots);
  for (int l = 0; l < num_layers; ++l) {
    MOEKIT_CHECK(rows[l].is_array() && rows[l].size() == num_slots,
                 fmt::format("{}: phy2log layer {} = {} must be an array of {} slots, as layer 0", origin, l,
                             quote(rows[l]), num_slots));
    for (size_t s = 0; s < num_slots; ++s)
      flat.push_back(json_integer<int32_t>(rows[l][s], 0, num_experts - 1,
                                           [&] { return fmt::format("{}: phy2log layer {} slot {}", origin, l, s); }));
  }
  Placement p;
  try {
    p = placement_from_phy2log(flat, num_layers, num_experts, int(num_slots), num_groups, num_nodes, num_gpus);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", origin, e.what()));
  }
  // max_replicas is log2phy's row width: at least the most replicated expert's count, and may be
  // wider (rows padded with -1, as a spliced placement's or DeepSeek's maxlogcnt).
  if (f.has("max_replicas")) {
    const int64_t declared = f.integer<int64_t>("max_replicas", 0, std::numeric_limits<int64_t>::max());
    MOEKIT_CHECK(declared >= p.max_replicas && declared <= int64_t(num_slots),
                 fmt::format("{} = {} does not match the data: the most replicated expert of phy2log has {}, and a "
                             "layer has {} slots",
                             f.field_name("max_replicas"), declared, p.max_replicas, num_slots));
  }
  check_replica_count(f, p);
  if (f.has("policy")) {
    const std::string policy = f.str("policy"), want = p.hierarchical() ? "hierarchical" : "global";
    MOEKIT_CHECK(policy == want, fmt::format("{}: field 'policy' = \"{}\", but num_groups = {} and num_nodes = {} give "
                                             "the {} policy",
                                             origin, quote_text(policy), num_groups, num_nodes, want));
  }
  if (!f.has("log2phy")) return p;
  // Keep the file's replica order after checking it names exactly each expert's slots.
  const json& l2p = f.array("log2phy", kMaxLayers);
  MOEKIT_CHECK(int(l2p.size()) == p.num_layers,
               fmt::format("{}: log2phy has {} layers, phy2log {}", origin, l2p.size(), p.num_layers));
  std::vector<int32_t> log2phy(p.log2phy.size(), -1);
  for (int l = 0; l < p.num_layers; ++l) {
    MOEKIT_CHECK(l2p[l].is_array() && int(l2p[l].size()) == num_experts,
                 fmt::format("{}: log2phy layer {} = {} must be an array of {} experts", origin, l, quote(l2p[l]),
                             num_experts));
    for (int e = 0; e < num_experts; ++e) {
      const json& slots = l2p[l][e];
      MOEKIT_CHECK(slots.is_array() && slots.size() <= num_slots,
                   fmt::format("{}: log2phy layer {} expert {} = {} must be an array of at most {} slots", origin, l, e,
                               quote(slots), num_slots));
      std::vector<int32_t> got;
      for (const json& s : slots) {
        const int32_t slot = json_integer<int32_t>(s, -1, int32_t(num_slots) - 1, [&] {
          return fmt::format("{}: log2phy layer {} expert {}: slot", origin, l, e);
        });
        if (slot >= 0) got.push_back(slot);
      }
      std::vector<int32_t> want(p.log2phy_row(l) + size_t(e) * p.max_replicas,
                                p.log2phy_row(l) + size_t(e) * p.max_replicas + p.replica_count_row(l)[e]);
      std::vector<int32_t> got_sorted = got;
      std::sort(got_sorted.begin(), got_sorted.end());
      MOEKIT_CHECK(got_sorted == want, fmt::format("{}: log2phy layer {} expert {} lists slots {}, phy2log puts it in {}",
                                                   origin, l, e, quote(json(got)), quote(json(want))));
      std::copy(got.begin(), got.end(), log2phy.begin() + (size_t(l) * num_experts + e) * p.max_replicas);
    }
  }
  p.log2phy = std::move(log2phy);
  return p;
}

}  // namespace moekit
