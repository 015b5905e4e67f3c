/* tok-encode.c -- text -> ids: added tokens, normalizer, pre-tokenizer, BPE or SentencePiece merges. */
#include "tok-impl.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "status.h"

/* ---- per-call state ------------------------------------------------------------- */

typedef struct tok_piece {
    const char *s;
    size_t len;
    bool origin; /* starts at offset 0 of the input (Metaspace prepend_scheme "first") */
} tok_piece;

typedef struct tok_pvec {
    tok_piece *v;
    size_t n, cap;
} tok_pvec;

typedef struct tok_range {
    size_t s, e;
    bool match;
} tok_range;

typedef struct tok_block {
    struct tok_block *next;
    size_t used, cap;
    char data[];
} tok_block;

typedef struct bpe_sym {
    int32_t id, prev, next, len; /* len 0: merged into its left neighbour */
} bpe_sym;

typedef struct bpe_cand {
    int32_t rank, pos, result;
} bpe_cand;

typedef struct spm_sym {
    int32_t start, n, prev, next;
} spm_sym;

typedef struct spm_cand {
    float score;
    int32_t left, right, size;
} spm_cand;

typedef struct tok_enc {
    const tok_tokenizer *t;
    bool parse_special;
    const tok_span *plain; /* ranges of base where special tokens are text */
    size_t n_plain;
    const char *base; /* the (repaired) text being encoded */
    bool frag_plain;  /* the fragment being normalized overlaps a plain range */
    int32_t *out;
    size_t n_out, cap_out;
    tok_block *arena;
    tok_pvec pv[2];
    tok_range *rg;
    size_t n_rg, cap_rg;
    pcre2_match_data **md; /* [t->n_pre], created on first use */
    void *sym;             /* bpe_sym[] or spm_sym[] */
    size_t cap_sym;
    void *heap; /* bpe_cand[] or spm_cand[] */
    size_t n_heap, cap_heap;
} tok_enc;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return FU_OK;
    size_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, nc * elem);
    if (!np) return fu_errorf(FU_ERR_NOMEM, "tokenizer: encode buffers");
    *p = np;
    *cap = nc;
    return FU_OK;
}

static int out_push(tok_enc *e, int32_t id) {
    if (e->n_out == e->cap_out) {
        int rc = grow((void **)&e->out, &e->cap_out, e->n_out + 1, sizeof *e->out);
        if (rc) return rc;
    }
    e->out[e->n_out++] = id;
    return FU_OK;
}

static char *arena_alloc(tok_enc *e, size_t n) {
    tok_block *b = e->arena;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 60000 ? n : 60000;
        tok_block *nb = malloc(sizeof *nb + cap);
        if (!nb) return NULL;
        nb->next = b;
        nb->used = 0;
        nb->cap = cap;
        e->arena = b = nb;
    }
    char *p = b->data + b->used;
    b->used += n;
    return p;
}

static int pv_push(tok_pvec *v, const char *s, size_t len, bool origin) {
    if (!len) return FU_OK; /* HF drops empty splits */
    if (v->n == v->cap) {
        int rc = grow((void **)&v->v, &v->cap, v->n + 1, sizeof *v->v);
        if (rc) return rc;
    }
    v->v[v->n++] = (tok_piece){s, len, origin};
    return FU_OK;
}

static int rg_push(tok_enc *e, size_t s, size_t end, bool match) {
    if (e->n_rg == e->cap_rg) {
        int rc = grow((void **)&e->rg, &e->cap_rg, e->n_rg + 1, sizeof *e->rg);
        if (rc) return rc;
    }
    e->rg[e->n_rg++] = (tok_range){s, end, match};
    return FU_OK;
}

static void enc_free(tok_enc *e) {
    free(e->out);
    while (e->arena) {
        tok_block *n = e->arena->next;
        free(e->arena);
        e->arena = n;
    }
    free(e->pv[0].v);
    free(e->pv[1].v);
    free(e->rg);
    if (e->md) {
        for (size_t i = 0; i < e->t->n_pre; i++) pcre2_match_data_free(e->md[i]);
        free(e->md);
    }
    free(e->sym);
    free(e->heap);
}

/* ---- Unicode helpers ---------------------------------------------------------------- */

/* Unicode White_Space (what Rust's char::is_whitespace and regex \s use). */
static bool is_white_space(uint32_t c) {
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

/* Approximates Rust regex's \w: letters, marks, decimal digits, letter numbers,
 * connector punctuation, joiners. */
static bool is_word_char(uint32_t c) {
    if (c == 0x200c || c == 0x200d) return true;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
        return true;
    default:
        return false;
    }
}

/* Code point of the character ending at s[end) (valid UTF-8), and its start. */
static uint32_t utf8_prev(const char *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xc0) == 0x80) i--;
    size_t adv;
    uint32_t cp = 0xfffd;
    tok__utf8_next((const uint8_t *)s + i, end - i, &adv, &cp);
    *start = i;
    return cp;
}

/* Repairs invalid UTF-8: NULL in *out if s is already valid, else a malloc'd
 * copy with each maximal invalid subpart replaced by U+FFFD. */
static int utf8_sanitize(const char *s, size_t n, char **out, size_t *outlen) {
    *out = NULL;
    size_t i = 0;
    while (i < n) {
        size_t adv;
        if (tok__utf8_next((const uint8_t *)s + i, n - i, &adv, NULL) != 1) break;
        i += adv;
    }
    if (i == n) return FU_OK;
    size_t need = i; /* exact size of the repaired text */
    for (size_t k = i; k < n;) {
        size_t adv;
        need += tok__utf8_next((const uint8_t *)s + k, n - k, &adv, NULL) == 1 ? adv : 3;
        k += adv;
    }
    char *o = malloc(need + 1);
    if (!o) return fu_errorf(FU_ERR_NOMEM, "tokenizer: text copy");
    memcpy(o, s, i);
    size_t j = i;
    while (i < n) {
        size_t adv;
        if (tok__utf8_next((const uint8_t *)s + i, n - i, &adv, NULL) == 1) {
            memcpy(o + j, s + i, adv);
            j += adv;
        } else {
            memcpy(o + j, "\xef\xbf\xbd", 3);
            j += 3;
        }
        i += adv;
    }
    o[j] = '\0';
    *out = o;
    *outlen = j;
    return FU_OK;
}

/* ---- normalizer ------------------------------------------------------------------------ */

static int norm_utf8proc(const char *s, size_t n, int opts, char **out, size_t *outlen) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      (utf8proc_option_t)(opts | UTF8PROC_STABLE));
    if (r < 0) {
        free(dst);
        return fu_errorf(r == UTF8PROC_ERROR_NOMEM ? FU_ERR_NOMEM : FU_ERR_INVALID,
                         "tokenizer: normalization failed: %s", utf8proc_errmsg(r));
    }
    *out = (char *)dst;
    *outlen = (size_t)r;
    return FU_OK;
}

static int norm_step(const tok_norm *nm, const char *s, size_t n, char **out, size_t *outlen) {
    switch (nm->kind) {
    case TOK_NORM_NFC:
        return norm_utf8proc(s, n, UTF8PROC_COMPOSE, out, outlen);
    case TOK_NORM_NFD:
        return norm_utf8proc(s, n, UTF8PROC_DECOMPOSE, out, outlen);
    case TOK_NORM_NFKC:
        return norm_utf8proc(s, n, UTF8PROC_COMPOSE | UTF8PROC_COMPAT, out, outlen);
    case TOK_NORM_NFKD:
        return norm_utf8proc(s, n, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, out, outlen);
    case TOK_NORM_PREPEND: {
        char *o = malloc(nm->alen + n + 1);
        if (!o) return fu_errorf(FU_ERR_NOMEM, "tokenizer: normalize");
        size_t j = 0;
        if (n) { /* HF: nothing is prepended to an empty string */
            memcpy(o, nm->a, nm->alen);
            j = nm->alen;
        }
        memcpy(o + j, s, n);
        o[j + n] = '\0';
        *out = o;
        *outlen = j + n;
        return FU_OK;
    }
    case TOK_NORM_REPLACE: {
        size_t cnt = 0;
        if (nm->alen)
            for (size_t i = 0; i + nm->alen <= n;) {
                if (memcmp(s + i, nm->a, nm->alen) == 0) {
                    cnt++;
                    i += nm->alen;
                } else {
                    i++;
                }
            }
        size_t nn = n - cnt * nm->alen + cnt * nm->blen;
        char *o = malloc(nn + 1);
        if (!o) return fu_errorf(FU_ERR_NOMEM, "tokenizer: normalize");
        size_t j = 0;
        for (size_t i = 0; i < n;) {
            if (cnt && i + nm->alen <= n && memcmp(s + i, nm->a, nm->alen) == 0) {
                memcpy(o + j, nm->b, nm->blen);
                j += nm->blen;
                i += nm->alen;
            } else {
                o[j++] = s[i++];
            }
        }
        o[j] = '\0';
        *out = o;
        *outlen = j;
        return FU_OK;
    }
    case TOK_NORM_LOWERCASE: {
        char *o = malloc(n * 2 + 4); /* a lower-case code point needs at most 4 bytes; input >= 1 */
        if (!o) return fu_errorf(FU_ERR_NOMEM, "tokenizer: normalize");
        size_t j = 0;
        for (size_t i = 0; i < n;) {
            size_t adv;
            uint32_t cp = 0xfffd;
            tok__utf8_next((const uint8_t *)s + i, n - i, &adv, &cp);
            uint32_t lc = (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
            char tmp[4];
            size_t k = tok__utf8_put(lc, tmp);
            if (j + k > n * 2 + 4) { /* cannot happen for real tables; stay in bounds */
                free(o);
                return fu_errorf(FU_ERR_INTERNAL, "tokenizer: lowercase grew the text");
            }
            memcpy(o + j, tmp, k);
            j += k;
            i += adv;
        }
        o[j] = '\0';
        *out = o;
        *outlen = j;
        return FU_OK;
    }
    case TOK_NORM_STRIP: {
        size_t lo = 0, hi = n;
        if (nm->flags & 1)
            while (lo < hi) {
                size_t adv;
                uint32_t cp = 0;
                tok__utf8_next((const uint8_t *)s + lo, hi - lo, &adv, &cp);
                if (!is_white_space(cp)) break;
                lo += adv;
            }
        if (nm->flags & 2)
            while (hi > lo) {
                size_t st;
                uint32_t cp = utf8_prev(s, hi, &st);
                if (!is_white_space(cp) || st < lo) break;
                hi = st;
            }
        *out = tok__strndup(s + lo, hi - lo);
        if (!*out) return fu_errorf(FU_ERR_NOMEM, "tokenizer: normalize");
        *outlen = hi - lo;
        return FU_OK;
    }
    }
    return fu_errorf(FU_ERR_INTERNAL, "tokenizer: unknown normalizer step %d", (int)nm->kind);
}

int tok__normalize(const tok_tokenizer *t, const char *s, size_t len, char **out, size_t *outlen) {
    char *cur = tok__strndup(s, len);
    if (!cur) return fu_errorf(FU_ERR_NOMEM, "tokenizer: normalize");
    size_t n = len;
    for (size_t k = 0; k < t->n_norm; k++) {
        char *nx;
        size_t nn;
        int rc = norm_step(&t->norm[k], cur, n, &nx, &nn);
        free(cur);
        if (rc) return rc;
        cur = nx;
        n = nn;
    }
    *out = cur;
    *outlen = n;
    return FU_OK;
}

/* ---- BPE (Hugging Face): merges by rank ----------------------------------------------- */

static inline bool bpe_less(const bpe_cand *a, const bpe_cand *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static int bpe_heap_push(tok_enc *e, bpe_cand c) {
    int rc = grow(&e->heap, &e->cap_heap, e->n_heap + 1, sizeof(bpe_cand));
    if (rc) return rc;
    bpe_cand *h = e->heap;
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bpe_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
    return FU_OK;
}

static bpe_cand bpe_heap_pop(tok_enc *e) {
    bpe_cand *h = e->heap;
    bpe_cand top = h[0], last = h[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = l + 1 < n && bpe_less(&h[l + 1], &h[l]) ? l + 1 : l;
        if (!bpe_less(&h[m], &last)) break;
        h[i] = h[m];
        i = m;
    }
    if (n) h[i] = last;
    return top;
}

static int bpe_add_sym(tok_enc *e, size_t *nsym, int32_t id, int32_t len) {
    int rc = grow(&e->sym, &e->cap_sym, *nsym + 1, sizeof(bpe_sym));
    if (rc) return rc;
    bpe_sym *s = e->sym;
    s[*nsym] = (bpe_sym){id, (int32_t)*nsym - 1, (int32_t)*nsym + 1, len};
    (*nsym)++;
    return FU_OK;
}

/* One pre-tokenized word through the BPE model (HF BPE::merge_word + Word::merge_all). */
static int bpe_word(tok_enc *e, const char *w, size_t n) {
    const tok_tokenizer *t = e->t;
    int rc;
    if (t->ignore_merges) {
        int32_t id = tok__lookup(t, w, n, true);
        if (id >= 0) return out_push(e, id);
    }
    size_t nsym = 0;
    bool unk_pending = false;
    int32_t unk_len = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        if (tok__utf8_next((const uint8_t *)w + i, n - i, &adv, NULL) != 1) adv = 1;
        int32_t id = tok__lookup(t, w + i, adv, true);
        if (id >= 0) {
            if (unk_pending) {
                if ((rc = bpe_add_sym(e, &nsym, t->model_unk, unk_len))) return rc;
                unk_pending = false;
            }
            if ((rc = bpe_add_sym(e, &nsym, id, (int32_t)adv))) return rc;
        } else {
            bool done = false;
            if (t->byte_fallback) {
                done = true;
                for (size_t k = 0; k < adv; k++)
                    if (t->byte_tok[(unsigned char)w[i + k]] < 0) done = false;
                for (size_t k = 0; done && k < adv; k++)
                    if ((rc = bpe_add_sym(e, &nsym, t->byte_tok[(unsigned char)w[i + k]], 1))) return rc;
            }
            if (!done && t->model_unk >= 0) {
                if (unk_pending && t->fuse_unk) {
                    unk_len += (int32_t)adv;
                } else {
                    if (unk_pending && (rc = bpe_add_sym(e, &nsym, t->model_unk, unk_len))) return rc;
                    unk_pending = true;
                    unk_len = (int32_t)adv;
                }
            }
            /* neither: HF drops the character */
        }
        i += adv;
    }
    if (unk_pending && (rc = bpe_add_sym(e, &nsym, t->model_unk, unk_len))) return rc;
    if (!nsym) return FU_OK;
    bpe_sym *s = e->sym;
    s[nsym - 1].next = -1;

    e->n_heap = 0;
    int32_t rank, res;
    for (size_t i = 0; i + 1 < nsym; i++)
        if (tok__merge_get(t, s[i].id, s[i + 1].id, &rank, &res) &&
            (rc = bpe_heap_push(e, (bpe_cand){rank, (int32_t)i, res})))
            return rc;
    while (e->n_heap) {
        bpe_cand top = bpe_heap_pop(e);
        s = e->sym;
        bpe_sym *cur = &s[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        int32_t nx = cur->next;
        if (!tok__merge_get(t, cur->id, s[nx].id, &rank, &res) || res != top.result) continue;
        cur->id = top.result;
        cur->len += s[nx].len;
        cur->next = s[nx].next;
        s[nx].len = 0;
        if (cur->next >= 0) s[cur->next].prev = top.pos;
        int32_t pv = cur->prev, nn = cur->next, id = cur->id;
        if (pv >= 0 && tok__merge_get(t, s[pv].id, id, &rank, &res) &&
            (rc = bpe_heap_push(e, (bpe_cand){rank, pv, res})))
            return rc;
        s = e->sym;
        if (nn >= 0 && tok__merge_get(t, id, s[nn].id, &rank, &res) &&
            (rc = bpe_heap_push(e, (bpe_cand){rank, top.pos, res})))
            return rc;
    }
    s = e->sym;
    for (int32_t i = 0; i >= 0; i = s[i].next)
        if ((rc = out_push(e, s[i].id))) return rc;
    return FU_OK;
}

/* ---- SentencePiece (llama.cpp "llama" vocabularies): bigrams by score ---------------- */

static inline bool spm_better(const spm_cand *a, const spm_cand *b) {
    return a->score != b->score ? a->score > b->score : a->left < b->left;
}

static int spm_heap_push(tok_enc *e, spm_cand c) {
    int rc = grow(&e->heap, &e->cap_heap, e->n_heap + 1, sizeof(spm_cand));
    if (rc) return rc;
    spm_cand *h = e->heap;
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!spm_better(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
    return FU_OK;
}

static spm_cand spm_heap_pop(tok_enc *e) {
    spm_cand *h = e->heap;
    spm_cand top = h[0], last = h[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = l + 1 < n && spm_better(&h[l + 1], &h[l]) ? l + 1 : l;
        if (!spm_better(&h[m], &last)) break;
        h[i] = h[m];
        i = m;
    }
    if (n) h[i] = last;
    return top;
}

static int spm_try_add(tok_enc *e, const char *w, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return FU_OK;
    const spm_sym *s = e->sym;
    int32_t size = s[l].n + s[r].n;
    int32_t id = tok__lookup(e->t, w + s[l].start, (size_t)size, true);
    if (id < 0) return FU_OK;
    float score = e->t->scores ? e->t->scores[id] : 0.0f;
    return spm_heap_push(e, (spm_cand){score, l, r, size});
}

/* One text fragment through llama.cpp's SentencePiece merge (llm_tokenizer_spm). */
static int spm_word(tok_enc *e, const char *w, size_t n) {
    const tok_tokenizer *t = e->t;
    int rc;
    size_t nsym = 0;
    for (size_t i = 0; i < n;) {
        size_t adv;
        if (tok__utf8_next((const uint8_t *)w + i, n - i, &adv, NULL) != 1) adv = 1;
        if ((rc = grow(&e->sym, &e->cap_sym, nsym + 1, sizeof(spm_sym)))) return rc;
        ((spm_sym *)e->sym)[nsym] =
            (spm_sym){(int32_t)i, (int32_t)adv, (int32_t)nsym - 1, (int32_t)nsym + 1};
        nsym++;
        i += adv;
    }
    if (!nsym) return FU_OK;
    ((spm_sym *)e->sym)[nsym - 1].next = -1;
    e->n_heap = 0;
    for (size_t i = 1; i < nsym; i++)
        if ((rc = spm_try_add(e, w, (int32_t)i - 1, (int32_t)i))) return rc;
    while (e->n_heap) {
        spm_cand b = spm_heap_pop(e);
        spm_sym *s = e->sym;
        spm_sym *L = &s[b.left], *R = &s[b.right];
        if (L->n == 0 || R->n == 0 || L->n + R->n != b.size) continue;
        L->n += R->n;
        R->n = 0;
        L->next = R->next;
        if (R->next >= 0) s[R->next].prev = b.left;
        int32_t pv = L->prev, nx = L->next;
        if ((rc = spm_try_add(e, w, pv, b.left))) return rc;
        if ((rc = spm_try_add(e, w, b.left, nx))) return rc;
    }
    const spm_sym *s = e->sym;
    for (int32_t i = 0; i >= 0; i = s[i].next) {
        int32_t id = tok__lookup(t, w + s[i].start, (size_t)s[i].n, true);
        if (id >= 0) {
            if ((rc = out_push(e, id))) return rc;
            continue;
        }
        for (int32_t k = 0; k < s[i].n; k++) { /* not a token: its bytes */
            int32_t bt = t->byte_tok[(unsigned char)w[s[i].start + k]];
            if (bt < 0) bt = t->model_unk;
            if (bt >= 0 && (rc = out_push(e, bt))) return rc;
        }
    }
    return FU_OK;
}

/* ---- pre-tokenizer --------------------------------------------------------------------- */

/* Finds the pattern's matches in s[0..n) as HF's Pattern::find_matches does:
 * ranges covering the whole string, each marked match or not. */
static int find_regex(tok_enc *e, size_t step, const tok_pre *p, const char *s, size_t n) {
    e->n_rg = 0;
    if (!e->md[step]) {
        e->md[step] = pcre2_match_data_create_from_pattern(p->re, NULL);
        if (!e->md[step]) return fu_errorf(FU_ERR_NOMEM, "tokenizer: regex match data");
    }
    pcre2_match_data *md = e->md[step];
    size_t prev = 0, off = 0;
    int rc;
    while (off <= n) {
        int r = pcre2_match(p->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (r == PCRE2_ERROR_JIT_STACKLIMIT)
            r = pcre2_match(p->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (r == PCRE2_ERROR_NOMATCH) break;
        if (r < 0) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(r, msg, sizeof msg);
            return fu_errorf(FU_ERR_INTERNAL, "tokenizer: regex match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (ms != prev && (rc = rg_push(e, prev, ms, false))) return rc;
        if ((rc = rg_push(e, ms, me, true))) return rc;
        prev = me;
        if (me > ms) {
            off = me;
        } else { /* empty match: step over one character */
            if (ms >= n) break;
            size_t adv;
            if (tok__utf8_next((const uint8_t *)s + ms, n - ms, &adv, NULL) != 1) adv = 1;
            off = ms + adv;
        }
    }
    if (prev != n && (rc = rg_push(e, prev, n, false))) return rc;
    return FU_OK;
}

/* Every occurrence of c[0..clen) is its own match (HF char patterns). */
static int find_char(tok_enc *e, const char *c, size_t clen, const char *s, size_t n) {
    e->n_rg = 0;
    size_t last = 0;
    int rc;
    for (size_t i = 0; i + clen <= n;) {
        if (memcmp(s + i, c, clen) == 0) {
            if (last < i && (rc = rg_push(e, last, i, false))) return rc;
            if ((rc = rg_push(e, i, i + clen, true))) return rc;
            i += clen;
            last = i;
        } else {
            i++;
        }
    }
    if (last < n && (rc = rg_push(e, last, n, false))) return rc;
    return FU_OK;
}

/* Applies a split behavior to e->rg and appends the resulting pieces of `in`. */
static int emit_splits(tok_enc *e, tok_split_behavior beh, bool invert, const tok_piece *in,
                       tok_pvec *out) {
    tok_range *r = e->rg;
    size_t n = e->n_rg, k = 0;
    if (invert)
        for (size_t i = 0; i < n; i++) r[i].match = !r[i].match;
    /* merge in place into r[0..k), each kept range then has match=false unless removed */
    switch (beh) {
    case TOK_SPLIT_ISOLATED:
        k = n;
        for (size_t i = 0; i < n; i++) r[i].match = false;
        break;
    case TOK_SPLIT_REMOVED:
        k = n;
        break;
    case TOK_SPLIT_CONTIGUOUS: {
        bool prev = false;
        for (size_t i = 0; i < n; i++) {
            bool m = r[i].match;
            if (m == prev && k > 0) r[k - 1].e = r[i].e;
            else r[k++] = (tok_range){r[i].s, r[i].e, false};
            prev = m;
        }
        break;
    }
    case TOK_SPLIT_MERGED_PREV: {
        bool prev = false;
        for (size_t i = 0; i < n; i++) {
            bool m = r[i].match;
            if (m && !prev && k > 0) r[k - 1].e = r[i].e;
            else r[k++] = (tok_range){r[i].s, r[i].e, false};
            prev = m;
        }
        break;
    }
    case TOK_SPLIT_MERGED_NEXT: {
        /* walk backwards, merging a match into the piece after it; store from the end */
        bool prev = false;
        size_t w = n;
        for (size_t i = n; i-- > 0;) {
            bool m = r[i].match;
            tok_range cur = r[i];
            if (m && !prev && w < n) r[w].s = cur.s;
            else r[--w] = (tok_range){cur.s, cur.e, false};
            prev = m;
        }
        memmove(r, r + w, (n - w) * sizeof *r);
        k = n - w;
        break;
    }
    }
    int rc;
    for (size_t i = 0; i < k; i++) {
        if (r[i].match) continue; /* removed */
        if ((rc = pv_push(out, in->s + r[i].s, r[i].e - r[i].s, in->origin && r[i].s == 0))) return rc;
    }
    return FU_OK;
}

static int pre_step(tok_enc *e, size_t step, const tok_pvec *in, tok_pvec *out) {
    const tok_pre *p = &e->t->pre[step];
    int rc;
    out->n = 0;
    for (size_t i = 0; i < in->n; i++) {
        const tok_piece *pc = &in->v[i];
        switch (p->kind) {
        case TOK_PRE_SPLIT:
            if ((rc = find_regex(e, step, p, pc->s, pc->len))) return rc;
            if ((rc = emit_splits(e, p->behavior, p->invert, pc, out))) return rc;
            break;
        case TOK_PRE_PREFIX_SPACE:
            if (pc->s[0] == ' ') {
                rc = pv_push(out, pc->s, pc->len, pc->origin);
            } else {
                char *b = arena_alloc(e, pc->len + 1);
                if (!b) return fu_errorf(FU_ERR_NOMEM, "tokenizer: encode");
                b[0] = ' ';
                memcpy(b + 1, pc->s, pc->len);
                rc = pv_push(out, b, pc->len + 1, pc->origin);
            }
            if (rc) return rc;
            break;
        case TOK_PRE_BYTELEVEL: {
            char *b = arena_alloc(e, pc->len * 2);
            if (!b) return fu_errorf(FU_ERR_NOMEM, "tokenizer: encode");
            size_t j = 0;
            for (size_t k = 0; k < pc->len; k++)
                j += tok__utf8_put(tok__byte_to_cp((uint8_t)pc->s[k]), b + j);
            if ((rc = pv_push(out, b, j, pc->origin))) return rc;
            break;
        }
        case TOK_PRE_METASPACE: {
            size_t spaces = 0;
            for (size_t k = 0; k < pc->len; k++) spaces += pc->s[k] == ' ';
            size_t cap = pc->len + spaces * p->repl_len + p->repl_len;
            char *b = arena_alloc(e, cap);
            if (!b) return fu_errorf(FU_ERR_NOMEM, "tokenizer: encode");
            size_t j = 0;
            for (size_t k = 0; k < pc->len; k++) {
                if (pc->s[k] == ' ') {
                    memcpy(b + j, p->repl, p->repl_len);
                    j += p->repl_len;
                } else {
                    b[j++] = pc->s[k];
                }
            }
            bool starts = j >= p->repl_len && memcmp(b, p->repl, p->repl_len) == 0;
            if (!starts && (p->prepend_scheme == 2 || (p->prepend_scheme == 1 && pc->origin))) {
                memmove(b + p->repl_len, b, j);
                memcpy(b, p->repl, p->repl_len);
                j += p->repl_len;
            }
            tok_piece np = {b, j, pc->origin};
            if (p->split) {
                if ((rc = find_char(e, p->repl, p->repl_len, b, j))) return rc;
                if ((rc = emit_splits(e, TOK_SPLIT_MERGED_NEXT, false, &np, out))) return rc;
            } else if ((rc = pv_push(out, b, j, pc->origin))) {
                return rc;
            }
            break;
        }
        }
    }
    return FU_OK;
}

static int model_word(tok_enc *e, const char *s, size_t n) {
    if (!n) return FU_OK;
    return e->t->algo == TOK_ALGO_SPM ? spm_word(e, s, n) : bpe_word(e, s, n);
}

/* A normalized text fragment: pre-tokenizer, then the model on each piece. */
static int pretok_model(tok_enc *e, const char *s, size_t n, bool origin) {
    const tok_tokenizer *t = e->t;
    if (!n) return FU_OK;
    if (!t->n_pre) return model_word(e, s, n);
    int rc;
    tok_pvec *in = &e->pv[0], *out = &e->pv[1];
    in->n = 0;
    if ((rc = pv_push(in, s, n, origin))) return rc;
    for (size_t k = 0; k < t->n_pre; k++) {
        if ((rc = pre_step(e, k, in, out))) return rc;
        tok_pvec *tmp = in;
        in = out;
        out = tmp;
    }
    for (size_t i = 0; i < in->n; i++)
        if ((rc = model_word(e, in->v[i].s, in->v[i].len))) return rc;
    return FU_OK;
}

/* ---- added tokens ------------------------------------------------------------------------ */

typedef int (*tok_text_fn)(tok_enc *e, const char *s, size_t n, bool origin);

/* Whether base[start..end) overlaps one of e's plain ranges. */
static bool overlaps_plain(const tok_enc *e, size_t start, size_t end) {
    size_t lo = 0, hi = e->n_plain;
    while (lo < hi) { /* first range that ends after start */
        size_t mid = lo + (hi - lo) / 2;
        if (e->plain[mid].end <= start) lo = mid + 1;
        else hi = mid;
    }
    return lo < e->n_plain && e->plain[lo].start < end;
}

/* Whether the special token matched at s[ms..ms+ml) is taken as its id. */
static bool special_taken(const tok_enc *e, const tok_matcher *m, const char *s, size_t ms, size_t ml) {
    if (!e->parse_special) return false;
    if (!e->n_plain) return true;
    if (m == &e->t->match_raw) return !overlaps_plain(e, (size_t)(s - e->base) + ms, (size_t)(s - e->base) + ms + ml);
    return !e->frag_plain;
}

/* Splits s[0..n) on the matcher's added tokens (leftmost-longest, HF
 * AddedVocabulary::find_matches): token ids go out, the text between goes to fn. */
static int split_added(tok_enc *e, const tok_matcher *m, const char *s, size_t n, bool origin,
                       tok_text_fn fn) {
    const tok_tokenizer *t = e->t;
    size_t start_off = 0, pos = 0;
    int rc;
    while (pos < n) {
        size_t ms = 0, ml = 0;
        const tok_added *a = NULL;
        for (size_t p = pos; p < n && !a; p++) {
            unsigned char b = (unsigned char)s[p];
            for (uint32_t k = m->start[b]; k < m->start[b + 1]; k++) {
                const tok_added *c = &t->added[m->idx[k]];
                if (c->len <= n - p && memcmp(s + p, c->content, c->len) == 0) {
                    a = c;
                    ms = p;
                    ml = c->len;
                    break;
                }
            }
        }
        if (!a) break;
        size_t mstart = ms, mstop = ms + ml;
        pos = mstop;
        if (a->special && !special_taken(e, m, s, ms, ml)) continue;
        if (a->single_word) {
            size_t st;
            bool left_ok = mstart == 0 || !is_word_char(utf8_prev(s, mstart, &st));
            bool right_ok = true;
            if (mstop < n) {
                size_t adv;
                uint32_t cp = 0;
                tok__utf8_next((const uint8_t *)s + mstop, n - mstop, &adv, &cp);
                right_ok = !is_word_char(cp);
            }
            if (!left_ok || !right_ok) continue;
        }
        if (a->lstrip) {
            size_t ns = mstart;
            while (ns > 0) {
                size_t st;
                if (!is_white_space(utf8_prev(s, ns, &st))) break;
                ns = st;
            }
            mstart = ns > start_off ? ns : start_off;
        }
        if (a->rstrip) {
            while (mstop < n) {
                size_t adv;
                uint32_t cp = 0;
                tok__utf8_next((const uint8_t *)s + mstop, n - mstop, &adv, &cp);
                if (!is_white_space(cp)) break;
                mstop += adv;
            }
        }
        if (mstart < start_off) mstart = start_off; /* overlap with an rstrip before */
        if (start_off < mstart &&
            (rc = fn(e, s + start_off, mstart - start_off, origin && start_off == 0)))
            return rc;
        if ((rc = out_push(e, a->id))) return rc;
        start_off = mstop;
        if (pos < mstop) pos = mstop;
    }
    if (start_off < n && (rc = fn(e, s + start_off, n - start_off, origin && start_off == 0)))
        return rc;
    return FU_OK;
}

/* A fragment of raw text between (unnormalized) added tokens. */
static int encode_fragment(tok_enc *e, const char *s, size_t n, bool origin) {
    const tok_tokenizer *t = e->t;
    if (!n) return FU_OK;
    if (e->n_plain) e->frag_plain = overlaps_plain(e, (size_t)(s - e->base), (size_t)(s - e->base) + n);
    if (!t->n_norm) {
        if (t->has_norm_added) return split_added(e, &t->match_norm, s, n, origin, pretok_model);
        return pretok_model(e, s, n, origin);
    }
    char *ns = NULL;
    size_t nn = 0;
    int rc = tok__normalize(t, s, n, &ns, &nn);
    if (rc) return rc;
    if (t->has_norm_added) rc = split_added(e, &t->match_norm, ns, nn, origin, pretok_model);
    else rc = pretok_model(e, ns, nn, origin);
    free(ns);
    return rc;
}

/* tok_encode and tok_encode_spans. */
static int encode(const tok_tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
                  const tok_span *plain, size_t n_plain, int32_t **ids, size_t *n) {
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!t || !ids || !n || (!text && len) || (!plain && n_plain))
        return fu_errorf(FU_ERR_INVALID, "tok_encode: bad arguments");
    if (!text) text = "";
    char *fixed = NULL;
    size_t fixed_len = 0;
    int rc = utf8_sanitize(text, len, &fixed, &fixed_len);
    if (rc) return rc;
    if (fixed) {
        text = fixed;
        len = fixed_len;
        if (n_plain) parse_special = false; /* the ranges no longer line up: no special token */
    }
    tok_enc e = {.t = t, .parse_special = parse_special, .plain = plain, .n_plain = n_plain, .base = text};
    if (t->n_pre) {
        e.md = calloc(t->n_pre, sizeof *e.md);
        if (!e.md) rc = fu_errorf(FU_ERR_NOMEM, "tokenizer: encode");
    }
    if (!rc && add_special)
        for (size_t i = 0; i < t->n_prefix && !rc; i++) rc = out_push(&e, t->prefix_ids[i]);
    if (!rc) rc = split_added(&e, &t->match_raw, text, len, true, encode_fragment);
    if (!rc && add_special)
        for (size_t i = 0; i < t->n_suffix && !rc; i++) rc = out_push(&e, t->suffix_ids[i]);
    free(fixed);
    if (rc) {
        enc_free(&e);
        return rc;
    }
    *ids = e.n_out ? e.out : NULL;
    *n = e.n_out;
    if (!e.n_out) free(e.out);
    e.out = NULL;
    enc_free(&e);
    return FU_OK;
}

int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
               int32_t **ids, size_t *n) {
    return encode(t, text, len, add_special, parse_special, NULL, 0, ids, n);
}

int tok_encode_spans(const tok_tokenizer *t, const char *text, size_t len, bool add_special, const tok_span *plain,
                     size_t n_plain, int32_t **ids, size_t *n) {
    return encode(t, text, len, add_special, true, plain, n_plain, ids, n);
}
