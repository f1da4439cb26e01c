// Cleanup on SIGINT/SIGTERM through a pipe and a thread (see cli/interrupt.h).
#include "cli/interrupt.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <thread>

#include "io/file_io.h"

namespace moekit::cli {
namespace {

int g_pipe[2] = {-1, -1};
std::atomic<bool> g_interrupted{false};  // lock-free, so safe to set in a handler

extern "C" void on_interrupt(int sig) {
  g_interrupted.store(true);
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_pipe[1], &b, 1);
  errno = saved;
}

void restore_default(int sig) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(sig, &dfl, nullptr);
}

void cleanup_thread() {
  unsigned char sig = 0;
  for (;;) {
    const ssize_t n = ::read(g_pipe[0], &sig, 1);
    if (n == 1) break;
    if (n < 0 && errno == EINTR) continue;
    restore_default(SIGINT);  // the pipe broke: no cleanup, but the signals still end moekit
    restore_default(SIGTERM);
    return;
  }
  remove_interrupt_paths();
  // Die of the signal itself: default action, raised in this thread.
  restore_default(sig);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  ::_exit(128 + sig);  // not reached
}

}  // namespace

void start_interrupt_cleanup() {
  if (::pipe2(g_pipe, O_CLOEXEC) != 0) return;  // no cleanup, but moekit still runs
  std::thread(cleanup_thread).detach();
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
  }
}

void wait_if_interrupted() {
  if (!g_interrupted.load()) return;
  for (;;) ::pause();  // the cleanup thread ends the process
}

}  // namespace moekit::cli
