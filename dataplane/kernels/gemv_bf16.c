/* y = x W^T for a few rows of x, bfloat16 in and out, float32 accumulation.
 *
 *   x [M, K] bf16 (row stride ldx), W [N, K] bf16 row-major, y [M, N] bf16 (row stride ldy),
 *   1 <= M <= 4, K a multiple of 32; ``threads``: PyTorch's intra-op thread count.
 *
 * A decode step multiplies one row (a verify step a few) by every weight matrix: the
 * product is bound by reading W once. Each thread takes a contiguous share of W's rows
 * and streams them once, four rows at a time, with AVX512-BF16 dot products
 * (vdpbf16ps: 32 bf16 products summed pairwise into 16 float32 lanes per instruction)
 * against every row of x, which stays in cache. Threads come from the OpenMP runtime
 * PyTorch already loaded, so they are PyTorch's intra-op threads.
 *
 * Reference: dataplane.kernels.cpu_gemv.gemv_torch (float32 accumulation of the same
 * products; the order of the additions differs, so results agree to bf16 rounding).
 */
#include <immintrin.h>
#include <stdint.h>

static inline uint16_t to_bf16(float f) {
    /* round to nearest even, as PyTorch's float -> bfloat16 conversion (inputs are finite) */
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* R rows of W at a time against M rows of x: R * M float32 accumulators stay in registers. */
#define BLOCK(NAME, R, MMAX)                                                                         \
    static void NAME(const uint16_t *x, int64_t ldx, int M, const uint16_t *w, int64_t K, int nrows,   \
                     uint16_t *y, int64_t ldy) {                                                      \
        __m512 acc[MMAX][R];                                                                          \
        for (int m = 0; m < MMAX; m++)                                                                \
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();                              \
        for (int64_t k = 0; k < K; k += 32) {                                                         \
            __m512bh wv[R];                                                                           \
            for (int r = 0; r < R; r++) {                                                             \
                const uint16_t *row = w + (r < nrows ? r : 0) * K + k;                                \
                _mm_prefetch((const char *)(row + R * K), _MM_HINT_T0);                               \
                wv[r] = (__m512bh)_mm512_loadu_si512((const void *)row);                              \
            }                                                                                         \
            for (int m = 0; m < M; m++) {                                                             \
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));          \
                for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);       \
            }                                                                                         \
        }                                                                                             \
        for (int m = 0; m < M; m++)                                                                   \
            for (int r = 0; r < nrows; r++) y[m * ldy + r] = to_bf16(_mm512_reduce_add_ps(acc[m][r])); \
    }

BLOCK(block_one, 8, 1)
BLOCK(block_few, 4, 4)

int adaflash_gemv_bf16(const uint16_t *x, int64_t ldx, int M, const uint16_t *w, int64_t N, int64_t K,
                       uint16_t *y, int64_t ldy, int threads) {
    if (M < 1 || M > 4 || K % 32 != 0) return 1;
    const int R = M == 1 ? 8 : 4;
    int64_t blocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n = b * R;
        int nrows = (int)(N - n < R ? N - n : R);
        if (M == 1)
            block_one(x, ldx, M, w + n * K, K, nrows, y + n, ldy);
        else
            block_few(x, ldx, M, w + n * K, K, nrows, y + n, ldy);
    }
    return 0;
}
