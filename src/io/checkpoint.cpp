// Checkpoints: a safetensors file, or a directory of them with or without Hugging Face's index
// (see include/moekit/safetensors.h). The files themselves are read by safetensors.cpp.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "io/file_io.h"
#include "io/json_read.h"
#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/safetensors.h"

namespace moekit {

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

  auto add_file = [&](const std::string& file_name) {
    const SafetensorsFile& f = impl.file(file_name);
    for (const auto& t : f.tensors()) {
      auto [it, inserted] = impl.weight_map.emplace(t.name, file_name);
      MOEKIT_CHECK(inserted, fmt::format("checkpoint '{}': tensor '{}' is in both '{}' and '{}'", path, t.name, it->second,
                                         file_name));
    }
  };

  if (!is_directory_or_regular_file(path, "checkpoint")) {
    impl.dir = fs::path(path).parent_path().string();
    add_file(fs::path(path).filename().string());
    return c;
  }
  impl.dir = path;
  const std::string index_path = (fs::path(path) / kIndexFileName).string();
  struct stat st {};
  if (::lstat(index_path.c_str(), &st) == 0 || errno != ENOENT) {  // there is something of that name: read it
    const nlohmann::json j =
        parse_json(read_regular_file(index_path, "checkpoint index"), fmt::format("checkpoint index '{}'", index_path),
                   JsonKeys::last_wins);  // as transformers' json.load reads it
    MOEKIT_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                 fmt::format("checkpoint index '{}': expected an object with \"weight_map\": {{tensor: file}}", index_path));
    for (const auto& [name, file] : j["weight_map"].items()) {
      MOEKIT_CHECK(file.is_string(), fmt::format("checkpoint index '{}': weight_map['{}'] = {} is not a file name",
                                                 index_path, quote_text(name, kMaxQuotedNameChars), quote(file)));
      const std::string file_name = file.get<std::string>();
      MOEKIT_CHECK(!file_name.empty() && fs::path(file_name).filename() == file_name,
                   fmt::format("checkpoint index '{}': weight_map['{}'] = '{}' must be a file name in the same directory",
                               index_path, quote_text(name, kMaxQuotedNameChars),
                               quote_text(file_name, kMaxQuotedNameChars)));
      impl.weight_map.emplace(name, file_name);
    }
    return c;
  }
  // No index: every *.safetensors entry (SafetensorsFile::open refuses one that is not a regular file).
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".safetensors") names.push_back(it->path().filename().string());
  MOEKIT_CHECK(!ec, fmt::format("checkpoint '{}': cannot list the directory: {}", path, ec.message()));
  MOEKIT_CHECK(!names.empty(), fmt::format("checkpoint '{}': directory holds neither {} nor *.safetensors files", path,
                                           kIndexFileName));
  std::sort(names.begin(), names.end());
  // moekit's generator writes the index last: its files without one are an interrupted write
  // (checked before the files' tensors, which may well clash between two runs' shards).
  for (const auto& n : names) {
    const auto& meta = impl.file(n).metadata();
    auto gen = meta.find("generator");
    MOEKIT_CHECK(gen == meta.end() || gen->second != kGeneratorName,
                 fmt::format("checkpoint '{}': '{}' was written by {} (seed {}), which writes {} last, and the "
                             "directory has no {}: it holds an interrupted write whose files may mix two runs. "
                             "Write the weights again, or delete the directory",
                             path, n, kGeneratorName, meta.count("seed") ? meta.at("seed") : "?", kIndexFileName,
                             kIndexFileName));
  }
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
