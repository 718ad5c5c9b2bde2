// How the hybrid path picks its zero-copy share for a shape of call: a search for the share at
// which the call takes least time, from the measured time of calls at each share tried.
// Both sides of a call share the PCIe link and the host's memory, so a share at which the two
// sides end together is not the fastest (each side slows the other). The search therefore
// compares whole calls (see docs/decisions.md, "The hybrid's split search"). Torch- and
// CUDA-free (the C++ tests check it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace speedtorch_ops::hybrid {

// A scan, then a closer look: time every share of a coarse grid, then the best of them again
// beside the shares `refine` either side of it and the grid's first share, and settle on the
// best of those (without the first share in the closer look, a slow spell over its calls in
// the scan once kept a noisy machine off the CPU side alone, the best share there). Each
// share is timed by a few calls, compared by their medians, so one slow call does not pick
// the share; the calls go round the shares in turn, so a trend (the first calls of a shape
// run slower while staging is allocated and faulted in) or a slow spell of the machine weighs
// on all of them alike, and the last choice compares only shares timed in the same turns. A
// grid share more than `drop` times slower than the fastest in the first turn is not timed
// again in the scan (the far end of the grid can take several times as long; one slow call
// can drop a good share, whose neighbours the closer look then still tries; the closer look
// times the first share whatever the scan made of it). A descent from point to point was sent
// down wrong paths by slow calls. Near the fastest share the time changes little, and the
// zero-copy side's kernels hold SMs the caller's own work could use, so the best share is the
// lowest one whose calls were within `margin` of the fastest. A settled search scans again
// every `recheck` calls, so a share follows a machine whose speeds drift. The first `warmup`
// calls of a shape take the grid's first share (0: the CPU side alone) and are not counted.
class ShareSearch {
 public:
  struct Options {
    // 0: the CPU side alone (no zero-copy kernels, no index upload)
    std::vector<double> grid{0.0, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95};
    double refine = 0.05;
    double lowest = 0.0;    // the bounds of the share
    double highest = 0.98;
    double margin = 0.02;   // how much slower than the fastest the best share may be
    double drop = 1.5;      // first-turn time, against the fastest, past which a share drops
    int per_point = 3;      // calls timed at each share
    int warmup = 20;        // first calls not counted
    int64_t recheck = 500;  // calls at a settled share before the next scan
  };

  ShareSearch() : ShareSearch(Options{}) {}
  // @brief Throws std::invalid_argument, naming the field, for options that cannot search.
  explicit ShareSearch(const Options& options);

  // @brief The share for the next call.
  double next() const;

  // @brief Folds in a call's time at `share`; a time at another share than next() (a call
  // that started before the last change) is ignored.
  void add(double share, double ms);

  // @brief Whether the search is done and the share stays (until the next scan).
  bool settled() const { return settled_; }

 private:
  struct Point {
    double share = 0;
    std::vector<double> ms;
  };
  void plan(const std::vector<double>& shares);
  double best() const;

  Options o_;
  std::vector<Point> tried_;  // the shares being timed now (the grid, or the closer look)
  size_t at_ = 0;             // the share the next call times
  bool refined_ = false, settled_ = false;
  double settled_share_ = 0;
  int64_t settled_calls_ = 0;
  int warmed_ = 0;
};

// @brief The median of a non-empty list.
double median(std::vector<double> v);

}  // namespace speedtorch_ops::hybrid
