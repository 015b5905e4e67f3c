/* gguf.c -- GGUF v2/v3 reader: validates the header of a read-only mapping up front. */
#include "gguf.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mapped-file.h"
#include "status.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" read as a little-endian uint32 */
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_ARRAY_DEPTH 8 /* nested arrays deeper than this are rejected */

/* ---- GGML type table ------------------------------------------------------- */

/* Every GGML type id that can appear in a file, with its block geometry, so
 * that any tensor's size can be checked even when fusion cannot compute with
 * it. `op` is the op_type it maps to, or -1. */
static const struct {
    const char *name;
    uint32_t block_elems;
    uint32_t block_bytes;
    int op;
} gguf_ggml_types[] = {
    [0] = {"f32", 1, 4, OP_TYPE_F32},
    [1] = {"f16", 1, 2, OP_TYPE_F16},
    [2] = {"q4_0", 32, 18, OP_TYPE_Q4_0},
    [3] = {"q4_1", 32, 20, OP_TYPE_Q4_1},
    /* 4, 5: q4_2 / q4_3, removed from ggml */
    [6] = {"q5_0", 32, 22, -1},
    [7] = {"q5_1", 32, 24, -1},
    [8] = {"q8_0", 32, 34, OP_TYPE_Q8_0},
    [9] = {"q8_1", 32, 36, -1},
    [10] = {"q2_k", 256, 84, -1},
    [11] = {"q3_k", 256, 110, -1},
    [12] = {"q4_k", 256, 144, -1},
    [13] = {"q5_k", 256, 176, -1},
    [14] = {"q6_k", 256, 210, -1},
    [15] = {"q8_k", 256, 292, -1},
    [16] = {"iq2_xxs", 256, 66, -1},
    [17] = {"iq2_xs", 256, 74, -1},
    [18] = {"iq3_xxs", 256, 98, -1},
    [19] = {"iq1_s", 256, 50, -1},
    [20] = {"iq4_nl", 32, 18, -1},
    [21] = {"iq3_s", 256, 110, -1},
    [22] = {"iq2_s", 256, 82, -1},
    [23] = {"iq4_xs", 256, 136, -1},
    [24] = {"i8", 1, 1, -1},
    [25] = {"i16", 1, 2, -1},
    [26] = {"i32", 1, 4, -1},
    [27] = {"i64", 1, 8, -1},
    [28] = {"f64", 1, 8, -1},
    [29] = {"iq1_m", 256, 56, -1},
    [30] = {"bf16", 1, 2, OP_TYPE_BF16},
    [31] = {"q4_0_4_4", 32, 18, -1},
    [32] = {"q4_0_4_8", 32, 18, -1},
    [33] = {"q4_0_8_8", 32, 18, -1},
    [34] = {"tq1_0", 256, 54, -1},
    [35] = {"tq2_0", 256, 66, -1},
    [36] = {"iq4_nl_4_4", 32, 18, -1},
    [37] = {"iq4_nl_4_8", 32, 18, -1},
    [38] = {"iq4_nl_8_8", 32, 18, -1},
    [39] = {"mxfp4", 32, 17, -1},
};
#define GGUF_N_GGML_TYPES (sizeof gguf_ggml_types / sizeof gguf_ggml_types[0])

static bool gguf_ggml_type_known(uint32_t t) {
    return t < GGUF_N_GGML_TYPES && gguf_ggml_types[t].name != NULL;
}

const char *gguf_type_name(uint32_t ggml_type) {
    return gguf_ggml_type_known(ggml_type) ? gguf_ggml_types[ggml_type].name : "unknown";
}

int gguf_ggml_type_to_op(uint32_t ggml_type, op_type *out) {
    if (!gguf_ggml_type_known(ggml_type) || gguf_ggml_types[ggml_type].op < 0)
        return FU_ERR_UNSUPPORTED;
    *out = (op_type)gguf_ggml_types[ggml_type].op;
    return FU_OK;
}

static const char *const gguf_vtype_names[] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool",  "string", "array", "uint64", "int64", "float64",
};
#define GGUF_N_VTYPES 13

const char *gguf_vtype_name(gguf_vtype t) {
    return (unsigned)t < GGUF_N_VTYPES ? gguf_vtype_names[t] : "invalid";
}

/* Size of one value of a fixed-size type, 0 for STRING / ARRAY. */
static uint64_t gguf_vtype_size(gguf_vtype t) {
    switch (t) {
    case GGUF_VTYPE_UINT8:
    case GGUF_VTYPE_INT8:
    case GGUF_VTYPE_BOOL:
        return 1;
    case GGUF_VTYPE_UINT16:
    case GGUF_VTYPE_INT16:
        return 2;
    case GGUF_VTYPE_UINT32:
    case GGUF_VTYPE_INT32:
    case GGUF_VTYPE_FLOAT32:
        return 4;
    case GGUF_VTYPE_UINT64:
    case GGUF_VTYPE_INT64:
    case GGUF_VTYPE_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

/* ---- the file ---------------------------------------------------------------- */

typedef struct gguf_kv {
    const char *key;       /* NUL-terminated, in f->names */
    gguf_vtype type;
    const uint8_t *val;    /* the value in the mapping (a string starts with its u64 length) */
    /* ARRAY only */
    gguf_vtype elem_type;
    uint64_t n;            /* number of elements */
    const uint8_t *arr;    /* first element */
    uint64_t *str_off;     /* STRING elements: offset of element i from arr; owned */
} gguf_kv;

/* Open-addressing hash from names to indices (slots hold index + 1, 0 = empty). */
typedef struct gguf_index {
    int64_t *slots;
    uint64_t mask;
} gguf_index;

struct gguf_file {
    mf_file mf;            /* the mapping (unused by gguf_open_mem) */
    char *path;            /* name used in messages; owned */
    const uint8_t *base;   /* header + data */
    size_t size;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;  /* start of the data section in the file */

    int64_t n_kv;
    gguf_kv *kv;           /* (n_kv) */
    int64_t n_tensors;
    gguf_tensor_info *tensors; /* (n_tensors) */
    char *names;           /* arena of NUL-terminated key and tensor names */
    gguf_index kv_index, tensor_index;
};

/* ---- name index ---------------------------------------------------------- */

static uint64_t gguf_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Sizes the table for n names; returns FU_OK or FU_ERR_NOMEM. */
static int gguf_index_init(gguf_index *ix, int64_t n) {
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap *= 2;
    ix->slots = calloc(cap, sizeof *ix->slots);
    ix->mask = cap - 1;
    return ix->slots ? FU_OK : FU_ERR_NOMEM;
}

/* Index of `name` among names[0..], or -1. `name_at(i)` reads name i. */
static int64_t gguf_index_find(const gguf_index *ix, const char *name,
                               const char *(*name_at)(const void *, int64_t), const void *ctx) {
    if (!ix->slots) return -1;
    for (uint64_t h = gguf_hash(name) & ix->mask;; h = (h + 1) & ix->mask) {
        int64_t s = ix->slots[h];
        if (s == 0) return -1;
        if (strcmp(name_at(ctx, s - 1), name) == 0) return s - 1;
    }
}

/* Inserts index i under `name`; returns the index already holding that name,
 * or -1 when it was new. */
static int64_t gguf_index_add(gguf_index *ix, const char *name, int64_t i,
                              const char *(*name_at)(const void *, int64_t), const void *ctx) {
    for (uint64_t h = gguf_hash(name) & ix->mask;; h = (h + 1) & ix->mask) {
        int64_t s = ix->slots[h];
        if (s == 0) {
            ix->slots[h] = i + 1;
            return -1;
        }
        if (strcmp(name_at(ctx, s - 1), name) == 0) return s - 1;
    }
}

static const char *gguf_kv_name_at(const void *ctx, int64_t i) {
    return ((const gguf_file *)ctx)->kv[i].key;
}

static const char *gguf_tensor_name_at(const void *ctx, int64_t i) {
    return ((const gguf_file *)ctx)->tensors[i].name;
}

/* ---- reader -------------------------------------------------------------- */

/* A bounds-checked cursor over the header. `what` describes the item being
 * read, for error messages. */
typedef struct gguf_rd {
    const gguf_file *f;
    size_t pos;
    char what[192];
} gguf_rd;

static void gguf_rd_what(gguf_rd *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void gguf_rd_what(gguf_rd *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->what, sizeof r->what, fmt, ap);
    va_end(ap);
}

/* Checks that n more bytes are available at the cursor. */
static int gguf_rd_need(gguf_rd *r, uint64_t n, const char *item) {
    size_t left = r->f->size - r->pos;
    if (n > left)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: %s%s%s at offset %zu runs past end of file (needs %" PRIu64
                         " bytes, %zu left; file truncated or header corrupt)",
                         r->f->path, r->what, r->what[0] ? ": " : "", item, r->pos, n, left);
    return FU_OK;
}

static int gguf_rd_u32(gguf_rd *r, uint32_t *v, const char *item) {
    int rc = gguf_rd_need(r, 4, item);
    if (rc) return rc;
    memcpy(v, r->f->base + r->pos, 4);
    r->pos += 4;
    return FU_OK;
}

static int gguf_rd_u64(gguf_rd *r, uint64_t *v, const char *item) {
    int rc = gguf_rd_need(r, 8, item);
    if (rc) return rc;
    memcpy(v, r->f->base + r->pos, 8);
    r->pos += 8;
    return FU_OK;
}

/* Reads a string (u64 length + bytes); *s points into the mapping. */
static int gguf_rd_str(gguf_rd *r, const char **s, uint64_t *len, const char *item) {
    int rc = gguf_rd_u64(r, len, item);
    if (rc) return rc;
    if (*len > r->f->size - r->pos)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: %s%s%s at offset %zu has length %" PRIu64
                         " which runs past end of file (%zu bytes left)",
                         r->f->path, r->what, r->what[0] ? ": " : "", item, r->pos - 8, *len,
                         r->f->size - r->pos);
    *s = (const char *)r->f->base + r->pos;
    r->pos += (size_t)*len;
    return FU_OK;
}

static int gguf_rd_skip_value(gguf_rd *r, gguf_vtype t, int depth);

/* Validates and skips an array body (element type, count, elements). When kv
 * is non-NULL records the array's shape there and, for string arrays, builds
 * the element offset table. */
static int gguf_rd_array(gguf_rd *r, int depth, gguf_kv *kv) {
    if (depth > GGUF_MAX_ARRAY_DEPTH)
        return fu_errorf(FU_ERR_FORMAT, "%s: %s: arrays nested deeper than %d levels",
                         r->f->path, r->what, GGUF_MAX_ARRAY_DEPTH);
    uint32_t et;
    uint64_t n;
    int rc = gguf_rd_u32(r, &et, "array element type");
    if (!rc) rc = gguf_rd_u64(r, &n, "array length");
    if (rc) return rc;
    if (et >= GGUF_N_VTYPES)
        return fu_errorf(FU_ERR_FORMAT, "%s: %s: array has unknown element type %" PRIu32,
                         r->f->path, r->what, et);
    /* Every element takes at least `min` bytes, which bounds n by the file. */
    uint64_t esize = gguf_vtype_size((gguf_vtype)et);
    uint64_t min = esize ? esize : et == GGUF_VTYPE_STRING ? 8 : 12;
    size_t left = r->f->size - r->pos;
    if (n > left / min)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: %s: array of %" PRIu64 " %s elements at offset %zu runs past end "
                         "of file (%zu bytes left)",
                         r->f->path, r->what, n, gguf_vtype_name((gguf_vtype)et), r->pos, left);
    const size_t start = r->pos;
    if (kv) {
        kv->elem_type = (gguf_vtype)et;
        kv->n = n;
        kv->arr = r->f->base + start;
    }
    if (esize) {
        r->pos += (size_t)(n * esize);
        return FU_OK;
    }
    if (et == GGUF_VTYPE_STRING && kv && n > 0) {
        kv->str_off = malloc((size_t)n * sizeof *kv->str_off);
        if (!kv->str_off)
            return fu_errorf(FU_ERR_NOMEM, "%s: %s: no memory for %" PRIu64 " string offsets",
                             r->f->path, r->what, n);
    }
    for (uint64_t i = 0; i < n; i++) {
        if (kv && kv->str_off) kv->str_off[i] = r->pos - start;
        rc = gguf_rd_skip_value(r, (gguf_vtype)et, depth + 1);
        if (rc) return rc;
    }
    return FU_OK;
}

/* Validates and skips one value of type t. */
static int gguf_rd_skip_value(gguf_rd *r, gguf_vtype t, int depth) {
    uint64_t size = gguf_vtype_size(t);
    if (size) {
        int rc = gguf_rd_need(r, size, "value");
        if (!rc) r->pos += (size_t)size;
        return rc;
    }
    if (t == GGUF_VTYPE_STRING) {
        const char *s;
        uint64_t len;
        return gguf_rd_str(r, &s, &len, "string");
    }
    return gguf_rd_array(r, depth, NULL);
}

/* ---- parsing --------------------------------------------------------------- */

/* Appends a copy of name[0..len) plus NUL to the arena; returns its offset. */
typedef struct gguf_arena {
    char *buf;
    size_t len, cap;
} gguf_arena;

static int gguf_arena_add(gguf_arena *a, const char *s, size_t len, size_t *off) {
    if (len >= SIZE_MAX / 2 - a->len) return FU_ERR_NOMEM;
    if (a->len + len + 1 > a->cap) {
        size_t cap = a->cap ? a->cap : 4096;
        while (cap < a->len + len + 1) cap *= 2;
        char *p = realloc(a->buf, cap);
        if (!p) return FU_ERR_NOMEM;
        a->buf = p;
        a->cap = cap;
    }
    memcpy(a->buf + a->len, s, len);
    a->buf[a->len + len] = '\0';
    *off = a->len;
    a->len += len + 1;
    return FU_OK;
}

/* Integer value of a kv of any integer type: *neg set for negative values,
 * then *s holds it; otherwise *u holds it. Returns false for non-integers. */
static bool gguf_kv_int(const gguf_kv *kv, bool *neg, int64_t *s, uint64_t *u) {
    const uint8_t *p = kv->val;
    int64_t sv = 0;
    uint64_t uv = 0;
    bool is_signed = false;
    switch (kv->type) {
    case GGUF_VTYPE_UINT8: uv = p[0]; break;
    case GGUF_VTYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); uv = v; break; }
    case GGUF_VTYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); uv = v; break; }
    case GGUF_VTYPE_UINT64: memcpy(&uv, p, 8); break;
    case GGUF_VTYPE_INT8: { int8_t v; memcpy(&v, p, 1); sv = v; is_signed = true; break; }
    case GGUF_VTYPE_INT16: { int16_t v; memcpy(&v, p, 2); sv = v; is_signed = true; break; }
    case GGUF_VTYPE_INT32: { int32_t v; memcpy(&v, p, 4); sv = v; is_signed = true; break; }
    case GGUF_VTYPE_INT64: memcpy(&sv, p, 8); is_signed = true; break;
    default: return false;
    }
    if (is_signed && sv < 0) {
        *neg = true;
        *s = sv;
    } else {
        *neg = false;
        *u = is_signed ? (uint64_t)sv : uv;
    }
    return true;
}

/* Reads the name of item i (what: "metadata key" or "tensor") and copies it
 * into the names arena at *off; a name with a NUL byte is an error. */
static int gguf_rd_name(gguf_file *f, gguf_rd *r, gguf_arena *names, const char *what, int64_t i,
                        const char **name, uint64_t *len, size_t *off) {
    gguf_rd_what(r, "%s %" PRId64, what, i);
    int rc = gguf_rd_str(r, name, len, "name");
    if (rc) return rc;
    if (memchr(*name, '\0', (size_t)*len))
        return fu_errorf(FU_ERR_FORMAT, "%s: %s %" PRId64 " has a NUL byte in its name", f->path, what, i);
    if (gguf_arena_add(names, *name, (size_t)*len, off))
        return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", f->path);
    return FU_OK;
}

static int gguf_parse_kvs(gguf_file *f, gguf_rd *r, gguf_arena *names, size_t *key_off) {
    for (int64_t i = 0; i < f->n_kv; i++) {
        gguf_kv *kv = &f->kv[i];
        const char *key = NULL;
        uint64_t key_len = 0;
        int rc = gguf_rd_name(f, r, names, "metadata key", i, &key, &key_len, &key_off[i]);
        if (rc) return rc;
        gguf_rd_what(r, "metadata key %" PRId64 " ('%.*s')", i,
                     (int)(key_len > 96 ? 96 : key_len), key);
        uint32_t t;
        rc = gguf_rd_u32(r, &t, "value type");
        if (rc) return rc;
        if (t >= GGUF_N_VTYPES)
            return fu_errorf(FU_ERR_FORMAT, "%s: %s has unknown value type %" PRIu32, f->path,
                             r->what, t);
        kv->type = (gguf_vtype)t;
        kv->val = f->base + r->pos;
        rc = t == GGUF_VTYPE_ARRAY ? gguf_rd_array(r, 1, kv)
                                   : gguf_rd_skip_value(r, kv->type, 1);
        if (rc) return rc;
    }
    return FU_OK;
}

static int gguf_parse_tensor_infos(gguf_file *f, gguf_rd *r, gguf_arena *names, size_t *name_off) {
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor_info *ti = &f->tensors[i];
        const char *name = NULL;
        uint64_t len = 0;
        int rc = gguf_rd_name(f, r, names, "tensor", i, &name, &len, &name_off[i]);
        if (rc) return rc;
        if (len == 0)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor %" PRId64 " has an empty name", f->path, i);
        const int nshow = (int)(len > 96 ? 96 : len);
        gguf_rd_what(r, "tensor '%.*s'", nshow, name);
        uint32_t n_dims;
        rc = gguf_rd_u32(r, &n_dims, "n_dims");
        if (rc) return rc;
        if (n_dims > GGUF_MAX_DIMS)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%.*s' has %" PRIu32 " dims (max %d)",
                             f->path, nshow, name, n_dims, GGUF_MAX_DIMS);
        ti->n_dims = (int)n_dims;
        /* The product of the dims (zeros counted as 1, so that no partial
         * product a consumer computes can overflow) must fit an int64. */
        uint64_t nelems = 1, span = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) {
            uint64_t ne = 1;
            if ((uint32_t)d < n_dims) {
                rc = gguf_rd_u64(r, &ne, "dims");
                if (rc) return rc;
            }
            if (ne > (uint64_t)INT64_MAX || mf_mul_u64(span, ne ? ne : 1, &span) ||
                span > (uint64_t)INT64_MAX)
                return fu_errorf(FU_ERR_FORMAT,
                                 "%s: tensor '%.*s' dims overflow (dim %d = %" PRIu64 ")",
                                 f->path, nshow, name, d, ne);
            nelems *= ne; /* <= span */
            ti->ne[d] = (int64_t)ne;
        }
        rc = gguf_rd_u32(r, &ti->ggml_type, "type");
        if (!rc) rc = gguf_rd_u64(r, &ti->offset, "data offset");
        if (rc) return rc;
        if (!gguf_ggml_type_known(ti->ggml_type))
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: tensor '%.*s' has unknown GGML type %" PRIu32,
                             f->path, nshow, name, ti->ggml_type);
        const uint64_t be = gguf_ggml_types[ti->ggml_type].block_elems;
        const uint64_t bb = gguf_ggml_types[ti->ggml_type].block_bytes;
        if ((uint64_t)ti->ne[0] % be)
            return fu_errorf(FU_ERR_FORMAT,
                             "%s: tensor '%.*s' of type %s has ne[0] = %" PRId64
                             ", not a multiple of its block size %" PRIu64,
                             f->path, nshow, name, gguf_type_name(ti->ggml_type), ti->ne[0], be);
        uint64_t nbytes, span_bytes;
        if (mf_mul_u64(span, bb, &span_bytes) || span_bytes > (uint64_t)SIZE_MAX)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%.*s' size overflows", f->path, nshow,
                             name);
        if (mf_mul_u64(nelems / be, bb, &nbytes) || nbytes > (uint64_t)SIZE_MAX)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%.*s' size overflows", f->path, nshow,
                             name);
        ti->nbytes = (size_t)nbytes;
    }
    return FU_OK;
}

/* Reads general.alignment (any integer type; a power of two) into f->alignment. */
static int gguf_parse_alignment(gguf_file *f) {
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(f, "general.alignment");
    if (i < 0) return FU_OK;
    bool neg = false;
    int64_t s;
    uint64_t u = 0;
    if (!gguf_kv_int(&f->kv[i], &neg, &s, &u))
        return fu_errorf(FU_ERR_FORMAT, "%s: general.alignment has type %s, not an integer",
                         f->path, gguf_vtype_name(f->kv[i].type));
    if (neg || u == 0 || u > (1u << 30) || (u & (u - 1)))
        return fu_errorf(FU_ERR_FORMAT, "%s: general.alignment %s%" PRIu64
                         " is not a power of two in [1, 2^30]",
                         f->path, neg ? "(negative) " : "", neg ? (uint64_t)-s : u);
    f->alignment = (uint32_t)u;
    return FU_OK;
}

/* Checks every tensor's offset and size against the data section. */
static int gguf_check_tensor_data(gguf_file *f) {
    const uint64_t data_size = f->size > f->data_offset ? f->size - f->data_offset : 0;
    mf_range *ranges = NULL;
    if (f->n_tensors > 0) {
        ranges = malloc((size_t)f->n_tensors * sizeof *ranges);
        if (!ranges) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", f->path);
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor_info *ti = &f->tensors[i];
        if (ti->offset % f->alignment) {
            free(ranges);
            return fu_errorf(FU_ERR_FORMAT,
                             "%s: tensor '%s' data offset %" PRIu64
                             " is not a multiple of the alignment %" PRIu32,
                             f->path, ti->name, ti->offset, f->alignment);
        }
        if (ti->offset > data_size || ti->nbytes > data_size - ti->offset) {
            uint64_t begin = f->data_offset + ti->offset; /* may wrap: printed as stored */
            free(ranges);
            return fu_errorf(FU_ERR_FORMAT,
                             "%s: tensor '%s' data [%" PRIu64 ", %" PRIu64 " + %zu) beyond end of "
                             "file (size %zu)",
                             f->path, ti->name, begin, begin, ti->nbytes, f->size);
        }
        /* (only empty tensors can sit past the end, when the file stops before
         * the padded data section starts: point them at the end) */
        ti->data = f->base + (data_size ? f->data_offset + ti->offset : f->size);
        ranges[i] = (mf_range){ti->offset, ti->offset + ti->nbytes, i};
    }
    int64_t a, b;
    int overlap = mf_ranges_overlap(ranges, (size_t)f->n_tensors, &a, &b);
    free(ranges);
    if (overlap)
        return fu_errorf(FU_ERR_FORMAT, "%s: data of tensors '%s' and '%s' overlap", f->path,
                         f->tensors[a].name, f->tensors[b].name);
    return FU_OK;
}

static int gguf_parse(gguf_file *f) {
    gguf_rd r = {.f = f};
    gguf_arena names = {0};
    size_t *key_off = NULL, *name_off = NULL;
    int rc;
    if (f->size == 0) return fu_errorf(FU_ERR_FORMAT, "%s: empty file, not a GGUF file", f->path);

    uint32_t magic;
    gguf_rd_what(&r, "header");
    if ((rc = gguf_rd_u32(&r, &magic, "magic"))) return rc;
    if (magic != GGUF_MAGIC)
        return fu_errorf(FU_ERR_FORMAT, "%s: not a GGUF file (bad magic 0x%08" PRIx32 ")", f->path,
                         magic);
    if ((rc = gguf_rd_u32(&r, &f->version, "version"))) return rc;
    if (f->version != 2 && f->version != 3) {
        uint32_t sw = __builtin_bswap32(f->version);
        if (sw == 2 || sw == 3)
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: big-endian GGUF v%" PRIu32 " not supported",
                             f->path, sw);
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: GGUF version %" PRIu32 " not supported (2 or 3)",
                         f->path, f->version);
    }
    uint64_t n_tensors, n_kv;
    if ((rc = gguf_rd_u64(&r, &n_tensors, "tensor count"))) return rc;
    if ((rc = gguf_rd_u64(&r, &n_kv, "metadata count"))) return rc;
    /* A key takes at least 13 bytes (length, type, 1-byte value), a tensor info
     * at least 24 (name length, n_dims, type, offset): bound counts by the file
     * before allocating anything. */
    const size_t left = f->size - r.pos;
    if (n_kv > left / 13)
        return fu_errorf(FU_ERR_FORMAT, "%s: metadata count %" PRIu64
                         " impossible for a file of %zu bytes (header corrupt or truncated)",
                         f->path, n_kv, f->size);
    if (n_tensors > left / 24 || n_tensors > (left - n_kv * 13) / 24)
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor count %" PRIu64
                         " impossible for a file of %zu bytes (header corrupt or truncated)",
                         f->path, n_tensors, f->size);
    f->n_kv = (int64_t)n_kv;
    f->n_tensors = (int64_t)n_tensors;
    f->kv = calloc(n_kv ? n_kv : 1, sizeof *f->kv);
    f->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *f->tensors);
    key_off = malloc((n_kv ? n_kv : 1) * sizeof *key_off);
    name_off = malloc((n_tensors ? n_tensors : 1) * sizeof *name_off);
    if (!f->kv || !f->tensors || !key_off || !name_off) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", f->path);
        goto out;
    }

    if ((rc = gguf_parse_kvs(f, &r, &names, key_off))) goto out;
    if ((rc = gguf_parse_tensor_infos(f, &r, &names, name_off))) goto out;

    /* Names live in one arena; fix up the pointers now that it has stopped moving. */
    f->names = names.buf;
    names.buf = NULL;
    for (int64_t i = 0; i < f->n_kv; i++) f->kv[i].key = f->names + key_off[i];
    for (int64_t i = 0; i < f->n_tensors; i++) f->tensors[i].name = f->names + name_off[i];

    if ((rc = gguf_index_init(&f->kv_index, f->n_kv)) ||
        (rc = gguf_index_init(&f->tensor_index, f->n_tensors))) {
        rc = fu_errorf(rc, "%s: out of memory", f->path);
        goto out;
    }
    for (int64_t i = 0; i < f->n_kv; i++)
        if (gguf_index_add(&f->kv_index, f->kv[i].key, i, gguf_kv_name_at, f) >= 0) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: duplicate metadata key '%s'", f->path, f->kv[i].key);
            goto out;
        }
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (gguf_index_add(&f->tensor_index, f->tensors[i].name, i, gguf_tensor_name_at, f) >= 0) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: duplicate tensor name '%s'", f->path,
                           f->tensors[i].name);
            goto out;
        }

    if ((rc = gguf_parse_alignment(f))) goto out;
    uint64_t pad = (f->alignment - r.pos % f->alignment) % f->alignment;
    f->data_offset = (uint64_t)r.pos + pad;
    rc = gguf_check_tensor_data(f);
out:
    free(names.buf);
    free(key_off);
    free(name_off);
    return rc;
}

/* Allocates the file object around `base`/`size` and parses it. */
static int gguf_open_common(gguf_file *f, const char *name, gguf_file **out) {
    int rc;
    f->path = strdup(name);
    if (!f->path) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", name);
        goto err;
    }
    if ((rc = gguf_parse(f))) goto err;
    *out = f;
    return FU_OK;
err:
    gguf_close(f);
    return rc;
}

int gguf_open(const char *path, gguf_file **out) {
    *out = NULL;
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    int rc = mf_open(&f->mf, path);
    if (rc) {
        free(f);
        return rc;
    }
    f->base = f->mf.data;
    f->size = f->mf.size;
    return gguf_open_common(f, path, out);
}

int gguf_open_mem(const void *data, size_t size, const char *name, gguf_file **out) {
    *out = NULL;
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", name);
    f->base = data;
    f->size = data ? size : 0;
    return gguf_open_common(f, name, out);
}

void gguf_release(const gguf_file *f, const void *p, size_t n) {
    if (f) mf_release(&f->mf, p, n);
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->kv)
        for (int64_t i = 0; i < f->n_kv; i++) free(f->kv[i].str_off);
    free(f->kv);
    free(f->tensors);
    free(f->names);
    free(f->kv_index.slots);
    free(f->tensor_index.slots);
    free(f->path);
    mf_close(&f->mf);
    free(f);
}

const char *gguf_path(const gguf_file *f) { return f->path; }
uint32_t gguf_version(const gguf_file *f) { return f->version; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_offset; }

/* ---- metadata ------------------------------------------------------------- */

int64_t gguf_n_keys(const gguf_file *f) { return f->n_kv; }

const char *gguf_key_name(const gguf_file *f, int64_t i) {
    return i >= 0 && i < f->n_kv ? f->kv[i].key : NULL;
}

int64_t gguf_find_key(const gguf_file *f, const char *key) {
    return gguf_index_find(&f->kv_index, key, gguf_kv_name_at, f);
}

gguf_vtype gguf_key_type(const gguf_file *f, int64_t i) {
    return i >= 0 && i < f->n_kv ? f->kv[i].type : (gguf_vtype)-1;
}

/* Finds `key` or sets the NOT_FOUND message. */
static const gguf_kv *gguf_kv_get(const gguf_file *f, const char *key, int *rc) {
    int64_t i = gguf_find_key(f, key);
    if (i < 0) {
        *rc = fu_errorf(FU_ERR_NOT_FOUND, "%s: no metadata key '%s'", f->path, key);
        return NULL;
    }
    *rc = FU_OK;
    return &f->kv[i];
}

static int gguf_type_error(const gguf_file *f, const char *key, const gguf_kv *kv,
                           const char *want) {
    return fu_errorf(FU_ERR_FORMAT, "%s: metadata key '%s' has type %s, not %s", f->path, key,
                     gguf_vtype_name(kv->type), want);
}

/* Shared by the integer getters: the value as (neg, s, u) or an error. */
static int gguf_get_int(const gguf_file *f, const char *key, bool *neg, int64_t *s, uint64_t *u) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (!gguf_kv_int(kv, neg, s, u)) return gguf_type_error(f, key, kv, "an integer");
    return FU_OK;
}

static int gguf_range_error(const gguf_file *f, const char *key, bool neg, int64_t s, uint64_t u,
                            const char *want) {
    if (neg)
        return fu_errorf(FU_ERR_FORMAT, "%s: metadata key '%s' = %" PRId64 " does not fit %s",
                         f->path, key, s, want);
    return fu_errorf(FU_ERR_FORMAT, "%s: metadata key '%s' = %" PRIu64 " does not fit %s", f->path,
                     key, u, want);
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    int rc = gguf_get_int(f, key, &neg, &s, &u);
    if (rc) return rc;
    if (neg || u > UINT32_MAX) return gguf_range_error(f, key, neg, s, u, "uint32");
    *out = (uint32_t)u;
    return FU_OK;
}

int gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    int rc = gguf_get_int(f, key, &neg, &s, &u);
    if (rc) return rc;
    if (neg) return gguf_range_error(f, key, neg, s, u, "uint64");
    *out = u;
    return FU_OK;
}

int gguf_get_i32(const gguf_file *f, const char *key, int32_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    int rc = gguf_get_int(f, key, &neg, &s, &u);
    if (rc) return rc;
    if (neg ? s < INT32_MIN : u > INT32_MAX) return gguf_range_error(f, key, neg, s, u, "int32");
    *out = neg ? (int32_t)s : (int32_t)u;
    return FU_OK;
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out) {
    bool neg = false;
    int64_t s = 0;
    uint64_t u = 0;
    int rc = gguf_get_int(f, key, &neg, &s, &u);
    if (rc) return rc;
    if (!neg && u > INT64_MAX) return gguf_range_error(f, key, neg, s, u, "int64");
    *out = neg ? s : (int64_t)u;
    return FU_OK;
}

int gguf_get_f64(const gguf_file *f, const char *key, double *out) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (kv->type == GGUF_VTYPE_FLOAT32) {
        float v;
        memcpy(&v, kv->val, 4);
        *out = v;
    } else if (kv->type == GGUF_VTYPE_FLOAT64) {
        memcpy(out, kv->val, 8);
    } else {
        return gguf_type_error(f, key, kv, "a float");
    }
    return FU_OK;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out) {
    double d;
    int rc = gguf_get_f64(f, key, &d);
    if (rc) return rc;
    if (isfinite(d) && fabs(d) > 3.4028234663852886e38)
        return fu_errorf(FU_ERR_FORMAT, "%s: metadata key '%s' = %g does not fit float32", f->path,
                         key, d);
    *out = (float)d;
    return FU_OK;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (kv->type != GGUF_VTYPE_BOOL) return gguf_type_error(f, key, kv, "bool");
    *out = kv->val[0] != 0;
    return FU_OK;
}

int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (kv->type != GGUF_VTYPE_STRING) return gguf_type_error(f, key, kv, "string");
    uint64_t n;
    memcpy(&n, kv->val, 8);
    *s = (const char *)kv->val + 8;
    *len = (size_t)n;
    return FU_OK;
}

int gguf_get_str_dup(const gguf_file *f, const char *key, char **out) {
    const char *s = NULL;
    size_t len = 0;
    int rc = gguf_get_str(f, key, &s, &len);
    if (rc) return rc;
    char *p = malloc(len + 1);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", f->path);
    memcpy(p, s, len);
    p[len] = '\0';
    *out = p;
    return FU_OK;
}

int gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype *elem_type, uint64_t *n,
                 const void **data) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (kv->type != GGUF_VTYPE_ARRAY) return gguf_type_error(f, key, kv, "array");
    *elem_type = kv->elem_type;
    *n = kv->n;
    *data = kv->arr;
    return FU_OK;
}

int gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s,
                     size_t *len) {
    int rc;
    const gguf_kv *kv = gguf_kv_get(f, key, &rc);
    if (!kv) return rc;
    if (kv->type != GGUF_VTYPE_ARRAY || kv->elem_type != GGUF_VTYPE_STRING)
        return fu_errorf(FU_ERR_FORMAT, "%s: metadata key '%s' is not an array of strings",
                         f->path, key);
    if (i >= kv->n)
        return fu_errorf(FU_ERR_RANGE, "%s: metadata key '%s': index %" PRIu64
                         " out of range (%" PRIu64 " strings)",
                         f->path, key, i, kv->n);
    const uint8_t *p = kv->arr + kv->str_off[i];
    uint64_t n;
    memcpy(&n, p, 8);
    *s = (const char *)p + 8;
    *len = (size_t)n;
    return FU_OK;
}

/* ---- tensors ---------------------------------------------------------------- */

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }

const gguf_tensor_info *gguf_tensor(const gguf_file *f, int64_t i) {
    return i >= 0 && i < f->n_tensors ? &f->tensors[i] : NULL;
}

int64_t gguf_find_tensor(const gguf_file *f, const char *name) {
    return gguf_index_find(&f->tensor_index, name, gguf_tensor_name_at, f);
}

int gguf_tensor_as_op(const gguf_file *f, int64_t i, op_tensor *out) {
    const gguf_tensor_info *ti = gguf_tensor(f, i);
    if (!ti)
        return fu_errorf(FU_ERR_RANGE, "%s: tensor index %" PRId64 " out of range (%" PRId64 ")",
                         f->path, i, f->n_tensors);
    op_type type;
    if (gguf_ggml_type_to_op(ti->ggml_type, &type))
        return fu_errorf(FU_ERR_UNSUPPORTED,
                         "%s: tensor '%s' has GGML type %s (%" PRIu32
                         "), which fusion does not support (f32, f16, bf16, q8_0, q4_0, q4_1)",
                         f->path, ti->name, gguf_type_name(ti->ggml_type), ti->ggml_type);
    memset(out, 0, sizeof *out);
    out->type = type;
    out->ndim = ti->n_dims > 0 ? ti->n_dims : 1;
    for (int d = 0; d < 4; d++) out->ne[d] = ti->ne[d];
    out->nb[0] = op_type_block_bytes(type);
    out->nb[1] = op_row_bytes(type, ti->ne[0]);
    for (int d = 2; d < 4; d++) out->nb[d] = out->nb[d - 1] * (size_t)out->ne[d - 1];
    out->data = (void *)ti->data; /* read-only mapping: callers must not write */
    out->name = ti->name;
    return FU_OK;
}
