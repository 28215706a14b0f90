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
    union { int32_t i; float f; } two_n;
    /* n is in [-126, 0] for x in [-87, 0]; the clamp only keeps a NaN input's cast defined (p is NaN then) */
    two_n.i = ((int32_t)fmaxf(fminf(n, 0.0f), -126.0f) + 127) << 23;
    return p * two_n.f;
}

#endif
