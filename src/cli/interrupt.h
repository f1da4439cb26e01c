// SIGINT and SIGTERM remove what the command was writing (io/file_io.h's InterruptCleanup paths:
// `moekit run`'s temporary checkpoint, the "<path>.tmp" of an output), then end the process by
// the same signal, so the shell sees the usual "killed by SIGINT/SIGTERM" status.
//
// The handler itself only writes the signal number to a pipe (write(2) is async-signal-safe); a
// thread started here reads it and does the removal as ordinary code, free to allocate and to use
// std::filesystem, which a signal handler may not. A signal ignored when moekit starts (a
// background job of a non-interactive shell, nohup) stays ignored.
#pragma once

namespace moekit::cli {

// Installs the handlers and starts the cleanup thread; call once, first thing in main().
void start_interrupt_cleanup();

// After SIGINT/SIGTERM, waits for the cleanup thread to end the process (it does not return), so
// that an error caused by the removal (a file vanishing under the command) is not reported and
// the exit status stays the signal's. Returns at once when no signal came.
void wait_if_interrupted();

}  // namespace moekit::cli
