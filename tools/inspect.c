/* inspect.c -- fusion-inspect: prints a GGUF or safetensors checkpoint's metadata, tensor table
 * or one tensor's dequantized values as JSON.
 *
 *   fusion-inspect FILE_OR_DIR                       metadata + tensor table
 *   fusion-inspect FILE_OR_DIR --tensor NAME [--rows A:B]
 *                                                    values of NAME (rows [A, B) of its 2-D view)
 *
 * GGUF output: {"format":"gguf","version","alignment","data_offset","metadata":{key:{"type",
 * "value"}},"tensors":[{"name","type","ggml_type","shape" (ne order),"offset","nbytes"}]}.
 * Array values are {"type":"array","elem_type":T,"value":[...]}, nested arrays as nested lists.
 * Safetensors output: {"format":"safetensors","n_shards","tensors":[{"name","dtype","shape"
 * (file order),"file","offset","nbytes"}]}.
 * Integers above INT64_MAX and non-finite floats are written as JSON strings; invalid UTF-8 in
 * strings is replaced by U+FFFD. Values are written with 9 significant digits (exact for f32).
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utf8proc.h>

#include "gguf.h"
#include "mapped-file.h"
#include "ops.h"
#include "parse.h"
#include "safetensors.h"
#include "status.h"

static void usage(void) {
    fprintf(stderr, "usage: fusion-inspect FILE_OR_DIR [--tensor NAME [--rows START:END]]\n");
}

/* ---- JSON helpers ---------------------------------------------------------- */

/* A JSON string from arbitrary bytes: invalid UTF-8 becomes U+FFFD. */
static json_t *json_bytes(const char *s, size_t len) {
    json_t *j = json_stringn(s, len);
    if (j) return j;
    char *buf = malloc(len * 3 + 1);
    if (!buf) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t c;
        utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &c);
        if (n <= 0) {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        } else {
            memcpy(buf + o, s + i, (size_t)n);
            o += (size_t)n;
            i += (size_t)n;
        }
    }
    j = json_stringn(buf, o);
    free(buf);
    return j;
}

/* obj[key] = v (v's reference is taken); a key that is not UTF-8 is sanitized. */
static void set_key(json_t *obj, const char *key, json_t *v) {
    json_t *k = json_bytes(key, strlen(key)); /* valid UTF-8 (jansson drops other keys) */
    json_object_set_new(obj, k ? json_string_value(k) : "?", v);
    json_decref(k);
}

static json_t *json_u64(uint64_t v) {
    if (v <= INT64_MAX) return json_integer((json_int_t)v);
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRIu64, v);
    return json_string(buf);
}

static json_t *json_float(double v) {
    if (isnan(v)) return json_string("nan");
    if (isinf(v)) return json_string(v > 0 ? "inf" : "-inf");
    return json_real(v);
}

static void print_float(float v) {
    if (isnan(v))
        fputs("\"nan\"", stdout);
    else if (isinf(v))
        fputs(v > 0 ? "\"inf\"" : "\"-inf\"", stdout);
    else if (v == 0.0f && signbit(v))
        fputs("-0.0", stdout); /* "-0" would read back as the integer 0 */
    else
        printf("%.9g", (double)v);
}

/* Prints j compactly (keys in insertion order) and frees it. */
static void print_json(json_t *j) {
    json_dumpf(j, stdout, JSON_COMPACT | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(17));
    json_decref(j);
}

/* ---- GGUF ---------------------------------------------------------------------- */

/* Decodes one value of type t at *p (already validated by gguf_open) and advances *p. */
static json_t *gguf_value_json(gguf_vtype t, const uint8_t **p) {
    const uint8_t *q = *p;
    switch (t) {
    case GGUF_VTYPE_UINT8: *p += 1; return json_integer(q[0]);
    case GGUF_VTYPE_INT8: { int8_t v; memcpy(&v, q, 1); *p += 1; return json_integer(v); }
    case GGUF_VTYPE_UINT16: { uint16_t v; memcpy(&v, q, 2); *p += 2; return json_integer(v); }
    case GGUF_VTYPE_INT16: { int16_t v; memcpy(&v, q, 2); *p += 2; return json_integer(v); }
    case GGUF_VTYPE_UINT32: { uint32_t v; memcpy(&v, q, 4); *p += 4; return json_integer(v); }
    case GGUF_VTYPE_INT32: { int32_t v; memcpy(&v, q, 4); *p += 4; return json_integer(v); }
    case GGUF_VTYPE_UINT64: { uint64_t v; memcpy(&v, q, 8); *p += 8; return json_u64(v); }
    case GGUF_VTYPE_INT64: { int64_t v; memcpy(&v, q, 8); *p += 8; return json_integer(v); }
    case GGUF_VTYPE_FLOAT32: { float v; memcpy(&v, q, 4); *p += 4; return json_float(v); }
    case GGUF_VTYPE_FLOAT64: { double v; memcpy(&v, q, 8); *p += 8; return json_float(v); }
    case GGUF_VTYPE_BOOL: *p += 1; return json_boolean(q[0] != 0);
    case GGUF_VTYPE_STRING: {
        uint64_t n;
        memcpy(&n, q, 8);
        *p += 8 + n;
        return json_bytes((const char *)q + 8, (size_t)n);
    }
    case GGUF_VTYPE_ARRAY: {
        uint32_t et;
        uint64_t n;
        memcpy(&et, q, 4);
        memcpy(&n, q + 4, 8);
        *p += 12;
        json_t *a = json_array();
        for (uint64_t i = 0; i < n; i++) json_array_append_new(a, gguf_value_json((gguf_vtype)et, p));
        return a;
    }
    }
    return json_null();
}

static json_t *gguf_kv_json(const gguf_file *f, int64_t i) {
    const char *key = gguf_key_name(f, i);
    gguf_vtype t = gguf_key_type(f, i);
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string(gguf_vtype_name(t)));
    if (t == GGUF_VTYPE_ARRAY) {
        gguf_vtype et;
        uint64_t n;
        const void *data;
        gguf_get_arr(f, key, &et, &n, &data);
        json_object_set_new(o, "elem_type", json_string(gguf_vtype_name(et)));
        json_t *a = json_array();
        if (et == GGUF_VTYPE_STRING) {
            for (uint64_t k = 0; k < n; k++) { /* exercises the O(1) element access */
                const char *s;
                size_t len;
                gguf_get_arr_str(f, key, k, &s, &len);
                json_array_append_new(a, json_bytes(s, len));
            }
        } else {
            const uint8_t *p = data;
            for (uint64_t k = 0; k < n; k++) json_array_append_new(a, gguf_value_json(et, &p));
        }
        json_object_set_new(o, "value", a);
    } else if (t == GGUF_VTYPE_STRING) {
        const char *s;
        size_t len;
        gguf_get_str(f, key, &s, &len);
        json_object_set_new(o, "value", json_bytes(s, len));
    } else if (t == GGUF_VTYPE_FLOAT32 || t == GGUF_VTYPE_FLOAT64) {
        double d;
        gguf_get_f64(f, key, &d);
        json_object_set_new(o, "value", json_float(d));
    } else if (t == GGUF_VTYPE_BOOL) {
        bool b;
        gguf_get_bool(f, key, &b);
        json_object_set_new(o, "value", json_boolean(b));
    } else {
        int64_t s;
        uint64_t u;
        if (gguf_get_i64(f, key, &s) == FU_OK)
            json_object_set_new(o, "value", json_integer(s));
        else if (gguf_get_u64(f, key, &u) == FU_OK)
            json_object_set_new(o, "value", json_u64(u));
    }
    return o;
}

static void gguf_print_table(const gguf_file *f) {
    json_t *root = json_object();
    json_object_set_new(root, "format", json_string("gguf"));
    json_object_set_new(root, "version", json_integer(gguf_version(f)));
    json_object_set_new(root, "alignment", json_integer(gguf_alignment(f)));
    json_object_set_new(root, "data_offset", json_u64(gguf_data_offset(f)));
    json_t *meta = json_object();
    for (int64_t i = 0; i < gguf_n_keys(f); i++)
        set_key(meta, gguf_key_name(f, i), gguf_kv_json(f, i));
    json_object_set_new(root, "metadata", meta);
    json_t *tensors = json_array();
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor_info *ti = gguf_tensor(f, i);
        json_t *t = json_object();
        json_object_set_new(t, "name", json_bytes(ti->name, strlen(ti->name)));
        json_object_set_new(t, "type", json_string(gguf_type_name(ti->ggml_type)));
        json_object_set_new(t, "ggml_type", json_integer(ti->ggml_type));
        json_t *shape = json_array();
        for (int d = 0; d < ti->n_dims; d++) json_array_append_new(shape, json_integer(ti->ne[d]));
        json_object_set_new(t, "shape", shape);
        json_object_set_new(t, "offset", json_u64(ti->offset));
        json_object_set_new(t, "nbytes", json_u64(ti->nbytes));
        json_array_append_new(tensors, t);
    }
    json_object_set_new(root, "tensors", tensors);
    print_json(root);
    putchar('\n');
}

/* ---- values ------------------------------------------------------------------ */

typedef struct row_range {
    int64_t start, end; /* end < 0: to the last row */
} row_range;

/* Prints {"name","type","shape","values"} for t; shape as given by the caller. */
static int print_values(const op_tensor *t, json_t *shape, row_range rows) {
    int64_t n_rows = t->ne[1] * t->ne[2] * t->ne[3];
    int64_t start = rows.start, end = rows.end < 0 ? n_rows : rows.end;
    if (start > end || end > n_rows) {
        json_decref(shape);
        fprintf(stderr, "fusion-inspect: rows %" PRId64 ":%" PRId64 " outside [0, %" PRId64 "]\n",
                start, end, n_rows);
        return 1;
    }
    /* A contiguous tensor is a 2-D (ne[0], n_rows) view. */
    op_tensor v = op_tensor_2d(t->type, t->data, t->ne[0], n_rows);
    float *row = malloc((size_t)(t->ne[0] > 0 ? t->ne[0] : 1) * sizeof *row);
    if (!row) {
        json_decref(shape);
        fprintf(stderr, "fusion-inspect: out of memory\n");
        return 1;
    }
    json_t *head = json_object();
    json_object_set_new(head, "name", json_bytes(t->name, strlen(t->name)));
    json_object_set_new(head, "type", json_string(op_type_name(t->type)));
    json_object_set_new(head, "shape", shape);
    json_object_set_new(head, "rows", json_pack("[II]", (json_int_t)start, (json_int_t)end));
    char *s = json_dumps(head, JSON_COMPACT | JSON_ENSURE_ASCII);
    json_decref(head);
    if (!s) {
        free(row);
        return 1;
    }
    s[strlen(s) - 1] = '\0'; /* drop the closing brace */
    fputs(s, stdout);
    free(s);
    fputs(",\"values\":[", stdout);
    for (int64_t r = start; r < end; r++) {
        op_dequantize_row(&v, r, row);
        for (int64_t i = 0; i < t->ne[0]; i++) {
            if (r > start || i > 0) putchar(',');
            print_float(row[i]);
        }
    }
    fputs("]}\n", stdout);
    free(row);
    return 0;
}

static int inspect_gguf(const char *path, const char *tensor, row_range rows) {
    gguf_file *f;
    if (gguf_open(path, &f)) {
        fprintf(stderr, "fusion-inspect: %s\n", fu_last_error());
        return 1;
    }
    int rc = 0;
    if (!tensor) {
        gguf_print_table(f);
    } else {
        int64_t i = gguf_find_tensor(f, tensor);
        op_tensor t;
        if (i < 0) {
            fprintf(stderr, "fusion-inspect: %s: no tensor '%s'\n", path, tensor);
            rc = 1;
        } else if (gguf_tensor_as_op(f, i, &t)) {
            fprintf(stderr, "fusion-inspect: %s\n", fu_last_error());
            rc = 1;
        } else {
            const gguf_tensor_info *ti = gguf_tensor(f, i);
            json_t *shape = json_array();
            for (int d = 0; d < ti->n_dims; d++) json_array_append_new(shape, json_integer(ti->ne[d]));
            rc = print_values(&t, shape, rows);
        }
    }
    gguf_close(f);
    return rc;
}

/* ---- safetensors ------------------------------------------------------------- */

static int inspect_safetensors(const char *path, const char *tensor, row_range rows) {
    st_model *m;
    if (st_model_open(path, &m)) {
        fprintf(stderr, "fusion-inspect: %s\n", fu_last_error());
        return 1;
    }
    int rc = 0;
    if (!tensor) {
        json_t *root = json_object();
        json_object_set_new(root, "format", json_string("safetensors"));
        json_object_set_new(root, "n_shards", json_integer(st_model_n_shards(m)));
        json_t *tensors = json_array();
        for (int64_t i = 0; i < st_model_n_tensors(m); i++) {
            st_tensor_info ti;
            st_model_tensor_info(m, i, &ti);
            json_t *t = json_object();
            json_object_set_new(t, "name", json_bytes(ti.name, strlen(ti.name)));
            json_object_set_new(t, "dtype", json_bytes(ti.dtype, strlen(ti.dtype)));
            json_t *shape = json_array();
            for (int d = 0; d < ti.rank; d++) json_array_append_new(shape, json_integer(ti.shape[d]));
            json_object_set_new(t, "shape", shape);
            const char *slash = strrchr(ti.file, '/');
            json_object_set_new(t, "file", json_bytes(slash ? slash + 1 : ti.file,
                                                      strlen(slash ? slash + 1 : ti.file)));
            json_object_set_new(t, "offset", json_u64(ti.file_offset));
            json_object_set_new(t, "nbytes", json_u64(ti.nbytes));
            json_array_append_new(tensors, t);
        }
        json_object_set_new(root, "tensors", tensors);
        print_json(root);
        putchar('\n');
    } else {
        op_tensor t;
        if (st_model_find(m, tensor, &t)) {
            fprintf(stderr, "fusion-inspect: %s\n", fu_last_error());
            rc = 1;
        } else {
            st_tensor_info ti;
            st_model_tensor_info(m, st_model_find_index(m, tensor), &ti);
            json_t *shape = json_array();
            for (int d = 0; d < ti.rank; d++) json_array_append_new(shape, json_integer(ti.shape[d]));
            rc = print_values(&t, shape, rows);
        }
    }
    st_model_close(m);
    return rc;
}

/* ---- main -------------------------------------------------------------------- */

static bool parse_rows(const char *s, row_range *r) {
    long a, b;
    if (fu_parse_range(s, 0, LONG_MAX, &a, &b)) return false;
    r->start = a;
    r->end = b;
    return true;
}

int main(int argc, char **argv) {
    const char *path = NULL, *tensor = NULL;
    row_range rows = {0, -1};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tensor") == 0 && i + 1 < argc) {
            tensor = argv[++i];
        } else if (strcmp(argv[i], "--rows") == 0 && i + 1 < argc) {
            if (!parse_rows(argv[++i], &rows)) {
                usage();
                return 2;
            }
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage();
            return 0;
        } else if (argv[i][0] != '-' && !path) {
            path = argv[i];
        } else {
            usage();
            return 2;
        }
    }
    if (!path) {
        usage();
        return 2;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fusion-inspect: %s: %s\n", path, strerror(errno));
        return 1;
    }
    bool is_gguf = false;
    if (!S_ISDIR(st.st_mode)) {
        /* only a regular file is read: a FIFO or device would block or never end */
        int fd;
        uint64_t size;
        if (mf_open_regular(path, UINT64_MAX, &fd, &size)) {
            fprintf(stderr, "fusion-inspect: %s\n", fu_last_error());
            return 1;
        }
        char magic[4] = {0};
        is_gguf = read(fd, magic, 4) == 4 && memcmp(magic, "GGUF", 4) == 0;
        close(fd);
        size_t len = strlen(path);
        if (!is_gguf && len >= 5 && strcmp(path + len - 5, ".gguf") == 0) is_gguf = true;
    }
    return is_gguf ? inspect_gguf(path, tensor, rows) : inspect_safetensors(path, tensor, rows);
}
