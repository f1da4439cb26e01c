// Load files (JSON or CSV) and placement JSON, as `moekit eplb` reads them.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

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

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::vector<double>> loads_from_json(const std::string& text, const std::string& path) {
  json j = parse_json(text, fmt::format("'{}'", path));
  MOEKIT_CHECK(j.is_object() && j.contains("layers") && j["layers"].is_array(),
               fmt::format("'{}': expected {{\"layers\": [[load, ...], ...]}}", path));
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

std::vector<std::vector<double>> loads_from_csv(const std::string& text, const std::string& path) {
  std::vector<std::vector<double>> w;
  std::istringstream lines(text);
  std::string line;
  for (int line_no = 1; std::getline(lines, line); ++line_no) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    MOEKIT_CHECK(w.size() < size_t(kMaxLayers),
                 fmt::format("'{}' line {}: more than the limit of {} layers", path, line_no, kMaxLayers));
    auto& row = w.emplace_back();
    std::istringstream fields(line);
    std::string field;
    while (std::getline(fields, field, ',')) {
      field = trim(field);
      MOEKIT_CHECK(row.size() < size_t(kMaxExperts), fmt::format("'{}' line {}: layer {} holds more than the limit of {} "
                                                               "expert loads",
                                                               path, line_no, w.size() - 1, kMaxExperts));
      MOEKIT_CHECK(!field.empty(), fmt::format("'{}' line {}: load of layer {} expert {} is missing", path, line_no,
                                               w.size() - 1, row.size()));
      char* end = nullptr;
      double v = std::strtod(field.c_str(), &end);
      MOEKIT_CHECK(end && *end == '\0',
                   fmt::format("'{}' line {}: load of layer {} expert {} is '{}', expected a number", path, line_no,
                               w.size() - 1, row.size(), quote_text(field)));
      row.push_back(v);
    }
    MOEKIT_CHECK(line.back() != ',', fmt::format("'{}' line {}: load of layer {} expert {} is missing (trailing comma)",
                                                 path, line_no, w.size() - 1, row.size()));
  }
  return w;
}

}  // namespace

std::vector<std::vector<double>> read_loads(const std::string& path) {
  const std::string text = trim(read_text(path, "load"));
  MOEKIT_CHECK(!text.empty(), fmt::format("load file '{}' is empty", path));
  auto w = text[0] == '{' ? loads_from_json(text, path) : loads_from_csv(text, path);
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
  const int num_experts = f.integer<int>("num_experts", 1, kMaxExperts);
  const int num_groups = f.integer<int>("num_groups", 1, kMaxExperts);
  const int num_nodes = f.integer<int>("num_nodes", 1, kMaxRanks);
  const int num_gpus = f.integer<int>("num_gpus", 1, kMaxRanks);
  const json& rows = f.array("phy2log", kMaxLayers);
  MOEKIT_CHECK(!rows.empty() && rows[0].is_array() && !rows[0].empty(), fmt::format("{}: phy2log is empty", origin));
  const int num_layers = int(rows.size());
  const size_t num_slots = rows[0].size();
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
