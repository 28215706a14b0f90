/* Vectorisable float math shared by the CPU kernels (engine/csrc/*.c). */
#ifndef AFFINITY_VEC_MATH_H
#define AFFINITY_VEC_MATH_H
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0 (softmax after subtracting the max, the logistic function of -|x|), vectorisable:
   Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial, about 1 ulp; inputs below -87 give
   ~1e-38 instead of denormals. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n built from n's bits: n + 1.5 * 2^23 holds n in its low mantissa bits, so no float -> int conversion
       (undefined for a NaN input, whose result is NaN through p anyway) and all-unsigned integer arithmetic.
       The loops that call this must vectorise (check with -fopt-info-vec): an fminf / fmaxf clamp here
       stopped GCC 12 from vectorising them, and silu_mul ran 12x slower. */
    union { float f; uint32_t u; } shifted = {n + 12582912.0f}, magic = {12582912.0f}, two_n;
    two_n.u = (shifted.u - magic.u + 127u) << 23;
    return p * two_n.f;
}

#endif
