// Bounded JSON parsing, short quotes and typed fields (see json_read.h).
#include "io/json_read.h"

#include <cmath>
#include <vector>

namespace moekit {

using nlohmann::json;

namespace {

// Builds the DOM from nlohmann's SAX events, as json::parse would, but refuses an array or
// object that would open level kMaxJsonDepth + 1 and keeps the path of the value being read,
// so that every error can say where it happened.
class BoundedBuilder {
 public:
  BoundedBuilder(json& root, std::string_view origin, JsonKeys keys) : root_(root), origin_(origin), keys_(keys) {}

  bool null() { return value(nullptr); }
  bool boolean(bool v) { return value(v); }
  bool number_integer(json::number_integer_t v) { return value(v); }
  bool number_unsigned(json::number_unsigned_t v) { return value(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return value(v); }
  bool string(json::string_t& v) { return value(v); }
  bool binary(json::binary_t& v) { return value(v); }
  bool start_object(std::size_t) { return open(json::value_t::object); }
  bool start_array(std::size_t) { return open(json::value_t::array); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& object = *stack_.back();
    if (keys_ == JsonKeys::unique && object.contains(k))
      throw Error(fmt::format("{}: key '{}' appears twice in the object{}, expected each key once (a repeat would "
                              "silently replace the first)",
                              origin_, quote_text(k, kMaxQuotedNameChars), where_or_top()));
    object_element_ = &object[k];
    frames_.back().key = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const json::exception& e) {
    // nlohmann's message ends with the last token read, which may be long: cut it.
    throw Error(fmt::format("{}: malformed JSON{}: {}", origin_, where(), quote_text(e.what(), 4 * kMaxQuotedChars)));
  }

 private:
  struct Frame {
    bool array;
    size_t index;     // arrays: the element being read
    std::string key;  // objects: the key whose value is being read ("" between values)
  };

  template <class V>
  json* put(V&& v) {
    if (stack_.empty()) {
      root_ = json(std::forward<V>(v));
      return &root_;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.emplace_back(std::forward<V>(v));
      return &parent.back();
    }
    *object_element_ = json(std::forward<V>(v));
    return object_element_;
  }
  template <class V>
  bool value(V&& v) {
    put(std::forward<V>(v));
    next();
    return true;
  }
  bool open(json::value_t type) {
    if (int(stack_.size()) >= kMaxJsonDepth)
      throw Error(fmt::format("{}: JSON nested deeper than {} levels{}", origin_, kMaxJsonDepth, where()));
    stack_.push_back(put(type));
    frames_.push_back({type == json::value_t::array, 0, {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    frames_.pop_back();
    next();
    return true;
  }
  // A value is complete: an array moves to its next element, an object waits for its next key.
  void next() {
    if (frames_.empty()) return;
    Frame& f = frames_.back();
    if (f.array)
      ++f.index;
    else
      f.key.clear();
  }
  std::string where() const {
    std::string path;
    for (const Frame& f : frames_) {
      if (f.array) {
        path += fmt::format("[{}]", f.index);
      } else if (!f.key.empty()) {
        if (!path.empty()) path += '.';
        path += f.key;
      }
    }
    return path.empty() ? std::string() : " at " + quote_text(path);
  }
  std::string where_or_top() const {
    const std::string w = where();
    return w.empty() ? std::string(" at the top level") : w;
  }

  json& root_;
  std::string_view origin_;
  JsonKeys keys_;
  std::vector<json*> stack_;  // the open arrays and objects
  std::vector<Frame> frames_;
  json* object_element_ = nullptr;
};

// Appends `v` to `out` until `out` holds more than `limit` characters. Each array or object
// level appends a bracket before it recurses, so the recursion is at most `limit` deep.
void append_quoted(const json& v, std::string& out, size_t limit) {
  auto dump = [](const json& x) { return x.dump(-1, ' ', true, json::error_handler_t::replace); };
  if (out.size() > limit) return;
  switch (v.type()) {
    case json::value_t::array:
    case json::value_t::object: {
      const bool array = v.is_array();
      out += array ? '[' : '{';
      bool first = true;
      for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
        if (!first) out += ',';
        first = false;
        if (!array) out += dump(json(it.key().substr(0, limit))) + ':';
        append_quoted(it.value(), out, limit);
      }
      out += array ? ']' : '}';
      break;
    }
    case json::value_t::string:
      out += dump(json(v.get_ref<const std::string&>().substr(0, limit + 1)));
      break;
    default:
      out += dump(v);
  }
}

}  // namespace

json parse_json(std::string_view text, std::string_view origin, JsonKeys keys) {
  json root;
  BoundedBuilder builder(root, origin, keys);
  json::sax_parse(text, &builder);
  return root;
}

std::string quote(const json& v) {
  std::string out;
  append_quoted(v, out, kMaxQuotedChars);
  if (out.size() > kMaxQuotedChars) out.resize(kMaxQuotedChars), out += "...";
  return out;
}

std::string quote_text(std::string_view s, size_t max_chars) {
  const bool cut = s.size() > max_chars;
  if (cut) {
    size_t n = max_chars;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // not inside a UTF-8 sequence
    s = s.substr(0, n);
  }
  std::string out(s);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return cut ? out + "..." : out;
}

std::string integer_problem(const json& v, int64_t lo, int64_t hi, int64_t& out) {
  const std::string not_integer = fmt::format("must be an integer in [{}, {}]", lo, hi);
  const std::string below = fmt::format("must be >= {}", lo), above = fmt::format("must be <= {}", hi);
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (hi < 0 || u > uint64_t(hi)) return above;
    out = int64_t(u);
  } else if (v.is_number_integer()) {
    out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::trunc(d) != d) return not_integer;
    if (d >= 0x1p63) return above;
    if (d < -0x1p63) return below;
    out = int64_t(d);
  } else {
    return not_integer;
  }
  if (out < lo) return below;
  if (out > hi) return above;
  return "";
}

std::string number_problem(const json& v, double lo, double hi, double& out) {
  if (!v.is_number()) return "must be a number";
  out = v.get<double>();
  if (!std::isfinite(out)) return fmt::format("must be a finite number in [{:g}, {:g}]", lo, hi);
  if (out < lo) return lo > 0 && out <= 0 ? std::string("must be > 0") : fmt::format("must be >= {:g}", lo);
  if (out > hi) return fmt::format("must be <= {:g}", hi);
  return "";
}

JsonFields::JsonFields(const json& obj, std::string origin) : obj_(obj), origin_(std::move(origin)) {
  MOEKIT_CHECK(obj_.is_object(), fmt::format("{}: expected a JSON object, got {}", origin_, quote(obj_)));
}

std::string JsonFields::field_name(const std::string& key) const { return fmt::format("{}: field '{}'", origin_, key); }

const json& JsonFields::at(const std::string& key) {
  seen_.insert(key);
  MOEKIT_CHECK(obj_.contains(key), fmt::format("{}: missing field '{}'", origin_, key));
  return obj_.at(key);
}

std::string JsonFields::str(const std::string& key) {
  const json& v = at(key);
  MOEKIT_CHECK(v.is_string(), fmt::format("{} = {} must be a string", field_name(key), quote(v)));
  return v.get<std::string>();
}

bool JsonFields::boolean(const std::string& key) {
  const json& v = at(key);
  MOEKIT_CHECK(v.is_boolean(), fmt::format("{} = {} must be true or false", field_name(key), quote(v)));
  return v.get<bool>();
}

double JsonFields::number(const std::string& key, double lo, double hi) {
  return json_number(at(key), lo, hi, [&] { return field_name(key); });
}

const json& JsonFields::array(const std::string& key, size_t max_size) {
  const json& v = at(key);
  MOEKIT_CHECK(v.is_array(), fmt::format("{} = {} must be an array", field_name(key), quote(v)));
  MOEKIT_CHECK(v.size() <= max_size,
               fmt::format("{} holds {} elements, more than the limit of {}", field_name(key), v.size(), max_size));
  return v;
}

const json& JsonFields::object(const std::string& key) {
  const json& v = at(key);
  MOEKIT_CHECK(v.is_object(), fmt::format("{} = {} must be an object", field_name(key), quote(v)));
  return v;
}

void JsonFields::reject_unknown() const {
  for (const auto& [key, value] : obj_.items()) {
    if (key == "notes" || key == "source") continue;
    MOEKIT_CHECK(seen_.count(key), fmt::format("{}: unknown field '{}' (a typo?)", origin_, quote_text(key, kMaxQuotedNameChars)));
  }
}

}  // namespace moekit
