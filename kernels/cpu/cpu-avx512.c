/* cpu-avx512.c -- AVX-512 kernels of the CPU backend (compiled with -mavx512*; run only when present). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu-impl.h"

#define CPU_INLINE static inline __attribute__((always_inline))

CPU_INLINE float cpu_h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- 32 weights of a row as two vectors ------------------------------------ */

/* Block b (32 elements) of a weight row, dequantized: w0 = elements 0..15,
 * w1 = 16..31. Exact: every value equals op_dequantize_row's. */
CPU_INLINE void cpu_avx512_deq(op_type type, const uint8_t *row, int64_t b, __m512 *w0, __m512 *w1) {
    switch (type) {
    case OP_TYPE_F32: {
        const float *p = (const float *)row + b * 32;
        *w0 = _mm512_loadu_ps(p);
        *w1 = _mm512_loadu_ps(p + 16);
        break;
    }
    case OP_TYPE_F16: {
        const uint8_t *p = row + b * 64;
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        break;
    }
    case OP_TYPE_BF16: {
        const uint8_t *p = row + b * 64;
        __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
        __m512i c = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)));
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(c, 16));
        break;
    }
    case OP_TYPE_I8: {
        const uint8_t *p = row + b * 32;
        *w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        *w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        break;
    }
    case OP_TYPE_Q8_0: {
        const uint8_t *p = row + b * sizeof(op_block_q8_0);
        __m512 d = _mm512_set1_ps(cpu_h2f(p));
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))));
        break;
    }
    case OP_TYPE_Q4_0: {
        const uint8_t *p = row + b * sizeof(op_block_q4_0);
        __m512 d = _mm512_set1_ps(cpu_h2f(p));
        __m128i qs = _mm_loadu_si128((const __m128i *)(p + 2));
        const __m128i m4 = _mm_set1_epi8(0x0f), e8 = _mm_set1_epi8(8);
        __m128i lo = _mm_sub_epi8(_mm_and_si128(qs, m4), e8);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), e8);
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
        break;
    }
    case OP_TYPE_Q4_1: {
        const uint8_t *p = row + b * sizeof(op_block_q4_1);
        __m512 d = _mm512_set1_ps(cpu_h2f(p)), mn = _mm512_set1_ps(cpu_h2f(p + 2));
        __m128i qs = _mm_loadu_si128((const __m128i *)(p + 4));
        const __m128i m4 = _mm_set1_epi8(0x0f);
        __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), mn);
        *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), mn);
        break;
    }
    default:
        *w0 = *w1 = _mm512_setzero_ps();
        break;
    }
}

/* ---- matvec ---------------------------------------------------------------- */

/* Software prefetch CPU_PF_DIST bytes ahead of blocks b, b+1 of a row (rows
 * are consecutive, so this runs into the next rows): the hardware prefetcher
 * alone does not keep enough reads in flight at this per-core bandwidth. */
CPU_INLINE void cpu_avx512_prefetch_blocks(op_type type, const uint8_t *row, int64_t b) {
    const size_t bytes = type == OP_TYPE_F32                              ? 256
                         : type == OP_TYPE_F16 || type == OP_TYPE_BF16      ? 128
                         : type == OP_TYPE_Q8_0                             ? 2 * sizeof(op_block_q8_0)
                         : type == OP_TYPE_Q4_0                             ? 2 * sizeof(op_block_q4_0)
                         : type == OP_TYPE_Q4_1                             ? 2 * sizeof(op_block_q4_1)
                                                                            : 64;
    const size_t at = (size_t)b * (bytes / 2); /* b is even: the pair starts here */
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + at + o + CPU_PF_DIST, _MM_HINT_T0);
}

/* sums[t] = sum over the nb full blocks of row . x[t], for nt tokens; two
 * blocks per step into separate accumulators to hide the FMA latency. */
CPU_INLINE void cpu_avx512_mv(op_type type, const uint8_t *row, const float *x, size_t ldx, int nt,
                              int64_t nb, float *sums) {
    __m512 acc[CPU_MV_T][4];
    #pragma GCC unroll 16
    for (int t = 0; t < nt; t++)
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m512 w0, w1, w2, w3;
        cpu_avx512_prefetch_blocks(type, row, b);
        cpu_avx512_deq(type, row, b, &w0, &w1);
        cpu_avx512_deq(type, row, b + 1, &w2, &w3);
        #pragma GCC unroll 16
        for (int t = 0; t < nt; t++) {
            const float *xp = x + t * ldx + b * 32;
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc[t][1]);
            acc[t][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xp + 32), acc[t][2]);
            acc[t][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xp + 48), acc[t][3]);
        }
    }
    if (b < nb) {
        __m512 w0, w1;
        cpu_avx512_deq(type, row, b, &w0, &w1);
        #pragma GCC unroll 16
        for (int t = 0; t < nt; t++) {
            const float *xp = x + t * ldx + b * 32;
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc[t][1]);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < nt; t++)
        sums[t] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3])));
}

/* Half h of block b of a plain (F32/F16/BF16) row: 16 weights. */
CPU_INLINE __m512 cpu_avx512_deq_half(op_type type, const uint8_t *row, int64_t b, int h) {
    if (type == OP_TYPE_F32) return _mm512_loadu_ps((const float *)row + b * 32 + 16 * h);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * 64 + 32 * h));
    if (type == OP_TYPE_F16) return _mm512_cvtph_ps(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* acc[i][t] = 0 for i < R, t < NT (R, NT compile-time after inlining). */
CPU_INLINE void cpu_avx512_zero(__m512 (*acc)[8], const int R, const int NT) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[i][t] = _mm512_setzero_ps();
}

/* sums[i * NT + t] = W[r + i] . x[t] over the nb full blocks, for R rows and
 * NT (6..8) tokens of a plain type: one accumulator per (row, token), so that
 * each 16 activations loaded serve R rows. With 4 tokens per pass as in
 * cpu_avx512_mv, the activations of 6..8 tokens (more than L1 at K = 2048)
 * would be re-read from L2 for every row. */
CPU_INLINE void cpu_avx512_mv_rows(op_type type, const uint8_t *w, size_t ws, const float *x, size_t ldx,
                                   const int R, const int NT, int64_t nb, float *sums) {
    const size_t bs = type == OP_TYPE_F32 ? 128 : 64; /* bytes per block of 32 */
    __m512 acc[3][8];
    cpu_avx512_zero(acc, R, NT);
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
            for (size_t o = 0; o < bs; o += 64)
                _mm_prefetch((const char *)w + (size_t)i * ws + (size_t)b * bs + o + CPU_PF_DIST, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512 wv[3];
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) wv[i] = cpu_avx512_deq_half(type, w + (size_t)i * ws, b, h);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const __m512 xv = _mm512_loadu_ps(x + (size_t)t * ldx + b * 32 + 16 * h);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) sums[i * NT + t] = _mm512_reduce_add_ps(acc[i][t]);
}

/* Rows [r, r + R) x all m->t (6..8) tokens of a plain type, stored to y. */
CPU_INLINE void cpu_avx512_mv_rows_store(op_type type, const cpu_mm *m, int64_t r, const int R, const int NT) {
    const int64_t nb = m->k / 32;
    float sums[3 * 8];
    cpu_avx512_mv_rows(type, m->w + (size_t)r * m->w_stride, m->w_stride, m->x, m->ldx, R, NT, nb, sums);
    for (int i = 0; i < R; i++) {
        if (nb * 32 < m->k) cpu_portable_matvec_tail(m, r + i, nb * 32, 0, NT, sums + i * NT);
        for (int t = 0; t < NT; t++) m->y[(size_t)t * m->ldy + r + i] = sums[i * NT + t];
    }
}

CPU_INLINE void cpu_avx512_matvec_rows(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + 3 <= r1; r += 3) {
        switch (m->t) {
        case 6: cpu_avx512_mv_rows_store(type, m, r, 3, 6); break;
        case 7: cpu_avx512_mv_rows_store(type, m, r, 3, 7); break;
        default: cpu_avx512_mv_rows_store(type, m, r, 3, 8); break;
        }
    }
    for (; r < r1; r++) {
        switch (m->t) {
        case 6: cpu_avx512_mv_rows_store(type, m, r, 1, 6); break;
        case 7: cpu_avx512_mv_rows_store(type, m, r, 1, 7); break;
        default: cpu_avx512_mv_rows_store(type, m, r, 1, 8); break;
        }
    }
}

CPU_INLINE void cpu_avx512_matvec_any(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t nb = m->k / 32;
    if ((type == OP_TYPE_F32 || type == OP_TYPE_F16 || type == OP_TYPE_BF16) && m->t >= 6 && m->t <= 8) {
        cpu_avx512_matvec_rows(type, m, r0, r1);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + (size_t)r * m->w_stride;
        float scale = m->row_scale ? m->row_scale[r] : 1.0f;
        for (int64_t t0 = 0; t0 < m->t; t0 += CPU_MV_T) {
            int nt = (int)(m->t - t0 < CPU_MV_T ? m->t - t0 : CPU_MV_T);
            const float *x = m->x + (size_t)t0 * m->ldx;
            float sums[CPU_MV_T];
            switch (nt) {
            case 1: cpu_avx512_mv(type, row, x, m->ldx, 1, nb, sums); break;
            case 2: cpu_avx512_mv(type, row, x, m->ldx, 2, nb, sums); break;
            case 3: cpu_avx512_mv(type, row, x, m->ldx, 3, nb, sums); break;
            default: cpu_avx512_mv(type, row, x, m->ldx, 4, nb, sums); break;
            }
            if (nb * 32 < m->k) cpu_portable_matvec_tail(m, r, nb * 32, (int)t0, nt, sums);
            #pragma GCC unroll 16
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = scale * sums[t];
        }
    }
}

/* ---- exact matvec for the block types (Q8_0, Q4_0, Q4_1, I8) -----------------------
 *
 * f32 activations, f32 accumulation, weights dequantized in registers to exactly
 * op_dequantize_row's values: Q8_0 d * q (exact in f32: 11 x 8 significant
 * bits); Q4_0 / Q4_1 by a 16-entry table per block, tbl[j] = d * (j - 8) or
 * d * j + m (d * j is exact, so the FMA rounds once like the reference's add),
 * looked up with vpermps by the nibbles (vpmovzxbd, and a shift for the high
 * ones); I8 as q, the row scale applied to the sum. Each dequantized block is
 * used for R rows x NT tokens of accumulators. The f16 scales of 8 blocks are
 * picked out of the block bytes with word permutes (no scalar moves) and
 * converted at once. The weights are prefetched 2 KiB (into L1) and 16 KiB
 * (into L2) ahead in the order the kernel reads them. */

CPU_INLINE size_t cpu_qblock_bytes(op_type type) {
    return type == OP_TYPE_Q8_0   ? sizeof(op_block_q8_0)
           : type == OP_TYPE_Q4_0 ? sizeof(op_block_q4_0)
           : type == OP_TYPE_Q4_1 ? sizeof(op_block_q4_1)
                                  : 32; /* I8: 32 int8 */
}

/* dm[j] = d of block j < 8 starting at p (8 whole blocks of `type`), and for
 * Q4_1 dm[8 + j] = m. Reads only those 8 blocks. */
CPU_INLINE void cpu_avx512_scales8(op_type type, const uint8_t *p, float *dm) {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
    if (type == OP_TYPE_Q4_0) { /* d at word 9j */
        const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 0, 0, 63, 54, 45, 36, 27, 18, 9, 0);
        __m512i h = _mm512_permutex2var_epi16(a, idx, b);
        _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm512_castsi512_si128(h)));
    } else if (type == OP_TYPE_Q4_1) { /* d, m at words 10j, 10j + 1; block 7 from bytes 96.. */
        const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 61, 51, 41,
                                             31, 21, 11, 1, 0, 60, 50, 40, 30, 20, 10, 0);
        const __m512i idx7 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 23, 0, 0, 0,
                                              0, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0);
        __m512i h = _mm512_permutex2var_epi16(a, idx, b);
        h = _mm512_mask_permutexvar_epi16(h, (__mmask32)0x8080, idx7, _mm512_loadu_si512(p + 96));
        _mm512_storeu_ps(dm, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    } else { /* Q8_0: d at word 17j; blocks 4..7 from bytes 136.. */
        const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 0, 0, 51, 34, 17, 0, 51, 34, 17, 0);
        __m512i h0 = _mm512_permutex2var_epi16(a, idx, b);
        __m512i h1 = _mm512_permutex2var_epi16(_mm512_loadu_si512(p + 136), idx, _mm512_loadu_si512(p + 200));
        __m512i h = _mm512_mask_blend_epi16((__mmask32)0xf0, h0, h1);
        _mm256_storeu_ps(dm, _mm256_cvtph_ps(_mm512_castsi512_si128(h)));
    }
}

/* Block b of the row at blk (already offset to the block) dequantized: w0 =
 * elements 0..15, w1 = 16..31; d, m its scale and minimum (unused for I8). */
CPU_INLINE void cpu_avx512_qdeq(op_type type, const uint8_t *blk, float d, float m, __m512 base, __m512 *w0,
                                __m512 *w1) {
    if (type == OP_TYPE_Q8_0) {
        __m512 dv = _mm512_set1_ps(d);
        *w0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        *w1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
    } else if (type == OP_TYPE_I8) {
        *w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk)));
        *w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16))));
    } else {
        __m512 tbl = type == OP_TYPE_Q4_1 ? _mm512_fmadd_ps(_mm512_set1_ps(d), base, _mm512_set1_ps(m))
                                          : _mm512_mul_ps(_mm512_set1_ps(d), base);
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (type == OP_TYPE_Q4_1 ? 4 : 2))));
        *w0 = _mm512_permutexvar_ps(q, tbl);                       /* low nibbles: elements 0..15 */
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), tbl); /* high nibbles: 16..31 */
    }
}

/* Software prefetch of a group of R weight rows: the position CPU_QMV_PF_*
 * bytes ahead in the order the kernel reads the rows (8 blocks of each of
 * the R rows, then the next 8, then the next group of rows), as row i = 0 of
 * group `at` at block pb. Near (into L1) and far (into L2): the L2 requests
 * run ahead without holding L1 fill buffers. */
#define CPU_QMV_PF_L1 2048
#define CPU_QMV_PF_L2 16384

typedef struct cpu_qpf {
    const uint8_t *at; /* row 0 of the target group, at block pb */
    int64_t pb;
} cpu_qpf;

CPU_INLINE void cpu_qpf_init(cpu_qpf *p, const uint8_t *w, size_t ws, size_t bs, int64_t nb, int R, int64_t ahead) {
    const int64_t steps = ahead / (int64_t)((size_t)R * bs); /* blocks ahead in each row */
    p->pb = steps % nb;
    p->at = w + (size_t)(steps / nb) * (size_t)R * ws + (size_t)p->pb * bs;
}

CPU_INLINE void cpu_qpf_line(const char *a, bool l1) {
    if (l1)
        _mm_prefetch(a, _MM_HINT_T0);
    else
        _mm_prefetch(a, _MM_HINT_T1);
}

/* Prefetches (into L1, or L2) 8 blocks of each of the R rows at the position
 * (every line they touch), and moves it on. */
CPU_INLINE void cpu_qpf_step(cpu_qpf *p, size_t ws, size_t bs, int64_t nb, const int R, bool l1) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        const char *a = (const char *)p->at + (size_t)i * ws;
        cpu_qpf_line(a, l1);
        cpu_qpf_line(a + 64, l1);
        if (8 * bs > 128) cpu_qpf_line(a + 128, l1);
        if (8 * bs > 192) cpu_qpf_line(a + 192, l1);
        cpu_qpf_line(a + 8 * bs - 1, l1);
    }
    p->at += 8 * bs;
    p->pb += 8;
    if (p->pb >= nb) {
        p->pb -= nb;
        p->at += (size_t)R * ws - (size_t)nb * bs;
    }
}

/* Block b of rows w + i * ws (i < R), scales dm[i][j] / dm[i][8 + j], into
 * acc[i][t] for NT tokens of x (ldx floats apart). */
CPU_INLINE void cpu_avx512_qblock(op_type type, const uint8_t *w, size_t ws, int64_t b, const int R,
                                  float (*dm)[16], int j, const float *x, size_t ldx, const int NT, __m512 base,
                                  __m512 (*acc)[CPU_QMV_T][2]) {
    const size_t bs = cpu_qblock_bytes(type);
    const float *xb = x + b * 32;
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        __m512 w0, w1;
        cpu_avx512_qdeq(type, w + (size_t)i * ws + (size_t)b * bs, dm[i][j], dm[i][8 + j], base, &w0, &w1);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            acc[i][t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + t * ldx), acc[i][t][0]);
            acc[i][t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + t * ldx + 16), acc[i][t][1]);
        }
    }
}

/* sums[i * NT + t] = W[r + i] . x[t0 + t] for i < R, t < NT, over the m->k / 32
 * full blocks (the I8 row scale not applied). Steps of 8 blocks: prefetches,
 * their scales, then the blocks. */
CPU_INLINE void cpu_avx512_qmv(op_type type, const cpu_mm *m, int64_t r, const int R, int64_t t0, const int NT,
                               float *sums) {
    const size_t bs = cpu_qblock_bytes(type), ws = m->w_stride, ldx = m->ldx;
    const int64_t nb = m->k / 32;
    const uint8_t *w = m->w + (size_t)r * ws;
    const float *x = m->x + (size_t)t0 * ldx;
    const __m512 base = type == OP_TYPE_Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                             : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[4][CPU_QMV_T][2];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) acc[i][t][0] = acc[i][t][1] = _mm512_setzero_ps();
    float dm[4][16];
    cpu_qpf near, far;
    cpu_qpf_init(&near, w, ws, bs, nb, R, CPU_QMV_PF_L1);
    cpu_qpf_init(&far, w, ws, bs, nb, R, CPU_QMV_PF_L2);
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) {
        cpu_qpf_step(&near, ws, bs, nb, R, true);
        cpu_qpf_step(&far, ws, bs, nb, R, false);
        float(*d8)[16] = dm;
        if (type != OP_TYPE_I8) {
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) cpu_avx512_scales8(type, w + (size_t)i * ws + (size_t)b0 * bs, dm[i]);
            /* read the scales back through an opaque pointer: broadcasts from
             * memory (load ports) instead of lane shuffles (port 5) */
            __asm__("" : "+r"(d8));
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) cpu_avx512_qblock(type, w, ws, b0 + j, R, d8, j, x, ldx, NT, base, acc);
    }
    if (b0 < nb) { /* the last nb % 8 blocks */
        const int n = (int)(nb - b0);
        if (type != OP_TYPE_I8) {
            for (int i = 0; i < R; i++)
                for (int j = 0; j < n; j++) {
                    const uint8_t *p = w + (size_t)i * ws + (size_t)(b0 + j) * bs;
                    dm[i][j] = cpu_h2f(p);
                    dm[i][8 + j] = type == OP_TYPE_Q4_1 ? cpu_h2f(p + 2) : 0.0f;
                }
        }
        for (int j = 0; j < n; j++) cpu_avx512_qblock(type, w, ws, b0 + j, R, dm, j, x, ldx, NT, base, acc);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) sums[i * NT + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][t][0], acc[i][t][1]));
}

/* Rows [r, r + R) x tokens [t0, t0 + NT): the sums, the I8 tail (K % 32) and scale, stored to y. */
CPU_INLINE void cpu_avx512_qmv_store(op_type type, const cpu_mm *m, int64_t r, const int R, int64_t t0,
                                     const int NT) {
    float sums[4 * CPU_QMV_T];
    cpu_avx512_qmv(type, m, r, R, t0, NT, sums);
    for (int i = 0; i < R; i++) {
        if (type == OP_TYPE_I8 && m->k % 32) cpu_portable_matvec_tail(m, r + i, m->k / 32 * 32, (int)t0, NT, sums + i * NT);
        float s = type == OP_TYPE_I8 ? m->row_scale[r + i] : 1.0f;
        for (int t = 0; t < NT; t++) m->y[(size_t)(t0 + t) * m->ldy + r + i] = s * sums[i * NT + t];
    }
}

/* Rows per group for NT tokens: about 8..16 zmm accumulators. */
#define CPU_AVX512_QMV_ROWS(nt) ((nt) <= 2 ? 4 : (nt) <= 4 ? 2 : 1)

CPU_INLINE void cpu_avx512_matvec_exact(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    for (int64_t t0 = 0; t0 < m->t; t0 += CPU_QMV_T) {
        const int nt = (int)(m->t - t0 < CPU_QMV_T ? m->t - t0 : CPU_QMV_T);
        const int R = CPU_AVX512_QMV_ROWS(nt);
        int64_t r = r0;
        for (; r + R <= r1; r += R) {
            switch (nt) {
            case 1: cpu_avx512_qmv_store(type, m, r, CPU_AVX512_QMV_ROWS(1), t0, 1); break;
            case 2: cpu_avx512_qmv_store(type, m, r, CPU_AVX512_QMV_ROWS(2), t0, 2); break;
            case 3: cpu_avx512_qmv_store(type, m, r, CPU_AVX512_QMV_ROWS(3), t0, 3); break;
            case 4: cpu_avx512_qmv_store(type, m, r, CPU_AVX512_QMV_ROWS(4), t0, 4); break;
            case 5: cpu_avx512_qmv_store(type, m, r, 1, t0, 5); break;
            case 6: cpu_avx512_qmv_store(type, m, r, 1, t0, 6); break;
            case 7: cpu_avx512_qmv_store(type, m, r, 1, t0, 7); break;
            default: cpu_avx512_qmv_store(type, m, r, 1, t0, 8); break;
            }
        }
        for (; r < r1; r++) { /* rows left over when R > 1, so nt <= 4 */
            switch (nt) {
            case 1: cpu_avx512_qmv_store(type, m, r, 1, t0, 1); break;
            case 2: cpu_avx512_qmv_store(type, m, r, 1, t0, 2); break;
            case 3: cpu_avx512_qmv_store(type, m, r, 1, t0, 3); break;
            default: cpu_avx512_qmv_store(type, m, r, 1, t0, 4); break;
            }
        }
    }
}

/* ---- integer matvec (VNNI, opt-in) for Q4_0 / Q4_1 -------------------------------------------
 *
 * Activations: per pair of blocks (b, b+1) of a token, CPU_XQ_PAIR bytes:
 *   q[64]   int8 in the order x_b[0..15], x_b1[0..15], x_b[16..31], x_b1[16..31],
 *           matching the nibbles of two Q4 blocks unpacked as lo(b), lo(b1),
 *           hi(b), hi(b1);
 *   dx[16]  f32 scale of the block each int32 lane of vpdpbusd belongs to
 *           (lanes -> blocks {b x4, b1 x4, b x4, b1 x4});
 *   sx      Q4_1: f32 {0, sx_b, 0, sx_b1} with sx = dx * sum(q) of the block,
 *           lined up with the f16 pairs {d_b, m_b, d_b1, m_b1} of the weights;
 *           Q4_0: int32[16], -8 * (sum of the lane's 4 q), the starting value
 *           of vpdpbusd, which makes it sum (nib - 8) * q.
 * A block's dot is then d_w * dx * sum((nib - 8) * q) for Q4_0, d_w * dx *
 * sum(nib * q) + m_w sx for Q4_1. Quantizing x (d = amax / 127, q = rint(x / d))
 * costs at most dx/2 per element. */

static void cpu_avx512_quant_x_q4(op_type type, const float *x, int64_t k, uint8_t *dst) {
    for (int64_t p = 0; p < k / 64; p++) {
        const float *xb = x + p * 64;
        uint8_t *o = dst + p * CPU_XQ_PAIR;
        float dx[2], sx[2];
        int8_t q[64];
        for (int h = 0; h < 2; h++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[32 * h + j]));
            float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int v = (int)rintf(xb[32 * h + j] * id);
                q[32 * h + j] = (int8_t)v;
                sum += v;
            }
            dx[h] = d;
            sx[h] = d * (float)sum;
        }
        int8_t *oq = (int8_t *)o;
        for (int j = 0; j < 16; j++) {
            oq[j] = q[j];           /* x_b[0..15] */
            oq[16 + j] = q[32 + j]; /* x_b1[0..15] */
            oq[32 + j] = q[16 + j]; /* x_b[16..31] */
            oq[48 + j] = q[48 + j]; /* x_b1[16..31] */
        }
        for (int l = 0; l < 16; l++) {
            float d = dx[(l / 4) & 1];
            memcpy(o + 64 + 4 * l, &d, 4);
            if (type == OP_TYPE_Q4_0) {
                int32_t lane = 0;
                for (int j = 0; j < 4; j++) lane += oq[4 * l + j];
                lane *= -8;
                memcpy(o + 128 + 4 * l, &lane, 4);
            }
        }
        if (type == OP_TYPE_Q4_1) {
            float s4[4] = {0.0f, sx[0], 0.0f, sx[1]};
            memcpy(o + 128, s4, sizeof s4);
        }
    }
}

static void cpu_avx512_quant_x_q4_0(const float *x, int64_t k, uint8_t *dst) {
    cpu_avx512_quant_x_q4(OP_TYPE_Q4_0, x, k, dst);
}

static void cpu_avx512_quant_x_q4_1(const float *x, int64_t k, uint8_t *dst) {
    cpu_avx512_quant_x_q4(OP_TYPE_Q4_1, x, k, dst);
}

CPU_INLINE uint32_t cpu_ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* sums[t] = row . x[t] over np pairs of Q4 blocks, from the quantized activations. */
CPU_INLINE void cpu_avx512_mvq(op_type type, const uint8_t *row, const uint8_t *xq, size_t ldxq,
                               int nt, int64_t np, float *sums) {
    const bool q41 = type == OP_TYPE_Q4_1;
    const size_t bs = q41 ? sizeof(op_block_q4_1) : sizeof(op_block_q4_0);
    const int off = q41 ? 4 : 2; /* of qs in a block */
    const __m512i idx_d = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[CPU_MV_T];
    __m128 accm[CPU_MV_T];
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm512_setzero_ps();
        accm[t] = _mm_setzero_ps();
    }
    for (int64_t p = 0; p < np; p++) {
        const uint8_t *b0 = row + (size_t)(2 * p) * bs, *b1 = b0 + bs;
        _mm_prefetch((const char *)b0 + CPU_PF_DIST, _MM_HINT_T0);
        /* [d_b, m_b, d_b1, m_b1] (m is the first nibble bytes for Q4_0: unused) */
        __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)cpu_ld32(b0)), (int)cpu_ld32(b1), 1));
        __m512 dw = _mm512_permutexvar_ps(idx_d, _mm512_castps128_ps512(dm));
        __m256i qq = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + off))),
                                             _mm_loadu_si128((const __m128i *)(b1 + off)), 1);
        __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qq), _mm256_srli_epi16(qq, 4), 1), m4);
#pragma GCC unroll 16
        for (int t = 0; t < nt; t++) {
            const uint8_t *xp = xq + t * ldxq + (size_t)p * CPU_XQ_PAIR;
            __m512i xv = _mm512_loadu_si512(xp);
            __m512i dot = q41 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv)
                              : _mm512_dpbusd_epi32(_mm512_loadu_si512(xp + 128), w, xv);
            __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps((const float *)(xp + 64)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[t]);
            if (q41) accm[t] = _mm_fmadd_ps(dm, _mm_loadu_ps((const float *)(xp + 128)), accm[t]); /* m * sx */
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++) {
        __m128 m = _mm_add_ps(accm[t], _mm_movehl_ps(accm[t], accm[t]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        sums[t] = _mm512_reduce_add_ps(acc[t]) + (q41 ? _mm_cvtss_f32(m) : 0.0f);
    }
}

/* Q8_0 on the natural layout (cpu_quant_x_natural): per block, 256-bit
 * vpdpbusd of |w| with x carrying w's sign, scaled by d_w * dx. Faster here
 * than the 512-bit pair scheme, which needs a second vpdpbusd for the offset. */
CPU_INLINE void cpu_avx512_mvq8(const uint8_t *row, const uint8_t *xq, size_t ldxq, int nt, int64_t np,
                                float *sums) {
    const size_t bs = sizeof(op_block_q8_0);
    __m256 acc[CPU_MV_T];
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        _mm_prefetch((const char *)row + (size_t)(2 * p) * bs + CPU_PF_DIST, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *blk = row + (size_t)(2 * p + h) * bs;
            const float dw = cpu_h2f(blk);
            __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2)), aw = _mm256_abs_epi8(w);
#pragma GCC unroll 16
            for (int t = 0; t < nt; t++) {
                const uint8_t *xp = xq + t * ldxq + (size_t)p * CPU_XQ_PAIR;
                __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xp + 32 * h)), w);
                float dx;
                memcpy(&dx, xp + 64 + 4 * h, 4);
                __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, xv);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx), acc[t]);
            }
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++) {
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        sums[t] = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
    }
}

CPU_INLINE void cpu_avx512_matvec_q(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t np = m->k / 64;
    const size_t ldxq = CPU_XQ_BYTES(m->k);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + (size_t)r * m->w_stride;
        for (int64_t t0 = 0; t0 < m->t; t0 += CPU_MV_T) {
            int nt = (int)(m->t - t0 < CPU_MV_T ? m->t - t0 : CPU_MV_T);
            const uint8_t *xq = m->xq + (size_t)t0 * ldxq;
            float sums[CPU_MV_T];
            if (type == OP_TYPE_Q8_0) {
                switch (nt) {
                case 1: cpu_avx512_mvq8(row, xq, ldxq, 1, np, sums); break;
                case 2: cpu_avx512_mvq8(row, xq, ldxq, 2, np, sums); break;
                case 3: cpu_avx512_mvq8(row, xq, ldxq, 3, np, sums); break;
                default: cpu_avx512_mvq8(row, xq, ldxq, 4, np, sums); break;
                }
            } else {
            switch (nt) {
            case 1: cpu_avx512_mvq(type, row, xq, ldxq, 1, np, sums); break;
            case 2: cpu_avx512_mvq(type, row, xq, ldxq, 2, np, sums); break;
            case 3: cpu_avx512_mvq(type, row, xq, ldxq, 3, np, sums); break;
            default: cpu_avx512_mvq(type, row, xq, ldxq, 4, np, sums); break;
            }
            }
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = sums[t];
        }
    }
}

/* ---- dequantize a row slice (prefill panels, get_rows) ------------------------ */

CPU_INLINE void cpu_avx512_dequant_any(op_type type, const uint8_t *row, int64_t k0, int64_t n,
                                       float scale, float *out) {
    const int64_t b0 = k0 / 32, nfull = (k0 % 32 == 0) ? n / 32 : 0;
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < nfull; b++) {
        __m512 w0, w1;
        cpu_avx512_deq(type, row, b0 + b, &w0, &w1);
        if (type == OP_TYPE_I8) {
            w0 = _mm512_mul_ps(w0, s);
            w1 = _mm512_mul_ps(w1, s);
        }
        _mm512_storeu_ps(out + b * 32, w0);
        _mm512_storeu_ps(out + b * 32 + 16, w1);
    }
    if (nfull * 32 < n) cpu_portable_dequant_any(type, row, k0 + nfull * 32, n - nfull * 32, scale, out + nfull * 32);
}

#define CPU_AVX512_TYPE(name, type)                                                               \
    static void cpu_avx512_matvec_##name(const cpu_mm *m, int64_t r0, int64_t r1) {              \
        if ((type == OP_TYPE_Q8_0 || type == OP_TYPE_Q4_0 || type == OP_TYPE_Q4_1) && m->xq)     \
            cpu_avx512_matvec_q(type, m, r0, r1);                                                 \
        else if (type == OP_TYPE_Q8_0 || type == OP_TYPE_Q4_0 || type == OP_TYPE_Q4_1 ||         \
                 type == OP_TYPE_I8)                                                              \
            cpu_avx512_matvec_exact(type, m, r0, r1);                                             \
        else                                                                                      \
            cpu_avx512_matvec_any(type, m, r0, r1);                                               \
    }                                                                                             \
    static void cpu_avx512_dequant_##name(const uint8_t *w, size_t stride, int64_t r, int64_t k0, \
                                          int64_t n, float scale, float *out) {                   \
        cpu_avx512_dequant_any(type, w + (size_t)r * stride, k0, n, scale, out);                  \
    }
CPU_AVX512_TYPE(f32, OP_TYPE_F32)
CPU_AVX512_TYPE(f16, OP_TYPE_F16)
CPU_AVX512_TYPE(bf16, OP_TYPE_BF16)
CPU_AVX512_TYPE(q8_0, OP_TYPE_Q8_0)
CPU_AVX512_TYPE(q4_0, OP_TYPE_Q4_0)
CPU_AVX512_TYPE(q4_1, OP_TYPE_Q4_1)
CPU_AVX512_TYPE(i8, OP_TYPE_I8)

/* ---- interleaved Q4 and Q8_0 (Q4_0_R16, Q4_1_R16, Q8_0_R16) ----------------------
 *
 * One weight row per vector lane (the layout in ops.h): for each input k the
 * 16 rows' nibbles sit in one 32-bit word per lane, 8 inputs to a word. The
 * activations come rounded to integers per block of 32 (cpu_xw_block). A mask
 * of a word's low nibbles gives 16 rows' weights for its inputs 0, 2, 4, 6 as
 * bytes, a shift and the same mask those for 1, 3, 5, 7, and one vpdpbusd
 * multiplies either by four activation bytes and adds the products: 64
 * multiply-adds per instruction. Each activation is two signed bytes
 * (q = 256 hi + lo), so a chunk of 8 inputs takes four: seven instructions
 * for 128 multiply-adds, where int16 pairs (vpdpwssd) took nine. Per block
 * the integer sums (exact) are combined (lo + 256 hi) and scaled by the 16
 * rows' d times the block's activation scale in one FMA (Q4_0's -8 is folded
 * in as -8 * sum(q); Q4_1 adds m times the block's sum of x), and the 16
 * outputs are stored together: no horizontal sums. */

CPU_INLINE size_t cpu_r16_block_bytes(op_type type) {
    return OP_R16_ROWS * (type == OP_TYPE_Q4_1_R16 ? sizeof(op_block_q4_1) : sizeof(op_block_q4_0));
}

CPU_INLINE __m512 cpu_r16_table(op_type type) {
    return type == OP_TYPE_Q4_1_R16 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                    : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

/* Groups the batched-decode passes work on at once: enough independent
 * chains (groups x tokens) to cover the latency of the multiply-adds. */
#define CPU_R16_NG(nt) ((nt) == 1 ? 4 : (nt) <= 5 ? 2 : 1)

static void cpu_avx512_quant_xw(const float *x, int64_t k, cpu_xw_block *dst) {
    /* The low bytes of inputs 0..15, 16..31, then their high bytes, one
     * 16-byte lane each, are shuffled within the lanes into the words of q4
     * (inputs 8c + 2i, then 8c + 2i + 1, c < 2 per lane) and of q8 (inputs
     * 8c + 2i + {0, 1, 4, 5}), whose words are then put in order. */
    const __m512i q4_bytes =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m512i q4_words = _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    const __m512i q8_bytes =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
    const __m512i q8_words = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t b = 0; b < k / 32; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
        float d = amax / (float)CPU_XW_QMAX;
        const __m512 id = _mm512_set1_ps(d > 0 ? 1.0f / d : 0.0f);
        enum { rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, id), rn);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, id), rn);
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q0)),
                                             _mm512_cvtepi32_epi16(q1), 1);
        /* lo = q's low byte as a signed value, hi = (q - lo) / 256 */
        const __m512i lo0 = _mm512_srai_epi32(_mm512_slli_epi32(q0, 24), 24);
        const __m512i lo1 = _mm512_srai_epi32(_mm512_slli_epi32(q1, 24), 24);
        const __m512i hi0 = _mm512_srai_epi32(_mm512_sub_epi32(q0, lo0), 8);
        const __m512i hi1 = _mm512_srai_epi32(_mm512_sub_epi32(q1, lo1), 8);
        __m512i v = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(lo0));
        v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(lo1), 1);
        v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(hi0), 2);
        v = _mm512_inserti32x4(v, _mm512_cvtepi32_epi8(hi1), 3);
        _mm512_storeu_si512(dst[b].q4, _mm512_permutexvar_epi32(q4_words, _mm512_shuffle_epi8(v, q4_bytes)));
        _mm512_storeu_si512(dst[b].q8, _mm512_permutexvar_epi32(q8_words, _mm512_shuffle_epi8(v, q8_bytes)));
        if (!(s - s == 0)) d = s - s; /* an inf or NaN in x: NaN out, as in f32 */
        dst[b].d = d;
        /* from the values the kernels multiply (what an inf or NaN rounds
         * to is undefined, and does not matter then: d is NaN) */
        dst[b].off = -8 * _mm512_reduce_add_epi32(_mm512_madd_epi16(q, _mm512_set1_epi16(1)));
        dst[b].s = s;
        dst[b].pad = 0;
    }
}

/* y[i * 16 + t * ldy + r] = W[16 (g + i) + r] . x[t] for r < 16, t < NT
 * (1..8), groups i < NG at g + i * gs, over the nb blocks, with the tokens'
 * rounded activations xw ((NT, ldxw) blocks). Each (group, token) sums the
 * products with the activations' low bytes and those with their high bytes
 * in two chains. The integer sums are exact, so a token's result does not
 * depend on how many tokens or groups share its pass. */
CPU_INLINE void cpu_avx512_mv_r16(op_type type, const uint8_t *g, size_t gs, const int NG, int64_t nb,
                                  const cpu_xw_block *xw, size_t ldxw, const int NT, float *y, size_t ldy) {
    const bool q41 = type == OP_TYPE_Q4_1_R16;
    const size_t bb = cpu_r16_block_bytes(type), hdr = q41 ? 64 : 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[4][8];
    cpu_avx512_zero(acc, NG, NT);
    for (int64_t b = 0; b < nb; b++) {
        __m512i sl[4][8], sh[4][8];
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++) { /* without it, well under 0.7 of the bandwidth */
            /* and this block of the next NG groups, into L2: twice as many
             * streams in flight, which Q4 (more instructions per byte than
             * the other layouts, so fewer loads in flight) needs to keep up
             * with the memory: +4% of the bandwidth bound in Llama-3.2-1B
             * decode (the Q8_0 and f16 kernels gained nothing from it) */
            for (size_t o = 0; o < bb; o += 64) {
                _mm_prefetch((const char *)g + i * gs + (size_t)b * bb + o + CPU_PF_DIST, _MM_HINT_T0);
                _mm_prefetch((const char *)g + (i + NG) * gs + (size_t)b * bb + o, _MM_HINT_T1);
            }
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                sl[i][t] = q41 ? _mm512_setzero_si512() : _mm512_set1_epi32(xw[(size_t)t * ldxw + b].off);
                sh[i][t] = _mm512_setzero_si512();
            }
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < NG; i++) {
                const __m512i v = _mm512_loadu_si512(g + i * gs + (size_t)b * bb + hdr + 64 * c);
                const __m512i we = _mm512_and_si512(v, low), wo = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++) {
                    const int32_t *q4 = xw[(size_t)t * ldxw + b].q4 + 4 * c;
                    sl[i][t] = _mm512_dpbusd_epi32(sl[i][t], we, _mm512_set1_epi32(q4[0]));
                    sl[i][t] = _mm512_dpbusd_epi32(sl[i][t], wo, _mm512_set1_epi32(q4[1]));
                    sh[i][t] = _mm512_dpbusd_epi32(sh[i][t], we, _mm512_set1_epi32(q4[2]));
                    sh[i][t] = _mm512_dpbusd_epi32(sh[i][t], wo, _mm512_set1_epi32(q4[3]));
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++) {
            const uint8_t *p = g + i * gs + (size_t)b * bb;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
            const __m512 mn = q41 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))) : d;
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const cpu_xw_block *xb = xw + (size_t)t * ldxw + b;
                const __m512i sum = _mm512_add_epi32(sl[i][t], _mm512_slli_epi32(sh[i][t], 8));
                acc[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(sum),
                                            acc[i][t]);
                if (q41) acc[i][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xb->s), acc[i][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NG; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + i * OP_R16_ROWS + (size_t)t * ldy, acc[i][t]);
}

/* Q8_0_R16: the same bytes without masks. A weight word holds one row's
 * inputs 8c + 2i + {0, 1, 4, 5} as q + 128 (0..255), which one vpdpbusd
 * multiplies by the same inputs' low activation bytes, and one by their high
 * bytes (q8): two instructions for 64 multiply-adds. The + 128 adds
 * 128 * sum(q) to each block's sums, taken off by starting them at
 * -128 * sum(q) = 16 * off. Every sum is exact (|sum| < 2^29), as for Q4. */
CPU_INLINE void cpu_avx512_mv_r16q8(const uint8_t *g, size_t gs, const int NG, int64_t nb, const cpu_xw_block *xw,
                                    size_t ldxw, const int NT, float *y, size_t ldy) {
    const size_t bb = OP_R16_ROWS * sizeof(op_block_q8_0);
    __m512 acc[4][8];
    cpu_avx512_zero(acc, NG, NT);
    for (int64_t b = 0; b < nb; b++) {
        __m512i sl[4][8], sh[4][8];
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++) {
            for (size_t o = 0; o < bb; o += 64)
                _mm_prefetch((const char *)g + i * gs + (size_t)b * bb + o + CPU_PF_DIST, _MM_HINT_T0);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                sl[i][t] = _mm512_set1_epi32(16 * xw[(size_t)t * ldxw + b].off);
                sh[i][t] = _mm512_setzero_si512();
            }
        }
        /* the chunks only index memory: two at a time are enough, and whole
         * blocks unrolled over every (NG, NT) make the sanitizer builds slow */
#pragma GCC unroll 2
        for (int h = 0; h < 8; h++) {
#pragma GCC unroll 4
            for (int i = 0; i < NG; i++) {
                const __m512i v = _mm512_loadu_si512(g + i * gs + (size_t)b * bb + 32 + 64 * h);
#pragma GCC unroll 8
                for (int t = 0; t < NT; t++) {
                    const int32_t *q8 = xw[(size_t)t * ldxw + b].q8 + 2 * h;
                    sl[i][t] = _mm512_dpbusd_epi32(sl[i][t], v, _mm512_set1_epi32(q8[0]));
                    sh[i][t] = _mm512_dpbusd_epi32(sh[i][t], v, _mm512_set1_epi32(q8[1]));
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + i * gs + (size_t)b * bb)));
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const __m512i sum = _mm512_add_epi32(sl[i][t], _mm512_slli_epi32(sh[i][t], 8));
                acc[i][t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xw[(size_t)t * ldxw + b].d)),
                                            _mm512_cvtepi32_ps(sum), acc[i][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NG; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + i * OP_R16_ROWS + (size_t)t * ldy, acc[i][t]);
}

/* ---- interleaved 16-bit weights (F16_R16, BF16_R16) ----------------------------
 *
 * The same scheme without blocks: input k of the group's 16 rows is one
 * 32-byte load, widened to 16 floats (a convert, or a zero-extend and shift
 * for bf16), and FMA'd with each token's x[k]. Sums run in slices of 32
 * inputs (NC chains each) added into the total, like the blocks above. */

CPU_INLINE __m512 cpu_r16_half(op_type type, const uint8_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return type == OP_TYPE_F16_R16 ? _mm512_cvtph_ps(v)
                                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

CPU_INLINE void cpu_avx512_mv_r16h(op_type type, const uint8_t *g, size_t gs, const int NG, int64_t k,
                                   const float *x, size_t ldx, const int NT, float *y, size_t ldy) {
    __m512 acc[4][8];
    cpu_avx512_zero(acc, NG, NT);
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const int64_t kn = k - k0 < 32 ? k - k0 : 32;
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++)
            for (int o = 0; o < 32 * kn; o += 64)
                _mm_prefetch((const char *)g + i * gs + (size_t)k0 * 32 + o + CPU_PF_DIST, _MM_HINT_T0);
        __m512 s[4][8];
        cpu_avx512_zero(s, NG, NT);
#define CPU_R16H_STEP(j)                                                                                   \
    for (int i = 0; i < NG; i++) {                                                                         \
        const __m512 w = cpu_r16_half(type, g + i * gs + (size_t)(k0 + (j)) * 32);                         \
        for (int t = 0; t < NT; t++)                                                                       \
            s[i][t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(size_t)t * ldx + k0 + (j)]), s[i][t]);          \
    }
        if (kn == 32) {
#pragma GCC unroll 32
            for (int j = 0; j < 32; j++) CPU_R16H_STEP(j)
        } else {
            for (int j = 0; j < kn; j++) CPU_R16H_STEP(j)
        }
#undef CPU_R16H_STEP
#pragma GCC unroll 4
        for (int i = 0; i < NG; i++)
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) acc[i][t] = _mm512_add_ps(acc[i][t], s[i][t]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < NG; i++)
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + i * OP_R16_ROWS + (size_t)t * ldy, acc[i][t]);
}

/* Row r's elements [k0, k0 + n) of an F16_R16 / BF16_R16 weight: 16 at a time
 * by a gather of the aligned 32-bit words that hold them. */
CPU_INLINE void cpu_avx512_dequant_r16h(op_type type, const uint8_t *w, size_t stride, int64_t r, int64_t k0,
                                        int64_t n, float *out) {
    const int lane = (int)(r % OP_R16_ROWS);
    const uint8_t *g = w + (size_t)(r / OP_R16_ROWS) * OP_R16_ROWS * stride + 4 * (lane / 2);
    const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(32));
    const int hi = lane & 1;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_i32gather_epi32(step, g + (size_t)(k0 + i) * 32, 1);
        if (hi) v = _mm512_srli_epi32(v, 16);
        const __m512 f = type == OP_TYPE_F16_R16 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
                                                 : _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        _mm512_storeu_ps(out + i, f);
    }
    if (i < n) op_r16_dequant(type, w, stride, r, k0 + i, n - i, out + i);
}

/* One pass of NT tokens from t0 over NG groups from g, either kind of layout. */
CPU_INLINE void cpu_avx512_mv_r16_pass(op_type type, const cpu_mm *m, const uint8_t *g, const int NG, int64_t t0,
                                       const int NT, float *y) {
    const int64_t nb = m->k / 32;
    const size_t gs = OP_R16_ROWS * m->w_stride;
    const float *x = m->x + (size_t)t0 * m->ldx;
    if (type == OP_TYPE_F16_R16 || type == OP_TYPE_BF16_R16)
        cpu_avx512_mv_r16h(type, g, gs, NG, m->k, x, m->ldx, NT, y, m->ldy);
    else if (type == OP_TYPE_Q8_0_R16)
        cpu_avx512_mv_r16q8(g, gs, NG, nb, m->xw + (size_t)t0 * (size_t)nb, (size_t)nb, NT, y, m->ldy);
    else
        cpu_avx512_mv_r16(type, g, gs, NG, nb, m->xw + (size_t)t0 * (size_t)nb, (size_t)nb, NT, y, m->ldy);
}

/* NT tokens from t0 over the ng groups from g. ng never exceeds CPU_R16_NG(NT)
 * (it is chosen for the longest pass), so the other branches are dead code. */
#define CPU_R16_PASS(NT)                                                                            \
    do {                                                                                            \
        if (CPU_R16_NG(NT) >= 4 && ng == 4)                                                         \
            cpu_avx512_mv_r16_pass(type, m, g, 4, t0, NT, y);                                       \
        else if (CPU_R16_NG(NT) >= 2 && ng == 2)                                                    \
            cpu_avx512_mv_r16_pass(type, m, g, 2, t0, NT, y);                                       \
        else                                                                                        \
            cpu_avx512_mv_r16_pass(type, m, g, 1, t0, NT, y);                                       \
    } while (0)

/* Rows [r0, r1) (multiples of 16: matvec chunks are) for every token, in
 * passes of at most 8 tokens of equal size (T = 12: 6 and 6), each pass over
 * the same few groups' weights, which stay in L1 / L2. */
CPU_INLINE void cpu_avx512_matvec_r16(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const size_t gs = OP_R16_ROWS * m->w_stride;
    const int64_t passes = (m->t + 7) / 8, per = (m->t + passes - 1) / passes;
    const int want = CPU_R16_NG(per);
    for (int64_t r = r0; r < r1;) {
        const uint8_t *g = m->w + (size_t)(r / OP_R16_ROWS) * gs;
        const int64_t left = (r1 - r) / OP_R16_ROWS;
        const int ng = want >= 4 && left >= 4 ? 4 : want >= 2 && left >= 2 ? 2 : 1;
        for (int64_t t0 = 0; t0 < m->t; t0 += per) {
            float *y = m->y + (size_t)t0 * m->ldy + r;
            switch (m->t - t0 < per ? m->t - t0 : per) {
            case 1: CPU_R16_PASS(1); break;
            case 2: CPU_R16_PASS(2); break;
            case 3: CPU_R16_PASS(3); break;
            case 4: CPU_R16_PASS(4); break;
            case 5: CPU_R16_PASS(5); break;
            case 6: CPU_R16_PASS(6); break;
            case 7: CPU_R16_PASS(7); break;
            default: CPU_R16_PASS(8); break;
            }
        }
        r += (int64_t)ng * OP_R16_ROWS;
    }
}

/* Row r's elements [k0, k0 + n) (GEMM panels, get_rows): 16 at a time, two
 * words broadcast into the halves of a vector and shifted apart per lane. */
CPU_INLINE void cpu_avx512_dequant_r16(op_type type, const uint8_t *w, size_t stride, int64_t r, int64_t k0,
                                       int64_t n, float *out) {
    const bool q41 = type == OP_TYPE_Q4_1_R16;
    const size_t bb = cpu_r16_block_bytes(type), hdr = q41 ? 64 : 32;
    const int lane = (int)(r % OP_R16_ROWS);
    const uint8_t *g = w + (size_t)(r / OP_R16_ROWS) * OP_R16_ROWS * stride;
    const __m512 tbl = cpu_r16_table(type);
    const __m512i sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *p = g + (size_t)(k0 / 32 + b) * bb;
        const __m512 d = _mm512_set1_ps(cpu_h2f(p + 2 * lane));
        const __m512 mn = q41 ? _mm512_set1_ps(cpu_h2f(p + 32 + 2 * lane)) : d;
#pragma GCC unroll 2
        for (int c = 0; c < 4; c += 2) {
            uint32_t lo, hi;
            memcpy(&lo, p + hdr + 64 * c + 4 * lane, 4);
            memcpy(&hi, p + hdr + 64 * (c + 1) + 4 * lane, 4);
            const __m512i v = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)lo), (__mmask16)0xff00, (int)hi);
            const __m512 q = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh), tbl);
            _mm512_storeu_ps(out + b * 32 + 8 * c, q41 ? _mm512_fmadd_ps(d, q, mn) : _mm512_mul_ps(d, q));
        }
    }
}

#define CPU_AVX512_R16(name, type)                                                                     \
    static void cpu_avx512_matvec_##name(const cpu_mm *m, int64_t r0, int64_t r1) {                   \
        cpu_avx512_matvec_r16(type, m, r0, r1);                                                        \
    }                                                                                                  \
    static void cpu_avx512_dequant_##name(const uint8_t *w, size_t stride, int64_t r, int64_t k0,      \
                                          int64_t n, float scale, float *out) {                        \
        (void)scale;                                                                                   \
        if (type == OP_TYPE_F16_R16 || type == OP_TYPE_BF16_R16)                                       \
            cpu_avx512_dequant_r16h(type, w, stride, r, k0, n, out);                                   \
        else                                                                                           \
            cpu_avx512_dequant_r16(type, w, stride, r, k0, n, out);                                    \
    }
CPU_AVX512_R16(q4_0_r16, OP_TYPE_Q4_0_R16)
CPU_AVX512_R16(q4_1_r16, OP_TYPE_Q4_1_R16)
CPU_AVX512_R16(f16_r16, OP_TYPE_F16_R16)
CPU_AVX512_R16(bf16_r16, OP_TYPE_BF16_R16)

static void cpu_avx512_matvec_q8_0_r16(const cpu_mm *m, int64_t r0, int64_t r1) {
    cpu_avx512_matvec_r16(OP_TYPE_Q8_0_R16, m, r0, r1);
}

/* ---- gemm micro-kernel: 12 outputs x 32 tokens, 24 zmm accumulators ----------- */

#define CPU_AVX512_NR 12

/* One prefetch step of a micro-kernel (see cpu_gemm_pf): line l of row r, then on. */
CPU_INLINE void cpu_avx512_pf_step(const cpu_gemm_pf *pf, int *r, int *l) {
    if (*l < pf->lines) {
        _mm_prefetch((const char *)pf->at + (size_t)*r * pf->stride + (size_t)*l * 64, _MM_HINT_T1);
        if (++*r == pf->rows) {
            *r = 0;
            ++*l;
        }
    }
}

static void cpu_avx512_gemm(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                            int accumulate, const cpu_gemm_pf *pf) {
    cpu_gemm_pf pfl = pf && pf->rows > 0 ? *pf : (cpu_gemm_pf){0};
    int pr = 0, pl = 0;
    __m512 acc[CPU_AVX512_NR][2];
    #pragma GCC unroll 16
    for (int j = 0; j < CPU_AVX512_NR; j++) {
        acc[j][0] = accumulate ? _mm512_loadu_ps(c + j * CPU_TB) : _mm512_setzero_ps();
        acc[j][1] = accumulate ? _mm512_loadu_ps(c + j * CPU_TB + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        cpu_avx512_pf_step(&pfl, &pr, &pl);
        __m512 x0 = _mm512_loadu_ps(xt + k * CPU_TB), x1 = _mm512_loadu_ps(xt + k * CPU_TB + 16);
        #pragma GCC unroll 16
        for (int j = 0; j < CPU_AVX512_NR; j++) {
            __m512 w = _mm512_set1_ps(wf[j * ldw + k]);
            acc[j][0] = _mm512_fmadd_ps(w, x0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(w, x1, acc[j][1]);
        }
    }
    #pragma GCC unroll 16
    for (int j = 0; j < CPU_AVX512_NR; j++) {
        _mm512_storeu_ps(c + j * CPU_TB, acc[j][0]);
        _mm512_storeu_ps(c + j * CPU_TB + 16, acc[j][1]);
    }
}

/* ---- narrow gemm micro-kernel: 24 outputs x 16 tokens, 24 zmm accumulators ----
 *
 * For T % 32 in 1..16: one vector of tokens per output, so a taller panel.
 * Per k: one load of the 16 tokens and 24 FMAs, each broadcasting its weight
 * from the panel (a load, not a shuffle). The panel rows are CPU_WF_LD apart,
 * a constant here so that every row is a fixed displacement. */

#define CPU_AVX512_NR16 24

static void cpu_avx512_gemm16(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                              int accumulate, const cpu_gemm_pf *pf) {
    (void)ldw; /* CPU_WF_LD */
    cpu_gemm_pf pfl = pf && pf->rows > 0 ? *pf : (cpu_gemm_pf){0};
    int pr = 0, pl = 0;
    __m512 acc[CPU_AVX512_NR16];
    #pragma GCC unroll 32
    for (int j = 0; j < CPU_AVX512_NR16; j++)
        acc[j] = accumulate ? _mm512_loadu_ps(c + j * CPU_TB16) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        cpu_avx512_pf_step(&pfl, &pr, &pl);
        const __m512 x = _mm512_loadu_ps(xt + k * CPU_TB16);
        #pragma GCC unroll 32
        for (int j = 0; j < CPU_AVX512_NR16; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(wf[j * CPU_WF_LD + k]), x, acc[j]);
    }
    #pragma GCC unroll 32
    for (int j = 0; j < CPU_AVX512_NR16; j++) _mm512_storeu_ps(c + j * CPU_TB16, acc[j]);
}

/* ---- attention -------------------------------------------------------------- */

/* Elements d0 .. d0+15 of a K/V row (masked past hd). */
CPU_INLINE __m512 cpu_avx512_kv(const uint8_t *row, op_type t, int d0, __mmask16 mk) {
    if (t == OP_TYPE_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, row + 2 * d0));
    return _mm512_maskz_loadu_ps(mk, (const float *)row + d0);
}

CPU_INLINE __mmask16 cpu_avx512_mask(int left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* The 16 sums of v[0..15]'s lanes, as one vector (lane j: sum of v[j]):
 * pairs of vectors are interleaved and added, 45 instructions where 16
 * separate reductions take about 130. */
CPU_INLINE __m512 cpu_avx512_hsum16(__m512 v[16]) {
    __m512 r[8], s[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* per 128-bit lane: v[4i .. 4i + 3]'s sums over that lane */
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(s[2], s[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 positions at a time: each head's 16 dot products (the block's K rows
 * stay in L1 across the heads), reduced together by cpu_avx512_hsum16. */
static void cpu_avx512_scores(const float *q, size_t ldq, int nh, const uint8_t *k, op_type kt, size_t stride,
                              int n, int hd, float scale, float *s) {
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int jn = n - j0 < 16 ? n - j0 : 16;
        for (int h = 0; h < nh; h++) {
            const float *qh = q + (size_t)h * ldq;
            __m512 a[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int d = 0; d < hd; d += 16) {
                const __mmask16 mk = cpu_avx512_mask(hd - d);
                const __m512 qv = _mm512_maskz_loadu_ps(mk, qh + d);
                if (jn == 16) {
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++)
                        a[j] = _mm512_fmadd_ps(qv, cpu_avx512_kv(k + (size_t)(j0 + j) * stride, kt, d, mk), a[j]);
                } else {
                    for (int j = 0; j < jn; j++)
                        a[j] = _mm512_fmadd_ps(qv, cpu_avx512_kv(k + (size_t)(j0 + j) * stride, kt, d, mk), a[j]);
                }
            }
            _mm512_mask_storeu_ps(s + h * CPU_ATTN_CHUNK + j0, cpu_avx512_mask(jn),
                                  _mm512_mul_ps(_mm512_set1_ps(scale), cpu_avx512_hsum16(a)));
        }
    }
}

/* 64 columns at a time: each V row is read once for the NH heads (up to 16
 * accumulators). */
CPU_INLINE void cpu_avx512_accum_nh(const float *p, const int NH, const uint8_t *v, op_type vt, size_t stride, int n,
                                    int hd, float *acc) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        __mmask16 mk[4];
        __m512 a[CPU_ATTN_GROUP][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            int left = hd - d0 - 16 * i;
            mk[i] = left > 0 ? cpu_avx512_mask(left) : 0;
        }
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) a[h][i] = _mm512_maskz_loadu_ps(mk[i], acc + (size_t)h * hd + d0 + 16 * i);
        for (int j = 0; j < n; j++) {
            const uint8_t *row = v + (size_t)j * stride;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                if (!mk[i]) continue;
                const __m512 vv = cpu_avx512_kv(row, vt, d0 + 16 * i, mk[i]);
#pragma GCC unroll 4
                for (int h = 0; h < NH; h++)
                    a[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * CPU_ATTN_CHUNK + j]), vv, a[h][i]);
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(acc + (size_t)h * hd + d0 + 16 * i, mk[i], a[h][i]);
    }
}

static void cpu_avx512_accum(const float *p, int nh, const uint8_t *v, op_type vt, size_t stride, int n, int hd,
                             float *acc) {
    switch (nh) {
    case 1: cpu_avx512_accum_nh(p, 1, v, vt, stride, n, hd, acc); break;
    case 2: cpu_avx512_accum_nh(p, 2, v, vt, stride, n, hd, acc); break;
    case 3: cpu_avx512_accum_nh(p, 3, v, vt, stride, n, hd, acc); break;
    default: cpu_avx512_accum_nh(p, 4, v, vt, stride, n, hd, acc); break;
    }
}

/* glibc's vector expf (libmvec), 16 lanes */
__m512 _ZGVeN16v_expf(__m512 x);

static float cpu_avx512_exp_sum(float *s, int n, float m) {
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mk = cpu_avx512_mask(n - j);
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), _mm512_set1_ps(m)));
        _mm512_mask_storeu_ps(s + j, mk, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
    }
    return _mm512_reduce_add_ps(sum);
}

static void cpu_avx512_swiglu(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = cpu_avx512_mask(n - i > 16 ? 16 : (int)(n - i));
        const __m512 gv = _mm512_maskz_loadu_ps(mk, g + i);
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_mask_storeu_ps(out + i, mk,
                              _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                            _mm512_maskz_loadu_ps(mk, u + i)));
    }
}

static double cpu_avx512_sumsq(const float *x, int64_t n) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(cpu_avx512_mask(n - i > 16 ? 16 : (int)(n - i)), x + i);
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v)),
                      hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

static void cpu_avx512_to_f16(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = op_f32_to_f16(x[i]);
}

const cpu_kernels cpu_kernels_avx512 = {
    .name = "avx512",
    .nr = CPU_AVX512_NR,
    .nr16 = CPU_AVX512_NR16,
    .matvec =
        {
            [OP_TYPE_F32] = cpu_avx512_matvec_f32,
            [OP_TYPE_F16] = cpu_avx512_matvec_f16,
            [OP_TYPE_BF16] = cpu_avx512_matvec_bf16,
            [OP_TYPE_Q8_0] = cpu_avx512_matvec_q8_0,
            [OP_TYPE_Q4_0] = cpu_avx512_matvec_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx512_matvec_q4_1,
            [OP_TYPE_I8] = cpu_avx512_matvec_i8,
            [OP_TYPE_Q4_0_R16] = cpu_avx512_matvec_q4_0_r16,
            [OP_TYPE_Q4_1_R16] = cpu_avx512_matvec_q4_1_r16,
            [OP_TYPE_F16_R16] = cpu_avx512_matvec_f16_r16,
            [OP_TYPE_BF16_R16] = cpu_avx512_matvec_bf16_r16,
            [OP_TYPE_Q8_0_R16] = cpu_avx512_matvec_q8_0_r16,
        },
    .dequant =
        {
            [OP_TYPE_F32] = cpu_avx512_dequant_f32,
            [OP_TYPE_F16] = cpu_avx512_dequant_f16,
            [OP_TYPE_BF16] = cpu_avx512_dequant_bf16,
            [OP_TYPE_Q8_0] = cpu_avx512_dequant_q8_0,
            [OP_TYPE_Q4_0] = cpu_avx512_dequant_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx512_dequant_q4_1,
            [OP_TYPE_I8] = cpu_avx512_dequant_i8,
            [OP_TYPE_Q4_0_R16] = cpu_avx512_dequant_q4_0_r16,
            [OP_TYPE_Q4_1_R16] = cpu_avx512_dequant_q4_1_r16,
            [OP_TYPE_F16_R16] = cpu_avx512_dequant_f16_r16,
            [OP_TYPE_BF16_R16] = cpu_avx512_dequant_bf16_r16,
            [OP_TYPE_Q8_0_R16] = cpu_portable_dequant_q8_0_r16,
        },
    .gemm = cpu_avx512_gemm,
    .gemm16 = cpu_avx512_gemm16,
    .scores = cpu_avx512_scores,
    .accum = cpu_avx512_accum,
    .to_f16 = cpu_avx512_to_f16,
    .exp_sum = cpu_avx512_exp_sum,
    .swiglu = cpu_avx512_swiglu,
    .sumsq = cpu_avx512_sumsq,
    .quant_x =
        {
            [OP_TYPE_Q8_0] = cpu_quant_x_natural,
            [OP_TYPE_Q4_0] = cpu_avx512_quant_x_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx512_quant_x_q4_1,
        },
    .quant_xw = cpu_avx512_quant_xw,
};
