#include <doctest/doctest.h>

#include "core/error.h"
#include "core/log.h"

TEST_CASE("error: FN_REQUIRE throws the given kind with the message and its location") {
  try {
    FN_REQUIRE(1 + 1 == 3, Format, "tensor '{}' has {} dims", "x.weight", 3);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Format);
    CHECK(std::string(e.what()) == "tensor 'x.weight' has 3 dims");
    CHECK(e.where().find("test_error.cpp:") != std::string::npos);
  }
}

TEST_CASE("error: FN_CHECK raises an internal error naming the failed condition") {
  try {
    int n = 2;
    FN_CHECK(n == 1, "n is {}", n);
    FAIL("no throw");
  } catch (const fn::Error& e) {
    CHECK(e.kind() == fn::ErrorKind::Internal);
    CHECK(std::string(e.what()) == "n is 2 [failed: n == 1]");
  }
}

TEST_CASE("error: kinds map to the documented exit codes") {
  CHECK(fn::exit_code(fn::ErrorKind::Usage) == 2);
  CHECK(fn::exit_code(fn::ErrorKind::Io) == 3);
  CHECK(fn::exit_code(fn::ErrorKind::Format) == 3);
  CHECK(fn::exit_code(fn::ErrorKind::Cuda) == 4);
  CHECK(fn::exit_code(fn::ErrorKind::Nccl) == 5);
  CHECK(fn::exit_code(fn::ErrorKind::Mpi) == 5);
  CHECK(fn::exit_code(fn::ErrorKind::Internal) == 1);
}

TEST_CASE("log: levels parse by name and unknown names are usage errors") {
  CHECK(fn::parse_log_level("debug") == fn::LogLevel::Debug);
  CHECK_THROWS_AS(fn::parse_log_level("loud"), fn::Error);
}
