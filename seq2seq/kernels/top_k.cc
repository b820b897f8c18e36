// The k best entries of each row and the row's logsumexp, in one read of the row.
//
// Beam search needs, per row of logits, its best 2k tokens and their log-probabilities
// (logit - logsumexp of the row). XLA:CPU makes that three passes over the [N, V] logits
// (the maxima of the top-k's chunks, the row's max, the sum of exponentials) and its
// exponential costs ~0.6 ns per element; here a row is read while it sits in the cache:
// one pass keeps the k best (a block of 64 whose maximum cannot enter them is skipped
// after one vectorised max), a second sums exp(x - max) with a polynomial exp.
//
//   x       f32 [N, V]
//   values  f32 [N, k]   the k largest x of each row, best first (ties: the lower index)
//   indices s32 [N, k]
//   lse     f32 [N]      log(sum(exp(x)))
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "fast_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;
typedef float Lanes __attribute__((vector_size(64)));   // 16 floats: a vectorised max

float block_max(const float* x, int64_t size) {
  float top = -std::numeric_limits<float>::infinity();
  if (size == kBlock) {
    Lanes m, v;
    std::memcpy(&m, x, sizeof m);
    for (int64_t j = 16; j < kBlock; j += 16) {
      std::memcpy(&v, x + j, sizeof v);
      m = v > m ? v : m;
    }
    for (int l = 0; l < 16; ++l) top = std::max(top, m[l]);
    return top;
  }
  for (int64_t j = 0; j < size; ++j) top = std::max(top, x[j]);
  return top;
}

void row_top_k(const float* x, int64_t V, int64_t k, float* values, int32_t* indices,
               float* lse) {
  int64_t n = 0;   // entries kept so far, values[0] >= ... >= values[n - 1]
  auto offer = [&](float v, int32_t i) {
    if (n == k && !(v > values[k - 1])) return;   // a tie keeps the lower index
    int64_t at = n < k ? n++ : k - 1;
    while (at > 0 && v > values[at - 1]) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = v;
    indices[at] = i;
  };
  for (int64_t start = 0; start < V; start += kBlock) {
    const int64_t end = std::min(V, start + kBlock);
    if (n == k && !(block_max(x + start, end - start) > values[k - 1])) continue;
    for (int64_t j = start; j < end; ++j) offer(x[j], int32_t(j));
  }
  const float best = values[0];
  if (!std::isfinite(best)) {   // every entry -inf (or a NaN): as XLA would
    *lse = best;
    return;
  }
  float sum = 0.f;
  for (int64_t j = 0; j < V; ++j) sum += exp_nonpositive(x[j] - best);
  *lse = best + std::log(sum);
}

struct Tasks {
  std::atomic<int64_t> next{0}, done{0};
};

ffi::Error TopKLogsumexp(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> values,
                         ffi::ResultBuffer<ffi::S32> indices,
                         ffi::ResultBuffer<ffi::F32> lse) {
  auto xd = x.dimensions(), vd = values->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] < 1 || vd[1] > xd[1])
    return ffi::Error::InvalidArgument("top_k_logsumexp: x must be [N, V], values [N, k <= V]");
  const int64_t N = xd[0], V = xd[1], k = vd[1];
  const float* xs = x.typed_data();
  float* vs = values->typed_data();
  int32_t* is = indices->typed_data();
  float* ls = lse->typed_data();
  constexpr int64_t kRows = 8;   // rows per task
  const int64_t tasks = (N + kRows - 1) / kRows;
  auto state = std::make_shared<Tasks>();
  auto work = [=](Tasks* t) {
    for (int64_t i; (i = t->next.fetch_add(1)) < tasks;) {
      for (int64_t r = i * kRows; r < std::min(N, (i + 1) * kRows); ++r)
        row_top_k(xs + r * V, V, k, vs + r * k, is + r * k, ls + r);
      t->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state, work] { work(state.get()); });
  work(state.get());
  while (state->done.load() < tasks) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(seq2seq_top_k_logsumexp, TopKLogsumexp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
