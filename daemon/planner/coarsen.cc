#include "daemon/planner/coarsen.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace rannc {
namespace planner {

std::vector<int> CoarsenToBlocks(const std::vector<double>& node_ms,
                                 const std::vector<double>& cut_bytes, int target_blocks) {
  const int n = static_cast<int>(node_ms.size());
  if (n == 0) return {};
  const int target = target_blocks < 1 ? 1 : target_blocks;
  std::vector<int> starts;
  if (n <= target) {
    for (int i = 0; i < n; ++i) starts.push_back(i);
    return starts;
  }

  std::vector<double> weight(n);
  double total = 0;
  for (int i = 0; i < n; ++i) {
    weight[i] = node_ms[i] > 0 ? node_ms[i] : 0;  // also maps NaN to 0
    total += weight[i];
  }
  if (!(total > 0) || !std::isfinite(total)) {
    // Nothing measured: balance node counts instead.
    for (double& w : weight) w = 1;
    total = n;
  }
  // prefix[i]: time of nodes before boundary i.
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weight[i];
  auto cut = [&](int i) {
    return static_cast<size_t>(i) < cut_bytes.size() ? cut_bytes[i] : 0.0;
  };

  const double block_ms = total / target;
  // A hair of slack so that a boundary exactly half a block away is not lost to rounding.
  const double half = block_ms / 2 * (1 + 1e-12);
  starts.push_back(0);
  for (int j = 1; j < target; ++j) {
    const int prev = starts.back();
    if (prev + 1 >= n) break;  // no boundary left
    const double ideal = block_ms * j;
    int best = -1;
    double best_cut = 0, best_dist = 0;
    for (int i = prev + 1; i < n; ++i) {
      const double offset = prefix[i] - ideal;
      if (offset > half) break;  // prefix only grows
      const double dist = std::fabs(offset);
      if (dist > half) continue;
      const double c = cut(i);
      if (best < 0 || c < best_cut || (c == best_cut && dist < best_dist)) {
        best = i;
        best_cut = c;
        best_dist = dist;
      }
    }
    if (best < 0) {
      // A node longer than the window: take the nearest boundary instead.
      for (int i = prev + 1; i < n; ++i) {
        const double dist = std::fabs(prefix[i] - ideal);
        if (best < 0 || dist < best_dist) {
          best = i;
          best_dist = dist;
        }
      }
    }
    starts.push_back(best);
  }
  return starts;
}

namespace {

class RepeatCoarsener {
 public:
  RepeatCoarsener(const std::vector<double>& node_ms, const std::vector<double>& cut_bytes,
                  const std::vector<int>& node_class)
      : n_(static_cast<int>(node_ms.size())), cut_bytes_(cut_bytes) {
    weight_.resize(n_);
    double total = 0;
    for (int i = 0; i < n_; ++i) {
      weight_[i] = node_ms[i] > 0 ? node_ms[i] : 0;  // also maps NaN to 0
      total += weight_[i];
    }
    if (!(total > 0) || !std::isfinite(total)) std::fill(weight_.begin(), weight_.end(), 1.0);
    prefix_.assign(n_ + 1, 0);
    for (int i = 0; i < n_; ++i) prefix_[i + 1] = prefix_[i] + weight_[i];
    class_.resize(n_);
    for (int i = 0; i < n_; ++i) {
      // Without a class a node is its own: it never repeats.
      class_[i] = static_cast<size_t>(i) < node_class.size() ? node_class[i] : -1 - i;
    }
  }

  // Appends the blocks and pieces of nodes [lo, hi) in at most `budget` blocks.
  void Coarsen(int lo, int hi, int budget, Coarsening* out) {
    const int n = hi - lo;
    if (n <= 0) return;
    budget = std::max(budget, 1);
    if (n <= budget) {
      for (int i = lo; i < hi; ++i) {
        out->blocks.push_back(i);
        out->pieces.push_back(i);
      }
      return;
    }
    Repeat r = FindRepeat(lo, hi);
    const bool before = r.start > lo, after = r.start + r.units * r.period < hi;
    const double span = Weight(lo, hi);
    const double region = Weight(r.start, r.start + r.units * r.period);
    if (r.units < 2 || region < span / 4 || budget < 1 + before + after) {
      Plain(lo, hi, budget, out);
      return;
    }
    const int end = r.start + r.units * r.period;
    // Blocks in proportion to time; each non-empty side keeps at least one.
    int region_blocks = static_cast<int>(std::lround(budget * region / span));
    region_blocks = std::clamp(region_blocks, 1, budget - before - after);
    int rest = budget - region_blocks;
    int before_blocks = 0;
    if (before && after) {
      const double w = Weight(lo, r.start), total = w + Weight(end, hi);
      before_blocks = std::clamp(static_cast<int>(std::lround(rest * (total > 0 ? w / total : 0.5))),
                                 1, rest - 1);
    } else if (before) {
      before_blocks = rest;
    }
    Coarsen(lo, r.start, before_blocks, out);
    Region(r, region_blocks, out);
    Coarsen(end, hi, rest - before_blocks, out);
  }

 private:
  struct Repeat {
    int start = 0;
    int period = 0;
    int units = 0;
  };

  double Weight(int a, int b) const { return prefix_[b] - prefix_[a]; }
  double Cut(int i) const {
    return i > 0 && static_cast<size_t>(i) < cut_bytes_.size() ? cut_bytes_[i] : 0.0;
  }

  void Plain(int lo, int hi, int budget, Coarsening* out) {
    std::vector<double> ms(weight_.begin() + lo, weight_.begin() + hi);
    std::vector<double> cut(hi - lo, 0.0);
    for (int i = 1; i < hi - lo; ++i) cut[i] = Cut(lo + i);
    for (int s : CoarsenToBlocks(ms, cut, budget)) {
      out->blocks.push_back(lo + s);
      out->pieces.push_back(lo + s);
    }
  }

  // The stretch of back-to-back copies of one class sequence in [lo, hi) that covers the most
  // time (ties: the shorter period, then the earlier stretch), started at the offset whose
  // boundaries between units cut the fewest bytes (ties: more units, then the earlier offset).
  Repeat FindRepeat(int lo, int hi) const {
    Repeat best;
    double best_weight = 0;
    int best_length = 0;
    for (int p = 1; 2 * p <= hi - lo; ++p) {
      int run = 0;  // consecutive i with class[i] == class[i + p]
      for (int i = lo; i + p < hi; ++i) {
        run = class_[i] == class_[i + p] ? run + 1 : 0;
        const bool ends = run > 0 && (i + p + 1 == hi || class_[i + 1] != class_[i + 1 + p]);
        if (!ends) continue;
        const int start = i - run + 1, length = run + p;  // nodes [start, start + length)
        const int units = length / p;
        if (units < 2) continue;
        const double w = Weight(start, start + units * p);
        if (w > best_weight * (1 + 1e-9)) {
          best = {start, p, units};
          best_weight = w;
          best_length = length;
        }
      }
    }
    if (best.units < 2) return best;
    Repeat chosen = best;
    double chosen_cut = -1;
    for (int phase = 0; phase < best.period; ++phase) {
      const int units = (best_length - phase) / best.period;
      if (units < 2) break;
      const int start = best.start + phase;
      double worst = 0;
      // The boundaries between units: the region's ends border other parts of the model.
      for (int u = 1; u < units; ++u) worst = std::max(worst, Cut(start + u * best.period));
      if (chosen_cut < 0 || worst < chosen_cut ||
          (worst == chosen_cut && units > chosen.units)) {
        chosen = {start, best.period, units};
        chosen_cut = worst;
      }
    }
    return chosen;
  }

  // Blocks and pieces of the repeated part of `r` in `budget` blocks.
  void Region(const Repeat& r, int budget, Coarsening* out) {
    std::vector<int> offsets = {0};  // piece starts within a unit
    if (r.units < budget) {
      const int per_unit = (budget + r.units - 1) / r.units;
      std::vector<double> ms(weight_.begin() + r.start, weight_.begin() + r.start + r.period);
      std::vector<double> cut(r.period, 0.0);
      for (int i = 1; i < r.period; ++i) cut[i] = Cut(r.start + i);
      offsets = CoarsenToBlocks(ms, cut, per_unit);
    }
    std::vector<int> pieces;
    for (int u = 0; u < r.units; ++u) {
      for (int off : offsets) pieces.push_back(r.start + u * r.period + off);
    }
    // Consecutive pieces into at most `budget` blocks, as even as possible.
    const int count = static_cast<int>(pieces.size());
    const int blocks = std::min(budget, count);
    int next = 0;
    for (int b = 0; b < blocks; ++b) {
      out->blocks.push_back(pieces[next]);
      next += count / blocks + (b < count % blocks ? 1 : 0);
    }
    out->pieces.insert(out->pieces.end(), pieces.begin(), pieces.end());
  }

  const int n_;
  const std::vector<double>& cut_bytes_;
  std::vector<double> weight_;
  std::vector<double> prefix_;
  std::vector<int> class_;
};

}  // namespace

Coarsening CoarsenRepeated(const std::vector<double>& node_ms,
                           const std::vector<double>& cut_bytes,
                           const std::vector<int>& node_class, int target_blocks) {
  Coarsening out;
  RepeatCoarsener(node_ms, cut_bytes, node_class)
      .Coarsen(0, static_cast<int>(node_ms.size()), target_blocks, &out);
  return out;
}

}  // namespace planner
}  // namespace rannc
