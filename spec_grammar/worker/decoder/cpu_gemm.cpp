// Small-batch float32 projections on x86-64 with AVX-512: y[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]) for up to a few dozen rows m. Built on first use by cpu_gemm.py (g++ -O3
// -march=native -fopenmp) and called through ctypes.
//
// Why: a verify forward of a few tokens is bound by streaming the weights from memory once. A
// GEMM library tuned for large M reaches about half the memory bandwidth at M = 1 and falls to
// a third at M = 8 (SmolLM2's LM head, one core: oneDNN 8.3 ms at M = 1, 15 ms at M = 8;
// this kernel 5.5 ms and 7 ms). Each weight row is read from memory once and multiplied
// with up to 8 rows of x held in L1; weights are prefetched 32 KiB ahead into L2, which keeps
// enough cache-line misses in flight when the FMAs per byte grow with M.
//
// Every output element is the same sequence of operations whatever M is (16-wide partial
// sums over k in order, then one horizontal sum): a row's result does not depend on the
// other rows of the batch.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>

namespace {

constexpr int kPrefetchBytes = 32768;
constexpr int64_t kChunkRows = 64;  // weight rows per task: 64 x K floats stay in L2
constexpr int kMaxTileRows = 8;     // rows of x per pass over a chunk

template <int MB, int R>
inline void dot_rows(const float* __restrict x, int64_t ldx, const float* __restrict w,
                     int64_t K, float* __restrict y, int64_t ldy, const float* bias, int64_t n,
                     int64_t kfull, __mmask16 tail) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  const float* w0 = w + n * K;
  for (int64_t k = 0; k < kfull; k += 16) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) {
      v[r] = _mm512_loadu_ps(w0 + r * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + k) + kPrefetchBytes, _MM_HINT_T1);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(xv, v[r], acc[r][m]);
    }
  }
  if (tail) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm512_maskz_loadu_ps(tail, w0 + r * K + kfull);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + kfull);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(xv, v[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = bias ? bias[n + r] : 0.f;
    for (int m = 0; m < MB; ++m) y[m * ldy + n + r] = _mm512_reduce_add_ps(acc[r][m]) + b;
  }
}

// Weight rows [n0, n1) against MB rows of x. Fewer rows of x leave registers for more weight
// rows at once (more independent accumulators).
template <int MB>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
          const float* bias, int64_t n0, int64_t n1) {
  const int64_t kfull = K & ~int64_t(15);
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - kfull)) - 1u);
  constexpr int R = MB <= 2 ? 8 : (MB <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + R <= n1; n += R) dot_rows<MB, R>(x, ldx, w, K, y, ldy, bias, n, kfull, tail);
  for (; n < n1; ++n) dot_rows<MB, 1>(x, ldx, w, K, y, ldy, bias, n, kfull, tail);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                        const float*, int64_t, int64_t);
constexpr TileFn kTiles[kMaxTileRows + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                             tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

// x: (M, K) with row stride ldx; w: (N, K) contiguous; bias: (N,) or null; y: (M, N) with row
// stride ldy. Runs on `threads` OpenMP threads (the process's libgomp: torch's, by soname).
extern "C" void sg_linear_f32(const float* x, int64_t M, int64_t ldx, const float* w, int64_t N,
                              int64_t K, const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t tasks = (N + kChunkRows - 1) / kChunkRows;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * kChunkRows;
    const int64_t n1 = n0 + kChunkRows < N ? n0 + kChunkRows : N;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
      const int64_t mb = M - m0 < kMaxTileRows ? M - m0 : kMaxTileRows;
      kTiles[mb](x + m0 * ldx, ldx, w, K, y + m0 * ldy, ldy, bias, n0, n1);
    }
  }
}
