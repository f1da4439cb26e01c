// Reading regular files only, writing through "<path>.tmp" and a rename (see file_io.h).
#include "io/file_io.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <new>
#include <vector>

#include "moekit/check.h"

namespace moekit {
namespace {

// Why a path cannot be read, in words (errno from open or stat).
std::string open_error(int err) {
  switch (err) {
    case ENOENT: return "no such file or directory";
    case ELOOP: return "too many levels of symbolic links (a symlink loop)";
    case EACCES: return "permission denied";
    case ENOTDIR: return "a component of the path is not a directory";
    case ENAMETOOLONG: return "the path is too long";
    case ENXIO: return "a socket or a device without a reader, not a regular file";
    default: return std::strerror(err);
  }
}

// What a path is when it is not a regular file.
std::string kind_error(mode_t mode) {
  if (S_ISDIR(mode)) return "is a directory, not a regular file";
  if (S_ISFIFO(mode)) return "is a FIFO (named pipe), not a regular file";
  if (S_ISSOCK(mode)) return "is a socket, not a regular file";
  if (S_ISCHR(mode)) return "is a character device, not a regular file";
  if (S_ISBLK(mode)) return "is a block device, not a regular file";
  return "is not a regular file";
}

std::mutex& cleanup_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& cleanup_paths() {
  static std::vector<std::string> paths;
  return paths;
}
void add_cleanup_path(const std::string& path) {
  std::lock_guard lock(cleanup_mutex());
  cleanup_paths().push_back(path);
}
void drop_cleanup_path(const std::string& path) {
  std::lock_guard lock(cleanup_mutex());
  auto& paths = cleanup_paths();
  if (auto it = std::find(paths.begin(), paths.end(), path); it != paths.end()) paths.erase(it);
}

}  // namespace

// ---- reading ----------------------------------------------------------------------------------

ReadFd::~ReadFd() {
  if (fd_ >= 0) ::close(fd_);
}

ReadFd open_regular_file(const std::string& path, std::string_view what) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw Error(fmt::format("cannot open {} '{}': {}", what, path, open_error(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(fmt::format("cannot open {} '{}': {}", what, path, open_error(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("cannot open {} '{}': {}", what, path, kind_error(st.st_mode)));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // plain blocking reads from here on
  return ReadFd(fd, uint64_t(st.st_size));
}

std::string read_regular_file(const std::string& path, std::string_view what) {
  const ReadFd fd = open_regular_file(path, what);
  std::string text;
  try {
    text.reserve(size_t(fd.size()));
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd.get(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(fmt::format("reading {} '{}' failed: {}", what, path, std::strerror(errno)));
      if (n == 0) break;
      text.append(buf, size_t(n));
    }
  } catch (const std::bad_alloc&) {  // a message that names the file, not "std::bad_alloc"
    throw Error(fmt::format("reading {} '{}' ({:.2f} GB) ran out of memory", what, path, double(fd.size()) / 1e9));
  }
  return text;
}

bool is_directory_or_regular_file(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(fmt::format("cannot open {} '{}': {}", what, path, open_error(errno)));
  if (S_ISDIR(st.st_mode)) return true;
  if (S_ISREG(st.st_mode)) return false;
  throw Error(fmt::format("cannot open {} '{}': {}", what, path, kind_error(st.st_mode)));
}

// ---- writing ----------------------------------------------------------------------------------

std::string resolve_output_path(const std::string& path, std::string_view what) {
  MOEKIT_CHECK(!path.empty(), fmt::format("cannot write {}: the path is empty", what));
  namespace fs = std::filesystem;
  // Follow symlinks to the file they name (at most 40, the kernel's own limit): the rename would
  // replace the link itself.
  std::string target = path;
  struct stat st {};
  for (int hops = 0;; ++hops) {
    if (::lstat(target.c_str(), &st) != 0) {
      if (errno != ENOENT) throw Error(fmt::format("cannot write {} '{}': {}", what, path, open_error(errno)));
      // A new file: its folder must exist.
      const fs::path parent = fs::path(target).parent_path();
      struct stat dir {};
      const std::string shown = parent.empty() ? "." : parent.string();
      if (::stat(shown.c_str(), &dir) != 0)
        throw Error(errno == ENOENT
                        ? fmt::format("cannot write {} '{}': the folder '{}' does not exist", what, path, shown)
                        : fmt::format("cannot write {} '{}': its folder '{}': {}", what, path, shown, open_error(errno)));
      if (!S_ISDIR(dir.st_mode))
        throw Error(fmt::format("cannot write {} '{}': '{}' is not a folder", what, path, shown));
      return target;
    }
    if (!S_ISLNK(st.st_mode)) break;
    if (hops == 40) throw Error(fmt::format("cannot write {} '{}': {}", what, path, open_error(ELOOP)));
    std::error_code ec;
    const fs::path link = fs::read_symlink(target, ec);
    if (ec) throw Error(fmt::format("cannot write {} '{}': reading the link '{}': {}", what, path, target, ec.message()));
    target = (link.is_absolute() ? link : fs::path(target).parent_path() / link).string();
  }
  // Rename over a device, a FIFO or a socket would replace the node (as root: /dev/null), and over
  // a directory it fails only after the work is done.
  if (!S_ISREG(st.st_mode)) {
    const std::string shown = target == path ? "" : fmt::format(" (a link to '{}')", target);
    throw Error(fmt::format("cannot write {} '{}'{}: {}", what, path, shown, kind_error(st.st_mode)));
  }
  return target;
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return !a.empty() && !b.empty() && ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

OutputFile::OutputFile(std::string path, std::string_view what)
    : path_(resolve_output_path(path, what)), tmp_path_(path_ + ".tmp"), what_(what) {
  // A stale .tmp from an interrupted run (or a FIFO or symlink put there) is replaced, never
  // written through: unlink, then create exclusively.
  if (::unlink(tmp_path_.c_str()) != 0 && errno != ENOENT)
    throw Error(fmt::format("cannot write {} '{}': cannot remove the stale '{}': {}", what_, path_, tmp_path_,
                            std::strerror(errno)));
  const int fd = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0)
    throw Error(fmt::format("cannot write {} '{}': cannot create '{}': {}", what_, path_, tmp_path_, open_error(errno)));
  file_ = ::fdopen(fd, "wb");
  if (!file_) {
    ::close(fd);
    ::unlink(tmp_path_.c_str());
    throw Error(fmt::format("cannot write {} '{}': {}", what_, path_, std::strerror(errno)));
  }
  add_cleanup_path(tmp_path_);
}

OutputFile::~OutputFile() {
  if (file_) {
    std::fclose(file_);
    ::unlink(tmp_path_.c_str());
  }
  drop_cleanup_path(tmp_path_);
}

void OutputFile::write(std::string_view bytes) {
  MOEKIT_CHECK(file_, fmt::format("{} '{}': written after commit", what_, path_));
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    throw Error(fmt::format("writing {} '{}' failed: {}", what_, tmp_path_, std::strerror(errno)));
}

void OutputFile::commit() {
  MOEKIT_CHECK(file_, fmt::format("{} '{}': committed twice", what_, path_));
  const bool flushed = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  const int err = errno;
  std::fclose(file_);
  file_ = nullptr;
  if (!flushed) {
    ::unlink(tmp_path_.c_str());
    throw Error(fmt::format("writing {} '{}' failed: {}", what_, tmp_path_, std::strerror(err)));
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp_path_.c_str());
    throw Error(fmt::format("cannot write {} '{}': renaming '{}' over it failed: {}", what_, path_, tmp_path_,
                            std::strerror(rename_err)));
  }
  sync_directory(std::filesystem::path(path_).parent_path().string());
}

void write_file_atomically(const std::string& path, std::string_view content, std::string_view what) {
  OutputFile out(path, what);
  out.write(content);
  out.commit();
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// ---- interrupts -------------------------------------------------------------------------------

InterruptCleanup::InterruptCleanup(std::string path) : path_(std::move(path)) { add_cleanup_path(path_); }

InterruptCleanup::~InterruptCleanup() { drop_cleanup_path(path_); }

void remove_interrupt_paths() {
  std::vector<std::string> paths;
  {
    std::lock_guard lock(cleanup_mutex());
    paths = cleanup_paths();
  }
  for (const auto& p : paths) {
    // Other threads may still be creating files in a directory being removed: retry a few times.
    for (int attempt = 0; attempt < 5; ++attempt) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
      if (!ec) break;
    }
  }
}

}  // namespace moekit
