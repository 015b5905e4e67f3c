/* sampler.c -- next-token sampling with OpenAI's and llama.cpp's knobs. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

typedef struct smp_cand {
    float p;
    int32_t id;
} smp_cand;

struct smp_sampler {
    smp_params p;
    int n_vocab;
    uint64_t rng[4];   /* xoshiro256** state */
    smp_bias *bias;    /* (cap_bias) copy of the parameters' logit_bias */
    int cap_bias;
    int32_t *counts;   /* (n_vocab) occurrences of each emitted token */
    float *prob;       /* (n_vocab) probabilities */
    smp_cand *cand;    /* (n_vocab) candidates */
};

smp_params smp_params_default(void) {
    smp_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    return p;
}

static uint64_t smp_splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t smp_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t smp_next(smp_sampler *s) {
    uint64_t *r = s->rng;
    uint64_t result = smp_rotl(r[1] * 5, 7) * 9, t = r[1] << 17;
    r[2] ^= r[0];
    r[3] ^= r[1];
    r[1] ^= r[2];
    r[0] ^= r[3];
    r[2] ^= t;
    r[3] = smp_rotl(r[3], 45);
    return result;
}

/* Uniform in [0, 1). */
static double smp_uniform(smp_sampler *s) { return (double)(smp_next(s) >> 11) * 0x1.0p-53; }

/* Checks p against a vocabulary of n_vocab. */
static int smp_params_check(const smp_params *p, int n_vocab) {
    if (!(p->temperature >= 0 && p->temperature <= 100))
        return fu_errorf(FU_ERR_INVALID, "temperature must be in [0, 100]");
    if (!(p->top_p > 0 && p->top_p <= 1)) return fu_errorf(FU_ERR_INVALID, "top_p must be in (0, 1]");
    if (!(p->min_p >= 0 && p->min_p <= 1)) return fu_errorf(FU_ERR_INVALID, "min_p must be in [0, 1]");
    if (p->top_k < 0) return fu_errorf(FU_ERR_INVALID, "top_k must be >= 0");
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return fu_errorf(FU_ERR_INVALID, "presence_penalty must be in [-2, 2]");
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return fu_errorf(FU_ERR_INVALID, "frequency_penalty must be in [-2, 2]");
    if (!(p->repetition_penalty > 0 && p->repetition_penalty <= 10))
        return fu_errorf(FU_ERR_INVALID, "repetition_penalty must be in (0, 10]");
    if (p->n_bias < 0 || (p->n_bias && !p->bias)) return fu_errorf(FU_ERR_INVALID, "logit_bias");
    if (p->n_bias > SMP_MAX_LOGIT_BIAS)
        return fu_errorf(FU_ERR_INVALID, "logit_bias: at most %d entries", SMP_MAX_LOGIT_BIAS);
    if (p->allowed) {
        size_t want = ((size_t)n_vocab + 7) / 8, any = 0;
        if (p->n_allowed != want)
            return fu_errorf(FU_ERR_INVALID, "allowed_tokens: %zu bytes for a vocabulary of %d tokens (want %zu)",
                             p->n_allowed, n_vocab, want);
        for (size_t i = 0; i < want && !any; i++) any = p->allowed[i];
        if (!any) return fu_errorf(FU_ERR_INVALID, "allowed_tokens: no token is allowed");
    }
    for (int i = 0; i < p->n_bias; i++) {
        if (p->bias[i].token < 0 || p->bias[i].token >= n_vocab)
            return fu_errorf(FU_ERR_INVALID, "logit_bias: token %d outside the vocabulary [0, %d)",
                             p->bias[i].token, n_vocab);
        if (!(p->bias[i].bias >= -100 && p->bias[i].bias <= 100))
            return fu_errorf(FU_ERR_INVALID, "logit_bias: bias for token %d must be in [-100, 100]",
                             p->bias[i].token);
    }
    return FU_OK;
}

int smp_reset(smp_sampler *s, const smp_params *p) {
    int rc = smp_params_check(p, s->n_vocab);
    if (rc) return rc;
    if (p->n_bias > s->cap_bias) {
        smp_bias *nb = realloc(s->bias, (size_t)p->n_bias * sizeof *nb);
        if (!nb) return fu_errorf(FU_ERR_NOMEM, "sampler");
        s->bias = nb;
        s->cap_bias = p->n_bias;
    }
    s->p = *p;
    if (p->n_bias) memcpy(s->bias, p->bias, (size_t)p->n_bias * sizeof *s->bias);
    s->p.bias = s->bias;
    memset(s->counts, 0, (size_t)s->n_vocab * sizeof *s->counts);
    uint64_t seed = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = smp_splitmix(&seed);
    return FU_OK;
}

int smp_new(const smp_params *p, int n_vocab, smp_sampler **out) {
    *out = NULL;
    if (n_vocab <= 0) return fu_errorf(FU_ERR_INVALID, "sampler: vocabulary size %d", n_vocab);
    int rc = smp_params_check(p, n_vocab);
    if (rc) return rc;
    smp_sampler *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "sampler");
    s->n_vocab = n_vocab;
    s->counts = calloc((size_t)n_vocab, sizeof *s->counts);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->prob = malloc((size_t)n_vocab * sizeof *s->prob);
    if (!s->counts || !s->cand || !s->prob || (rc = smp_reset(s, p))) {
        smp_free(s);
        return rc ? rc : fu_errorf(FU_ERR_NOMEM, "sampler");
    }
    *out = s;
    return FU_OK;
}

void smp_free(smp_sampler *s) {
    if (!s) return;
    free(s->counts);
    free(s->cand);
    free(s->prob);
    free(s->bias);
    free(s);
}

void smp_accept(smp_sampler *s, int32_t token) {
    if (token >= 0 && token < s->n_vocab) s->counts[token]++;
}

int32_t smp_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Descending probability, then ascending id. */
static int smp_cand_cmp(const void *a, const void *b) {
    const smp_cand *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Keeps the k best of c[0..n) in c[0..k), sorted descending. */
static void smp_partial_sort(smp_cand *c, int n, int k) {
    if (k <= 32) {
        for (int i = 0; i < k; i++) {
            int best = i;
            for (int j = i + 1; j < n; j++)
                if (smp_cand_cmp(&c[j], &c[best]) < 0) best = j;
            smp_cand t = c[i];
            c[i] = c[best];
            c[best] = t;
        }
        return;
    }
    qsort(c, (size_t)n, sizeof *c, smp_cand_cmp);
}

/* Sets the logits of the tokens outside p->allowed to -inf. */
static void smp_apply_mask(const smp_params *p, float *logits, int n) {
    for (int i = 0; i < n; i++)
        if (!((p->allowed[i >> 3] >> (i & 7)) & 1)) logits[i] = -INFINITY;
}

/* Penalties, logit_bias and the allowed mask applied to logits (n_vocab) in place. */
static void smp_adjust(const smp_sampler *s, float *logits) {
    const int n = s->n_vocab;
    const smp_params *p = &s->p;
    if (p->presence_penalty != 0 || p->frequency_penalty != 0 || p->repetition_penalty != 1) {
        for (int i = 0; i < n; i++) {
            if (!s->counts[i]) continue;
            if (p->repetition_penalty != 1)
                logits[i] = logits[i] > 0 ? logits[i] / p->repetition_penalty
                                          : logits[i] * p->repetition_penalty;
            logits[i] -= (float)s->counts[i] * p->frequency_penalty + p->presence_penalty;
        }
    }
    for (int i = 0; i < p->n_bias; i++) {
        if (p->bias[i].bias <= -100) logits[p->bias[i].token] = -INFINITY;
        else logits[p->bias[i].token] += p->bias[i].bias;
    }
    if (p->allowed) smp_apply_mask(p, logits, n);
}

int32_t smp_sample(smp_sampler *s, float *logits) {
    const int n = s->n_vocab;
    const smp_params *p = &s->p;
    smp_adjust(s, logits);
    if (p->temperature <= 0) return smp_argmax(logits, n);

    /* softmax with temperature over all tokens */
    float mx = logits[smp_argmax(logits, n)];
    if (mx == -INFINITY) return smp_argmax(logits, n);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = expf((logits[i] - mx) / p->temperature);
        sum += s->prob[i];
    }
    int m = 0;
    float pmax = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = (float)(s->prob[i] / sum);
        if (s->prob[i] > pmax) pmax = s->prob[i];
    }
    /* min-p, then top-k, then top-p (llama.cpp's order of truncations) */
    smp_cand *c = s->cand;
    for (int i = 0; i < n; i++)
        if (s->prob[i] > 0 && s->prob[i] >= p->min_p * pmax) c[m++] = (smp_cand){s->prob[i], i};
    int k = p->top_k > 0 && p->top_k < m ? p->top_k : m;
    if (k < m || p->top_p < 1) {
        smp_partial_sort(c, m, k);
        m = k;
        if (p->top_p < 1) {
            double cum = 0, total = 0;
            for (int i = 0; i < m; i++) total += c[i].p;
            for (int i = 0; i < m; i++) {
                cum += c[i].p / total;
                if (cum >= p->top_p) {
                    m = i + 1;
                    break;
                }
            }
        }
    }
    double total = 0;
    for (int i = 0; i < m; i++) total += c[i].p;
    double r = smp_uniform(s) * total, acc = 0;
    for (int i = 0; i < m; i++) {
        acc += c[i].p;
        if (r < acc) return c[i].id;
    }
    return c[m - 1].id;
}

float smp_top_logprobs(const float *logits, int n, int32_t token, int k, int32_t *ids,
                       float *logprobs) {
    float mx = logits[smp_argmax(logits, n)];
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    float lse = mx + (float)log(sum);
    /* one pass keeping the k best in ids[0..k), sorted descending */
    int have = 0;
    for (int i = 0; i < n && k > 0; i++) {
        if (have == k && !(logits[i] > logits[ids[k - 1]])) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && logits[ids[j - 1]] < logits[i]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
    for (int j = 0; j < have; j++) logprobs[j] = logits[ids[j]] - lse;
    return token >= 0 && token < n ? logits[token] - lse : 0.0f;
}
