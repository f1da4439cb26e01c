// moekit/safetensors.h: the safetensors container format, and checkpoints made of such files.
//
// A safetensors file is
//   [8 bytes: N, the header length, little-endian u64]
//   [N bytes: a JSON object, UTF-8, padded with spaces]
//   [the data: every tensor's bytes, row-major, little-endian]
// The header maps each tensor name to {"dtype": "F8_E4M3"|"F32"|"BF16"|..., "shape": [d0, ...],
// "data_offsets": [begin, end]} with offsets relative to the start of the data, and may hold
// "__metadata__": {string: string}. moekit accepts exactly what the reference implementation
// (the `safetensors` Python/Rust package) accepts, checked on a corpus of mutated files
// (tests/python/safetensors_interop.py): the header is UTF-8 JSON with no NUL byte and no byte
// order mark, padded with JSON whitespace; every tensor's end - begin is the byte count of its
// dtype and shape, the product folded left to right in 64 bits with no overflow and a whole
// number of bytes; the tensors tile the data with no gap and no overlap; the data end where the
// file ends. The package's JSON reader also takes a few unusual spellings, and so does moekit: a
// tensor entry as an array [dtype, shape, data_offsets], a dtype as {"F32": null},
// "__metadata__": null, and a repeated tensor name (the last entry counts, every entry must be
// well formed); it refuses a repeated "__metadata__", a repeated field inside an entry, and
// nesting deeper than 127 levels. One difference: a dimension above 2^63 - 1 (possible only in
// a tensor with another dimension 0) is refused, because shapes are held as int64_t.
// Anything else is an Error naming the file, the tensor and the bad value: a file shorter than
// 8 bytes, a header length past the end of the file, malformed JSON, an unknown dtype, offsets
// that do not match the shape, overlap, leave a gap or run past the end (a truncated file).
// Only regular files are opened (a FIFO, a directory or a device is an Error, see
// src/io/file_io.h).
//
// Reading memory-maps the file; tensor data are spans into the mapping, valid while the
// SafetensorsFile lives. Writing streams: the header (all names, dtypes and shapes) is declared
// first, then each tensor's bytes are written in order, so a file of many GB needs only one
// tensor in memory. The writer pads the header so the data start 8-byte aligned, as the
// reference writer does, and writes to "<path>.tmp", renamed to <path> once complete, so an
// interrupted write never leaves a file that looks valid.
//
// A Checkpoint is one safetensors file, a directory with model.safetensors.index.json
// ({"weight_map": {tensor: file name}}, the Hugging Face convention for sharded checkpoints), or a
// directory of *.safetensors files without an index (a tensor found in two of them is an Error).
// A directory without an index whose files carry moekit's generator metadata (kGeneratorName,
// below) is refused: the generator removes the old index first and writes the new one last, so
// such a directory is an interrupted write that may mix new and old shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moekit {

// The dtypes of the safetensors format. F4, F6_E2M3 and F6_E3M2 pack 4 or 6 bits per element
// (a tensor of them must hold a whole number of bytes); every other dtype holds whole bytes.
enum class Dtype {
  kBool, kU8, kI8, kF8E4M3, kF8E5M2, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kI64, kU64, kF64,
  kF4, kF6E2M3, kF6E3M2, kF8E8M0, kF8E4M3FNUZ, kF8E5M2FNUZ, kC64
};

std::string_view dtype_name(Dtype dtype);  // as in the header: "F8_E4M3", "BF16", ...
size_t dtype_bits(Dtype dtype);            // bits per element
size_t dtype_size(Dtype dtype);            // bytes per element; an Error for the sub-byte dtypes
// Parses a header dtype string; an unknown one is an Error naming `origin` (file and tensor).
Dtype parse_dtype(std::string_view name, std::string_view origin);

// "[2048, 7168]"
std::string shape_string(std::span<const int64_t> shape);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data
  uint64_t end = 0;

  int64_t num_elements() const;
  uint64_t num_bytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Maps and validates the whole header (see the contract above).
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(std::string_view name) const;
  // A missing name is an Error naming the tensor and the file.
  const TensorInfo& info(std::string_view name) const;
  std::span<const uint8_t> bytes(std::string_view name) const;
  // The bytes of `name` after checking its dtype and shape; a mismatch is an Error of the form
  // "tensor 'NAME' in FILE: expected dtype F8_E4M3 shape [2048, 7168], got BF16 [2048, 7168]".
  std::span<const uint8_t> bytes(std::string_view name, Dtype dtype, std::span<const int64_t> shape) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data region inside the mapping
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: its name, dtype and shape (the byte count follows from them).
struct TensorDecl {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;

  uint64_t num_bytes() const;
};

// The exact size of the header block (8-byte length plus padded JSON) of a file holding `tensors`.
uint64_t safetensors_header_bytes(std::span<const TensorDecl> tensors, const std::map<std::string, std::string>& metadata = {});

class OutputFile;  // src/io/file_io.h: "<path>.tmp", renamed when complete

class SafetensorsWriter {
 public:
  // Validates the declarations (unique non-empty names, non-negative dims, no "__metadata__"
  // name) and writes the header. Tensors are then written in the declared order.
  SafetensorsWriter(std::string path, std::vector<TensorDecl> tensors, const std::map<std::string, std::string>& metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();  // an unfinished file is removed

  // The next declared tensor; `data` must hold exactly its byte count.
  const TensorDecl& next() const;
  void write(std::span<const uint8_t> data);
  // Checks that every declared tensor was written, flushes and moves the file into place.
  void finish();

 private:
  std::string path_;
  std::vector<TensorDecl> tensors_;
  size_t written_ = 0;
  std::unique_ptr<OutputFile> out_;  // null once finished
};

// A tensor and its bytes, for writing a small file in one call.
struct TensorData {
  TensorDecl decl;
  std::span<const uint8_t> data;
};
void write_safetensors(const std::string& path, std::span<const TensorData> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The name of the index file of a sharded checkpoint.
constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
// __metadata__["generator"] of the files moekit's random-weights generator writes (weights.h).
constexpr std::string_view kGeneratorName = "moekit random weights";

class Checkpoint {
 public:
  // `path` is a .safetensors file, or a directory with an index file, or a directory of
  // *.safetensors files. Files named by an index are opened when a tensor in them is first asked for.
  static Checkpoint open(const std::string& path);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& path() const { return path_; }
  bool contains(std::string_view name) const;
  // The file holding `name`; a missing tensor is an Error naming it and the checkpoint.
  const SafetensorsFile& file_of(std::string_view name) const;
  const TensorInfo& info(std::string_view name) const { return file_of(name).info(name); }
  std::span<const uint8_t> bytes(std::string_view name, Dtype dtype, std::span<const int64_t> shape) const {
    return file_of(name).bytes(name, dtype, shape);
  }
  std::vector<std::string> tensor_names() const;  // sorted

 private:
  Checkpoint() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace moekit
