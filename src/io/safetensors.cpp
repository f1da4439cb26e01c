// The safetensors container format (see include/moekit/safetensors.h).
#include "moekit/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "io/json_read.h"
#include "moekit/check.h"

namespace moekit {

namespace {

struct DtypeEntry {
  Dtype dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DtypeEntry, 15> kDtypes = {{
    {Dtype::kBool, "BOOL", 1},   {Dtype::kU8, "U8", 1},      {Dtype::kI8, "I8", 1},
    {Dtype::kF8E4M3, "F8_E4M3", 1}, {Dtype::kF8E5M2, "F8_E5M2", 1}, {Dtype::kI16, "I16", 2},
    {Dtype::kU16, "U16", 2},     {Dtype::kF16, "F16", 2},    {Dtype::kBF16, "BF16", 2},
    {Dtype::kI32, "I32", 4},     {Dtype::kU32, "U32", 4},    {Dtype::kF32, "F32", 4},
    {Dtype::kI64, "I64", 8},     {Dtype::kU64, "U64", 8},    {Dtype::kF64, "F64", 8},
}};

const DtypeEntry& entry(Dtype dtype) {
  for (const auto& e : kDtypes)
    if (e.dtype == dtype) return e;
  throw Error(fmt::format("safetensors: invalid Dtype value {}", int(dtype)));
}

// The header's size fields are at most 2^64; a shape's element count must not overflow either.
int64_t checked_elements(std::span<const int64_t> shape, std::string_view origin) {
  int64_t n = 1;
  for (int64_t d : shape) {
    MOEKIT_CHECK(d >= 0, fmt::format("{}: shape {} has a negative dimension", origin, shape_string(shape)));
    MOEKIT_CHECK(d == 0 || n <= INT64_MAX / d, fmt::format("{}: shape {} is too large", origin, shape_string(shape)));
    n *= d;
  }
  return n;
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

}  // namespace

std::string_view dtype_name(Dtype dtype) { return entry(dtype).name; }
size_t dtype_size(Dtype dtype) { return entry(dtype).size; }

Dtype parse_dtype(std::string_view name, std::string_view origin) {
  for (const auto& e : kDtypes)
    if (e.name == name) return e.dtype;
  std::string known;
  for (const auto& e : kDtypes) known += fmt::format("{}{}", known.empty() ? "" : ", ", e.name);
  throw Error(fmt::format("{}: unknown dtype \"{}\" (expected one of {})", origin, name, known));
}

std::string shape_string(std::span<const int64_t> shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int64_t TensorInfo::num_elements() const { return checked_elements(shape, name); }

uint64_t TensorDecl::num_bytes() const { return uint64_t(checked_elements(shape, name)) * dtype_size(dtype); }

// ---------------------------------------------------------------------------------------------
// Reading

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOEKIT_CHECK(fd >= 0, fmt::format("safetensors file '{}': cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("safetensors file '{}': not a regular file", path));
  }
  const uint64_t file_size = uint64_t(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    throw Error(fmt::format("safetensors file '{}': file too short ({} bytes): expected at least the 8-byte header length",
                            path, file_size));
  }
  void* m = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file
  MOEKIT_CHECK(m != MAP_FAILED, fmt::format("safetensors file '{}': mmap failed: {}", path, std::strerror(errno)));
  f.map_ = static_cast<const uint8_t*>(m);
  f.map_size_ = file_size;

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | f.map_[i];  // little-endian
  MOEKIT_CHECK(header_len <= file_size - 8,
               fmt::format("safetensors file '{}': header length {} runs past the end of the file ({} bytes): "
                           "not a safetensors file, or truncated",
                           path, header_len, file_size));
  MOEKIT_CHECK(header_len <= kMaxHeaderBytes,
               fmt::format("safetensors file '{}': header length {} exceeds the limit of {} bytes", path, header_len,
                           kMaxHeaderBytes));
  std::string_view text(reinterpret_cast<const char*>(f.map_ + 8), header_len);
  f.data_ = f.map_ + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  // Nesting is bounded while parsing (kMaxJsonDepth, the package's own limit).
  const nlohmann::json j = parse_json(text, fmt::format("safetensors file '{}': header", path));
  MOEKIT_CHECK(j.is_object(), fmt::format("safetensors file '{}': header must be a JSON object, got {}", path, j.type_name()));

  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      MOEKIT_CHECK(v.is_object(), fmt::format("safetensors file '{}': __metadata__ must be an object of strings", path));
      for (const auto& [key, value] : v.items()) {
        MOEKIT_CHECK(value.is_string(), fmt::format("safetensors file '{}': __metadata__ entry '{}' = {} is not a string",
                                                    path, quote_text(key, kMaxQuotedNameChars), quote(value)));
        f.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string origin =
        fmt::format("safetensors file '{}': tensor '{}'", path, quote_text(name, kMaxQuotedNameChars));
    MOEKIT_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
                 fmt::format("{}: expected an object with dtype, shape and data_offsets, got {}", origin, quote(v)));
    const auto& jd = v["dtype"];
    const auto& js = v["shape"];
    const auto& jo = v["data_offsets"];
    MOEKIT_CHECK(jd.is_string(), fmt::format("{}: dtype {} is not a string", origin, quote(jd)));
    MOEKIT_CHECK(js.is_array() && std::all_of(js.begin(), js.end(), [](const auto& d) { return d.is_number_unsigned(); }),
                 fmt::format("{}: shape {} must be an array of non-negative integers", origin, quote(js)));
    MOEKIT_CHECK(jo.is_array() && jo.size() == 2 && jo[0].is_number_unsigned() && jo[1].is_number_unsigned(),
                 fmt::format("{}: data_offsets {} must be [begin, end], non-negative integers", origin, quote(jo)));
    TensorInfo t;
    t.name = name;
    t.dtype = parse_dtype(jd.get<std::string>(), origin);
    for (const auto& d : js) {
      MOEKIT_CHECK(d.get<uint64_t>() <= uint64_t(INT64_MAX), fmt::format("{}: shape {} is too large", origin, quote(js)));
      t.shape.push_back(d.get<int64_t>());
    }
    t.begin = jo[0].get<uint64_t>();
    t.end = jo[1].get<uint64_t>();
    MOEKIT_CHECK(t.begin <= t.end, fmt::format("{}: data_offsets [{}, {}] end before they begin", origin, t.begin, t.end));
    const uint64_t expected = uint64_t(checked_elements(t.shape, origin)) * dtype_size(t.dtype);
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
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), tensors_(std::move(tensors)) {
  std::map<std::string_view, int> seen;
  for (const auto& t : tensors_) {
    MOEKIT_CHECK(!t.name.empty() && t.name != "__metadata__",
                 fmt::format("safetensors writer '{}': invalid tensor name '{}'", path_, t.name));
    MOEKIT_CHECK(seen[t.name]++ == 0, fmt::format("safetensors writer '{}': tensor '{}' declared twice", path_, t.name));
    t.num_bytes();  // checks the shape
  }
  const std::string header = header_json(tensors_, metadata);
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  MOEKIT_CHECK(file_, fmt::format("safetensors writer: cannot create '{}': {}", tmp_path_, std::strerror(errno)));
  std::array<uint8_t, 8> len{};
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  if (std::fwrite(len.data(), 1, 8, file_) != 8 || std::fwrite(header.data(), 1, header.size(), file_) != header.size())
    throw Error(fmt::format("safetensors writer '{}': write failed: {}", tmp_path_, std::strerror(errno)));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

const TensorDecl& SafetensorsWriter::next() const {
  MOEKIT_CHECK(written_ < tensors_.size(),
               fmt::format("safetensors writer '{}': all {} declared tensors are already written", path_, tensors_.size()));
  return tensors_[written_];
}

void SafetensorsWriter::write(std::span<const uint8_t> data) {
  const TensorDecl& t = next();
  MOEKIT_CHECK(file_, fmt::format("safetensors writer '{}': already finished", path_));
  MOEKIT_CHECK(data.size() == t.num_bytes(),
               fmt::format("safetensors writer '{}': tensor '{}' dtype {} shape {} needs {} bytes, got {}", path_, t.name,
                           dtype_name(t.dtype), shape_string(t.shape), t.num_bytes(), data.size()));
  MOEKIT_CHECK(data.empty() || std::fwrite(data.data(), 1, data.size(), file_) == data.size(),
               fmt::format("safetensors writer '{}': write of tensor '{}' failed: {}", tmp_path_, t.name, std::strerror(errno)));
  ++written_;
}

void SafetensorsWriter::finish() {
  MOEKIT_CHECK(written_ == tensors_.size(),
               fmt::format("safetensors writer '{}': {} of {} declared tensors written; next is '{}'", path_, written_,
                           tensors_.size(), written_ < tensors_.size() ? tensors_[written_].name : ""));
  MOEKIT_CHECK(file_, fmt::format("safetensors writer '{}': already finished", path_));
  const bool ok = std::fflush(file_) == 0;
  std::fclose(file_);
  file_ = nullptr;
  if (!ok) std::remove(tmp_path_.c_str());
  MOEKIT_CHECK(ok, fmt::format("safetensors writer '{}': flush failed: {}", tmp_path_, std::strerror(errno)));
  std::error_code ec;
  std::filesystem::rename(tmp_path_, path_, ec);
  MOEKIT_CHECK(!ec, fmt::format("safetensors writer: cannot rename '{}' to '{}': {}", tmp_path_, path_, ec.message()));
}

void write_safetensors(const std::string& path, std::span<const TensorData> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorDecl> decls;
  for (const auto& t : tensors) decls.push_back(t.decl);
  SafetensorsWriter w(path, std::move(decls), metadata);
  for (const auto& t : tensors) w.write(t.data);
  w.finish();
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

struct Checkpoint::Impl {
  std::string dir;                                          // where the index's file names live
  std::map<std::string, std::string, std::less<>> weight_map;  // tensor -> file name (relative to dir)
  mutable std::mutex mutex;                                  // guards files (opened lazily)
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> files;

  const SafetensorsFile& file(const std::string& file_name) const {
    std::lock_guard lock(mutex);
    auto& slot = files[file_name];
    if (!slot) slot = std::make_unique<SafetensorsFile>(SafetensorsFile::open((std::filesystem::path(dir) / file_name).string()));
    return *slot;
  }
};

Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

Checkpoint Checkpoint::open(const std::string& path) {
  namespace fs = std::filesystem;
  Checkpoint c;
  c.path_ = path;
  c.impl_ = std::make_unique<Impl>();
  Impl& impl = *c.impl_;
  std::error_code ec;
  MOEKIT_CHECK(fs::exists(path, ec), fmt::format("checkpoint '{}': no such file or directory", path));

  auto add_file = [&](const std::string& file_name) {
    const SafetensorsFile& f = impl.file(file_name);
    for (const auto& t : f.tensors()) {
      auto [it, inserted] = impl.weight_map.emplace(t.name, file_name);
      MOEKIT_CHECK(inserted, fmt::format("checkpoint '{}': tensor '{}' is in both '{}' and '{}'", path, t.name, it->second,
                                         file_name));
    }
  };

  if (!fs::is_directory(path)) {
    impl.dir = fs::path(path).parent_path().string();
    add_file(fs::path(path).filename().string());
    return c;
  }
  impl.dir = path;
  const fs::path index_path = fs::path(path) / kIndexFileName;
  if (fs::exists(index_path)) {
    std::ifstream in(index_path, std::ios::binary);
    MOEKIT_CHECK(in.good(), fmt::format("checkpoint index '{}': cannot open", index_path.string()));
    std::ostringstream text;
    text << in.rdbuf();
    const nlohmann::json j = parse_json(text.str(), fmt::format("checkpoint index '{}'", index_path.string()));
    MOEKIT_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                 fmt::format("checkpoint index '{}': expected an object with \"weight_map\": {{tensor: file}}",
                             index_path.string()));
    for (const auto& [name, file] : j["weight_map"].items()) {
      MOEKIT_CHECK(file.is_string(), fmt::format("checkpoint index '{}': weight_map['{}'] = {} is not a file name",
                                                 index_path.string(), quote_text(name, kMaxQuotedNameChars), quote(file)));
      const std::string file_name = file.get<std::string>();
      MOEKIT_CHECK(!file_name.empty() && fs::path(file_name).filename() == file_name,
                   fmt::format("checkpoint index '{}': weight_map['{}'] = '{}' must be a file name in the same directory",
                               index_path.string(), quote_text(name, kMaxQuotedNameChars),
                               quote_text(file_name, kMaxQuotedNameChars)));
      impl.weight_map.emplace(name, file_name);
    }
    return c;
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
  MOEKIT_CHECK(!names.empty(), fmt::format("checkpoint '{}': directory holds neither {} nor *.safetensors files", path,
                                           kIndexFileName));
  std::sort(names.begin(), names.end());
  for (const auto& n : names) add_file(n);
  return c;
}

bool Checkpoint::contains(std::string_view name) const { return impl_->weight_map.find(name) != impl_->weight_map.end(); }

const SafetensorsFile& Checkpoint::file_of(std::string_view name) const {
  auto it = impl_->weight_map.find(name);
  MOEKIT_CHECK(it != impl_->weight_map.end(), fmt::format("tensor '{}' not found in checkpoint '{}'", name, path_));
  const SafetensorsFile& f = impl_->file(it->second);
  MOEKIT_CHECK(f.contains(name), fmt::format("checkpoint '{}': the index places tensor '{}' in '{}', which does not hold it",
                                             path_, name, f.path()));
  return f;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : impl_->weight_map) out.push_back(name);
  return out;
}

}  // namespace moekit
