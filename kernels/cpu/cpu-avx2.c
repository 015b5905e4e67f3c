/* cpu-avx2.c -- AVX2/FMA/F16C kernels of the CPU backend (compiled with -mavx2 -mfma -mf16c). */
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

CPU_INLINE __m256 cpu_i8x8_to_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* ---- 32 weights of a row as four vectors ----------------------------------- */

/* Block b (32 elements) of a weight row, dequantized exactly into w[0..3]
 * (elements 0..7, 8..15, 16..23, 24..31). */
CPU_INLINE void cpu_avx2_deq(op_type type, const uint8_t *row, int64_t b, __m256 w[4]) {
    switch (type) {
    case OP_TYPE_F32: {
        const float *p = (const float *)row + b * 32;
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(p + 8 * i);
        break;
    }
    case OP_TYPE_F16: {
        const uint8_t *p = row + b * 64;
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
        break;
    }
    case OP_TYPE_BF16: {
        const uint8_t *p = row + b * 64;
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))), 16));
        break;
    }
    case OP_TYPE_I8: {
        const uint8_t *p = row + b * 32;
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) w[i] = cpu_i8x8_to_ps(p + 8 * i);
        break;
    }
    case OP_TYPE_Q8_0: {
        const uint8_t *p = row + b * sizeof(op_block_q8_0);
        __m256 d = _mm256_set1_ps(cpu_h2f(p));
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, cpu_i8x8_to_ps(p + 2 + 8 * i));
        break;
    }
    case OP_TYPE_Q4_0:
    case OP_TYPE_Q4_1: {
        const int q41 = type == OP_TYPE_Q4_1;
        const uint8_t *p = row + b * (q41 ? sizeof(op_block_q4_1) : sizeof(op_block_q4_0));
        __m256 d = _mm256_set1_ps(cpu_h2f(p));
        __m128i qs = _mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2)));
        const __m128i m4 = _mm_set1_epi8(0x0f);
        __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        __m256 q[4] = {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
        };
        if (q41) {
            __m256 mn = _mm256_set1_ps(cpu_h2f(p + 2));
            #pragma GCC unroll 16
            for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, q[i], mn);
        } else {
            const __m256 e8 = _mm256_set1_ps(8.0f);
            #pragma GCC unroll 16
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, _mm256_sub_ps(q[i], e8));
        }
        break;
    }
    default:
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) w[i] = _mm256_setzero_ps();
        break;
    }
}

CPU_INLINE float cpu_avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- matvec ---------------------------------------------------------------- */

/* Software prefetch CPU_PF_DIST bytes ahead of blocks b, b+1 (b even) of a row. */
CPU_INLINE void cpu_avx2_prefetch_blocks(op_type type, const uint8_t *row, int64_t b) {
    const size_t bytes = type == OP_TYPE_F32                              ? 256
                         : type == OP_TYPE_F16 || type == OP_TYPE_BF16      ? 128
                         : type == OP_TYPE_Q8_0                             ? 2 * sizeof(op_block_q8_0)
                         : type == OP_TYPE_Q4_0                             ? 2 * sizeof(op_block_q4_0)
                         : type == OP_TYPE_Q4_1                             ? 2 * sizeof(op_block_q4_1)
                                                                            : 64;
    const size_t at = (size_t)b * (bytes / 2);
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + at + o + CPU_PF_DIST, _MM_HINT_T0);
}

CPU_INLINE void cpu_avx2_mv(op_type type, const uint8_t *row, const float *x, size_t ldx, int nt,
                            int64_t nb, float *sums) {
    __m256 acc[CPU_MV_T][4];
    #pragma GCC unroll 16
    for (int t = 0; t < nt; t++)
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) acc[t][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        if ((b & 1) == 0) cpu_avx2_prefetch_blocks(type, row, b);
        cpu_avx2_deq(type, row, b, w);
        #pragma GCC unroll 16
        for (int t = 0; t < nt; t++) {
            const float *xp = x + t * ldx + b * 32;
            #pragma GCC unroll 16
            for (int i = 0; i < 4; i++) acc[t][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xp + 8 * i), acc[t][i]);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < nt; t++)
        sums[t] = cpu_avx2_hsum(
            _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3])));
}

CPU_INLINE void cpu_avx2_matvec_any(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t nb = m->k / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + (size_t)r * m->w_stride;
        float scale = m->row_scale ? m->row_scale[r] : 1.0f;
        for (int64_t t0 = 0; t0 < m->t; t0 += CPU_MV_T) {
            int nt = (int)(m->t - t0 < CPU_MV_T ? m->t - t0 : CPU_MV_T);
            const float *x = m->x + (size_t)t0 * m->ldx;
            float sums[CPU_MV_T];
            switch (nt) {
            case 1: cpu_avx2_mv(type, row, x, m->ldx, 1, nb, sums); break;
            case 2: cpu_avx2_mv(type, row, x, m->ldx, 2, nb, sums); break;
            case 3: cpu_avx2_mv(type, row, x, m->ldx, 3, nb, sums); break;
            default: cpu_avx2_mv(type, row, x, m->ldx, 4, nb, sums); break;
            }
            if (nb * 32 < m->k) cpu_portable_matvec_tail(m, r, nb * 32, (int)t0, nt, sums);
            #pragma GCC unroll 16
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = scale * sums[t];
        }
    }
}

/* ---- integer matvec (maddubs) for Q8_0 / Q4_0 / Q4_1 -------------------------------
 *
 * Activations in the natural layout of cpu_quant_x_natural. A block's dot is d_w * dx * sum(w * q),
 * with the Q4_0 offset (-8 d_w sx) and the Q4_1 minimum (m_w sx) added per
 * block as scalars. Quantizing x costs at most dx/2 per element. */

CPU_INLINE void cpu_avx2_mvq(op_type type, const uint8_t *row, const uint8_t *xq, size_t ldxq, int nt,
                             int64_t np, float *sums) {
    const size_t bs = type == OP_TYPE_Q8_0   ? sizeof(op_block_q8_0)
                      : type == OP_TYPE_Q4_0 ? sizeof(op_block_q4_0)
                                             : sizeof(op_block_q4_1);
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[CPU_MV_T];
    float corr[CPU_MV_T];
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        corr[t] = 0;
    }
    for (int64_t p = 0; p < np; p++) {
        _mm_prefetch((const char *)row + (size_t)(2 * p) * bs + CPU_PF_DIST, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *blk = row + (size_t)(2 * p + h) * bs;
            const float dw = cpu_h2f(blk), mw = type == OP_TYPE_Q4_1 ? cpu_h2f(blk + 2) : 0.0f;
            __m256i w, aw = _mm256_setzero_si256();
            if (type == OP_TYPE_Q8_0) {
                w = _mm256_loadu_si256((const __m256i *)(blk + 2));
                aw = _mm256_sign_epi8(w, w);
            } else {
                __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (type == OP_TYPE_Q4_1 ? 4 : 2)));
                w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
            }
#pragma GCC unroll 16
            for (int t = 0; t < nt; t++) {
                const uint8_t *xp = xq + t * ldxq + (size_t)p * CPU_XQ_PAIR;
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xp + 32 * h));
                __m256i prod = type == OP_TYPE_Q8_0 ? _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w))
                                                    : _mm256_maddubs_epi16(w, xv);
                float dx, sx;
                memcpy(&dx, xp + 64 + 4 * h, 4);
                memcpy(&sx, xp + 72 + 4 * h, 4);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones)),
                                         _mm256_set1_ps(dw * dx), acc[t]);
                if (type == OP_TYPE_Q4_0) corr[t] += dw * sx;
                if (type == OP_TYPE_Q4_1) corr[t] += mw * sx;
            }
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < nt; t++)
        sums[t] = cpu_avx2_hsum(acc[t]) + (type == OP_TYPE_Q4_0 ? -8.0f * corr[t] : corr[t]);
}

CPU_INLINE void cpu_avx2_matvec_q(op_type type, const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t np = m->k / 64;
    const size_t ldxq = CPU_XQ_BYTES(m->k);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = m->w + (size_t)r * m->w_stride;
        for (int64_t t0 = 0; t0 < m->t; t0 += CPU_MV_T) {
            int nt = (int)(m->t - t0 < CPU_MV_T ? m->t - t0 : CPU_MV_T);
            const uint8_t *xq = m->xq + (size_t)t0 * ldxq;
            float sums[CPU_MV_T];
            switch (nt) {
            case 1: cpu_avx2_mvq(type, row, xq, ldxq, 1, np, sums); break;
            case 2: cpu_avx2_mvq(type, row, xq, ldxq, 2, np, sums); break;
            case 3: cpu_avx2_mvq(type, row, xq, ldxq, 3, np, sums); break;
            default: cpu_avx2_mvq(type, row, xq, ldxq, 4, np, sums); break;
            }
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = sums[t];
        }
    }
}

/* ---- dequantize a row slice ------------------------------------------------- */

CPU_INLINE void cpu_avx2_dequant_any(op_type type, const uint8_t *row, int64_t k0, int64_t n,
                                     float scale, float *out) {
    const int64_t b0 = k0 / 32, nfull = (k0 % 32 == 0) ? n / 32 : 0;
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t b = 0; b < nfull; b++) {
        __m256 w[4];
        cpu_avx2_deq(type, row, b0 + b, w);
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(out + b * 32 + 8 * i, type == OP_TYPE_I8 ? _mm256_mul_ps(w[i], s) : w[i]);
    }
    if (nfull * 32 < n) cpu_portable_dequant_any(type, row, k0 + nfull * 32, n - nfull * 32, scale, out + nfull * 32);
}

#define CPU_AVX2_TYPE(name, type)                                                               \
    static void cpu_avx2_matvec_##name(const cpu_mm *m, int64_t r0, int64_t r1) {              \
        if ((type == OP_TYPE_Q8_0 || type == OP_TYPE_Q4_0 || type == OP_TYPE_Q4_1) && m->xq)   \
            cpu_avx2_matvec_q(type, m, r0, r1);                                                 \
        else                                                                                    \
            cpu_avx2_matvec_any(type, m, r0, r1);                                               \
    }                                                                                           \
    static void cpu_avx2_dequant_##name(const uint8_t *w, size_t stride, int64_t r, int64_t k0, \
                                        int64_t n, float scale, float *out) {                   \
        cpu_avx2_dequant_any(type, w + (size_t)r * stride, k0, n, scale, out);                  \
    }
CPU_AVX2_TYPE(f32, OP_TYPE_F32)
CPU_AVX2_TYPE(f16, OP_TYPE_F16)
CPU_AVX2_TYPE(bf16, OP_TYPE_BF16)
CPU_AVX2_TYPE(q8_0, OP_TYPE_Q8_0)
CPU_AVX2_TYPE(q4_0, OP_TYPE_Q4_0)
CPU_AVX2_TYPE(q4_1, OP_TYPE_Q4_1)
CPU_AVX2_TYPE(i8, OP_TYPE_I8)

/* ---- gemm micro-kernel: 6 outputs x 16 tokens (12 ymm accumulators), twice --- */

#define CPU_AVX2_NR 6

static void cpu_avx2_gemm(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                          int accumulate, const cpu_gemm_pf *pf) {
    (void)pf;
    for (int half = 0; half < 2; half++) {
        const float *xh = xt + 16 * half;
        float *ch = c + 16 * half;
        __m256 acc[CPU_AVX2_NR][2];
        #pragma GCC unroll 16
        for (int j = 0; j < CPU_AVX2_NR; j++) {
            acc[j][0] = accumulate ? _mm256_loadu_ps(ch + j * CPU_TB) : _mm256_setzero_ps();
            acc[j][1] = accumulate ? _mm256_loadu_ps(ch + j * CPU_TB + 8) : _mm256_setzero_ps();
        }
        for (int64_t k = 0; k < kc; k++) {
            __m256 x0 = _mm256_loadu_ps(xh + k * CPU_TB), x1 = _mm256_loadu_ps(xh + k * CPU_TB + 8);
            #pragma GCC unroll 16
            for (int j = 0; j < CPU_AVX2_NR; j++) {
                __m256 w = _mm256_broadcast_ss(wf + j * ldw + k);
                acc[j][0] = _mm256_fmadd_ps(w, x0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w, x1, acc[j][1]);
            }
        }
        #pragma GCC unroll 16
        for (int j = 0; j < CPU_AVX2_NR; j++) {
            _mm256_storeu_ps(ch + j * CPU_TB, acc[j][0]);
            _mm256_storeu_ps(ch + j * CPU_TB + 8, acc[j][1]);
        }
    }
}

/* ---- attention -------------------------------------------------------------- */

CPU_INLINE __m256 cpu_avx2_kv(const uint8_t *row, op_type t, int d) {
    if (t == OP_TYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * d)));
    return _mm256_loadu_ps((const float *)row + d);
}

CPU_INLINE float cpu_avx2_kv1(const uint8_t *row, op_type t, int d) {
    return t == OP_TYPE_F16 ? cpu_h2f(row + 2 * d) : ((const float *)row)[d];
}

/* One head's scores (see cpu_scores_fn). */
static void cpu_avx2_scores1(const float *q, const uint8_t *k, op_type kt, size_t stride, int n, int hd,
                             float scale, float *s) {
    for (int j = 0; j < n; j++) {
        const uint8_t *row = k + (size_t)j * stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int d = 0;
        for (; d + 16 <= hd; d += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), cpu_avx2_kv(row, kt, d), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), cpu_avx2_kv(row, kt, d + 8), a1);
        }
        for (; d + 8 <= hd; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), cpu_avx2_kv(row, kt, d), a0);
        float sum = cpu_avx2_hsum(_mm256_add_ps(a0, a1));
        for (; d < hd; d++) sum += q[d] * cpu_avx2_kv1(row, kt, d);
        s[j] = scale * sum;
    }
}

/* One head's accumulation (see cpu_accum_fn). */
static void cpu_avx2_accum1(const float *p, const uint8_t *v, op_type vt, size_t stride, int n, int hd,
                            float *acc) {
    int d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32) {
        __m256 a[4];
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
        for (int j = 0; j < n; j++) {
            const uint8_t *row = v + (size_t)j * stride;
            __m256 pj = _mm256_set1_ps(p[j]);
            #pragma GCC unroll 16
            for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(pj, cpu_avx2_kv(row, vt, d0 + 8 * i), a[i]);
        }
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
    }
    for (; d0 + 8 <= hd; d0 += 8) {
        __m256 a = _mm256_loadu_ps(acc + d0);
        for (int j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), cpu_avx2_kv(v + (size_t)j * stride, vt, d0), a);
        _mm256_storeu_ps(acc + d0, a);
    }
    for (; d0 < hd; d0++)
        for (int j = 0; j < n; j++) acc[d0] += p[j] * cpu_avx2_kv1(v + (size_t)j * stride, vt, d0);
}

static void cpu_avx2_scores(const float *q, size_t ldq, int nh, const uint8_t *k, op_type kt, size_t stride,
                            int n, int hd, float scale, float *s) {
    for (int h = 0; h < nh; h++)
        cpu_avx2_scores1(q + (size_t)h * ldq, k, kt, stride, n, hd, scale, s + h * CPU_ATTN_CHUNK);
}

static void cpu_avx2_accum(const float *p, int nh, const uint8_t *v, op_type vt, size_t stride, int n, int hd,
                           float *acc) {
    for (int h = 0; h < nh; h++)
        cpu_avx2_accum1(p + h * CPU_ATTN_CHUNK, v, vt, stride, n, hd, acc + (size_t)h * (size_t)hd);
}

/* glibc's vector expf (libmvec), 8 lanes */
__m256 _ZGVdN8v_expf(__m256 x);

static void cpu_avx2_swiglu(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                _mm256_loadu_ps(u + i)));
    }
    cpu_portable_swiglu(g + i, u + i, out + i, n - i);
}

static double cpu_avx2_sumsq(const float *x, int64_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(a0, a1));
    return t[0] + t[1] + t[2] + t[3] + cpu_portable_sumsq(x + i, n - i);
}

static void cpu_avx2_to_f16(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = op_f32_to_f16(x[i]);
}

const cpu_kernels cpu_kernels_avx2 = {
    .name = "avx2",
    .nr = CPU_AVX2_NR,
    .matvec =
        {
            [OP_TYPE_F32] = cpu_avx2_matvec_f32,
            [OP_TYPE_F16] = cpu_avx2_matvec_f16,
            [OP_TYPE_BF16] = cpu_avx2_matvec_bf16,
            [OP_TYPE_Q8_0] = cpu_avx2_matvec_q8_0,
            [OP_TYPE_Q4_0] = cpu_avx2_matvec_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx2_matvec_q4_1,
            [OP_TYPE_I8] = cpu_avx2_matvec_i8,
            /* the interleaved types are the AVX-512 kernel's layout: here
             * they are only correct, never chosen by op_weight_prepare */
            [OP_TYPE_Q4_0_R16] = cpu_portable_matvec,
            [OP_TYPE_Q4_1_R16] = cpu_portable_matvec,
            [OP_TYPE_F16_R16] = cpu_portable_matvec,
            [OP_TYPE_BF16_R16] = cpu_portable_matvec,
            [OP_TYPE_Q8_0_R16] = cpu_portable_matvec,
        },
    .dequant =
        {
            [OP_TYPE_F32] = cpu_avx2_dequant_f32,
            [OP_TYPE_F16] = cpu_avx2_dequant_f16,
            [OP_TYPE_BF16] = cpu_avx2_dequant_bf16,
            [OP_TYPE_Q8_0] = cpu_avx2_dequant_q8_0,
            [OP_TYPE_Q4_0] = cpu_avx2_dequant_q4_0,
            [OP_TYPE_Q4_1] = cpu_avx2_dequant_q4_1,
            [OP_TYPE_I8] = cpu_avx2_dequant_i8,
            [OP_TYPE_Q4_0_R16] = cpu_portable_dequant_q4_0_r16,
            [OP_TYPE_Q4_1_R16] = cpu_portable_dequant_q4_1_r16,
            [OP_TYPE_F16_R16] = cpu_portable_dequant_f16_r16,
            [OP_TYPE_BF16_R16] = cpu_portable_dequant_bf16_r16,
            [OP_TYPE_Q8_0_R16] = cpu_portable_dequant_q8_0_r16,
        },
    .gemm = cpu_avx2_gemm,
    .scores = cpu_avx2_scores,
    .accum = cpu_avx2_accum,
    .to_f16 = cpu_avx2_to_f16,
    .exp_sum = cpu_portable_exp_sum,
    .swiglu = cpu_avx2_swiglu,
    .sumsq = cpu_avx2_sumsq,
    .quant_x =
        {
            [OP_TYPE_Q8_0] = cpu_quant_x_natural,
            [OP_TYPE_Q4_0] = cpu_quant_x_natural,
            [OP_TYPE_Q4_1] = cpu_quant_x_natural,
        },
};
