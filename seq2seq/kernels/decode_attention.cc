// Attention of a decode step on the CPU, read once from a bfloat16 (or float32) cache.
//
// XLA:CPU runs a bfloat16 attention dot on a float32 copy of its operands, made anew at each
// step for a cache that changes every step: reading the cache costs three times its bytes.
// This kernel reads keys and values once, in their own dtype, for every query of a row,
// and skips the keys a query may not attend to (a cache not yet filled, padding). The
// softmax's exponentials are a polynomial (fast_exp.h) the compiler vectorises.
//
//   q     f32  [B, H, Q, D]   queries, already scaled by 1/sqrt(D)
//   k, v  bf16 (or its bits, u16) or f32 [B, H, K, D]
//   mask  pred [Bm, Qm, K]    Bm in {1, B}, Qm in {1, Q}: true = may attend
//   rows  s32  [B, K]         (seq2seq_decode_attention_rows only) the row of k and v that
//                             holds key j of row b: beam search reads each hypothesis's
//                             keys where its ancestors wrote them instead of moving the cache
//   out   f32  [B, H, Q, D]   softmax(q.k^T) v over the allowed keys; 0 where none is
//
// Each (b, h) is one task; tasks are shared between the calling thread and XLA's intra-op
// thread pool through an atomic counter, a few at a time, so the caller never waits on a
// task nobody runs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "fast_exp.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {   // bfloat16 -> float32: the top half of the bits
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Shape {
  int64_t heads, queries, keys, dim, mask_rows, mask_queries;
};

// Key j of row b, head h: in row `rows[j]` of the cache if rows is given, else in row b.
struct KeyAt {
  const int32_t* rows;
  int64_t b, h, heads, keys, dim, batch;
  int64_t operator()(int64_t j) const {
    const int64_t r = rows ? std::clamp<int64_t>(rows[j], 0, batch - 1) : b;
    return ((r * heads + h) * keys + j) * dim;
  }
};

template <typename T>
void attend_row(const Shape& s, const float* q, const T* k, const T* v, const bool* mask,
                const KeyAt& at, float* out, std::vector<float>& scores) {
  const int64_t Q = s.queries, K = s.keys, D = s.dim;
  const int64_t mq = s.mask_queries == 1 ? 0 : K;   // mask stride between queries
  for (int64_t j = 0; j < K; ++j) {   // scores of the keys a query may attend to
    const T* kj = k + at(j);
    for (int64_t i = 0; i < Q; ++i) {
      if (!mask[i * mq + j]) continue;
      const float* qi = q + i * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qi[d] * widen(kj[d]);
      scores[i * K + j] = dot;
    }
  }
  for (int64_t i = 0; i < Q; ++i) {
    float* si = scores.data() + i * K;
    const bool* mi = mask + i * mq;
    float top = -INFINITY;
    for (int64_t j = 0; j < K; ++j) top = mi[j] ? std::max(top, si[j]) : top;
    if (top == -INFINITY) {   // no key to attend to: a zero output
      std::fill(si, si + K, 0.f);
      continue;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < K; ++j) {   // (a masked key's score is stale: selected away)
      si[j] = mi[j] ? exp_nonpositive(si[j] - top) : 0.f;
      sum += si[j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < K; ++j) si[j] *= inv;
  }
  std::fill(out, out + Q * D, 0.f);
  for (int64_t j = 0; j < K; ++j) {
    const T* vj = v + at(j);
    for (int64_t i = 0; i < Q; ++i) {
      const float p = scores[i * K + j];
      if (p == 0.f) continue;
      float* oi = out + i * D;
      for (int64_t d = 0; d < D; ++d) oi[d] += p * widen(vj[d]);
    }
  }
}

struct Tasks {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename T>
ffi::Error run(ffi::ThreadPool pool, const float* q, const T* k, const T* v, const bool* mask,
               const int32_t* key_rows, float* out, int64_t rows, Shape s) {
  const int64_t tasks = rows * s.heads;
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(),
                                                                  tasks - 1));
  // Tasks taken a few at a time: one counter update per task costs more than a small
  // model's task (two cores contending for the counter's cache line).
  const int64_t grain = std::max<int64_t>(1, tasks / (8 * (helpers + 1)));
  auto state = std::make_shared<Tasks>();
  auto work = [=](Tasks* t) {
    std::vector<float> scores(s.queries * s.keys);
    for (int64_t start; (start = t->next.fetch_add(grain)) < tasks;) {
      const int64_t end = std::min(tasks, start + grain);
      for (int64_t i = start; i < end; ++i) {
        const int64_t b = i / s.heads;
        const bool* m = mask + (s.mask_rows == 1 ? 0 : b) * s.mask_queries * s.keys;
        const KeyAt at{key_rows ? key_rows + b * s.keys : nullptr, b, i % s.heads, s.heads,
                       s.keys, s.dim, rows};
        attend_row<T>(s, q + i * s.queries * s.dim, k, v, m, at,
                      out + i * s.queries * s.dim, scores);
      }
      t->done.fetch_add(end - start);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state, work] { work(state.get()); });
  work(state.get());
  while (state->done.load() < tasks) {   // the last tasks taken by helpers: microseconds
  }
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                  ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask, const int32_t* key_rows,
                  ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 3 || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || md[2] != kd[2] || v.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin()) ||
      k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("decode_attention: mismatched shapes");
  Shape s{qd[1], qd[2], kd[2], qd[3], md[0], md[1]};
  const bool* m = mask.typed_data();
  if (k.element_type() == ffi::F32)
    return run(pool, q.typed_data(), static_cast<const float*>(k.untyped_data()),
               static_cast<const float*>(v.untyped_data()), m, key_rows, out->typed_data(),
               qd[0], s);
  if (k.element_type() == ffi::BF16 || k.element_type() == ffi::U16)   // U16: bf16's bits
    return run(pool, q.typed_data(), static_cast<const uint16_t*>(k.untyped_data()),
               static_cast<const uint16_t*>(v.untyped_data()), m, key_rows,
               out->typed_data(), qd[0], s);
  return ffi::Error::InvalidArgument(
      "decode_attention: keys must be bfloat16 (or its bits, uint16) or float32");
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask,
                           ffi::ResultBuffer<ffi::F32> out) {
  return Attend(pool, q, k, v, mask, nullptr, out);
}

ffi::Error DecodeAttentionRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> rows,
                               ffi::ResultBuffer<ffi::F32> out) {
  auto rd = rows.dimensions(), kd = k.dimensions();
  if (rd.size() != 2 || kd.size() != 4 || rd[0] != kd[0] || rd[1] != kd[2])
    return ffi::Error::InvalidArgument("decode_attention: rows must be [B, K]");
  return Attend(pool, q, k, v, mask, rows.typed_data(), out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(seq2seq_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(seq2seq_decode_attention_rows, DecodeAttentionRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
