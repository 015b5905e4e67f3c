/* ops.c -- type traits, scalar conversions, row (de)quantization and op dispatch. */
#include "ops-impl.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "parse.h"
#include "status.h"

/* ---- type traits -------------------------------------------------------- */

static const struct {
    const char *name;
    int block_elems;
    size_t block_bytes;
    bool weight;
} op_type_traits[OP_TYPE_COUNT] = {
    [OP_TYPE_F32] = {"f32", 1, 4, true},
    [OP_TYPE_F16] = {"f16", 1, 2, true},
    [OP_TYPE_BF16] = {"bf16", 1, 2, true},
    [OP_TYPE_Q8_0] = {"q8_0", OP_QK, sizeof(op_block_q8_0), true},
    [OP_TYPE_Q4_0] = {"q4_0", OP_QK, sizeof(op_block_q4_0), true},
    [OP_TYPE_Q4_1] = {"q4_1", OP_QK, sizeof(op_block_q4_1), true},
    [OP_TYPE_I8] = {"i8", 1, 1, true},
    [OP_TYPE_I32] = {"i32", 1, 4, false},
    [OP_TYPE_Q4_0_R16] = {"q4_0_r16", OP_QK, sizeof(op_block_q4_0), true},
    [OP_TYPE_Q4_1_R16] = {"q4_1_r16", OP_QK, sizeof(op_block_q4_1), true},
    [OP_TYPE_F16_R16] = {"f16_r16", 1, 2, true},
    [OP_TYPE_BF16_R16] = {"bf16_r16", 1, 2, true},
    [OP_TYPE_Q8_0_R16] = {"q8_0_r16", OP_QK, sizeof(op_block_q8_0), true},
};

_Static_assert(sizeof(op_block_q8_0) == 34, "q8_0 block layout");
_Static_assert(sizeof(op_block_q4_0) == 18, "q4_0 block layout");
_Static_assert(sizeof(op_block_q4_1) == 20, "q4_1 block layout");

const char *op_type_name(op_type type) {
    return (unsigned)type < OP_TYPE_COUNT ? op_type_traits[type].name : "invalid";
}

int op_type_block_elems(op_type type) {
    assert((unsigned)type < OP_TYPE_COUNT);
    return op_type_traits[type].block_elems;
}

size_t op_type_block_bytes(op_type type) {
    assert((unsigned)type < OP_TYPE_COUNT);
    return op_type_traits[type].block_bytes;
}

size_t op_row_bytes(op_type type, int64_t n) {
    return (size_t)(n / op_type_block_elems(type)) * op_type_block_bytes(type);
}

bool op_type_is_weight(op_type type) {
    return (unsigned)type < OP_TYPE_COUNT && op_type_traits[type].weight;
}

int op_type_row_group(op_type type) { return op_type_plain(type) != type ? OP_R16_ROWS : 1; }

op_type op_type_plain(op_type type) {
    switch (type) {
    case OP_TYPE_Q4_0_R16: return OP_TYPE_Q4_0;
    case OP_TYPE_Q4_1_R16: return OP_TYPE_Q4_1;
    case OP_TYPE_F16_R16: return OP_TYPE_F16;
    case OP_TYPE_BF16_R16: return OP_TYPE_BF16;
    case OP_TYPE_Q8_0_R16: return OP_TYPE_Q8_0;
    default: return type;
    }
}

/* ---- descriptors -------------------------------------------------------- */

static op_tensor op_tensor_make(op_type type, void *data, int ndim, const int64_t *ne) {
    op_tensor t;
    memset(&t, 0, sizeof t);
    t.type = type;
    t.ndim = ndim;
    t.data = data;
    for (int i = 0; i < 4; i++) t.ne[i] = i < ndim ? ne[i] : 1;
    t.nb[0] = op_type_block_bytes(type);
    t.nb[1] = op_row_bytes(type, t.ne[0]);
    for (int i = 2; i < 4; i++) t.nb[i] = t.nb[i - 1] * (size_t)t.ne[i - 1];
    return t;
}

op_tensor op_tensor_1d(op_type type, void *data, int64_t ne0) {
    int64_t ne[1] = {ne0};
    return op_tensor_make(type, data, 1, ne);
}

op_tensor op_tensor_2d(op_type type, void *data, int64_t ne0, int64_t ne1) {
    int64_t ne[2] = {ne0, ne1};
    return op_tensor_make(type, data, 2, ne);
}

op_tensor op_tensor_3d(op_type type, void *data, int64_t ne0, int64_t ne1, int64_t ne2) {
    int64_t ne[3] = {ne0, ne1, ne2};
    return op_tensor_make(type, data, 3, ne);
}

op_tensor op_tensor_kv_cache(op_type type, void *data, int64_t head_dim, int64_t n_kv_heads, int64_t max_len) {
    op_tensor t = op_tensor_3d(type, data, head_dim, n_kv_heads, max_len);
    t.nb[2] = t.nb[1];
    t.nb[1] = t.nb[1] * (size_t)max_len;
    t.nb[3] = t.nb[1] * (size_t)n_kv_heads;
    return t;
}

int64_t op_tensor_nelems(const op_tensor *t) { return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]; }

size_t op_tensor_nbytes(const op_tensor *t) {
    return op_row_bytes(t->type, t->ne[0]) * (size_t)(t->ne[1] * t->ne[2] * t->ne[3]);
}

bool op_tensor_is_contiguous(const op_tensor *t) {
    if (t->nb[0] != op_type_block_bytes(t->type)) return false;
    if (t->nb[1] != op_row_bytes(t->type, t->ne[0])) return false;
    for (int i = 2; i < 4; i++)
        if (t->ne[i] > 1 && t->nb[i] != t->nb[i - 1] * (size_t)t->ne[i - 1]) return false;
    return true;
}

/* ---- scalar conversions ------------------------------------------------- */

float op_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t op_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00);
    if (absx < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        float a;
        memcpy(&a, &absx, sizeof a);
        /* a * 2^24 rounded to nearest even gives the subnormal mantissa */
        float r = nearbyintf(a * 16777216.0f);
        return (uint16_t)(sign | (uint32_t)r);
    }
    uint32_t mant = absx & 0x7fffff;
    uint32_t exp = (absx >> 23) - 127 + 15;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++; /* may carry into the exponent: correct */
    return (uint16_t)(sign | h);
}

float op_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t op_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* ---- rows --------------------------------------------------------------- */

/* Q8_0_R16: the input (within its block) that byte j of a row's word in chunk
 * c holds: chunk 2c' + i holds inputs 8c' + 2i + {0, 1, 4, 5} (see ops.h). */
static int op_r16_q8_input(int c, int j) { return 8 * (c / 2) + 2 * (c % 2) + j % 2 + 4 * (j / 2); }

void op_r16_dequant(op_type type, const uint8_t *w, size_t row_bytes, int64_t r, int64_t k0, int64_t n,
                    float *out) {
    if (type == OP_TYPE_F16_R16 || type == OP_TYPE_BF16_R16) {
        const uint8_t *p = w + (size_t)(r / OP_R16_ROWS) * OP_R16_ROWS * row_bytes + 2 * (size_t)(r % OP_R16_ROWS);
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (size_t)(k0 + i) * 2 * OP_R16_ROWS, 2);
            out[i] = type == OP_TYPE_F16_R16 ? op_f16_to_f32(h) : op_bf16_to_f32(h);
        }
        return;
    }
    const size_t bb = OP_R16_ROWS * op_type_block_bytes(type); /* bytes per block of a group */
    const size_t hdr = type == OP_TYPE_Q4_1_R16 ? 64 : 32;    /* scales (and minimums) */
    const int lane = (int)(r % OP_R16_ROWS);
    const uint8_t *g = w + (size_t)(r / OP_R16_ROWS) * OP_R16_ROWS * row_bytes;
    for (int64_t b = 0; b < n / OP_QK; b++) {
        const uint8_t *blk = g + (size_t)(k0 / OP_QK + b) * bb;
        uint16_t h;
        memcpy(&h, blk + 2 * lane, 2);
        float d = op_f16_to_f32(h), m = 0.0f;
        if (type == OP_TYPE_Q8_0_R16) {
            for (int c = 0; c < 8; c++) {
                const uint8_t *q = blk + hdr + 64 * c + 4 * lane;
                for (int j = 0; j < 4; j++) out[b * OP_QK + op_r16_q8_input(c, j)] = d * (float)(q[j] - 128);
            }
            continue;
        }
        if (type == OP_TYPE_Q4_1_R16) {
            memcpy(&h, blk + 32 + 2 * lane, 2);
            m = op_f16_to_f32(h);
        }
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = blk + hdr + 64 * c + 4 * lane;
            uint32_t word = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
            for (int j = 0; j < 8; j++) {
                int v = (int)(word >> (4 * j) & 0x0f);
                out[b * OP_QK + 8 * c + j] = type == OP_TYPE_Q4_1_R16 ? d * (float)v + m : d * (float)(v - 8);
            }
        }
    }
}

int op_repack_weight(const op_tensor *src, op_type type, void *dst) {
    if (op_type_plain(type) == type || src->type != op_type_plain(type) || src->ne[2] * src->ne[3] != 1 ||
        src->ne[1] % OP_R16_ROWS || src->ne[0] % op_type_block_elems(src->type) || !op_tensor_is_contiguous(src))
        return fu_errorf(FU_ERR_INVALID, "repack %s: cannot make %s of a %s (%lld, %lld) tensor",
                         src->name ? src->name : "", op_type_name(type), op_type_name(src->type),
                         (long long)src->ne[1], (long long)src->ne[0]);
    if (op_type_block_elems(src->type) == 1) { /* 16-bit values: 16 rows' input k side by side */
        const int64_t k = src->ne[0];
        uint8_t *o = dst;
        for (int64_t g = 0; g < src->ne[1] / OP_R16_ROWS; g++, o += (size_t)k * 2 * OP_R16_ROWS)
            for (int r = 0; r < OP_R16_ROWS; r++) {
                const uint8_t *row = (const uint8_t *)src->data + (size_t)(g * OP_R16_ROWS + r) * src->nb[1];
                for (int64_t i = 0; i < k; i++) memcpy(o + (size_t)i * 2 * OP_R16_ROWS + 2 * r, row + 2 * i, 2);
            }
        return FU_OK;
    }
    const bool q41 = src->type == OP_TYPE_Q4_1;
    const size_t bs = op_type_block_bytes(src->type), hdr = q41 ? 64 : 32, qoff = q41 ? 4 : 2;
    const int64_t nb = src->ne[0] / OP_QK;
    uint8_t *o = dst;
    for (int64_t g = 0; g < src->ne[1] / OP_R16_ROWS; g++)
        for (int64_t b = 0; b < nb; b++, o += OP_R16_ROWS * bs)
            for (int r = 0; r < OP_R16_ROWS; r++) {
                const uint8_t *blk = (const uint8_t *)src->data + (size_t)(g * OP_R16_ROWS + r) * src->nb[1] + (size_t)b * bs;
                memcpy(o + 2 * r, blk, 2);
                if (q41) memcpy(o + 32 + 2 * r, blk + 2, 2);
                const uint8_t *qs = blk + qoff;
                if (src->type == OP_TYPE_Q8_0) { /* each q offset by 128 */
                    for (int c = 0; c < 8; c++) {
                        uint8_t *word = o + hdr + 64 * c + 4 * r;
                        for (int j = 0; j < 4; j++) word[j] = (uint8_t)((int8_t)qs[op_r16_q8_input(c, j)] + 128);
                    }
                    continue;
                }
                for (int c = 0; c < 4; c++) {
                    uint8_t *word = o + hdr + 64 * c + 4 * r;
                    for (int j = 0; j < 8; j += 2) { /* element e < 16: low nibble of qs[e], else high of qs[e - 16] */
                        int e0 = 8 * c + j, e1 = e0 + 1;
                        int v0 = e0 < 16 ? qs[e0] & 0x0f : qs[e0 - 16] >> 4;
                        int v1 = e1 < 16 ? qs[e1] & 0x0f : qs[e1 - 16] >> 4;
                        word[j / 2] = (uint8_t)(v0 | v1 << 4);
                    }
                }
            }
    return FU_OK;
}

void op_dequantize_row(const op_tensor *t, int64_t row, float *out) {
    const int64_t n = t->ne[0];
    if (op_type_row_group(t->type) > 1) {
        op_r16_dequant(t->type, t->data, t->nb[1], row, 0, n, out);
        return;
    }
    const uint8_t *p = (const uint8_t *)t->data + (size_t)row * t->nb[1];
    switch (t->type) {
    case OP_TYPE_F32:
        memcpy(out, p, (size_t)n * sizeof(float));
        break;
    case OP_TYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = op_f16_to_f32(h);
        }
        break;
    case OP_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = op_bf16_to_f32(h);
        }
        break;
    case OP_TYPE_Q8_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            op_block_q8_0 blk;
            memcpy(&blk, p + b * sizeof blk, sizeof blk);
            float d = op_f16_to_f32(blk.d);
            for (int j = 0; j < OP_QK; j++) out[b * OP_QK + j] = d * (float)blk.qs[j];
        }
        break;
    case OP_TYPE_Q4_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            op_block_q4_0 blk;
            memcpy(&blk, p + b * sizeof blk, sizeof blk);
            float d = op_f16_to_f32(blk.d);
            for (int j = 0; j < OP_QK / 2; j++) {
                out[b * OP_QK + j] = d * (float)((blk.qs[j] & 0x0f) - 8);
                out[b * OP_QK + j + OP_QK / 2] = d * (float)((blk.qs[j] >> 4) - 8);
            }
        }
        break;
    case OP_TYPE_Q4_1:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            op_block_q4_1 blk;
            memcpy(&blk, p + b * sizeof blk, sizeof blk);
            float d = op_f16_to_f32(blk.d), m = op_f16_to_f32(blk.m);
            for (int j = 0; j < OP_QK / 2; j++) {
                out[b * OP_QK + j] = d * (float)(blk.qs[j] & 0x0f) + m;
                out[b * OP_QK + j + OP_QK / 2] = d * (float)(blk.qs[j] >> 4) + m;
            }
        }
        break;
    case OP_TYPE_I8: {
        float s = t->row_scale ? t->row_scale[row] : 1.0f;
        for (int64_t i = 0; i < n; i++) out[i] = s * (float)((const int8_t *)p)[i];
        break;
    }
    case OP_TYPE_I32:
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, p + 4 * i, 4);
            out[i] = (float)v;
        }
        break;
    default:
        assert(!"op_dequantize_row: bad type");
    }
}

void op_quantize_row(op_type type, const float *x, int64_t n, void *dst, float *row_scale) {
    uint8_t *p = dst;
    switch (type) {
    case OP_TYPE_F32:
        memcpy(p, x, (size_t)n * sizeof(float));
        break;
    case OP_TYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = op_f32_to_f16(x[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        break;
    case OP_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = op_f32_to_bf16(x[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        break;
    case OP_TYPE_Q8_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const float *xb = x + b * OP_QK;
            float amax = 0;
            for (int j = 0; j < OP_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
            op_block_q8_0 blk;
            blk.d = op_f32_to_f16(d);
            for (int j = 0; j < OP_QK; j++) blk.qs[j] = (int8_t)roundf(xb[j] * id);
            memcpy(p + b * sizeof blk, &blk, sizeof blk);
        }
        break;
    case OP_TYPE_Q4_0:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const float *xb = x + b * OP_QK;
            float amax = 0, max = 0;
            for (int j = 0; j < OP_QK; j++)
                if (fabsf(xb[j]) > amax) {
                    amax = fabsf(xb[j]);
                    max = xb[j];
                }
            float d = max / -8.0f, id = d ? 1.0f / d : 0.0f;
            op_block_q4_0 blk;
            blk.d = op_f32_to_f16(d);
            for (int j = 0; j < OP_QK / 2; j++) {
                int q0 = (int)(xb[j] * id + 8.5f), q1 = (int)(xb[j + OP_QK / 2] * id + 8.5f);
                q0 = q0 > 15 ? 15 : q0 < 0 ? 0 : q0;
                q1 = q1 > 15 ? 15 : q1 < 0 ? 0 : q1;
                blk.qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
            memcpy(p + b * sizeof blk, &blk, sizeof blk);
        }
        break;
    case OP_TYPE_Q4_1:
        for (int64_t b = 0; b < n / OP_QK; b++) {
            const float *xb = x + b * OP_QK;
            float mn = xb[0], mx = xb[0];
            for (int j = 1; j < OP_QK; j++) {
                mn = fminf(mn, xb[j]);
                mx = fmaxf(mx, xb[j]);
            }
            float d = (mx - mn) / 15.0f, id = d ? 1.0f / d : 0.0f;
            op_block_q4_1 blk;
            blk.d = op_f32_to_f16(d);
            blk.m = op_f32_to_f16(mn);
            for (int j = 0; j < OP_QK / 2; j++) {
                int q0 = (int)((xb[j] - mn) * id + 0.5f), q1 = (int)((xb[j + OP_QK / 2] - mn) * id + 0.5f);
                q0 = q0 > 15 ? 15 : q0 < 0 ? 0 : q0;
                q1 = q1 > 15 ? 15 : q1 < 0 ? 0 : q1;
                blk.qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
            memcpy(p + b * sizeof blk, &blk, sizeof blk);
        }
        break;
    case OP_TYPE_I8: {
        float amax = 0;
        for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
        float s = amax / 127.0f, is = s ? 1.0f / s : 0.0f;
        for (int64_t i = 0; i < n; i++) ((int8_t *)p)[i] = (int8_t)roundf(x[i] * is);
        if (row_scale) *row_scale = s;
        break;
    }
    default:
        assert(!"op_quantize_row: bad type");
    }
}

/* ---- dispatch ----------------------------------------------------------- */

/* A backend may be shared by threads (a shard serving two spans during a
 * move): calls on one backend are serialized, each op running whole, since
 * ops share the backend's scratch and thread pool. */
#define OP_LOCKED(be, call)                        \
    do {                                           \
        pthread_mutex_lock(&(be)->lock);           \
        int op_rc_ = (call);                       \
        pthread_mutex_unlock(&(be)->lock);         \
        return op_rc_;                             \
    } while (0)

void op_backend_base_init(op_backend *be, const op_backend_vtbl *v, int n_threads) {
    be->v = v;
    be->n_threads = n_threads;
    pthread_mutex_init(&be->lock, NULL);
}

void op_backend_free(op_backend *be) {
    if (!be) return;
    pthread_mutex_destroy(&be->lock);
    be->v->free(be);
}

const char *op_backend_name(const op_backend *be) { return be->v->name; }

const char *op_backend_isa(const op_backend *be) { return be->v->isa ? be->v->isa(be) : be->v->name; }

int op_backend_n_threads(const op_backend *be) { return be->n_threads; }

bool op_backend_supports(const op_backend *be, op_type weight_type) {
    return be->v->supports(be, weight_type);
}

void *op_buffer_alloc(op_backend *be, size_t nbytes) { return be->v->buffer_alloc(be, nbytes); }

void op_buffer_free(op_backend *be, void *ptr) {
    if (ptr) be->v->buffer_free(be, ptr);
}

int op_buffer_set(op_backend *be, void *dst, const void *src, size_t nbytes) {
    OP_LOCKED(be, be->v->buffer_set(be, dst, src, nbytes));
}

int op_buffer_get(op_backend *be, void *dst, const void *src, size_t nbytes) {
    OP_LOCKED(be, be->v->buffer_get(be, dst, src, nbytes));
}

int op_weight_prepare(op_backend *be, const op_tensor *w, op_tensor *out) {
    *out = *w;
    if (!be->v->weight_prepare) return 0;
    OP_LOCKED(be, be->v->weight_prepare(be, w, out));
}

int op_tensor_upload(op_backend *be, const op_tensor *t, op_tensor *out) {
    *out = *t;
    if (!be->v->upload) return 0;
    OP_LOCKED(be, be->v->upload(be, t, out));
}

op_type op_weight_layout(const op_backend *be, op_type type, int64_t rows) {
    return be->v->weight_layout ? be->v->weight_layout(be, type, rows) : type;
}

int op_reserve(op_backend *be, int64_t max_tokens, int64_t max_k) {
    OP_LOCKED(be, be->v->reserve(be, max_tokens, max_k));
}

int op_synchronize(op_backend *be) {
    if (!be->v->synchronize) return FU_OK;
    OP_LOCKED(be, be->v->synchronize(be));
}

static int op_matmul_check(const op_backend *be, const op_tensor *w, const op_tensor *x, const op_tensor *y) {
    if (w->ne[0] != x->ne[0] || y->ne[0] != w->ne[1] || y->ne[1] != x->ne[1])
        return fu_errorf(FU_ERR_INVALID,
                         "matmul %s: W (%lld, %lld) x (%lld, %lld) -> y (%lld, %lld) mismatch",
                         w->name ? w->name : "", (long long)w->ne[1], (long long)w->ne[0],
                         (long long)x->ne[1], (long long)x->ne[0], (long long)y->ne[1],
                         (long long)y->ne[0]);
    if (x->type != OP_TYPE_F32 || y->type != OP_TYPE_F32)
        return fu_errorf(FU_ERR_INVALID, "matmul: activations must be f32");
    if (!be->v->supports(be, w->type))
        return fu_errorf(FU_ERR_UNSUPPORTED, "matmul: backend %s has no %s weights", be->v->name,
                         op_type_name(w->type));
    return FU_OK;
}

int op_matmul(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y) {
    int rc = op_matmul_check(be, w, x, y);
    if (rc) return rc;
    OP_LOCKED(be, be->v->matmul(be, w, x, y));
}

static int op_matmul_each(op_backend *be, int n, const op_tensor *const *w, const op_tensor *x,
                          op_tensor *const *y) {
    for (int i = 0; i < n; i++) {
        int rc = be->v->matmul(be, w[i], x, y[i]);
        if (rc) return rc;
    }
    return FU_OK;
}

int op_matmul_n(op_backend *be, int n, const op_tensor *const *w, const op_tensor *x, op_tensor *const *y) {
    if (n < 1 || n > OP_MATMUL_N_MAX)
        return fu_errorf(FU_ERR_INVALID, "matmul_n: %d weights, not 1..%d", n, OP_MATMUL_N_MAX);
    for (int i = 0; i < n; i++) {
        int rc = op_matmul_check(be, w[i], x, y[i]);
        if (rc) return rc;
    }
    OP_LOCKED(be, be->v->matmul_n ? be->v->matmul_n(be, n, w, x, y) : op_matmul_each(be, n, w, x, y));
}

int op_rmsnorm(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y) {
    if ((w && w->ne[0] != x->ne[0]) || y->ne[0] != x->ne[0] ||
        op_tensor_nelems(y) != op_tensor_nelems(x))
        return fu_errorf(FU_ERR_INVALID, "rmsnorm: shape mismatch");
    OP_LOCKED(be, be->v->rmsnorm(be, x, w, eps, y));
}

int op_rope(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p) {
    if (p->rot_dim <= 0 || p->rot_dim > x->ne[0] || p->rot_dim % 2)
        return fu_errorf(FU_ERR_INVALID, "rope: rot_dim %d with head_dim %lld", p->rot_dim,
                         (long long)x->ne[0]);
    OP_LOCKED(be, be->v->rope(be, x, pos, p));
}

int op_attention(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out) {
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads || q->ne[0] != a->head_dim ||
        q->ne[1] != a->n_heads || op_tensor_nelems(out) != op_tensor_nelems(q))
        return fu_errorf(FU_ERR_INVALID, "attention: shape mismatch");
    OP_LOCKED(be, be->v->attention(be, q, a, out));
}

int op_kv_layout_of(const op_tensor *d, int64_t cols, int index, op_kv_layout *out) {
    const bool heads = d->ndim >= 3 && d->ne[3] == 1 && d->ne[0] > 0 && d->ne[0] * d->ne[1] == cols;
    const int last = heads ? 2 : d->ndim > 1 ? d->ndim - 1 : 1;
    *out = (op_kv_layout){d->ne[last], heads ? d->ne[0] : cols, d->nb[last], heads ? d->nb[1] : 0};
    if ((d->type != OP_TYPE_F32 && d->type != OP_TYPE_F16) || op_tensor_nelems(d) != out->len * cols ||
        d->nb[0] != op_type_block_bytes(d->type) || !d->data)
        return fu_errorf(FU_ERR_INVALID, "kv_store: cache %d must be F32/F16 rows of %lld", index,
                         (long long)cols);
    return FU_OK;
}

int op_kv_store(op_backend *be, const op_tensor *src, op_tensor *const *dst, int n_seqs,
                const int32_t *seq, const int32_t *pos) {
    for (int64_t t = 0; t < src->ne[1]; t++) {
        if (seq[t] < 0 || seq[t] >= n_seqs)
            return fu_errorf(FU_ERR_RANGE, "kv_store: sequence %d outside [0, %d)", seq[t], n_seqs);
        const op_tensor *d = dst[seq[t]];
        int64_t rows = src->ne[0] ? op_tensor_nelems(d) / src->ne[0] : 0; /* positions of C values */
        if (pos[t] < 0 || pos[t] >= rows)
            return fu_errorf(FU_ERR_RANGE, "kv_store: position %d outside a cache of %lld", pos[t],
                             (long long)rows);
    }
    OP_LOCKED(be, be->v->kv_store(be, src, dst, seq, pos));
}

int op_swiglu(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out) {
    if (op_tensor_nelems(gate) != op_tensor_nelems(up) ||
        op_tensor_nelems(out) != op_tensor_nelems(gate))
        return fu_errorf(FU_ERR_INVALID, "swiglu: shape mismatch");
    OP_LOCKED(be, be->v->swiglu(be, gate, up, out));
}

int op_add(op_backend *be, op_tensor *x, const op_tensor *y) {
    if (op_tensor_nelems(x) != op_tensor_nelems(y))
        return fu_errorf(FU_ERR_INVALID, "add: shape mismatch");
    OP_LOCKED(be, be->v->add(be, x, y));
}

int op_add_row(op_backend *be, op_tensor *x, const op_tensor *b) {
    if (b->ne[0] != x->ne[0]) return fu_errorf(FU_ERR_INVALID, "add_row: shape mismatch");
    OP_LOCKED(be, be->v->add_row(be, x, b));
}

int op_add_rows(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale) {
    if (!be->v->add_rows)
        return fu_errorf(FU_ERR_UNSUPPORTED, "add_rows: not supported by the %s backend", be->v->name);
    if (y->ne[0] != x->ne[0]) return fu_errorf(FU_ERR_INVALID, "add_rows: shape mismatch");
    const int64_t R = op_tensor_nelems(x) / (x->ne[0] ? x->ne[0] : 1);
    for (int64_t i = 0; i < y->ne[1]; i++)
        if (rows[i] < 0 || rows[i] >= R)
            return fu_errorf(FU_ERR_RANGE, "add_rows: row %d outside [0, %lld)", rows[i], (long long)R);
    OP_LOCKED(be, be->v->add_rows(be, x, rows, y, scale));
}

int op_get_rows(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out) {
    if (out->ne[0] != table->ne[0]) return fu_errorf(FU_ERR_INVALID, "get_rows: shape mismatch");
    for (int64_t t = 0; t < out->ne[1]; t++)
        if (ids[t] < 0 || ids[t] >= table->ne[1])
            return fu_errorf(FU_ERR_RANGE, "get_rows: id %d outside [0, %lld)", ids[t],
                             (long long)table->ne[1]);
    OP_LOCKED(be, be->v->get_rows(be, table, ids, out));
}

int op_softmax(op_backend *be, op_tensor *x) { OP_LOCKED(be, be->v->softmax(be, x)); }

int op_log_softmax(op_backend *be, op_tensor *x) { OP_LOCKED(be, be->v->log_softmax(be, x)); }

/* ---- training (backward) ops ------------------------------------------------ */

bool op_backend_can_train(const op_backend *be) {
    const op_backend_vtbl *v = be->v;
    return v->matmul_back && v->outer_acc && v->rmsnorm_back && v->swiglu_back && v->attention_back &&
           v->cross_entropy && v->dropout;
}

/* FU_ERR_UNSUPPORTED naming `op` unless the backend has it (its entry is not NULL). */
static int op_train_has(const op_backend *be, bool has, const char *op) {
    return has ? FU_OK : fu_errorf(FU_ERR_UNSUPPORTED, "%s: not supported by the %s backend", op, be->v->name);
}

/* Rows of a tensor whose rows are ne[0] long (dimensions 1..3 flattened). */
static int64_t op_rows(const op_tensor *t) { return t->ne[1] * t->ne[2] * t->ne[3]; }

/* FU_ERR_INVALID unless each of the n tensors is contiguous f32 with data. */
static int op_check_f32(const char *op, int n, const op_tensor *const *t) {
    for (int i = 0; i < n; i++)
        if (t[i]->type != OP_TYPE_F32 || !t[i]->data || !op_tensor_is_contiguous(t[i]))
            return fu_errorf(FU_ERR_INVALID, "%s: %s must be contiguous f32, not %s", op,
                             t[i]->name ? t[i]->name : "every activation", op_type_name(t[i]->type));
    return FU_OK;
}

static int op_check_beta(const char *op, float beta) {
    return beta == 0.0f || beta == 1.0f ? FU_OK : fu_errorf(FU_ERR_INVALID, "%s: beta %g is not 0 or 1", op, beta);
}

int op_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta) {
    int rc = op_train_has(be, be->v->matmul_back != NULL, "matmul_back");
    if (rc) return rc;
    if (w->ne[2] * w->ne[3] != 1 || dy->ne[0] != w->ne[1] || dx->ne[0] != w->ne[0] || op_rows(dy) != op_rows(dx))
        return fu_errorf(FU_ERR_INVALID, "matmul_back %s: dy (%lld, %lld) @ W (%lld, %lld) -> dx (%lld, %lld) mismatch",
                         w->name ? w->name : "", (long long)op_rows(dy), (long long)dy->ne[0], (long long)w->ne[1],
                         (long long)w->ne[0], (long long)op_rows(dx), (long long)dx->ne[0]);
    if ((rc = op_check_f32("matmul_back", 2, (const op_tensor *[]){dy, dx})) || (rc = op_check_beta("matmul_back", beta)))
        return rc;
    if (!be->v->supports(be, w->type))
        return fu_errorf(FU_ERR_UNSUPPORTED, "matmul_back: backend %s has no %s weights", be->v->name,
                         op_type_name(w->type));
    OP_LOCKED(be, be->v->matmul_back(be, w, dy, dx, beta));
}

int op_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x, float alpha) {
    int rc = op_train_has(be, be->v->outer_acc != NULL, "outer_acc");
    if (rc) return rc;
    if (dw->ne[2] * dw->ne[3] != 1 || dy->ne[0] != dw->ne[1] || x->ne[0] != dw->ne[0] || op_rows(dy) != op_rows(x))
        return fu_errorf(FU_ERR_INVALID, "outer_acc: dy (%lld, %lld)^T x (%lld, %lld) -> dw (%lld, %lld) mismatch",
                         (long long)op_rows(dy), (long long)dy->ne[0], (long long)op_rows(x), (long long)x->ne[0],
                         (long long)dw->ne[1], (long long)dw->ne[0]);
    if ((rc = op_check_f32("outer_acc", 3, (const op_tensor *[]){dw, dy, x}))) return rc;
    OP_LOCKED(be, be->v->outer_acc(be, dw, dy, x, alpha));
}

int op_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, const op_tensor *dy,
                    op_tensor *dx, float beta) {
    int rc = op_train_has(be, be->v->rmsnorm_back != NULL, "rmsnorm_back");
    if (rc) return rc;
    if ((w && (w->ne[0] != x->ne[0] || op_tensor_nelems(w) != w->ne[0])) || dy->ne[0] != x->ne[0] ||
        dx->ne[0] != x->ne[0] || op_rows(dy) != op_rows(x) || op_rows(dx) != op_rows(x))
        return fu_errorf(FU_ERR_INVALID, "rmsnorm_back: x (%lld, %lld), w (%lld), dy (%lld, %lld), dx (%lld, %lld) mismatch",
                         (long long)op_rows(x), (long long)x->ne[0], (long long)(w ? w->ne[0] : 0),
                         (long long)op_rows(dy), (long long)dy->ne[0], (long long)op_rows(dx), (long long)dx->ne[0]);
    if ((rc = op_check_f32("rmsnorm_back", 3, (const op_tensor *[]){x, dy, dx})) ||
        (w && (rc = op_check_f32("rmsnorm_back", 1, &w))) || (rc = op_check_beta("rmsnorm_back", beta)))
        return rc;
    if (dx->data == x->data || dx->data == dy->data)
        return fu_errorf(FU_ERR_INVALID, "rmsnorm_back: dx may not alias x or dy");
    OP_LOCKED(be, be->v->rmsnorm_back(be, x, w, eps, dy, dx, beta));
}

int op_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up, const op_tensor *dout,
                   op_tensor *dgate, op_tensor *dup) {
    int rc = op_train_has(be, be->v->swiglu_back != NULL, "swiglu_back");
    if (rc) return rc;
    const int64_t n = op_tensor_nelems(gate);
    if (op_tensor_nelems(up) != n || op_tensor_nelems(dout) != n || op_tensor_nelems(dgate) != n ||
        op_tensor_nelems(dup) != n)
        return fu_errorf(FU_ERR_INVALID, "swiglu_back: gate has %lld elements, up %lld, dout %lld, dgate %lld, dup %lld",
                         (long long)n, (long long)op_tensor_nelems(up), (long long)op_tensor_nelems(dout),
                         (long long)op_tensor_nelems(dgate), (long long)op_tensor_nelems(dup));
    if ((rc = op_check_f32("swiglu_back", 5, (const op_tensor *[]){gate, up, dout, dgate, dup}))) return rc;
    if (dup->data == gate->data || dup->data == up->data || dup->data == dgate->data ||
        dgate->data == gate->data || dgate->data == up->data)
        return fu_errorf(FU_ERR_INVALID, "swiglu_back: dgate / dup alias an input other than dout");
    OP_LOCKED(be, be->v->swiglu_back(be, gate, up, dout, dgate, dup));
}

/* FU_ERR_RANGE unless first[] describes runs of rows, each causal within
 * itself: first[t] == t (a new example) or first[t] == first[t - 1]. */
static int op_check_first(const int32_t *first, int64_t T) {
    for (int64_t t = 0; t < T; t++)
        if (first[t] != t && (t == 0 || first[t] != first[t - 1]))
            return fu_errorf(FU_ERR_RANGE, "attention_back: first[%lld] = %d (row %lld follows first %d)",
                             (long long)t, first[t], (long long)t, t ? first[t - 1] : 0);
    return FU_OK;
}

/* FU_ERR_INVALID unless t is (T, heads, hd). */
static int op_check_heads(const op_tensor *t, int heads, int hd, int64_t T, const char *what) {
    if (t->ne[0] == hd && t->ne[1] == heads && op_rows(t) == T * heads) return FU_OK;
    return fu_errorf(FU_ERR_INVALID, "attention_back: %s is (%lld, %lld, %lld), not (%lld, %d, %d)", what,
                     (long long)(t->ne[2] * t->ne[3]), (long long)t->ne[1], (long long)t->ne[0],
                     (long long)T, heads, hd);
}

int op_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q, const op_tensor *k,
                      const op_tensor *v, const op_tensor *out, const op_tensor *dout, op_tensor *dq,
                      op_tensor *dk, op_tensor *dv) {
    int rc = op_train_has(be, be->v->attention_back != NULL, "attention_back");
    if (rc) return rc;
    if (a->n_heads <= 0 || a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads || a->head_dim <= 0)
        return fu_errorf(FU_ERR_INVALID, "attention_back: %d heads over %d KV heads of %d", a->n_heads,
                         a->n_kv_heads, a->head_dim);
    const int64_t T = q->ne[2] * q->ne[3];
    const op_tensor *qs[] = {q, out, dout, dq}, *kvs[] = {k, v, dk, dv};
    static const char *qn[] = {"q", "out", "dout", "dq"}, *kvn[] = {"k", "v", "dk", "dv"};
    for (int i = 0; i < 4; i++)
        if ((rc = op_check_heads(qs[i], a->n_heads, a->head_dim, T, qn[i])) ||
            (rc = op_check_heads(kvs[i], a->n_kv_heads, a->head_dim, T, kvn[i])))
            return rc;
    if ((rc = op_check_f32("attention_back", 4, qs)) || (rc = op_check_f32("attention_back", 4, kvs))) return rc;
    if ((rc = op_check_first(a->first, T))) return rc;
    OP_LOCKED(be, be->v->attention_back(be, a, q, k, v, out, dout, dq, dk, dv));
}

int op_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight, float *loss,
                     uint8_t *correct) {
    int rc = op_train_has(be, be->v->cross_entropy != NULL, "cross_entropy");
    if (rc) return rc;
    if ((rc = op_check_f32("cross_entropy", 1, (const op_tensor *[]){logits}))) return rc;
    const int64_t R = op_rows(logits), V = logits->ne[0];
    for (int64_t r = 0; r < R; r++)
        if (target[r] < -1 || target[r] >= V)
            return fu_errorf(FU_ERR_RANGE, "cross_entropy: row %lld has target %d outside [-1, %lld)", (long long)r,
                             target[r], (long long)V);
    OP_LOCKED(be, be->v->cross_entropy(be, logits, target, weight, loss, correct));
}

int op_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0) {
    int rc = op_train_has(be, be->v->dropout != NULL, "dropout");
    if (rc) return rc;
    if (!(p >= 0.0f && p < 1.0f)) return fu_errorf(FU_ERR_INVALID, "dropout: p %g outside [0, 1)", p);
    if ((rc = op_check_f32("dropout", 1, (const op_tensor *[]){x}))) return rc;
    if (p == 0.0f) return FU_OK;
    OP_LOCKED(be, be->v->dropout(be, x, p, seed, row0));
}

int op_backend_open(const char *device, int n_threads, op_cpu_isa isa, op_backend **out, char *desc,
                    size_t desc_size) {
    *out = NULL;
    if (!strcmp(device, "cpu")) {
        op_cpu_options co = {.n_threads = n_threads, .isa = isa};
        if (!(*out = op_backend_cpu_new(&co))) return FU_ERR_INTERNAL;
        snprintf(desc, desc_size, "cpu (%s, %d threads)", op_backend_isa(*out), op_backend_n_threads(*out));
        return FU_OK;
    }
    long gpu = 0;
    if (strncmp(device, "cuda", 4) || (device[4] && (device[4] != ':' || fu_parse_long(device + 5, 0, 1023, &gpu))))
        return fu_errorf(FU_ERR_INVALID, "unknown device '%s' (cpu, cuda or cuda:N)", device);
    if (!(*out = op_backend_cuda_new((int)gpu))) return FU_ERR_UNSUPPORTED;
    snprintf(desc, desc_size, "cuda:%ld (%s)", gpu, op_backend_isa(*out));
    return FU_OK;
}

const fu_opt_choice op_cpu_isa_choices[] = {{"auto", OP_CPU_ISA_AUTO},
                                            {"portable", OP_CPU_ISA_PORTABLE},
                                            {"avx2", OP_CPU_ISA_AVX2},
                                            {"avx512", OP_CPU_ISA_AVX512},
                                            {NULL, 0}};
const fu_opt_choice op_kv_type_choices[] = {{"f32", OP_TYPE_F32}, {"f16", OP_TYPE_F16}, {NULL, 0}};

#ifndef FUSION_HAVE_CUDA
op_backend *op_backend_cuda_new(int device) {
    (void)device;
    fu_errorf(FU_ERR_UNSUPPORTED, "fusion was built without the CUDA backend");
    return NULL;
}
#endif
