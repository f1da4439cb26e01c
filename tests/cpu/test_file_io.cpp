// Files moekit reads and writes (src/io/file_io.h): every reader refuses a FIFO, a directory and a
// symlink loop with the path and what it is, without blocking; every output goes through
// "<path>.tmp" and a rename, so an unfinished write leaves the previous file as it was.
#include "io/file_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>

#include "expect_error.h"
#include "moekit/eplb.h"
#include "moekit/safetensors.h"
#include "moekit/spec.h"
#include "moekit/trace.h"

namespace fs = std::filesystem;
using namespace moekit;

namespace {

fs::path test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(MOEKIT_BINARY_DIR) / "test_tmp" / "file_io" / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

fs::path make_fifo(const fs::path& p) {
  EXPECT_EQ(::mkfifo(p.c_str(), 0644), 0) << p;
  return p;
}

// Runs `fn` and fails the test if it has not returned within 10 seconds. A call blocked opening
// a FIFO for reading is released by opening the FIFO's write end.
void finishes_without_blocking(const std::function<void()>& fn, const fs::path& fifo = {}) {
  auto done = std::async(std::launch::async, fn);
  if (done.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
    ADD_FAILURE() << "blocked for 10 s (on the FIFO " << fifo << ")";
    if (!fifo.empty()) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
  }
  done.get();
}

// `read` must throw an Error holding every fragment, without blocking.
void expect_error_without_blocking(const std::function<void()>& read, std::initializer_list<std::string> fragments,
                                   const fs::path& fifo = {}) {
  finishes_without_blocking([&] { expect_error(read, fragments); }, fifo);
}

}  // namespace

// Item: a FIFO as an input hangs forever; a directory gives "basic_filebuf::underflow".
TEST(ReadRegularFile, EveryReaderRefusesWhatIsNotARegularFile) {
  const fs::path dir = test_dir();
  const fs::path fifo = make_fifo(dir / "fifo.json");
  fs::create_directories(dir / "a_dir.json");
  fs::create_symlink("loop_b.json", dir / "loop_a.json");
  fs::create_symlink("loop_a.json", dir / "loop_b.json");
  const std::string f = fifo.string(), d = (dir / "a_dir.json").string(), loop = (dir / "loop_a.json").string();

  const std::vector<std::pair<std::string, std::function<void(const std::string&)>>> readers = {
      {"spec file", [](const std::string& p) { load_model_spec(p); }},
      {"spec file", [](const std::string& p) { load_gpu_spec(p); }},
      {"trace file", [](const std::string& p) { read_trace(p); }},
      {"load file", [](const std::string& p) { read_loads(p); }},
      {"placement file", [](const std::string& p) { read_placement(p); }},
      {"safetensors file", [](const std::string& p) { SafetensorsFile::open(p); }},
  };
  for (const auto& [what, read] : readers) {
    SCOPED_TRACE(what);
    expect_error_without_blocking([&] { read(f); }, {"cannot open " + what + " '" + f + "'", "is a FIFO (named pipe), not a regular file"}, fifo);
    expect_error_without_blocking([&] { read(d); }, {"cannot open " + what + " '" + d + "'", "is a directory, not a regular file"});
    expect_error_without_blocking([&] { read(loop); }, {"'" + loop + "'", "symlink loop"});
  }
  expect_error([&] { read_trace((dir / "none.json").string()); }, {"cannot open trace file", "no such file or directory"});
  expect_error([&] { read_regular_file("/dev/null", "load file"); }, {"'/dev/null'", "is a character device, not a regular file"});
  if (::geteuid() != 0) {  // root reads anything
    write_file(dir / "secret.json", "{}");
    fs::permissions(dir / "secret.json", fs::perms::none);
    expect_error([&] { read_trace((dir / "secret.json").string()); }, {"secret.json", "permission denied"});
  }
  // A regular file through a symlink is fine.
  write_file(dir / "real.json", "abc");
  fs::create_symlink("real.json", dir / "link.json");
  EXPECT_EQ(read_regular_file((dir / "link.json").string(), "test file"), "abc");
}

// Item: index.json naming a FIFO hangs when the tensor is first read; a directory or a symlink
// loop as the checkpoint or its index says what it is.
TEST(ReadRegularFile, CheckpointsRefuseFifosDirectoriesAndLoops) {
  const fs::path dir = test_dir();
  const std::vector<uint8_t> a = {1, 2, 3, 4};
  write_safetensors((dir / "x.safetensors").string(), std::vector<TensorData>{{{"a", Dtype::kU8, {4}}, a}});
  const fs::path fifo = make_fifo(dir / "fifo.safetensors");
  write_file(dir / kIndexFileName, R"({"weight_map": {"a": "x.safetensors", "b": "fifo.safetensors"}})");
  const Checkpoint c = Checkpoint::open(dir.string());
  EXPECT_EQ(c.info("a").num_bytes(), 4u);
  expect_error_without_blocking([&] { c.info("b"); }, {fifo.string(), "is a FIFO (named pipe), not a regular file"}, fifo);
  // The FIFO given directly, and a FIFO among the files of a directory without an index.
  expect_error_without_blocking([&] { Checkpoint::open(fifo.string()); }, {fifo.string(), "is a FIFO"}, fifo);
  fs::remove(dir / kIndexFileName);
  expect_error_without_blocking([&] { Checkpoint::open(dir.string()); }, {fifo.string(), "is a FIFO"}, fifo);
  fs::remove(fifo);

  // The index as a directory, a FIFO, a symlink loop.
  fs::create_directories(dir / kIndexFileName);
  expect_error([&] { Checkpoint::open(dir.string()); }, {"cannot open checkpoint index", kIndexFileName.data(), "is a directory"});
  fs::remove(dir / kIndexFileName);
  const fs::path index_fifo = make_fifo(dir / kIndexFileName);
  expect_error_without_blocking([&] { Checkpoint::open(dir.string()); }, {"cannot open checkpoint index", "is a FIFO"}, index_fifo);
  fs::remove(index_fifo);
  fs::create_symlink(kIndexFileName, dir / kIndexFileName);
  expect_error([&] { Checkpoint::open(dir.string()); }, {"cannot open checkpoint index", "symlink loop"});
  fs::remove(dir / kIndexFileName);
  // The checkpoint path itself a symlink loop: not "no such file or directory".
  fs::create_symlink("loop", dir / "loop");
  expect_error([&] { Checkpoint::open((dir / "loop").string()); }, {"cannot open checkpoint", "symlink loop"});
}

// Item: outputs were truncated and written in place.
TEST(OutputFile, TheOldFileStaysUntilTheNewOneIsComplete) {
  const fs::path dir = test_dir();
  const fs::path p = dir / "out.json";
  write_file(p, "old");
  {
    OutputFile out(p.string(), "test output");
    out.write(std::string_view("new, but never finished"));
    EXPECT_EQ(read_file(p), "old");
    EXPECT_TRUE(fs::exists(dir / "out.json.tmp"));
  }  // an exception, say, before commit()
  EXPECT_EQ(read_file(p), "old");
  EXPECT_FALSE(fs::exists(dir / "out.json.tmp"));
  write_file_atomically(p.string(), "new", "test output");
  EXPECT_EQ(read_file(p), "new");
  EXPECT_FALSE(fs::exists(dir / "out.json.tmp"));

  // A stale .tmp is replaced, never written through: a symlink to another file, a FIFO.
  write_file(dir / "victim", "victim");
  fs::create_symlink("victim", dir / "out.json.tmp");
  write_file_atomically(p.string(), "newer", "test output");
  EXPECT_EQ(read_file(p), "newer");
  EXPECT_EQ(read_file(dir / "victim"), "victim");
  make_fifo(dir / "out.json.tmp");
  finishes_without_blocking([&] { write_file_atomically(p.string(), "newest", "test output"); });
  EXPECT_EQ(read_file(p), "newest");

  // A write that cannot start names the output.
  expect_error([&] { write_file_atomically((dir / "no" / "such" / "dir.json").string(), "x", "placement file"); },
               {"cannot write placement file", "dir.json", "the folder", "does not exist"});
}

TEST(OutputFile, WritesThroughSymlinksAndRefusesWhatIsNoFile) {
  // The final rename replaces whatever <path> is: a symlink would lose its target's update, and a
  // device node (as root: /dev/null) or a FIFO would be replaced by a regular file.
  const fs::path dir = test_dir();
  write_file(dir / "target.json", "old");
  fs::create_symlink("target.json", dir / "link.json");
  fs::create_symlink(dir / "link.json", dir / "link2.json");  // a chain, absolute
  write_file_atomically((dir / "link2.json").string(), "new", "placement file");
  EXPECT_TRUE(fs::is_symlink(dir / "link.json"));
  EXPECT_TRUE(fs::is_symlink(dir / "link2.json"));
  EXPECT_EQ(read_file(dir / "target.json"), "new");
  fs::create_symlink("missing.json", dir / "dangling.json");  // a link to a new file: the file is made
  write_file_atomically((dir / "dangling.json").string(), "made", "placement file");
  EXPECT_TRUE(fs::is_symlink(dir / "dangling.json"));
  EXPECT_EQ(read_file(dir / "missing.json"), "made");

  make_fifo(dir / "fifo.json");
  fs::create_directory(dir / "folder.json");
  fs::create_symlink("fifo.json", dir / "to-fifo.json");
  expect_error([&] { write_file_atomically((dir / "fifo.json").string(), "x", "placement file"); },
               {"cannot write placement file", "fifo.json", "is a FIFO"});
  expect_error([&] { write_file_atomically((dir / "folder.json").string(), "x", "placement file"); },
               {"folder.json", "is a directory"});
  expect_error([&] { write_file_atomically((dir / "to-fifo.json").string(), "x", "placement file"); },
               {"to-fifo.json", "(a link to", "is a FIFO"});
  EXPECT_TRUE(fs::is_fifo(dir / "fifo.json"));
  EXPECT_FALSE(fs::exists(dir / "fifo.json.tmp"));
  fs::create_symlink("loop.json", dir / "loop.json");
  expect_error([&] { write_file_atomically((dir / "loop.json").string(), "x", "placement file"); },
               {"loop.json", "symlink loop"});
  expect_error([&] { write_file_atomically("", "x", "placement file"); }, {"the path is empty"});

  // same_file: one file under two names, not two files, not a missing one.
  EXPECT_TRUE(same_file((dir / "target.json").string(), (dir / "link.json").string()));
  EXPECT_FALSE(same_file((dir / "target.json").string(), (dir / "missing.json").string()));
  EXPECT_FALSE(same_file((dir / "target.json").string(), (dir / "nothing.json").string()));
  EXPECT_FALSE(same_file("", ""));
}

TEST(OutputFile, TracesAreWrittenThroughATemporaryFile) {
  const fs::path dir = test_dir();
  const fs::path p = dir / "trace.json";
  RoutingTrace t;
  t.num_experts = 4;
  t.topk = 2;
  t.num_ranks = 1;
  t.layers = {{{0, 1, 2, 3}}};
  write_file(p, "old");
  fs::create_hard_link(p, dir / "same_inode.json");  // a write in place would change this one too
  write_trace(t, p.string());
  EXPECT_EQ(read_file(dir / "same_inode.json"), "old");
  const RoutingTrace back = read_trace(p.string());
  EXPECT_EQ(back.layers, t.layers);
  EXPECT_FALSE(fs::exists(dir / "trace.json.tmp"));
}

TEST(InterruptCleanup, RemovesWhatIsRegisteredAndOnlyThat) {
  const fs::path dir = test_dir();
  fs::create_directories(dir / "tmpdir" / "sub");
  write_file(dir / "tmpdir" / "sub" / "a", "x");
  write_file(dir / "keep", "x");
  {
    InterruptCleanup guard((dir / "tmpdir").string());
    OutputFile out((dir / "out").string(), "test output");
    remove_interrupt_paths();
    EXPECT_FALSE(fs::exists(dir / "tmpdir"));
    EXPECT_FALSE(fs::exists(dir / "out.tmp"));
    EXPECT_TRUE(fs::exists(dir / "keep"));
  }
  fs::create_directories(dir / "tmpdir");
  remove_interrupt_paths();  // unregistered when the guard went
  EXPECT_TRUE(fs::exists(dir / "tmpdir"));
}
