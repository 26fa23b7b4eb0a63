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

#include "bf16.h"
#include "vec_f32.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Softmax of s[0..L) in place: the maximum, exp of the shifted scores eight at a time (the
 * last L % 8 through the scalar function), their sum, normalised. A row's result depends
 * on its scores and L only. */
static void softmax_row(float *s, int64_t L) {
    __m256 mv = _mm256_set1_ps(s[0]);
    int64_t j = 0;
    for (; j + 8 <= L; j += 8)
        mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float m = s[0];
    {
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int u = 0; u < 8; u++)
            m = lanes[u] > m ? lanes[u] : m;
    }
    for (; j < L; j++)
        m = s[j] > m ? s[j] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (j = 0; j + 8 <= L; j += 8) {
        const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
        _mm256_storeu_ps(s + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    for (; j < L; j++) {
        s[j] = exp_nonpos(s[j] - m);
        sum += s[j];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (j = 0; j + 8 <= L; j += 8)
        _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
    for (; j < L; j++)
        s[j] *= 1.0f / sum;
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
    for (; j < L; j++) { /* the last L % 8 keys: one accumulator each, summed across lanes */
        __m256 a = _mm256_setzero_ps();
        for (int64_t t = 0; t < d; t += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + t), _mm256_loadu_ps(K + j * d + t), a);
        s[j] = hsum8(a) * scale;
    }
}

/* acc[r, t] = sum_j P[r, j] * V[j, t] for r < R (at most 3 query heads sharing a kv head),
 * t < d: P [R, L] (row stride ldp), V [L, d], acc [R, d]. Each key's values are loaded once
 * for the R rows; 16 columns at a time keep the 3 x 2 accumulators, two value vectors and
 * three weights within AVX2's sixteen registers (32 columns spilled to the stack). */
static void weighted_values(const float *P, int64_t ldp, int R, const float *V, int64_t L, int64_t d, float *acc) {
    if (d % 16) {
        memset(acc, 0, sizeof(float) * (size_t)(R * d));
        for (int r = 0; r < R; r++)
            for (int64_t j = 0; j < L; j++)
                for (int64_t t = 0; t < d; t++)
                    acc[r * d + t] += P[r * ldp + j] * V[j * d + t];
        return;
    }
    const float *p0 = P, *p1 = P + (R > 1 ? ldp : 0), *p2 = P + (R > 2 ? 2 * ldp : 0);
    for (int64_t t0 = 0; t0 < d; t0 += 16) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        for (int64_t j = 0; j < L; j++) {
            const float *vj = V + j * d + t0;
            const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
            const __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j);
            const __m256 w2 = _mm256_broadcast_ss(p2 + j);
            a00 = _mm256_fmadd_ps(w0, v0, a00);
            a01 = _mm256_fmadd_ps(w0, v1, a01);
            a10 = _mm256_fmadd_ps(w1, v0, a10);
            a11 = _mm256_fmadd_ps(w1, v1, a11);
            a20 = _mm256_fmadd_ps(w2, v0, a20);
            a21 = _mm256_fmadd_ps(w2, v1, a21);
        }
        const __m256 a[3][2] = {{a00, a01}, {a10, a11}, {a20, a21}};
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(acc + r * d + t0, a[r][0]);
            _mm256_storeu_ps(acc + r * d + t0 + 8, a[r][1]);
        }
    }
}

/* Stores the n new keys and values of one request (rows of k_new, v_new, token strides
 * ldk, ldv) at positions start .. start+n-1 of its float32 cache [2, kvh, cap, d]. */
static void store_new(const void *k_new, int64_t ldk, const void *v_new, int64_t ldv, int64_t n, int64_t kvh,
                      int64_t d, float *cache, int64_t cap, int64_t start, int is_bf16) {
    float *keys = cache, *vals = cache + kvh * cap * d;
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < kvh; h++) {
            float *kd = keys + (h * cap + start + i) * d, *vd = vals + (h * cap + start + i) * d;
            for (int64_t t = 0; t < d; t++) {
                kd[t] = load(k_new, i * ldk + h * d + t, is_bf16);
                vd[t] = load(v_new, i * ldv + h * d + t, is_bf16);
            }
        }
}

/* One (kv head h, query i) item of one request: the g query heads of token i (row i of q,
 * token stride ldq) against the L keys they see, softmax, weighted values, written to row
 * i of out (token stride ldo). sc: scratch of g * stride floats, stride >= L. */
static void attend_item(const void *q, int64_t ldq, int64_t h, int64_t i, int64_t L, int64_t g, int64_t d,
                        const float *cache, int64_t cap, int64_t kvh, float scale, int is_bf16, float *sc,
                        int64_t stride, void *out, int64_t ldo) {
    const float *K = cache + h * cap * d, *V = cache + (kvh + h) * cap * d;
    float qv[MAX_HEAD_DIM], acc[3 * MAX_HEAD_DIM];
    for (int64_t r = 0; r < g; r++) {
        for (int64_t t = 0; t < d; t++)
            qv[t] = load(q, i * ldq + (h * g + r) * d + t, is_bf16);
        scores8(qv, K, L, d, scale, sc + r * stride);
    }
    for (int64_t r = 0; r < g; r++) /* softmax of each row, in place */
        softmax_row(sc + r * stride, L);
    for (int64_t r0 = 0; r0 < g; r0 += 3) {
        const int R = g - r0 < 3 ? (int)(g - r0) : 3;
        weighted_values(sc + r0 * stride, stride, R, V, L, d, acc);
        for (int r = 0; r < R; r++) {
            const int64_t o = i * ldo + (h * g + r0 + r) * d;
            if (is_bf16)
                for (int64_t t = 0; t < d; t++)
                    ((uint16_t *)out)[o + t] = bf16(acc[r * d + t]);
            else
                memcpy((float *)out + o, acc + r * d, sizeof(float) * (size_t)d);
        }
    }
}

/* A packed stream of B requests: request b's n[b] tokens are rows row0[b] .. row0[b]+n[b]-1
 * of q, k_new, v_new and out (token strides ldq, ldk, ldv, ldo); its cache is the float32
 * block at caches[b] + layer * layer_stride[b] ([2, kvh, cap[b], d], ``start[b]``
 * positions). Every request's new keys and values are stored first; then each (request,
 * kv head, query) item is computed on its own (``attend_item``), so a request's rows do not
 * depend on what else is in the batch. */
static int attend_stream(const void *q, int64_t ldq, const void *k_new, int64_t ldk, const void *v_new, int64_t ldv,
                         int64_t B, const int64_t *row0, const int64_t *n, float *const *caches,
                         const int64_t *layer_stride, const int64_t *cap, const int64_t *start, int64_t layer,
                         int64_t heads, int64_t kvh, int64_t d, int causal, void *out, int64_t ldo, int is_bf16,
                         float scale, int threads) {
    const int64_t g = heads / kvh;
    if (d > MAX_HEAD_DIM || d % 8 || g > MAX_GROUP || g * kvh != heads)
        return -1;
    const size_t es = is_bf16 ? 2 : 4;
    int64_t items = 0, longest = 0;
    for (int64_t b = 0; b < B; b++) {
        if (start[b] + n[b] > cap[b] || n[b] < 1)
            return -1;
        float *cache = caches[b] + layer * layer_stride[b];
        store_new((const char *)k_new + row0[b] * ldk * es, ldk, (const char *)v_new + row0[b] * ldv * es, ldv,
                  n[b], kvh, d, cache, cap[b], start[b], is_bf16);
        items += kvh * n[b];
        longest = start[b] + n[b] > longest ? start[b] + n[b] : longest;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (items >= 8)
    {
        float *sc = malloc(sizeof(float) * (size_t)(g * longest));
        if (sc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t b = 0, first = 0; /* the request holding this thread's current item, and its first item */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (sc == NULL)
                continue;
            if (it < first) /* a static schedule hands out ascending items; restart only if not */
                b = 0, first = 0;
            while (it >= first + kvh * n[b])
                first += kvh * n[b++];
            const int64_t local = it - first, h = local % kvh, i = local / kvh, total = start[b] + n[b];
            attend_item((const char *)q + row0[b] * ldq * es, ldq, h, i, causal ? start[b] + i + 1 : total, g, d,
                        caches[b] + layer * layer_stride[b], cap[b], kvh, scale, is_bf16, sc, total,
                        (char *)out + row0[b] * ldo * es, ldo);
        }
        free(sc);
    }
    return failed ? -2 : 0;
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
    const int64_t row0 = 0, stride = 0;
    float *caches[1] = {cache};
    return attend_stream(q, ldq, k_new, ldk, v_new, ldv, 1, &row0, &n, caches, &stride, &cap, &start, 0, heads, kvh,
                         d, causal, out, ldo, is_bf16, scale, threads);
}

/* The packed stream of B requests (``attend_stream``) in one call, causal: each request's
 * rows exactly as ``adaflash_attend_cached`` computes them alone. */
int adaflash_attend_cached_batch(const void *q, int64_t ldq, const void *k_new, int64_t ldk, const void *v_new,
                                 int64_t ldv, int64_t B, const int64_t *row0, const int64_t *n,
                                 float *const *caches, const int64_t *layer_stride, const int64_t *cap,
                                 const int64_t *start, int64_t layer, int64_t heads, int64_t kvh, int64_t d,
                                 void *out, int64_t ldo, int is_bf16, float scale, int threads) {
    return attend_stream(q, ldq, k_new, ldk, v_new, ldv, B, row0, n, caches, layer_stride, cap, start, layer, heads,
                         kvh, d, 1, out, ldo, is_bf16, scale, threads);
}
