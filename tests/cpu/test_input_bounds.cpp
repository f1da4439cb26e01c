// Hostile input, file kind by file kind: JSON nested 200,000 deep, values quoted in errors,
// integers that would wrap in the type they end in, loads whose sums overflow, and counts that
// would allocate without bound. Each must be an Error that names the file and the field: never
// a crash, a silently wrong number or an allocation the size of the machine. The files are made
// here, small (the deepest is 400 KB).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "expect_error.h"
#include "io/json_read.h"
#include "moekit/eplb.h"
#include "moekit/limits.h"
#include "moekit/safetensors.h"
#include "moekit/simulate.h"
#include "moekit/spec.h"
#include "moekit/trace.h"

namespace fs = std::filesystem;
using namespace moekit;
using nlohmann::json;

namespace {

constexpr int kDeep = 200000;  // the release build died with SIGSEGV from here

std::string nest(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

// A fresh, empty directory for one test.
fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(MOEKIT_BINARY_DIR) / "test_tmp" / "input_bounds" /
                 (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  return p.string();
}

// A safetensors file: the 8-byte little-endian header length, the header, the data.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(header.size()) >> (8 * i)) & 0xFF);
  return out + header + data;
}

// The message of the Error `f` throws ("" and a failure when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

std::string tiny_model() { return to_json(load_model_spec("tiny-moe")); }
std::string h200() { return to_json(load_gpu_spec("h200")); }

// Every reader of a file, fed `value` in place of one field; the path of the file it read.
struct FileKind {
  const char* name;
  std::function<std::string(const fs::path& dir, const std::string& value)> write;
  std::function<void(const std::string& path)> read;
};

std::vector<FileKind> file_kinds() {
  auto with = [](std::string text, const std::string& field, const std::string& value) {
    json j = json::parse(text);
    j[field] = "@@";
    text = j.dump();
    return text.replace(text.find("\"@@\""), 4, value);
  };
  return {
      {"model spec",
       [=](const fs::path& d, const std::string& v) { return write_file(d / "model.json", with(tiny_model(), "hidden_size", v)); },
       [](const std::string& p) { load_model_spec(p); }},
      {"GPU spec",
       [=](const fs::path& d, const std::string& v) { return write_file(d / "gpu.json", with(h200(), "gpus_per_node", v)); },
       [](const std::string& p) { load_gpu_spec(p); }},
      {"trace",
       [](const fs::path& d, const std::string& v) {
         return write_file(d / "trace.json", R"({"format": "moekit-trace", "num_experts": 8, "topk": 1, "num_ranks": 1, )"
                                             R"("layers": [[[[0], [)" + v + "]]]]}");
       },
       [](const std::string& p) { read_trace(p); }},
      {"load file",
       [](const fs::path& d, const std::string& v) { return write_file(d / "loads.json", R"({"layers": [[1, )" + v + "]]}"); },
       [](const std::string& p) { read_loads(p); }},
      {"placement",
       [](const fs::path& d, const std::string& v) {
         return write_file(d / "placement.json", R"({"num_experts": 2, "num_groups": 1, "num_nodes": 1, "num_gpus": )" + v +
                                                     R"(, "phy2log": [[0, 1]]})");
       },
       [](const std::string& p) { read_placement(p); }},
      {"safetensors __metadata__",
       [](const fs::path& d, const std::string& v) {
         return write_file(d / "meta.safetensors",
                           safetensors_bytes(R"({"__metadata__": {"k": )" + v +
                                                 R"(}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})",
                                             "x"));
       },
       [](const std::string& p) { SafetensorsFile::open(p); }},
      {"safetensors tensor entry",
       [](const fs::path& d, const std::string& v) {
         return write_file(d / "tensor.safetensors",
                           safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": )" + v + "}}", "x"));
       },
       [](const std::string& p) { SafetensorsFile::open(p); }},
      {"index.json weight_map",
       [](const fs::path& d, const std::string& v) {
         fs::create_directories(d / "ckpt");
         write_file(d / "ckpt" / kIndexFileName, R"({"weight_map": {"a": )" + v + "}}");
         return (d / "ckpt").string();
       },
       [](const std::string& p) { Checkpoint::open(p); }},
  };
}

}  // namespace

TEST(JsonRead, NestingIsBoundedWhileParsing) {
  EXPECT_EQ(parse_json(nest(kMaxJsonDepth), "x").dump().size(), size_t(2 * kMaxJsonDepth + 1));
  const std::string msg = error_of([] { parse_json(nest(kMaxJsonDepth + 1), "deep.json"); });
  EXPECT_NE(msg.find("deep.json: JSON nested deeper than 127 levels at [0][0]"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 200u) << msg;
  std::string objects;
  for (int i = 0; i < kDeep; ++i) objects += "{\"key\":";
  const std::string obj_msg = error_of([&] { parse_json(objects, "o.json"); });
  EXPECT_NE(obj_msg.find("o.json: JSON nested deeper than 127 levels at key.key.key"), std::string::npos) << obj_msg;
}

TEST(JsonRead, ParseErrorsNameTheFileAndTheField) {
  expect_error([] { parse_json(R"({"router": {"num_groups": 1e999}})", "m.json"); },
               {"m.json: malformed JSON at router.num_groups", "number overflow parsing '1e999'"});
  expect_error([] { parse_json(R"({"layers": [[1, 2], [3, x]]})", "l.json"); }, {"l.json: malformed JSON at layers[1][1]"});
  // Between two fields the path names the object, not the field before.
  expect_error([] { parse_json(R"({"a": {"b": 1, x}})", "k.json"); }, {"k.json: malformed JSON at a: "});
  // An unterminated string of 1 MB: the message quotes a short prefix of it.
  const std::string msg = error_of([] { parse_json("{\"a\": \"" + std::string(1 << 20, 'z'), "s.json"); });
  EXPECT_NE(msg.find("s.json: malformed JSON at a"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u);
}

TEST(JsonRead, QuotesAreShortAndNeverRecurseFar) {
  EXPECT_EQ(quote(json(std::string(1 << 20, 'x'))), '"' + std::string(kMaxQuotedChars - 1, 'x') + "...");
  EXPECT_EQ(quote(parse_json(nest(kMaxJsonDepth), "x")), std::string(kMaxQuotedChars, '[') + "...");
  EXPECT_EQ(quote(json::parse(R"({"a": [1, 2.5, "b\nc"], "d": null})")), R"({"a":[1,2.5,"b\nc"],"d":null})");
  // Cut at a UTF-8 boundary, control characters shown as '?'.
  std::string accents;
  for (int i = 0; i < 100; ++i) accents += "\xC3\xA9";
  EXPECT_EQ(quote_text(accents), accents.substr(0, kMaxQuotedChars) + "...");
  EXPECT_EQ(quote_text('x' + accents), 'x' + accents.substr(0, kMaxQuotedChars - 2) + "...");
  EXPECT_EQ(quote_text("a\nb\x1b[2J"), "a?b?[2J");
}

TEST(JsonRead, IntegersAreCheckedInTheirFinalType) {
  auto problem = [](const char* text, int64_t lo, int64_t hi) {
    int64_t out = -7;
    std::string why = integer_problem(json::parse(text), lo, hi, out);
    return why.empty() ? std::to_string(out) : why;
  };
  const int64_t int_max = std::numeric_limits<int>::max();
  EXPECT_EQ(problem("8", 0, int_max), "8");
  EXPECT_EQ(problem("8.0", 0, int_max), "8");
  EXPECT_EQ(problem("1e3", 0, int_max), "1000");
  EXPECT_EQ(problem("-3", -5, 5), "-3");
  EXPECT_EQ(problem("8.9", 0, int_max), "must be an integer in [0, 2147483647]");
  EXPECT_EQ(problem("1e20", 0, int_max), "must be <= 2147483647");
  EXPECT_EQ(problem("-1e20", 0, int_max), "must be >= 0");
  EXPECT_EQ(problem("4294967304", 0, int_max), "must be <= 2147483647");  // wrapped to 8 before
  EXPECT_EQ(problem("18446744073709551615", 0, std::numeric_limits<int64_t>::max()), "must be <= 9223372036854775807");
  EXPECT_EQ(problem("9223372036854775807", 0, std::numeric_limits<int64_t>::max()), "9223372036854775807");
  EXPECT_EQ(problem("9.3e18", 0, std::numeric_limits<int64_t>::max()), "must be <= 9223372036854775807");
  EXPECT_EQ(problem("-1", 0, 10), "must be >= 0");
  EXPECT_EQ(problem("\"8\"", 0, 10), "must be an integer in [0, 10]");
  EXPECT_EQ(problem("true", 0, 10), "must be an integer in [0, 10]");
  EXPECT_EQ(problem("null", 0, 10), "must be an integer in [0, 10]");
  expect_error([] { json_integer<int32_t>(json(4294967304ULL), 0, 7, [] { return std::string("f.json: field 'n'"); }); },
               {"f.json: field 'n' = 4294967304 must be <= 7"});
}

// Item 2 of the hostile-input issue: every file kind, 200,000 levels deep (400 KB).
TEST(HostileFiles, DeepJsonInEveryFileKindIsAnErrorNamingTheFile) {
  const fs::path dir = test_dir();
  for (const FileKind& kind : file_kinds()) {
    const std::string path = kind.write(dir, nest(kDeep));
    const std::string msg = error_of([&] { kind.read(path); });
    EXPECT_NE(msg.find("nested deeper than 127 levels"), std::string::npos) << kind.name << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << kind.name << ": " << msg;
    EXPECT_LT(msg.size(), 200 + path.size()) << kind.name;
  }
}

// The depth limit is the safetensors package's (serde_json's): with safetensors 0.8.0 a header
// whose tensor entry holds an extra field of 125 nested arrays (127 levels in all) opens, one of
// 126 arrays is refused ("recursion limit exceeded"). moekit draws the line at the same place.
TEST(HostileFiles, SafetensorsHeaderDepthMatchesThePackage) {
  const fs::path dir = test_dir();
  auto file = [&](int arrays) {
    return write_file(dir / fmt::format("d{}.safetensors", arrays),
                      safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": )" +
                                            nest(arrays, "") + "}}",
                                        "x"));
  };
  EXPECT_EQ(SafetensorsFile::open(file(125)).tensors().size(), 1u);
  const std::string p = file(126);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "nested deeper than 127 levels at a.x[0][0]"});
}

// Values nested within the limit, or merely long, are quoted in a message by a short prefix.
TEST(HostileFiles, BadValuesAreQuotedByAShortPrefix) {
  const fs::path dir = test_dir();
  const std::string long_value = nest(100, '"' + std::string(100000, 'v') + '"');
  for (const FileKind& kind : file_kinds()) {
    const std::string path = kind.write(dir, long_value);
    const std::string msg = error_of([&] { kind.read(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << kind.name << ": " << msg;
    EXPECT_NE(msg.find("[[[[[["), std::string::npos) << kind.name << ": " << msg;
    EXPECT_LT(msg.size(), 300 + path.size()) << kind.name << ": " << msg;
  }
}

// Item 4: a spec integer is checked as the int it is stored in (4294967296 was 0, then SIGFPE).
TEST(HostileFiles, SpecIntegersAreCheckedInTheTypeTheyEndIn) {
  auto model_with = [](const std::string& field, uint64_t value) {
    json j = json::parse(tiny_model());
    if (field == "num_groups")
      j["router"][field] = value;
    else
      j[field] = value;
    return j.dump();
  };
  expect_error([&] { parse_model_spec(model_with("num_groups", 4294967296ULL), "m.json"); },
               {"m.json.router: field 'num_groups' = 4294967296 must be <= 65536"});
  expect_error([&] { parse_model_spec(model_with("num_routed_experts", 4294967298ULL), "m.json"); },
               {"m.json: field 'num_routed_experts' = 4294967298 must be <= 65536"});
  expect_error([&] { parse_model_spec(model_with("num_layers", 4294967297ULL), "m.json"); },
               {"m.json: field 'num_layers' = 4294967297 must be <= 4096"});
  json g = json::parse(h200());
  g["gpus_per_node"] = 4294967304ULL;
  expect_error([&] { parse_gpu_spec(g.dump(), "g.json"); }, {"g.json: field 'gpus_per_node' = 4294967304 must be <= 4096"});
  // An integer-valued float is an integer; a fraction is not.
  g["gpus_per_node"] = 8.0;
  EXPECT_EQ(parse_gpu_spec(g.dump(), "g.json").gpus_per_node, 8);
  g["gpus_per_node"] = 8.9;
  expect_error([&] { parse_gpu_spec(g.dump(), "g.json"); }, {"field 'gpus_per_node' = 8.9 must be an integer"});
}

// Item 5: traces and placements read every integer through the checked reader.
TEST(HostileFiles, TraceAndPlacementIntegersAreChecked) {
  const fs::path dir = test_dir();
  auto trace = [&](const std::string& num_experts, const std::string& id) {
    return write_file(dir / "t.json", R"({"format": "moekit-trace", "num_experts": )" + num_experts +
                                          R"(, "topk": 1, "num_ranks": 1, "layers": [[[[)" + id + "]]]]}");
  };
  std::string p = trace("4294967304", "0");
  expect_error([&] { read_trace(p); }, {"trace '" + p + "': field 'num_experts' = 4294967304 must be <= 65536"});
  p = trace("1e20", "0");
  expect_error([&] { read_trace(p); }, {"field 'num_experts' = 1e+20 must be <= 65536"});
  p = trace("8", "8.9");
  expect_error([&] { read_trace(p); }, {p, "layer 0 step 0 token 0: expert id 8.9 is not an integer in [0, 8)"});
  p = trace("8", "4294967304");
  expect_error([&] { read_trace(p); }, {"expert id 4294967304 is not an integer in [0, 8)"});
  p = trace("8.0", "7.0");
  EXPECT_EQ(read_trace(p).layers[0][0][0], 7);
  p = write_file(dir / "f.json", R"({"format": ["moekit-trace"], "num_experts": 8})");
  expect_error([&] { read_trace(p); }, {"trace '" + p + "': field 'format' = [\"moekit-trace\"] must be a string"});

  auto placement = [&](const std::string& num_gpus, const std::string& slot) {
    return write_file(dir / "p.json", R"({"num_experts": 2, "num_groups": 1, "num_nodes": 1, "num_gpus": )" + num_gpus +
                                          R"(, "phy2log": [[0, )" + slot + "]]}");
  };
  p = placement("4294967298", "1");
  expect_error([&] { read_placement(p); }, {"placement '" + p + "': field 'num_gpus' = 4294967298 must be <= 4096"});
  p = placement("2", "1.5");
  expect_error([&] { read_placement(p); }, {"phy2log layer 0 slot 1 = 1.5 must be an integer in [0, 1]"});
  p = placement("2", "1e20");
  expect_error([&] { read_placement(p); }, {"phy2log layer 0 slot 1 = 1e+20 must be <= 1"});
  p = placement("2.0", "1.0");
  EXPECT_EQ(read_placement(p).num_gpus, 2);
}

// Item 8: inputs whose results would overflow are refused, naming the input.
TEST(HostileFiles, InputsWhoseResultsOverflowAreRefused) {
  const fs::path dir = test_dir();
  const std::string p = write_file(dir / "l.json", R"({"layers": [[1e308, 1e308, 1e308, 1e308, 1e308, 1e308, 1e308, 1e308]]})");
  expect_error([&] { read_loads(p); }, {p, "load of layer 0 expert 0 is 1e+308, expected a finite value in [0, 1e+18]"});
  expect_error([] { rebalance({{1e19, 1}}, 2, 1, 1, 1); }, {"load of layer 0 expert 0 is 1e+19"});
  json g = json::parse(h200());
  g["hbm_bandwidth"] = 1e-320;
  expect_error([&] { parse_gpu_spec(g.dump(), "g.json"); }, {"g.json: field 'hbm_bandwidth' = 1e-320 must be >= 1e+06"});
  g = json::parse(h200());
  g["fp8_flops"] = 1e300;
  expect_error([&] { parse_gpu_spec(g.dump(), "g.json"); }, {"field 'fp8_flops' = 1e+300 must be <= 1e+18"});
  json m = json::parse(tiny_model());
  m["kv_bytes_per_token"] = 1e-300;
  expect_error([&] { parse_model_spec(m.dump(), "m.json"); }, {"field 'kv_bytes_per_token' = 1e-300 must be >= 1"});
}

// Item 9: counts from files and arguments are bounded before anything is allocated from them.
TEST(HostileFiles, CountsAreBoundedBeforeAllocating) {
  const fs::path dir = test_dir();
  std::string p = write_file(dir / "t.json", R"({"format": "moekit-trace", "num_experts": 2000000000, "topk": 1, )"
                                             R"("num_ranks": 1, "layers": [[[[0]]]]})");
  expect_error([&] { read_trace(p); }, {p, "field 'num_experts' = 2000000000 must be <= 65536"});
  // 1500 empty layers x 65536 experts: the load table trace_loads() would build is past the bound.
  p = write_file(dir / "t2.json", [] {
    std::string layers;
    for (int l = 0; l < 1500; ++l) layers += l ? ",[]" : "[]";
    return R"({"format": "moekit-trace", "num_experts": 65536, "topk": 1, "num_ranks": 1, "layers": [)" + layers + "]}";
  }());
  expect_error([&] { read_trace(p); }, {p, "1500 layers x 65536 experts exceed the limit of 67108864 load entries"});
  p = write_file(dir / "p.json", R"({"num_experts": 2000000000, "num_groups": 1, "num_nodes": 1, "num_gpus": 1, "phy2log": [[0]]})");
  expect_error([&] { read_placement(p); }, {p, "field 'num_experts' = 2000000000 must be <= 65536"});

  expect_error([] { rebalance({{1, 1}}, 200000000, 1, 1, 1); }, {"num_slots = 200000000 exceeds the limit of 262144"});
  expect_error([] { rebalance({{1, 1}}, 4, 1, 1, 2000000); }, {"num_gpus = 2000000 exceeds the limit of 4096"});
  expect_error([] { rebalance(std::vector<std::vector<double>>(300, std::vector<double>(2, 1.0)), 262144, 1, 1, 1); },
               {"300 layers x 262144 slots exceed the limit of 67108864"});
  // One hot expert takes every redundant slot: log2phy is [E][max_replicas], 8192 x 8193 entries.
  std::vector<std::vector<double>> hot(1, std::vector<double>(8192, 1.0));
  hot[0][0] = 1e15;
  expect_error([&] { rebalance(hot, 16384, 1, 1, 1); },
               {"log2phy of 1 layers x 8192 experts x 8193 replicas", "exceeds the limit of 67108864 entries"});

  SimulateInput in;
  in.num_experts = std::numeric_limits<int>::max();
  in.topk = 1;
  in.batch = 1;
  in.trials = 2;
  expect_error([&] { simulate(in); }, {"--experts = 2147483647 must be <= 65536"});
  in.num_experts = 8;
  in.batch = int64_t(1) << 40;
  expect_error([&] { simulate(in); }, {"--batch = 1099511627776 must be <= 16777216"});
  in.batch = 1;
  in.trials = std::numeric_limits<int64_t>::max();
  expect_error([&] { simulate(in); }, {"--trials = 9223372036854775807 must be <= 4194304"});
  in.trials = 2;
  expect_error([&] { sample_trace(in, 1, int64_t(1) << 30); }, {"--steps = 1073741824 must be >= 1 and <= 4194304"});

  // The dual-load search keeps tokens x GPUs counters per layer.
  RoutingTrace big;
  big.num_experts = 1;
  big.topk = 1;
  big.num_ranks = 1;
  big.layers.assign(1, std::vector<std::vector<int32_t>>(1, std::vector<int32_t>(16385, 0)));
  expect_error([&] { rebalance_dual(big, 4096, 1, 1, 4096); }, {"16385 tokens x 4096 GPUs exceed the limit of 67108864"});
}

// ---- Strict readers: what a reader used to take without a word -------------------------------

// A CSV load is plain decimal text: strtod stopped at a NUL ("5\0abc" read as 5, a file of NULs
// as one load) and took hex ("0x10") and hex floats ("0x1p3").
TEST(StrictReaders, CsvLoadsArePlainDecimalText) {
  const fs::path dir = test_dir();
  std::string p = write_file(dir / "nul.csv", std::string("5\0abc,7\n", 8));
  expect_error([&] { read_loads(p); }, {p, "line 1 column 2", "control byte \\x00", "expected printable text"});
  p = write_file(dir / "nuls.csv", std::string(4096, '\0'));
  expect_error([&] { read_loads(p); }, {p, "line 1 column 1", "control byte \\x00"});
  p = write_file(dir / "ff.csv", "1,2\f,3\n");
  expect_error([&] { read_loads(p); }, {p, "line 1 column 4", "control byte \\x0C"});
  p = write_file(dir / "cr.csv", "1,2\r3\n");
  expect_error([&] { read_loads(p); }, {p, "line 1 column 4", "control byte \\x0D"});
  p = write_file(dir / "hex.csv", "# loads\n1,2\n3,0x10\n");
  expect_error([&] { read_loads(p); }, {p, "line 3 column 3 (field 1)", "layer 1 expert 1 is '0x10'", "expected a number"});
  p = write_file(dir / "hexfloat.csv", "0x1p3,1\n");
  expect_error([&] { read_loads(p); }, {p, "line 1 column 1 (field 0)", "layer 0 expert 0 is '0x1p3'"});
  p = write_file(dir / "inner.csv", "1, 2 3 ,4\n");
  expect_error([&] { read_loads(p); }, {p, "line 1 column 4 (field 1)", "is '2 3'"});
  p = write_file(dir / "utf8.csv", "1,\xC3\xA9,3\n");
  expect_error([&] { read_loads(p); }, {p, "is '\\xC3\\xA9'"});
  for (const char* bad : {"1e", "e5", ".", "+", "1.2.3", "--1", "1e+", "1d0"}) {
    p = write_file(dir / "bad.csv", std::string("1,") + bad + "\n");
    expect_error([&] { read_loads(p); }, {p, "layer 0 expert 1 is '" + std::string(bad) + "'"});
  }
  // NaN and inf are numbers the range check refuses by name, as before.
  p = write_file(dir / "nan.csv", "1,nan\n");
  expect_error([&] { read_loads(p); }, {p, "layer 0 expert 1 is nan"});
  // What the docs allow: signs, decimal points, exponents, spaces and tabs around a load,
  // CRLF line ends, comments and blank lines.
  p = write_file(dir / "ok.csv", "# layer 0\r\n1, 2.5 ,\t3e2, .5\r\n\n  # layer 1\n4,5.,6E-1,+7\n");
  EXPECT_EQ(read_loads(p), (std::vector<std::vector<double>>{{1, 2.5, 300, 0.5}, {4, 5, 0.6, 7}}));
  p = write_file(dir / "last.csv", "1,2");  // no final line end
  EXPECT_EQ(read_loads(p), (std::vector<std::vector<double>>{{1, 2}}));
}

// Load JSON is as strict as a spec: a repeated key (nlohmann keeps the last one) and an
// unknown key are refused; so is a repeated key in a spec, a trace and a placement.
TEST(StrictReaders, JsonRefusesRepeatedAndUnknownKeys) {
  const fs::path dir = test_dir();
  std::string p = write_file(dir / "twice.json", R"({"layers": [[1, 2]], "layers": [[3, 4]]})");
  expect_error([&] { read_loads(p); }, {p, "key 'layers' appears twice", "at the top level"});
  p = write_file(dir / "typo.json", R"({"layers": [[1, 2]], "layer": [[3, 4]]})");
  expect_error([&] { read_loads(p); }, {p, "unknown field 'layer'"});
  p = write_file(dir / "notes.json", R"({"layers": [[1, 2]], "notes": "from a run", "source": "x"})");
  EXPECT_EQ(read_loads(p), (std::vector<std::vector<double>>{{1, 2}}));
  expect_error([] { parse_json(R"({"router": {"a": 1, "b": {"c": 2}, "a": 3}})", "m.json"); },
               {"m.json: key 'a' appears twice in the object at router"});
  expect_error([] { parse_json(R"({"layers": [{"x": 1, "x": 1}]})", "l.json"); }, {"key 'x' appears twice", "at layers[0]"});
  p = write_file(dir / "t.json", R"({"format": "moekit-trace", "num_experts": 8, "topk": 1, "num_experts": 9, )"
                                 R"("num_ranks": 1, "layers": [[[[0]]]]})");
  expect_error([&] { read_trace(p); }, {p, "key 'num_experts' appears twice"});
  p = write_file(dir / "p.json", R"({"num_experts": 2, "num_groups": 1, "num_nodes": 1, "num_gpus": 1, )"
                                 R"("phy2log": [[0, 1]], "phy2log": [[1, 0]]})");
  expect_error([&] { read_placement(p); }, {p, "key 'phy2log' appears twice"});
  // A safetensors header keeps the last of a repeated key, as the safetensors package does.
  EXPECT_EQ(parse_json(R"({"a": 1, "a": 2})", "h", JsonKeys::last_wins)["a"], 2);
}

// A token's top-k experts are distinct, and a trace without steps has no loads to balance.
TEST(StrictReaders, TracesNeedDistinctExpertsAndSteps) {
  const fs::path dir = test_dir();
  auto trace = [&](const std::string& layers) {
    return write_file(dir / "t.json",
                      R"({"format": "moekit-trace", "num_experts": 8, "topk": 2, "num_ranks": 1, "layers": )" + layers + "}");
  };
  std::string p = trace("[[[[0, 1], [2, 5]], [[4, 6], [3, 3]]]]");
  expect_error([&] { read_trace(p); }, {p, "layer 0 step 1 token 1 lists expert id 3 twice", "topk = 2 distinct"});
  p = trace("[[]]");
  expect_error([&] { read_trace(p); }, {p, "layer 0 holds no steps"});
  p = trace("[[[[0, 1]]], []]");
  expect_error([&] { read_trace(p); }, {p, "layer 1 holds no steps"});
  p = trace("[]");
  expect_error([&] { read_trace(p); }, {p, "holds no layers"});
  // The same id in two tokens, or twice in one step, is fine.
  p = trace("[[[[3, 1], [1, 3]]]]");
  EXPECT_EQ(read_trace(p).layers[0][0], (std::vector<int32_t>{3, 1, 1, 3}));
  RoutingTrace t;
  t.num_experts = 4;
  t.topk = 2;
  t.layers = {{{0, 0}}};
  expect_error([&] { validate_trace(t); }, {"trace: layer 0 step 0 token 0 lists expert id 0 twice"});
}

// A placement's declared fields must agree with its phy2log.
TEST(StrictReaders, PlacementFieldsMatchTheData) {
  const fs::path dir = test_dir();
  // 1 layer, 4 experts, 4 slots on 2 GPUs, identity: the fields eplb writes, each replaced in turn.
  const json good = json::parse(R"({"format": "moekit-placement", "policy": "hierarchical", "num_layers": 1,
      "num_experts": 4, "num_slots": 4, "num_groups": 1, "num_nodes": 1, "num_gpus": 2, "max_replicas": 1,
      "phy2log": [[0, 1, 2, 3]], "replica_count": [[1, 1, 1, 1]], "log2phy": [[[0], [1], [2], [3]]]})");
  auto with = [&](const std::string& key, const json& v) {
    json j = good;
    j[key] = v;
    return write_file(dir / "p.json", j.dump());
  };
  std::string p = with("format", "moekit-placement");
  EXPECT_EQ(read_placement(p).num_slots, 4);
  p = with("format", "moekit-trace");
  expect_error([&] { read_placement(p); }, {p, "field 'format' = \"moekit-trace\" must be \"moekit-placement\""});
  p = with("format", 3);
  expect_error([&] { read_placement(p); }, {p, "field 'format' = 3 must be a string"});
  p = with("num_slots", 8);
  expect_error([&] { read_placement(p); }, {p, "field 'num_slots' = 8 does not match the data: phy2log layer 0 holds 4"});
  p = with("num_layers", 2);
  expect_error([&] { read_placement(p); }, {p, "field 'num_layers' = 2 does not match the data: phy2log holds 1"});
  p = with("max_replicas", 1000000000);
  expect_error([&] { read_placement(p); },
               {p, "field 'max_replicas' = 1000000000 does not match the data", "the most replicated expert of phy2log has 1"});
  p = with("max_replicas", 0);
  expect_error([&] { read_placement(p); }, {p, "field 'max_replicas' = 0 does not match the data"});
  // Wider than the most replicated expert: log2phy's rows padded with -1 (a spliced placement).
  EXPECT_EQ(read_placement(with("max_replicas", 3)).num_slots, 4);
  p = with("replica_count", json::parse("[[9, 9, 9, 9]]"));
  expect_error([&] { read_placement(p); },
               {p, "field 'replica_count' layer 0 = [9,9,9,9] does not match phy2log, which gives [1,1,1,1]"});
  p = with("replica_count", json::parse("[[1, 1, 1, 1], [1, 1, 1, 1]]"));
  expect_error([&] { read_placement(p); }, {p, "field 'replica_count' holds 2 layers, phy2log 1"});
  p = with("policy", "global");
  expect_error([&] { read_placement(p); }, {p, "field 'policy' = \"global\"", "give the hierarchical policy"});
  p = with("num_slots", -1);
  expect_error([&] { read_placement(p); }, {p, "field 'num_slots' = -1 must be >= 0"});
  // Each is optional: a placement written by hand may give phy2log alone.
  json bare = good;
  for (const char* key : {"format", "policy", "num_layers", "num_slots", "max_replicas", "replica_count", "log2phy"})
    bare.erase(key);
  EXPECT_EQ(read_placement(write_file(dir / "bare.json", bare.dump())).num_slots, 4);
}
