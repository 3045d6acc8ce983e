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

TEST_CASE("error: a NUL byte in the message is written as \\x00, so what() is not cut there") {
  const fn::Error e(fn::ErrorKind::Format, std::string("token 'a\0b' is bad", 18));
  CHECK(std::string(e.what()) == "token 'a\\x00b' is bad");
  CHECK(std::string(fn::Error(fn::ErrorKind::Io, "plain").what()) == "plain");
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

TEST_CASE("log: escape_for_log keeps valid UTF-8, tab and newline, and escapes every other byte") {
  using fn::escape_for_log;
  CHECK(escape_for_log("plain ascii\tand\nlines") == "plain ascii\tand\nlines");
  CHECK(escape_for_log("caf\xC3\xA9 \xE4\xB8\xAD \xF0\x9F\x98\x80") ==
        "caf\xC3\xA9 \xE4\xB8\xAD \xF0\x9F\x98\x80");  // 2-, 3- and 4-byte sequences
  CHECK(escape_for_log("last read: '\x98'") == "last read: '\\x98'");      // a lone continuation
  CHECK(escape_for_log("\x1B[31mred\x7F\r") == "\\x1B[31mred\\x7F\\x0D");  // controls, DEL, CR
  CHECK(escape_for_log("\xC0\xAF") == "\\xC0\\xAF");                       // overlong '/'
  CHECK(escape_for_log("\xED\xA0\x80") == "\\xED\\xA0\\x80");              // a surrogate
  CHECK(escape_for_log("\xF4\x90\x80\x80") == "\\xF4\\x90\\x80\\x80");     // past U+10FFFF
  CHECK(escape_for_log("\xE4\xB8") == "\\xE4\\xB8");                       // truncated at the end
  CHECK(escape_for_log(std::string_view("a\0b", 3)) == "a\\x00b");
}
