/* One request's few-query attention over its float32 key/value cache, one call per layer.
 *
 * A decode or verify step brings n (1..64) new tokens per request. Through PyTorch, one
 * layer's attention of a lone request is about ten operators on tiny tensors (cast the
 * queries, stack and store the new keys and values, two batched products, a softmax, a
 * copy out and a cast back), each with its own dispatch and OpenMP region. Here it is one
 * call: the new keys and values are stored into the cache (converted to float32), and
 * every (kv head, query) pair computes the scores of its g query heads against the keys
 * it sees, their softmax and the weighted sum of the values, in float32.
 *
 * Each query row is computed the same way whatever n is (its own keys, in order), so a
 * decode of one token and a verify of sixteen give that token's row the same result.
 *
 * Reference (``dataplane.kernels.cpu_attention``): attend_cached_torch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline float f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16(float f) {
    /* round to nearest even, as PyTorch's float -> bfloat16 conversion; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* exp(x) for x <= 0 (a softmax's shifted scores): Cody-Waite reduction to r in
 * [-ln2/2, ln2/2] and a degree-6 polynomial, within 2 ulp of expf; 0 below -87.3. Plain
 * arithmetic, so the loop calling it vectorizes. */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.3f ? -87.3f : x;
    const float n = __builtin_roundf(xc * 1.44269504088896341f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.3f ? 0.0f : p * s.f;
}

/* s[j] = scale * (q . K[j]) for j < L; K [L, d] rows of d floats. Eight keys at a time in
 * eight AVX2 accumulators, summed across lanes by a tree of horizontal adds (d % 8 == 0). */
static void scores8(const float *qv, const float *K, int64_t L, int64_t d, float scale, float *s) {
    int64_t j = 0;
    const __m256 sc = _mm256_set1_ps(scale);
    for (; j + 8 <= L; j += 8) {
        __m256 a[8];
        for (int u = 0; u < 8; u++)
            a[u] = _mm256_setzero_ps();
        for (int64_t t = 0; t < d; t += 8) {
            const __m256 x = _mm256_loadu_ps(qv + t);
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(x, _mm256_loadu_ps(K + (j + u) * d + t), a[u]);
        }
        const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
        const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
        _mm256_storeu_ps(s + j, _mm256_mul_ps(sum, sc));
    }
    for (; j < L; j++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < d; t++)
            acc += qv[t] * K[j * d + t];
        s[j] = acc * scale;
    }
}

/* acc[t] = sum_j p[j] * V[j, t] for t < D (a compile-time D lets the accumulators live in
 * registers across the keys). */
#define WEIGHTED_SUM(D)                                                                            \
    static void wsum_##D(const float *p, const float *V, int64_t L, float *acc) {                  \
        float a[D] = {0};                                                                          \
        for (int64_t j = 0; j < L; j++) {                                                          \
            const float pj = p[j];                                                                 \
            for (int t = 0; t < D; t++)                                                            \
                a[t] += pj * V[j * D + t];                                                         \
        }                                                                                          \
        memcpy(acc, a, sizeof(a));                                                                 \
    }
WEIGHTED_SUM(64)
WEIGHTED_SUM(128)

static void wsum(const float *p, const float *V, int64_t L, int64_t d, float *acc) {
    if (d == 64)
        return wsum_64(p, V, L, acc);
    if (d == 128)
        return wsum_128(p, V, L, acc);
    memset(acc, 0, sizeof(float) * (size_t)d);
    for (int64_t j = 0; j < L; j++)
        for (int64_t t = 0; t < d; t++)
            acc[t] += p[j] * V[j * d + t];
}

/* q [n, heads, d] (token stride ldq), k_new, v_new [n, kvh, d] (token strides ldk, ldv), in
 * bfloat16 (is_bf16) or float32; cache: this layer's [2, kvh, cap, d] float32, holding
 * ``start`` positions. Stores the new keys and values at start .. start+n-1, then
 * out[i, h*d : (h+1)*d] = softmax(scale * q_ih . K[:L_i]) V[:L_i] for query head h of
 * token i, with L_i = start + i + 1 (causal) or start + n; out [n, heads * d] (token
 * stride ldo) in q's precision. Query head h reads kv head h / (heads / kvh). */
int adaflash_attend_cached(const void *q, int64_t ldq, const void *k_new, int64_t ldk, const void *v_new, int64_t ldv,
                           int64_t n, int64_t heads, int64_t kvh, int64_t d, float *cache, int64_t cap,
                           int64_t start, int causal, void *out, int64_t ldo, int is_bf16, float scale,
                           int threads) {
    const int64_t g = heads / kvh;
    if (d > MAX_HEAD_DIM || d % 8 || g > MAX_GROUP || g * kvh != heads || start + n > cap)
        return -1;
    float *keys = cache, *vals = cache + kvh * cap * d;
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < kvh; h++) {
            float *kd = keys + (h * cap + start + i) * d, *vd = vals + (h * cap + start + i) * d;
            for (int64_t t = 0; t < d; t++) {
                kd[t] = load(k_new, i * ldk + h * d + t, is_bf16);
                vd[t] = load(v_new, i * ldv + h * d + t, is_bf16);
            }
        }
    const int64_t items = kvh * n, total = start + n;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (items >= 8)
    {
        float *sc = malloc(sizeof(float) * (size_t)(g * total));
        if (sc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (sc == NULL)
                continue;
            const int64_t h = it % kvh, i = it / kvh;
            const int64_t L = causal ? start + i + 1 : total;
            const float *K = keys + h * cap * d, *V = vals + h * cap * d;
            float qv[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
            for (int64_t r = 0; r < g; r++) {
                for (int64_t t = 0; t < d; t++)
                    qv[t] = load(q, i * ldq + (h * g + r) * d + t, is_bf16);
                scores8(qv, K, L, d, scale, sc + r * total);
            }
            for (int64_t r = 0; r < g; r++) {
                float *s = sc + r * total, m = s[0], sum = 0.0f;
                for (int64_t j = 1; j < L; j++)
                    m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < L; j++) {
                    s[j] = exp_nonpos(s[j] - m);
                    sum += s[j];
                }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < L; j++)
                    s[j] *= inv;
                wsum(s, V, L, d, acc);
                const int64_t o = i * ldo + (h * g + r) * d;
                if (is_bf16)
                    for (int64_t t = 0; t < d; t++)
                        ((uint16_t *)out)[o + t] = bf16(acc[t]);
                else
                    memcpy((float *)out + o, acc, sizeof(float) * (size_t)d);
            }
        }
        free(sc);
    }
    return failed ? -2 : 0;
}
