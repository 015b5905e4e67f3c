/* grammar-match.c -- a grammar's pushdown state set advanced byte by byte, the vocabulary's
 * trie and the allowed-token mask computed from both. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "grow.h"
#include "status.h"

#define GM_MAX_NEST 256   /* rule references expanded in one go before a stack is dropped */
#define GM_CACHE 16       /* masks of recent states a matcher keeps */
#define GM_DFA_STATES 4096 /* automaton states a matcher keeps before starting over */
#define GM_UNKNOWN (-1)
#define GM_DEAD (-2)

/* ---- the vocabulary ------------------------------------------------------------------------ */

typedef struct gm_node {
    uint32_t first, n;     /* children: nodes[first .. first + n), by byte */
    uint32_t tok_off, n_tok; /* tokens ending here: ids[tok_off .. tok_off + n_tok) */
    uint8_t byte;
} gm_node;

struct gm_vocab {
    int n;
    char *bytes;          /* every token's bytes back to back */
    size_t *off;          /* (n + 1) token i: bytes[off[i] .. off[i + 1]) */
    uint8_t *eog;         /* (n) end-of-generation ids */
    int32_t *eog_ids;     /* (n_eog) the same, listed */
    int n_eog;
    gm_node *nodes;       /* (n_nodes) nodes[0] is the root */
    uint32_t n_nodes, cap_nodes;
    int32_t *ids;         /* (n) token ids in trie order */
    uint32_t n_ids;
};

static const gm_vocab *gm_sort_vocab; /* qsort has no context argument; building is serialized below */

static int gm_tok_cmp(const void *a, const void *b) {
    const gm_vocab *v = gm_sort_vocab;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    size_t lx = v->off[x + 1] - v->off[x], ly = v->off[y + 1] - v->off[y];
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], lx < ly ? lx : ly);
    if (c) return c;
    return lx != ly ? (lx < ly ? -1 : 1) : (x > y) - (x < y);
}

static size_t gm_tok_len(const gm_vocab *v, int32_t id) { return v->off[id + 1] - v->off[id]; }

/* Fills node `at` from the sorted ids[lo, hi), all sharing their first d bytes. */
static int gm_trie_build(gm_vocab *v, uint32_t at, uint32_t lo, uint32_t hi, size_t d) {
    uint32_t i = lo;
    while (i < hi && gm_tok_len(v, v->ids[i]) == d) i++;
    v->nodes[at].tok_off = lo;
    v->nodes[at].n_tok = i - lo;
    uint32_t groups = 0;
    for (uint32_t k = i; k < hi; k++)
        if (k == i || v->bytes[v->off[v->ids[k]] + d] != v->bytes[v->off[v->ids[k - 1]] + d]) groups++;
    size_t cap = v->cap_nodes;
    if (fu_grow((void **)&v->nodes, &cap, (size_t)v->n_nodes + groups, sizeof *v->nodes)) return FU_ERR_NOMEM;
    v->cap_nodes = (uint32_t)cap;
    uint32_t first = v->n_nodes;
    v->nodes[at].first = first;
    v->nodes[at].n = groups;
    v->n_nodes += groups;
    for (uint32_t g = 0, k = i; g < groups; g++) {
        uint8_t byte = (uint8_t)v->bytes[v->off[v->ids[k]] + d];
        uint32_t e = k;
        while (e < hi && (uint8_t)v->bytes[v->off[v->ids[e]] + d] == byte) e++;
        memset(&v->nodes[first + g], 0, sizeof *v->nodes);
        v->nodes[first + g].byte = byte;
        int rc = gm_trie_build(v, first + g, k, e, d + 1);
        if (rc) return rc;
        k = e;
    }
    return FU_OK;
}

/* Copies the tokens' bytes and marks the end-of-generation ids. */
static int gm_vocab_fill(gm_vocab *v, const char *const *tokens, const size_t *lens, const int32_t *eog, int n_eog) {
    size_t total = 0;
    for (int i = 0; i < v->n; i++) total += tokens[i] && lens[i] <= GM_MAX_TOKEN_BYTES ? lens[i] : 0;
    v->bytes = malloc(total + 1);
    v->off = malloc(((size_t)v->n + 1) * sizeof *v->off);
    v->eog = calloc((size_t)v->n, 1);
    v->ids = malloc((size_t)v->n * sizeof *v->ids);
    if (!v->bytes || !v->off || !v->eog || !v->ids) return FU_ERR_NOMEM;
    v->eog_ids = malloc(((size_t)n_eog + 1) * sizeof *v->eog_ids);
    if (!v->eog_ids) return FU_ERR_NOMEM;
    for (int i = 0; i < n_eog; i++)
        if (eog[i] >= 0 && eog[i] < v->n && !v->eog[eog[i]]) v->eog[eog[i]] = 1, v->eog_ids[v->n_eog++] = eog[i];
    size_t at = 0;
    for (int i = 0; i < v->n; i++) {
        v->off[i] = at;
        size_t l = tokens[i] && lens[i] <= GM_MAX_TOKEN_BYTES && !v->eog[i] ? lens[i] : 0;
        if (l) memcpy(v->bytes + at, tokens[i], l);
        at += l;
        if (l) v->ids[v->n_ids++] = i;
    }
    v->off[v->n] = at;
    return FU_OK;
}

int gm_vocab_new(const char *const *tokens, const size_t *lens, int n, const int32_t *eog, int n_eog,
                 gm_vocab **out) {
    static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;
    *out = NULL;
    if (n <= 0) return fu_errorf(FU_ERR_INVALID, "grammar: empty vocabulary");
    gm_vocab *v = calloc(1, sizeof *v);
    if (!v) return fu_errorf(FU_ERR_NOMEM, "grammar: vocabulary");
    v->n = n;
    int rc = gm_vocab_fill(v, tokens, lens, eog, n_eog);
    if (!rc) {
        pthread_mutex_lock(&sort_mu);
        gm_sort_vocab = v;
        qsort(v->ids, v->n_ids, sizeof *v->ids, gm_tok_cmp);
        pthread_mutex_unlock(&sort_mu);
        size_t cap = 0;
        rc = fu_grow((void **)&v->nodes, &cap, 1, sizeof *v->nodes) ? FU_ERR_NOMEM : FU_OK;
        v->cap_nodes = (uint32_t)cap;
        if (!rc) memset(v->nodes, 0, sizeof *v->nodes), v->n_nodes = 1;
        if (!rc) rc = gm_trie_build(v, 0, 0, v->n_ids, 0);
    }
    if (rc) {
        gm_vocab_free(v);
        return fu_errorf(rc, "grammar: vocabulary: out of memory");
    }
    *out = v;
    return FU_OK;
}

void gm_vocab_free(gm_vocab *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->eog);
    free(v->eog_ids);
    free(v->nodes);
    free(v->ids);
    free(v);
}

int gm_vocab_size(const gm_vocab *v) { return v->n; }
size_t gm_vocab_mask_bytes(const gm_vocab *v) { return ((size_t)v->n + 7) / 8; }

/* ---- state sets ------------------------------------------------------------------------------ */

/* Stacks back to back as [len, pos_0 .. pos_{len-1}] (top last), without duplicates. */
typedef struct gm_set {
    uint32_t *buf;
    size_t len, cap;
    int n;
} gm_set;

/* A state of the lazily built automaton: an interned set, and its transitions as computed. */
typedef struct gm_dstate {
    size_t off, len;       /* its stack records: dfa_buf[off .. off + len) */
    int n;                 /* stacks */
    uint64_t hash;
    int wide, accepting;   /* some top set holds a code point >= 0x80; the empty stack is there */
    int32_t next[128];     /* by ASCII code point: GM_UNKNOWN, GM_DEAD or a state */
} gm_dstate;

/* A computed transition by a code point >= 0x80. */
typedef struct gm_wide_edge {
    uint64_t key;          /* (state << 21 | code point) + 1; 0: empty slot */
    int32_t to;
} gm_wide_edge;

typedef struct gm_cache_entry {
    int32_t state;         /* -1: unused */
    uint32_t cp;
    int need;
    int count;
    uint8_t *mask;
} gm_cache_entry;

struct gm_matcher {
    const gm_grammar *g;
    const gm_vocab *v;
    gm_set cur;               /* the state after the bytes so far */
    uint32_t cp;              /* a partial UTF-8 character: its bits so far ... */
    int need;                 /* ... and the continuation bytes it still needs */
    int finished;
    gm_set tmp[2];            /* accept_bytes' scratch */
    uint32_t *scr;            /* expansion frames */
    size_t cap_scr;
    long budget;              /* expansions the current step may still take */
    /* the automaton: sets met by the mask walks, interned, with their transitions; cleared when it
     * grows past GM_DFA_STATES */
    gm_dstate *ds;
    size_t n_ds, cap_ds;
    uint32_t *dfa_buf;
    size_t dfa_len, dfa_cap;
    int32_t *dhash;           /* (cap_dhash) state ids + 1 by hash; 0: empty */
    size_t cap_dhash;
    gm_wide_edge *wide;       /* (cap_wide) open addressing */
    size_t n_wide, cap_wide;
    gm_set work;              /* an advance's result before it is interned */
    gm_cache_entry cache[GM_CACHE];
    int next_slot;
};

static void gm_set_free(gm_set *s) { free(s->buf); }

static int gm_set_add(gm_set *s, const uint32_t *st, uint32_t n) {
    for (size_t i = 0; i < s->len; i += 1 + s->buf[i])
        if (s->buf[i] == n && (!n || !memcmp(s->buf + i + 1, st, n * sizeof *st))) return FU_OK;
    if (s->n >= GM_MAX_STACKS) return fu_errorf(FU_ERR_EXHAUSTED, "grammar: over %d ambiguous parses", GM_MAX_STACKS);
    if (fu_grow((void **)&s->buf, &s->cap, s->len + 1 + n, sizeof *s->buf)) return fu_errorf(FU_ERR_NOMEM, "grammar");
    s->buf[s->len] = n;
    if (n) memcpy(s->buf + s->len + 1, st, n * sizeof *st);
    s->len += 1 + n;
    s->n++;
    return FU_OK;
}

static int gm_set_copy(gm_set *dst, const gm_set *src) {
    if (fu_grow((void **)&dst->buf, &dst->cap, src->len, sizeof *dst->buf)) return fu_errorf(FU_ERR_NOMEM, "grammar");
    if (src->len) memcpy(dst->buf, src->buf, src->len * sizeof *dst->buf);
    dst->len = src->len;
    dst->n = src->n;
    return FU_OK;
}

static int gm_set_has_empty(const gm_set *s) {
    for (size_t i = 0; i < s->len; i += 1 + s->buf[i])
        if (!s->buf[i]) return 1;
    return 0;
}

/* Whether some stack's top set holds a code point >= 0x80. */
static int gm_set_wide(const gm_grammar *g, const gm_set *s) {
    for (size_t i = 0; i < s->len; i += 1 + s->buf[i])
        if (s->buf[i] && g->sets[g->elems[s->buf[i + s->buf[i]]].arg].wide) return 1;
    return 0;
}

/* ---- expansion and advance ------------------------------------------------------------------- */

/* Expands the stack scr[off .. off + n) (this frame's to change) until its top is a set or it is
 * empty, adding each result to out; a rule reference forks one stack per alternative. Stacks
 * deeper than GM_MAX_DEPTH or nested past GM_MAX_NEST references are dropped. A step that takes
 * more than m->budget expansions fails with FU_ERR_EXHAUSTED: alternatives that fork at every
 * level (a ::= b | b, b ::= c | c, ...) grow exponentially even when they end in the same stacks. */
static int gm_expand(gm_matcher *m, gm_set *out, size_t off, uint32_t n, int depth) {
    const gm_grammar *g = m->g;
    const size_t own = n;
    if (--m->budget < 0)
        return fu_errorf(FU_ERR_EXHAUSTED, "grammar: a step takes over %d rule expansions (too ambiguous)", GM_MAX_EXPAND);
    for (;;) {
        if (!n) return gm_set_add(out, NULL, 0);
        uint32_t p = m->scr[off + n - 1];
        gm_elem e = g->elems[p];
        if (e.type == GM_END) {
            n--;
            continue;
        }
        if (e.type == GM_SET) return gm_set_add(out, m->scr + off, n);
        if (g->elems[p + 1].type == GM_END) n--; /* a tail reference replaces its caller */
        else m->scr[off + n - 1] = p + 1;
        if (depth >= GM_MAX_NEST || n + 1 > GM_MAX_DEPTH) return FU_OK;
        size_t at = off + own;
        if (fu_grow((void **)&m->scr, &m->cap_scr, at + n + 1, sizeof *m->scr)) return fu_errorf(FU_ERR_NOMEM, "grammar");
        for (uint32_t a = g->rule_alt[e.arg]; a < g->rule_alt[e.arg + 1]; a++) {
            memmove(m->scr + at, m->scr + off, n * sizeof *m->scr);
            m->scr[at + n] = g->alts[a];
            int rc = gm_expand(m, out, at, n + 1, depth + 1);
            if (rc) return rc;
        }
        return FU_OK;
    }
}

/* out = the stacks of in that go on with code point c, expanded. */
static int gm_advance(gm_matcher *m, const gm_set *in, uint32_t c, gm_set *out) {
    const gm_grammar *g = m->g;
    out->len = 0;
    out->n = 0;
    m->budget = GM_MAX_EXPAND;
    for (size_t i = 0; i < in->len; i += 1 + in->buf[i]) {
        uint32_t n = in->buf[i];
        if (!n) continue;
        uint32_t top = in->buf[i + n];
        if (!gm_cset_has(g, &g->sets[g->elems[top].arg], c)) continue;
        if (fu_grow((void **)&m->scr, &m->cap_scr, n, sizeof *m->scr)) return fu_errorf(FU_ERR_NOMEM, "grammar");
        memcpy(m->scr, in->buf + i + 1, n * sizeof *m->scr);
        m->scr[n - 1] = top + 1;
        int rc = gm_expand(m, out, 0, n, 0);
        if (rc) return rc;
    }
    return FU_OK;
}

/* The state after byte c from (in, *cp, *need): 1 alive, 0 dead, < 0 an error. When the byte
 * only extends a partial character the set is unchanged (*same = 1), else it is out. */
static int gm_step_byte(gm_matcher *m, const gm_set *in, uint32_t *cp, int *need, uint8_t c, gm_set *out,
                        int *same) {
    *same = 0;
    if (*need > 0) {
        if ((c & 0xC0) != 0x80) return 0;
        *cp = (*cp << 6) | (c & 0x3Fu);
        if (--*need > 0) return *same = 1;
    } else if (c >= 0x80) {
        int n = (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : 0;
        if (!n || !gm_set_wide(m->g, in)) return 0;
        *cp = c & (0x3Fu >> n);
        *need = n;
        return *same = 1;
    } else {
        *cp = c;
    }
    int rc = gm_advance(m, in, *cp, out);
    return rc < 0 ? rc : out->n > 0;
}

/* ---- the matcher --------------------------------------------------------------------------- */

int gm_matcher_new(const gm_grammar *g, const gm_vocab *v, gm_matcher **out) {
    *out = NULL;
    gm_matcher *m = calloc(1, sizeof *m);
    if (!m) return fu_errorf(FU_ERR_NOMEM, "grammar: matcher");
    m->g = g;
    m->v = v;
    for (int i = 0; i < GM_CACHE; i++) m->cache[i].state = -1;
    uint32_t root = 0;
    m->budget = GM_MAX_EXPAND;
    int rc = fu_grow((void **)&m->scr, &m->cap_scr, 64, sizeof *m->scr) ? fu_errorf(FU_ERR_NOMEM, "grammar") : FU_OK;
    for (uint32_t a = g->rule_alt[g->root]; !rc && a < g->rule_alt[g->root + 1]; a++) {
        root = g->alts[a];
        m->scr[0] = root;
        rc = gm_expand(m, &m->cur, 0, 1, 0);
    }
    if (rc) {
        gm_matcher_free(m);
        return rc;
    }
    *out = m;
    return FU_OK;
}

void gm_matcher_free(gm_matcher *m) {
    if (!m) return;
    gm_set_free(&m->cur);
    gm_set_free(&m->tmp[0]);
    gm_set_free(&m->tmp[1]);
    gm_set_free(&m->work);
    for (int i = 0; i < GM_CACHE; i++) free(m->cache[i].mask);
    free(m->ds);
    free(m->dfa_buf);
    free(m->dhash);
    free(m->wide);
    free(m->scr);
    free(m);
}

int gm_matcher_accept_bytes(gm_matcher *m, const char *s, size_t n) {
    if (m->finished) return n ? fu_errorf(FU_ERR_INVALID, "grammar: bytes after the end") : FU_OK;
    if (!n) return FU_OK;
    int rc = gm_set_copy(&m->tmp[0], &m->cur);
    if (rc) return rc;
    uint32_t cp = m->cp;
    int need = m->need, at = 0;
    for (size_t i = 0; i < n; i++) {
        int same;
        int alive = gm_step_byte(m, &m->tmp[at], &cp, &need, (uint8_t)s[i], &m->tmp[at ^ 1], &same);
        if (alive < 0) return alive;
        if (!alive) return fu_errorf(FU_ERR_INVALID, "grammar: byte %zu (0x%02x) is not allowed here", i, (uint8_t)s[i]);
        if (!same) at ^= 1;
    }
    gm_set t = m->cur;
    m->cur = m->tmp[at];
    m->tmp[at] = t;
    m->cp = need ? cp : 0; /* only a partial character's bits are state */
    m->need = need;
    return FU_OK;
}

bool gm_matcher_accepting(const gm_matcher *m) { return m->need == 0 && gm_set_has_empty(&m->cur); }
bool gm_matcher_finished(const gm_matcher *m) { return m->finished; }

int gm_matcher_accept_token(gm_matcher *m, int32_t id) {
    const gm_vocab *v = m->v;
    if (id < 0 || id >= v->n) return fu_errorf(FU_ERR_INVALID, "grammar: token %d outside the vocabulary", id);
    if (v->eog[id]) {
        if (!m->finished && !gm_matcher_accepting(m))
            return fu_errorf(FU_ERR_INVALID, "grammar: end of generation before the grammar is complete");
        m->finished = 1;
        return FU_OK;
    }
    if (m->finished) return fu_errorf(FU_ERR_INVALID, "grammar: token after the end");
    size_t len = gm_tok_len(v, id);
    if (!len) return fu_errorf(FU_ERR_INVALID, "grammar: token %d is never allowed", id);
    return gm_matcher_accept_bytes(m, v->bytes + v->off[id], len);
}

/* ---- the automaton -------------------------------------------------------------------------- */

static uint64_t gm_hash_words(const uint32_t *w, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ w[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

/* Forgets every state and transition (and the masks cached by state). */
static void gm_dfa_clear(gm_matcher *m) {
    m->n_ds = m->dfa_len = m->n_wide = 0;
    if (m->dhash) memset(m->dhash, 0, m->cap_dhash * sizeof *m->dhash);
    if (m->wide) memset(m->wide, 0, m->cap_wide * sizeof *m->wide);
    for (int i = 0; i < GM_CACHE; i++) m->cache[i].state = -1;
}

/* Puts state id into the hash table (rebuilt twice as large when half full). */
static int gm_dhash_put(gm_matcher *m, int32_t id) {
    if (2 * (m->n_ds + 1) > m->cap_dhash) {
        size_t cap = m->cap_dhash ? 2 * m->cap_dhash : 1024;
        int32_t *h = calloc(cap, sizeof *h);
        if (!h) return fu_errorf(FU_ERR_NOMEM, "grammar");
        free(m->dhash);
        m->dhash = h;
        m->cap_dhash = cap;
        for (size_t i = 0; i < m->n_ds; i++)
            if ((int32_t)i != id) gm_dhash_put(m, (int32_t)i);
    }
    size_t i = m->ds[id].hash & (m->cap_dhash - 1);
    while (m->dhash[i]) i = (i + 1) & (m->cap_dhash - 1);
    m->dhash[i] = id + 1;
    return FU_OK;
}

/* The id of the state holding set s (added when new), or a negative status. */
static int32_t gm_intern(gm_matcher *m, const gm_set *s) {
    uint64_t h = gm_hash_words(s->buf, s->len);
    for (size_t i = m->cap_dhash ? h & (m->cap_dhash - 1) : 0; m->cap_dhash && m->dhash[i]; i = (i + 1) & (m->cap_dhash - 1)) {
        const gm_dstate *d = &m->ds[m->dhash[i] - 1];
        if (d->hash == h && d->len == s->len && !memcmp(m->dfa_buf + d->off, s->buf, s->len * sizeof *s->buf))
            return m->dhash[i] - 1;
    }
    if (fu_grow((void **)&m->ds, &m->cap_ds, m->n_ds + 1, sizeof *m->ds) ||
        fu_grow((void **)&m->dfa_buf, &m->dfa_cap, m->dfa_len + s->len, sizeof *m->dfa_buf))
        return fu_errorf(FU_ERR_NOMEM, "grammar");
    gm_dstate *d = &m->ds[m->n_ds];
    d->off = m->dfa_len;
    d->len = s->len;
    d->n = s->n;
    d->hash = h;
    d->wide = gm_set_wide(m->g, s);
    d->accepting = gm_set_has_empty(s);
    for (int c = 0; c < 128; c++) d->next[c] = GM_UNKNOWN;
    if (s->len) memcpy(m->dfa_buf + m->dfa_len, s->buf, s->len * sizeof *s->buf);
    m->dfa_len += s->len;
    int32_t id = (int32_t)m->n_ds++;
    int rc = gm_dhash_put(m, id);
    return rc ? rc : id;
}

/* The set of state id (pointing into the automaton's buffer: valid until the next intern). */
static gm_set gm_dstate_set(const gm_matcher *m, int32_t id) {
    const gm_dstate *d = &m->ds[id];
    return (gm_set){m->dfa_buf + d->off, d->len, d->len, d->n};
}

/* The slot of the wide edge `key` (found or empty). */
static gm_wide_edge *gm_wide_slot(gm_matcher *m, uint64_t key) {
    size_t i = (size_t)(key * 0x9E3779B97F4A7C15ull >> 20) & (m->cap_wide - 1);
    while (m->wide[i].key && m->wide[i].key != key) i = (i + 1) & (m->cap_wide - 1);
    return &m->wide[i];
}

static int gm_wide_put(gm_matcher *m, uint64_t key, int32_t to) {
    if (2 * (m->n_wide + 1) > m->cap_wide) {
        size_t cap = m->cap_wide ? 2 * m->cap_wide : 1024;
        gm_wide_edge *old = m->wide, *w = calloc(cap, sizeof *w);
        if (!w) return fu_errorf(FU_ERR_NOMEM, "grammar");
        size_t old_cap = m->cap_wide;
        m->wide = w;
        m->cap_wide = cap;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].key) *gm_wide_slot(m, old[i].key) = old[i];
        free(old);
    }
    gm_wide_edge *e = gm_wide_slot(m, key);
    if (!e->key) m->n_wide++;
    *e = (gm_wide_edge){key, to};
    return FU_OK;
}

/* The state after code point c from state id: computed once, then looked up. GM_DEAD when no
 * stack goes on; a status < GM_DEAD on failure. */
static int32_t gm_next(gm_matcher *m, int32_t id, uint32_t c) {
    uint64_t key = (((uint64_t)id << 21) | c) + 1;
    if (c < 128 && m->ds[id].next[c] != GM_UNKNOWN) return m->ds[id].next[c];
    if (c >= 128 && m->cap_wide) {
        gm_wide_edge *e = gm_wide_slot(m, key);
        if (e->key) return e->to;
    }
    gm_set in = gm_dstate_set(m, id);
    int rc = gm_advance(m, &in, c, &m->work);
    if (rc) return rc < GM_DEAD ? rc : FU_ERR_INTERNAL;
    int32_t to = m->work.n ? gm_intern(m, &m->work) : GM_DEAD;
    if (to < GM_DEAD) return to;
    if (c < 128) m->ds[id].next[c] = to;
    else if ((rc = gm_wide_put(m, key, to))) return rc;
    return to;
}

/* ---- the mask ------------------------------------------------------------------------------ */

/* The state after byte b from (id, *cp, *need), as gm_step_byte but over the automaton. */
static int32_t gm_next_byte(gm_matcher *m, int32_t id, uint32_t *cp, int *need, uint8_t b) {
    if (*need > 0) {
        if ((b & 0xC0) != 0x80) return GM_DEAD;
        *cp = (*cp << 6) | (b & 0x3Fu);
        return --*need > 0 ? id : gm_next(m, id, *cp);
    }
    if (b < 0x80) return gm_next(m, id, *cp = b);
    int n = (b >> 5) == 6 ? 1 : (b >> 4) == 14 ? 2 : (b >> 3) == 30 ? 3 : 0;
    if (!n || !m->ds[id].wide) return GM_DEAD;
    *cp = b & (0x3Fu >> n);
    *need = n;
    return id;
}

/* Walks node's children from state (id, cp, need) at depth d, marking the tokens whose bytes
 * stay alive; dead subtrees are skipped. */
static int gm_walk(gm_matcher *m, const gm_node *node, int d, int32_t id, uint32_t cp, int need, uint8_t *mask,
                   int *count) {
    const gm_vocab *v = m->v;
    for (uint32_t k = 0; k < node->n; k++) {
        const gm_node *c = &v->nodes[node->first + k];
        uint32_t cp2 = cp;
        int need2 = need;
        int32_t to = gm_next_byte(m, id, &cp2, &need2, c->byte);
        if (to == GM_DEAD) continue;
        if (to < GM_DEAD) return to;
        for (uint32_t t = 0; t < c->n_tok; t++) {
            int32_t tok = v->ids[c->tok_off + t];
            mask[tok >> 3] |= (uint8_t)(1u << (tok & 7));
        }
        *count += (int)c->n_tok;
        if (c->n && d + 1 < GM_MAX_TOKEN_BYTES) {
            int rc = gm_walk(m, c, d + 1, to, cp2, need2, mask, count);
            if (rc) return rc;
        }
    }
    return FU_OK;
}

static gm_cache_entry *gm_cache_find(gm_matcher *m, int32_t id) {
    for (int i = 0; i < GM_CACHE; i++) {
        gm_cache_entry *e = &m->cache[i];
        if (e->state == id && e->cp == m->cp && e->need == m->need) return e;
    }
    return NULL;
}

/* Stores mask under state (id, cp, need) (best effort: a failed allocation just skips it). */
static void gm_cache_put(gm_matcher *m, int32_t id, const uint8_t *mask, size_t mask_bytes, int count) {
    gm_cache_entry *e = &m->cache[m->next_slot];
    m->next_slot = (m->next_slot + 1) % GM_CACHE;
    e->state = -1;
    if (!e->mask && !(e->mask = malloc(mask_bytes))) return;
    memcpy(e->mask, mask, mask_bytes);
    *e = (gm_cache_entry){id, m->cp, m->need, count, e->mask};
}

/* The end-of-generation ids, allowed when the grammar accepts here. */
static int gm_mask_eog(const gm_matcher *m, uint8_t *mask) {
    if (!gm_matcher_accepting(m)) return 0;
    for (int i = 0; i < m->v->n_eog; i++) mask[m->v->eog_ids[i] >> 3] |= (uint8_t)(1u << (m->v->eog_ids[i] & 7));
    return m->v->n_eog;
}

int gm_matcher_mask(gm_matcher *m, uint8_t *mask, size_t mask_bytes) {
    if (mask_bytes != gm_vocab_mask_bytes(m->v))
        return fu_errorf(FU_ERR_INVALID, "grammar: mask of %zu bytes for %d tokens", mask_bytes, m->v->n);
    memset(mask, 0, mask_bytes);
    if (m->finished) return 0;
    if (m->n_ds > GM_DFA_STATES) gm_dfa_clear(m);
    int32_t id = gm_intern(m, &m->cur);
    if (id < 0) return id;
    gm_cache_entry *e = gm_cache_find(m, id);
    if (e) {
        memcpy(mask, e->mask, mask_bytes);
        return e->count;
    }
    int count = 0;
    int rc = gm_walk(m, &m->v->nodes[0], 0, id, m->cp, m->need, mask, &count);
    if (rc) return rc;
    count += gm_mask_eog(m, mask);
    gm_cache_put(m, id, mask, mask_bytes, count);
    return count;
}
