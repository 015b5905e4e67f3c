/* tok-hf.c -- loads a tokenizer from Hugging Face tokenizer.json (+ tokenizer_config.json). */
#include "tok-impl.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"
#include "mapped-file.h"
#include "status.h"

/* Largest tokenizer.json or side file read. */
#define TOK_JSON_MAX ((size_t)256 << 20)

/* ---- JSON helpers ---------------------------------------------------------------------- */

/* The string member `key` of obj (NULL if absent or not a string). */
static const char *jstr(const json_t *obj, const char *key, size_t *len) {
    const json_t *v = json_object_get(obj, key);
    if (len) *len = 0;
    if (!json_is_string(v)) return NULL;
    if (len) *len = json_string_length(v);
    return json_string_value(v);
}

static bool jbool(const json_t *obj, const char *key, bool dflt) {
    const json_t *v = json_object_get(obj, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

/* A special-token entry of tokenizer_config.json: "text" or {"content": "text"}. */
static const char *jtoken(const json_t *obj, const char *key) {
    const json_t *v = json_object_get(obj, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Parses `len` bytes of JSON text (NULs allowed inside strings) into *out, a
 * JSON object; FU_ERR_FORMAT names `name`, line and column. */
static int parse_json(const char *text, size_t len, const char *name, size_t flags, json_t **out) {
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_ALLOW_NUL | flags, &jerr);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s:%d:%d: %s", name, jerr.line, jerr.column, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return fu_errorf(FU_ERR_FORMAT, "%s: top level is not a JSON object", name);
    }
    *out = root;
    return FU_OK;
}

/* Loads a JSON file (a regular file: never waits on a FIFO or device).
 * FU_ERR_NOT_FOUND if it does not exist (when `optional`, *out = NULL and
 * FU_OK), FU_ERR_IO if it is not a readable regular file, FU_ERR_FORMAT
 * naming file, line and column.
 * `flags`: extra jansson decoding flags (JSON_DECODE_INT_AS_REAL for configs,
 * whose model_max_length can exceed 64 bits). */
static int load_json(const char *path, bool optional, size_t flags, json_t **out) {
    *out = NULL;
    char *text;
    size_t len;
    int rc = mf_read(path, TOK_JSON_MAX, &text, &len);
    if (rc == FU_ERR_NOT_FOUND && optional) return FU_OK;
    if (rc) return rc;
    rc = parse_json(text, len, path, flags, out);
    free(text);
    return rc;
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* ---- model -------------------------------------------------------------------------------- */

static int get_id(const json_t *v, const char *what, int32_t *id) {
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 24))
        return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: %s: id missing or out of range", what);
    *id = (int32_t)json_integer_value(v);
    return FU_OK;
}

static int load_vocab(const json_t *root, const json_t *model, tok_tokenizer **out) {
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(vocab)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: model.vocab is not an object");
    if (added && !json_is_null(added) && !json_is_array(added))
        return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: added_tokens is not an array");
    int32_t max_id = -1, id = -1;
    int rc;
    for (void *it = json_object_iter((json_t *)vocab); it; it = json_object_iter_next((json_t *)vocab, it)) {
        if ((rc = get_id(json_object_iter_value(it), "model.vocab", &id))) return rc;
        if (id > max_id) max_id = id;
    }
    size_t i;
    const json_t *a;
    json_array_foreach(added, i, a) {
        if (!json_is_object(a) || !jstr(a, "content", NULL))
            return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: added_tokens[%zu] has no content", i);
        if ((rc = get_id(json_object_get(a, "id"), "added_tokens", &id))) return rc;
        if (id > max_id) max_id = id;
    }
    if (max_id < 0) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: empty vocabulary");
    tok_tokenizer *t;
    if ((rc = tok__new(max_id + 1, &t))) return rc;
    for (void *it = json_object_iter((json_t *)vocab); it; it = json_object_iter_next((json_t *)vocab, it)) {
        get_id(json_object_iter_value(it), "model.vocab", &id);
        if ((rc = tok__set_token(t, id, json_object_iter_key(it), json_object_iter_key_len(it), TOK_F_MODEL)))
            goto err;
    }
    json_array_foreach(added, i, a) {
        size_t len = 0;
        const char *content = jstr(a, "content", &len);
        get_id(json_object_get(a, "id"), "added_tokens", &id);
        if (t->flags[id] & TOK_F_PRESENT &&
            (t->text_len[id] != len || memcmp(t->text[id], content, len) != 0)) {
            rc = fu_errorf(FU_ERR_FORMAT, "tokenizer.json: added token '%s' has id %d of '%s'",
                           content, (int)id, t->text[id]);
            goto err;
        }
        if ((rc = tok__set_token(t, id, content, len, 0))) goto err;
    }
    if ((rc = tok__build_vocab(t))) goto err;
    json_array_foreach(added, i, a) {
        tok_added ta = {0};
        ta.content = (char *)jstr(a, "content", &ta.len);
        get_id(json_object_get(a, "id"), "added_tokens", &ta.id);
        ta.special = jbool(a, "special", false);
        ta.lstrip = jbool(a, "lstrip", false);
        ta.rstrip = jbool(a, "rstrip", false);
        ta.single_word = jbool(a, "single_word", false);
        ta.normalized = jbool(a, "normalized", !ta.special);
        if ((rc = tok__add_added(t, &ta))) goto err;
    }
    *out = t;
    return FU_OK;
err:
    tok_free(t);
    return rc;
}

static int load_merges(tok_tokenizer *t, const json_t *model) {
    const json_t *merges = json_object_get(model, "merges");
    if (!merges || json_is_null(merges)) return FU_OK;
    if (!json_is_array(merges)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: model.merges is not an array");
    size_t i;
    const json_t *m;
    int rc;
    json_array_foreach(merges, i, m) {
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(m)) { /* "a b" */
            const char *s = json_string_value(m);
            size_t n = json_string_length(m);
            const char *sp = memchr(s, ' ', n);
            if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
                return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: merge %zu ('%.*s') is not two tokens separated by one space",
                                 i, (int)(n > 64 ? 64 : n), s);
            a = s;
            alen = (size_t)(sp - s);
            b = sp + 1;
            blen = n - alen - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            alen = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            blen = json_string_length(json_array_get(m, 1));
        } else {
            return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: merge %zu is neither \"a b\" nor [a, b]", i);
        }
        if (i > INT32_MAX) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: too many merges");
        if ((rc = tok__add_merge(t, a, alen, b, blen, (int32_t)i))) return rc;
    }
    return FU_OK;
}

/* ---- normalizer / pre-tokenizer / decoder ------------------------------------------------- */

static int unsupported(const char *what, const json_t *node) {
    const char *type = jstr(node, "type", NULL);
    return fu_errorf(FU_ERR_UNSUPPORTED, "tokenizer.json: %s type '%s' is not supported", what,
                     type ? type : "(missing)");
}

static int load_normalizer(tok_tokenizer *t, const json_t *n, int depth) {
    if (!n || json_is_null(n)) return FU_OK;
    if (!json_is_object(n) || depth > 8) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: bad normalizer");
    const char *type = jstr(n, "type", NULL);
    if (!type) return unsupported("normalizer", n);
    if (!strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: normalizer Sequence without a list");
        size_t i;
        const json_t *c;
        json_array_foreach(list, i, c) {
            int rc = load_normalizer(t, c, depth + 1);
            if (rc) return rc;
        }
        return FU_OK;
    }
    if (!strcmp(type, "NFC")) return tok__add_norm(t, TOK_NORM_NFC, NULL, 0, NULL, 0, 0);
    if (!strcmp(type, "NFD")) return tok__add_norm(t, TOK_NORM_NFD, NULL, 0, NULL, 0, 0);
    if (!strcmp(type, "NFKC")) return tok__add_norm(t, TOK_NORM_NFKC, NULL, 0, NULL, 0, 0);
    if (!strcmp(type, "NFKD")) return tok__add_norm(t, TOK_NORM_NFKD, NULL, 0, NULL, 0, 0);
    if (!strcmp(type, "Lowercase")) return tok__add_norm(t, TOK_NORM_LOWERCASE, NULL, 0, NULL, 0, 0);
    if (!strcmp(type, "Strip"))
        return tok__add_norm(t, TOK_NORM_STRIP, NULL, 0, NULL, 0,
                             (jbool(n, "strip_left", true) ? 1 : 0) | (jbool(n, "strip_right", true) ? 2 : 0));
    if (!strcmp(type, "Prepend")) {
        size_t len;
        const char *p = jstr(n, "prepend", &len);
        if (!p) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: Prepend normalizer without 'prepend'");
        return tok__add_norm(t, TOK_NORM_PREPEND, p, len, NULL, 0, 0);
    }
    if (!strcmp(type, "Replace")) {
        size_t alen = 0, blen = 0;
        const char *a = jstr(json_object_get(n, "pattern"), "String", &alen);
        const char *b = jstr(n, "content", &blen);
        if (!a || !b) {
            if (jstr(json_object_get(n, "pattern"), "Regex", NULL))
                return fu_errorf(FU_ERR_UNSUPPORTED, "tokenizer.json: Replace normalizer with a Regex pattern is not supported");
            return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: Replace normalizer needs pattern.String and content");
        }
        return tok__add_norm(t, TOK_NORM_REPLACE, a, alen, b, blen, 0);
    }
    return unsupported("normalizer", n);
}

static int parse_behavior(const char *s, tok_split_behavior *out) {
    static const struct {
        const char *name;
        tok_split_behavior b;
    } map[] = {{"Isolated", TOK_SPLIT_ISOLATED}, {"Removed", TOK_SPLIT_REMOVED},
               {"MergedWithPrevious", TOK_SPLIT_MERGED_PREV}, {"MergedWithNext", TOK_SPLIT_MERGED_NEXT},
               {"Contiguous", TOK_SPLIT_CONTIGUOUS}};
    for (size_t i = 0; s && i < sizeof map / sizeof *map; i++)
        if (!strcmp(s, map[i].name)) {
            *out = map[i].b;
            return FU_OK;
        }
    return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: unknown split behavior '%s'", s ? s : "(missing)");
}

/* Metaspace settings shared by the pre-tokenizer and the decoder: replacement and prepend scheme. */
static int metaspace_cfg(const json_t *n, tok_pre *p) {
    size_t len;
    const char *r = jstr(n, "replacement", &len);
    if (!r) r = "\xe2\x96\x81", len = 3;
    if (len == 0 || len >= sizeof p->repl) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: bad Metaspace replacement");
    memcpy(p->repl, r, len);
    p->repl[len] = '\0';
    p->repl_len = len;
    const char *scheme = jstr(n, "prepend_scheme", NULL);
    if (scheme) {
        if (!strcmp(scheme, "always")) p->prepend_scheme = 2;
        else if (!strcmp(scheme, "first")) p->prepend_scheme = 1;
        else if (!strcmp(scheme, "never")) p->prepend_scheme = 0;
        else return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: unknown Metaspace prepend_scheme '%s'", scheme);
    } else {
        p->prepend_scheme = jbool(n, "add_prefix_space", true) ? 2 : 0;
    }
    p->split = jbool(n, "split", true);
    return FU_OK;
}

static int load_pre(tok_tokenizer *t, const json_t *n, int depth) {
    if (!n || json_is_null(n)) return FU_OK;
    if (!json_is_object(n) || depth > 8) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: bad pre_tokenizer");
    const char *type = jstr(n, "type", NULL);
    int rc;
    if (!type) return unsupported("pre_tokenizer", n);
    if (!strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(n, "pretokenizers");
        if (!json_is_array(list)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: pre_tokenizer Sequence without a list");
        size_t i;
        const json_t *c;
        json_array_foreach(list, i, c) if ((rc = load_pre(t, c, depth + 1))) return rc;
        return FU_OK;
    }
    if (!strcmp(type, "Split")) {
        const json_t *pat = json_object_get(n, "pattern");
        size_t len;
        const char *re = jstr(pat, "Regex", &len);
        bool literal = false;
        if (!re) {
            re = jstr(pat, "String", &len);
            literal = true;
        }
        if (!re) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: Split pre-tokenizer without a pattern");
        tok_split_behavior b = TOK_SPLIT_ISOLATED;
        if ((rc = parse_behavior(jstr(n, "behavior", NULL), &b))) return rc;
        return tok__add_split(t, re, len, literal, b, jbool(n, "invert", false));
    }
    if (!strcmp(type, "ByteLevel")) {
        if (jbool(n, "add_prefix_space", true)) {
            tok_pre p = {.kind = TOK_PRE_PREFIX_SPACE};
            if ((rc = tok__add_pre(t, &p))) return rc;
        }
        if (jbool(n, "use_regex", true) &&
            (rc = tok__add_split(t, tok__gpt2_pattern, strlen(tok__gpt2_pattern), false, TOK_SPLIT_ISOLATED, false)))
            return rc;
        tok_pre p = {.kind = TOK_PRE_BYTELEVEL};
        t->kind_name = "bpe-bytelevel";
        return tok__add_pre(t, &p);
    }
    if (!strcmp(type, "Digits")) {
        bool ind = jbool(n, "individual_digits", false);
        const char *re = ind ? "\\p{N}" : "\\p{N}+";
        return tok__add_split(t, re, strlen(re), false, TOK_SPLIT_ISOLATED, false);
    }
    if (!strcmp(type, "Metaspace")) {
        tok_pre p = {.kind = TOK_PRE_METASPACE};
        if ((rc = metaspace_cfg(n, &p))) return rc;
        return tok__add_pre(t, &p);
    }
    if (!strcmp(type, "WhitespaceSplit")) {
        const char *re = "\\s+";
        return tok__add_split(t, re, strlen(re), false, TOK_SPLIT_REMOVED, false);
    }
    if (!strcmp(type, "Whitespace")) {
        const char *re = "\\w+|[^\\w\\s]+";
        return tok__add_split(t, re, strlen(re), false, TOK_SPLIT_REMOVED, true);
    }
    return unsupported("pre_tokenizer", n);
}

static int load_decoder(tok_tokenizer *t, const json_t *n, int depth, bool *fused) {
    if (!n || json_is_null(n)) {
        if (depth == 0) t->dec_join_space = true;
        return FU_OK;
    }
    if (!json_is_object(n) || depth > 8) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: bad decoder");
    const char *type = jstr(n, "type", NULL);
    int rc;
    if (!type) return unsupported("decoder", n);
    if (!strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(n, "decoders");
        if (!json_is_array(list)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: decoder Sequence without a list");
        size_t i;
        const json_t *c;
        json_array_foreach(list, i, c) if ((rc = load_decoder(t, c, depth + 1, fused))) return rc;
        return FU_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        tok_dec d = {.kind = TOK_DEC_BYTELEVEL};
        return tok__add_dec(t, &d);
    }
    if (!strcmp(type, "ByteFallback")) {
        tok_dec d = {.kind = TOK_DEC_BYTEFALLBACK};
        return tok__add_dec(t, &d);
    }
    if (!strcmp(type, "Fuse")) {
        *fused = true;
        return FU_OK;
    }
    if (!strcmp(type, "Replace")) {
        tok_dec d = {.kind = TOK_DEC_REPLACE};
        d.a = (char *)jstr(json_object_get(n, "pattern"), "String", &d.alen);
        d.b = (char *)jstr(n, "content", &d.blen);
        if (!d.a || !d.b) return fu_errorf(FU_ERR_UNSUPPORTED, "tokenizer.json: Replace decoder needs pattern.String and content");
        return tok__add_dec(t, &d);
    }
    if (!strcmp(type, "Strip")) {
        size_t len;
        const char *c = jstr(n, "content", &len);
        const json_t *js = json_object_get(n, "start"), *je = json_object_get(n, "stop");
        int start = json_is_integer(js) ? (int)json_integer_value(js) : 0;
        int stop = json_is_integer(je) ? (int)json_integer_value(je) : 0;
        if (!c || len != 1 || start < 0 || stop < 0 || start > 64 || stop > 64)
            return fu_errorf(FU_ERR_UNSUPPORTED, "tokenizer.json: Strip decoder needs a one-byte content and small start/stop");
        if (*fused) { /* strips the start of the whole text; the end cannot be streamed */
            if (c[0] != ' ' || stop)
                return fu_errorf(FU_ERR_UNSUPPORTED, "tokenizer.json: Strip decoder after Fuse only supports leading spaces");
            t->dec_strip += start;
            return FU_OK;
        }
        tok_dec d = {.kind = TOK_DEC_STRIP, .start = start, .stop = stop, .ch = c[0]};
        return tok__add_dec(t, &d);
    }
    if (!strcmp(type, "Metaspace")) {
        tok_pre p = {0};
        if ((rc = metaspace_cfg(n, &p))) return rc;
        tok_dec d = {.kind = TOK_DEC_REPLACE, .a = p.repl, .alen = p.repl_len, .b = " ", .blen = 1};
        if ((rc = tok__add_dec(t, &d))) return rc;
        if (p.prepend_scheme != 0) t->dec_strip = 1;
        return FU_OK;
    }
    return unsupported("decoder", n);
}

/* ---- post-processor: what encode(add_special) puts around a sequence ----------------------- */

static int ids_push(int32_t **v, size_t *n, int32_t id) {
    int32_t *nv = realloc(*v, (*n + 1) * sizeof *nv);
    if (!nv) return fu_errorf(FU_ERR_NOMEM, "tokenizer post-processor");
    *v = nv;
    nv[(*n)++] = id;
    return FU_OK;
}

static int load_post(tok_tokenizer *t, const json_t *n, int depth) {
    if (!n || json_is_null(n)) return FU_OK;
    if (!json_is_object(n) || depth > 8) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: bad post_processor");
    const char *type = jstr(n, "type", NULL);
    int rc;
    if (!type) return unsupported("post_processor", n);
    if (!strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(n, "processors");
        size_t i;
        const json_t *c;
        json_array_foreach(list, i, c) if ((rc = load_post(t, c, depth + 1))) return rc;
        return FU_OK;
    }
    if (!strcmp(type, "ByteLevel")) return FU_OK; /* offsets only */
    if (!strcmp(type, "TemplateProcessing")) {
        const json_t *single = json_object_get(n, "single"), *specials = json_object_get(n, "special_tokens");
        if (!json_is_array(single)) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: TemplateProcessing without 'single'");
        bool after = false;
        size_t i;
        const json_t *piece;
        json_array_foreach(single, i, piece) {
            if (json_object_get(piece, "Sequence")) {
                after = true;
                continue;
            }
            const char *name = jstr(json_object_get(piece, "SpecialToken"), "id", NULL);
            if (!name) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: TemplateProcessing piece %zu", i);
            const json_t *ids = json_object_get(json_object_get(specials, name), "ids");
            if (!json_is_array(ids))
                return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: TemplateProcessing special '%s' has no ids", name);
            size_t k;
            const json_t *idv;
            json_array_foreach(ids, k, idv) {
                int32_t id = -1;
                if ((rc = get_id(idv, "TemplateProcessing", &id))) return rc;
                if (id >= t->n_vocab) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: TemplateProcessing id %d out of range", (int)id);
                if ((rc = after ? ids_push(&t->suffix_ids, &t->n_suffix, id) : ids_push(&t->prefix_ids, &t->n_prefix, id)))
                    return rc;
            }
        }
        return FU_OK;
    }
    if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
        const json_t *cls = json_object_get(n, "cls"), *sep = json_object_get(n, "sep");
        int32_t c = 0, s = 0;
        if ((rc = get_id(json_array_get(cls, 1), "cls", &c)) || (rc = get_id(json_array_get(sep, 1), "sep", &s))) return rc;
        if (c >= t->n_vocab || s >= t->n_vocab) return fu_errorf(FU_ERR_FORMAT, "tokenizer.json: cls/sep out of range");
        if ((rc = ids_push(&t->prefix_ids, &t->n_prefix, c))) return rc;
        return ids_push(&t->suffix_ids, &t->n_suffix, s);
    }
    return unsupported("post_processor", n);
}

/* ---- tokenizer_config.json & friends --------------------------------------------------------- */

/* Replaces *out with a copy of s (when s is not NULL). */
static int dup_opt(const char *s, char **out) {
    if (!s) return FU_OK;
    free(*out);
    *out = strdup(s);
    return *out ? FU_OK : fu_errorf(FU_ERR_NOMEM, "tokenizer config");
}

/* Reads an optional text file (chat_template.jinja): *out = NULL when absent. */
static int read_text_file(const char *path, char **out) {
    size_t len;
    int rc = mf_read(path, TOK_JSON_MAX, out, &len);
    return rc == FU_ERR_NOT_FOUND ? FU_OK : rc;
}

static int load_config(tok_tokenizer *t, const char *dir) {
    int rc;
    char *path = path_join(dir, "tokenizer_config.json");
    if (!path) return fu_errorf(FU_ERR_NOMEM, "tokenizer config");
    json_t *cfg;
    rc = load_json(path, true, JSON_DECODE_INT_AS_REAL, &cfg);
    free(path);
    if (rc) return rc;

    const char *bos = cfg ? jtoken(cfg, "bos_token") : NULL;
    const char *eos = cfg ? jtoken(cfg, "eos_token") : NULL;
    const char *unk = cfg ? jtoken(cfg, "unk_token") : NULL;
    const char *pad = cfg ? jtoken(cfg, "pad_token") : NULL;
    if ((rc = dup_opt(bos, &t->bos_str)) || (rc = dup_opt(eos, &t->eos_str)) ||
        (rc = dup_opt(unk, &t->unk_str)) || (rc = dup_opt(pad, &t->pad_str)))
        goto out;
    if (bos) t->bos_id = tok__lookup(t, bos, strlen(bos), false);
    if (eos) t->eos_id = tok__lookup(t, eos, strlen(eos), false);
    if (pad) t->pad_id = tok__lookup(t, pad, strlen(pad), false);
    if (t->bos_id < 0 && t->n_prefix > 0) { /* the template's first special is the BOS */
        t->bos_id = t->prefix_ids[0];
        if (!t->bos_str && (rc = dup_opt(t->text[t->bos_id], &t->bos_str))) goto out;
    }
    if (cfg) {
        const json_t *ab = json_object_get(cfg, "add_bos_token"), *ae = json_object_get(cfg, "add_eos_token");
        if (json_is_boolean(ab) || json_is_boolean(ae)) {
            /* as transformers' LlamaTokenizerFast.update_post_processor */
            t->n_prefix = t->n_suffix = 0;
            if (json_is_true(ab) && t->bos_id >= 0 && (rc = ids_push(&t->prefix_ids, &t->n_prefix, t->bos_id)))
                goto out;
            if (json_is_true(ae) && t->eos_id >= 0 && (rc = ids_push(&t->suffix_ids, &t->n_suffix, t->eos_id)))
                goto out;
        }
        const json_t *ct = json_object_get(cfg, "chat_template");
        if (json_is_array(ct)) { /* [{name, template}, ...]: "default", else the first */
            const json_t *pick = NULL, *e;
            size_t i;
            json_array_foreach(ct, i, e) {
                const char *name = jstr(e, "name", NULL);
                if (!pick || (name && !strcmp(name, "default"))) pick = e;
            }
            ct = pick ? json_object_get(pick, "template") : NULL;
        }
        if (json_is_string(ct) && (rc = dup_opt(json_string_value(ct), &t->chat_template))) goto out;
    }
    for (size_t i = 0; i < t->n_prefix; i++) t->add_bos |= t->prefix_ids[i] == t->bos_id;
    for (size_t i = 0; i < t->n_suffix; i++) t->add_eos |= t->suffix_ids[i] == t->eos_id;

    if (!t->chat_template) {
        char *p = path_join(dir, "chat_template.jinja");
        if (!p) {
            rc = fu_errorf(FU_ERR_NOMEM, "tokenizer config");
            goto out;
        }
        rc = read_text_file(p, &t->chat_template);
        free(p);
        if (rc) goto out;
    }

    /* generation_config.json: extra end-of-generation ids */
    char *gp = path_join(dir, "generation_config.json");
    if (!gp) {
        rc = fu_errorf(FU_ERR_NOMEM, "tokenizer config");
        goto out;
    }
    json_t *gen;
    rc = load_json(gp, true, JSON_DECODE_INT_AS_REAL, &gen);
    free(gp);
    if (rc) {
        FU_WARN("tokenizer: ignoring generation_config.json: %s", fu_last_error());
        rc = FU_OK;
    } else if (gen) {
        const json_t *e = json_object_get(gen, "eos_token_id");
        /* numbers come back as reals (JSON_DECODE_INT_AS_REAL) */
        if (json_is_number(e)) {
            double x = json_number_value(e);
            if (x >= 0 && x < t->n_vocab) rc = tok__add_eog(t, (int32_t)x);
        } else if (json_is_array(e)) {
            size_t i;
            const json_t *v;
            json_array_foreach(e, i, v) {
                double x = json_number_value(v);
                if (json_is_number(v) && x >= 0 && x < t->n_vocab && !rc) rc = tok__add_eog(t, (int32_t)x);
            }
        }
        json_decref(gen);
    }
out:
    json_decref(cfg);
    return rc;
}

/* ---- entry point ------------------------------------------------------------------------------- */

/* Builds a tokenizer from a parsed tokenizer.json (`file` names it in
 * messages); `dir` (NULL: none) holds the side files read by load_config. */
static int load_root(const json_t *root, const char *file, const char *dir, tok_tokenizer **out) {
    tok_tokenizer *t = NULL;
    int rc;
    const json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: no 'model' object", file);
        goto done;
    }
    const char *type = jstr(model, "type", NULL);
    if (type ? strcmp(type, "BPE") != 0 : !json_object_get(model, "merges")) {
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: tokenizer model type '%s' is not supported (only BPE)", file,
                       type ? type : "(missing)");
        goto done;
    }
    size_t plen;
    const char *pfx = jstr(model, "continuing_subword_prefix", &plen);
    const char *sfx = jstr(model, "end_of_word_suffix", NULL);
    if ((pfx && plen) || (sfx && *sfx)) {
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: BPE continuing_subword_prefix / end_of_word_suffix are not supported", file);
        goto done;
    }
    if ((rc = load_vocab(root, model, &t))) goto done;
    t->algo = TOK_ALGO_BPE;
    t->kind_name = "bpe-spm";
    t->byte_fallback = jbool(model, "byte_fallback", false);
    t->fuse_unk = jbool(model, "fuse_unk", false);
    t->ignore_merges = jbool(model, "ignore_merges", false);
    const char *unk = jstr(model, "unk_token", NULL);
    if (unk) {
        t->unk_id = t->model_unk = tok__lookup(t, unk, strlen(unk), true);
        if (t->unk_id < 0) FU_WARN("tokenizer: unk_token '%s' is not in the vocabulary", unk);
        if (!t->unk_str && (rc = dup_opt(unk, &t->unk_str))) goto done;
    }
    if ((rc = load_merges(t, model))) goto done;
    if ((rc = load_normalizer(t, json_object_get(root, "normalizer"), 0))) goto done;
    if ((rc = load_pre(t, json_object_get(root, "pre_tokenizer"), 0))) goto done;
    bool fused = false;
    if ((rc = load_decoder(t, json_object_get(root, "decoder"), 0, &fused))) goto done;
    if ((rc = load_post(t, json_object_get(root, "post_processor"), 0))) goto done;
    if (dir && (rc = load_config(t, dir))) goto done;
    if ((rc = tok__finalize(t))) goto done;
    FU_DEBUG("tokenizer: %s: %d tokens, %zu merges, %zu added, %s", file, (int)t->n_vocab,
             t->merges.n, t->n_added, t->kind_name);
    *out = t;
    t = NULL;
done:
    tok_free(t);
    return rc;
}

int tok_load_hf(const char *path, tok_tokenizer **out) {
    if (!out) return fu_errorf(FU_ERR_INVALID, "tok_load_hf: no output");
    *out = NULL;
    if (!path) return fu_errorf(FU_ERR_INVALID, "tok_load_hf: no path");
    struct stat st;
    if (stat(path, &st) != 0)
        return fu_errorf(errno == ENOENT ? FU_ERR_NOT_FOUND : FU_ERR_IO, "%s: %s", path, strerror(errno));
    char *file, *dir;
    if (S_ISDIR(st.st_mode)) {
        dir = strdup(path);
        file = path_join(path, "tokenizer.json");
    } else {
        file = strdup(path);
        const char *slash = strrchr(path, '/');
        dir = slash ? tok__strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    }
    json_t *root = NULL;
    int rc;
    if (!file || !dir) rc = fu_errorf(FU_ERR_NOMEM, "tok_load_hf");
    else if (!(rc = load_json(file, false, 0, &root))) rc = load_root(root, file, dir, out);
    if (rc && file && dir && fu_last_error()[0] && strstr(fu_last_error(), dir) == NULL) {
        /* prefix the file name to messages that name no file of this directory */
        char msg[768];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        fu_errorf(rc, "%s: %s", file, msg);
    }
    json_decref(root);
    free(file);
    free(dir);
    return rc;
}

int tok_load_hf_mem(const char *json, size_t len, tok_tokenizer **out) {
    if (!out) return fu_errorf(FU_ERR_INVALID, "tok_load_hf_mem: no output");
    *out = NULL;
    json_t *root;
    int rc = parse_json(json, len, "tokenizer.json", 0, &root);
    if (!rc) rc = load_root(root, "tokenizer.json", NULL, out);
    json_decref(root);
    return rc;
}
