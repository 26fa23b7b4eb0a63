/* bfloat16 <-> float32 as PyTorch converts them, for the C kernels beside this file.
 * (``cpu_gemv.build_kernel`` keys a build by this header too.) */
#ifndef ADAFLASH_BF16_H
#define ADAFLASH_BF16_H
#include <stdint.h>
#include <string.h>

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
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded); /* a select: vectorizes */
}
#endif
