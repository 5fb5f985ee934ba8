#include "daemon/runtime/micro_batch.h"

#include <numeric>

#include <catch2/catch.hpp>

namespace rannc {
namespace {

TEST_CASE("SplitSizes shards a batch evenly, larger shards first", "[runtime]") {
  CHECK(SplitSizes(10, 4) == std::vector<int64_t>{3, 3, 2, 2});
  CHECK(SplitSizes(8, 2) == std::vector<int64_t>{4, 4});
  CHECK(SplitSizes(2, 3) == std::vector<int64_t>{1, 1, 0});
  CHECK(SplitSizes(5, 1) == std::vector<int64_t>{5});
  CHECK(SplitSizes(5, 0).empty());
  CHECK(Offsets({3, 3, 2, 2}) == std::vector<int64_t>{0, 3, 6, 8});
}

TEST_CASE("Reshard moves every sample once, to where the next stage's replica expects it",
          "[runtime]") {
  CHECK(Reshard({4, 4}, {3, 3, 2}) ==
        std::vector<Transfer>{{0, 0, 0, 0, 3}, {0, 1, 3, 0, 1}, {1, 1, 0, 1, 2}, {1, 2, 2, 0, 2}});
  CHECK(Reshard({5}, {5}) == std::vector<Transfer>{{0, 0, 0, 0, 5}});
  CHECK(Reshard({2, 2}, {4}) == std::vector<Transfer>{{0, 0, 0, 0, 2}, {1, 0, 0, 2, 2}});
  // Exhaustively: each destination sample comes from the same global position.
  for (int64_t total = 0; total <= 13; ++total) {
    for (int a = 1; a <= 5; ++a) {
      for (int b = 1; b <= 5; ++b) {
        std::vector<int64_t> src = SplitSizes(total, a), dst = SplitSizes(total, b);
        std::vector<int64_t> src_at = Offsets(src), dst_at = Offsets(dst);
        std::vector<int> filled(total, 0);
        for (const Transfer& t : Reshard(src, dst)) {
          REQUIRE(t.count > 0);
          REQUIRE(t.src_offset + t.count <= src[t.src]);
          REQUIRE(t.dst_offset + t.count <= dst[t.dst]);
          REQUIRE(src_at[t.src] + t.src_offset == dst_at[t.dst] + t.dst_offset);
          for (int64_t i = 0; i < t.count; ++i) ++filled[dst_at[t.dst] + t.dst_offset + i];
        }
        for (int64_t i = 0; i < total; ++i) CHECK(filled[i] == 1);
      }
    }
  }
}

}  // namespace
}  // namespace rannc
