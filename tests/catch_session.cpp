// SPDX-License-Identifier: Apache-2.0
// Catch2's implementation, once per build: see catch_session.hpp.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "catch_session.hpp"

int tierstate::test::run_catch(int argc, char** argv) { return Catch::Session().run(argc, argv); }
