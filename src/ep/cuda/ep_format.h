// Internal to src/ep/cuda: "{}" message formatting for the host code in .cu files. fmt 9 does not
// compile under nvcc in C++20 (its constexpr paths), so these files use this small stand-in:
// each "{}" takes the next argument through operator<<; "{:.Nf}" prints N decimals.
#pragma once

#include <iomanip>
#include <sstream>
#include <string>

namespace moekit::gpu {

namespace detail {
inline void format_to(std::ostringstream& os, const char* f) { os << f; }
template <class T, class... Rest>
void format_to(std::ostringstream& os, const char* f, const T& value, const Rest&... rest) {
  for (; *f; ++f) {
    if (f[0] == '{' && f[1] == '}') {
      os << value;
      return format_to(os, f + 2, rest...);
    }
    if (f[0] == '{' && f[1] == ':' && f[2] == '.' && f[4] == 'f' && f[5] == '}') {
      os << std::fixed << std::setprecision(f[3] - '0') << value << std::defaultfloat;
      return format_to(os, f + 6, rest...);
    }
    os << *f;
  }
}
}  // namespace detail

template <class... Args>
std::string fmtr(const char* format, const Args&... args) {
  std::ostringstream os;
  detail::format_to(os, format, args...);
  return os.str();
}

}  // namespace moekit::gpu
