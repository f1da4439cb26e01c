// How moekit opens the files it reads and writes the files it produces (internal header).
//
// Reading: every input (checkpoint shards, model.safetensors.index.json, specs, traces, loads,
// placements) is opened with open_regular_file, which opens without blocking (O_NONBLOCK, so a
// FIFO cannot hang the open) and then checks the open descriptor with fstat (so the file that is
// checked is the file that is read: no window between a stat and an open). Anything but a
// regular file is refused with a message that names the path and says what it is:
//   cannot open trace file 'runs/t': is a directory, not a regular file
//   cannot open safetensors file 'w/a.safetensors': is a FIFO (named pipe), not a regular file
//   cannot open spec file 'm.json': too many levels of symbolic links (a symlink loop)
//
// Writing: every output (placements, traces, plot data, checkpoint shards and indexes) goes
// through OutputFile, which writes "<path>.tmp" and renames it over <path> only once complete
// and flushed to disk (fsync of the file, then of its directory). An interrupted write leaves
// the previous <path> untouched and at most a stale "<path>.tmp", never a truncated <path>.
// A stale "<path>.tmp" (or a symlink or FIFO of that name) is removed and created afresh. A
// <path> that is a symlink is written through (the file it names is replaced, not the link);
// one that is, or leads to, anything but a regular file is refused before anything is written.
//
// Interrupts: paths registered with InterruptCleanup (temporary checkpoint directories, the
// ".tmp" files being written) are removed by remove_interrupt_paths(), which the command line
// calls when SIGINT or SIGTERM arrives (src/cli/interrupt.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>

namespace moekit {

// An open descriptor of a regular file, closed by the destructor.
class ReadFd {
 public:
  ReadFd(int fd, uint64_t size) : fd_(fd), size_(size) {}
  ReadFd(const ReadFd&) = delete;
  ReadFd& operator=(const ReadFd&) = delete;
  ~ReadFd();
  int get() const { return fd_; }
  uint64_t size() const { return size_; }  // st_size when opened

 private:
  int fd_;
  uint64_t size_;
};

// Opens `path` for reading if it is a regular file; otherwise an Error
// "cannot open {what} '{path}': {reason}" (what: "trace file", "safetensors file", ...).
ReadFd open_regular_file(const std::string& path, std::string_view what);

// The whole content of a regular file (see open_regular_file for the errors).
std::string read_regular_file(const std::string& path, std::string_view what);

// True when `path` is a directory, false when it is a regular file; anything else (missing,
// a FIFO, a symlink loop, no permission) is an Error "cannot open {what} '{path}': {reason}".
bool is_directory_or_regular_file(const std::string& path, std::string_view what);

// The file an output to `path` writes: `path` itself, or where its symlinks lead. An Error
// "cannot write {what} '{path}': ..." when that is not a regular file (a directory, a device, a
// FIFO, a socket: the final rename would replace it) or, for a new file, when its folder does not
// exist. Commands call it before any work, so that a bad output path costs nothing; OutputFile
// calls it again.
std::string resolve_output_path(const std::string& path, std::string_view what);

// True when both paths exist and name the same file (after symlinks): an output that would
// replace one of the command's own inputs.
bool same_file(const std::string& a, const std::string& b);

// Writes <path>.tmp; commit() moves it over <path>, where `path` is resolve_output_path's.
// Destroyed uncommitted, the .tmp is removed.
class OutputFile {
 public:
  OutputFile(std::string path, std::string_view what);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  void write(std::string_view bytes);
  void write(std::span<const uint8_t> bytes) { write(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())); }
  // Flushes, fsyncs, renames <path>.tmp to <path> and fsyncs the directory.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_path_; }

 private:
  std::string path_, tmp_path_, what_;
  std::FILE* file_ = nullptr;
};

// One call for a small output: OutputFile, write, commit.
void write_file_atomically(const std::string& path, std::string_view content, std::string_view what);

// Makes a directory's entries (a rename, an unlink) durable; errors are ignored (best effort).
void sync_directory(const std::string& dir);

// Paths removed (recursively) when the process is interrupted; the guard unregisters on destruction.
class InterruptCleanup {
 public:
  explicit InterruptCleanup(std::string path);
  InterruptCleanup(const InterruptCleanup&) = delete;
  InterruptCleanup& operator=(const InterruptCleanup&) = delete;
  ~InterruptCleanup();

 private:
  std::string path_;
};

// Removes every registered path. Called from an ordinary thread (never a signal handler).
void remove_interrupt_paths();

}  // namespace moekit
