/* chain.c -- fusion-chain: generates through a chain of shard servers (tests, latency figures). */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chain.h"
#include "options.h"
#include "parse.h"
#include "status.h"
#include "wire.h"

#define MAX_HOPS 16
#define MAX_SESSIONS 64

typedef struct job {
    chain_client *client;
    const chain_hop *hops;
    int n_hops;
    int idx;
    int32_t *prompt;
    int n_prompt;
    int max_tokens;
    smp_params sp;
    const char *logits_prefix;
    int rc;
    char err[512];
    int32_t *gen;
    int n_gen;
    double *step_us; /* per decode step */
    chain_timing last_timing[MAX_HOPS];
    int n_timing;
} job;

static void *run_job(void *arg) {
    job *j = arg;
    char id[64];
    snprintf(id, sizeof id, "chain-%d-%d", (int)getpid(), j->idx);
    chain_session *s = NULL;
    FILE *lf = NULL;
    int rc = chain_session_open(j->client, j->hops, j->n_hops, id, j->n_prompt + j->max_tokens, NULL, &s);
    if (!rc && j->logits_prefix) {
        char path[4096];
        snprintf(path, sizeof path, "%s.%d.bin", j->logits_prefix, j->idx);
        if (!(lf = fopen(path, "wb"))) rc = fu_errorf(FU_ERR_IO, "%s: %s", path, strerror(errno));
    }
    chain_spec spec = {.want_logits = lf != NULL, .all_positions = true, .sample = true, .sampling = j->sp};
    const chain_result *r;
    const int32_t *in = j->prompt;
    int n = j->n_prompt;
    for (int i = 0; !rc && i < j->max_tokens; i++) {
        spec.all_positions = lf && i == 0;
        if ((rc = chain_session_step(s, in, n, -1, &spec, &r))) break;
        if (lf) fwrite(r->logits, sizeof(float), (size_t)r->n_out * (size_t)r->vocab, lf);
        j->gen[j->n_gen++] = r->tokens[r->n_out - 1];
        if (i > 0) j->step_us[i - 1] = (double)r->total_us;
        j->n_timing = r->n_timing < MAX_HOPS ? r->n_timing : MAX_HOPS;
        memcpy(j->last_timing, r->timing, (size_t)j->n_timing * sizeof *r->timing);
        in = &j->gen[j->n_gen - 1];
        n = 1;
    }
    if (rc) snprintf(j->err, sizeof j->err, "%s", fu_last_error());
    if (lf) fclose(lf);
    chain_session_close(s);
    j->rc = rc;
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What the command line gives. */
typedef struct chain_args {
    chain_hop hops[MAX_HOPS];
    int n_hops;
    char *secret, *tls_ca, *prompt_ids, *logits_prefix;
    chain_options co;
    int sessions, max_tokens;
    bool json;
    smp_params sp;
} chain_args;

static chain_args args;

/* --hop ADDRESS:FIRST:LAST (the address may hold colons: host:port). */
static int add_hop(void *ctx, const char *v) {
    chain_args *a = ctx;
    if (a->n_hops == MAX_HOPS) return fu_errorf(FU_ERR_INVALID, "at most %d hops", MAX_HOPS);
    char *address;
    int span[2];
    int rc = fu_opt_split_span(v, 1000000, &address, span);
    if (!rc) a->hops[a->n_hops++] = (chain_hop){address, span[0], span[1], NULL};
    return rc;
}

static const fu_opt_choice wire_choices[] = {
    {"f32", WIRE_F32}, {"bf16", WIRE_BF16}, {"f16", WIRE_F16}, {"int8", WIRE_INT8_BLOCK}, {NULL, 0}};

static const fu_opt chain_opts[] = {
    {"hop", 0, FU_OPT_CALL, .dest = &args, .fn = add_hop, .arg = "HOST:PORT:FIRST:LAST",
     .help = "a shard and its span, in chain order (repeatable)"},
    {"prompt-ids", 0, FU_OPT_STRING, FU_OPT_TO(args.prompt_ids), "1,2,3", "the prompt's token ids"},
    {"secret", 0, FU_OPT_STRING, FU_OPT_TO(args.secret), "S", "swarm secret (default: env FUSION_SECRET)"},
    {"tls-ca", 0, FU_OPT_STRING, FU_OPT_TO(args.tls_ca), "F", "the shards' CA"},
    {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(args.co.insecure), .help = "plaintext to loopback shards"},
    {"forward", 0, FU_OPT_FLAG, FU_OPT_TO(args.co.forward), .help = "server-to-server forwarding"},
    {"wire", 0, FU_OPT_CHOICE, FU_OPT_TO(args.co.wire_dtype), .help = "activations on the wire (default bf16)",
     .choices = wire_choices},
    {"max-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.max_tokens), .help = "tokens to generate", .def = "16", .lo = 1,
     .hi = 1 << 20},
    {"sessions", 0, FU_OPT_INT, FU_OPT_TO(args.sessions), "K", "concurrent sessions", .def = "1", .lo = 1,
     .hi = MAX_SESSIONS},
    {"temperature", 0, FU_OPT_FLOAT, FU_OPT_TO(args.sp.temperature), "T", "0 = greedy", .def = "0"},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.sp.seed), "S", "session i samples with seed S + i", .lo = 0,
     .hi = LONG_MAX},
    {"logits-out", 0, FU_OPT_STRING, FU_OPT_TO(args.logits_prefix), "PREFIX",
     "write each session's f32 logits to PREFIX.I.bin"},
    {"json", 0, FU_OPT_FLAG, FU_OPT_TO(args.json), .help = "print the results as JSON"},
    FU_OPT_END,
};

static const fu_opt_spec chain_cli = {
    "fusion-chain", "usage: fusion-chain --hop HOST:PORT:FIRST:LAST ... --prompt-ids 1,2,3 [options]",
    chain_opts, NULL};

/* Runs the sessions and prints their results; the exit status. */
static int run_chain(const chain_args *a, const int32_t *prompt, int n_prompt) {
    chain_options co = a->co;
    co.secret = a->secret ? a->secret : getenv("FUSION_SECRET");
    co.tls_ca = a->tls_ca;
    const chain_hop *hops = a->hops;
    const int n_hops = a->n_hops, sessions = a->sessions, max_tokens = a->max_tokens;
    const bool json = a->json;
    const char *logits_prefix = a->logits_prefix;
    const smp_params sp = a->sp;
    chain_client *client;
    if (chain_client_new(&co, &client)) {
        fprintf(stderr, "fusion-chain: %s\n", fu_last_error());
        return 1;
    }
    job jobs[MAX_SESSIONS];
    pthread_t th[MAX_SESSIONS];
    for (int i = 0; i < sessions; i++) {
        job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        *j = (job){client, hops, n_hops, i, malloc((size_t)n_prompt * sizeof(int32_t)), n_prompt, max_tokens, sp,
                   logits_prefix, 0, "", calloc((size_t)max_tokens, sizeof(int32_t)), 0,
                   calloc((size_t)max_tokens, sizeof(double)), {{{0}, 0, 0, 0, 0, 0, 0}}, 0};
        /* session i sees the prompt rotated by i, so concurrent sessions differ */
        for (int k = 0; k < n_prompt; k++) j->prompt[k] = prompt[(k + i) % n_prompt];
        j->sp.seed = sp.seed + (uint64_t)i;
        pthread_create(&th[i], NULL, run_job, j);
    }
    int status = 0;
    if (json) printf("{\"sessions\": [");
    for (int i = 0; i < sessions; i++) {
        pthread_join(th[i], NULL);
        job *j = &jobs[i];
        if (j->rc) {
            fprintf(stderr, "fusion-chain: session %d: %s\n", i, j->err);
            status = 1;
        }
        int n_steps = j->n_gen > 1 ? j->n_gen - 1 : 0;
        qsort(j->step_us, (size_t)n_steps, sizeof(double), cmp_double);
        double mean = 0;
        for (int k = 0; k < n_steps; k++) mean += j->step_us[k] / n_steps;
        if (json) {
            printf("%s{\"ok\": %s, \"tokens\": [", i ? ", " : "", j->rc ? "false" : "true");
            for (int k = 0; k < j->n_gen; k++) printf("%s%d", k ? ", " : "", j->gen[k]);
            printf("], \"step_us_mean\": %.1f, \"step_us_p50\": %.1f, \"hops\": [", mean,
                   n_steps ? j->step_us[n_steps / 2] : 0.0);
            for (int k = 0; k < j->n_timing; k++)
                printf("%s{\"server\": \"%s\", \"first\": %d, \"last\": %d, \"queue_us\": %lld, "
                       "\"compute_us\": %lld, \"total_us\": %lld}",
                       k ? ", " : "", j->last_timing[k].server, j->last_timing[k].first_block,
                       j->last_timing[k].last_block, (long long)j->last_timing[k].queue_us,
                       (long long)j->last_timing[k].compute_us, (long long)j->last_timing[k].total_us);
            printf("]}");
        } else {
            for (int k = 0; k < j->n_gen; k++) printf("%s%d", k ? "," : "", j->gen[k]);
            printf("\n");
        }
        free(j->prompt);
        free(j->gen);
        free(j->step_us);
    }
    if (json) printf("]}\n");
    chain_client_free(client);
    return status;
}

int main(int argc, char **argv) {
    args.sp = smp_params_default();
    int status = fu_opt_main(&chain_cli, argc, argv, NULL);
    int32_t *prompt = NULL;
    size_t n_prompt_z = 0;
    if (status < 0 && (!args.n_hops || !args.prompt_ids || fu_parse_ids(args.prompt_ids, &prompt, &n_prompt_z) ||
                       n_prompt_z > 1000000))
        status = fu_opt_fail(&chain_cli, "give --hop and --prompt-ids (at most 1000000 token ids)");
    if (status < 0) status = run_chain(&args, prompt, (int)n_prompt_z);
    free(prompt);
    for (int i = 0; i < args.n_hops; i++) free((char *)args.hops[i].address);
    fu_opt_free(chain_opts);
    return status;
}
