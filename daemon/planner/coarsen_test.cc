// Checks that coarsening balances block times, prefers cheap boundaries near the ideal cut
// points, finds layer boundaries in a repeated pattern, and never makes empty blocks.
#include "daemon/planner/coarsen.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

namespace rannc {
namespace planner {
namespace {

// Starts at 0, strictly increasing, all < n, at most `target` blocks.
void CheckWellFormed(const std::vector<int>& starts, int n, int target) {
  REQUIRE(!starts.empty());
  CHECK(starts.front() == 0);
  CHECK(static_cast<int>(starts.size()) <= std::max(1, target));
  for (size_t k = 1; k < starts.size(); ++k) CHECK(starts[k] > starts[k - 1]);
  CHECK(starts.back() < n);
}

TEST_CASE("Uniform nodes are split into equal blocks", "[coarsen]") {
  std::vector<double> ms(100, 1.5), cut(100, 64);
  CHECK(CoarsenToBlocks(ms, cut, 10) ==
        std::vector<int>{0, 10, 20, 30, 40, 50, 60, 70, 80, 90});
  // Ideal points 3.33 and 6.67 nodes: the nearest boundaries win when cuts are equal.
  std::vector<double> ms10(10, 1.0), cut10(10, 5);
  CHECK(CoarsenToBlocks(ms10, cut10, 3) == std::vector<int>{0, 3, 7});
}

TEST_CASE("The cheapest boundary inside the window wins", "[coarsen]") {
  // 20 nodes of 1 ms, target 2: ideal cut before node 10, window nodes 5..15.
  std::vector<double> ms(20, 1.0), cut(20, 100);
  cut[13] = 10;
  cut[18] = 1;  // cheaper, but outside the window
  CHECK(CoarsenToBlocks(ms, cut, 2) == std::vector<int>{0, 13});
  // Equal cheap boundaries equally near the ideal point: the earlier one.
  cut[7] = 10;
  CHECK(CoarsenToBlocks(ms, cut, 2) == std::vector<int>{0, 7});
  // Equal cheap boundaries: the one nearer the ideal point.
  cut[8] = 10;
  CHECK(CoarsenToBlocks(ms, cut, 2) == std::vector<int>{0, 8});
  // The window edges (exactly half a block away) are inside.
  std::vector<double> edge(20, 100);
  edge[15] = 1;
  CHECK(CoarsenToBlocks(ms, edge, 2) == std::vector<int>{0, 15});
}

TEST_CASE("Transformer layers are cut at the residual stream", "[coarsen]") {
  // An embedding node, 4 layers of 10 nodes with uneven times, and an output head. Inside a
  // layer many tensors are live (attention scores, the MLP's hidden state); between layers
  // only the residual stream.
  const std::vector<double> layer_ms = {0.5, 2, 2, 3, 1, 0.5, 4, 4, 0.5, 0.5};
  const std::vector<double> layer_cut = {1, 3, 3, 12, 12, 3, 2, 8, 8, 2};  // before each node
  std::vector<double> ms = {1.0}, cut = {0};
  for (int l = 0; l < 4; ++l) {
    for (int i = 0; i < 10; ++i) {
      ms.push_back(layer_ms[i]);
      cut.push_back(layer_cut[i]);
    }
  }
  ms.push_back(1.5);
  cut.push_back(1);
  const std::vector<int> starts = CoarsenToBlocks(ms, cut, 4);
  // Each block starts with a layer (the embedding joins the first, the head the last).
  CHECK(starts == std::vector<int>{0, 11, 21, 31});
}

TEST_CASE("Coarsening edge cases", "[coarsen]") {
  CHECK(CoarsenToBlocks({}, {}, 4).empty());
  CHECK(CoarsenToBlocks({2.0}, {0}, 1) == std::vector<int>{0});
  CHECK(CoarsenToBlocks({2.0}, {0}, 8) == std::vector<int>{0});
  CHECK(CoarsenToBlocks({1, 2, 3}, {0, 1, 1}, 1) == std::vector<int>{0});
  CHECK(CoarsenToBlocks({1, 2, 3}, {0, 1, 1}, 0) == std::vector<int>{0});
  CHECK(CoarsenToBlocks({1, 2, 3}, {0, 1, 1}, -2) == std::vector<int>{0});
  // n <= target: every node is a block.
  CHECK(CoarsenToBlocks({1, 2, 3}, {0, 1, 1}, 3) == std::vector<int>{0, 1, 2});
  CHECK(CoarsenToBlocks({1, 2, 3}, {0, 1, 1}, 7) == std::vector<int>{0, 1, 2});
  // All times zero: node counts are balanced instead.
  std::vector<double> zero(10, 0.0), cut(10, 1);
  CHECK(CoarsenToBlocks(zero, cut, 5) == std::vector<int>{0, 2, 4, 6, 8});
  // ... and a cheap boundary within half a block still wins.
  cut[5] = 0;
  CHECK(CoarsenToBlocks(zero, cut, 2) == std::vector<int>{0, 5});
  // Missing cut_bytes count as 0; negative and NaN times as 0.
  CHECK(CoarsenToBlocks({1, 1, 1, 1}, {}, 2) == std::vector<int>{0, 2});
  CHECK(CoarsenToBlocks({1, -5, std::nan(""), 1, 1, 1}, {0, 9, 9, 9, 9, 9}, 2) ==
        std::vector<int>{0, 4});
}

TEST_CASE("A node longer than a block still gives non-empty blocks", "[coarsen]") {
  const std::vector<int> starts = CoarsenToBlocks({1, 100, 1, 1}, {0, 5, 5, 5}, 4);
  CheckWellFormed(starts, 4, 4);
  // The big node sits alone; the nearest boundaries are taken around it.
  CHECK(starts == std::vector<int>{0, 1, 2, 3});
  // Ideal point 52.5 ms; no boundary within 26.25 ms of it. Boundary 3 (after the big node,
  // at 102 ms) is nearer than boundary 2 (at 2 ms).
  const std::vector<int> two = CoarsenToBlocks({1, 1, 100, 1, 1, 1}, {0, 5, 5, 5, 5, 5}, 2);
  CHECK(two == std::vector<int>{0, 3});
}

TEST_CASE("Random inputs always give well-formed, reasonably balanced blocks", "[coarsen]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 200);
    const int target = 1 + static_cast<int>(rng() % 40);
    std::vector<double> ms(n), cut(n);
    double total = 0, largest = 0;
    for (int i = 0; i < n; ++i) {
      ms[i] = trial % 10 == 0 ? 0.0 : u(rng);
      cut[i] = std::floor(u(rng) * 4);
      total += ms[i];
      largest = std::max(largest, ms[i]);
    }
    const std::vector<int> starts = CoarsenToBlocks(ms, cut, target);
    CheckWellFormed(starts, n, target);
    if (n >= target && total > 0 && largest < total / target / 2) {
      // No node is longer than half a block: every window has a boundary, so the count is
      // exact and no block exceeds two ideal blocks.
      CHECK(static_cast<int>(starts.size()) == target);
      for (size_t k = 0; k < starts.size(); ++k) {
        const int end = k + 1 < starts.size() ? starts[k + 1] : n;
        double block = 0;
        for (int i = starts[k]; i < end; ++i) block += ms[i];
        CHECK(block <= 2 * total / target * (1 + 1e-9));
      }
    }
  }
}

// A model of `layers` identical layers of 10 nodes between an embedding (2 nodes) and a head (3
// nodes); node classes: layer node i is class 100 + i, the others distinct.
struct LayeredModel {
  std::vector<double> ms, cut;
  std::vector<int> classes;
  int first_layer_node = 2;
};

LayeredModel Layered(int layers, int cheapest_offset = 0) {
  const std::vector<double> layer_ms = {0.5, 2, 2, 3, 1, 0.5, 4, 4, 0.5, 0.5};
  std::vector<double> layer_cut = {2, 3, 3, 12, 12, 3, 2, 8, 8, 2};
  layer_cut[cheapest_offset] = 1;  // before the node at this offset only the stream is live
  LayeredModel m;
  m.ms = {0.2, 0.2};
  m.cut = {0, 5};
  m.classes = {0, 1};
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < 10; ++i) {
      m.ms.push_back(layer_ms[i]);
      m.cut.push_back(layer_cut[i]);
      m.classes.push_back(100 + i);
    }
  }
  for (int i = 0; i < 3; ++i) {
    m.ms.push_back(0.3);
    m.cut.push_back(4);
    m.classes.push_back(2 + i);
  }
  return m;
}

// Blocks and pieces well formed: both start at 0 and increase, blocks are piece starts.
void CheckWellFormed(const Coarsening& c, int n, int target) {
  CheckWellFormed(c.blocks, n, target);
  REQUIRE(!c.pieces.empty());
  CHECK(c.pieces.front() == 0);
  for (size_t k = 1; k < c.pieces.size(); ++k) CHECK(c.pieces[k] > c.pieces[k - 1]);
  CHECK(c.pieces.back() < n);
  for (int b : c.blocks) {
    CHECK(std::find(c.pieces.begin(), c.pieces.end(), b) != c.pieces.end());
  }
}

// The class sequence of each piece, and how many distinct ones there are.
int DistinctPieces(const Coarsening& c, const std::vector<int>& classes) {
  std::set<std::vector<int>> kinds;
  for (size_t k = 0; k < c.pieces.size(); ++k) {
    const int end = k + 1 < c.pieces.size() ? c.pieces[k + 1] : static_cast<int>(classes.size());
    kinds.insert(std::vector<int>(classes.begin() + c.pieces[k], classes.begin() + end));
  }
  return static_cast<int>(kinds.size());
}

TEST_CASE("Many layers: blocks of whole layers, one piece per layer", "[coarsen]") {
  const LayeredModel m = Layered(72, /*cheapest_offset=*/0);
  const int n = static_cast<int>(m.ms.size());
  const Coarsening c = CoarsenRepeated(m.ms, m.cut, m.classes, 32);
  CheckWellFormed(c, n, 32);
  CHECK(c.blocks.size() == 32);
  // Embedding, 72 layers, head: one piece each, and only three kinds of pieces to profile.
  CHECK(c.pieces.size() == 74);
  CHECK(DistinctPieces(c, m.classes) == 3);
  // 30 blocks of layers, as even as possible: 2 or 3 layers each.
  for (size_t b = 1; b + 1 < c.blocks.size(); ++b) {
    const int layers = (c.blocks[b + 1] - c.blocks[b]) / 10;
    CHECK((c.blocks[b + 1] - c.blocks[b]) % 10 == 0);
    CHECK((layers == 2 || layers == 3));
  }
  CHECK(c.blocks[1] == m.first_layer_node);
  CHECK(c.blocks.back() == m.first_layer_node + 720);
}

TEST_CASE("Layers are cut where the fewest bytes cross, all at the same offset", "[coarsen]") {
  const LayeredModel m = Layered(40, /*cheapest_offset=*/6);
  const int n = static_cast<int>(m.ms.size());
  const Coarsening c = CoarsenRepeated(m.ms, m.cut, m.classes, 16);
  CheckWellFormed(c, n, 16);
  // Units start at offset 6 of each layer: 39 whole units, the rest before and after them
  // (the part after them starts at offset 6 too).
  int at_offset = 0;
  for (int p : c.pieces) at_offset += (p - m.first_layer_node) % 10 == 6 ? 1 : 0;
  CHECK(at_offset == 40);
  for (size_t b = 1; b + 1 < c.blocks.size(); ++b) {
    CHECK((c.blocks[b] - m.first_layer_node) % 10 == 6);
  }
  CHECK(DistinctPieces(c, m.classes) <= 3);
}

TEST_CASE("Few layers: each layer is split alike into pieces", "[coarsen]") {
  const LayeredModel m = Layered(8);
  const int n = static_cast<int>(m.ms.size());
  const Coarsening c = CoarsenRepeated(m.ms, m.cut, m.classes, 32);
  CheckWellFormed(c, n, 32);
  CHECK(c.blocks.size() >= 24);
  // Every layer is cut at the same offsets, so its pieces are one layer's, whatever the layer.
  std::set<int> offsets;
  for (int p : c.pieces) {
    if (p >= m.first_layer_node && p < m.first_layer_node + 80) {
      offsets.insert((p - m.first_layer_node) % 10);
    }
  }
  CHECK(offsets.size() * 8 == static_cast<size_t>(std::count_if(
                                   c.pieces.begin(), c.pieces.end(), [&](int p) {
                                     return p >= m.first_layer_node && p < m.first_layer_node + 80;
                                   })));
  CHECK(DistinctPieces(c, m.classes) <= static_cast<int>(offsets.size()) + 2);
}

TEST_CASE("Two repeated parts (an encoder and a decoder) are both found", "[coarsen]") {
  std::vector<double> ms, cut;
  std::vector<int> classes;
  for (int part = 0; part < 2; ++part) {
    for (int l = 0; l < 20; ++l) {
      for (int i = 0; i < 6; ++i) {
        ms.push_back(1 + i % 3);
        cut.push_back(i == 0 ? 1 : 5);
        classes.push_back(10 * part + i);
      }
    }
  }
  const Coarsening c = CoarsenRepeated(ms, cut, classes, 10);
  CheckWellFormed(c, static_cast<int>(ms.size()), 10);
  CHECK(c.blocks.size() == 10);
  CHECK(DistinctPieces(c, classes) == 2);
  for (int b : c.blocks) CHECK(b % 6 == 0);
}

TEST_CASE("Without repeats, CoarsenRepeated is CoarsenToBlocks with one piece per block",
          "[coarsen]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 150);
    const int target = 1 + static_cast<int>(rng() % 40);
    std::vector<double> ms(n), cut(n);
    std::vector<int> distinct(n), random_classes(n);
    for (int i = 0; i < n; ++i) {
      ms[i] = u(rng);
      cut[i] = std::floor(u(rng) * 4);
      distinct[i] = i;
      random_classes[i] = static_cast<int>(rng() % 3);
    }
    const Coarsening plain = CoarsenRepeated(ms, cut, distinct, target);
    CHECK(plain.blocks == CoarsenToBlocks(ms, cut, target));
    CHECK(plain.pieces == plain.blocks);
    CHECK(CoarsenRepeated(ms, cut, {}, target).blocks == plain.blocks);
    // Classes that repeat by chance: still well formed.
    CheckWellFormed(CoarsenRepeated(ms, cut, random_classes, target), n, target);
  }
}

}  // namespace
}  // namespace planner
}  // namespace rannc
