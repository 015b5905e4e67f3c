/* sampler.h -- turns a row of logits into the next token: penalties, bias, temperature, top-k/p, min-p.
 *
 * A sampler holds one sequence's state (the RNG and the counts of emitted
 * tokens) and is used by one thread at a time; the free functions
 * (smp_argmax, smp_top_logprobs) are pure. Ownership: a sampler owns all its
 * scratch (allocated by smp_new) and a copy of the logit_bias entries; the
 * caller keeps ownership of smp_params and of the logits it passes in. The
 * allowed-token mask is borrowed: it must stay valid while the sampler samples
 * with those parameters (until its next smp_reset).
 */
#ifndef FU_SAMPLER_H
#define FU_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

/* The most logit_bias entries one set of parameters may hold (OpenAI's limit): the
 * sampler refuses more, and the gateway and the chain client check it before
 * sending (the wire carries at most this many). */
#define SMP_MAX_LOGIT_BIAS 300

typedef struct smp_bias {
    int32_t token;
    float bias;   /* added to the token's logit; -100 or less bans it */
} smp_bias;

typedef struct smp_params {
    float temperature;       /* 0: greedy (argmax) */
    int top_k;               /* 0: off */
    float top_p;             /* 1: off */
    float min_p;             /* 0: off */
    float presence_penalty;  /* OpenAI: subtract once if the token appeared */
    float frequency_penalty; /* OpenAI: subtract per occurrence */
    float repetition_penalty;/* 1: off; >1 divides positive logits (CTRL/HF style) */
    uint64_t seed;           /* same seed, same choices */
    const smp_bias *bias;    /* logit_bias entries, copied at smp_new */
    int n_bias;              /* 0..SMP_MAX_LOGIT_BIAS */
    const uint8_t *allowed;  /* NULL: every token; else a packed mask of the tokens that may be
                              * sampled (bit i & 7 of byte i / 8 is token i; constrained decoding),
                              * borrowed */
    size_t n_allowed;        /* its bytes: (n_vocab + 7) / 8, with at least one token allowed */
} smp_params;

typedef struct smp_sampler smp_sampler;

/* Default parameters: temperature 1, no truncation, no penalties, seed 0. */
smp_params smp_params_default(void);

/* Creates a sampler for a vocabulary of n_vocab; validates the parameters
 * (ranges, bias token ids, the allowed mask's size: FU_ERR_INVALID). All scratch is allocated here. Free with smp_free. */
int smp_new(const smp_params *p, int n_vocab, smp_sampler **out);
void smp_free(smp_sampler *s); /* NULL is a no-op */

/* Reconfigures an existing sampler for new parameters: validates them,
 * reseeds, forgets accepted tokens. Allocates only when p has more logit_bias
 * entries than any earlier configuration of this sampler. */
int smp_reset(smp_sampler *s, const smp_params *p);

/* Records that `token` (in [0, n_vocab)) was emitted (feeds the penalties). */
void smp_accept(smp_sampler *s, int32_t token);

/* Picks the next token from logits (n_vocab), which it modifies in place
 * (penalties and bias applied, tokens outside the allowed mask set to -inf, so
 * that greedy and seeded sampling both pick only allowed tokens); draws from the
 * RNG unless greedy. Never allocates. */
int32_t smp_sample(smp_sampler *s, float *logits);

/* Index of the largest value (lowest index on ties). */
int32_t smp_argmax(const float *x, int n);

/* Writes the k most likely tokens of log-softmax(logits) into ids/logprobs in
 * descending order (k <= n); returns the log-probability of `token` too when
 * token >= 0 (else 0). Does not modify logits. */
float smp_top_logprobs(const float *logits, int n, int32_t token, int k, int32_t *ids,
                       float *logprobs);

#endif
