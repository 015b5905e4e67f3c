/* safetensors.c -- safetensors reader (single files and sharded checkpoints with an index) and writer. */
#include "safetensors.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "atomic-file.h"
#include "mapped-file.h"
#include "status.h"

#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000) /* the safetensors library's own limit */
#define ST_MAX_INDEX ((uint64_t)256 << 20)
#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

/* ---- dtypes -------------------------------------------------------------- */

static const struct {
    const char *name;
    uint32_t size; /* bytes per element */
    int op;        /* op_type, or -1 when fusion cannot compute with it */
} st_dtypes[] = {
    {"F32", 4, OP_TYPE_F32}, {"F16", 2, OP_TYPE_F16},  {"BF16", 2, OP_TYPE_BF16},
    {"F64", 8, -1},          {"I64", 8, -1},           {"U64", 8, -1},
    {"I32", 4, -1},          {"U32", 4, -1},           {"I16", 2, -1},
    {"U16", 2, -1},          {"I8", 1, -1},            {"U8", 1, -1},
    {"BOOL", 1, -1},         {"F8_E4M3", 1, -1},       {"F8_E5M2", 1, -1},
};
#define ST_N_DTYPES ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static int st_dtype_find(const char *name) {
    for (int i = 0; i < ST_N_DTYPES; i++)
        if (strcmp(st_dtypes[i].name, name) == 0) return i;
    return -1;
}

/* ---- model ----------------------------------------------------------------- */

typedef struct st_tensor {
    char *name;          /* owned */
    char *dtype;         /* owned copy of the dtype string */
    int dtype_idx;       /* into st_dtypes, -1 if unknown (size not checked) */
    int shard;           /* index into st_model.shards */
    int rank;
    int64_t *shape;      /* (rank) outermost first, owned; NULL when rank == 0 */
    uint64_t begin, end; /* data_offsets, relative to the shard's data section */
    const uint8_t *data; /* inside the shard's mapping */
} st_tensor;

typedef struct st_shard {
    mf_file mf;
    uint64_t data_start; /* 8 + header length */
} st_shard;

struct st_model {
    char *path;          /* what st_model_open was given; owned */
    st_shard *shards;    /* (n_shards) */
    int n_shards;
    st_tensor *tensors;  /* (n_tensors) sorted by name */
    int64_t n_tensors, cap_tensors;
    bool in_memory;      /* st_model_open_mem: the shard's bytes are the caller's, not a mapping */
};

/* ---- helpers ----------------------------------------------------------------- */

static char *st_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static bool st_is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int st_tensor_cmp(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static const st_tensor *st_lookup(const st_model *m, const char *name) {
    st_tensor key = {.name = (char *)name};
    return m->n_tensors ? bsearch(&key, m->tensors, (size_t)m->n_tensors, sizeof key, st_tensor_cmp)
                        : NULL;
}

static int st_push_tensor(st_model *m, st_tensor **out) {
    if (m->n_tensors == m->cap_tensors) {
        int64_t cap = m->cap_tensors ? m->cap_tensors * 2 : 64;
        st_tensor *p = realloc(m->tensors, (size_t)cap * sizeof *p);
        if (!p) return FU_ERR_NOMEM;
        m->tensors = p;
        m->cap_tensors = cap;
    }
    *out = &m->tensors[m->n_tensors++];
    memset(*out, 0, sizeof **out);
    return FU_OK;
}

/* Reads a non-negative JSON integer. */
static bool st_json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* ---- one shard ------------------------------------------------------------ */

/* Validates one header entry `name` -> `desc` of shard `si` and appends it. */
static int st_parse_entry(st_model *m, int si, const char *name, const json_t *desc,
                          uint64_t data_size) {
    const char *path = m->shards[si].mf.path;
    if (!json_is_object(desc))
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': header entry is not an object", path,
                         name);
    const json_t *jdtype = json_object_get(desc, "dtype");
    const json_t *jshape = json_object_get(desc, "shape");
    const json_t *joffs = json_object_get(desc, "data_offsets");
    if (!json_is_string(jdtype))
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': missing or non-string \"dtype\"", path,
                         name);
    if (!json_is_array(jshape))
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': missing or non-array \"shape\"", path,
                         name);
    if (!json_is_array(joffs) || json_array_size(joffs) != 2)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: tensor '%s': \"data_offsets\" must be an array of 2 integers", path,
                         name);
    uint64_t begin, end;
    if (!st_json_u64(json_array_get(joffs, 0), &begin) ||
        !st_json_u64(json_array_get(joffs, 1), &end))
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: tensor '%s': \"data_offsets\" must be non-negative integers", path,
                         name);
    if (begin > end || end > data_size)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                         ") outside the data section (%" PRIu64 " bytes; file truncated or "
                         "header corrupt)",
                         path, name, begin, end, data_size);

    /* Shape: non-negative integers whose product (zeros counted as 1) fits an int64. */
    size_t rank = json_array_size(jshape);
    uint64_t nelems = 1, span = 1;
    for (size_t d = 0; d < rank; d++) {
        uint64_t v;
        if (!st_json_u64(json_array_get(jshape, d), &v))
            return fu_errorf(FU_ERR_FORMAT,
                             "%s: tensor '%s': shape[%zu] is not a non-negative integer", path,
                             name, d);
        if (mf_mul_u64(span, v ? v : 1, &span) || span > (uint64_t)INT64_MAX)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': shape overflows", path, name);
        nelems *= v;
    }
    const char *dtype = json_string_value(jdtype);
    int di = st_dtype_find(dtype);
    if (di >= 0) {
        uint64_t want, span_bytes;
        if (mf_mul_u64(span, st_dtypes[di].size, &span_bytes) || span_bytes > (uint64_t)INT64_MAX)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': size overflows", path, name);
        want = nelems * st_dtypes[di].size;
        if (end - begin != want)
            return fu_errorf(FU_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets span %" PRIu64
                             " bytes but shape and dtype %s need %" PRIu64,
                             path, name, end - begin, dtype, want);
    }

    st_tensor *t;
    if (st_push_tensor(m, &t)) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    t->name = strdup(name);
    t->dtype = strdup(dtype);
    t->shape = rank ? malloc(rank * sizeof *t->shape) : NULL;
    if (!t->name || !t->dtype || (rank && !t->shape))
        return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    t->dtype_idx = di;
    t->shard = si;
    t->rank = (int)rank;
    for (size_t d = 0; d < rank; d++)
        t->shape[d] = (int64_t)json_integer_value(json_array_get(jshape, d));
    t->begin = begin;
    t->end = end;
    t->data = m->shards[si].mf.data + m->shards[si].data_start + begin;
    return FU_OK;
}

/* Checks that the tensors [first, m->n_tensors) of one shard do not overlap. */
static int st_check_overlap(st_model *m, int64_t first, const char *path) {
    size_t n = (size_t)(m->n_tensors - first);
    if (n < 2) return FU_OK;
    mf_range *r = malloc(n * sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = &m->tensors[first + (int64_t)i];
        r[i] = (mf_range){t->begin, t->end, first + (int64_t)i};
    }
    int64_t a, b;
    int overlap = mf_ranges_overlap(r, n, &a, &b);
    free(r);
    if (overlap)
        return fu_errorf(FU_ERR_FORMAT, "%s: data of tensors '%s' and '%s' overlap", path,
                         m->tensors[a].name, m->tensors[b].name);
    return FU_OK;
}

/* Parses the header of shard number m->n_shards (its bytes in sh->mf, `path`
 * for messages), counts the shard and appends its tensors. */
static int st_parse_shard(st_model *m, const char *path) {
    st_shard *sh = &m->shards[m->n_shards];
    int rc;
    const int si = m->n_shards++;
    const size_t size = sh->mf.size;
    if (size < 8)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: file of %zu bytes is too small to be a safetensors file", path, size);
    uint64_t hlen;
    memcpy(&hlen, sh->mf.data, 8); /* little-endian hosts only, like the rest of fusion */
    if (hlen > size - 8)
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: header length %" PRIu64
                         " runs past end of file (size %zu; truncated or not safetensors)",
                         path, hlen, size);
    if (hlen > ST_MAX_HEADER)
        return fu_errorf(FU_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the limit %" PRIu64,
                         path, hlen, ST_MAX_HEADER);
    if (hlen < 2 || sh->mf.data[8] != '{')
        return fu_errorf(FU_ERR_FORMAT, "%s: header is not a JSON object (not a safetensors file?)",
                         path);
    sh->data_start = 8 + hlen;
    json_error_t jerr;
    json_t *root = json_loadb((const char *)sh->mf.data + 8, (size_t)hlen, JSON_REJECT_DUPLICATES,
                              &jerr);
    if (!root)
        return fu_errorf(FU_ERR_FORMAT, "%s: header JSON invalid at line %d column %d: %s", path,
                         jerr.line, jerr.column, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return fu_errorf(FU_ERR_FORMAT, "%s: header is not a JSON object", path);
    }
    const uint64_t data_size = size - sh->data_start;
    const int64_t first = m->n_tensors;
    const char *name;
    json_t *desc;
    rc = FU_OK;
    json_object_foreach(root, name, desc) {
        if (strcmp(name, "__metadata__") == 0) continue;
        if ((rc = st_parse_entry(m, si, name, desc, data_size))) break;
    }
    json_decref(root);
    if (!rc) rc = st_check_overlap(m, first, path);
    return rc;
}

/* Maps the file `path` as shard number m->n_shards and appends its tensors. */
static int st_open_shard(st_model *m, const char *path) {
    int rc = mf_open(&m->shards[m->n_shards].mf, path);
    return rc ? rc : st_parse_shard(m, path);
}

/* ---- index ------------------------------------------------------------------ */

static int st_str_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Rejects shard names that could leave the checkpoint's directory. */
static int st_check_shard_name(const char *index, const char *tensor, const char *shard) {
    if (!shard[0] || strchr(shard, '/') || strstr(shard, ".."))
        return fu_errorf(FU_ERR_FORMAT,
                         "%s: weight_map entry '%s' names shard '%s': must be a plain file name "
                         "(no '/' or '..')",
                         index, tensor, shard);
    return FU_OK;
}

/* Opens the shards listed by the index at `index` (in directory `dir`) and
 * checks that every weight_map entry is found in the shard it names. */
static int st_open_index(st_model *m, const char *index, const char *dir) {
    mf_file mf;
    int rc = mf_open(&mf, index);
    if (rc) return rc;
    json_t *root = NULL;
    const char **names = NULL;
    if (mf.size == 0) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: empty index file", index);
        goto out;
    }
    if (mf.size > ST_MAX_INDEX) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: index of %zu bytes is too large", index, mf.size);
        goto out;
    }
    json_error_t jerr;
    root = json_loadb((const char *)mf.data, mf.size, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", index,
                       jerr.line, jerr.column, jerr.text);
        goto out;
    }
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: missing or non-object \"weight_map\"", index);
        goto out;
    }
    size_t n = json_object_size(wm);
    if (n == 0) {
        rc = fu_errorf(FU_ERR_NOT_FOUND, "%s: weight_map lists no tensors", index);
        goto out;
    }
    names = malloc(n * sizeof *names);
    if (!names) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", index);
        goto out;
    }
    size_t k = 0;
    const char *tensor;
    json_t *v;
    json_object_foreach(wm, tensor, v) {
        if (!json_is_string(v)) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: weight_map entry '%s' is not a string", index,
                           tensor);
            goto out;
        }
        if ((rc = st_check_shard_name(index, tensor, json_string_value(v)))) goto out;
        names[k++] = json_string_value(v);
    }
    /* Each distinct shard is opened once. */
    qsort(names, n, sizeof *names, st_str_cmp);
    size_t n_unique = 0;
    for (size_t i = 0; i < n; i++)
        if (i == 0 || strcmp(names[i], names[n_unique - 1])) names[n_unique++] = names[i];
    m->shards = calloc(n_unique, sizeof *m->shards);
    if (!m->shards) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", index);
        goto out;
    }
    for (size_t i = 0; i < n_unique; i++) {
        char *p = st_join(dir, names[i]);
        if (!p) {
            rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", index);
            goto out;
        }
        if (!st_is_file(p)) {
            rc = fu_errorf(FU_ERR_NOT_FOUND, "%s: shard '%s' named by the index is missing (%s)",
                           index, names[i], p);
            free(p);
            goto out;
        }
        rc = st_open_shard(m, p);
        free(p);
        if (rc) goto out;
    }
    if (m->n_tensors > 1)
        qsort(m->tensors, (size_t)m->n_tensors, sizeof *m->tensors, st_tensor_cmp);
    for (int64_t i = 1; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i - 1].name, m->tensors[i].name) == 0) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s' is in both %s and %s", index,
                           m->tensors[i].name, m->shards[m->tensors[i - 1].shard].mf.path,
                           m->shards[m->tensors[i].shard].mf.path);
            goto out;
        }
    json_object_foreach(wm, tensor, v) {
        const st_tensor *t = st_lookup(m, tensor);
        const char *want = json_string_value(v);
        if (!t) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: weight_map puts tensor '%s' in shard '%s', "
                           "which has no such tensor", index, tensor, want);
            goto out;
        }
        /* Shard i was opened from names[i]. */
        const char **slot = bsearch(&want, names, n_unique, sizeof *names, st_str_cmp);
        if (!slot || slot - names != t->shard) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: weight_map puts tensor '%s' in shard '%s', but it "
                           "is in %s", index, tensor, want, m->shards[t->shard].mf.path);
            goto out;
        }
    }
    rc = FU_OK;
out:
    free(names);
    json_decref(root);
    mf_close(&mf);
    return rc;
}

/* ---- public API -------------------------------------------------------------- */

int st_model_open(const char *path, st_model **out) {
    *out = NULL;
    st_model *m = calloc(1, sizeof *m);
    char *index = NULL, *single = NULL, *dir = NULL;
    int rc;
    if (!m || !(m->path = strdup(path))) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
        goto err;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        rc = fu_errorf(FU_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        goto err;
    }
    if (S_ISDIR(st.st_mode)) {
        index = st_join(path, ST_INDEX_NAME);
        single = st_join(path, ST_SINGLE_NAME);
        dir = strdup(path);
        if (!index || !single || !dir) {
            rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
            goto err;
        }
        /* like transformers: a single file wins over an index */
        if (st_is_file(single)) {
            goto open_single;
        } else if (st_is_file(index)) {
            rc = st_open_index(m, index, dir);
        } else {
            rc = fu_errorf(FU_ERR_NOT_FOUND,
                           "%s: no " ST_SINGLE_NAME " or " ST_INDEX_NAME " in this directory",
                           path);
        }
        if (rc) goto err;
        goto done;
    }
    size_t len = strlen(path);
    if (len >= 5 && strcmp(path + len - 5, ".json") == 0) {
        dir = strdup(path);
        if (!dir) {
            rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
            goto err;
        }
        char *slash = strrchr(dir, '/');
        if (!slash) {
            dir[0] = '.';
            dir[1] = '\0';
        } else {
            slash[slash == dir ? 1 : 0] = '\0';
        }
        if ((rc = st_open_index(m, path, dir))) goto err;
        goto done;
    }
    single = strdup(path);
    if (!single) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
        goto err;
    }
open_single:
    m->shards = calloc(1, sizeof *m->shards);
    if (!m->shards) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
        goto err;
    }
    if ((rc = st_open_shard(m, single))) goto err;
    if (m->n_tensors > 1)
        qsort(m->tensors, (size_t)m->n_tensors, sizeof *m->tensors, st_tensor_cmp);
done:
    free(index);
    free(single);
    free(dir);
    *out = m;
    return FU_OK;
err:
    free(index);
    free(single);
    free(dir);
    st_model_close(m);
    return rc;
}

int st_model_open_mem(const void *data, size_t size, const char *name, st_model **out) {
    *out = NULL;
    st_model *m = calloc(1, sizeof *m);
    int rc;
    if (!m || !(m->path = strdup(name)) || !(m->shards = calloc(1, sizeof *m->shards)) ||
        !(m->shards[0].mf.path = strdup(name))) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", name);
        goto err;
    }
    m->in_memory = true;
    m->shards[0].mf.data = size ? data : NULL;
    m->shards[0].mf.size = size;
    if ((rc = st_parse_shard(m, name))) goto err;
    if (m->n_tensors > 1)
        qsort(m->tensors, (size_t)m->n_tensors, sizeof *m->tensors, st_tensor_cmp);
    *out = m;
    return FU_OK;
err:
    st_model_close(m);
    return rc;
}

void st_model_release(const st_model *m, const void *p, size_t n) {
    if (!m || m->in_memory) return;
    for (int i = 0; i < m->n_shards; i++) mf_release(&m->shards[i].mf, p, n);
}

void st_model_close(st_model *m) {
    if (!m) return;
    for (int64_t i = 0; i < m->n_tensors; i++) {
        free(m->tensors[i].name);
        free(m->tensors[i].dtype);
        free(m->tensors[i].shape);
    }
    free(m->tensors);
    if (m->in_memory && m->shards) free(m->shards[0].mf.path);
    else
        for (int i = 0; i < m->n_shards; i++) mf_close(&m->shards[i].mf);
    free(m->shards);
    free(m->path);
    free(m);
}

const char *st_model_path(const st_model *m) { return m->path; }

int st_model_n_shards(const st_model *m) { return m->n_shards; }

int64_t st_model_n_tensors(const st_model *m) { return m->n_tensors; }

const char *st_model_tensor_name(const st_model *m, int64_t i) {
    return i >= 0 && i < m->n_tensors ? m->tensors[i].name : NULL;
}

int64_t st_model_find_index(const st_model *m, const char *name) {
    const st_tensor *t = st_lookup(m, name);
    return t ? t - m->tensors : -1;
}

int st_model_tensor_info(const st_model *m, int64_t i, st_tensor_info *out) {
    if (i < 0 || i >= m->n_tensors)
        return fu_errorf(FU_ERR_RANGE, "%s: tensor index %" PRId64 " out of range (%" PRId64 ")",
                         m->path, i, m->n_tensors);
    const st_tensor *t = &m->tensors[i];
    out->name = t->name;
    out->dtype = t->dtype;
    out->rank = t->rank;
    out->shape = t->shape;
    out->file = m->shards[t->shard].mf.path;
    out->file_offset = m->shards[t->shard].data_start + t->begin;
    out->nbytes = t->end - t->begin;
    out->data = t->data;
    return FU_OK;
}

int st_model_find(const st_model *m, const char *name, op_tensor *out) {
    const st_tensor *t = st_lookup(m, name);
    if (!t) return fu_errorf(FU_ERR_NOT_FOUND, "%s: no tensor '%s'", m->path, name);
    const char *file = m->shards[t->shard].mf.path;
    if (t->dtype_idx < 0 || st_dtypes[t->dtype_idx].op < 0)
        return fu_errorf(FU_ERR_UNSUPPORTED,
                         "%s: tensor '%s' has dtype %s, which fusion does not support "
                         "(F32, F16, BF16)",
                         file, name, t->dtype);
    if (t->rank > 4)
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: tensor '%s' has %d dims (at most 4 supported)",
                         file, name, t->rank);
    op_type type = (op_type)st_dtypes[t->dtype_idx].op;
    memset(out, 0, sizeof *out);
    out->type = type;
    out->ndim = t->rank > 0 ? t->rank : 1;
    for (int d = 0; d < 4; d++) out->ne[d] = d < t->rank ? t->shape[t->rank - 1 - d] : 1;
    out->nb[0] = op_type_block_bytes(type);
    out->nb[1] = op_row_bytes(type, out->ne[0]);
    for (int d = 2; d < 4; d++) out->nb[d] = out->nb[d - 1] * (size_t)out->ne[d - 1];
    out->data = (void *)t->data; /* read-only mapping: callers must not write */
    out->name = t->name;
    return FU_OK;
}

/* ---- writing ------------------------------------------------------------------ */

/* Checks one tensor to write and returns its size in bytes in *nbytes. */
static int st_write_check(const st_write_tensor *t, uint64_t *nbytes) {
    if (!t->name || !*t->name) return fu_errorf(FU_ERR_INVALID, "safetensors: a tensor has no name");
    int di = t->dtype ? st_dtype_find(t->dtype) : -1;
    if (di < 0)
        return fu_errorf(FU_ERR_INVALID, "safetensors: tensor '%s': unknown dtype '%s'", t->name,
                         t->dtype ? t->dtype : "(null)");
    if (t->rank < 0 || t->rank > 8)
        return fu_errorf(FU_ERR_INVALID, "safetensors: tensor '%s': rank %d (0..8 supported)",
                         t->name, t->rank);
    uint64_t n = st_dtypes[di].size;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] < 0 || mf_mul_u64(n, (uint64_t)t->shape[d], &n))
            return fu_errorf(FU_ERR_INVALID, "safetensors: tensor '%s': bad shape[%d] = %" PRId64,
                             t->name, d, t->shape[d]);
    }
    *nbytes = n;
    return FU_OK;
}

/* Adds the header entry of tensor t at data offsets [*off, *off + nbytes). */
static int st_write_entry(json_t *hdr, const st_write_tensor *t, uint64_t *off) {
    uint64_t nbytes;
    int rc = st_write_check(t, &nbytes);
    if (rc) return rc;
    if (json_object_get(hdr, t->name))
        return fu_errorf(FU_ERR_INVALID, "safetensors: tensor '%s' given twice", t->name);
    json_t *shape = json_array();
    for (int d = 0; shape && d < t->rank; d++)
        json_array_append_new(shape, json_integer(t->shape[d]));
    json_t *e = json_pack("{s:s,s:o,s:[I,I]}", "dtype", t->dtype, "shape", shape, "data_offsets",
                          (json_int_t)*off, (json_int_t)(*off + nbytes));
    if (!e || json_object_set_new(hdr, t->name, e))
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *off += nbytes;
    return FU_OK;
}

/* The header JSON of the tensors, padded with spaces to a multiple of 8 (malloc'd). */
static int st_write_header(const st_write_tensor *tensors, size_t n, char **out, size_t *len) {
    json_t *hdr = json_pack("{s:{s:s}}", "__metadata__", "format", "pt");
    if (!hdr) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    uint64_t off = 0;
    int rc = FU_OK;
    for (size_t i = 0; i < n && rc == FU_OK; i++) rc = st_write_entry(hdr, &tensors[i], &off);
    char *text = rc == FU_OK ? json_dumps(hdr, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(hdr);
    if (rc) return rc;
    if (!text) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    size_t tl = strlen(text), padded = (tl + 7) / 8 * 8;
    *out = realloc(text, padded + 1);
    if (!*out) {
        free(text);
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    memset(*out + tl, ' ', padded - tl);
    (*out)[padded] = '\0';
    *len = padded;
    return FU_OK;
}

int st_write(const char *path, const st_write_tensor *tensors, size_t n) {
    char *hdr = NULL;
    size_t hlen = 0;
    int rc = st_write_header(tensors, n, &hdr, &hlen);
    if (rc) return rc;
    af_piece *pieces = malloc((n + 2) * sizeof *pieces);
    if (!pieces) {
        free(hdr);
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    pieces[0] = (af_piece){le, 8};
    pieces[1] = (af_piece){hdr, hlen};
    for (size_t i = 0; i < n; i++) {
        uint64_t nbytes = 0;
        st_write_check(&tensors[i], &nbytes); /* checked by st_write_header */
        pieces[i + 2] = (af_piece){tensors[i].data, (size_t)nbytes};
    }
    rc = af_write(path, pieces, n + 2);
    free(pieces);
    free(hdr);
    return rc;
}
