// The fused optimizers' arithmetic, shared by the CPU and CUDA kernels of _fused_row_update
// (registration.cpp has the op's contract). Torch-free and CUDA-free: plain C++ that compiles
// for the host and, under nvcc, for the device. Each rule is torch's own formula for one
// element (RowWiseAdagrad: one accumulator per row), written for a row's weight and state
// held in a record of bytes (the op's `fields` say where): the weight, each per-element state,
// and a row-wise value (RowWiseAdagrad's accumulator, PartialRowWiseAdam's second moment).
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define SPEEDTORCH_HD __host__ __device__ __forceinline__
#else
#define SPEEDTORCH_HD inline
#endif

namespace speedtorch_ops::optim {

// The optimizers with a fused update; the values are the op's `rule` argument (the Python
// side's numbers: speedtorch_ops/training/fused.py).
enum class Rule : int64_t {
  kSgd = 0,             // torch.optim.SGD (momentum, dampening, nesterov, weight_decay)
  kAdagrad = 1,         // torch.optim.Adagrad (lr_decay, weight_decay, eps)
  kRowWiseAdagrad = 2,  // speedtorch_ops.RowWiseAdagrad
  kAdam = 3,            // torch.optim.Adam (amsgrad, weight_decay as L2)
  kAdamW = 4,           // torch.optim.AdamW (decoupled weight decay)
  kPartialRowWiseAdam = 5,  // speedtorch_ops.PartialRowWiseAdam
};

// The rules' names (the optimizers they follow), for messages.
inline const char* rule_name(Rule rule) {
  switch (rule) {
    case Rule::kSgd: return "SGD";
    case Rule::kAdagrad: return "Adagrad";
    case Rule::kRowWiseAdagrad: return "RowWiseAdagrad";
    case Rule::kAdam: return "Adam";
    case Rule::kAdamW: return "AdamW";
    case Rule::kPartialRowWiseAdam: return "PartialRowWiseAdam";
  }
  return "?";
}

// The values of `rule` the op takes: kFirstRule to kLastRule.
constexpr Rule kFirstRule = Rule::kSgd;
constexpr Rule kLastRule = Rule::kPartialRowWiseAdam;

// The rules that count steps (the op's `step`, from which derive takes their constants).
SPEEDTORCH_HD bool counts_steps(Rule rule) {
  return rule == Rule::kAdagrad || rule == Rule::kAdam || rule == Rule::kAdamW ||
         rule == Rule::kPartialRowWiseAdam;
}

// The rules that keep one value per row (the record's row value) from the row's mean squared
// gradient: RowWiseAdagrad's accumulator, PartialRowWiseAdam's second moment.
SPEEDTORCH_HD bool has_row_value(Rule rule) {
  return rule == Rule::kRowWiseAdagrad || rule == Rule::kPartialRowWiseAdam;
}

// The op's `flags` bits (fused.py's too).
enum Flag : int64_t {
  kMaximize = 1,
  kNesterov = 2,
  kAmsgrad = 4,
  kFirstStep = 8,  // SGD with momentum: the buffer takes the gradient itself (torch's first step)
};
constexpr int64_t kAllFlags = kMaximize | kNesterov | kAmsgrad | kFirstStep;

// One step's constants. `a` and `b` are momentum and dampening (SGD), lr_decay (Adagrad), or
// beta1 and beta2 (Adam). The rest are derived from the step count once per step.
struct Hyper {
  double lr = 0, weight_decay = 0, a = 0, b = 0, eps = 0;
  int64_t flags = 0;
  // 1 - a, 1 - b and 1 - lr * weight_decay, taken in double by make_hyper.
  double one_minus_a = 1, one_minus_b = 1, one_minus_decay = 1;
  double step_size = 0;  // Adam: lr / (1 - beta1^step); Adagrad: lr / (1 + (step - 1) lr_decay)
  double bc2_sqrt = 1;   // Adam: sqrt(1 - beta2^step)
};

// One step's constants from the op's hyper = (lr, weight_decay, a, b, eps) and flags. The
// complements are taken here in double and rounded once where a rule uses them, as torch's
// optimizers take them in Python: rounding a or b to float before subtracting would lose the
// digits of the complement that the rounding of a or b took (beta2 near 1, say).
inline Hyper make_hyper(double lr, double weight_decay, double a, double b, double eps,
                        int64_t flags) {
  Hyper h;
  h.lr = lr;
  h.weight_decay = weight_decay;
  h.a = a;
  h.b = b;
  h.eps = eps;
  h.flags = flags;
  h.one_minus_a = 1.0 - a;
  h.one_minus_b = 1.0 - b;
  h.one_minus_decay = 1.0 - lr * weight_decay;
  return h;
}

// The step-dependent constants, from the step count after this step's increment (as torch's
// optimizers count it).
SPEEDTORCH_HD void derive(Hyper& h, Rule rule, double step) {
  if (rule == Rule::kAdam || rule == Rule::kAdamW || rule == Rule::kPartialRowWiseAdam) {
    h.step_size = h.lr / (1.0 - pow(h.a, step));
    h.bc2_sqrt = sqrt(1.0 - pow(h.b, step));
  } else if (rule == Rule::kAdagrad) {
    h.step_size = h.lr / (1.0 + (step - 1.0) * h.a);
  }
}

// The gradient as the rule sees it: negated to maximize, plus L2 weight decay (every rule but
// AdamW's and PartialRowWiseAdam's, whose decay is decoupled).
template <class T>
SPEEDTORCH_HD T effective_grad(T g, T w, const Hyper& h, Rule rule) {
  if (h.flags & kMaximize) g = -g;
  if (h.weight_decay != 0 && rule != Rule::kAdamW && rule != Rule::kPartialRowWiseAdam) {
    g += static_cast<T>(h.weight_decay) * w;
  }
  return g;
}

// A row's value after this step (has_row_value's rules), from its value before and the mean
// of the squares of the row's effective gradient.
template <class T>
SPEEDTORCH_HD T row_value(Rule rule, const Hyper& h, T before, T mean_square) {
  if (rule == Rule::kPartialRowWiseAdam) {
    return static_cast<T>(h.b) * before + static_cast<T>(h.one_minus_b) * mean_square;
  }
  return before + mean_square;
}

// One element's update: w its weight, s[0..2] its per-element state (as many as the rule keeps),
// g its gradient from effective_grad. The rules with a row value pass it, after this step's
// change (row_value), as `row_sum`.
template <class T>
SPEEDTORCH_HD void update(Rule rule, const Hyper& h, T g, T& w, T* s, bool momentum, T row_sum) {
  switch (rule) {
    case Rule::kSgd: {
      if (momentum) {
        const T mu = static_cast<T>(h.a);
        T buf = (h.flags & kFirstStep) ? g : mu * s[0] + static_cast<T>(h.one_minus_b) * g;
        s[0] = buf;
        g = (h.flags & kNesterov) ? g + mu * buf : buf;
      }
      w -= static_cast<T>(h.lr) * g;
      return;
    }
    case Rule::kAdagrad: {
      s[0] += g * g;
      w -= static_cast<T>(h.step_size) * g / (sqrt(s[0]) + static_cast<T>(h.eps));
      return;
    }
    case Rule::kRowWiseAdagrad: {
      w -= static_cast<T>(h.lr) * g / (sqrt(row_sum) + static_cast<T>(h.eps));
      return;
    }
    case Rule::kAdam:
    case Rule::kAdamW: {
      if (rule == Rule::kAdamW) w *= static_cast<T>(h.one_minus_decay);
      s[0] += static_cast<T>(h.one_minus_a) * (g - s[0]);  // torch's lerp_(grad, 1 - beta1)
      s[1] = static_cast<T>(h.b) * s[1] + static_cast<T>(h.one_minus_b) * g * g;
      T second = s[1];
      if (h.flags & kAmsgrad) {
        s[2] = s[2] > s[1] ? s[2] : s[1];
        second = s[2];
      }
      const T denom = sqrt(second) / static_cast<T>(h.bc2_sqrt) + static_cast<T>(h.eps);
      w -= static_cast<T>(h.step_size) * s[0] / denom;
      return;
    }
    case Rule::kPartialRowWiseAdam: {
      // Adam with its second moment one value per row (FBGEMM's PARTIAL_ROWWISE_ADAM): the
      // decay is decoupled, lr * weight_decay times the weight before the step.
      const T decay = static_cast<T>(h.lr * h.weight_decay) * w;
      s[0] += static_cast<T>(h.one_minus_a) * (g - s[0]);
      const T denom = sqrt(row_sum) / static_cast<T>(h.bc2_sqrt) + static_cast<T>(h.eps);
      w -= static_cast<T>(h.step_size) * s[0] / denom + decay;
      return;
    }
  }
}

}  // namespace speedtorch_ops::optim
