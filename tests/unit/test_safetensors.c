/* test_safetensors.c -- safetensors reader: valid single and sharded checkpoints built in the
 * test, then truncated, corrupted and inconsistent ones, each of which must be rejected with a
 * message naming the file (and the tensor or shard where there is one). */
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
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gguf.h"
#include "ops.h"
#include "safetensors.h"
#include "status.h"
#include "test-files.h"

/* ---- helpers --------------------------------------------------------------------- */

static void make_dir(const char *rel) {
    char p[512];
    tmp_path(p, sizeof p, rel);
    assert_int_equal(mkdir(p, 0755), 0);
}

/* Serialises a safetensors file (8-byte length, header, data) into a malloc'd
 * buffer; the header is padded with spaces to a multiple of 8 like the
 * reference writer does. */
static uint8_t *st_bytes(const char *header, const void *data, size_t n, size_t *len) {
    size_t h = strlen(header), hp = (h + 7) / 8 * 8;
    *len = 8 + hp + n;
    uint8_t *p = malloc(*len);
    assert_non_null(p);
    uint64_t hl = hp;
    memcpy(p, &hl, 8);
    memcpy(p + 8, header, h);
    memset(p + 8 + h, ' ', hp - h);
    if (n) memcpy(p + 8 + hp, data, n);
    return p;
}

static void st_write_raw(const char *rel, const char *header, const void *data, size_t n) {
    char path[512];
    tmp_path(path, sizeof path, rel);
    size_t len;
    uint8_t *p = st_bytes(header, data, n, &len);
    write_file(path, p, len);
    free(p);
}

static void expect_fail(int rc, int want, const char *name, const char *sub, int line) {
    const char *msg = fu_last_error();
    if (rc != want || !strstr(msg, name) || (sub && !strstr(msg, sub)))
        fail_msg("line %d: rc %d (want %d), message '%s' (want '%s' and '%s')", line, rc, want,
                 msg, name, sub ? sub : "");
}
#define EXPECT_FAIL(rc, want, name, sub) expect_fail((rc), (want), (name), (sub), __LINE__)

/* ---- a valid single file ------------------------------------------------------------ */

static const char valid_header[] =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"h\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[24,32]},"
    "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[32,40]},"
    "\"i8\":{\"dtype\":\"I8\",\"shape\":[3],\"data_offsets\":[40,43]},"
    "\"u8\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[43,44]},"
    "\"d\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[44,52]},"
    "\"l\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[52,68]},"
    "\"five\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,2],\"data_offsets\":[68,76]},"
    "\"scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[76,80]},"
    "\"weird\":{\"dtype\":\"F8_E8M0\",\"shape\":[2],\"data_offsets\":[80,82]}}";
#define VALID_DATA 82

static void valid_data(uint8_t *d) {
    memset(d, 0, VALID_DATA);
    for (int i = 0; i < 6; i++) {
        float v = (float)i - 2.5f;
        memcpy(d + 4 * i, &v, 4);
    }
    for (int i = 0; i < 4; i++) {
        uint16_t h = op_f32_to_f16((float)i * 0.5f);
        memcpy(d + 24 + 2 * i, &h, 2);
    }
    for (int i = 0; i < 4; i++) {
        uint16_t h = op_f32_to_bf16(-(float)i);
        memcpy(d + 32 + 2 * i, &h, 2);
    }
    float s = 42.0f;
    memcpy(d + 76, &s, 4);
}

static void test_valid_single(void **state) {
    (void)state;
    uint8_t data[VALID_DATA];
    valid_data(data);
    st_write_raw("valid.safetensors", valid_header, data, sizeof data);
    char path[512];
    tmp_path(path, sizeof path, "valid.safetensors");
    st_model *m;
    assert_int_equal(st_model_open(path, &m), FU_OK);
    assert_string_equal(st_model_path(m), path);
    assert_int_equal(st_model_n_shards(m), 1);
    assert_int_equal(st_model_n_tensors(m), 10);
    /* sorted by name, __metadata__ skipped */
    static const char *const names[] = {"b", "d", "five", "h", "i8", "l", "scalar", "u8", "w", "weird"};
    for (int i = 0; i < 10; i++) assert_string_equal(st_model_tensor_name(m, i), names[i]);
    assert_null(st_model_tensor_name(m, 10));
    assert_int_equal(st_model_find_index(m, "w"), 8);
    assert_int_equal(st_model_find_index(m, "__metadata__"), -1);

    op_tensor t;
    float row[8];
    assert_int_equal(st_model_find(m, "w", &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_F32);
    assert_int_equal(t.ndim, 2);
    assert_int_equal(t.ne[0], 3); /* (2, 3) -> ne[0] = cols */
    assert_int_equal(t.ne[1], 2);
    assert_int_equal(t.nb[1], 12);
    assert_string_equal(t.name, "w");
    op_dequantize_row(&t, 1, row);
    assert_true(row[0] == 0.5f && row[2] == 2.5f);
    assert_int_equal(st_model_find(m, "h", &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_F16);
    op_dequantize_row(&t, 0, row);
    assert_true(row[3] == 1.5f);
    assert_int_equal(st_model_find(m, "b", &t), FU_OK);
    assert_int_equal(t.type, OP_TYPE_BF16);
    assert_int_equal(t.ne[0], 2);
    op_dequantize_row(&t, 1, row);
    assert_true(row[1] == -3.0f);
    assert_int_equal(st_model_find(m, "scalar", &t), FU_OK);
    assert_int_equal(t.ndim, 1);
    assert_int_equal(t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3], 1);
    assert_true(*(const float *)t.data == 42.0f);

    int rc = st_model_find(m, "i8", &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, path, "'i8' has dtype I8");
    rc = st_model_find(m, "d", &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, path, "'d' has dtype F64");
    rc = st_model_find(m, "l", &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, path, "'l' has dtype I64");
    rc = st_model_find(m, "weird", &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, path, "F8_E8M0");
    rc = st_model_find(m, "five", &t);
    EXPECT_FAIL(rc, FU_ERR_UNSUPPORTED, path, "'five' has 5 dims");
    rc = st_model_find(m, "nope", &t);
    EXPECT_FAIL(rc, FU_ERR_NOT_FOUND, path, "'nope'");

    st_tensor_info ti;
    assert_int_equal(st_model_tensor_info(m, st_model_find_index(m, "l"), &ti), FU_OK);
    assert_string_equal(ti.dtype, "I64");
    assert_int_equal(ti.rank, 1);
    assert_int_equal(ti.shape[0], 2);
    assert_int_equal(ti.nbytes, 16);
    assert_string_equal(ti.file, path);
    size_t hp = (strlen(valid_header) + 7) / 8 * 8;
    assert_int_equal(ti.file_offset, 8 + hp + 52);
    rc = st_model_tensor_info(m, 10, &ti);
    EXPECT_FAIL(rc, FU_ERR_RANGE, path, NULL);
    st_model_close(m);
    st_model_close(NULL);

    /* a directory holding model.safetensors */
    make_dir("single");
    st_write_raw("single/model.safetensors", valid_header, data, sizeof data);
    tmp_path(path, sizeof path, "single");
    assert_int_equal(st_model_open(path, &m), FU_OK);
    assert_int_equal(st_model_n_tensors(m), 10);
    st_model_close(m);
}

/* ---- truncation and corruption of one file ------------------------------------------------- */

static void test_truncated_every_byte(void **state) {
    (void)state;
    uint8_t data[VALID_DATA];
    valid_data(data);
    size_t len;
    uint8_t *p = st_bytes(valid_header, data, sizeof data, &len);
    char path[512];
    tmp_path(path, sizeof path, "trunc.safetensors");
    for (size_t n = 0; n < len; n++) {
        write_file(path, p, n);
        st_model *m = (st_model *)1;
        int rc = st_model_open(path, &m);
        if (rc >= 0) fail_msg("prefix of %zu of %zu bytes was accepted", n, len);
        EXPECT_FAIL(rc, FU_ERR_FORMAT, path, NULL);
        assert_null(m);
        if (n < 8) assert_non_null(strstr(fu_last_error(), "too small"));
        else if (n < len - VALID_DATA) assert_non_null(strstr(fu_last_error(), "header length"));
        else assert_non_null(strstr(fu_last_error(), "outside the data section"));
    }
    free(p);
}

/* Writes `header` + `n` data bytes to bad.safetensors and expects FU_ERR_FORMAT with `sub`. */
static void expect_bad_header(const char *header, size_t n, const char *sub, int line) {
    uint8_t data[256] = {0};
    assert_true(n <= sizeof data);
    st_write_raw("bad.safetensors", header, data, n);
    char path[512];
    tmp_path(path, sizeof path, "bad.safetensors");
    st_model *m;
    int rc = st_model_open(path, &m);
    expect_fail(rc, FU_ERR_FORMAT, path, sub, line);
    assert_null(m);
}
#define BAD(header, n, sub) expect_bad_header((header), (n), (sub), __LINE__)

static void test_bad_headers(void **state) {
    (void)state;
    BAD("[1,2]", 0, "not a JSON object");
    BAD("{", 0, "JSON invalid");
    BAD("{\"a\":1,}", 0, "JSON invalid");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "duplicate");
    BAD("{\"w\":5}", 0, "'w': header entry is not an object");
    BAD("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "'w': missing or non-string \"dtype\"");
    BAD("{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "\"dtype\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "'w': missing or non-array \"shape\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "'w': shape[0]");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "'w': shape[0]");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, "shape[0]");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,4]}}", 4,
        "'w': shape overflows");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1152921504606846976,4],\"data_offsets\":[0,4]}}", 4,
        "'w': size overflows");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", 4,
        "JSON invalid");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "'w': \"data_offsets\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "'w': \"data_offsets\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, "\"data_offsets\"");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, "non-negative");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
        "'w': data_offsets [4, 0) outside");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,400]}}", 4,
        "'w': data_offsets [0, 400) outside the data section (4 bytes");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[9223372036854775807,9223372036854775807]}}",
        4, "outside");
    BAD("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 24,
        "'w': data_offsets span 20 bytes but shape and dtype F32 need 24");
    BAD("{\"w\":{\"dtype\":\"I8\",\"shape\":[3],\"data_offsets\":[0,4]}}", 4, "need 3");
    BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlap");
    BAD("{}x", 0, "JSON invalid");

    /* the 8-byte length itself */
    char path[512];
    tmp_path(path, sizeof path, "len.safetensors");
    const uint64_t lens[] = {(uint64_t)1 << 63, UINT64_MAX, 200000000, 17, 0};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint8_t buf[24] = "........{}              ";
        memcpy(buf, &lens[i], 8);
        write_file(path, buf, sizeof buf);
        st_model *m;
        int rc = st_model_open(path, &m);
        EXPECT_FAIL(rc, FU_ERR_FORMAT, path, lens[i] ? "header length" : "not a JSON object");
    }
    /* a header just over the library's 100 MB limit, in a sparse file that holds it */
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    assert_true(fd >= 0);
    uint64_t big = 100000008;
    assert_int_equal(write(fd, &big, 8), 8);
    assert_int_equal(ftruncate(fd, (off_t)(8 + big)), 0);
    close(fd);
    st_model *m;
    int rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, path, "exceeds the limit");
}

/* Byte flips in the header: never a crash; failures name the file. */
static void test_byte_flips(void **state) {
    (void)state;
    uint8_t data[VALID_DATA];
    valid_data(data);
    size_t len;
    uint8_t *p = st_bytes(valid_header, data, sizeof data, &len);
    char path[512];
    tmp_path(path, sizeof path, "flip.safetensors");
    const size_t hend = len - VALID_DATA;
    size_t rejected = 0;
    for (size_t pos = 0; pos < hend; pos += 1) {
        const uint8_t orig = p[pos];
        const uint8_t vals[] = {'0', '9', '"', ']', 0xff, (uint8_t)(orig ^ 0x01)};
        for (size_t v = 0; v < sizeof vals; v++) {
            if (pos >= 8 && v < 4 && pos % 3) continue; /* keep the run short */
            p[pos] = vals[v];
            write_file(path, p, len);
            st_model *m;
            int rc = st_model_open(path, &m);
            if (rc) {
                if (!strstr(fu_last_error(), path))
                    fail_msg("byte %zu: message '%s' does not name the file", pos, fu_last_error());
                rejected++;
            } else {
                for (int64_t i = 0; i < st_model_n_tensors(m); i++) {
                    st_tensor_info ti;
                    assert_int_equal(st_model_tensor_info(m, i, &ti), FU_OK);
                    assert_true(ti.file_offset <= len && ti.nbytes <= len - ti.file_offset);
                }
                st_model_close(m);
            }
        }
        p[pos] = orig;
    }
    assert_true(rejected > hend);
    free(p);
}

/* ---- sharded checkpoints ------------------------------------------------------------------ */

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"
static const char shard1_header[] =
    "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
    "\"b\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[8,12]}}";
static const char shard2_header[] =
    "{\"__metadata__\":{},\"c\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,4]}}";

/* Makes directory `dir` with both shards and an index whose weight_map is `wm`. */
static void make_sharded(const char *dir, const char *wm) {
    make_dir(dir);
    char rel[256];
    uint8_t d1[12], d2[4];
    float a[2] = {1.5f, -2.0f};
    memcpy(d1, a, 8);
    uint16_t h[2] = {op_f32_to_f16(0.25f), op_f32_to_f16(-8.0f)};
    memcpy(d1 + 8, h, 4);
    uint16_t bf[2] = {op_f32_to_bf16(3.0f), op_f32_to_bf16(-0.5f)};
    memcpy(d2, bf, 4);
    snprintf(rel, sizeof rel, "%s/" SHARD1, dir);
    st_write_raw(rel, shard1_header, d1, sizeof d1);
    snprintf(rel, sizeof rel, "%s/" SHARD2, dir);
    st_write_raw(rel, shard2_header, d2, sizeof d2);
    char index[1024];
    snprintf(index, sizeof index, "{\"metadata\":{\"total_size\":16},\"weight_map\":%s}", wm);
    char path[512];
    snprintf(rel, sizeof rel, "%s/model.safetensors.index.json", dir);
    tmp_path(path, sizeof path, rel);
    write_file(path, index, strlen(index));
}

static const char good_wm[] =
    "{\"a\":\"" SHARD1 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD2 "\"}";

static void test_sharded(void **state) {
    (void)state;
    make_sharded("sharded", good_wm);
    char path[512];
    tmp_path(path, sizeof path, "sharded");
    st_model *m;
    for (int pass = 0; pass < 2; pass++) { /* the directory, then the index file itself */
        if (pass == 1) tmp_path(path, sizeof path, "sharded/model.safetensors.index.json");
        assert_int_equal(st_model_open(path, &m), FU_OK);
        assert_int_equal(st_model_n_shards(m), 2);
        assert_int_equal(st_model_n_tensors(m), 3);
        op_tensor t;
        float row[2];
        assert_int_equal(st_model_find(m, "a", &t), FU_OK);
        op_dequantize_row(&t, 0, row);
        assert_true(row[0] == 1.5f && row[1] == -2.0f);
        assert_int_equal(st_model_find(m, "b", &t), FU_OK);
        op_dequantize_row(&t, 0, row);
        assert_true(row[0] == 0.25f && row[1] == -8.0f);
        assert_int_equal(st_model_find(m, "c", &t), FU_OK);
        assert_int_equal(t.type, OP_TYPE_BF16);
        assert_int_equal(t.ne[0], 2);
        assert_int_equal(t.ne[1], 1);
        op_dequantize_row(&t, 0, row);
        assert_true(row[0] == 3.0f && row[1] == -0.5f);
        st_tensor_info ti;
        assert_int_equal(st_model_tensor_info(m, st_model_find_index(m, "c"), &ti), FU_OK);
        assert_non_null(strstr(ti.file, "/sharded/" SHARD2));
        st_model_close(m);
    }

    /* with model.safetensors next to the index, the single file wins (as in transformers) */
    make_sharded("both", good_wm);
    uint8_t data[VALID_DATA];
    valid_data(data);
    st_write_raw("both/model.safetensors", valid_header, data, sizeof data);
    tmp_path(path, sizeof path, "both");
    assert_int_equal(st_model_open(path, &m), FU_OK);
    assert_int_equal(st_model_n_shards(m), 1);
    assert_int_equal(st_model_n_tensors(m), 10);
    st_model_close(m);
}

static void test_sharded_errors(void **state) {
    (void)state;
    char path[512], sub[768];
    st_model *m;
    int rc;

    /* a shard named by the index is missing */
    make_sharded("missing", "{\"a\":\"" SHARD1 "\",\"c\":\"model-00003-of-00002.safetensors\"}");
    tmp_path(path, sizeof path, "missing");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_NOT_FOUND, "model.safetensors.index.json",
                "shard 'model-00003-of-00002.safetensors' named by the index is missing");
    assert_null(m);

    /* shard names that leave the directory */
    static const char *const evil[] = {"../" SHARD1, "sub/" SHARD1, "..", "/etc/passwd", ""};
    for (size_t i = 0; i < sizeof evil / sizeof evil[0]; i++) {
        char dir[64], wm[256];
        snprintf(dir, sizeof dir, "evil%zu", i);
        snprintf(wm, sizeof wm, "{\"a\":\"" SHARD1 "\",\"c\":\"%s\"}", evil[i]);
        make_sharded(dir, wm);
        tmp_path(path, sizeof path, dir);
        rc = st_model_open(path, &m);
        EXPECT_FAIL(rc, FU_ERR_FORMAT, "model.safetensors.index.json", "plain file name");
    }

    /* weight_map disagrees with the shards */
    make_sharded("wrong1", "{\"a\":\"" SHARD1 "\",\"c\":\"" SHARD1 "\"}");
    tmp_path(path, sizeof path, "wrong1");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "wrong1/model.safetensors.index.json",
                "puts tensor 'c' in shard '" SHARD1 "', which has no such tensor");
    make_sharded("wrong2", "{\"a\":\"" SHARD2 "\",\"b\":\"" SHARD1 "\",\"c\":\"" SHARD2 "\"}");
    tmp_path(path, sizeof path, "wrong2");
    rc = st_model_open(path, &m);
    snprintf(sub, sizeof sub, "puts tensor 'a' in shard '" SHARD2 "', but it is in %s/wrong2/" SHARD1,
             tmpdir);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "index.json", sub);

    /* the same tensor in two shards */
    make_sharded("dup", good_wm);
    st_write_raw("dup/" SHARD2, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
             "\0\0\0\0", 4);
    tmp_path(path, sizeof path, "dup");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "index.json", "tensor 'a' is in both");

    /* a corrupt shard: the message names the shard file and tensor */
    make_sharded("badshard", good_wm);
    st_write_raw("badshard/" SHARD2, "{\"c\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,40]}}",
             "\0\0\0\0", 4);
    tmp_path(path, sizeof path, "badshard");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, "badshard/" SHARD2, "'c': data_offsets [0, 40) outside");

    /* broken index files */
    static const struct {
        const char *json;
        int want;
        const char *sub;
    } idx[] = {
        {"{\"metadata\":{}}", FU_ERR_FORMAT, "missing or non-object \"weight_map\""},
        {"{\"weight_map\":[]}", FU_ERR_FORMAT, "\"weight_map\""},
        {"{\"weight_map\":{\"a\":5}}", FU_ERR_FORMAT, "weight_map entry 'a' is not a string"},
        {"{\"weight_map\":{}}", FU_ERR_NOT_FOUND, "weight_map lists no tensors"},
        {"{\"weight_map\":{\"a\":\"" SHARD1 "\"", FU_ERR_FORMAT, "invalid JSON"},
        {"[]", FU_ERR_FORMAT, "\"weight_map\""},
        {"", FU_ERR_FORMAT, "empty"},
    };
    make_dir("idx");
    tmp_path(path, sizeof path, "idx/model.safetensors.index.json");
    for (size_t i = 0; i < sizeof idx / sizeof idx[0]; i++) {
        write_file(path, idx[i].json, strlen(idx[i].json));
        rc = st_model_open(path, &m);
        EXPECT_FAIL(rc, idx[i].want, path, idx[i].sub);
    }

    /* a directory without weights, a path that does not exist, an empty file */
    make_dir("empty");
    tmp_path(path, sizeof path, "empty");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_NOT_FOUND, path, "no model.safetensors");
    tmp_path(path, sizeof path, "nowhere.safetensors");
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_IO, path, "cannot open");
    tmp_path(path, sizeof path, "zero.safetensors");
    write_file(path, "", 0);
    rc = st_model_open(path, &m);
    EXPECT_FAIL(rc, FU_ERR_FORMAT, path, "too small");
}

/* Opening must not page in tensor data (a shard serves only its own blocks). */
static void test_open_does_not_touch_data(void **state) {
    (void)state;
    const size_t nbytes = (size_t)64 << 20;
    char header[256];
    snprintf(header, sizeof header,
             "{\"big\":{\"dtype\":\"F32\",\"shape\":[4096,4096],\"data_offsets\":[0,%zu]}}",
             nbytes);
    size_t len;
    uint8_t *p = st_bytes(header, NULL, 0, &len);
    char path[512];
    tmp_path(path, sizeof path, "big.safetensors");
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, p, len), (ssize_t)len);
    assert_int_equal(ftruncate(fd, (off_t)(len + nbytes)), 0);
    close(fd);
    free(p);
    st_model *m;
    assert_int_equal(st_model_open(path, &m), FU_OK);
    op_tensor t;
    assert_int_equal(st_model_find(m, "big", &t), FU_OK);
    const long page = sysconf(_SC_PAGESIZE);
    const uint8_t *lo = (const uint8_t *)t.data + (8 << 20);
    lo = (const uint8_t *)((uintptr_t)lo & ~(uintptr_t)(page - 1));
    const size_t span = (size_t)((const uint8_t *)t.data + nbytes - lo) & ~(size_t)(page - 1);
    unsigned char *vec = malloc(span / (size_t)page);
    assert_non_null(vec);
    assert_int_equal(mincore((void *)lo, span, vec), 0);
    size_t resident = 0;
    for (size_t i = 0; i < span / (size_t)page; i++) resident += vec[i] & 1;
    assert_int_equal(resident, 0);
    volatile uint8_t last = ((const uint8_t *)t.data)[nbytes - 1];
    (void)last;
    assert_int_equal(mincore((void *)lo, span, vec), 0);
    for (size_t i = 0; i < span / (size_t)page; i++) resident += vec[i] & 1;
    assert_true(resident > 0);
    free(vec);
    st_model_close(m);
}

/* Runs fn(path) in a child process, which must return within 5 s: opening a FIFO for reading
 * blocks until a writer comes, so an opener that does not refuse non-regular files hangs. */
static void expect_refused_in_time(int (*fn)(const char *), const char *path) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(fn(path) == FU_ERR_IO && strstr(fu_last_error(), "regular") ? 0 : 1);
    int status = 0;
    for (int i = 0; i < 500 && waitpid(pid, &status, WNOHANG) == 0; i++) usleep(10000);
    if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fail_msg("%s: still blocked after 5 s (a FIFO must be refused, not opened)", path);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("%s: not refused with FU_ERR_IO \"not a regular file\"", path);
}

static int open_st(const char *path) {
    st_model *m = NULL;
    int rc = st_model_open(path, &m);
    st_model_close(m);
    return rc;
}

static int open_gguf(const char *path) {
    gguf_file *f = NULL;
    int rc = gguf_open(path, &f);
    gguf_close(f);
    return rc;
}

static void test_fifo_refused(void **state) {
    (void)state;
    char fifo[512], index[512];
    tmp_path(fifo, sizeof fifo, "fifo-model.safetensors");
    tmp_path(index, sizeof index, "fifo-model.safetensors.index.json");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(mkfifo(index, 0600), 0);
    expect_refused_in_time(open_st, fifo);
    expect_refused_in_time(open_st, index);
    expect_refused_in_time(open_gguf, fifo);
    unlink(fifo);
    unlink(index);
}

/* st_write: a file the reader opens with the same names, shapes, dtypes and bytes; the header
 * padded to 8 bytes; bad tensors refused by name, and no file (or temporary) left then. */
static void test_writer(void **state) {
    (void)state;
    float w[6] = {1, -2, 3.5f, 0, 5, 6};
    uint16_t h[3] = {0x3c00, 0xc000, 0x3800};
    int64_t sw[2] = {2, 3}, sh[1] = {3};
    st_write_tensor ts[3] = {{"z.weight", "F32", 2, sw, w}, {"a.half", "F16", 1, sh, h},
                             {"scalar", "F32", 0, NULL, w}};
    char path[512];
    tmp_path(path, sizeof path, "written.safetensors");
    assert_int_equal(st_write(path, ts, 3), FU_OK);
    st_model *m;
    assert_int_equal(st_model_open(path, &m), FU_OK);
    assert_int_equal(st_model_n_tensors(m), 3);
    st_tensor_info ti;
    assert_int_equal(st_model_tensor_info(m, st_model_find_index(m, "z.weight"), &ti), FU_OK);
    assert_string_equal(ti.dtype, "F32");
    assert_int_equal(ti.rank, 2);
    assert_true(ti.shape[0] == 2 && ti.shape[1] == 3);
    assert_int_equal(ti.file_offset % 8, 0);
    assert_memory_equal(ti.data, w, sizeof w);
    assert_int_equal(st_model_tensor_info(m, st_model_find_index(m, "a.half"), &ti), FU_OK);
    assert_memory_equal(ti.data, h, sizeof h);
    st_model_close(m);

    st_write_tensor dup[2] = {ts[0], ts[0]}, bad = {"q", "F33", 1, sh, w};
    tmp_path(path, sizeof path, "refused.safetensors");
    expect_fail(st_write(path, dup, 2), FU_ERR_INVALID, "z.weight", "twice", __LINE__);
    expect_fail(st_write(path, &bad, 1), FU_ERR_INVALID, "'q'", "F33", __LINE__);
    assert_int_not_equal(access(path, F_OK), 0);
    tmp_path(path, sizeof path, "no-such-dir/x.safetensors");
    assert_int_equal(st_write(path, ts, 1), FU_ERR_IO);
    assert_non_null(strstr(fu_last_error(), "no-such-dir"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_single),
        cmocka_unit_test(test_truncated_every_byte),
        cmocka_unit_test(test_bad_headers),
        cmocka_unit_test(test_byte_flips),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_sharded_errors),
        cmocka_unit_test(test_open_does_not_touch_data),
        cmocka_unit_test(test_fifo_refused),
        cmocka_unit_test(test_writer),
    };
    return cmocka_run_group_tests(tests, tf_setup, tf_teardown);
}
