// SPDX-License-Identifier: Apache-2.0
// The headers in C++17 mode: one sentence that says what to do, and the compiler stops there
// (it printed 1,181 lines of errors about std::span and concepts before the check).
// expect: tierstate needs C++20: compile with -std=c++20 or later
// flags: -std=c++17
// max-lines: 12
#include <tierstate/tierstate.hpp>
