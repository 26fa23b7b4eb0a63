/* y = x W^T for a few rows in bfloat16 with AMX tiles (Intel AMX-BF16).
 *
 * x [M, K] bf16 (row stride ldx), W packed by ``adaflash_amx_pack`` layout:
 * [N/16][K/32][16 k-pairs][16 n][2] bf16, so one 1 KiB B tile per (16 columns, 32 k).
 * y [M, N] bf16 (row stride ldy), accumulated in float32 and rounded once.
 * Each thread takes blocks of 16 output columns and streams their packed weights once,
 * walking every 16-row chunk of x over the block while it sits in L1/L2.
 * Requires K % 32 == 0 and N % 16 == 0 (the driver checks). The torch reference is
 * ``dataplane.kernels.cpu_gemv.gemv_torch``.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Asks the kernel for the AMX tile state; 0 when granted. */
int adaflash_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

static void config(int rows) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    /* tiles 0-3: C [rows x 16 fp32], four column blocks; 4: A [rows x 32 bf16]; 5-7: B [16 x 32 bf16] */
    for (int t = 0; t < 5; t++) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
    for (int t = 5; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

static void store(int t, float *acc, uint16_t *y, int64_t ldy, int rows) {
    switch (t) {  /* tile numbers are immediates */
    case 0: _tile_stored(0, acc, 64); break;
    case 1: _tile_stored(1, acc, 64); break;
    case 2: _tile_stored(2, acc, 64); break;
    default: _tile_stored(3, acc, 64); break;
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 16; c++) y[(int64_t)r * ldy + c] = to_bf16(acc[r * 16 + c]);
}

/* Four blocks of 16 columns at once (independent accumulators hide the tile op's latency). */
static void block4(const uint16_t *xa, int64_t ldx, const uint16_t *wb, int64_t kb_count, uint16_t *y,
                   int64_t ldy, int rows, float *acc) {
    const int64_t step = kb_count * 512;  /* one column block's packed weights */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, xa + kb * 32, ldx * 2);
        _tile_loadd(5, wb + kb * 512, 64);
        _tile_loadd(6, wb + step + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(7, wb + 2 * step + kb * 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, wb + 3 * step + kb * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
    for (int t = 0; t < 4; t++) store(t, acc, y + 16 * t, ldy, rows);
}

static void block1(const uint16_t *xa, int64_t ldx, const uint16_t *wb, int64_t kb_count, uint16_t *y,
                   int64_t ldy, int rows, float *acc) {
    _tile_zero(0);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, xa + kb * 32, ldx * 2);
        _tile_loadd(5, wb + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    store(0, acc, y, ldy, rows);
}

int adaflash_amx_gemm_bf16(const uint16_t *x, int64_t ldx, int M, const uint16_t *wp, int64_t N, int64_t K,
                           uint16_t *y, int64_t ldy, int threads) {
    if (M < 1 || K % 32 || N % 16) return 1;
    const int64_t nb_count = N / 16, kb_count = K / 32;
    const int64_t groups = (nb_count + 3) / 4;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float acc[16 * 16] __attribute__((aligned(64)));
        int cur = -1;
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t nb0 = gi * 4;
            const int64_t nbs = nb_count - nb0 < 4 ? nb_count - nb0 : 4;
            for (int m0 = 0; m0 < M; m0 += 16) {
                int rows = M - m0 < 16 ? M - m0 : 16;
                if (rows != cur) { config(rows); cur = rows; }
                const uint16_t *xa = x + (int64_t)m0 * ldx;
                uint16_t *ya = y + (int64_t)m0 * ldy;
                if (nbs == 4) {
                    block4(xa, ldx, wp + nb0 * kb_count * 512, kb_count, ya + nb0 * 16, ldy, rows, acc);
                } else {
                    for (int64_t nb = nb0; nb < nb0 + nbs; nb++)
                        block1(xa, ldx, wp + nb * kb_count * 512, kb_count, ya + nb * 16, ldy, rows, acc);
                }
            }
        }
        if (cur >= 0) _tile_release();
    }
    return 0;
}
