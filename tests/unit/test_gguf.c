/* test_gguf.c -- GGUF reader: a valid file built byte by byte, then truncated and corrupted ones.
 *
 * The valid file holds metadata of every value type (string and nested arrays
 * included) and tensors of every supported GGML type plus an unsupported one
 * (q5_k). Every proper prefix of it, and every single-field corruption, must be
 * rejected with a message naming the file (and the tensor or key where there is
 * one); single-byte flips anywhere in the header must never read out of bounds
 * (the in-memory variants live in exactly-sized heap buffers, so ASan sees any
 * overread).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf.h"
#include "test-files.h"
#include "status.h"

/* ---- byte builder ---------------------------------------------------------- */

typedef struct gb {
    uint8_t *p;
    size_t len, cap;
} gb;

static void gb_put(gb *b, const void *d, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, d, n);
    b->len += n;
}
static void gb_u8(gb *b, uint8_t v) { gb_put(b, &v, 1); }
static void gb_u16(gb *b, uint16_t v) { gb_put(b, &v, 2); }
static void gb_u32(gb *b, uint32_t v) { gb_put(b, &v, 4); }
static void gb_u64(gb *b, uint64_t v) { gb_put(b, &v, 8); }
static void gb_f32(gb *b, float v) { gb_put(b, &v, 4); }
static void gb_f64(gb *b, double v) { gb_put(b, &v, 8); }
static void gb_strn(gb *b, const char *s, size_t n) {
    gb_u64(b, n);
    gb_put(b, s, n);
}
static void gb_str(gb *b, const char *s) { gb_strn(b, s, strlen(s)); }
static void gb_key(gb *b, const char *k, gguf_vtype t) {
    gb_str(b, k);
    gb_u32(b, (uint32_t)t);
}
static void gb_pad(gb *b, size_t align) {
    while (b->len % align) gb_u8(b, 0);
}
static void patch_u32(uint8_t *p, size_t off, uint32_t v) { memcpy(p + off, &v, 4); }
static void patch_u64(uint8_t *p, size_t off, uint64_t v) { memcpy(p + off, &v, 8); }

/* ---- the test file --------------------------------------------------------- */

#define NT 7
static const struct {
    const char *name;
    uint32_t type;
    int n_dims;
    int64_t ne[4];
    size_t nbytes;
} tensors[NT] = {
    {"f32", 0, 2, {4, 2, 1, 1}, 32},
    {"blk.0.f16", 1, 1, {8, 1, 1, 1}, 16},
    {"bf16", 30, 1, {8, 1, 1, 1}, 16},
    {"q8", 8, 2, {32, 2, 1, 1}, 68},
    {"q40", 2, 1, {64, 1, 1, 1}, 36},
    {"q41", 3, 4, {32, 1, 1, 2}, 40},
    {"q5k", 13, 1, {256, 1, 1, 1}, 176},
};

typedef struct opts {
    uint32_t version;   /* 3 unless set */
    uint32_t alignment; /* 0: no general.alignment key (default 32) */
    bool dup_key, dup_tensor;
} opts;

/* Offsets of fields inside the built file, for corruption tests. */
typedef struct layout {
    size_t n_tensors, n_kv, key0_len, str_val_len, u8_vtype, strarr_n, strarr_elem, nested_n,
        align_val, align_vtype;
    size_t t_name_len[NT], t_ndims[NT], t_dim0[NT], t_dim1[NT], t_type[NT], t_offset[NT];
    uint64_t t_rel[NT]; /* data offsets as written */
    size_t data_offset;
} layout;

#define N_KEYS 18

static void fill_tensor_data(uint8_t *p, int i) {
    const size_t n = tensors[i].nbytes;
    switch (tensors[i].type) {
    case 0:
        for (int k = 0; k < 8; k++) {
            float v = (float)k * 0.5f - 1.0f;
            memcpy(p + 4 * k, &v, 4);
        }
        break;
    case 1:
        for (int k = 0; k < 8; k++) {
            uint16_t h = op_f32_to_f16((float)k * 0.25f - 0.5f);
            memcpy(p + 2 * k, &h, 2);
        }
        break;
    case 30:
        for (int k = 0; k < 8; k++) {
            uint16_t h = op_f32_to_bf16((float)k - 3.5f);
            memcpy(p + 2 * k, &h, 2);
        }
        break;
    default:
        for (size_t k = 0; k < n; k++) p[k] = (uint8_t)(k * 37 + (size_t)i);
        /* sane f16 scales at the start of each block: d = 0.5, m = -1 */
        if (tensors[i].type == 8 || tensors[i].type == 2 || tensors[i].type == 3) {
            size_t bs = tensors[i].type == 8 ? 34 : tensors[i].type == 2 ? 18 : 20;
            for (size_t o = 0; o < n; o += bs) {
                uint16_t d = op_f32_to_f16(0.5f), m = op_f32_to_f16(-1.0f);
                memcpy(p + o, &d, 2);
                if (tensors[i].type == 3) memcpy(p + o + 2, &m, 2);
            }
        }
    }
}

/* Builds the test file into *b (freshly zeroed) and records where fields are. */
static void build(gb *b, const opts *o, layout *L) {
    memset(b, 0, sizeof *b);
    memset(L, 0, sizeof *L);
    const uint32_t align = o->alignment ? o->alignment : 32;
    gb_put(b, "GGUF", 4);
    gb_u32(b, o->version ? o->version : 3);
    L->n_tensors = b->len;
    gb_u64(b, NT);
    L->n_kv = b->len;
    gb_u64(b, N_KEYS);

    int nk = 0;
    L->key0_len = b->len;
    gb_key(b, "general.architecture", GGUF_VTYPE_STRING), nk++;
    L->str_val_len = b->len;
    gb_str(b, "llama");
    gb_key(b, "t.u8", GGUF_VTYPE_UINT8), nk++;
    L->u8_vtype = b->len - 4;
    gb_u8(b, 200);
    gb_key(b, "t.i8", GGUF_VTYPE_INT8), nk++;
    gb_u8(b, (uint8_t)-5);
    gb_key(b, "t.u16", GGUF_VTYPE_UINT16), nk++;
    gb_u16(b, 60000);
    gb_key(b, "t.i16", GGUF_VTYPE_INT16), nk++;
    gb_u16(b, (uint16_t)-30000);
    gb_key(b, "t.u32", GGUF_VTYPE_UINT32), nk++;
    gb_u32(b, 4000000000u);
    gb_key(b, "t.i32", GGUF_VTYPE_INT32), nk++;
    gb_u32(b, (uint32_t)-2000000000);
    gb_key(b, "t.f32", GGUF_VTYPE_FLOAT32), nk++;
    gb_f32(b, 0.5f);
    gb_key(b, o->dup_key ? "t.u8" : "t.bool", GGUF_VTYPE_BOOL), nk++;
    gb_u8(b, 1);
    gb_key(b, "t.u64", GGUF_VTYPE_UINT64), nk++;
    gb_u64(b, (uint64_t)1 << 40);
    gb_key(b, "t.i64", GGUF_VTYPE_INT64), nk++;
    gb_u64(b, (uint64_t)-((int64_t)1 << 40));
    gb_key(b, "t.f64", GGUF_VTYPE_FLOAT64), nk++;
    gb_f64(b, 3.25);
    gb_key(b, "t.strs", GGUF_VTYPE_ARRAY), nk++;
    L->strarr_elem = b->len;
    gb_u32(b, GGUF_VTYPE_STRING);
    L->strarr_n = b->len;
    gb_u64(b, 4);
    gb_str(b, "a");
    gb_str(b, "");
    gb_str(b, "h\xc3\xa9llo");
    gb_str(b, "last");
    gb_key(b, "t.u32s", GGUF_VTYPE_ARRAY), nk++;
    gb_u32(b, GGUF_VTYPE_UINT32);
    gb_u64(b, 3);
    gb_u32(b, 1), gb_u32(b, 2), gb_u32(b, 3);
    gb_key(b, "t.nested", GGUF_VTYPE_ARRAY), nk++; /* [[1, 2], ["x"]] */
    gb_u32(b, GGUF_VTYPE_ARRAY);
    L->nested_n = b->len;
    gb_u64(b, 2);
    gb_u32(b, GGUF_VTYPE_INT32);
    gb_u64(b, 2);
    gb_u32(b, 1), gb_u32(b, 2);
    gb_u32(b, GGUF_VTYPE_STRING);
    gb_u64(b, 1);
    gb_str(b, "x");
    gb_key(b, "t.empty", GGUF_VTYPE_ARRAY), nk++;
    gb_u32(b, GGUF_VTYPE_STRING);
    gb_u64(b, 0);
    gb_key(b, "t.last", GGUF_VTYPE_STRING), nk++;
    gb_str(b, "end");
    gb_key(b, "general.alignment", GGUF_VTYPE_UINT32), nk++;
    L->align_vtype = b->len - 4;
    L->align_val = b->len;
    gb_u32(b, align);
    assert_int_equal(nk, N_KEYS);

    uint64_t off = 0;
    for (int i = 0; i < NT; i++) {
        L->t_name_len[i] = b->len;
        gb_str(b, o->dup_tensor && i == 2 ? tensors[0].name : tensors[i].name);
        L->t_ndims[i] = b->len;
        gb_u32(b, (uint32_t)tensors[i].n_dims);
        L->t_dim0[i] = b->len;
        L->t_dim1[i] = b->len + 8;
        for (int d = 0; d < tensors[i].n_dims; d++) gb_u64(b, (uint64_t)tensors[i].ne[d]);
        L->t_type[i] = b->len;
        gb_u32(b, tensors[i].type);
        L->t_offset[i] = b->len;
        L->t_rel[i] = off;
        gb_u64(b, off);
        off += tensors[i].nbytes;
        off = (off + align - 1) / align * align;
    }
    gb_pad(b, align);
    L->data_offset = b->len;
    for (int i = 0; i < NT; i++) {
        while (b->len < L->data_offset + L->t_rel[i]) gb_u8(b, 0);
        uint8_t tmp[256];
        fill_tensor_data(tmp, i);
        gb_put(b, tmp, tensors[i].nbytes);
    }
    /* the last tensor ends the file: every proper prefix is invalid */
}

/* ---- files -------------------------------------------------------------------- */

/* Opens n bytes of p from an exactly-sized heap copy (so ASan catches overreads). */
static int open_mem(const uint8_t *p, size_t n, const char *name, gguf_file **f, uint8_t **copy) {
    *copy = malloc(n ? n : 1);
    assert_non_null(*copy);
    if (n) memcpy(*copy, p, n);
    return gguf_open_mem(*copy, n, name, f);
}

/* Asserts rc is `want` and the message names `name` and contains `sub` (if not NULL). */
static void expect_fail(int rc, int want, const char *name, const char *sub, int line) {
    const char *msg = fu_last_error();
    if (rc != want || !strstr(msg, name) || (sub && !strstr(msg, sub)))
        fail_msg("line %d: rc %d (want %d), message '%s' (want '%s' and '%s')", line, rc, want,
                 msg, name, sub ? sub : "");
}
#define EXPECT_FAIL(rc, want, name, sub) expect_fail((rc), (want), (name), (sub), __LINE__)

/* ---- valid file ------------------------------------------------------------------ */

static void check_valid(const gguf_file *f, uint32_t version, uint32_t alignment) {
    assert_int_equal(gguf_version(f), version);
    assert_int_equal(gguf_alignment(f), alignment);
    assert_int_equal(gguf_n_keys(f), N_KEYS);
    assert_string_equal(gguf_key_name(f, 0), "general.architecture");
    assert_null(gguf_key_name(f, N_KEYS));
    assert_null(gguf_key_name(f, -1));
    assert_int_equal(gguf_find_key(f, "t.last"), N_KEYS - 2);
    assert_int_equal(gguf_find_key(f, "nope"), -1);
    assert_int_equal(gguf_key_type(f, 1), GGUF_VTYPE_UINT8);

    const char *s;
    size_t len;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &len), FU_OK);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "llama", 5);
    char *dup;
    assert_int_equal(gguf_get_str_dup(f, "t.last", &dup), FU_OK);
    assert_string_equal(dup, "end");
    free(dup);

    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool bv;
    assert_int_equal(gguf_get_u32(f, "t.u8", &u32), FU_OK);
    assert_int_equal(u32, 200);
    assert_int_equal(gguf_get_i32(f, "t.i8", &i32), FU_OK);
    assert_int_equal(i32, -5);
    assert_int_equal(gguf_get_u32(f, "t.u16", &u32), FU_OK);
    assert_int_equal(u32, 60000);
    assert_int_equal(gguf_get_i32(f, "t.i16", &i32), FU_OK);
    assert_int_equal(i32, -30000);
    assert_int_equal(gguf_get_u32(f, "t.u32", &u32), FU_OK);
    assert_int_equal(u32, 4000000000u);
    assert_int_equal(gguf_get_i32(f, "t.i32", &i32), FU_OK);
    assert_int_equal(i32, -2000000000);
    assert_int_equal(gguf_get_u64(f, "t.u64", &u64), FU_OK);
    assert_true(u64 == (uint64_t)1 << 40);
    assert_int_equal(gguf_get_i64(f, "t.i64", &i64), FU_OK);
    assert_true(i64 == -((int64_t)1 << 40));
    assert_int_equal(gguf_get_f32(f, "t.f32", &f32), FU_OK);
    assert_true(f32 == 0.5f);
    assert_int_equal(gguf_get_f32(f, "t.f64", &f32), FU_OK);
    assert_true(f32 == 3.25f);
    assert_int_equal(gguf_get_f64(f, "t.f64", &f64), FU_OK);
    assert_true(f64 == 3.25);
    assert_int_equal(gguf_get_bool(f, "t.bool", &bv), FU_OK);
    assert_true(bv);

    /* conversions that do not fit, wrong types, absent keys: errors naming the key */
    int rc = gguf_get_u32(f, "t.i8", &u32);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.i8", "does not fit");
    rc = gguf_get_i32(f, "t.u32", &i32);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u32", "does not fit int32");
    rc = gguf_get_u32(f, "t.u64", &u32);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u64", "does not fit uint32");
    rc = gguf_get_u64(f, "t.i64", &u64);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.i64", "does not fit");
    rc = gguf_get_str(f, "t.u8", &s, &len);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u8", "not string");
    rc = gguf_get_u32(f, "t.f32", &u32);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.f32", "integer");
    rc = gguf_get_f32(f, "t.u8", &f32);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u8", "float");
    rc = gguf_get_bool(f, "t.u8", &bv);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u8", "bool");
    rc = gguf_get_u32(f, "missing.key", &u32);
    EXPECT_FAIL(rc, FU_ERR_NOT_FOUND, "missing.key", NULL);

    /* arrays */
    gguf_vtype et;
    uint64_t n;
    const void *data;
    assert_int_equal(gguf_get_arr(f, "t.u32s", &et, &n, &data), FU_OK);
    assert_int_equal(et, GGUF_VTYPE_UINT32);
    assert_int_equal(n, 3);
    uint32_t vals[3];
    memcpy(vals, data, sizeof vals);
    assert_int_equal(vals[0], 1);
    assert_int_equal(vals[2], 3);
    assert_int_equal(gguf_get_arr(f, "t.strs", &et, &n, &data), FU_OK);
    assert_int_equal(et, GGUF_VTYPE_STRING);
    assert_int_equal(n, 4);
    static const char *const want[4] = {"a", "", "h\xc3\xa9llo", "last"};
    for (int k = 3; k >= 0; k--) { /* any order: O(1) access */
        assert_int_equal(gguf_get_arr_str(f, "t.strs", (uint64_t)k, &s, &len), FU_OK);
        assert_int_equal(len, strlen(want[k]));
        assert_memory_equal(s, want[k], len);
    }
    rc = gguf_get_arr_str(f, "t.strs", 4, &s, &len);
    EXPECT_FAIL(rc, FU_ERR_RANGE, "t.strs", "out of range");
    rc = gguf_get_arr_str(f, "t.u32s", 0, &s, &len);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u32s", "not an array of strings");
    rc = gguf_get_arr_str(f, "t.empty", 0, &s, &len);
    EXPECT_FAIL(rc, FU_ERR_RANGE, "t.empty", NULL);
    assert_int_equal(gguf_get_arr(f, "t.nested", &et, &n, &data), FU_OK);
    assert_int_equal(et, GGUF_VTYPE_ARRAY);
    assert_int_equal(n, 2);
    rc = gguf_get_arr(f, "t.u8", &et, &n, &data);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "t.u8", "array");

    /* tensors */
    assert_int_equal(gguf_n_tensors(f), NT);
    assert_null(gguf_tensor(f, NT));
    assert_int_equal(gguf_find_tensor(f, "nope"), -1);
    for (int i = 0; i < NT; i++) {
        assert_int_equal(gguf_find_tensor(f, tensors[i].name), i);
        const gguf_tensor_info *ti = gguf_tensor(f, i);
        assert_string_equal(ti->name, tensors[i].name);
        assert_int_equal(ti->ggml_type, tensors[i].type);
        assert_int_equal(ti->n_dims, tensors[i].n_dims);
        for (int d = 0; d < 4; d++) assert_int_equal(ti->ne[d], tensors[i].ne[d]);
        assert_int_equal(ti->nbytes, tensors[i].nbytes);
        assert_int_equal(ti->offset % alignment, 0);
    }
    op_tensor t;
    float row[256];
    assert_int_equal(gguf_tensor_as_op(f, 0, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_F32);
    assert_int_equal(t.ndim, 2);
    assert_int_equal(t.ne[0], 4);
    assert_int_equal(t.ne[1], 2);
    assert_int_equal(t.nb[1], 16);
    assert_ptr_equal(t.data, gguf_tensor(f, 0)->data);
    op_dequantize_row(&t, 1, row);
    assert_true(row[3] == 7 * 0.5f - 1.0f);
    assert_int_equal(gguf_tensor_as_op(f, 1, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_F16);
    op_dequantize_row(&t, 0, row);
    assert_true(row[7] == 1.25f);
    assert_int_equal(gguf_tensor_as_op(f, 2, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_BF16);
    op_dequantize_row(&t, 0, row);
    assert_true(row[0] == -3.5f);
    assert_int_equal(gguf_tensor_as_op(f, 3, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_Q8_0);
    assert_int_equal(t.nb[1], 34);
    op_dequantize_row(&t, 1, row);
    assert_true(row[5] == 0.5f * (float)(int8_t)((34 + 2 + 5) * 37 + 3));
    assert_int_equal(gguf_tensor_as_op(f, 4, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_Q4_0);
    assert_int_equal(gguf_tensor_as_op(f, 5, &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_Q4_1);
    assert_int_equal(t.ndim, 4);
    assert_int_equal(t.ne[3], 2);
    assert_int_equal(t.nb[3], 20);
    op_dequantize_row(&t, 0, row);
    uint8_t q = (uint8_t)((4 + 1) * 37 + 5); /* qs[1] of block 0 */
    assert_true(row[1] == 0.5f * (float)(q & 15) - 1.0f);
    assert_true(row[17] == 0.5f * (float)(q >> 4) - 1.0f);

    rc = gguf_tensor_as_op(f, 6, &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, "'q5k'", "q5_k");
    assert_non_null(strstr(fu_last_error(), gguf_path(f)));
    rc = gguf_tensor_as_op(f, NT, &t);
    EXPECT_FAIL(rc, FU_ERR_RANGE, gguf_path(f), NULL);
}

static void test_valid_file(void **state) {
    (void)state;
    gb b;
    layout L;
    opts o = {0};
    build(&b, &o, &L);
    char path[512];
    tmp_path(path, sizeof path, "valid.gguf");
    write_file(path, b.p, b.len);
    gguf_file *f;
    assert_int_equal(gguf_open(path, &f), FU_OK);
    assert_string_equal(gguf_path(f), path);
    assert_int_equal(gguf_data_offset(f), L.data_offset);
    check_valid(f, 3, 32);
    /* data pointers are inside the (page-aligned) mapping at aligned offsets */
    for (int i = 0; i < NT; i++) assert_int_equal((uintptr_t)gguf_tensor(f, i)->data % 32, 0);
    gguf_close(f);
    gguf_close(NULL);

    /* same bytes from memory */
    uint8_t *copy;
    assert_int_equal(open_mem(b.p, b.len, "mem.gguf", &f, &copy), FU_OK);
    assert_string_equal(gguf_path(f), "mem.gguf");
    check_valid(f, 3, 32);
    gguf_close(f);
    free(copy);
    free(b.p);
}

static void test_v2_and_alignment(void **state) {
    (void)state;
    gb b;
    layout L;
    opts o = {.version = 2, .alignment = 64};
    build(&b, &o, &L);
    assert_int_equal(L.data_offset % 64, 0);
    gguf_file *f;
    uint8_t *copy;
    assert_int_equal(open_mem(b.p, b.len, "v2.gguf", &f, &copy), FU_OK);
    check_valid(f, 2, 64);
    gguf_close(f);
    free(copy);
    free(b.p);

    /* a file that only has metadata, with no padding after the header */
    memset(&b, 0, sizeof b);
    gb_put(&b, "GGUF", 4);
    gb_u32(&b, 3);
    gb_u64(&b, 0);
    gb_u64(&b, 1);
    gb_key(&b, "k", GGUF_VTYPE_UINT8);
    gb_u8(&b, 7);
    assert_int_equal(open_mem(b.p, b.len, "meta.gguf", &f, &copy), FU_OK);
    assert_int_equal(gguf_n_tensors(f), 0);
    assert_int_equal(gguf_n_keys(f), 1);
    gguf_close(f);
    free(copy);
    free(b.p);
}

/* ---- truncation ------------------------------------------------------------------- */

static void test_truncated_every_byte(void **state) {
    (void)state;
    gb b;
    layout L;
    opts o = {0};
    build(&b, &o, &L);
    char path[512];
    tmp_path(path, sizeof path, "trunc.gguf");
    for (size_t n = 0; n < b.len; n++) {
        gguf_file *f;
        uint8_t *copy;
        int rc = open_mem(b.p, n, "trunc-mem.gguf", &f, &copy);
        if (rc >= 0) fail_msg("prefix of %zu of %zu bytes was accepted", n, b.len);
        EXPECT_FAIL(rc, FU_ERR_FORMAT, "trunc-mem.gguf", NULL);
        assert_null(f);
        free(copy);
        /* a prefix cut inside the data section names the tensor that no longer fits */
        if (n >= L.data_offset) assert_non_null(strstr(fu_last_error(), "beyond end of file"));

        write_file(path, b.p, n);
        rc = gguf_open(path, &f);
        EXPECT_FAIL(rc, FU_ERR_FORMAT, path, NULL);
        if (n == 0) assert_non_null(strstr(fu_last_error(), "empty"));
    }
    free(b.p);
}

/* ---- single-field corruptions ---------------------------------------------------------- */

typedef struct corruption {
    const char *what;
    int width;    /* 4 or 8 */
    size_t off;
    uint64_t val;
    int want;     /* status */
    const char *sub; /* expected in the message */
} corruption;

static void run_corruptions(const gb *b, const corruption *c, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint8_t *p = malloc(b->len);
        assert_non_null(p);
        memcpy(p, b->p, b->len);
        if (c[i].width == 4)
            patch_u32(p, c[i].off, (uint32_t)c[i].val);
        else
            patch_u64(p, c[i].off, c[i].val);
        gguf_file *f;
        int rc = gguf_open_mem(p, b->len, "bad.gguf", &f);
        const char *msg = fu_last_error();
        if (rc != c[i].want || !strstr(msg, "bad.gguf") || !strstr(msg, c[i].sub))
            fail_msg("%s: rc %d (want %d), message '%s' (want '%s')", c[i].what, rc, c[i].want,
                     msg, c[i].sub);
        assert_null(f);
        free(p);
    }
}

static void test_corrupt_fields(void **state) {
    (void)state;
    gb b;
    layout L;
    opts o = {0};
    build(&b, &o, &L);
    const uint64_t big = (uint64_t)1 << 60;
    const corruption c[] = {
        {"magic", 4, 0, 0x46554746, FU_ERR_FORMAT, "not a GGUF file"},
        {"version 1", 4, 4, 1, FU_ERR_UNSUPPORTED, "version 1"},
        {"version 4", 4, 4, 4, FU_ERR_UNSUPPORTED, "version 4"},
        {"big-endian", 4, 4, 0x03000000, FU_ERR_UNSUPPORTED, "big-endian"},
        {"n_tensors 2^60", 8, L.n_tensors, big, FU_ERR_FORMAT, "tensor count"},
        {"n_tensors max", 8, L.n_tensors, UINT64_MAX, FU_ERR_FORMAT, "tensor count"},
        {"n_tensors + 1", 8, L.n_tensors, NT + 1, FU_ERR_FORMAT, "tensor 7 has an empty name"},
        {"n_kv 2^60", 8, L.n_kv, big, FU_ERR_FORMAT, "metadata count"},
        {"n_kv max", 8, L.n_kv, UINT64_MAX, FU_ERR_FORMAT, "metadata count"},
        {"n_kv + 1", 8, L.n_kv, N_KEYS + 1, FU_ERR_FORMAT, ""},
        {"key length 2^63", 8, L.key0_len, (uint64_t)1 << 63, FU_ERR_FORMAT, "metadata key 0"},
        {"key length max", 8, L.key0_len, UINT64_MAX, FU_ERR_FORMAT, "runs past end of file"},
        {"string value length", 8, L.str_val_len, big, FU_ERR_FORMAT, "general.architecture"},
        {"value type 13", 4, L.u8_vtype, 13, FU_ERR_FORMAT, "unknown value type 13"},
        {"value type max", 4, L.u8_vtype, UINT32_MAX, FU_ERR_FORMAT, "'t.u8'"},
        {"string array count", 8, L.strarr_n, big, FU_ERR_FORMAT, "'t.strs'"},
        {"string array count + 1", 8, L.strarr_n, 5, FU_ERR_FORMAT, "metadata key"},
        {"array elem type", 4, L.strarr_elem, 99, FU_ERR_FORMAT, "unknown element type 99"},
        {"nested count", 8, L.nested_n, big, FU_ERR_FORMAT, "'t.nested'"},
        {"alignment 0", 4, L.align_val, 0, FU_ERR_FORMAT, "general.alignment"},
        {"alignment 3", 4, L.align_val, 3, FU_ERR_FORMAT, "not a power of two"},
        {"alignment as float", 4, L.align_vtype, GGUF_VTYPE_FLOAT32, FU_ERR_FORMAT,
         "general.alignment has type float32"},
        {"tensor name length", 8, L.t_name_len[3], big, FU_ERR_FORMAT, "tensor 3"},
        {"n_dims 5", 4, L.t_ndims[0], 5, FU_ERR_FORMAT, "'f32' has 5 dims"},
        {"n_dims max", 4, L.t_ndims[0], UINT32_MAX, FU_ERR_FORMAT, "'f32'"},
        {"dim negative", 8, L.t_dim0[0], (uint64_t)-4, FU_ERR_FORMAT, "'f32' dims overflow"},
        {"dims overflow", 8, L.t_dim1[3], (uint64_t)1 << 62, FU_ERR_FORMAT, "'q8' dims overflow"},
        {"dim too large for file", 8, L.t_dim0[6], 512, FU_ERR_FORMAT, "'q5k' data"},
        {"dim overlaps next tensor", 8, L.t_dim1[0], 3, FU_ERR_FORMAT, "overlap"},
        {"unknown ggml type", 4, L.t_type[1], 4, FU_ERR_UNSUPPORTED,
         "'blk.0.f16' has unknown GGML type 4"},
        {"ggml type max", 4, L.t_type[1], UINT32_MAX, FU_ERR_UNSUPPORTED, "'blk.0.f16'"},
        {"block multiple", 4, L.t_type[0], 8, FU_ERR_FORMAT, "not a multiple of its block size"},
        {"misaligned offset", 8, L.t_offset[2], L.t_rel[2] + 1, FU_ERR_FORMAT,
         "'bf16' data offset"},
        {"offset beyond file", 8, L.t_offset[4], (uint64_t)1 << 40, FU_ERR_FORMAT,
         "'q40' data"},
        {"offset wraps", 8, L.t_offset[4], UINT64_MAX - 31, FU_ERR_FORMAT, "beyond end of file"},
        {"overlap", 8, L.t_offset[4], L.t_rel[3], FU_ERR_FORMAT, "overlap"},
    };
    run_corruptions(&b, c, sizeof c / sizeof c[0]);
    free(b.p);

    /* duplicates */
    gguf_file *f;
    uint8_t *copy;
    o.dup_key = true;
    build(&b, &o, &L);
    int rc = open_mem(b.p, b.len, "dup.gguf", &f, &copy);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "dup.gguf", "duplicate metadata key 't.u8'");
    free(copy);
    free(b.p);
    o.dup_key = false;
    o.dup_tensor = true;
    build(&b, &o, &L);
    rc = open_mem(b.p, b.len, "dup.gguf", &f, &copy);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "dup.gguf", "duplicate tensor name 'f32'");
    free(copy);
    free(b.p);

    /* a NUL inside a key name */
    o.dup_tensor = false;
    build(&b, &o, &L);
    b.p[L.key0_len + 8 + 3] = 0;
    rc = open_mem(b.p, b.len, "nul.gguf", &f, &copy);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "nul.gguf", "NUL");
    free(copy);
    free(b.p);

    /* arrays nested deeper than the limit */
    memset(&b, 0, sizeof b);
    gb_put(&b, "GGUF", 4);
    gb_u32(&b, 3);
    gb_u64(&b, 0);
    gb_u64(&b, 1);
    gb_key(&b, "deep", GGUF_VTYPE_ARRAY);
    for (int d = 0; d < 20; d++) {
        gb_u32(&b, GGUF_VTYPE_ARRAY);
        gb_u64(&b, 1);
    }
    gb_u32(&b, GGUF_VTYPE_UINT8);
    gb_u64(&b, 0);
    rc = open_mem(b.p, b.len, "deep.gguf", &f, &copy);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "deep.gguf", "nested deeper");
    free(copy);
    free(b.p);
}

/* ---- byte flips ---------------------------------------------------------------------- */

/* Every header byte set to a few interesting values: never a crash or an
 * out-of-bounds read; failures name the file; successes describe tensors
 * that lie inside the buffer. */
static void test_byte_flips(void **state) {
    (void)state;
    gb b;
    layout L;
    opts o = {0};
    build(&b, &o, &L);
    const uint8_t vals[] = {0x00, 0xff, 0x80, 0x01, 0x7f};
    size_t accepted = 0, rejected = 0;
    for (size_t pos = 0; pos < L.data_offset; pos++) {
        for (size_t v = 0; v <= sizeof vals; v++) {
            uint8_t *p = malloc(b.len);
            assert_non_null(p);
            memcpy(p, b.p, b.len);
            p[pos] = v < sizeof vals ? vals[v] : (uint8_t)(p[pos] ^ 0x10);
            gguf_file *f;
            int rc = gguf_open_mem(p, b.len, "flip.gguf", &f);
            if (rc) {
                assert_true(rc < 0);
                if (!strstr(fu_last_error(), "flip.gguf"))
                    fail_msg("byte %zu: message '%s' does not name the file", pos, fu_last_error());
                rejected++;
            } else {
                for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
                    const gguf_tensor_info *ti = gguf_tensor(f, i);
                    const uint8_t *d = ti->data;
                    assert_true(d >= p && d <= p + b.len && ti->nbytes <= (size_t)(p + b.len - d));
                }
                for (int64_t i = 0; i < gguf_n_keys(f); i++) {
                    gguf_vtype et;
                    uint64_t n;
                    const void *data;
                    const char *key = gguf_key_name(f, i);
                    if (gguf_get_arr(f, key, &et, &n, &data) == FU_OK && et == GGUF_VTYPE_STRING)
                        for (uint64_t k = 0; k < n; k++) {
                            const char *s;
                            size_t len;
                            assert_int_equal(gguf_get_arr_str(f, key, k, &s, &len), FU_OK);
                            assert_true((const uint8_t *)s + len <= p + b.len);
                        }
                }
                gguf_close(f);
                accepted++;
            }
            free(p);
        }
    }
    assert_true(rejected > L.data_offset); /* most flips break something */
    (void)accepted;
    free(b.p);
}

/* ---- I/O errors and laziness ------------------------------------------------------------ */

static void test_io_errors(void **state) {
    (void)state;
    gguf_file *f = (gguf_file *)1;
    char path[512];
    tmp_path(path, sizeof path, "does-not-exist.gguf");
    int rc = gguf_open(path, &f);
    EXPECT_FAIL(rc, FU_ERR_IO, path, "cannot open");
    assert_null(f);
    rc = gguf_open(tmpdir, &f);
    EXPECT_FAIL(rc, FU_ERR_IO, tmpdir, "directory");
    tmp_path(path, sizeof path, "empty.gguf");
    write_file(path, "", 0);
    rc = gguf_open(path, &f);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, path, "empty");
    tmp_path(path, sizeof path, "text.gguf");
    write_file(path, "hello world, not gguf at all", 28);
    rc = gguf_open(path, &f);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, path, "not a GGUF file");
}

/* Opening a file with a 64 MiB tensor must not page in its data. */
/* VmRSS of this process in KiB. */
static long resident_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
    fclose(f);
    assert_true(kib >= 0);
    return kib;
}

static void test_open_does_not_touch_data(void **state) {
    (void)state;
    const int64_t ne0 = 4096, ne1 = 4096; /* f32: 64 MiB */
    gb b = {0};
    gb_put(&b, "GGUF", 4);
    gb_u32(&b, 3);
    gb_u64(&b, 1);
    gb_u64(&b, 0);
    gb_str(&b, "big");
    gb_u32(&b, 2);
    gb_u64(&b, (uint64_t)ne0);
    gb_u64(&b, (uint64_t)ne1);
    gb_u32(&b, 0);
    gb_u64(&b, 0);
    gb_pad(&b, 32);
    const size_t total = b.len + (size_t)(ne0 * ne1 * 4);
    char path[512];
    tmp_path(path, sizeof path, "big.gguf");
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, b.p, b.len), (ssize_t)b.len);
    assert_int_equal(ftruncate(fd, (off_t)total), 0); /* a hole: no page is cached yet */
    close(fd);
    free(b.p);

    gguf_file *f;
    assert_int_equal(gguf_open(path, &f), FU_OK);
    const gguf_tensor_info *ti = gguf_tensor(f, 0);
    assert_int_equal(ti->nbytes, (size_t)(ne0 * ne1 * 4));
    const long page = sysconf(_SC_PAGESIZE);
    /* skip the first 8 MiB (read-ahead around the header may legitimately cache it) */
    const uint8_t *lo = (const uint8_t *)ti->data + (8 << 20);
    lo = (const uint8_t *)((uintptr_t)lo & ~(uintptr_t)(page - 1));
    const size_t span = (size_t)((const uint8_t *)ti->data + ti->nbytes - lo) & ~(size_t)(page - 1);
    unsigned char *vec = malloc(span / (size_t)page);
    assert_non_null(vec);
    assert_int_equal(mincore((void *)lo, span, vec), 0);
    size_t resident = 0;
    for (size_t i = 0; i < span / (size_t)page; i++) resident += vec[i] & 1;
    assert_int_equal(resident, 0);
    /* reading the last byte does page it in (the check above can fail) */
    volatile uint8_t last = ((const uint8_t *)ti->data)[ti->nbytes - 1];
    (void)last;
    assert_int_equal(mincore((void *)lo, span, vec), 0);
    resident = 0;
    for (size_t i = 0; i < span / (size_t)page; i++) resident += vec[i] & 1;
    assert_true(resident > 0);
    free(vec);
    /* read in whole, the tensor counts in the process's resident memory;
     * released, it no longer does, and reads still see the file */
    volatile uint64_t sum = 0;
    for (size_t i = 0; i < ti->nbytes; i += (size_t)page) sum += ((const uint8_t *)ti->data)[i];
    long touched = resident_kib();
    gguf_release(f, ti->data, ti->nbytes);
    long released = resident_kib();
    assert_true(touched - released > 48 * 1024);
    for (size_t i = 0; i < ti->nbytes; i += (size_t)page) sum += ((const uint8_t *)ti->data)[i];
    assert_int_equal(sum, 0);
    static uint8_t elsewhere[1 << 16];
    memset(elsewhere, 7, sizeof elsewhere);
    gguf_release(f, NULL, 0); /* no-ops: nothing, and memory outside the mapping */
    gguf_release(f, elsewhere, sizeof elsewhere);
    for (size_t i = 0; i < sizeof elsewhere; i++) assert_int_equal(elsewhere[i], 7);
    gguf_close(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_file),
        cmocka_unit_test(test_v2_and_alignment),
        cmocka_unit_test(test_truncated_every_byte),
        cmocka_unit_test(test_corrupt_fields),
        cmocka_unit_test(test_byte_flips),
        cmocka_unit_test(test_io_errors),
        cmocka_unit_test(test_open_does_not_touch_data),
    };
    return cmocka_run_group_tests(tests, tf_setup, tf_teardown);
}
