#include "daemon/common/stats.h"

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("Median takes the middle value, or the mean of the middle two", "[common]") {
  CHECK(Median({}) == 0);
  CHECK(Median({3.0}) == 3.0);
  CHECK(Median({5.0, 1.0, 3.0}) == 3.0);
  CHECK(Median({4.0, 1.0, 3.0, 2.0}) == 2.5);
}

}  // namespace
}  // namespace rannc
