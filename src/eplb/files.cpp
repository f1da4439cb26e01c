// Load files (JSON or CSV) and placement JSON, as `moekit eplb` reads them.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/file_io.h"
#include "moekit/check.h"
#include "moekit/eplb.h"

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

json parse_json(const std::string& text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(fmt::format("'{}': malformed JSON: {}", path, e.what()));
  }
}

std::vector<std::vector<double>> loads_from_json(const std::string& text, const std::string& path) {
  json j = parse_json(text, path);
  MOEKIT_CHECK(j.is_object() && j.contains("layers") && j["layers"].is_array(),
               fmt::format("'{}': expected {{\"layers\": [[load, ...], ...]}}", path));
  std::vector<std::vector<double>> w;
  for (size_t l = 0; l < j["layers"].size(); ++l) {
    const json& row = j["layers"][l];
    MOEKIT_CHECK(row.is_array(), fmt::format("'{}': layer {} is {}, expected an array of loads", path, l, row.dump()));
    auto& out = w.emplace_back();
    for (size_t e = 0; e < row.size(); ++e) {
      MOEKIT_CHECK(row[e].is_number(), fmt::format("'{}': load of layer {} expert {} is {}, expected a number (missing "
                                                   "or malformed load)",
                                                   path, l, e, row[e].dump()));
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
    auto& row = w.emplace_back();
    std::istringstream fields(line);
    std::string field;
    while (std::getline(fields, field, ',')) {
      field = trim(field);
      MOEKIT_CHECK(!field.empty(), fmt::format("'{}' line {}: load of layer {} expert {} is missing", path, line_no,
                                               w.size() - 1, row.size()));
      char* end = nullptr;
      double v = std::strtod(field.c_str(), &end);
      MOEKIT_CHECK(end && *end == '\0',
                   fmt::format("'{}' line {}: load of layer {} expert {} is '{}', expected a number", path, line_no,
                               w.size() - 1, row.size(), field));
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
  json j = parse_json(read_text(path, "placement"), path);
  MOEKIT_CHECK(j.is_object(), fmt::format("placement '{}': expected a JSON object", path));
  int num_experts = 0, num_groups = 0, num_nodes = 0, num_gpus = 0;
  std::vector<std::vector<int32_t>> rows;
  try {
    num_experts = j.at("num_experts").get<int>();
    num_groups = j.at("num_groups").get<int>();
    num_nodes = j.at("num_nodes").get<int>();
    num_gpus = j.at("num_gpus").get<int>();
    rows = j.at("phy2log").get<std::vector<std::vector<int32_t>>>();
  } catch (const json::exception& e) {
    throw Error(fmt::format("placement '{}': {} (needs phy2log, num_experts, num_groups, num_nodes, num_gpus)", path,
                            e.what()));
  }
  MOEKIT_CHECK(!rows.empty() && !rows[0].empty(), fmt::format("placement '{}': phy2log is empty", path));
  const int num_slots = int(rows[0].size());
  std::vector<int32_t> flat;
  for (size_t l = 0; l < rows.size(); ++l) {
    MOEKIT_CHECK(int(rows[l].size()) == num_slots,
                 fmt::format("placement '{}': phy2log layer {} has {} slots, layer 0 has {}", path, l, rows[l].size(),
                             num_slots));
    flat.insert(flat.end(), rows[l].begin(), rows[l].end());
  }
  Placement p;
  try {
    p = placement_from_phy2log(flat, int(rows.size()), num_experts, num_slots, num_groups, num_nodes, num_gpus);
  } catch (const Error& e) {
    throw Error(fmt::format("placement '{}': {}", path, e.what()));
  }
  if (!j.contains("log2phy")) return p;
  // Keep the file's replica order after checking it names exactly each expert's slots.
  std::vector<std::vector<std::vector<int32_t>>> l2p;
  try {
    l2p = j.at("log2phy").get<decltype(l2p)>();
  } catch (const json::exception& e) {
    throw Error(fmt::format("placement '{}': log2phy: {}", path, e.what()));
  }
  MOEKIT_CHECK(int(l2p.size()) == p.num_layers,
               fmt::format("placement '{}': log2phy has {} layers, phy2log {}", path, l2p.size(), p.num_layers));
  std::vector<int32_t> log2phy(p.log2phy.size(), -1);
  for (int l = 0; l < p.num_layers; ++l) {
    MOEKIT_CHECK(int(l2p[l].size()) == num_experts,
                 fmt::format("placement '{}': log2phy layer {} has {} experts, expected {}", path, l, l2p[l].size(),
                             num_experts));
    for (int e = 0; e < num_experts; ++e) {
      std::vector<int32_t> got;
      for (int32_t s : l2p[l][e])
        if (s >= 0) got.push_back(s);
      std::vector<int32_t> want(p.log2phy_row(l) + size_t(e) * p.max_replicas,
                                p.log2phy_row(l) + size_t(e) * p.max_replicas + p.replica_count_row(l)[e]);
      std::vector<int32_t> got_sorted = got;
      std::sort(got_sorted.begin(), got_sorted.end());
      MOEKIT_CHECK(got_sorted == want, fmt::format("placement '{}': log2phy layer {} expert {} lists slots {}, phy2log "
                                                   "puts it in {}",
                                                   path, l, e, json(got).dump(), json(want).dump()));
      std::copy(got.begin(), got.end(), log2phy.begin() + (size_t(l) * num_experts + e) * p.max_replicas);
    }
  }
  p.log2phy = std::move(log2phy);
  return p;
}

}  // namespace moekit
