// ProgressLine and format_progress (core/progress.h): the text, the 10 % cadence of plain output
// and the single final line.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "core/progress.h"

namespace {
std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) s += buf;
  return s;
}
int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}
}  // namespace

TEST_CASE("progress: the line shows GB done of total, percent, rate and ETA") {
  CHECK(fn::format_progress("load", 2'000'000'000, 8'000'000'000, 2.0) ==
        "load: 2.00 / 8.00 GB (25 %), 1.00 GB/s, ETA 6 s");
  CHECK(fn::format_progress("load", 8'000'000'000, 8'000'000'000, 4.0) ==
        "load: 8.00 / 8.00 GB (100 %), 2.00 GB/s, done in 4.0 s");
  CHECK(fn::format_progress("load", 0, 8'000'000'000, 0.0) == "load: 0.00 / 8.00 GB (0 %)");
  CHECK(fn::format_progress("load", 0, 0, 0.0) == "load: 0.00 / 0.00 MB (100 %)");
  // Below 1 GB the line counts MB (a tiny model would otherwise read 0.00 / 0.00 GB).
  CHECK(fn::format_progress("load", 1'500'000, 6'000'000, 0.5) ==
        "load: 1.50 / 6.00 MB (25 %), 3.00 MB/s, ETA 2 s");
}

TEST_CASE("progress: plain output writes one line per 10 % and one final line") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f != nullptr);
  {
    fn::ProgressLine p("weights", 1'000'000, true, f, 0);
    for (int i = 0; i < 100; ++i) p.add(10'000);  // 1 % steps
  }
  const std::string s = read_all(f);
  std::fclose(f);
  CHECK(count_lines(s) == 10);  // 10 %, ..., 90 %, then the final 100 % line
  CHECK(s.find("weights: 0.10 / 1.00 MB (10 %)") != std::string::npos);
  CHECK(s.find("(100 %)") != std::string::npos);
}

TEST_CASE("progress: a disabled line (ranks other than 0) writes nothing") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f != nullptr);
  {
    fn::ProgressLine p("weights", 1000, false, f, 0);
    p.add(1000);
    p.finish();
  }
  CHECK(read_all(f).empty());
  std::fclose(f);
}
