// The safetensors container format: one file read and written (see include/moekit/safetensors.h;
// checkpoints of several files and an index are in checkpoint.cpp).
#include "moekit/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "io/file_io.h"
#include "io/json_read.h"
#include "moekit/check.h"

namespace moekit {

namespace {

struct DtypeEntry {
  Dtype dtype;
  std::string_view name;
  size_t bits;
};

// The package's dtypes (safetensors 0.8) and their bits per element.
constexpr std::array<DtypeEntry, 22> kDtypes = {{
    {Dtype::kBool, "BOOL", 8},     {Dtype::kU8, "U8", 8},           {Dtype::kI8, "I8", 8},
    {Dtype::kF8E4M3, "F8_E4M3", 8}, {Dtype::kF8E5M2, "F8_E5M2", 8}, {Dtype::kF8E8M0, "F8_E8M0", 8},
    {Dtype::kF8E4M3FNUZ, "F8_E4M3FNUZ", 8}, {Dtype::kF8E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {Dtype::kI16, "I16", 16},      {Dtype::kU16, "U16", 16},        {Dtype::kF16, "F16", 16},
    {Dtype::kBF16, "BF16", 16},    {Dtype::kI32, "I32", 32},        {Dtype::kU32, "U32", 32},
    {Dtype::kF32, "F32", 32},      {Dtype::kI64, "I64", 64},        {Dtype::kU64, "U64", 64},
    {Dtype::kF64, "F64", 64},      {Dtype::kC64, "C64", 64},        {Dtype::kF4, "F4", 4},
    {Dtype::kF6E2M3, "F6_E2M3", 6}, {Dtype::kF6E3M2, "F6_E3M2", 6},
}};

const DtypeEntry& entry(Dtype dtype) {
  for (const auto& e : kDtypes)
    if (e.dtype == dtype) return e;
  throw Error(fmt::format("safetensors: invalid Dtype value {}", int(dtype)));
}

// A shape's element count as an int64 (the header's dimensions are at most 2^63 - 1).
int64_t checked_elements(std::span<const int64_t> shape, std::string_view origin) {
  int64_t n = 1;
  for (int64_t d : shape) {
    MOEKIT_CHECK(d >= 0, fmt::format("{}: shape {} has a negative dimension", origin, shape_string(shape)));
    MOEKIT_CHECK(d == 0 || n <= INT64_MAX / d, fmt::format("{}: shape {} is too large", origin, shape_string(shape)));
    n *= d;
  }
  return n;
}

// The bytes of a tensor of `dtype` and `shape`, computed as the reference implementation does:
// the element count folded left to right in 64 bits, times the bits per element, each step
// checked for overflow (so [2^62, 4, 0] is refused although its product is 0), and a whole
// number of bytes.
uint64_t checked_num_bytes(std::span<const int64_t> shape, Dtype dtype, std::string_view origin) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    MOEKIT_CHECK(d >= 0, fmt::format("{}: shape {} has a negative dimension", origin, shape_string(shape)));
    MOEKIT_CHECK(d == 0 || n <= UINT64_MAX / uint64_t(d),
                 fmt::format("{}: shape {} has more than 2^64 elements", origin, shape_string(shape)));
    n *= uint64_t(d);
  }
  const uint64_t bits = dtype_bits(dtype);
  MOEKIT_CHECK(n <= UINT64_MAX / bits, fmt::format("{}: dtype {} shape {} holds more than 2^64 bits", origin,
                                                   dtype_name(dtype), shape_string(shape)));
  MOEKIT_CHECK((n * bits) % 8 == 0, fmt::format("{}: dtype {} shape {} holds {} bits, not a whole number of bytes",
                                                origin, dtype_name(dtype), shape_string(shape), n * bits));
  return n * bits / 8;
}

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit

std::string header_json(std::span<const TensorDecl> tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t end = offset + t.num_bytes();
    j[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = j.dump();
  // Pad with spaces so that the data start 8-byte aligned after the 8-byte length.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// The header's top-level members in file order, each tensor entry kept even when a later one of
// the same name replaces it (the package checks every one), and the checks the DOM cannot make
// once built: nesting depth, a repeated "__metadata__" or entry field, metadata values.
struct HeaderMembers {
  bool is_object = false;
  std::string top_type;  // the JSON type of the whole header
  std::vector<std::pair<std::string, nlohmann::json>> members;
};

HeaderMembers parse_header_members(std::string_view text, const std::string& path) {
  using nlohmann::json;
  HeaderMembers h;
  std::string key;            // the current top-level key
  std::string meta_key;       // the current key inside __metadata__
  bool seen_metadata = false;
  bool metadata_is_object = false;
  std::vector<std::string> fields;  // dtype / shape / data_offsets seen in the current entry
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    if ((event == E::object_start || event == E::array_start) && depth >= kMaxJsonDepth)
      throw Error(fmt::format("safetensors file '{}': the header nests deeper than {} levels (the safetensors "
                              "package's limit)", path, kMaxJsonDepth));
    if (depth == 0 && h.top_type.empty())
      h.top_type = event == E::object_start ? "object" : event == E::array_start ? "array" : parsed.type_name();
    if (depth == 0 && event == E::object_start) h.is_object = true;
    if (!h.is_object) return true;
    const bool in_metadata = key == "__metadata__" && metadata_is_object;
    if (depth == 1 && event == E::object_start && key == "__metadata__") metadata_is_object = true;
    if (depth == 1 && event == E::key) {
      key = parsed.get<std::string>();
      fields.clear();
      MOEKIT_CHECK(key != "__metadata__" || !seen_metadata,
                   fmt::format("safetensors file '{}': \"__metadata__\" appears twice in the header", path));
      seen_metadata = seen_metadata || key == "__metadata__";
    } else if (depth == 2 && event == E::key && in_metadata) {
      meta_key = parsed.get<std::string>();
    } else if (depth == 2 && event == E::key) {
      const std::string field = parsed.get<std::string>();
      if (field == "dtype" || field == "shape" || field == "data_offsets") {
        MOEKIT_CHECK(std::find(fields.begin(), fields.end(), field) == fields.end(),
                     fmt::format("safetensors file '{}': tensor '{}': field \"{}\" appears twice", path, key, field));
        fields.push_back(field);
      }
    } else if (depth == 2 && in_metadata && (event == E::value || event == E::object_start || event == E::array_start)) {
      // Checked here, entry by entry: a repeated key keeps only its last value in the DOM.
      MOEKIT_CHECK(event == E::value && parsed.is_string(),
                   fmt::format("safetensors file '{}': __metadata__ entry '{}' = {} is not a string", path, meta_key,
                               event == E::value ? quote(parsed) : "an array or object"));
    } else if (depth == 1 && (event == E::value || event == E::object_end || event == E::array_end)) {
      h.members.emplace_back(key, std::move(parsed));
      return false;  // kept in `members`, not in the DOM
    }
    return true;
  };
  try {
    [[maybe_unused]] const json rest = json::parse(text.begin(), text.end(), callback);  // members kept by the callback
  } catch (const json::exception& e) {
    throw Error(fmt::format("safetensors file '{}': malformed JSON header: {}", path, e.what()));
  }
  return h;
}

// A dtype as the package's reader takes it: its name, or {name: null}.
Dtype parse_dtype_value(const nlohmann::json& v, const std::string& origin) {
  if (v.is_string()) return parse_dtype(v.get<std::string>(), origin);
  MOEKIT_CHECK(v.is_object() && v.size() == 1 && v.begin().value().is_null(),
               fmt::format("{}: dtype {} is not a string", origin, quote(v)));
  return parse_dtype(v.begin().key(), origin);
}

// One tensor entry: {"dtype", "shape", "data_offsets"} (other keys ignored) or the same three as
// an array. Only the types are checked here; sizes and offsets once repeated names are resolved.
TensorInfo parse_tensor_entry(const std::string& name, const nlohmann::json& v, const std::string& origin) {
  const bool as_array = v.is_array() && v.size() == 3;
  MOEKIT_CHECK(as_array || (v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets")),
               fmt::format("{}: expected an object with dtype, shape and data_offsets, got {}", origin, quote(v)));
  const auto& jd = as_array ? v[0] : v["dtype"];
  const auto& js = as_array ? v[1] : v["shape"];
  const auto& jo = as_array ? v[2] : v["data_offsets"];
  TensorInfo t;
  t.name = name;
  t.dtype = parse_dtype_value(jd, origin);
  MOEKIT_CHECK(js.is_array() && std::all_of(js.begin(), js.end(), [](const auto& d) { return d.is_number_unsigned(); }),
               fmt::format("{}: shape {} must be an array of non-negative integers", origin, quote(js)));
  MOEKIT_CHECK(jo.is_array() && jo.size() == 2 && jo[0].is_number_unsigned() && jo[1].is_number_unsigned(),
               fmt::format("{}: data_offsets {} must be [begin, end], non-negative integers", origin, quote(jo)));
  for (const auto& d : js) {
    MOEKIT_CHECK(d.get<uint64_t>() <= uint64_t(INT64_MAX),
                 fmt::format("{}: shape {}: dimension {} is above 2^63 - 1, which moekit does not hold", origin,
                             quote(js), d.get<uint64_t>()));
    t.shape.push_back(d.get<int64_t>());
  }
  t.begin = jo[0].get<uint64_t>();
  t.end = jo[1].get<uint64_t>();
  return t;
}

}  // namespace

std::string_view dtype_name(Dtype dtype) { return entry(dtype).name; }
size_t dtype_bits(Dtype dtype) { return entry(dtype).bits; }
size_t dtype_size(Dtype dtype) {
  const size_t bits = dtype_bits(dtype);
  MOEKIT_CHECK(bits % 8 == 0, fmt::format("dtype {} packs {} bits per element: it has no size in whole bytes",
                                          dtype_name(dtype), bits));
  return bits / 8;
}

Dtype parse_dtype(std::string_view name, std::string_view origin) {
  for (const auto& e : kDtypes)
    if (e.name == name) return e.dtype;
  std::string known;
  for (const auto& e : kDtypes) known += fmt::format("{}{}", known.empty() ? "" : ", ", e.name);
  const std::string shown = name.size() <= 40 ? std::string(name) : std::string(name.substr(0, 40)) + "...";
  throw Error(fmt::format("{}: unknown dtype \"{}\" (expected one of {})", origin, shown, known));
}

std::string shape_string(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t TensorInfo::num_elements() const { return checked_elements(shape, name); }

uint64_t TensorDecl::num_bytes() const { return checked_num_bytes(shape, dtype, name); }

// ---------------------------------------------------------------------------------------------
// Reading

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  uint64_t file_size = 0;
  {
    const ReadFd fd = open_regular_file(path, "safetensors file");
    file_size = fd.size();
    MOEKIT_CHECK(file_size >= 8,
                 fmt::format("safetensors file '{}': file too short ({} bytes): expected at least the 8-byte header length",
                             path, file_size));
    void* m = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.get(), 0);  // the mapping outlives the descriptor
    MOEKIT_CHECK(m != MAP_FAILED, fmt::format("safetensors file '{}': mmap failed: {}", path, std::strerror(errno)));
    f.map_ = static_cast<const uint8_t*>(m);
    f.map_size_ = file_size;
  }

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | f.map_[i];  // little-endian
  MOEKIT_CHECK(header_len <= kMaxHeaderBytes,
               fmt::format("safetensors file '{}': header length {} exceeds the limit of {} bytes", path, header_len,
                           kMaxHeaderBytes));
  MOEKIT_CHECK(header_len <= file_size - 8,
               fmt::format("safetensors file '{}': header length {} runs past the end of the file ({} bytes): "
                           "not a safetensors file, or truncated",
                           path, header_len, file_size));
  std::string_view text(reinterpret_cast<const char*>(f.map_ + 8), header_len);
  f.data_ = f.map_ + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  // JSON text only: nlohmann's reader would stop at a NUL byte and skip a byte order mark,
  // where the package's refuses both.
  const size_t nul = text.find('\0');
  MOEKIT_CHECK(nul == std::string_view::npos,
               fmt::format("safetensors file '{}': header byte {} is NUL (0x00): the header must be JSON text", path, nul));
  MOEKIT_CHECK(!text.starts_with("\xEF\xBB\xBF"),
               fmt::format("safetensors file '{}': the header starts with a UTF-8 byte order mark, which the format "
                           "does not allow", path));
  // The shared JSON reader first: it bounds the nesting while parsing and names the path of a
  // value too deep, and its tree quotes a bad metadata value by a short prefix. The member walk
  // below then sees what a finished tree cannot (repeated keys, every entry of a repeated name).
  {
    const nlohmann::json tree =
        parse_json(text, fmt::format("safetensors file '{}': header", path), JsonKeys::last_wins);
    if (tree.is_object() && tree.contains("__metadata__") && tree["__metadata__"].is_object())
      for (const auto& [k, v] : tree["__metadata__"].items())
        MOEKIT_CHECK(v.is_string(), fmt::format("safetensors file '{}': __metadata__ entry '{}' = {} is not a string",
                                                path, quote_text(k, kMaxQuotedNameChars), quote(v)));
  }
  const HeaderMembers header = parse_header_members(text, path);
  MOEKIT_CHECK(header.is_object,
               fmt::format("safetensors file '{}': header must be a JSON object, got {}", path, header.top_type));

  std::map<std::string, TensorInfo> by_name;  // a repeated name: the last entry counts
  for (const auto& [name, v] : header.members) {
    if (name == "__metadata__") {
      MOEKIT_CHECK(v.is_null() || v.is_object(),
                   fmt::format("safetensors file '{}': __metadata__ must be an object of strings, got {}", path,
                               v.type_name()));
      if (v.is_object())
        for (const auto& [key, value] : v.items()) f.metadata_[key] = value.get<std::string>();  // checked while parsing
      continue;
    }
    by_name.insert_or_assign(name, parse_tensor_entry(name, v, fmt::format("safetensors file '{}': tensor '{}'", path,
                                                                          quote_text(name, kMaxQuotedNameChars))));
  }
  for (auto& [name, t] : by_name) {
    const std::string origin =
        fmt::format("safetensors file '{}': tensor '{}'", path, quote_text(name, kMaxQuotedNameChars));
    MOEKIT_CHECK(t.begin <= t.end, fmt::format("{}: data_offsets [{}, {}] end before they begin", origin, t.begin, t.end));
    const uint64_t expected = checked_num_bytes(t.shape, t.dtype, origin);
    MOEKIT_CHECK(t.end - t.begin == expected,
                 fmt::format("{}: data_offsets [{}, {}] hold {} bytes, but dtype {} shape {} needs {}", origin, t.begin,
                             t.end, t.end - t.begin, dtype_name(t.dtype), shape_string(t.shape), expected));
    MOEKIT_CHECK(t.end <= data_size,
                 fmt::format("{}: data_offsets [{}, {}] run past the end of the data ({} bytes): the file is truncated",
                             origin, t.begin, t.end, data_size));
    f.tensors_.push_back(std::move(t));
  }

  // The tensors must tile the data exactly, as the reference implementation requires.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : f.tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  uint64_t covered = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo* t : by_offset) {
    MOEKIT_CHECK(t->begin >= covered,
                 fmt::format("safetensors file '{}': tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path,
                             t->name, t->begin, t->end, prev ? prev->name : "", prev ? prev->begin : 0, covered));
    MOEKIT_CHECK(t->begin == covered,
                 fmt::format("safetensors file '{}': tensor '{}' begins at data offset {}, leaving a gap after byte {}",
                             path, t->name, t->begin, covered));
    covered = t->end;
    prev = t;
  }
  MOEKIT_CHECK(covered == data_size,
               fmt::format("safetensors file '{}': the tensors cover {} bytes of data but the file holds {} after the header",
                           path, covered, data_size));
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    data_ = std::exchange(o.data_, nullptr);
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

bool SafetensorsFile::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

const TensorInfo& SafetensorsFile::info(std::string_view name) const {
  auto it = index_.find(name);
  MOEKIT_CHECK(it != index_.end(), fmt::format("tensor '{}' not found in safetensors file '{}'", name, path_));
  return tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::bytes(std::string_view name) const {
  const TensorInfo& t = info(name);
  return {data_ + t.begin, size_t(t.num_bytes())};
}

std::span<const uint8_t> SafetensorsFile::bytes(std::string_view name, Dtype dtype, std::span<const int64_t> shape) const {
  const TensorInfo& t = info(name);
  MOEKIT_CHECK(t.dtype == dtype && std::equal(t.shape.begin(), t.shape.end(), shape.begin(), shape.end()),
               fmt::format("tensor '{}' in '{}': expected dtype {} shape {}, got {} {}", name, path_, dtype_name(dtype),
                           shape_string(shape), dtype_name(t.dtype), shape_string(t.shape)));
  return bytes(name);
}

// ---------------------------------------------------------------------------------------------
// Writing

uint64_t safetensors_header_bytes(std::span<const TensorDecl> tensors, const std::map<std::string, std::string>& metadata) {
  return 8 + header_json(tensors, metadata).size();
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorDecl> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  std::map<std::string_view, int> seen;
  for (const auto& t : tensors_) {
    MOEKIT_CHECK(!t.name.empty() && t.name != "__metadata__",
                 fmt::format("safetensors writer '{}': invalid tensor name '{}'", path_, t.name));
    MOEKIT_CHECK(seen[t.name]++ == 0, fmt::format("safetensors writer '{}': tensor '{}' declared twice", path_, t.name));
    t.num_bytes();  // checks the shape
  }
  const std::string header = header_json(tensors_, metadata);
  out_ = std::make_unique<OutputFile>(path_, "safetensors file");
  std::array<char, 8> len{};
  for (int i = 0; i < 8; ++i) len[i] = char(uint8_t(uint64_t(header.size()) >> (8 * i)));
  out_->write(std::string_view(len.data(), len.size()));
  out_->write(header);
}

SafetensorsWriter::~SafetensorsWriter() = default;  // an unfinished OutputFile removes its .tmp

const TensorDecl& SafetensorsWriter::next() const {
  MOEKIT_CHECK(written_ < tensors_.size(),
               fmt::format("safetensors writer '{}': all {} declared tensors are already written", path_, tensors_.size()));
  return tensors_[written_];
}

void SafetensorsWriter::write(std::span<const uint8_t> data) {
  const TensorDecl& t = next();
  MOEKIT_CHECK(out_, fmt::format("safetensors writer '{}': already finished", path_));
  MOEKIT_CHECK(data.size() == t.num_bytes(),
               fmt::format("safetensors writer '{}': tensor '{}' dtype {} shape {} needs {} bytes, got {}", path_, t.name,
                           dtype_name(t.dtype), shape_string(t.shape), t.num_bytes(), data.size()));
  out_->write(data);
  ++written_;
}

void SafetensorsWriter::finish() {
  MOEKIT_CHECK(written_ == tensors_.size(),
               fmt::format("safetensors writer '{}': {} of {} declared tensors written; next is '{}'", path_, written_,
                           tensors_.size(), written_ < tensors_.size() ? tensors_[written_].name : ""));
  MOEKIT_CHECK(out_, fmt::format("safetensors writer '{}': already finished", path_));
  out_->commit();
  out_.reset();
}

void write_safetensors(const std::string& path, std::span<const TensorData> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorDecl> decls;
  for (const auto& t : tensors) decls.push_back(t.decl);
  SafetensorsWriter w(path, std::move(decls), metadata);
  for (const auto& t : tensors) w.write(t.data);
  w.finish();
}

}  // namespace moekit
