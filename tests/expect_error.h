// The tests' check for bad input: the call must throw moekit::Error, and its message must
// contain every fragment (the bad value, the expectation), so a user could fix the call from it.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "moekit/check.h"

template <class F>
void expect_error(F&& f, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const moekit::Error& e) {
    const std::string msg = e.what();
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "'" << frag << "' not in: " << msg;
  }
}
