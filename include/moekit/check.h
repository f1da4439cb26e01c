// moekit/check.h: how moekit reports bad input.
//
// Every public entry point validates its arguments before it touches any state and throws
// moekit::Error on failure. The message names the file and line of the check, the failing
// expression, and a sentence with the bad value and what was expected, so that a user can
// fix the call without reading moekit's source. Nothing is written or allocated before the
// checks have passed.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moekit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const char* expr, const std::string& msg) {
  std::ostringstream os;
  os << msg << " [" << file << ":" << line << ": " << expr << "]";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace moekit

// MOEKIT_CHECK(cond, msg): throw moekit::Error with msg (a std::string expression) when cond is false.
#define MOEKIT_CHECK(cond, msg)                                          \
  do {                                                                   \
    if (!(cond)) ::moekit::detail::throw_error(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
