/* Every decoder layer of a float32 forward (decode, verify or prompt) in one call, with AVX2 and FMA.
 *
 * With the products in our own kernel (gemv_f32.c) and attention in one call a layer
 * (attention_f32.c), what was left of a float32 step on CPU was the host between them:
 * per layer two RMS norms, the rotation, the SiLU-gated product, two residual adds and
 * four product calls, each a PyTorch operator or a ctypes call that finds the interpreter
 * and the dispatcher evicted from the caches by the weights streaming past. Here the
 * layers run back to back in C:
 *
 *   h = rms_norm(x) * ln1;  qkv = h Wqkv^T;  rotate q and k;  store k, v and attend;
 *   x += attn Wo^T;  h = rms_norm(x) * ln2;  gu = h Wgu^T;  x += (silu(g) * u) Wdown^T
 *
 * x [T, H] is updated in place; after layer l it is copied to hidden[:, s] for every slot s
 * with slot_layer[s] == l (hidden [T, S, H]). weights: 6 pointers a layer (ln1 [H],
 * Wqkv [(heads + 2 kvh) d, H], Wo [H, heads d], ln2 [H], Wgu [2 inter, H], Wdown [H, inter]),
 * row-major float32. cos, sin [T, d]. The stream's requests and caches are as
 * ``adaflash_attend_cached_batch`` takes them.
 *
 * Every row is computed on its own, the same way whatever else the stream holds: the
 * products are row-invariant (gemv_f32.c, 128 rows a call), the norms, rotation and
 * activation are per row, and attention per (request, head, query). A decode of one
 * token and a verify of sixteen give that token the same bits; so do a prompt's rows
 * whether the prompt comes alone or beside other requests.
 *
 * Reference: dataplane.kernels.cpu_forward.layers_torch (norm sums and exp are ordered
 * differently, so results agree to float32 rounding; the rotation is exact).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_f32.h"

int adaflash_gemv_f32(const float *x, int64_t ldx, int M, const float *w, int64_t N, int64_t K, float *y,
                      int64_t ldy, int threads);
int adaflash_attend_cached_batch(const void *q, int64_t ldq, const void *k_new, int64_t ldk, const void *v_new,
                                 int64_t ldv, int64_t B, const int64_t *row0, const int64_t *n,
                                 float *const *caches, const int64_t *layer_stride, const int64_t *cap,
                                 const int64_t *start, int64_t layer, int64_t heads, int64_t kvh, int64_t d,
                                 void *out, int64_t ldo, int is_bf16, float scale, int threads);

#define GEMV_ROWS 128

/* y [T, N] (row stride ldy) = x [T, K] (row stride ldx) W^T, 128 rows a call. */
static int product(const float *x, int64_t ldx, int64_t T, const float *w, int64_t N, int64_t K, float *y,
                   int64_t ldy, int threads) {
    for (int64_t t0 = 0; t0 < T; t0 += GEMV_ROWS) {
        const int M = (int)(T - t0 < GEMV_ROWS ? T - t0 : GEMV_ROWS);
        const int rc = adaflash_gemv_f32(x + t0 * ldx, ldx, M, w, N, K, y + t0 * ldy, ldy, threads);
        if (rc)
            return rc;
    }
    return 0;
}

/* y[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * w for each of T rows of H (H % 8 == 0). */
static void rms_norm_rows(const float *x, int64_t T, int64_t H, const float *w, float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *yr = y + t * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < H; j += 8) {
            const __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)H + eps));
        for (int64_t j = 0; j < H; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), r),
                                                   _mm256_loadu_ps(w + j)));
    }
}

/* The rotary embedding of `nh` heads of d at the start of each of T rows of x (row stride
 * ld), in place: x * cos + [-x2, x1] * sin, each product rounded, then their sum (as
 * PyTorch computes it). cos, sin [T, d]. */
__attribute__((optimize("fp-contract=off"))) /* two roundings, as PyTorch */
static void rotate_rows(float *x, int64_t ld, int64_t T, int64_t nh, int64_t d, const float *cos,
                        const float *sin) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++) {
            float *v = x + t * ld + h * d;
            const float *c = cos + t * d, *s = sin + t * d;
            float tmp[512];
            for (int64_t j = 0; j < half; j++) {
                const float a = v[j] * c[j], b = -v[j + half] * s[j];
                tmp[j] = a + b;
            }
            for (int64_t j = half; j < d; j++) {
                const float a = v[j] * c[j], b = v[j - half] * s[j];
                tmp[j] = a + b;
            }
            memcpy(v, tmp, sizeof(float) * (size_t)d);
        }
}

/* a[t, j] = silu(gu[t, j]) * gu[t, inter + j] into the first half of each row of gu
 * [T, 2 inter] (inter % 8 == 0); silu(x) = x * sigmoid(x) with e = exp(-|x|):
 * sigmoid = 1 / (1 + e) for x >= 0, e / (1 + e) below. */
static void silu_mul_rows(float *gu, int64_t T, int64_t inter, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (T * inter >= 32768)
    for (int64_t t = 0; t < T; t++) {
        float *g = gu + t * 2 * inter, *u = g + inter;
        for (int64_t j = 0; j < inter; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp_nonpos8(_mm256_or_ps(x, sign)); /* exp(-|x|) */
            const __m256 den = _mm256_add_ps(one, e);
            const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), den);
            _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + j)));
        }
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(x + j, _mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    for (; j < n; j++)
        x[j] += y[j];
}

int adaflash_forward_f32(float *x, int64_t T, int64_t H, int64_t layers, const float *const *weights,
                         int64_t heads, int64_t kvh, int64_t d, int64_t inter, float eps, const float *cos,
                         const float *sin, int64_t B, const int64_t *row0, const int64_t *n,
                         float *const *caches, const int64_t *layer_stride, const int64_t *cap,
                         const int64_t *start, float *hidden, int64_t slots, const int64_t *slot_layer,
                         int threads) {
    if (T < 1 || H % 8 || inter % 8 || d % 8 || d > 512 || heads % kvh)
        return 1;
    const int64_t nq = (heads + 2 * kvh) * d, na = heads * d;
    float *h = malloc(sizeof(float) * (size_t)(T * (H > na ? H : na)));
    float *qkv = malloc(sizeof(float) * (size_t)(T * nq));
    float *att = malloc(sizeof(float) * (size_t)(T * na));
    float *gu = malloc(sizeof(float) * (size_t)(T * 2 * inter));
    int rc = (h == NULL || qkv == NULL || att == NULL || gu == NULL) ? 2 : 0;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t l = 0; l < layers && rc == 0; l++) {
        const float *const *w = weights + 6 * l;
        rms_norm_rows(x, T, H, w[0], eps, h);
        if ((rc = product(h, H, T, w[1], nq, H, qkv, nq, threads)))
            break;
        rotate_rows(qkv, nq, T, heads + kvh, d, cos, sin);
        if ((rc = adaflash_attend_cached_batch(qkv, nq, qkv + heads * d, nq, qkv + (heads + kvh) * d, nq, B, row0,
                                               n, caches, layer_stride, cap, start, l, heads, kvh, d, att, na, 0,
                                               scale, threads)))
            break;
        if ((rc = product(att, na, T, w[2], H, na, h, H, threads)))
            break;
        add_rows(x, h, T * H);
        rms_norm_rows(x, T, H, w[3], eps, h);
        if ((rc = product(h, H, T, w[4], 2 * inter, H, gu, 2 * inter, threads)))
            break;
        silu_mul_rows(gu, T, inter, threads);
        if ((rc = product(gu, 2 * inter, T, w[5], H, inter, h, H, threads)))
            break;
        add_rows(x, h, T * H);
        for (int64_t s = 0; s < slots; s++)
            if (slot_layer[s] == l)
                for (int64_t t = 0; t < T; t++)
                    memcpy(hidden + (t * slots + s) * H, x + t * H, sizeof(float) * (size_t)H);
    }
    free(h);
    free(qkv);
    free(att);
    free(gu);
    return rc;
}
