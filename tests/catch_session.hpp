// SPDX-License-Identifier: Apache-2.0
// Catch2's session, compiled once per build (tests/catch_session.cpp, without optimization:
// it is Catch's own code, not the library's, and at -O3 it took a minute of every stage's
// compile, once for each test that brings its own main). A test with its own main (one that
// skips, mounts or forks first) includes <catch2/catch.hpp> without CATCH_CONFIG_RUNNER and
// calls run_catch; the others link tests/catch_main.cpp's main, which calls it too.
#pragma once

namespace tierstate::test {

/// Catch::Session().run(argc, argv): the test cases of this executable, with its arguments.
int run_catch(int argc, char** argv);

}  // namespace tierstate::test
