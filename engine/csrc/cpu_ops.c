/*
 * Fused per-token ops for the CPU path, float32: residual add + RMSNorm, RoPE over q and k, SiLU * up.
 *
 * The CPU twins of the Triton kernels in engine/models/_triton_ops.py, with the same arguments and the
 * same arithmetic order. At batch 1 a decode step streams every weight matrix through the caches, so each
 * small torch op that follows a GEMM starts cold (tens of microseconds for a 512-float row); the torch
 * RMSNorm is six such ops and a RoPE seven per tensor. Each function here is one pass over its rows.
 *
 * Rows are split over OpenMP threads only when there are enough of them (prefill chunks); a decode row is
 * done on the calling thread, without waking the pool.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

#define PARALLEL_MIN_ELEMS 65536

/* x[t] += d[t] when d is not NULL (stored back); y[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)). */
void add_rms_norm_f32(float *x, const float *d, const float *w, float *y, int64_t rows, int64_t n,
                      int64_t sx, int64_t sd, int64_t sy, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1 && rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * sx;
        float *yr = y + t * sy;
        float ss = 0.0f;
        if (d != NULL) {
            const float *dr = d + t * sd;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) {
                const float v = xr[i] + dr[i];
                xr[i] = v;
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        }
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* Rotate heads in place: x1 c - x2 s, x2 c + x1 s over the rotary halves of each head, cos / sin rows
   picked by position from the float32 tables ([table_rows] rows of stride sc). x: [rows, heads, head_dim]
   with strides (sxt, sxh, 1). Returns -1, having changed nothing, when a position is outside the table. */
int rope_f32(float *x, const int64_t *positions, const float *cos_t, const float *sin_t, int64_t rows,
             int64_t heads, int64_t sxt, int64_t sxh, int64_t sc, int64_t table_rows, int64_t half,
             int num_threads) {
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows > 1 && rows * heads * half >= PARALLEL_MIN_ELEMS / 2)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + positions[t] * sc;
        const float *s = sin_t + positions[t] * sc;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * sxt + h * sxh;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* y[t] = silu(gate) * up for x[t] = [gate | up] of 2n. silu(g) = g * sigmoid(g), with the logistic
   function computed from exp(-|g|) so one vectorisable exp covers both signs. Below -87 the logistic is
   under float's normal range and taken as 0, so silu is -0 there (and NaN at -inf), as in torch. */
void silu_mul_f32(const float *x, float *y, int64_t rows, int64_t n, int64_t sx, int64_t sy, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1 && rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = x + t * sx;
        const float *u = g + n;
        float *yr = y + t * sy;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float gi = g[i];
            const float e = exp_nonpos(gi < 0.0f ? gi : -gi);        /* exp(-|g|) in (0, 1] */
            const float sig = gi < -87.0f ? 0.0f : (gi < 0.0f ? e : 1.0f) / (1.0f + e);
            yr[i] = (gi * sig) * u[i];
        }
    }
}
