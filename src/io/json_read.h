// Reading JSON that came from outside (a spec, a trace, a load file, a placement, a
// safetensors header, an index.json). Not a public header.
//
// - parse_json() refuses nesting deeper than kMaxJsonDepth while it parses (the DOM is never
//   deeper, so nothing downstream recurses without bound), and its errors name the origin and
//   the path of the value where parsing stopped ("router.num_groups", "layers[0][3]").
// - quote() and quote_text() cut a value to about kMaxQuotedChars for an error message, without
//   recursing into what they do not print.
// - JsonFields and json_integer()/json_number() read typed values with their range; an integer
//   is any integer-valued number (8, 8.0, 1e3), checked against the bounds of the type it ends in.
// Every error is a moekit::Error whose text names the origin (file) and the field.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>

#include "moekit/check.h"
#include "moekit/limits.h"

namespace moekit {

// Whether an object may repeat a key. moekit's own formats (spec, trace, load file, placement)
// refuse a repeat: nlohmann keeps the last one, so a file with two "layers" would be read as one
// of them without a word. A safetensors header and an index.json keep the last one, as the
// `safetensors` package and Python's json module do (docs/weights.md).
enum class JsonKeys { unique, last_wins };

// `text` parsed; `origin` (e.g. "trace 'steps.json'") starts every error message.
nlohmann::json parse_json(std::string_view text, std::string_view origin, JsonKeys keys = JsonKeys::unique);

// `v` as compact JSON (ASCII, control characters escaped), cut to kMaxQuotedChars plus "...".
std::string quote(const nlohmann::json& v);
// `s` cut to max_chars bytes (at a UTF-8 boundary) plus "...", control characters as '?'.
std::string quote_text(std::string_view s, size_t max_chars = kMaxQuotedChars);

// Why `v` is not an integer in [lo, hi] ("" when it is one, then stored in `out`).
std::string integer_problem(const nlohmann::json& v, int64_t lo, int64_t hi, int64_t& out);
// Why `v` is not a finite number in [lo, hi] ("" when it is one, then stored in `out`).
std::string number_problem(const nlohmann::json& v, double lo, double hi, double& out);

// The integer `v`, in [lo, hi] of type T; `name()` (called on failure only) names the value,
// e.g. "trace 'f.json': layer 0 step 3 token 2: expert id".
template <class T, class Name>
T json_integer(const nlohmann::json& v, T lo, T hi, Name&& name) {
  int64_t x = 0;
  const std::string why = integer_problem(v, int64_t(lo), int64_t(hi), x);
  if (!why.empty()) throw Error(fmt::format("{} = {} {}", name(), quote(v), why));
  return T(x);
}

template <class Name>
double json_number(const nlohmann::json& v, double lo, double hi, Name&& name) {
  double x = 0;
  const std::string why = number_problem(v, lo, hi, x);
  if (!why.empty()) throw Error(fmt::format("{} = {} {}", name(), quote(v), why));
  return x;
}

// The fields of one JSON object. Remembers the keys read, so that unknown keys (usually
// typos) can be refused at the end. Errors read "ORIGIN: field 'KEY' = VALUE must be ...".
class JsonFields {
 public:
  JsonFields(const nlohmann::json& obj, std::string origin);

  bool has(const std::string& key) const { return obj_.contains(key); }
  const nlohmann::json& at(const std::string& key);  // missing: an Error
  std::string str(const std::string& key);
  bool boolean(const std::string& key);
  // A finite number in [lo, hi]; with lo > 0, a value <= 0 is reported as "must be > 0".
  double number(const std::string& key, double lo, double hi);
  template <class T>
  T integer(const std::string& key, T lo, T hi) {
    return json_integer<T>(at(key), lo, hi, [&] { return field_name(key); });
  }
  // An array of at most max_size elements.
  const nlohmann::json& array(const std::string& key, size_t max_size);
  const nlohmann::json& object(const std::string& key);
  // Keys never read, other than the free-text "notes" and "source", are an Error.
  void reject_unknown() const;

  const std::string& origin() const { return origin_; }
  std::string field_name(const std::string& key) const;  // "ORIGIN: field 'KEY'"

 private:
  const nlohmann::json& obj_;
  std::string origin_;
  std::set<std::string> seen_;
};

}  // namespace moekit
