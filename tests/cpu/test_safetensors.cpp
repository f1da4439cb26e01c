// The safetensors container: round trips, the byte layout of the format, every malformed file
// the reader must refuse with a clear message, and checkpoints spread over several files.
// (Cross-checks against the `safetensors` Python package are in test_weights.cpp.)
#include "moekit/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <fmt/format.h>

#include "moekit/check.h"

namespace fs = std::filesystem;
using namespace moekit;

namespace {

// A fresh, empty directory for one test.
fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(MOEKIT_BINARY_DIR) / "test_tmp" / "safetensors" / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A file built by hand: the 8-byte little-endian length, the header text, the data.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
  return out + header + data;
}

// Expects SafetensorsFile::open to throw an Error whose message contains every one of `parts`.
void expect_open_error(const fs::path& p, std::initializer_list<std::string> parts) {
  try {
    SafetensorsFile::open(p.string());
    ADD_FAILURE() << "opening " << p << " did not throw";
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what() << "\n  lacks: " << part;
  }
}

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

struct Sample {
  std::vector<uint8_t> fp8 = std::vector<uint8_t>(15);
  std::vector<float> f32 = {1.5f, -2.0f, 0.0f, 1e-30f};
  std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x0001, 0x7F7F};
  std::vector<int64_t> empty;
  std::vector<double> scalar = {2.5};
  Sample() {
    for (size_t i = 0; i < fp8.size(); ++i) fp8[i] = uint8_t(i * 37 + 5);
  }
  std::vector<TensorData> tensors() const {
    return {{{"w.fp8", Dtype::kF8E4M3, {3, 5}}, as_bytes(fp8)},
            {{"a.f32", Dtype::kF32, {2, 2}}, as_bytes(f32)},
            {{"z.bf16", Dtype::kBF16, {4}}, as_bytes(bf16)},
            {{"empty", Dtype::kI64, {0, 3}}, as_bytes(empty)},
            {{"scalar", Dtype::kF64, {}}, as_bytes(scalar)}};
  }
};

}  // namespace

TEST(Dtype, NamesAndSizes) {
  EXPECT_EQ(dtype_name(Dtype::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_name(Dtype::kBF16), "BF16");
  EXPECT_EQ(dtype_size(Dtype::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(Dtype::kBF16), 2u);
  EXPECT_EQ(dtype_size(Dtype::kF32), 4u);
  EXPECT_EQ(dtype_size(Dtype::kI64), 8u);
  EXPECT_EQ(dtype_size(Dtype::kC64), 8u);
  EXPECT_EQ(dtype_bits(Dtype::kF4), 4u);
  EXPECT_EQ(dtype_bits(Dtype::kF6E3M2), 6u);
  EXPECT_THROW(dtype_size(Dtype::kF4), Error);
  EXPECT_EQ(parse_dtype("F32", "x"), Dtype::kF32);
  EXPECT_EQ(parse_dtype("F8_E8M0", "x"), Dtype::kF8E8M0);
  EXPECT_EQ(parse_dtype("F8_E4M3FNUZ", "x"), Dtype::kF8E4M3FNUZ);
  EXPECT_EQ(dtype_size(Dtype::kF8E5M2FNUZ), 1u);
  EXPECT_THROW(parse_dtype("F2", "x"), Error);
  const int64_t shape[] = {2048, 7168};
  EXPECT_EQ(shape_string(shape), "[2048, 7168]");
}

TEST(Safetensors, WriteThenReadBitForBit) {
  const fs::path p = test_dir() / "a.safetensors";
  Sample s;
  write_safetensors(p.string(), s.tensors(), {{"format", "pt"}});
  SafetensorsFile f = SafetensorsFile::open(p.string());
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(f.tensors().size(), 5u);
  for (const auto& t : s.tensors()) {
    const TensorInfo& info = f.info(t.decl.name);
    EXPECT_EQ(info.dtype, t.decl.dtype) << t.decl.name;
    EXPECT_EQ(info.shape, t.decl.shape) << t.decl.name;
    auto got = f.bytes(t.decl.name, t.decl.dtype, t.decl.shape);
    ASSERT_EQ(got.size(), t.data.size()) << t.decl.name;
    if (!got.empty()) {  // an empty span may hold a null pointer, which memcmp must not see
      EXPECT_EQ(std::memcmp(got.data(), t.data.data(), got.size()), 0) << t.decl.name;
    }
  }
  EXPECT_EQ(f.info("scalar").num_elements(), 1);
  EXPECT_EQ(f.info("empty").num_elements(), 0);
}

// The bytes on disk, checked against the format's definition by hand.
TEST(Safetensors, FileLayoutFollowsTheFormat) {
  const fs::path p = test_dir() / "a.safetensors";
  Sample s;
  write_safetensors(p.string(), s.tensors());
  const std::string bytes = read_file(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "the data must start 8-byte aligned";
  // 15 + 16 + 8 + 0 + 8 bytes of data, in declared order.
  ASSERT_EQ(bytes.size(), 8 + n + 47);
  auto j = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_FALSE(j.contains("__metadata__"));
  EXPECT_EQ(j["w.fp8"]["data_offsets"], nlohmann::json({0, 15}));
  EXPECT_EQ(j["a.f32"]["data_offsets"], nlohmann::json({15, 31}));
  EXPECT_EQ(j["z.bf16"]["data_offsets"], nlohmann::json({31, 39}));
  EXPECT_EQ(j["empty"]["data_offsets"], nlohmann::json({39, 39}));
  EXPECT_EQ(j["scalar"]["data_offsets"], nlohmann::json({39, 47}));
  EXPECT_EQ(j["w.fp8"]["dtype"], "F8_E4M3");
  EXPECT_EQ(j["w.fp8"]["shape"], nlohmann::json({3, 5}));
  EXPECT_EQ(j["scalar"]["shape"], nlohmann::json::array());
  // 1.5f little-endian at the start of a.f32.
  EXPECT_EQ(bytes.substr(8 + n + 15, 4), std::string("\x00\x00\xC0\x3F", 4));
  EXPECT_EQ(safetensors_header_bytes(std::vector<TensorDecl>{{"w.fp8", Dtype::kF8E4M3, {3, 5}}, {"a.f32", Dtype::kF32, {2, 2}},
                                                              {"z.bf16", Dtype::kBF16, {4}}, {"empty", Dtype::kI64, {0, 3}},
                                                              {"scalar", Dtype::kF64, {}}}),
            8 + n);
}

TEST(Safetensors, LookupErrorsNameTheTensorAndTheFile) {
  const fs::path p = test_dir() / "a.safetensors";
  Sample s;
  write_safetensors(p.string(), s.tensors());
  SafetensorsFile f = SafetensorsFile::open(p.string());
  EXPECT_FALSE(f.contains("nope"));
  try {
    f.info("nope");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'nope' not found in safetensors file '" + p.string() + "'"), std::string::npos) << e.what();
  }
  const int64_t shape[] = {2, 2};
  try {
    f.bytes("z.bf16", Dtype::kF32, shape);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'z.bf16' in '" + p.string() + "': expected dtype F32 shape [2, 2], got BF16 [4]"),
              std::string::npos)
        << e.what();
  }
  const int64_t wrong[] = {5, 3};
  EXPECT_THROW(f.bytes("w.fp8", Dtype::kF8E4M3, wrong), Error);
}

TEST(Safetensors, MalformedFilesAreRefusedWithTheReason) {
  const fs::path dir = test_dir();
  auto check = [&](const std::string& name, const std::string& bytes, std::initializer_list<std::string> parts) {
    SCOPED_TRACE(name);
    write_file(dir / name, bytes);
    expect_open_error(dir / name, parts);
  };
  const std::string u8x4 = R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";
  check("short", std::string("\x05\x00\x00", 3), {"file too short (3 bytes)"});
  check("empty", "", {"file too short (0 bytes)"});
  check("header_past_end", raw_file("{" + u8x4 + "}", "1234").substr(0, 20), {"header length", "runs past the end of the file (20 bytes)"});
  check("json", raw_file("{\"a\":", ""), {"malformed JSON"});
  check("not_object", raw_file("[1,2]", ""), {"must be a JSON object, got array"});
  check("fields", raw_file(R"({"a":{"dtype":"U8","shape":[4]}})", "1234"), {"tensor 'a'", "expected an object with dtype, shape and data_offsets"});
  check("dtype", raw_file(R"({"a":{"dtype":"F7","shape":[4],"data_offsets":[0,4]}})", "1234"), {"tensor 'a'", "unknown dtype \"F7\""});
  check("negative_dim", raw_file(R"({"a":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", "1234"),
        {"tensor 'a'", "shape [-4] must be an array of non-negative integers"});
  check("size", raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,3]}})", "123"),
        {"tensor 'a'", "data_offsets [0, 3] hold 3 bytes, but dtype F32 shape [1] needs 4"});
  check("reversed", raw_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", "1234"), {"end before they begin"});
  check("out_of_range", raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "1234"),
        {"tensor 'a'", "data_offsets [2, 6] run past the end of the data (4 bytes)", "truncated"});
  check("overlap",
        raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "123456"),
        {"tensor 'b' data_offsets [2, 6] overlap tensor 'a' [0, 4]"});
  check("gap",
        raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})", "12345"),
        {"tensor 'b' begins at data offset 3, leaving a gap after byte 2"});
  check("trailing", raw_file("{" + u8x4 + "}", "12345"), {"the tensors cover 4 bytes of data but the file holds 5"});
  check("metadata", raw_file(R"({"__metadata__":{"x":1},)" + u8x4 + "}", "1234"), {"__metadata__ entry 'x' = 1 is not a string"});
  // The error names the file.
  check("named", "", {(dir / "named").string()});
  // And the smallest valid file, an empty header (padded as the reference writer pads it), opens.
  write_file(dir / "valid", raw_file("{}      ", ""));
  EXPECT_TRUE(SafetensorsFile::open((dir / "valid").string()).tensors().empty());
}

// Item: shape × dtype size wrapped at 2^64, and a NUL or a byte order mark in the header passed.
// Each case below was checked against the `safetensors` package (0.8), and the differential test
// in test_weights.cpp compares both on a few hundred mutated files.
TEST(Safetensors, HeaderAcceptedExactlyAsThePackageAcceptsIt) {
  const fs::path dir = test_dir();
  int n = 0;
  auto refused = [&](const std::string& header, const std::string& data, std::initializer_list<std::string> parts) {
    SCOPED_TRACE(header.substr(0, 120));
    const fs::path p = dir / fmt::format("refused{}", n++);
    write_file(p, raw_file(header, data));
    expect_open_error(p, parts);
  };
  auto accepted = [&](const std::string& header, const std::string& data) {
    SCOPED_TRACE(header.substr(0, 120));
    const fs::path p = dir / fmt::format("accepted{}", n++);
    write_file(p, raw_file(header, data));
    return SafetensorsFile::open(p.string());
  };
  const std::string u8x4 = R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";

  // [2^31, 2^30] F64 is 2^61 elements, 2^67 bits: it used to wrap to 0 bytes.
  refused(R"({"a":{"dtype":"F64","shape":[2147483648,1073741824],"data_offsets":[0,0]}})", "",
          {"tensor 'a'", "dtype F64 shape [2147483648, 1073741824] holds more than 2^64 bits"});
  refused(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", "", {"has more than 2^64 elements"});
  // The product is folded left to right, as the package does: an overflow before a 0 is refused.
  refused(R"({"a":{"dtype":"F64","shape":[4611686018427387904,4,0],"data_offsets":[0,0]}})", "", {"more than 2^64 elements"});
  EXPECT_EQ(accepted(R"({"a":{"dtype":"F64","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})", "").info("a").num_elements(), 0);

  // Only JSON text: a NUL byte ends nothing, a byte order mark is not skipped.
  refused("{" + u8x4 + "}" + std::string("\0\0\0", 3), "1234", {"header byte 53 is NUL (0x00)"});
  refused("{" + u8x4 + std::string("}\0garbage", 9), "1234", {"is NUL"});
  refused("\xEF\xBB\xBF{" + u8x4 + "}", "1234", {"byte order mark"});
  refused("{" + u8x4 + "}\xEF\xBB\xBF", "1234", {"header: malformed JSON"});
  // JSON whitespace around the object is fine, as the package's reader takes it.
  EXPECT_EQ(accepted(" \t\r\n{" + u8x4 + "} \t\r\n", "1234").tensors().size(), 1u);

  // The package's unusual spellings: an entry as an array, a dtype as {name: null}, null metadata.
  {
    const SafetensorsFile f = accepted(R"({"__metadata__":null,"a":["U8",[2],[0,2]],"b":{"dtype":{"I16":null},"shape":[1],"data_offsets":[2,4]}})", "1234");
    EXPECT_TRUE(f.metadata().empty());
    EXPECT_EQ(f.info("a").dtype, Dtype::kU8);
    EXPECT_EQ(f.info("b").dtype, Dtype::kI16);
  }
  refused(R"({"a":["U8",[4]]})", "1234", {"expected an object with dtype, shape and data_offsets"});
  refused(R"({"a":{"dtype":{"U8":[]},"shape":[4],"data_offsets":[0,4]}})", "1234", {"dtype {\"U8\":[]} is not a string"});
  // A repeated tensor name: the last entry counts, but every one must be well formed.
  EXPECT_EQ(accepted(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[9,4]},"a":{"dtype":"U16","shape":[2],"data_offsets":[0,4]}})", "1234")
                .info("a").dtype, Dtype::kU16);
  refused(R"({"a":5,)" + u8x4 + "}", "1234", {"tensor 'a'", "expected an object"});
  refused(R"({"__metadata__":{},"__metadata__":{},)" + u8x4 + "}", "1234", {"\"__metadata__\" appears twice"});
  refused(R"({"a":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "1234", {"tensor 'a': field \"dtype\" appears twice"});
  EXPECT_EQ(accepted(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1,"x":2}})", "1234").tensors().size(), 1u);
  refused(R"({"__metadata__":{"k":1,"k":"x"}})", "", {"__metadata__ entry 'k' = 1 is not a string"});
  EXPECT_EQ(accepted(R"({"__metadata__":{"k":"y","k":"x"}})", "").metadata().at("k"), "x");
  refused(R"({"__metadata__":[1]})", "", {"__metadata__ must be an object of strings, got array"});

  // Nesting: 127 levels pass, 128 do not (serde_json's limit).
  auto nested = [&](int levels) {
    return R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":)" + std::string(levels - 2, '[') +
           std::string(levels - 2, ']') + "}}";
  };
  EXPECT_EQ(accepted(nested(127), "1234").tensors().size(), 1u);
  refused(nested(128), "1234", {"nested deeper than 127 levels"});
  refused(std::string(100000, '[') + std::string(100000, ']'), "", {"nested deeper than 127 levels"});

  // The package's dtypes, the sub-byte ones in whole bytes only.
  EXPECT_EQ(accepted(R"({"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]},"b":{"dtype":"C64","shape":[1],"data_offsets":[3,11]},"c":{"dtype":"F8_E8M0","shape":[1],"data_offsets":[11,12]},"d":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[12,15]}})",
                     std::string(15, 'x')).tensors().size(), 4u);
  refused(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "12", {"dtype F4 shape [3] holds 12 bits, not a whole number of bytes"});
  // moekit's one difference: dimensions are int64_t.
  refused(R"({"a":{"dtype":"U8","shape":[9223372036854775808,0],"data_offsets":[0,0]}})", "",
          {"dimension 9223372036854775808 is above 2^63 - 1"});
  // A value in an error message is quoted up to 200 characters.
  try {
    write_file(dir / "long", raw_file(R"({"a":{"dtype":"U8","shape":")" + std::string(5000, 'x') + R"(","data_offsets":[0,0]}})", ""));
    SafetensorsFile::open((dir / "long").string());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 600u) << e.what();
  }
}

TEST(Safetensors, TruncatedFileNamesTheTensorCut) {
  const fs::path p = test_dir() / "a.safetensors";
  Sample s;
  write_safetensors(p.string(), s.tensors());
  std::string bytes = read_file(p);
  write_file(p, bytes.substr(0, bytes.size() - 1));  // the last tensor in data order is "scalar"
  expect_open_error(p, {p.string(), "tensor 'scalar'", "run past the end of the data", "truncated"});
  write_file(p, bytes.substr(0, 30));  // inside the header
  expect_open_error(p, {"runs past the end of the file (30 bytes)"});
}

TEST(SafetensorsWriter, ChecksWhatItWrites) {
  const fs::path dir = test_dir();
  const std::vector<uint8_t> four(4), three(3);
  EXPECT_THROW(SafetensorsWriter((dir / "dup").string(), {{"a", Dtype::kU8, {4}}, {"a", Dtype::kU8, {4}}}), Error);
  EXPECT_THROW(SafetensorsWriter((dir / "meta").string(), {{"__metadata__", Dtype::kU8, {4}}}), Error);
  EXPECT_THROW(SafetensorsWriter((dir / "neg").string(), {{"a", Dtype::kU8, {-1}}}), Error);
  {
    SafetensorsWriter w((dir / "a.safetensors").string(), {{"a", Dtype::kF32, {1}}, {"b", Dtype::kU8, {3}}});
    EXPECT_EQ(w.next().name, "a");
    EXPECT_THROW(w.write(three), Error);  // F32 [1] needs 4 bytes
    w.write(four);
    EXPECT_THROW(w.finish(), Error);  // "b" not written yet
    w.write(three);
    EXPECT_THROW(w.write(three), Error);  // nothing left to write
    w.finish();
  }
  EXPECT_TRUE(fs::exists(dir / "a.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "a.safetensors.tmp"));
  {
    SafetensorsWriter w((dir / "unfinished.safetensors").string(), {{"a", Dtype::kU8, {4}}});
    w.write(four);
  }
  EXPECT_FALSE(fs::exists(dir / "unfinished.safetensors")) << "an unfinished write must leave no file";
  EXPECT_FALSE(fs::exists(dir / "unfinished.safetensors.tmp"));
}

TEST(Checkpoint, OneFileADirectoryAndAnIndex) {
  const fs::path dir = test_dir();
  const std::vector<uint8_t> a = {1, 2, 3, 4}, b = {5, 6}, c = {7};
  const int64_t s4[] = {4}, s2[] = {2}, s1[] = {1};
  fs::create_directories(dir / "plain");
  write_safetensors((dir / "plain" / "x.safetensors").string(), std::vector<TensorData>{{{"a", Dtype::kU8, {4}}, a}});
  write_safetensors((dir / "plain" / "y.safetensors").string(),
                    std::vector<TensorData>{{{"b", Dtype::kU8, {2}}, b}, {{"c", Dtype::kU8, {1}}, c}});
  write_file(dir / "plain" / "notes.txt", "not a tensor file");

  Checkpoint one = Checkpoint::open((dir / "plain" / "y.safetensors").string());
  EXPECT_EQ(one.tensor_names(), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(one.bytes("c", Dtype::kU8, s1)[0], 7);

  Checkpoint plain = Checkpoint::open((dir / "plain").string());
  EXPECT_EQ(plain.tensor_names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(plain.bytes("a", Dtype::kU8, s4)[3], 4);
  EXPECT_EQ(plain.bytes("b", Dtype::kU8, s2)[1], 6);
  EXPECT_EQ(plain.file_of("b").path(), (dir / "plain" / "y.safetensors").string());
  try {
    plain.info("d");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'd' not found in checkpoint '" + (dir / "plain").string() + "'"), std::string::npos)
        << e.what();
  }

  // With an index, the index decides where each tensor is.
  write_file(dir / "plain" / kIndexFileName, R"({"metadata": {}, "weight_map": {"a": "x.safetensors", "b": "y.safetensors"}})");
  Checkpoint indexed = Checkpoint::open((dir / "plain").string());
  EXPECT_EQ(indexed.tensor_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(indexed.bytes("b", Dtype::kU8, s2)[0], 5);
  EXPECT_FALSE(indexed.contains("c"));
}

TEST(Checkpoint, InconsistentCheckpointsAreErrors) {
  const fs::path dir = test_dir();
  const std::vector<uint8_t> a = {1, 2, 3, 4};
  write_safetensors((dir / "x.safetensors").string(), std::vector<TensorData>{{{"a", Dtype::kU8, {4}}, a}});
  write_safetensors((dir / "y.safetensors").string(), std::vector<TensorData>{{{"a", Dtype::kU8, {4}}, a}});
  auto expect_error = [](auto&& fn, std::initializer_list<std::string> parts) {
    try {
      fn();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what() << "\n  lacks: " << part;
    }
  };
  expect_error([&] { Checkpoint::open(dir.string()); }, {"tensor 'a' is in both 'x.safetensors' and 'y.safetensors'"});
  expect_error([&] { Checkpoint::open((dir / "none").string()); }, {"no such file or directory"});
  fs::create_directories(dir / "empty");
  expect_error([&] { Checkpoint::open((dir / "empty").string()); }, {"neither model.safetensors.index.json nor *.safetensors"});

  const int64_t s4[] = {4};
  write_file(dir / kIndexFileName, R"({"weight_map": {"a": "x.safetensors", "b": "x.safetensors", "c": "gone.safetensors"}})");
  Checkpoint c = Checkpoint::open(dir.string());
  EXPECT_EQ(c.bytes("a", Dtype::kU8, s4)[0], 1);
  expect_error([&] { c.info("b"); }, {"the index places tensor 'b' in", "x.safetensors", "which does not hold it"});
  expect_error([&] { c.info("c"); }, {"gone.safetensors", "cannot open"});
  write_file(dir / kIndexFileName, R"({"weight_map": {"a": "../x.safetensors"}})");
  expect_error([&] { Checkpoint::open(dir.string()); }, {"must be a file name in the same directory"});
  write_file(dir / kIndexFileName, R"({"weight_map": [}})");
  expect_error([&] { Checkpoint::open(dir.string()); }, {"malformed JSON"});
  write_file(dir / kIndexFileName, R"({"tensors": {}})");
  expect_error([&] { Checkpoint::open(dir.string()); }, {"expected an object with \"weight_map\""});

  // A truncated shard: the error names the file when a tensor in it is first needed.
  write_file(dir / kIndexFileName, R"({"weight_map": {"a": "x.safetensors"}})");
  const std::string bytes = read_file(dir / "x.safetensors");
  write_file(dir / "x.safetensors", bytes.substr(0, bytes.size() - 2));
  Checkpoint t = Checkpoint::open(dir.string());
  expect_error([&] { t.info("a"); }, {(dir / "x.safetensors").string(), "truncated"});
}
