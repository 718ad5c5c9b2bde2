#include "hybrid/share_search.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace speedtorch_ops::hybrid {

double median(std::vector<double> v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  return v[mid];
}

ShareSearch::ShareSearch(const Options& options) : o_(options) {
  const auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("ShareSearch::Options: ") + what);
  };
  require(!o_.grid.empty(), "grid must not be empty");
  require(o_.lowest >= 0 && o_.lowest <= o_.highest && o_.highest <= 1,
          "lowest and highest must satisfy 0 <= lowest <= highest <= 1");
  require(o_.refine > 0, "refine must be > 0");
  require(o_.margin >= 0, "margin must be >= 0");
  require(o_.drop >= 1, "drop must be >= 1");
  require(o_.per_point >= 1, "per_point must be >= 1");
  require(o_.warmup >= 0, "warmup must be >= 0");
  require(o_.recheck >= 1, "recheck must be >= 1");
  plan(o_.grid);
}

double ShareSearch::next() const { return settled_ ? settled_share_ : tried_[at_].share; }

// Queues the shares (bounded) not queued yet in this phase.
void ShareSearch::plan(const std::vector<double>& shares) {
  for (const double s : shares) {
    const double bounded = std::clamp(s, o_.lowest, o_.highest);
    const bool seen = std::any_of(tried_.begin(), tried_.end(), [&](const Point& p) {
      return std::abs(p.share - bounded) < 1e-9;
    });
    if (!seen) tried_.push_back({bounded, {}});
  }
}

double ShareSearch::best() const {
  double fastest = median(tried_.front().ms);
  for (const auto& p : tried_) fastest = std::min(fastest, median(p.ms));
  double share = o_.highest;
  for (const auto& p : tried_) {
    if (median(p.ms) <= fastest * (1 + o_.margin)) share = std::min(share, p.share);
  }
  return share;
}

void ShareSearch::add(double share, double ms) {
  if (share != next() || !(ms > 0)) return;
  if (warmed_ < o_.warmup) {
    ++warmed_;
    return;
  }
  if (settled_) {
    if (++settled_calls_ < o_.recheck) return;
    settled_ = refined_ = false;  // scan again
    tried_.clear();
    at_ = 0;
    plan(o_.grid);
    return;
  }
  tried_[at_].ms.push_back(ms);
  if (!refined_ && at_ + 1 == tried_.size() && tried_[at_].ms.size() == 1) {
    // The grid's first turn is done: shares far slower than the fastest are not timed again.
    double fastest = tried_.front().ms[0];
    for (const auto& p : tried_) fastest = std::min(fastest, p.ms[0]);
    tried_.erase(std::remove_if(tried_.begin(), tried_.end(),
                                [&](const Point& p) { return p.ms[0] > o_.drop * fastest; }),
                 tried_.end());
    at_ = tried_.size() - 1;  // the turns go on from the first share
  }
  // The next share of this phase still short of its calls, going round them in turn.
  for (size_t j = 1; j <= tried_.size(); ++j) {
    const size_t i = (at_ + j) % tried_.size();
    if (static_cast<int>(tried_[i].ms.size()) < o_.per_point) {
      at_ = i;
      return;
    }
  }
  if (!refined_) {
    // The best share is timed again beside its neighbours and the grid's first share (the CPU
    // side alone), in the same turns: a slow spell over that share's calls in the scan then
    // cannot keep the search off it.
    refined_ = true;
    const double b = best();
    tried_.clear();
    at_ = 0;
    plan({b, b - o_.refine, b + o_.refine, o_.grid.front()});
    return;
  }
  settled_ = true;
  settled_share_ = best();
  settled_calls_ = 0;
}

}  // namespace speedtorch_ops::hybrid
