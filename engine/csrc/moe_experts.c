/*
 * The CPU MoE experts, float32: every (token, expert) pair through its expert's gate_up GEMM, SiLU * up and
 * down GEMM, weighted by the router, and each token's pairs summed in expert order; one call per layer.
 *
 * Why C: at a batch's decode step every expert has a few rows (batch 32, top 4 of 32: about 4), and a GEMM
 * of 4 rows runs far below the machine's compute and bandwidth in the BLAS torch calls on CPU (measured on
 * the 2-core AMD EPYC box: MKL's 1- and 4-row GEMMs over all experts' weights read 11-16 GB/s where a plain
 * pass over the same bytes reads 75-90 GB/s), plus a call per expert. Here the work is tiles of (an expert,
 * 4 weight rows), each a 4 x 4 block of dot products over the expert's rows 4 at a time: every weight byte is
 * read once per 4 rows, from memory once, and the tiles are shared over the threads. Prefill-sized groups
 * (256+ rows for some expert) go through panels instead: 32 weight rows transposed once into a scratch
 * buffer, then 6 rows x 32 columns of outer products at a time, without the dot tiles' horizontal sums.
 *
 * Layout (the model's): w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. Pairs are p = t * k + j
 * (token t's j-th expert, the experts of a token ascending); `sorted` lists the pairs grouped by expert,
 * `offsets` [E + 1] where each expert's group starts. Scratch h [P, 2I] and y [P, H]; out [T, H].
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec_math.h"

#define RB 4 /* rows per tile */
#define CB 4 /* weight rows (output columns) per tile */

/* out[r * so + c] = dot(x[r], w + c * sw) over n, for r < nr <= RB, c < nc <= CB. */
static void dot_tile(const float *const *x, int nr, const float *w, int64_t sw, int nc, int64_t n, float *out,
                     int64_t so) {
#ifdef __AVX512F__
    if (nr == RB && nc == CB && n % 16 == 0) {
        __m512 acc[RB][CB];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 wv[CB];
            for (int c = 0; c < CB; c++) wv[c] = _mm512_loadu_ps(w + c * sw + i);
            for (int r = 0; r < RB; r++) {
                const __m512 xv = _mm512_loadu_ps(x[r] + i);
                for (int c = 0; c < CB; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) out[r * so + c] = _mm512_reduce_add_ps(acc[r][c]);
        return;
    }
    if (n % 16 == 0) {
        for (int c = 0; c < nc; c++) {
            __m512 acc[RB];
            for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                const __m512 wv = _mm512_loadu_ps(w + c * sw + i);
                for (int r = 0; r < nr; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + i), wv, acc[r]);
            }
            for (int r = 0; r < nr; r++) out[r * so + c] = _mm512_reduce_add_ps(acc[r]);
        }
        return;
    }
#endif
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nc; c++) {
            const float *xr = x[r];
            const float *wc = w + c * sw;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < n; i++) s += xr[i] * wc[i];
            out[r * so + c] = s;
        }
}

#ifdef __AVX512F__
#define BIG_ROWS 256 /* a group of at least this many rows sends the call down the panel path */
#define NB 32        /* weight rows per panel */
#define RB2 6        /* rows per panel step */

/* A panel of NB weight rows transposed into wt [n, NB], then dst[row, c0:c0+NB] for the group's rows RB2 at a
   time as outer products (no horizontal sums; each weight vector feeds RB2 FMAs); the last rows as dot tiles.
   Used for prefill-sized groups, where the transpose (once per panel) is small against the panel's work. */
static void panel_rows(const float *const *xs_all, int64_t rows, const float *w, int64_t n, float *wt,
                       float *const *dst_rows) {
    for (int64_t kk = 0; kk < n; kk++)
        for (int c = 0; c < NB; c++) wt[kk * NB + c] = w[c * n + kk];
    int64_t i = 0;
    for (; i + RB2 <= rows; i += RB2) {
        __m512 acc[RB2][2];
        for (int r = 0; r < RB2; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t kk = 0; kk < n; kk++) {
            const __m512 w0 = _mm512_loadu_ps(wt + kk * NB);
            const __m512 w1 = _mm512_loadu_ps(wt + kk * NB + 16);
            for (int r = 0; r < RB2; r++) {
                const __m512 xv = _mm512_set1_ps(xs_all[i + r][kk]);
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
            }
        }
        for (int r = 0; r < RB2; r++) {
            _mm512_storeu_ps(dst_rows[i + r], acc[r][0]);
            _mm512_storeu_ps(dst_rows[i + r] + 16, acc[r][1]);
        }
    }
    for (; i < rows; i++)
        for (int c = 0; c < NB; c++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < n; kk++) s += xs_all[i][kk] * wt[kk * NB + c];
            dst_rows[i][c] = s;
        }
}
#endif

/* One GEMM per expert over its group: dst[row] = src[row] W_e^T for W_e [ncols, n] (row stride n), the
   group's rows of src found through `src_row` (a pair -> its row in src) and written to dst's row of the
   same pair (stride sd). Tiles (expert, CB columns) over the threads. */
static void grouped_gemm(const float *src, int64_t ss, int by_token, int64_t k, const float *w, int64_t ncols,
                         int64_t n, const int64_t *sorted, const int64_t *offsets, int64_t num_experts, float *dst,
                         int64_t sd, int num_threads) {
    const int64_t tiles_per_expert = (ncols + CB - 1) / CB;
#ifdef __AVX512F__
    int big = 0;
    for (int64_t e = 0; e < num_experts; e++) big |= offsets[e + 1] - offsets[e] >= BIG_ROWS;
    if (big && ncols % NB == 0 && n % 16 == 0) {
        const int64_t panels = ncols / NB;
        int64_t max_rows = 0;
        for (int64_t e = 0; e < num_experts; e++)
            if (offsets[e + 1] - offsets[e] > max_rows) max_rows = offsets[e + 1] - offsets[e];
#pragma omp parallel num_threads(num_threads)
        {
            float *wt = (float *)aligned_alloc(64, (size_t)(n * NB * sizeof(float) + 63) / 64 * 64);
            const float **xs = (const float **)malloc((size_t)max_rows * sizeof(float *));
            float **ds = (float **)malloc((size_t)max_rows * sizeof(float *));
#pragma omp for schedule(dynamic, 1)
            for (int64_t tile = 0; tile < num_experts * panels; tile++) {
                const int64_t e = tile / panels;
                const int64_t c0 = (tile % panels) * NB;
                const int64_t rows = offsets[e + 1] - offsets[e];
                if (rows == 0) continue;
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t p = sorted[offsets[e] + r];
                    xs[r] = src + (by_token ? p / k : p) * ss;
                    ds[r] = dst + p * sd + c0;
                }
                panel_rows(xs, rows, w + (e * ncols + c0) * n, n, wt, ds);
            }
            free(wt);
            free(xs);
            free(ds);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (int64_t tile = 0; tile < num_experts * tiles_per_expert; tile++) {
        const int64_t e = tile / tiles_per_expert;
        const int64_t c0 = (tile % tiles_per_expert) * CB;
        const int nc = (int)(ncols - c0 < CB ? ncols - c0 : CB);
        const float *we = w + (e * ncols + c0) * n;
        for (int64_t i = offsets[e]; i < offsets[e + 1]; i += RB) {
            const int nr = (int)(offsets[e + 1] - i < RB ? offsets[e + 1] - i : RB);
            const float *xs[RB];
            float tmp[RB * CB];
            for (int r = 0; r < nr; r++) {
                const int64_t p = sorted[i + r];
                xs[r] = src + (by_token ? p / k : p) * ss;
            }
            dot_tile(xs, nr, we, n, nc, n, tmp, CB);
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++) dst[sorted[i + r] * sd + c0 + c] = tmp[r * CB + c];
        }
    }
}

/* x [T, H] (row stride sx) -> out [T, H]: out[t] = sum over j (ascending) of pair_w[t k + j] *
   down_e(silu(gate_e(x[t])) * up_e(x[t])) for e = token t's j-th expert. h [T k, 2I], y [T k, H] scratch. */
void moe_experts_f32(const float *x, int64_t sx, const float *w13, const float *w2, const int64_t *sorted,
                     const int64_t *offsets, const float *pair_w, int64_t num_tokens, int64_t k, int64_t num_experts,
                     int64_t hidden, int64_t inter, float *h, float *y, float *out, int num_threads) {
    const int64_t pairs = num_tokens * k;
    grouped_gemm(x, sx, 1, k, w13, 2 * inter, hidden, sorted, offsets, num_experts, h, 2 * inter, num_threads);
    /* silu(gate) * up into the gate half of h, as silu_mul_f32 computes it */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (pairs * inter >= 65536)
    for (int64_t p = 0; p < pairs; p++) {
        float *g = h + p * 2 * inter;
        const float *u = g + inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float gi = g[i];
            const float e = exp_nonpos(gi < 0.0f ? gi : -gi);
            const float sig = gi < -87.0f ? 0.0f : (gi < 0.0f ? e : 1.0f) / (1.0f + e);
            g[i] = (gi * sig) * u[i];
        }
    }
    grouped_gemm(h, 2 * inter, 0, k, w2, hidden, inter, sorted, offsets, num_experts, y, hidden, num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens * hidden >= 65536)
    for (int64_t t = 0; t < num_tokens; t++) {
        float *o = out + t * hidden;
        for (int64_t j = 0; j < k; j++) {
            const float *yr = y + (t * k + j) * hidden;
            const float wj = pair_w[t * k + j];
            if (j == 0) {
#pragma omp simd
                for (int64_t i = 0; i < hidden; i++) o[i] = yr[i] * wj;
            } else {
#pragma omp simd
                for (int64_t i = 0; i < hidden; i++) o[i] += yr[i] * wj;
            }
        }
    }
}
