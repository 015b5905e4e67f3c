/* grammar.h -- context-free grammars for constrained decoding: llama.cpp's GBNF, a matcher
 * advanced byte by byte, and the mask of the tokens that may come next.
 *
 * A gm_grammar (parsed from GBNF, or compiled from a JSON Schema by json-schema.h) is
 * immutable after it is made: any number of threads may read it. A gm_vocab is the
 * per-tokenizer precomputation (a trie of every token's bytes, the end-of-generation ids),
 * also immutable and shared. A gm_matcher is one generation's position in one grammar,
 * used by one thread at a time; it borrows its grammar and vocabulary, which must outlive
 * it. Ownership: every *_new returns an object the caller frees with its *_free (NULL is a
 * no-op); inputs are copied unless a comment says "borrowed".
 *
 * Semantics: the grammar is over Unicode code points written as UTF-8. The matcher is a
 * pushdown state set (llama.cpp's stacks of rule positions): it accepts a byte when some
 * stack can go on with it, holding a partial UTF-8 character between bytes. Errors are
 * FU_ERR_* statuses with fu_last_error() saying what, where and which rule.
 */
#ifndef FU_GRAMMAR_H
#define FU_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bounds: GBNF text, rules, elements, stacks a matcher follows at once and their depth. */
#define GM_MAX_TEXT (4u << 20)
#define GM_MAX_RULES 65536
#define GM_MAX_ELEMS (1u << 22)
#define GM_MAX_STACKS 512
#define GM_MAX_DEPTH 1024
#define GM_MAX_EXPAND 50000 /* rule expansions one step of a matcher may take */
#define GM_MAX_REPEAT 1000   /* most copies a {m,n} quantifier may expand into */
#define GM_MAX_TOKEN_BYTES 256 /* longer tokens are never allowed */

typedef struct gm_grammar gm_grammar;
typedef struct gm_vocab gm_vocab;
typedef struct gm_matcher gm_matcher;

/* Parses GBNF text[0..len) (rules `name ::= alternatives`; "literals", [classes], [^negated],
 * `.`, groups, `|`, `*` `+` `?` `{m}` `{m,}` `{m,n}`, `#` comments) with start rule `root`
 * (NULL: "root"). Checks that every referenced rule is defined, that no rule is left-recursive
 * and that the start rule derives some finite string. FU_ERR_INVALID with the line and column,
 * or FU_ERR_EXHAUSTED past the bounds above. On success *out is the caller's. */
int gm_grammar_parse(const char *text, size_t len, const char *root, gm_grammar **out);
void gm_grammar_free(gm_grammar *g);

/* Number of rules (after quantifiers became rules of their own). */
int gm_grammar_rules(const gm_grammar *g);

/* A vocabulary from n tokens' bytes (tokens[i], lens[i]; NULL or length 0: never allowed) and
 * the end-of-generation ids eog[0..n_eog), which are allowed only where the grammar accepts. */
int gm_vocab_new(const char *const *tokens, const size_t *lens, int n, const int32_t *eog, int n_eog,
                 gm_vocab **out);
void gm_vocab_free(gm_vocab *v);
int gm_vocab_size(const gm_vocab *v);
/* Bytes of a packed mask for this vocabulary: (size + 7) / 8, bit (i & 7) of byte i / 8 is token i. */
size_t gm_vocab_mask_bytes(const gm_vocab *v);

/* A matcher at the start of g over vocabulary v (both borrowed). It and the calls below fail
 * with FU_ERR_EXHAUSTED when one step forks into more than GM_MAX_STACKS stacks or takes more
 * than GM_MAX_EXPAND rule expansions (a grammar too ambiguous to follow). */
int gm_matcher_new(const gm_grammar *g, const gm_vocab *v, gm_matcher **out);
void gm_matcher_free(gm_matcher *m);

/* Advances over bytes s[0..n): FU_OK, or FU_ERR_INVALID (nothing changed) when the grammar
 * does not allow them here. Never allocates once the matcher has warmed up. */
int gm_matcher_accept_bytes(gm_matcher *m, const char *s, size_t n);
/* Advances over token id: its bytes, or, for an end-of-generation id, the end (FU_ERR_INVALID
 * unless the grammar accepts here; afterwards the matcher is finished). */
int gm_matcher_accept_token(gm_matcher *m, int32_t id);
/* Whether the bytes so far form a complete string of the grammar. */
bool gm_matcher_accepting(const gm_matcher *m);
/* Whether the matcher has taken an end-of-generation token. */
bool gm_matcher_finished(const gm_matcher *m);

/* Writes the tokens allowed next into mask (mask_bytes == gm_vocab_mask_bytes): a token is
 * allowed when its bytes can follow; an end-of-generation id when the grammar accepts here.
 * Walks the vocabulary's trie once with the state set, pruning dead subtrees; recent states'
 * masks are cached in the matcher. Returns the number of allowed tokens (0: a dead end), or a
 * negative status. */
int gm_matcher_mask(gm_matcher *m, uint8_t *mask, size_t mask_bytes);

#endif
