/* tokenizer.c -- tokenizer construction (shared by the loaders), decoding and accessors. */
#include "tok-impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "status.h"

#define TOK_MAX_VOCAB (1 << 24) /* sanity bound on ids from files */

/* ---- small helpers ---------------------------------------------------------- */

char *tok__strndup(const char *s, size_t len) {
    char *p = malloc(len + 1);
    if (!p) return NULL;
    if (len) memcpy(p, s, len);
    p[len] = '\0';
    return p;
}

static uint64_t tok_hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 31);
}

static uint64_t tok_hash_u64(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static size_t tok_pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* ---- text -> id map --------------------------------------------------------- */

static int strmap_insert(tok_tokenizer *t, int32_t id) {
    tok_strmap *m = &t->vocab;
    size_t mask = m->cap - 1;
    size_t i = tok_hash_bytes(t->text[id], t->text_len[id]) & mask;
    for (;;) {
        uint32_t s = m->slots[i];
        if (s == 0) {
            m->slots[i] = (uint32_t)id + 1;
            m->n++;
            return 1;
        }
        int32_t o = (int32_t)s - 1;
        if (t->text_len[o] == t->text_len[id] &&
            memcmp(t->text[o], t->text[id], t->text_len[id]) == 0)
            return 0; /* keep the first */
        i = (i + 1) & mask;
    }
}

int tok__build_vocab(tok_tokenizer *t) {
    free(t->vocab.slots);
    t->vocab.cap = tok_pow2_at_least((size_t)t->n_vocab * 2 + 1);
    t->vocab.n = 0;
    t->vocab.slots = calloc(t->vocab.cap, sizeof *t->vocab.slots);
    if (!t->vocab.slots) return fu_errorf(FU_ERR_NOMEM, "tokenizer vocabulary map");
    /* model tokens first so that they win over added tokens of the same text */
    for (int pass = 0; pass < 2; pass++)
        for (int32_t id = 0; id < t->n_vocab; id++) {
            if (!(t->flags[id] & TOK_F_PRESENT)) continue;
            bool model = (t->flags[id] & TOK_F_MODEL) != 0;
            if (model == (pass == 0)) strmap_insert(t, id);
        }
    return FU_OK;
}

int32_t tok__lookup(const tok_tokenizer *t, const char *s, size_t len, bool model_only) {
    const tok_strmap *m = &t->vocab;
    if (!m->slots) return -1;
    size_t mask = m->cap - 1;
    size_t i = tok_hash_bytes(s, len) & mask;
    for (;;) {
        uint32_t v = m->slots[i];
        if (v == 0) return -1;
        int32_t id = (int32_t)v - 1;
        if (t->text_len[id] == len && memcmp(t->text[id], s, len) == 0) {
            if (model_only && !(t->flags[id] & TOK_F_MODEL)) return -1;
            return id;
        }
        i = (i + 1) & mask;
    }
}

/* ---- pair -> merge map ------------------------------------------------------- */

static int pairmap_grow(tok_pairmap *m) {
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    uint64_t *keys = malloc(ncap * sizeof *keys);
    int32_t *rank = malloc(ncap * sizeof *rank);
    int32_t *res = malloc(ncap * sizeof *res);
    if (!keys || !rank || !res) {
        free(keys);
        free(rank);
        free(res);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer merge map");
    }
    memset(keys, 0xff, ncap * sizeof *keys);
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == UINT64_MAX) continue;
        size_t j = tok_hash_u64(m->keys[i]) & (ncap - 1);
        while (keys[j] != UINT64_MAX) j = (j + 1) & (ncap - 1);
        keys[j] = m->keys[i];
        rank[j] = m->rank[i];
        res[j] = m->result[i];
    }
    free(m->keys);
    free(m->rank);
    free(m->result);
    m->keys = keys;
    m->rank = rank;
    m->result = res;
    m->cap = ncap;
    return FU_OK;
}

static int pairmap_put(tok_pairmap *m, uint64_t key, int32_t rank, int32_t result) {
    if ((m->n + 1) * 4 > m->cap * 3) {
        int rc = pairmap_grow(m);
        if (rc) return rc;
    }
    size_t j = tok_hash_u64(key) & (m->cap - 1);
    while (m->keys[j] != UINT64_MAX && m->keys[j] != key) j = (j + 1) & (m->cap - 1);
    if (m->keys[j] == UINT64_MAX) m->n++;
    m->keys[j] = key;
    m->rank[j] = rank;
    m->result[j] = result;
    return FU_OK;
}

/* Looks up the merge of (a, b): true with *rank / *result if there is one. */
static inline bool pairmap_get(const tok_pairmap *m, int32_t a, int32_t b, int32_t *rank,
                               int32_t *result) {
    if (!m->cap) return false;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t j = tok_hash_u64(key) & (m->cap - 1);
    for (;;) {
        uint64_t k = m->keys[j];
        if (k == key) {
            *rank = m->rank[j];
            *result = m->result[j];
            return true;
        }
        if (k == UINT64_MAX) return false;
        j = (j + 1) & (m->cap - 1);
    }
}

bool tok__merge_get(const tok_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *result) {
    return pairmap_get(&t->merges, a, b, rank, result);
}

/* ---- construction ------------------------------------------------------------ */

int tok__new(int32_t n_vocab, tok_tokenizer **out) {
    *out = NULL;
    if (n_vocab <= 0 || n_vocab > TOK_MAX_VOCAB)
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: vocabulary size %d out of range", (int)n_vocab);
    tok_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return fu_errorf(FU_ERR_NOMEM, "tokenizer");
    t->n_vocab = n_vocab;
    t->text = calloc((size_t)n_vocab, sizeof *t->text);
    t->text_len = calloc((size_t)n_vocab, sizeof *t->text_len);
    t->flags = calloc((size_t)n_vocab, sizeof *t->flags);
    t->piece = calloc((size_t)n_vocab, sizeof *t->piece);
    t->piece_len = calloc((size_t)n_vocab, sizeof *t->piece_len);
    if (!t->text || !t->text_len || !t->flags || !t->piece || !t->piece_len) {
        tok_free(t);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer vocabulary of %d", (int)n_vocab);
    }
    t->unk_id = t->model_unk = t->bos_id = t->eos_id = t->pad_id = t->eot_id = -1;
    for (int i = 0; i < 256; i++) t->byte_tok[i] = -1;
    *out = t;
    return FU_OK;
}

int tok__set_token(tok_tokenizer *t, int32_t id, const char *s, size_t len, unsigned flags) {
    if (id < 0 || id >= t->n_vocab)
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: token id %d out of range [0, %d)", (int)id,
                         (int)t->n_vocab);
    if (len > UINT32_MAX / 2) return fu_errorf(FU_ERR_FORMAT, "tokenizer: token %d too long", (int)id);
    if (t->flags[id] & TOK_F_PRESENT) {
        if (t->text_len[id] == len && memcmp(t->text[id], s, len) == 0) {
            t->flags[id] |= (uint8_t)flags;
            return FU_OK;
        }
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: id %d given to both '%s' and '%.*s'", (int)id,
                         t->text[id], (int)(len > 64 ? 64 : len), s);
    }
    t->text[id] = tok__strndup(s, len);
    if (!t->text[id]) return fu_errorf(FU_ERR_NOMEM, "tokenizer token");
    t->text_len[id] = (uint32_t)len;
    t->flags[id] |= (uint8_t)(flags | TOK_F_PRESENT);
    return FU_OK;
}

int tok__add_merge(tok_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                   int32_t rank) {
    int32_t ia = tok__lookup(t, a, alen, true);
    int32_t ib = tok__lookup(t, b, blen, true);
    if (ia < 0 || ib < 0)
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: merge %d ('%.*s' '%.*s'): '%.*s' is not in the vocabulary",
                         (int)rank, (int)(alen > 64 ? 64 : alen), a, (int)(blen > 64 ? 64 : blen), b,
                         ia < 0 ? (int)(alen > 64 ? 64 : alen) : (int)(blen > 64 ? 64 : blen),
                         ia < 0 ? a : b);
    char stackbuf[256];
    char *buf = alen + blen <= sizeof stackbuf ? stackbuf : malloc(alen + blen);
    if (!buf) return fu_errorf(FU_ERR_NOMEM, "tokenizer merge");
    memcpy(buf, a, alen);
    memcpy(buf + alen, b, blen);
    int32_t ir = tok__lookup(t, buf, alen + blen, true);
    if (buf != stackbuf) free(buf);
    if (ir < 0)
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: merge %d ('%.*s' '%.*s'): the merged token is not in the vocabulary",
                         (int)rank, (int)(alen > 64 ? 64 : alen), a, (int)(blen > 64 ? 64 : blen), b);
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    return pairmap_put(&t->merges, key, rank, ir);
}

int tok__add_added(tok_tokenizer *t, const tok_added *a) {
    if (a->id < 0 || a->id >= t->n_vocab)
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: added token id %d out of range", (int)a->id);
    if (a->len == 0) return FU_OK; /* HF ignores empty added tokens */
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == a->len && memcmp(t->added[i].content, a->content, a->len) == 0)
            return FU_OK; /* first one wins */
    tok_added *na = realloc(t->added, (t->n_added + 1) * sizeof *na);
    if (!na) return fu_errorf(FU_ERR_NOMEM, "tokenizer added tokens");
    t->added = na;
    tok_added *d = &t->added[t->n_added];
    *d = *a;
    d->content = tok__strndup(a->content, a->len);
    if (!d->content) return fu_errorf(FU_ERR_NOMEM, "tokenizer added token");
    t->n_added++;
    t->flags[a->id] |= TOK_F_ADDED | (a->special ? TOK_F_SPECIAL : 0);
    return FU_OK;
}

int tok__add_norm(tok_tokenizer *t, tok_norm_kind kind, const char *a, size_t alen, const char *b,
                  size_t blen, int flags) {
    tok_norm *nn = realloc(t->norm, (t->n_norm + 1) * sizeof *nn);
    if (!nn) return fu_errorf(FU_ERR_NOMEM, "tokenizer normalizer");
    t->norm = nn;
    tok_norm *d = &t->norm[t->n_norm];
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->flags = flags;
    if (a) {
        d->a = tok__strndup(a, alen);
        d->alen = alen;
    }
    if (b) {
        d->b = tok__strndup(b, blen);
        d->blen = blen;
    }
    if ((a && !d->a) || (b && !d->b)) {
        free(d->a);
        free(d->b);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer normalizer");
    }
    t->n_norm++;
    return FU_OK;
}

int tok__add_pre(tok_tokenizer *t, const tok_pre *p) {
    tok_pre *np = realloc(t->pre, (t->n_pre + 1) * sizeof *np);
    if (!np) return fu_errorf(FU_ERR_NOMEM, "tokenizer pre-tokenizer");
    t->pre = np;
    t->pre[t->n_pre++] = *p;
    return FU_OK;
}

const char tok__gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

int tok__add_split(tok_tokenizer *t, const char *pattern, size_t len, bool literal,
                   tok_split_behavior behavior, bool invert) {
    int err = 0;
    PCRE2_SIZE eoff = 0;
    uint32_t opts = literal ? PCRE2_LITERAL | PCRE2_UTF : PCRE2_UTF | PCRE2_UCP;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &err, &eoff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return fu_errorf(FU_ERR_FORMAT, "tokenizer: split pattern '%.*s' at offset %zu: %s",
                         (int)(len > 200 ? 200 : len), pattern, (size_t)eoff, (const char *)msg);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    tok_pre p = {.kind = TOK_PRE_SPLIT, .re = re, .behavior = behavior, .invert = invert};
    int rc = tok__add_pre(t, &p);
    if (rc) pcre2_code_free(re);
    return rc;
}

int tok__add_dec(tok_tokenizer *t, const tok_dec *d) {
    tok_dec *nd = realloc(t->dec, (t->n_dec + 1) * sizeof *nd);
    if (!nd) return fu_errorf(FU_ERR_NOMEM, "tokenizer decoder");
    t->dec = nd;
    tok_dec *c = &t->dec[t->n_dec];
    *c = *d;
    c->a = c->b = NULL;
    if (d->a) c->a = tok__strndup(d->a, d->alen);
    if (d->b) c->b = tok__strndup(d->b, d->blen);
    if ((d->a && !c->a) || (d->b && !c->b)) {
        free(c->a);
        free(c->b);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer decoder");
    }
    t->n_dec++;
    return FU_OK;
}

int tok__add_eog(tok_tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab || !(t->flags[id] & TOK_F_PRESENT)) return FU_OK;
    if (t->flags[id] & TOK_F_EOG) return FU_OK;
    int32_t *ne = realloc(t->eog_ids, (t->n_eog + 1) * sizeof *ne);
    if (!ne) return fu_errorf(FU_ERR_NOMEM, "tokenizer eog ids");
    t->eog_ids = ne;
    t->eog_ids[t->n_eog++] = id;
    t->flags[id] |= TOK_F_EOG;
    return FU_OK;
}

/* ---- GPT-2 byte <-> code point map -------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable bytes (33..126, 161..172, 174..255) stand
 * for themselves; the other 68 (0..32, 127..160, 173), in order, become
 * U+0100..U+0143. */
uint32_t tok__byte_to_cp(uint8_t b) {
    if (b <= 32) return 256u + b;
    if (b >= 127 && b <= 160) return 256u + 33u + (b - 127u);
    if (b == 173) return 256u + 67u;
    return b;
}

/* Inverse of tok__byte_to_cp: the byte, or -1 if cp is not in the map. */
static int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) return (cp <= 32 || (cp >= 127 && cp <= 160) || cp == 173) ? -1 : (int)cp;
    uint32_t n = cp - 256;
    if (n < 33) return (int)n;
    if (n < 67) return (int)(127 + n - 33);
    return n == 67 ? 173 : -1;
}

/* ---- UTF-8 ---------------------------------------------------------------------- */

int tok__utf8_next(const uint8_t *s, size_t n, size_t *adv, uint32_t *cp) {
    uint8_t b0 = s[0];
    if (b0 < 0x80) {
        *adv = 1;
        if (cp) *cp = b0;
        return 1;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xbf;
    uint32_t c;
    if (b0 >= 0xc2 && b0 <= 0xdf) {
        need = 1;
        c = b0 & 0x1f;
    } else if (b0 >= 0xe0 && b0 <= 0xef) {
        need = 2;
        c = b0 & 0x0f;
        if (b0 == 0xe0) lo = 0xa0;
        if (b0 == 0xed) hi = 0x9f;
    } else if (b0 >= 0xf0 && b0 <= 0xf4) {
        need = 3;
        c = b0 & 0x07;
        if (b0 == 0xf0) lo = 0x90;
        if (b0 == 0xf4) hi = 0x8f;
    } else {
        *adv = 1;
        return -1;
    }
    for (size_t i = 1; i <= need; i++) {
        if (i >= n) {
            *adv = i;
            return 0;
        }
        uint8_t b = s[i];
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xbf;
        if (b < l || b > h) {
            *adv = i;
            return -1;
        }
        c = (c << 6) | (b & 0x3f);
    }
    *adv = need + 1;
    if (cp) *cp = c;
    return 1;
}

size_t tok__utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* ---- finalize: decoded pieces, matchers, specials ----------------------------------- */

/* Replaces every occurrence of a in *s (length *n, owned) by b. */
static int tok_replace_all(char **s, size_t *n, const char *a, size_t alen, const char *b,
                           size_t blen) {
    if (alen == 0 || *n < alen) return FU_OK;
    size_t cnt = 0;
    for (size_t i = 0; i + alen <= *n;) {
        if (memcmp(*s + i, a, alen) == 0) {
            cnt++;
            i += alen;
        } else {
            i++;
        }
    }
    if (!cnt) return FU_OK;
    size_t nn = *n - cnt * alen + cnt * blen;
    char *o = malloc(nn + 1);
    if (!o) return fu_errorf(FU_ERR_NOMEM, "tokenizer replace");
    size_t j = 0;
    for (size_t i = 0; i < *n;) {
        if (i + alen <= *n && memcmp(*s + i, a, alen) == 0) {
            memcpy(o + j, b, blen);
            j += blen;
            i += alen;
        } else {
            o[j++] = (*s)[i++];
        }
    }
    o[j] = '\0';
    free(*s);
    *s = o;
    *n = nn;
    return FU_OK;
}

/* Computes the decoded bytes of token id from its text and the decoder steps. */
static int tok_make_piece(tok_tokenizer *t, int32_t id) {
    size_t n = t->text_len[id];
    char *s = tok__strndup(t->text[id], n);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "tokenizer piece");
    for (size_t k = 0; k < t->n_dec; k++) {
        const tok_dec *d = &t->dec[k];
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL: {
            /* every code point must be in the byte map, else the text stays (HF) */
            char *o = malloc(n + 1);
            if (!o) {
                free(s);
                return fu_errorf(FU_ERR_NOMEM, "tokenizer piece");
            }
            size_t j = 0, i = 0;
            bool ok = true;
            while (i < n) {
                size_t adv;
                uint32_t cp;
                if (tok__utf8_next((const uint8_t *)s + i, n - i, &adv, &cp) != 1) {
                    ok = false;
                    break;
                }
                int b = tok_cp_to_byte(cp);
                if (b < 0) {
                    ok = false;
                    break;
                }
                o[j++] = (char)b;
                i += adv;
            }
            if (ok) {
                o[j] = '\0';
                free(s);
                s = o;
                n = j;
            } else {
                free(o);
            }
            break;
        }
        case TOK_DEC_BYTEFALLBACK:
            if (n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>') {
                char hex[3] = {s[3], s[4], 0};
                char *end;
                unsigned long v = strtoul(hex, &end, 16);
                if (end == hex + 2) {
                    s[0] = (char)v;
                    n = 1;
                    t->flags[id] |= TOK_F_BYTE;
                }
            }
            break;
        case TOK_DEC_REPLACE: {
            int rc = tok_replace_all(&s, &n, d->a, d->alen, d->b, d->blen);
            if (rc) {
                free(s);
                return rc;
            }
            break;
        }
        case TOK_DEC_STRIP: {
            size_t lo = 0, hi = n;
            for (int i = 0; i < d->start && lo < hi && s[lo] == d->ch; i++) lo++;
            for (int i = 0; i < d->stop && hi > lo && s[hi - 1] == d->ch; i++) hi--;
            memmove(s, s + lo, hi - lo);
            n = hi - lo;
            s[n] = '\0';
            break;
        }
        }
    }
    t->piece[id] = s;
    t->piece_len[id] = (uint32_t)n;
    return FU_OK;
}

typedef struct tok_sortkey {
    size_t len;
    uint32_t idx;
} tok_sortkey;

static int sortkey_cmp(const void *pa, const void *pb) { /* longest first, then by index */
    const tok_sortkey *a = pa, *b = pb;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

/* Buckets the added tokens with the given `normalized` flag by first byte,
 * longest first, so that the first hit at a position is the longest match. */
static int tok_build_matcher(tok_tokenizer *t, tok_matcher *m, bool normalized) {
    size_t cnt = 0;
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len) cnt++;
    free(m->idx);
    m->idx = malloc((cnt ? cnt : 1) * sizeof *m->idx);
    tok_sortkey *keys = malloc((cnt ? cnt : 1) * sizeof *keys);
    if (!m->idx || !keys) {
        free(keys);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer matcher");
    }
    uint32_t counts[256] = {0};
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len)
            counts[(unsigned char)t->added[i].content[0]]++;
    m->start[0] = 0;
    for (int b = 0; b < 256; b++) m->start[b + 1] = m->start[b] + counts[b];
    uint32_t fill[256];
    memcpy(fill, m->start, sizeof fill);
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len) {
            uint32_t at = fill[(unsigned char)t->added[i].content[0]]++;
            keys[at] = (tok_sortkey){t->added[i].len, (uint32_t)i};
        }
    for (int b = 0; b < 256; b++)
        if (m->start[b + 1] - m->start[b] > 1)
            qsort(keys + m->start[b], m->start[b + 1] - m->start[b], sizeof *keys, sortkey_cmp);
    for (size_t i = 0; i < cnt; i++) m->idx[i] = keys[i].idx;
    free(keys);
    return FU_OK;
}

static const char *const tok_eog_texts[] = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
};

int tok__finalize(tok_tokenizer *t) {
    int rc;
    if (!t->vocab.slots && (rc = tok__build_vocab(t))) return rc;
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_tok[b] = tok__lookup(t, name, 6, false);
    }
    for (int32_t id = 0; id < t->n_vocab; id++)
        if ((t->flags[id] & TOK_F_PRESENT) && (rc = tok_make_piece(t, id))) return rc;
    /* normalized added tokens match the normalized text: normalize their content */
    t->has_norm_added = false;
    for (size_t i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        if (!a->normalized) continue;
        t->has_norm_added = true;
        char *nc;
        size_t nl;
        if ((rc = tok__normalize(t, a->content, a->len, &nc, &nl))) return rc;
        free(a->content);
        a->content = nc;
        a->len = nl;
    }
    if ((rc = tok_build_matcher(t, &t->match_raw, false))) return rc;
    if ((rc = tok_build_matcher(t, &t->match_norm, true))) return rc;
    if ((rc = tok__add_eog(t, t->eos_id))) return rc;
    if ((rc = tok__add_eog(t, t->eot_id))) return rc;
    for (size_t k = 0; k < sizeof tok_eog_texts / sizeof *tok_eog_texts; k++) {
        int32_t id = tok__lookup(t, tok_eog_texts[k], strlen(tok_eog_texts[k]), false);
        if (id >= 0 && (t->flags[id] & (TOK_F_SPECIAL | TOK_F_ADDED)) && (rc = tok__add_eog(t, id)))
            return rc;
    }
    return FU_OK;
}

/* ---- decoding -------------------------------------------------------------------- */

struct tok_decoder {
    const tok_tokenizer *t;
    bool skip_special;
    int strip_left;   /* leading spaces still to strip */
    bool any_token;   /* a token has been emitted (join-with-space decoders) */
    uint8_t hold[4];  /* bytes of an incomplete character */
    size_t n_hold;
    char *out;
    size_t out_len, out_cap;
    uint8_t *work;
    size_t work_cap;
};

static int dec_reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return FU_OK;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    char *nb = realloc(*buf, nc);
    if (!nb) return fu_errorf(FU_ERR_NOMEM, "tokenizer decode buffer");
    *buf = nb;
    *cap = nc;
    return FU_OK;
}

/* Appends complete text, applying the leading-space strip. */
static int dec_out(tok_decoder *d, const char *s, size_t n) {
    while (n && d->strip_left > 0) {
        if (s[0] != ' ') {
            d->strip_left = 0;
            break;
        }
        s++;
        n--;
        d->strip_left--;
    }
    if (!n) return FU_OK;
    d->strip_left = 0;
    int rc = dec_reserve(&d->out, &d->out_cap, d->out_len + n + 1);
    if (rc) return rc;
    memcpy(d->out + d->out_len, s, n);
    d->out_len += n;
    d->out[d->out_len] = '\0';
    return FU_OK;
}

static const char tok_fffd[] = "\xef\xbf\xbd";

/* Feeds bytes: complete characters go out, an incomplete tail is held. */
static int dec_bytes(tok_decoder *d, const char *p, size_t n) {
    size_t total = d->n_hold + n;
    if (total > d->work_cap) {
        size_t nc = d->work_cap ? d->work_cap : 64;
        while (nc < total) nc *= 2;
        uint8_t *nw = realloc(d->work, nc);
        if (!nw) return fu_errorf(FU_ERR_NOMEM, "tokenizer decode buffer");
        d->work = nw;
        d->work_cap = nc;
    }
    memcpy(d->work, d->hold, d->n_hold);
    if (n) memcpy(d->work + d->n_hold, p, n);
    d->n_hold = 0;
    size_t i = 0, run = 0; /* run: start of pending valid bytes */
    int rc;
    while (i < total) {
        size_t adv;
        int r = tok__utf8_next(d->work + i, total - i, &adv, NULL);
        if (r == 1) {
            i += adv;
            continue;
        }
        if ((rc = dec_out(d, (const char *)d->work + run, i - run))) return rc;
        if (r == 0) { /* incomplete at the end: hold */
            memcpy(d->hold, d->work + i, total - i);
            d->n_hold = total - i;
            return FU_OK;
        }
        if ((rc = dec_out(d, tok_fffd, 3))) return rc;
        i += adv;
        run = i;
    }
    return dec_out(d, (const char *)d->work + run, i - run);
}

static int dec_feed(tok_decoder *d, int32_t id) {
    const tok_tokenizer *t = d->t;
    if (id < 0 || id >= t->n_vocab || !(t->flags[id] & TOK_F_PRESENT))
        return fu_errorf(FU_ERR_RANGE, "tokenizer: id %d outside the vocabulary (size %d)", (int)id,
                         (int)t->n_vocab);
    if (d->skip_special && (t->flags[id] & TOK_F_SPECIAL)) return FU_OK;
    if (t->dec_join_space && d->any_token) {
        int rc = dec_bytes(d, " ", 1);
        if (rc) return rc;
    }
    d->any_token = true;
    return dec_bytes(d, t->piece[id], t->piece_len[id]);
}

static int dec_flush(tok_decoder *d) {
    if (!d->n_hold) return FU_OK;
    d->n_hold = 0;
    return dec_out(d, tok_fffd, 3);
}

int tok_decoder_init(const tok_tokenizer *t, bool skip_special, tok_decoder **out) {
    *out = NULL;
    if (!t) return fu_errorf(FU_ERR_INVALID, "tok_decoder_init: no tokenizer");
    tok_decoder *d = calloc(1, sizeof *d);
    if (!d) return fu_errorf(FU_ERR_NOMEM, "tokenizer decoder");
    d->t = t;
    d->skip_special = skip_special;
    d->strip_left = t->dec_strip;
    if (dec_reserve(&d->out, &d->out_cap, 64)) {
        free(d);
        return fu_errorf(FU_ERR_NOMEM, "tokenizer decoder");
    }
    d->out[0] = '\0';
    *out = d;
    return FU_OK;
}

void tok_decoder_free(tok_decoder *d) {
    if (!d) return;
    free(d->out);
    free(d->work);
    free(d);
}

void tok_decoder_reset(tok_decoder *d) {
    d->strip_left = d->t->dec_strip;
    d->any_token = false;
    d->n_hold = 0;
    d->out_len = 0;
    d->out[0] = '\0';
}

int tok_decoder_push(tok_decoder *d, int32_t id, const char **text, size_t *len) {
    d->out_len = 0;
    d->out[0] = '\0';
    int rc = dec_feed(d, id);
    *text = d->out;
    *len = rc ? 0 : d->out_len;
    return rc;
}

int tok_decoder_flush(tok_decoder *d, const char **text, size_t *len) {
    d->out_len = 0;
    d->out[0] = '\0';
    int rc = dec_flush(d);
    *text = d->out;
    *len = rc ? 0 : d->out_len;
    return rc;
}

int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
               char **text, size_t *len) {
    *text = NULL;
    if (len) *len = 0;
    if (!t || (n && !ids)) return fu_errorf(FU_ERR_INVALID, "tok_decode: bad arguments");
    tok_decoder *d;
    int rc = tok_decoder_init(t, skip_special, &d);
    if (rc) return rc;
    for (size_t i = 0; i < n && !rc; i++) rc = dec_feed(d, ids[i]);
    if (!rc) rc = dec_flush(d);
    if (rc) {
        tok_decoder_free(d);
        return rc;
    }
    *text = d->out;
    if (len) *len = d->out_len;
    d->out = NULL;
    tok_decoder_free(d);
    return FU_OK;
}

/* ---- accessors ----------------------------------------------------------------------- */

int32_t tok_vocab_size(const tok_tokenizer *t) { return t->n_vocab; }

const char *tok_token_str(const tok_tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    return t->text[id];
}

int tok_token_piece(const tok_tokenizer *t, int32_t id, const char **bytes, size_t *len) {
    if (id < 0 || id >= t->n_vocab || !(t->flags[id] & TOK_F_PRESENT))
        return fu_errorf(FU_ERR_RANGE, "tokenizer: id %d outside the vocabulary", (int)id);
    *bytes = t->piece[id];
    *len = t->piece_len[id];
    return FU_OK;
}

int32_t tok_token_id(const tok_tokenizer *t, const char *text, size_t len) {
    return tok__lookup(t, text, len, false);
}

int32_t tok_bos(const tok_tokenizer *t) { return t->bos_id; }
int32_t tok_eos(const tok_tokenizer *t) { return t->eos_id; }
int32_t tok_unk(const tok_tokenizer *t) { return t->unk_id; }
int32_t tok_pad(const tok_tokenizer *t) { return t->pad_id; }
bool tok_add_bos(const tok_tokenizer *t) { return t->add_bos; }
bool tok_add_eos(const tok_tokenizer *t) { return t->add_eos; }

bool tok_is_special(const tok_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->flags[id] & TOK_F_SPECIAL);
}

bool tok_is_eog(const tok_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && (t->flags[id] & TOK_F_EOG);
}

size_t tok_eog_ids(const tok_tokenizer *t, const int32_t **ids) {
    *ids = t->eog_ids;
    return t->n_eog;
}

const char *tok_chat_template(const tok_tokenizer *t) { return t->chat_template; }
const char *tok_bos_str(const tok_tokenizer *t) { return t->bos_str; }
const char *tok_eos_str(const tok_tokenizer *t) { return t->eos_str; }
const char *tok_kind(const tok_tokenizer *t) { return t->kind_name ? t->kind_name : "bpe"; }

void tok_free(tok_tokenizer *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (t->text) free(t->text[i]);
        if (t->piece) free(t->piece[i]);
    }
    free(t->text);
    free(t->text_len);
    free(t->flags);
    free(t->scores);
    free(t->piece);
    free(t->piece_len);
    free(t->vocab.slots);
    free(t->merges.keys);
    free(t->merges.rank);
    free(t->merges.result);
    for (size_t i = 0; i < t->n_added; i++) free(t->added[i].content);
    free(t->added);
    free(t->match_raw.idx);
    free(t->match_norm.idx);
    for (size_t i = 0; i < t->n_norm; i++) {
        free(t->norm[i].a);
        free(t->norm[i].b);
    }
    free(t->norm);
    for (size_t i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i].re);
    free(t->pre);
    for (size_t i = 0; i < t->n_dec; i++) {
        free(t->dec[i].a);
        free(t->dec[i].b);
    }
    free(t->dec);
    free(t->prefix_ids);
    free(t->suffix_ids);
    free(t->eog_ids);
    free(t->bos_str);
    free(t->eos_str);
    free(t->unk_str);
    free(t->pad_str);
    free(t->chat_template);
    free(t);
}
