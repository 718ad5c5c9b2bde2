#include "optim/optim_checks.h"

#include "common/checks.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace speedtorch_ops {

void check_segment_sum_args(at::TensorList grads, const at::Tensor& perm,
                            const at::Tensor& starts, const at::Tensor& count, int64_t rows) {
  TORCH_CHECK(!grads.empty(), "grads must hold at least one tensor (the rows' gradients)");
  const at::Tensor& first = grads[0];
  const auto dtype = check_step_float(first, "grads");
  int64_t n = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    TORCH_CHECK(g.dim() == 2 && g.is_contiguous(), "grads[", k, "] must be a contiguous "
                "(positions, dim) tensor, got shape ", g.sizes());
    TORCH_CHECK(g.size(1) == first.size(1), "grads[", k, "] must have grads[0]'s ",
                first.size(1), " columns, got ", g.size(1));
    TORCH_CHECK(g.scalar_type() == dtype, "grads[", k, "] must be ", dtype, " like grads[0], got ",
                g.scalar_type());
    const std::string name = "grads[" + std::to_string(k) + "]";
    check_same_device(g, name.c_str(), first, "grads[0]");
    n += g.size(0);
  }
  check_vectors({{perm, "perm", at::kLong}, {starts, "starts", at::kLong}});
  check_same_device(perm, "perm", first, "grads[0]");
  TORCH_CHECK(perm.numel() == n, "perm must have one entry a row of grads (", n, "), got ",
              perm.numel());
  TORCH_CHECK(starts.numel() >= 1, "starts must hold at least one entry (segments + 1)");
  check_one_int64(count, "count", first, "grads[0]");
  TORCH_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  check_items(perm, "perm");
}

void check_bag_segment_sum_args(const at::Tensor& grad, const at::Tensor& offsets,
                                const c10::optional<at::Tensor>& per_sample_weights, bool mean,
                                const at::Tensor& perm, const at::Tensor& starts,
                                const at::Tensor& count, int64_t lo, int64_t rows) {
  const auto dtype = check_step_float(grad, "grad");
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "grad must be a contiguous (bags, dim) "
              "tensor, got shape ", grad.sizes());
  check_vectors({{offsets, "offsets", at::kLong}, {perm, "perm", at::kLong},
                 {starts, "starts", at::kLong}});
  check_same_device(offsets, "offsets", grad, "grad");
  TORCH_CHECK(offsets.numel() == grad.size(0) + 1, "offsets must hold one entry a bag of grad "
              "and the end (", grad.size(0) + 1, "), got ", offsets.numel());
  if (per_sample_weights.has_value()) {
    check_vector(*per_sample_weights, "per_sample_weights", dtype);
    check_same_device(*per_sample_weights, "per_sample_weights", grad, "grad");
    TORCH_CHECK(!mean, "per_sample_weights need sum pooling (mean false), as nn.EmbeddingBag");
  }
  TORCH_CHECK(starts.numel() >= 1, "starts must hold at least one entry (segments + 1)");
  check_one_int64(count, "count", grad, "grad");
  TORCH_CHECK(lo >= 0 && lo <= perm.numel(), "lo must be a position in perm's range [0, ",
              perm.numel(), "], got ", lo);
  TORCH_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  check_items(perm, "perm");
}

namespace {

using optim::Rule;

// A stochastic rounding's (seed, counter) beside the tensor it rounds into.
void check_rounding(const at::Tensor& r, const at::Tensor& beside, const char* name) {
  TORCH_CHECK(r.dim() == 1 && r.numel() == 2 && r.scalar_type() == at::kLong && r.is_contiguous(),
              "rounding must be a contiguous int64 tensor of 2 values (seed, counter), got ",
              r.scalar_type(), " of shape ", r.sizes());
  check_same_device(r, "rounding", beside, name);
}

// The op's `rule` as a Rule; raises for any other value, listing the rules.
Rule check_rule(int64_t rule) {
  const auto first = static_cast<int64_t>(optim::kFirstRule);
  const auto last = static_cast<int64_t>(optim::kLastRule);
  std::string rules;
  for (int64_t r = first; r <= last; ++r) {
    rules += (r == first ? "" : r == last ? " or " : ", ") + std::to_string(r) + " (" +
             optim::rule_name(static_cast<Rule>(r)) + ")";
  }
  TORCH_CHECK(rule >= first && rule <= last, "rule must be ", rules, ", got ", rule);
  return static_cast<Rule>(rule);
}

// fields: the weight's offset, the row value's (an offset for the rules that keep one, else
// -1), then the rule's per-element states (SGD: a momentum buffer or none; Adagrad its sum;
// RowWiseAdagrad none, its accumulator being the row value; Adam and AdamW two moments, three
// with amsgrad; PartialRowWiseAdam its first moment, the second being the row value); and the
// flags the rule takes.
void check_rule_fields(Rule rule, int64_t flags, c10::ArrayRef<int64_t> fields) {
  TORCH_CHECK(fields.size() >= 2 && fields.size() <= 5, "fields must hold the byte offsets of "
              "the weight, the row value (-1: none) and up to 3 states, got ", fields.size(),
              " values");
  const int64_t states = static_cast<int64_t>(fields.size()) - 2;
  const bool amsgrad = (flags & optim::kAmsgrad) != 0;
  const bool adam = rule == Rule::kAdam || rule == Rule::kAdamW;
  const bool sgd = rule == Rule::kSgd;
  const int64_t needed = sgd ? std::min<int64_t>(states, 1)
                         : rule == Rule::kRowWiseAdagrad ? 0
                         : adam ? (amsgrad ? 3 : 2) : 1;
  TORCH_CHECK(states == needed, "fields must name the rule's ",
              sgd ? "momentum buffer (or nothing)"
              : rule == Rule::kAdagrad ? "sum"
              : rule == Rule::kRowWiseAdagrad
                  ? "no per-element state (the accumulator is the row value)"
              : rule == Rule::kPartialRowWiseAdam ? "exp_avg (exp_avg_sq is the row value)"
              : amsgrad ? "exp_avg, exp_avg_sq and max_exp_avg_sq" : "exp_avg and exp_avg_sq",
              " after the weight and the row value, got ", states, " states");
  const bool rowwise = optim::has_row_value(rule);
  TORCH_CHECK(rowwise == (fields[1] >= 0), "fields[1] (the row value's offset) must be ",
              rowwise ? "an offset: the rule keeps one value a row" : "-1: the rule keeps none");
  TORCH_CHECK(!amsgrad || adam, "flags: amsgrad (", optim::kAmsgrad, ") is Adam's and AdamW's "
              "only");
  TORCH_CHECK((flags & (optim::kNesterov | optim::kFirstStep)) == 0 || (sgd && states == 1),
              "flags: nesterov (", optim::kNesterov, ") and first step (", optim::kFirstStep,
              ") need SGD with a momentum buffer");
}

// Every field inside the record, aligned to its element size in every row (the record a
// multiple of it), and no two overlapping. Returns the widest element: the alignment buf's
// (and a cache's) data needs.
int64_t check_field_spans(c10::ArrayRef<int64_t> fields, bool rowwise, int64_t record,
                          int64_t dim, int64_t w_item, int64_t s_item, int64_t r_item) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t k = 0; k < fields.size(); ++k) {
    if (k == 1 && !rowwise) continue;
    const int64_t item = k == 0 ? w_item : k == 1 ? r_item : s_item;
    const int64_t bytes = k == 1 ? item : dim * item;
    TORCH_CHECK(fields[k] >= 0 && fields[k] % item == 0 && record % item == 0 &&
                    fields[k] + bytes <= record,
                "fields[", k, "] = ", fields[k], " must be a multiple of ", item, " with its ",
                bytes, " bytes inside buf's record of ", record, " bytes (a multiple of ", item,
                ")");
    for (const auto& [lo, hi] : spans) {
      TORCH_CHECK(fields[k] + bytes <= lo || fields[k] >= hi, "fields[", k, "] overlaps another "
                  "field: [", fields[k], ", ", fields[k] + bytes, ") and [", lo, ", ", hi, ")");
    }
    spans.emplace_back(fields[k], fields[k] + bytes);
  }
  return std::max({w_item, s_item, rowwise ? r_item : 1});
}

// The step count: required by the rules that count steps; one float32 or float64 on the CPU
// or buf's device.
void check_step(const c10::optional<at::Tensor>& step, Rule rule, const at::Tensor& buf) {
  TORCH_CHECK(!optim::counts_steps(rule) || step.has_value(), "step is required by rule ",
              static_cast<int64_t>(rule), " (the step count after this step's increment)");
  if (!step.has_value()) return;
  const auto& s = *step;
  TORCH_CHECK(s.numel() == 1 && (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
              "step must be one float32 or float64, got ", s.scalar_type(), " of shape ",
              s.sizes());
  TORCH_CHECK(s.device().is_cpu() || s.device() == buf.device(), "step must be on the CPU or "
              "buf's device ", buf.device(), ", got ", s.device());
}

// cache and at together or neither: cache records like buf's, aligned to `widest`, on buf's
// device, overlapping neither buf nor grad; at 1-D int64 there.
void check_update_cache(const c10::optional<at::Tensor>& cache,
                        const c10::optional<at::Tensor>& at, const at::Tensor& buf,
                        const at::Tensor& grad, int64_t widest) {
  TORCH_CHECK(cache.has_value() == at.has_value(), "cache and at go together (a slot per staged "
              "row of the cache), got ", cache.has_value() ? "cache only" : "at only");
  if (!cache.has_value()) return;
  const auto& c = *cache;
  const int64_t record = buf.size(1);
  TORCH_CHECK(c.dim() == 2 && c.scalar_type() == at::kByte && c.is_contiguous() &&
                  c.size(1) == record,
              "cache must be a contiguous uint8 (slots, record) tensor with buf's record of ",
              record, " bytes, got ", c.scalar_type(), " of shape ", c.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(c.const_data_ptr()) % widest == 0, "cache's data "
              "must be ", widest, "-byte aligned (its fields' widest element)");
  check_same_device(c, "cache", buf, "buf");
  check_vector(*at, "at", at::kLong);
  check_same_device(*at, "at", buf, "buf");
  check_no_overlap(c, "cache", buf, "buf");
  check_no_overlap(c, "cache", grad, "grad");
}

// The checks of check_fused_update_args (below), in order.
Rule check_update_args(const at::Tensor& buf, const at::Tensor& grad, const at::Tensor& count,
                       const c10::optional<at::Tensor>& step, int64_t rule_arg,
                       c10::ArrayRef<double> hyper, int64_t flags, c10::ArrayRef<int64_t> fields,
                       at::ScalarType state_dtype, const c10::optional<at::Tensor>& cache,
                       const c10::optional<at::Tensor>& at,
                       const c10::optional<at::Tensor>& rounding) {
  const Rule rule = check_rule(rule_arg);
  TORCH_CHECK(buf.dim() == 2 && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "buf must be a contiguous uint8 (rows, record) tensor, got ", buf.scalar_type(),
              " of shape ", buf.sizes());
  TORCH_CHECK(grad.dim() == 2 && grad.is_contiguous(), "grad must be a contiguous (rows, dim) "
              "tensor, got shape ", grad.sizes());
  const auto dtype = check_step_float(grad, "grad");
  const auto state = state_dtype;
  const bool wide = dtype == at::kDouble;
  TORCH_CHECK(wide ? state == at::kDouble
                   : state == at::kFloat || state == at::kBFloat16 || state == dtype,
              "state_dtype must be ", wide ? "float64 with float64 weights (grad's dtype)"
                                           : "float32, bfloat16 or the weights' (grad's) dtype",
              ", got ", state, " for ", dtype, " weights");
  check_same_device(grad, "grad", buf, "buf");
  TORCH_CHECK(grad.size(0) == buf.size(0), "grad must have buf's ", buf.size(0), " rows, got ",
              grad.size(0));
  check_one_int64(count, "count", buf, "buf");
  TORCH_CHECK(hyper.size() == 5, "hyper must hold 5 values (lr, weight_decay, a, b, eps), got ",
              hyper.size());
  TORCH_CHECK((flags & ~optim::kAllFlags) == 0, "flags must be a combination of ",
              optim::kMaximize, " (maximize), ", optim::kNesterov, " (nesterov), ",
              optim::kAmsgrad, " (amsgrad) and ", optim::kFirstStep, " (first step), got ", flags);
  check_rule_fields(rule, flags, fields);
  const int64_t widest =
      check_field_spans(fields, optim::has_row_value(rule), buf.size(1), grad.size(1),
                        grad.element_size(), c10::elementSize(state), wide ? 8 : 4);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.const_data_ptr()) % widest == 0, "buf's data must "
              "be ", widest, "-byte aligned (its fields' widest element)");
  check_step(step, rule, buf);
  check_no_overlap(buf, "buf", grad, "grad");
  check_update_cache(cache, at, buf, grad, widest);
  if (rounding.has_value()) check_rounding(*rounding, buf, "buf");
  return rule;
}

}  // namespace

FusedUpdateArgs check_fused_update_args(const at::Tensor& buf, const at::Tensor& grad,
                                        const at::Tensor& count,
                                        const c10::optional<at::Tensor>& step, int64_t rule,
                                        c10::ArrayRef<double> hyper, int64_t flags,
                                        c10::ArrayRef<int64_t> fields,
                                        at::ScalarType state_dtype,
                                        const c10::optional<at::Tensor>& cache,
                                        const c10::optional<at::Tensor>& at,
                                        const c10::optional<at::Tensor>& rounding) {
  FusedUpdateArgs c{check_update_args(buf, grad, count, step, rule, hyper, flags, fields,
                                      state_dtype, cache, at, rounding),
                    optim::make_hyper(hyper[0], hyper[1], hyper[2], hyper[3], hyper[4], flags)};
  if (step.has_value() && step->device().is_cpu()) {
    optim::derive(c.hyper, c.rule, step->item<double>());
  }
  const auto narrow = [](at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; };
  c.rounds = rounding.has_value() && (narrow(grad.scalar_type()) || narrow(state_dtype));
  if (c.rounds && rounding->device().is_cpu()) {
    const int64_t* r = rounding->const_data_ptr<int64_t>();
    c.seed = static_cast<uint64_t>(r[0]);
    c.counter = static_cast<uint64_t>(r[1]);
  }
  return c;
}

void check_round_into_args(const at::Tensor& dst, const at::Tensor& src,
                           const at::Tensor& rounding) {
  check_step_float(dst, "dst");
  TORCH_CHECK(dst.is_contiguous(), "dst must be contiguous");
  TORCH_CHECK(src.scalar_type() == at::kFloat && src.is_contiguous(),
              "src must be a contiguous float32 tensor, got ", src.scalar_type());
  TORCH_CHECK(src.sizes() == dst.sizes(), "src must have dst's shape ", dst.sizes(), ", got ",
              src.sizes());
  check_same_device(src, "src", dst, "dst");
  check_no_overlap(dst, "dst", src, "src");
  check_rounding(rounding, dst, "dst");
}

}  // namespace speedtorch_ops
