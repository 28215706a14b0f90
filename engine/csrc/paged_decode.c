/*
 * Paged decode attention for CPU, float32.
 *
 * One query token per request attends over that request's KV pages, read in place from the cache
 * (no gather copy). Layout matches engine/attention/torch_paged.py:
 *   q, out      [num_reqs, num_heads, head_dim]              contiguous
 *   kv_cache    [2, num_kv_heads, num_blocks, block_size, head_dim]   contiguous (K then V)
 *   block_tables[num_reqs, bt_stride] int32; seq_lens[num_reqs] int32 (keys to attend, >= 1)
 * Query head i reads KV head i / (num_heads / num_kv_heads), as grouped-query attention does.
 *
 * Work is split over (request, KV head) pairs with OpenMP. Loaded next to torch, this library binds
 * to the libgomp torch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

/* 8 floats, unaligned loads allowed; GCC/Clang lower it to AVX on x86 and to NEON pairs on arm64 */
typedef float vf8 __attribute__((vector_size(32), aligned(4)));

/* out = r * sum_t p[t] v_t over the pages in `table`. For head_dim a multiple of 8 up to 128 the row
   accumulates in vector registers (head_dim 64 and 128 arrive as literals, see attend_one's callers,
   so the inner loops unroll fully); other sizes accumulate in `out`. */
static inline __attribute__((always_inline)) void accumulate_row(
    const float *p, const float *vh, const int32_t *table, int64_t L, int64_t block_size, const int64_t D,
    float r, float *out) {
    if (D % 8 == 0 && D <= 128) {
        const int64_t nv = D / 8;
        vf8 acc[16];
        for (int64_t i = 0; i < nv; i++) acc[i] = (vf8){0};
        for (int64_t t0 = 0; t0 < L; t0 += block_size) {
            const float *vb = vh + (int64_t)table[t0 / block_size] * block_size * D;
            const int64_t n = (L - t0 < block_size) ? L - t0 : block_size;
            for (int64_t j = 0; j < n; j++) {
                const float pj = p[t0 + j];
                const vf8 *vt = (const vf8 *)(vb + j * D);
                for (int64_t i = 0; i < nv; i++) acc[i] += pj * vt[i];
            }
        }
        for (int64_t i = 0; i < nv; i++) ((vf8 *)out)[i] = acc[i] * r;
        return;
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const float *vb = vh + (int64_t)table[t0 / block_size] * block_size * D;
        const int64_t n = (L - t0 < block_size) ? L - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            const float pj = p[t0 + j];
            const float *vt = vb + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) out[d] += pj * vt[d];
        }
    }
    for (int64_t d = 0; d < D; d++) out[d] *= r;
}

/* One (request, KV head) pair: the G query rows that share this KV head. Returns -1 when out of memory.
   Always inlined with D a literal in paged_decode_attention_f32, so the D-long loops unroll. */
static inline __attribute__((always_inline)) int attend_one(
    const float *qh, const float *kh, const float *vh, const int32_t *table, int64_t L, int64_t G,
    int64_t block_size, const int64_t D, float scale, float *oh) {
    float *s = (float *)malloc(sizeof(float) * (size_t)(G * L + G));
    if (s == NULL) return -1;
    float *inv = s + G * L;

    /* scores s[g, t] = scale * q_g . k_t, pages read in place */
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const float *kb = kh + (int64_t)table[t0 / block_size] * block_size * D;
        const int64_t n = (L - t0 < block_size) ? L - t0 : block_size;
        int64_t j = 0;
        /* four keys at a time: four independent FMA chains instead of one latency-bound one */
        for (; j + 4 <= n; j += 4) {
            const float *k0 = kb + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t d = 0; d < D; d++) {
                    a0 += qg[d] * k0[d];
                    a1 += qg[d] * k1[d];
                    a2 += qg[d] * k2[d];
                    a3 += qg[d] * k3[d];
                }
                float *sg = s + g * L + t0 + j;
                sg[0] = a0 * scale;
                sg[1] = a1 * scale;
                sg[2] = a2 * scale;
                sg[3] = a3 * scale;
            }
        }
        for (; j < n; j++) {
            const float *kt = kb + j * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += qg[d] * kt[d];
                s[g * L + t0 + j] = acc * scale;
            }
        }
    }
    /* softmax numerators in place, 1 / denominators aside */
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * L;
        float m = sg[0];
        for (int64_t t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            sg[t] = exp_nonpos(sg[t] - m);
            sum += sg[t];
        }
        inv[g] = 1.0f / sum;
    }
    /* out_g = sum_t p[g, t] v_t / denominator, one row at a time (the request's V pages stay in L1/L2
       between the G rows) */
    for (int64_t g = 0; g < G; g++) accumulate_row(s + g * L, vh, table, L, block_size, D, inv[g], oh + g * D);
    free(s);
    return 0;
}

int paged_decode_attention_f32(const float *q, const float *kv_cache, const int32_t *block_tables,
                               int64_t bt_stride, const int32_t *seq_lens, float *out, int64_t num_reqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                               int64_t block_size, int64_t head_dim, float scale, int num_threads) {
    const int64_t G = num_heads / num_kv_heads;
    const int64_t D = head_dim;
    const int64_t head_stride = num_blocks * block_size * D;
    const float *v_cache = kv_cache + num_kv_heads * head_stride;
    int failed = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < num_reqs; b++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *qh = q + (b * num_heads + h * G) * D;
            float *oh = out + (b * num_heads + h * G) * D;
            const float *kh = kv_cache + h * head_stride;
            const float *vh = v_cache + h * head_stride;
            const int32_t *table = block_tables + b * bt_stride;
            const int64_t L = seq_lens[b];
            int rc;
            if (D == 64)
                rc = attend_one(qh, kh, vh, table, L, G, block_size, 64, scale, oh);
            else if (D == 128)
                rc = attend_one(qh, kh, vh, table, L, G, block_size, 128, scale, oh);
            else
                rc = attend_one(qh, kh, vh, table, L, G, block_size, D, scale, oh);
            if (rc != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    return failed ? -1 : 0;
}
