/* cpu-portable.c -- plain-C kernels of the CPU backend: the reference every SIMD path matches. */
#include <math.h>
#include <string.h>

#include "cpu-impl.h"

/* ---- dequantization ------------------------------------------------------ */

static inline uint16_t cpu_ld16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Any weight type: out[i] = W[k0 + i] for i < n. Block types need k0 and n
 * multiples of OP_QK. */
void cpu_portable_dequant_any(op_type type, const uint8_t *row, int64_t k0, int64_t n,
                              float scale, float *out) {
    switch (type) {
    case OP_TYPE_F32:
        memcpy(out, row + 4 * k0, (size_t)n * sizeof(float));
        break;
    case OP_TYPE_F16:
        for (int64_t i = 0; i < n; i++) out[i] = op_f16_to_f32(cpu_ld16(row + 2 * (k0 + i)));
        break;
    case OP_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) out[i] = op_bf16_to_f32(cpu_ld16(row + 2 * (k0 + i)));
        break;
    case OP_TYPE_I8:
        for (int64_t i = 0; i < n; i++) out[i] = scale * (float)((const int8_t *)row)[k0 + i];
        break;
    case OP_TYPE_Q8_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const uint8_t *blk = row + (size_t)(k0 / OP_QK + b) * sizeof(op_block_q8_0);
            float d = op_f16_to_f32(cpu_ld16(blk));
            const int8_t *qs = (const int8_t *)(blk + 2);
            for (int j = 0; j < OP_QK; j++) out[b * OP_QK + j] = d * (float)qs[j];
        }
        break;
    case OP_TYPE_Q4_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const uint8_t *blk = row + (size_t)(k0 / OP_QK + b) * sizeof(op_block_q4_0);
            float d = op_f16_to_f32(cpu_ld16(blk));
            const uint8_t *qs = blk + 2;
            for (int j = 0; j < OP_QK / 2; j++) {
                out[b * OP_QK + j] = d * (float)((qs[j] & 0x0f) - 8);
                out[b * OP_QK + j + OP_QK / 2] = d * (float)((qs[j] >> 4) - 8);
            }
        }
        break;
    case OP_TYPE_Q4_1:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const uint8_t *blk = row + (size_t)(k0 / OP_QK + b) * sizeof(op_block_q4_1);
            float d = op_f16_to_f32(cpu_ld16(blk)), m = op_f16_to_f32(cpu_ld16(blk + 2));
            const uint8_t *qs = blk + 4;
            for (int j = 0; j < OP_QK / 2; j++) {
                out[b * OP_QK + j] = d * (float)(qs[j] & 0x0f) + m;
                out[b * OP_QK + j + OP_QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        }
        break;
    default:
        memset(out, 0, (size_t)n * sizeof(float));
        break;
    }
}

void cpu_portable_dequant(op_type type, const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                          float scale, float *out) {
    if (op_type_row_group(type) > 1)
        op_r16_dequant(type, w, stride, r, k0, n, out);
    else
        cpu_portable_dequant_any(type, w + (size_t)r * stride, k0, n, scale, out);
}

#define CPU_PORTABLE_DEQUANT(name, type)                                                          \
    static void cpu_portable_dequant_##name(const uint8_t *w, size_t stride, int64_t r, int64_t k0, \
                                            int64_t n, float scale, float *out) {                 \
        cpu_portable_dequant(type, w, stride, r, k0, n, scale, out);                              \
    }
CPU_PORTABLE_DEQUANT(f32, OP_TYPE_F32)
CPU_PORTABLE_DEQUANT(f16, OP_TYPE_F16)
CPU_PORTABLE_DEQUANT(bf16, OP_TYPE_BF16)
CPU_PORTABLE_DEQUANT(q8_0, OP_TYPE_Q8_0)
CPU_PORTABLE_DEQUANT(q4_0, OP_TYPE_Q4_0)
CPU_PORTABLE_DEQUANT(q4_1, OP_TYPE_Q4_1)
CPU_PORTABLE_DEQUANT(i8, OP_TYPE_I8)
#define CPU_PORTABLE_R16(name, type)                                                               \
    void cpu_portable_dequant_##name(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n, \
                                     float scale, float *out) {                                        \
        (void)scale;                                                                                   \
        op_r16_dequant(type, w, stride, r, k0, n, out);                                                \
    }
CPU_PORTABLE_R16(q4_0_r16, OP_TYPE_Q4_0_R16)
CPU_PORTABLE_R16(q4_1_r16, OP_TYPE_Q4_1_R16)
CPU_PORTABLE_R16(f16_r16, OP_TYPE_F16_R16)
CPU_PORTABLE_R16(bf16_r16, OP_TYPE_BF16_R16)
CPU_PORTABLE_R16(q8_0_r16, OP_TYPE_Q8_0_R16)

/* ---- matvec -------------------------------------------------------------- */

/* sums[t] += sum_{k >= k0} W[r][k] * x[t0 + t][k] for t < nt, types of
 * single elements (the kernels' tails when K is not a multiple of 32). The I8 row scale is
 * left out: callers multiply the whole sum by it. */
void cpu_portable_matvec_tail(const cpu_mm *m, int64_t r, int64_t k0, int t0, int nt, float *sums) {
    for (int64_t k = k0; k < m->k; k++) {
        float w;
        cpu_portable_dequant(m->type, m->w, m->w_stride, r, k, 1, 1.0f, &w);
        for (int t = 0; t < nt; t++) sums[t] += w * m->x[(size_t)(t0 + t) * m->ldx + k];
    }
}

/* y[t][r] = W[r] . x[t]: dequantizes 32 weights at a time and dots them with
 * up to CPU_MV_T tokens, each with its own f32 accumulator. */
void cpu_portable_matvec(const cpu_mm *m, int64_t r0, int64_t r1) {
    const int64_t blk = OP_QK;
    const int64_t kfull = m->k / blk * blk;
    float w[OP_QK];
    for (int64_t r = r0; r < r1; r++) {
        float scale = m->row_scale ? m->row_scale[r] : 1.0f;
        for (int64_t t0 = 0; t0 < m->t; t0 += CPU_MV_T) {
            int nt = (int)(m->t - t0 < CPU_MV_T ? m->t - t0 : CPU_MV_T);
            float sums[CPU_MV_T] = {0};
            for (int64_t k = 0; k < kfull; k += blk) {
                cpu_portable_dequant(m->type, m->w, m->w_stride, r, k, blk, 1.0f, w);
                for (int t = 0; t < nt; t++) {
                    const float *x = m->x + (size_t)(t0 + t) * m->ldx + k;
                    float s = 0;
                    for (int j = 0; j < OP_QK; j++) s += w[j] * x[j];
                    sums[t] += s;
                }
            }
            if (kfull < m->k) cpu_portable_matvec_tail(m, r, kfull, (int)t0, nt, sums);
            for (int t = 0; t < nt; t++) m->y[(size_t)(t0 + t) * m->ldy + r] = scale * sums[t];
        }
    }
}

/* ---- gemm micro-kernel ---------------------------------------------------- */

#define CPU_PORTABLE_NR 4

static void cpu_portable_gemm(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                              int accumulate, const cpu_gemm_pf *pf) {
    (void)pf;
    float acc[CPU_PORTABLE_NR][CPU_TB];
    if (accumulate)
        memcpy(acc, c, sizeof acc);
    else
        memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < kc; k++) {
        const float *xk = xt + k * CPU_TB;
        for (int j = 0; j < CPU_PORTABLE_NR; j++) {
            float w = wf[j * ldw + k];
            for (int i = 0; i < CPU_TB; i++) acc[j][i] += w * xk[i];
        }
    }
    memcpy(c, acc, sizeof acc);
}

/* ---- attention ------------------------------------------------------------ */

static void cpu_portable_scores(const float *q, size_t ldq, int nh, const uint8_t *k, op_type kt, size_t stride,
                                int n, int hd, float scale, float *s) {
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < n; j++) {
            const uint8_t *row = k + (size_t)j * stride;
            const float *qh = q + (size_t)h * ldq;
            float sum = 0;
            if (kt == OP_TYPE_F16)
                for (int d = 0; d < hd; d++) sum += qh[d] * op_f16_to_f32(cpu_ld16(row + 2 * d));
            else
                for (int d = 0; d < hd; d++) sum += qh[d] * ((const float *)row)[d];
            s[h * CPU_ATTN_CHUNK + j] = sum * scale;
        }
}

static void cpu_portable_accum(const float *p, int nh, const uint8_t *v, op_type vt, size_t stride, int n, int hd,
                               float *acc) {
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < n; j++) {
            const uint8_t *row = v + (size_t)j * stride;
            const float pj = p[h * CPU_ATTN_CHUNK + j];
            float *ah = acc + (size_t)h * (size_t)hd;
            if (vt == OP_TYPE_F16)
                for (int d = 0; d < hd; d++) ah[d] += pj * op_f16_to_f32(cpu_ld16(row + 2 * d));
            else
                for (int d = 0; d < hd; d++) ah[d] += pj * ((const float *)row)[d];
        }
}

float cpu_portable_exp_sum(float *s, int n, float m) {
    float sum = 0;
    for (int j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

void cpu_portable_swiglu(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

double cpu_portable_sumsq(const float *x, int64_t n) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    return ss;
}

static void cpu_portable_to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = op_f32_to_f16(x[i]);
}

const cpu_kernels cpu_kernels_portable = {
    .name = "portable",
    .nr = CPU_PORTABLE_NR,
    .matvec =
        {
            [OP_TYPE_F32] = cpu_portable_matvec,
            [OP_TYPE_F16] = cpu_portable_matvec,
            [OP_TYPE_BF16] = cpu_portable_matvec,
            [OP_TYPE_Q8_0] = cpu_portable_matvec,
            [OP_TYPE_Q4_0] = cpu_portable_matvec,
            [OP_TYPE_Q4_1] = cpu_portable_matvec,
            [OP_TYPE_I8] = cpu_portable_matvec,
            [OP_TYPE_Q4_0_R16] = cpu_portable_matvec,
            [OP_TYPE_Q4_1_R16] = cpu_portable_matvec,
            [OP_TYPE_F16_R16] = cpu_portable_matvec,
            [OP_TYPE_BF16_R16] = cpu_portable_matvec,
            [OP_TYPE_Q8_0_R16] = cpu_portable_matvec,
        },
    .dequant =
        {
            [OP_TYPE_F32] = cpu_portable_dequant_f32,
            [OP_TYPE_F16] = cpu_portable_dequant_f16,
            [OP_TYPE_BF16] = cpu_portable_dequant_bf16,
            [OP_TYPE_Q8_0] = cpu_portable_dequant_q8_0,
            [OP_TYPE_Q4_0] = cpu_portable_dequant_q4_0,
            [OP_TYPE_Q4_1] = cpu_portable_dequant_q4_1,
            [OP_TYPE_I8] = cpu_portable_dequant_i8,
            [OP_TYPE_Q4_0_R16] = cpu_portable_dequant_q4_0_r16,
            [OP_TYPE_Q4_1_R16] = cpu_portable_dequant_q4_1_r16,
            [OP_TYPE_F16_R16] = cpu_portable_dequant_f16_r16,
            [OP_TYPE_BF16_R16] = cpu_portable_dequant_bf16_r16,
            [OP_TYPE_Q8_0_R16] = cpu_portable_dequant_q8_0_r16,
        },
    .gemm = cpu_portable_gemm,
    .scores = cpu_portable_scores,
    .accum = cpu_portable_accum,
    .to_f16 = cpu_portable_to_f16,
    .exp_sum = cpu_portable_exp_sum,
    .swiglu = cpu_portable_swiglu,
    .sumsq = cpu_portable_sumsq,
};
