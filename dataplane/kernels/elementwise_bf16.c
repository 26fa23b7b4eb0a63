/* The small bfloat16 steps between a decoder layer's products, one call each instead of
 * several PyTorch operators: the RMS norm and the rotary embedding.
 *
 * Every value is rounded to bfloat16 where the PyTorch expression it replaces rounds, so
 * the rotation agrees with the reference bit for bit and the norm up to the order of its
 * float32 sum (equal in every check so far). Rows run on one thread up to ``PARALLEL_ROWS`` (a decode or
 * verify step) and on PyTorch's OpenMP threads beyond (prompts).
 *
 * References (``dataplane.kernels.cpu_elementwise``): rms_norm_torch, rotary_torch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_ROWS 64

/* y[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * w), one rounding as F.rms_norm: x, y [rows, H]
 * (row strides ldx, ldy). */
void adaflash_rms_norm(const uint16_t *x, int64_t ldx, const uint16_t *w, float eps, int64_t rows, int64_t H,
                       uint16_t *y, int64_t ldy, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (rows > PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *yr = y + r * ldy;
        float part[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= H; i += 16)
            for (int j = 0; j < 16; j++) part[j] += f32(xr[i + j]) * f32(xr[i + j]);
        float sum = 0.f;
        for (; i < H; i++) sum += f32(xr[i]) * f32(xr[i]);
        for (int j = 0; j < 16; j++) sum += part[j];
        const float inv = 1.f / sqrtf(sum / (float)H + eps);
        for (i = 0; i < H; i++) yr[i] = bf16(f32(xr[i]) * inv * f32(w[i]));
    }
}

/* out[t, h] = bf16(bf16(x * cos[t]) + bf16(rot(x) * sin[t])), rot(x) = [-x[d/2:], x[:d/2]]:
 * x [T, heads, d] (row stride ldx between tokens, heads contiguous), cos, sin [T, d]
 * contiguous, out [T, heads, d] contiguous. */
void adaflash_rotary(const uint16_t *x, int64_t ldx, int64_t T, int64_t heads, int64_t d, const uint16_t *cos,
                     const uint16_t *sin, uint16_t *out, int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (T > PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + t * ldx + h * d;
            uint16_t *oh = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) /* two loops, so that each vectorizes */
                oh[i] = bf16(f32(bf16(f32(xh[i]) * f32(c[i]))) + f32(bf16(-f32(xh[i + half]) * f32(s[i]))));
            for (int64_t i = half; i < d; i++)
                oh[i] = bf16(f32(bf16(f32(xh[i]) * f32(c[i]))) + f32(bf16(f32(xh[i - half]) * f32(s[i]))));
        }
    }
}
