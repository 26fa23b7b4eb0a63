/* y = x W^T for one to a few hundred rows in bfloat16 with AVX512-BF16 dot products
 * (for CPUs with AVX512-BF16 and no AMX).
 *
 * x [M, K] bf16 (row stride ldx), W laid out as for the AMX kernel (``cpu_amx.pack``):
 * [N/16][K/32][16 k-pairs][16 n][2] bf16, so each 64-byte line of W holds one pair of k for
 * 16 output columns. y [M, N] bf16 (row stride ldy), accumulated in float32, rounded once.
 *
 * vdpbf16ps multiplies a line of W by one pair of x's elements broadcast to every lane and
 * adds each pair's sum into 16 float32 column accumulators, so no horizontal sums are left
 * at the end. Each thread takes a contiguous share of the 16-column blocks and walks them
 * three at a time; every chunk of up to eight rows of x walks the three blocks with 24
 * accumulators in registers while their weights sit in L1/L2, so the weights are read from
 * memory once per call. From five rows up the product is bound by arithmetic more than by
 * memory, and the first row chunk alone would wait on memory while the later ones find
 * the weights in cache: so every chunk also prefetches (into L2) its share of the next
 * blocks' weights, and the memory stream overlaps all the arithmetic (16 rows: 13.5 ->
 * 11.6 ms for the 121 products of a SmolLM2-135M forward on a 2-core Zen 4). Up to four
 * rows, where memory bounds the product, the hardware prefetcher alone measured best.
 * Requires K % 32 == 0 and N % 16 == 0 (the driver checks). The torch reference is
 * ``dataplane.kernels.cpu_gemv.gemv_torch``.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MR 8 /* rows of x per register tile */
#define NB 3 /* column blocks of 16 per register tile: MR * NB accumulators */

/* ``nbk`` (1..NB) column blocks against ``mr`` (1..MR) rows of x; both constant after inlining.
 * Each of its steps also prefetches ``pf_n`` lines from ``*pf`` onwards, up to ``pf_end``. */
static inline __attribute__((always_inline)) void tile(const uint16_t *xa, int64_t ldx, const uint16_t *wb,
                                                       int64_t kb_count, uint16_t *y, int64_t ldy,
                                                       const char **pf, const char *pf_end, int pf_n,
                                                       const int mr, const int nbk) {
    const int64_t step = kb_count * 512; /* one column block's packed weights */
    __m512 acc[MR][NB];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nbk; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kb_count; kb++) {
        const uint16_t *w = wb + kb * 512;
        for (int p = 0; p < 16; p++) {
            __m512bh b[NB];
            for (int j = 0; j < nbk; j++) b[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * step + p * 32));
            for (int i = 0; i < pf_n; i++)
                if (*pf < pf_end) { _mm_prefetch(*pf, _MM_HINT_T1); *pf += 64; }
            for (int m = 0; m < mr; m++) {
                int32_t pair;
                memcpy(&pair, xa + m * ldx + kb * 32 + 2 * p, 4);
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < nbk; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nbk; j++) /* round to nearest even, as PyTorch's float -> bfloat16 */
            _mm256_storeu_si256((__m256i *)(y + m * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[m][j]));
}

#define ROWS(NBK)                                                          \
    switch (rows) {                                                        \
    case 8: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 8, NBK); break;           \
    case 7: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 7, NBK); break;           \
    case 6: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 6, NBK); break;           \
    case 5: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 5, NBK); break;           \
    case 4: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 4, NBK); break;           \
    case 3: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 3, NBK); break;           \
    case 2: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 2, NBK); break;           \
    default: tile(xa, ldx, wb, kb_count, ya, ldy, &pf, pf_end, pf_n, 1, NBK); break;          \
    }

/* Every row chunk of x over ``nbk`` blocks starting at block ``nb``. */
static void blocks(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int64_t nb, int64_t kb_count,
                   uint16_t *y, int64_t ldy, int nbk, int64_t end) {
    const uint16_t *wb = wp + nb * kb_count * 512;
    /* the next blocks' weights fetched while these are multiplied, spread over every row chunk */
    const char *pf = (const char *)(wb + nbk * kb_count * 512);
    const char *pf_end = (const char *)(wp + (nb + nbk + NB < end ? nb + nbk + NB : end) * kb_count * 512);
    const int chunks = (M + MR - 1) / MR;
    const int pf_n = M <= 4 ? 0 : (NB + chunks - 1) / chunks;
    for (int m0 = 0; m0 < M; m0 += MR) {
        const int rows = M - m0 < MR ? M - m0 : MR;
        const uint16_t *xa = x + (int64_t)m0 * ldx;
        uint16_t *ya = y + (int64_t)m0 * ldy + nb * 16;
        if (nbk == 3) {
            ROWS(3)
        } else if (nbk == 2) {
            ROWS(2)
        } else {
            ROWS(1)
        }
    }
}

int adaflash_dpbf16_gemm(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int64_t N, int64_t K,
                         uint16_t *y, int64_t ldy, int threads) {
    if (M < 1 || K % 32 || N % 16) return 1;
    const int64_t nb_count = N / 16, kb_count = K / 32;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        /* a contiguous share of the column blocks per thread, NB at a time, then the rest */
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t nb = nb_count * t / n;
        const int64_t end = nb_count * (t + 1) / n;
        for (; nb + NB <= end; nb += NB) blocks(x, ldx, M, wp, nb, kb_count, y, ldy, NB, end);
        if (nb < end) blocks(x, ldx, M, wp, nb, kb_count, y, ldy, (int)(end - nb), end);
    }
    return 0;
}
