/* cpu-avx512.c -- AVX-512 kernels of the CPU backend (compiled with -mavx512*; run only when present). */
#include <immintrin.h>
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

/* sums[t] = sum over the nb full blocks of row . x[t], for nt tokens; two
 * blocks per step into separate accumulators to hide the FMA latency. */
CPU_INLINE void cpu_avx512_mv(op_type type, const uint8_t *row, const float *x, size_t ldx, int nt,
                              int64_t nb, float *sums) {
    __m512 acc[CPU_MV_T][4];
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m512 w0, w1, w2, w3;
        cpu_avx512_deq(type, row, b, &w0, &w1);
        cpu_avx512_deq(type, row, b + 1, &w2, &w3);
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
        for (int t = 0; t < nt; t++) {
            const float *xp = x + t * ldx + b * 32;
            acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), acc[t][1]);
        }
    }
    for (int t = 0; t < nt; t++)
        sums[t] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3])));
}

CPU_INLINE void cpu_avx512_matvec_any(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t nb = m->k / 32;
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
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = scale * sums[t];
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
        cpu_avx512_matvec_any(type, m, r0, r1);                                                   \
    }                                                                                             \
    static void cpu_avx512_dequant_##name(const uint8_t *row, int64_t k0, int64_t n, float scale, \
                                          float *out) {                                           \
        cpu_avx512_dequant_any(type, row, k0, n, scale, out);                                     \
    }
CPU_AVX512_TYPE(f32, OP_TYPE_F32)
CPU_AVX512_TYPE(f16, OP_TYPE_F16)
CPU_AVX512_TYPE(bf16, OP_TYPE_BF16)
CPU_AVX512_TYPE(q8_0, OP_TYPE_Q8_0)
CPU_AVX512_TYPE(q4_0, OP_TYPE_Q4_0)
CPU_AVX512_TYPE(q4_1, OP_TYPE_Q4_1)
CPU_AVX512_TYPE(i8, OP_TYPE_I8)

/* ---- gemm micro-kernel: 12 outputs x 32 tokens, 24 zmm accumulators ----------- */

#define CPU_AVX512_NR 12

static void cpu_avx512_gemm(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                            int accumulate) {
    __m512 acc[CPU_AVX512_NR][2];
    for (int j = 0; j < CPU_AVX512_NR; j++) {
        acc[j][0] = accumulate ? _mm512_loadu_ps(c + j * CPU_TB) : _mm512_setzero_ps();
        acc[j][1] = accumulate ? _mm512_loadu_ps(c + j * CPU_TB + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        __m512 x0 = _mm512_loadu_ps(xt + k * CPU_TB), x1 = _mm512_loadu_ps(xt + k * CPU_TB + 16);
        for (int j = 0; j < CPU_AVX512_NR; j++) {
            __m512 w = _mm512_set1_ps(wf[j * ldw + k]);
            acc[j][0] = _mm512_fmadd_ps(w, x0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(w, x1, acc[j][1]);
        }
    }
    for (int j = 0; j < CPU_AVX512_NR; j++) {
        _mm512_storeu_ps(c + j * CPU_TB, acc[j][0]);
        _mm512_storeu_ps(c + j * CPU_TB + 16, acc[j][1]);
    }
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

static void cpu_avx512_scores(const float *q, const uint8_t *k, op_type kt, size_t stride, int n,
                              int hd, float scale, float *s) {
    for (int j = 0; j < n; j++) {
        const uint8_t *row = k + (size_t)j * stride;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int d = 0;
        for (; d + 32 <= hd; d += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), cpu_avx512_kv(row, kt, d, 0xffff), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), cpu_avx512_kv(row, kt, d + 16, 0xffff), a1);
        }
        for (; d < hd; d += 16) {
            __mmask16 mk = cpu_avx512_mask(hd - d);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + d), cpu_avx512_kv(row, kt, d, mk), a0);
        }
        s[j] = scale * _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
}

static void cpu_avx512_accum(const float *p, const uint8_t *v, op_type vt, size_t stride, int n,
                             int hd, float *acc) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        __mmask16 mk[4];
        __m512 a[4];
        for (int i = 0; i < 4; i++) {
            int left = hd - d0 - 16 * i;
            mk[i] = left > 0 ? cpu_avx512_mask(left) : 0;
            a[i] = _mm512_maskz_loadu_ps(mk[i], acc + d0 + 16 * i);
        }
        for (int j = 0; j < n; j++) {
            const uint8_t *row = v + (size_t)j * stride;
            __m512 pj = _mm512_set1_ps(p[j]);
            for (int i = 0; i < 4; i++)
                if (mk[i]) a[i] = _mm512_fmadd_ps(pj, cpu_avx512_kv(row, vt, d0 + 16 * i, mk[i]), a[i]);
        }
        for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(acc + d0 + 16 * i, mk[i], a[i]);
    }
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
    .matvec =
        {
            [OP_TYPE_F32] = cpu_avx512_matvec_f32,
            [OP_TYPE_F16] = cpu_avx512_matvec_f16,
            [OP_TYPE_BF16] = cpu_avx512_matvec_bf16,
            [OP_TYPE_Q8_0] = cpu_avx512_matvec_q8_0,
            [OP_TYPE_Q4_0] = cpu_avx512_matvec_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx512_matvec_q4_1,
            [OP_TYPE_I8] = cpu_avx512_matvec_i8,
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
        },
    .gemm = cpu_avx512_gemm,
    .scores = cpu_avx512_scores,
    .accum = cpu_avx512_accum,
    .to_f16 = cpu_avx512_to_f16,
};
