/* Every decoder layer of a bfloat16 forward (decode, verify or prompt) in one call.
 *
 * Where a node serves bfloat16 on CPU the products, the norms, the rotation and attention
 * already ran in kernels of our own, one call each from Python: per layer two norms, the
 * rotation, attention, four products, the SiLU-gated product and two residual adds, each a
 * ctypes call or a PyTorch operator that found the interpreter and the dispatcher evicted
 * from the caches by the weights streaming past. Here the layers run back to back in C,
 * calling the same kernels through the function pointers the driver hands over
 * (``cpu_forward_bf16``): the libraries the Python path loads, built with their own flags,
 * so every product, norm, rotation and attention row is computed exactly as there.
 *
 *   h = rms_norm(x) * ln1;  qkv = h Wqkv^T;  rotate q and k;  store k, v and attend;
 *   x += attn Wo^T;  h = rms_norm(x) * ln2;  gu = h Wgu^T;  x += (silu(g) * u) Wdown^T
 *
 * x [T, H] bfloat16 is updated in place; after layer l it is copied to hidden[:, s] for
 * every slot s with slot_layer[s] == l (hidden [T, S, H] bfloat16). weights: 10 pointers a
 * layer: ln1 [H], Wqkv [(heads + 2 kvh) d, H], Wo [H, heads d], ln2 [H], Wgu [2 inter, H],
 * Wdown [H, inter] row-major bfloat16, then the four matrices in the tiled kernel's layout
 * (``cpu_amx.pack``). A product of up to ``gemv_rows`` rows goes to the streaming GEMV on the
 * row-major matrix, any other to the tiled kernel (at most ``TILED_ROWS`` rows a call).
 * cos, sin [T, d] bfloat16. The stream's requests and caches are as
 * ``adaflash_attend_cached_batch`` takes them.
 *
 * Every value is rounded to bfloat16 where the Python path (``dataplane.fused_layers``)
 * rounds: the residual adds, the SiLU and the gated product. The SiLU's float32 value may
 * differ from PyTorch's in its last bit (x * sigmoid(x) against x / (1 + exp(-x))), which
 * the rounding to bfloat16 hides but for rare ties.
 *
 * Reference: dataplane.kernels.cpu_forward.layers_torch in bfloat16.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_f32.h"

typedef int (*product_fn)(const uint16_t *x, int64_t ldx, int M, const uint16_t *w, int64_t N, int64_t K,
                          uint16_t *y, int64_t ldy, int threads);
typedef void (*norm_fn)(const uint16_t *x, int64_t ldx, const uint16_t *w, float eps, int64_t rows, int64_t H,
                        uint16_t *y, int64_t ldy, int threads);
typedef void (*rotary_fn)(const uint16_t *x, int64_t ldx, int64_t T, int64_t heads, int64_t d,
                          const uint16_t *cos, const uint16_t *sin, uint16_t *out, int threads);
typedef int (*attend_fn)(const void *q, int64_t ldq, const void *k_new, int64_t ldk, const void *v_new,
                         int64_t ldv, int64_t B, const int64_t *row0, const int64_t *n, float *const *caches,
                         const int64_t *layer_stride, const int64_t *cap, const int64_t *start, int64_t layer,
                         int64_t heads, int64_t kvh, int64_t d, void *out, int64_t ldo, int is_bf16, float scale,
                         int threads);

typedef struct {
    product_fn gemv;  /* may be NULL when gemv_rows == 0 */
    product_fn tiled;
    norm_fn rms_norm;
    rotary_fn rotary;
    attend_fn attend;
    int64_t gemv_rows;
    int64_t tiled_rows;
} kernels_t;

/* y [T, N] = x [T, K] W^T: up to gemv_rows rows through the GEMV, else tiled_rows a call. */
static int product(const kernels_t *k, const uint16_t *x, int64_t ldx, int64_t T, const uint16_t *w,
                   const uint16_t *tiles, int64_t N, int64_t K, uint16_t *y, int64_t ldy, int threads) {
    if (T <= k->gemv_rows)
        return k->gemv(x, ldx, (int)T, w, N, K, y, ldy, threads);
    for (int64_t t0 = 0; t0 < T; t0 += k->tiled_rows) {
        const int M = (int)(T - t0 < k->tiled_rows ? T - t0 : k->tiled_rows);
        const int rc = k->tiled(x + t0 * ldx, ldx, M, tiles, N, K, y + t0 * ldy, ldy, threads);
        if (rc)
            return rc;
    }
    return 0;
}

/* x[j] = bf16(x[j] + y[j]) over n values: a bfloat16 add as PyTorch rounds it. */
static void add_rows(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        x[j] = bf16(f32(x[j]) + f32(y[j]));
}

/* a[t, j] = bf16(bf16(silu(g)) * u) with g = gu[t, j], u = gu[t, inter + j], into the first
 * half of each row of gu [T, 2 inter] (inter % 8 == 0); silu(x) = x * sigmoid(x) with
 * e = exp(-|x|): sigmoid = 1 / (1 + e) for x >= 0, e / (1 + e) below. */
static void silu_mul_rows(uint16_t *gu, int64_t T, int64_t inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (T * inter >= 32768)
    for (int64_t t = 0; t < T; t++) {
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        uint16_t *g = gu + t * 2 * inter, *u = g + inter;
        for (int64_t j = 0; j < inter; j += 8) {
            float gf[8], sf[8];
            for (int i = 0; i < 8; i++)
                gf[i] = f32(g[j + i]);
            const __m256 x = _mm256_loadu_ps(gf);
            const __m256 e = exp_nonpos8(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            const __m256 den = _mm256_add_ps(one, e);
            const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
            _mm256_storeu_ps(sf, _mm256_mul_ps(x, _mm256_div_ps(_mm256_blendv_ps(e, one, pos), den)));
            for (int i = 0; i < 8; i++)
                g[j + i] = bf16(f32(bf16(sf[i])) * f32(u[j + i]));
        }
    }
}

int adaflash_forward_bf16(uint16_t *x, int64_t T, int64_t H, int64_t layers, const uint16_t *const *weights,
                          int64_t heads, int64_t kvh, int64_t d, int64_t inter, float eps, const uint16_t *cos,
                          const uint16_t *sin, int64_t B, const int64_t *row0, const int64_t *n,
                          float *const *caches, const int64_t *layer_stride, const int64_t *cap,
                          const int64_t *start, uint16_t *hidden, int64_t slots, const int64_t *slot_layer,
                          void *const *fns, int64_t gemv_rows, int64_t tiled_rows, int threads) {
    const kernels_t k = {(product_fn)fns[0], (product_fn)fns[1], (norm_fn)fns[2], (rotary_fn)fns[3],
                         (attend_fn)fns[4], gemv_rows, tiled_rows};
    if (T < 1 || H % 32 || inter % 32 || d % 8 || heads % kvh || k.tiled == NULL || tiled_rows < 1
        || (gemv_rows > 0 && k.gemv == NULL) || !k.rms_norm || !k.rotary || !k.attend)
        return 1;
    const int64_t nq = (heads + 2 * kvh) * d, nr = (heads + kvh) * d, na = heads * d;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(T * (H > na ? H : na)));
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)(T * nq));
    uint16_t *qk = malloc(sizeof(uint16_t) * (size_t)(T * nr));
    uint16_t *att = malloc(sizeof(uint16_t) * (size_t)(T * na));
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)(T * 2 * inter));
    int rc = (h == NULL || qkv == NULL || qk == NULL || att == NULL || gu == NULL) ? 2 : 0;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t l = 0; l < layers && rc == 0; l++) {
        const uint16_t *const *w = weights + 10 * l;
        k.rms_norm(x, H, w[0], eps, T, H, h, H, threads);
        if ((rc = product(&k, h, H, T, w[1], w[6], nq, H, qkv, nq, threads)))
            break;
        k.rotary(qkv, nq, T, heads + kvh, d, cos, sin, qk, threads);
        if ((rc = k.attend(qk, nr, qk + heads * d, nr, qkv + (heads + kvh) * d, nq, B, row0, n, caches,
                           layer_stride, cap, start, l, heads, kvh, d, att, na, 1, scale, threads)))
            break;
        if ((rc = product(&k, att, na, T, w[2], w[7], H, na, h, H, threads)))
            break;
        add_rows(x, h, T * H);
        k.rms_norm(x, H, w[3], eps, T, H, h, H, threads);
        if ((rc = product(&k, h, H, T, w[4], w[8], 2 * inter, H, gu, 2 * inter, threads)))
            break;
        silu_mul_rows(gu, T, inter, threads);
        if ((rc = product(&k, gu, 2 * inter, T, w[5], w[9], H, inter, h, H, threads)))
            break;
        add_rows(x, h, T * H);
        for (int64_t s = 0; s < slots; s++)
            if (slot_layer[s] == l)
                for (int64_t t = 0; t < T; t++)
                    memcpy(hidden + (t * slots + s) * H, x + t * H, sizeof(uint16_t) * (size_t)H);
    }
    free(h);
    free(qkv);
    free(qk);
    free(att);
    free(gu);
    return rc;
}
