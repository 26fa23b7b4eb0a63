/* y = x W^T for a few rows of x in float32, with AVX2 and FMA.
 *
 *   x [M, K] f32 (row stride ldx), W [N, K] f32 row-major, y [M, N] f32 (row stride ldy),
 *   1 <= M <= 128, K a multiple of 8; ``threads``: PyTorch's intra-op thread count.
 *
 * A float32 decode step multiplies one row (a verify step a few) by every weight matrix:
 * the product is bound by reading W once, and two cores of AVX2 FMA do about twelve rows'
 * products in the time one row of W streams in. Each thread takes a contiguous share of
 * W's rows and streams each block of R rows once; the rows of x go past it MB at a time
 * while the block stays in L1.
 *
 * Every output y[m, n] is one 8-lane float32 accumulator over k = 0, 8, 16, ... in order,
 * summed across its lanes by a fixed tree, whatever M, the blocking or the threads are:
 * a row's result does not depend on the rows beside it (decode and verify agree bit for
 * bit).
 *
 * Reference: dataplane.kernels.cpu_gemv_f32.gemv_torch (the same products; the order of
 * the additions differs, so results agree to float32 rounding).
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* R rows of W against rows m0 .. m0 + MB - 1 of x (fewer where M ends): R * MB accumulators. */
#define BLOCK(NAME, R, MB)                                                                          \
    static void NAME(const float *x, int64_t ldx, int mrows, const float *w, int64_t K, int nrows,   \
                     float *y, int64_t ldy, int prefetch) {                                          \
        __m256 acc[MB][R];                                                                           \
        const float *xr[MB];                                                                         \
        const float *wr[R];                                                                          \
        for (int m = 0; m < MB; m++) xr[m] = x + (m < mrows ? m : 0) * ldx;                          \
        for (int r = 0; r < R; r++) wr[r] = w + (r < nrows ? r : 0) * K;                             \
        for (int m = 0; m < MB; m++)                                                                 \
            for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();                             \
        for (int64_t k = 0; k < K; k += 8) {                                                         \
            __m256 wv[R];                                                                            \
            for (int r = 0; r < R; r++) {                                                            \
                if (prefetch) _mm_prefetch((const char *)(wr[r] + R * K + k), _MM_HINT_T0);          \
                wv[r] = _mm256_loadu_ps(wr[r] + k);                                                  \
            }                                                                                        \
            for (int m = 0; m < MB; m++) {                                                           \
                __m256 xv = _mm256_loadu_ps(xr[m] + k);                                              \
                for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);       \
            }                                                                                        \
        }                                                                                            \
        for (int m = 0; m < mrows && m < MB; m++)                                                    \
            for (int r = 0; r < nrows && r < R; r++) y[m * ldy + r] = hsum(acc[m][r]);               \
    }

BLOCK(block_one, 8, 1)
BLOCK(block_two, 4, 2)
BLOCK(block_many, 3, 4)

int adaflash_gemv_f32(const float *x, int64_t ldx, int M, const float *w, int64_t N, int64_t K, float *y,
                      int64_t ldy, int threads) {
    if (M < 1 || M > 128 || K % 8 != 0) return 1;
    /* R rows of W per block: eight for one row of x (streaming), four for two, three for more */
    const int R = M == 1 ? 8 : M == 2 ? 4 : 3;
    int64_t blocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n = b * R;
        int nrows = (int)(N - n < R ? N - n : R);
        const float *wb = w + n * K;
        if (M == 1) {
            block_one(x, ldx, 1, wb, K, nrows, y + n, ldy, 1);
        } else if (M == 2) {
            block_two(x, ldx, 2, wb, K, nrows, y + n, ldy, 1);
        } else {
            /* the block streams in with the first rows of x; later rows find it in L1 */
            for (int m0 = 0; m0 < M; m0 += 4)
                block_many(x + m0 * ldx, ldx, M - m0, wb, K, nrows, y + m0 * ldy + n, ldy, m0 == 0);
        }
    }
    return 0;
}
