/* Float32 vector helpers shared by the AVX2 kernels beside this file: exp of a
 * non-positive argument (scalar and eight lanes, the same operations in the same order)
 * and the sum of eight lanes. (``cpu_gemv.build_kernel`` keys a build by this header too.) */
#ifndef ADAFLASH_VEC_F32_H
#define ADAFLASH_VEC_F32_H
#include <immintrin.h>
#include <stdint.h>

/* exp(x) for x <= 0 (a softmax's shifted scores): Cody-Waite reduction to r in
 * [-ln2/2, ln2/2] and a degree-6 polynomial, within 2 ulp of expf; 0 below -87.3. Plain
 * arithmetic, so the loop calling it vectorizes. */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.3f ? -87.3f : x;
    const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
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

/* The sum of a vector's eight lanes. */
static inline float hsum8(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

/* ``exp_nonpos`` of eight lanes, lane by lane the scalar function's operations in its order. */
static inline __m256 exp_nonpos8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), shift = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), shift), shift);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); /* 0 below -87.3 */
}
#endif
