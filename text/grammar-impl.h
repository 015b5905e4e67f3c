/* grammar-impl.h -- the compiled form of a grammar, shared by its parser and its matcher.
 *
 * Internal to text/ (tests may include it). Immutable once gm_grammar_parse returns.
 * Each rule is a list of alternatives; an alternative is a run of elements in `elems`
 * ending with GM_END. A position is an index into `elems`.
 */
#ifndef FU_GRAMMAR_IMPL_H
#define FU_GRAMMAR_IMPL_H

#include <stdint.h>

#include "grammar.h"

enum { GM_END = 0, GM_SET = 1, GM_REF = 2 };

typedef struct gm_elem {
    uint32_t type : 2;  /* GM_END, GM_SET (arg: a char set) or GM_REF (arg: a rule) */
    uint32_t arg : 30;
} gm_elem;

/* A set of code points: sorted, disjoint inclusive ranges, and a bitmap of its ASCII part. */
typedef struct gm_cset {
    uint32_t ascii[4];
    uint32_t off, n;    /* ranges[off .. off + n) */
    int wide;           /* holds some code point >= 0x80 */
} gm_cset;

struct gm_grammar {
    gm_elem *elems;       /* (n_elems) */
    uint32_t n_elems;
    uint32_t *alts;       /* (n_alts) the first position of each alternative */
    uint32_t *rule_alt;   /* (n_rules + 1) rule r's alternatives: alts[rule_alt[r] .. rule_alt[r + 1]) */
    int n_rules;
    gm_cset *sets;        /* (n_sets) */
    uint32_t *ranges;     /* (2 * total ranges) lo, hi pairs */
    int root;
};

/* Sorts and merges the inclusive code point ranges r[0..2n) (lo, hi pairs) in place; returns
 * how many pairs remain. */
size_t gm_ranges_norm(uint32_t *r, size_t n);
/* Writes the complement over [0, 0x10FFFF] of normalized pairs r[0..2n) into out (room for
 * 2n + 2 entries); returns its pair count. */
size_t gm_ranges_not(const uint32_t *r, size_t n, uint32_t *out);

/* Whether char set s of g holds code point c. */
static inline int gm_cset_has(const gm_grammar *g, const gm_cset *s, uint32_t c) {
    if (c < 128) return (int)((s->ascii[c >> 5] >> (c & 31)) & 1u);
    if (!s->wide) return 0;
    const uint32_t *r = g->ranges + 2 * (size_t)s->off;
    uint32_t lo = 0, hi = s->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (c < r[2 * mid]) hi = mid;
        else if (c > r[2 * mid + 1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

#endif
