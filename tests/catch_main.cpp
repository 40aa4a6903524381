// SPDX-License-Identifier: Apache-2.0
// The main of every Catch2 test that needs no main of its own (see catch_session.hpp).
#include "catch_session.hpp"

int main(int argc, char** argv) { return tierstate::test::run_catch(argc, argv); }
