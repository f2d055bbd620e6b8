// Attention of a few query tokens per request over the KV store, float32, x86-64 AVX-512:
// out[b, i, h] = softmax_j(scale * q[b, h, i] . k[row_b, h / G, j] + mask[b, i, j]) v[row_b, h / G, j]
// for j < kv. Built on first use by cpu_attention.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes.
//
// Why: a decode or draft-tree verify step attends a few queries per request to a few hundred
// cached keys; torch's SDPA over k_buf[rows, :, :kv] gathers those rows first (a copy when the
// rows are an index tensor) and runs at about a quarter of the memory bandwidth there. Here one
// task per (request, KV head) reads that head's keys and values in place, once each, for all
// its G query heads and query tokens:
//   1. scores: 16 keys at a time (in L1), each query's 16 dot products summed by one transposing
//      reduction tree, then scaled and masked, into a per-thread buffer (queries x kv); the keys
//      16 positions ahead are prefetched into L1 and this block's values into L2, so both
//      streams are in flight at once (SmolLM2, 8 requests x 1 token over 300 keys, one core:
//      302 us a layer without the prefetches, 196 us with them, 132 us to merely read them);
//   2. softmax per query row: max-subtracted, exp by range reduction to [-ln2/2, ln2/2] and a
//      degree-7 Taylor polynomial (relative error ~1e-7, float rounding);
//   3. values: each value row read once per block of queries held in registers (from L2),
//      while the next task's keys are prefetched into L2 (5-10% less time, all shapes).
// The buffer grows to the largest queries x kv seen per thread and is kept.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPrefetchKeys = 16;  // 4 KiB ahead at D = 64

// r[i] = sum of the 16 lanes of a[i]
inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    // pairs of floats moved as doubles, added as floats
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                       _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// exp(x) for x <= 0 (scores minus their row's maximum); below -87 it returns ~1e-38, which the
// normalisation cannot tell from 0
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // Cody-Waite: ln 2 split so that n * hi is exact
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Task {
  const float* q;     // query row (g, i) at q + (g * n + i) * D
  const float* k;     // key j at k + j * ps
  const float* v;     // value j at v + j * ps
  const float* mask;  // mask row i at mask + i * mrs
  float* out;         // output row (g, i) at out + i * ors + g * D
  const float* next;  // the next task's keys, prefetched into L2 during this one's values
  int64_t n, nq, G, ps, mrs, ors, kv;
  float scale;
};

// Scores of rows [0, G * nq) (row r = g * nq + i) into S (row stride ld), scaled and masked.
template <int C>
void scores(const Task& t, float* S, int64_t ld) {
  constexpr int D = 16 * C;
  for (int64_t j0 = 0; j0 < t.kv; j0 += 16) {
    const int64_t left = t.kv - j0;
    const __mmask16 live = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    const float* kp[16];
    for (int jj = 0; jj < 16; ++jj)  // past the end: the last key again, its lanes not stored
      kp[jj] = t.k + (jj < left ? j0 + jj : t.kv - 1) * t.ps;
    // keys kPrefetchKeys ahead into L1, and this block's values into L2 for the third pass
    const int64_t ahead = j0 + kPrefetchKeys;
    for (int jj = 0; jj < 16; ++jj) {
      const char* kn = reinterpret_cast<const char*>(t.k + (ahead + jj) * t.ps);
      const char* vn = reinterpret_cast<const char*>(t.v + (j0 + jj < t.kv ? j0 + jj : t.kv - 1) * t.ps);
      for (int c = 0; c < C; ++c) {
        if (ahead + jj < t.kv) _mm_prefetch(kn + 64 * c, _MM_HINT_T0);
        _mm_prefetch(vn + 64 * c, _MM_HINT_T1);
      }
    }
    for (int64_t g = 0; g < t.G; ++g) {
      for (int64_t i = 0; i < t.nq; ++i) {
        const float* qr = t.q + (g * t.n + i) * D;
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qr + 16 * c);
        __m512 acc[16];
        for (int jj = 0; jj < 16; ++jj) {
          acc[jj] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp[jj]));
          for (int c = 1; c < C; ++c)
            acc[jj] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kp[jj] + 16 * c), acc[jj]);
        }
        const __m512 m = _mm512_maskz_loadu_ps(live, t.mask + i * t.mrs + j0);
        const __m512 s = _mm512_fmadd_ps(sum16(acc), _mm512_set1_ps(t.scale), m);
        _mm512_mask_storeu_ps(S + (g * t.nq + i) * ld + j0, live, s);
      }
    }
  }
}

// Row r of S becomes exp(S - max) over its kv entries; returns 1 / their sum.
inline float softmax_row(float* s, int64_t kv) {
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t j = 0; j < kv; j += 16) {
    const __mmask16 live = kv - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (kv - j)) - 1u);
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kv; j += 16) {
    const __mmask16 live = kv - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (kv - j)) - 1u);
    const __m512 e =
        _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m)));
    _mm512_mask_storeu_ps(s + j, live, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// Output rows [r0, r0 + R) of P (rows of S after softmax_row, inverse sums in inv) times V.
template <int C, int R>
void values(const Task& t, const float* P, int64_t ld, const float* inv, int64_t r0) {
  constexpr int D = 16 * C;
  if constexpr (R > 1) {
    if (t.G * t.nq - r0 < R) return values<C, R - 1>(t, P, ld, inv, r0);
  }
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < t.kv; ++j) {
    const float* vp = t.v + j * t.ps;
    if (r0 == 0 && t.next)
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(t.next + j * t.ps) + 64 * c, _MM_HINT_T1);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vp + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(P[(r0 + r) * ld + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t g = (r0 + r) / t.nq, i = (r0 + r) % t.nq;
    float* o = t.out + i * t.ors + g * D;
    const __m512 w = _mm512_set1_ps(inv[r0 + r]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[r][c], w));
  }
}

template <int C>
void run_task(const Task& t) {
  constexpr int D = 16 * C;
  constexpr int R = C >= 8 ? 3 : (C >= 4 ? 6 : (C >= 2 ? 8 : 12));  // R * C + C registers
  for (int64_t i = t.nq; i < t.n; ++i)  // queries past nq: padding, their output zero
    for (int64_t g = 0; g < t.G; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.out + i * t.ors + g * D + 16 * c, _mm512_setzero_ps());
  const int64_t rows = t.G * t.nq;
  if (rows == 0) return;
  const int64_t ld = (t.kv + 15) & ~int64_t(15);
  thread_local std::vector<float> buf;
  if (buf.size() < size_t(rows * (ld + 1))) buf.resize(size_t(rows * (ld + 1)));
  float* S = buf.data();
  float* inv = S + rows * ld;
  scores<C>(t, S, ld);
  for (int64_t r = 0; r < rows; ++r) inv[r] = softmax_row(S + r * ld, t.kv);
  for (int64_t r0 = 0; r0 < rows; r0 += R) values<C, R>(t, S, ld, inv, r0);
}

using TaskFn = void (*)(const Task&);
constexpr TaskFn kTasks[9] = {nullptr,     run_task<1>, run_task<2>, run_task<3>, run_task<4>,
                              run_task<5>, run_task<6>, run_task<7>, run_task<8>};

}  // namespace

// q: (B, KH * G, n, D) contiguous; k, v: the store's buffers, request b's head h key j at
// k + rows[b] * rs + h * hs + j * ps (v likewise); mask: request b's row i at
// mask + b * mbs + i * mrs, kv entries; nq: (B,) queries computed per request (the rest are
// padding: zero output), or null for all n; out: (B, n, KH * G, D) contiguous. D = 16 * C,
// 1 <= C <= 8. Runs on `threads` OpenMP threads (the process's libgomp: torch's, by soname).
// Returns 0, or before any work 1 where a row is outside [0, R) and 2 where an nq is outside
// [0, n]: either would read or write outside the buffers, and B integer compares cost nothing.
extern "C" int sg_attention_f32(const float* q, int64_t B, int64_t KH, int64_t G, int64_t n,
                                int64_t D, const float* k, const float* v, const int64_t* rows,
                                int64_t R, int64_t rs, int64_t hs, int64_t ps, const float* mask,
                                int64_t mbs, int64_t mrs, int64_t kv, float scale,
                                const int64_t* nq, float* out, int threads) {
  for (int64_t b = 0; b < B; ++b) {
    if (rows[b] < 0 || rows[b] >= R) return 1;
    if (nq && (nq[b] < 0 || nq[b] > n)) return 2;
  }
  const TaskFn fn = kTasks[D / 16];
  const int64_t H = KH * G, tasks = B * KH;
  auto one = [&](int64_t task) {
    const int64_t b = task / KH, h = task % KH;
    const int64_t base = rows[b] * rs + h * hs;
    const int64_t after = task + 1;
    const float* next = after < tasks ? k + rows[after / KH] * rs + after % KH * hs : nullptr;
    const Task t{q + (b * H + h * G) * n * D,
                 k + base,
                 v + base,
                 mask + b * mbs,
                 out + (b * n * H + h * G) * D,
                 next,
                 n,
                 nq ? nq[b] : n,
                 G,
                 ps,
                 mrs,
                 H * D,
                 kv,
                 scale};
    fn(t);
  };
  if (threads <= 1 || tasks == 1) {
    for (int64_t task = 0; task < tasks; ++task) one(task);
    return 0;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) one(task);
  return 0;
}
