/* chain.c -- fusion-chain: generates through a chain of shard servers (tests, latency figures). */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chain.h"
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
    int rc = chain_session_open(j->client, j->hops, j->n_hops, id, j->n_prompt + j->max_tokens, &s);
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

int main(int argc, char **argv) {
    chain_hop hops[MAX_HOPS];
    char *hop_addr[MAX_HOPS] = {0};
    int n_hops = 0, sessions = 1, max_tokens = 16, json = 0;
    const char *prompt_ids = NULL, *logits_prefix = NULL;
    chain_options co = {0};
    co.secret = getenv("FUSION_SECRET");
    smp_params sp = smp_params_default();
    sp.temperature = 0;
    static const struct option opts[] = {
        {"hop", required_argument, 0, 'H'},       {"secret", required_argument, 0, 's'},
        {"tls-ca", required_argument, 0, 'C'},    {"insecure", no_argument, 0, 'i'},
        {"forward", no_argument, 0, 'f'},         {"wire", required_argument, 0, 'w'},
        {"prompt-ids", required_argument, 0, 'p'}, {"max-tokens", required_argument, 0, 'n'},
        {"sessions", required_argument, 0, 'S'},  {"temperature", required_argument, 0, 't'},
        {"seed", required_argument, 0, 'e'},      {"logits-out", required_argument, 0, 'L'},
        {"json", no_argument, 0, 'j'},            {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'H': { /* ADDRESS:FIRST:LAST, address may hold colons (host:port) */
            if (n_hops == MAX_HOPS) goto bad;
            char *s = strdup(optarg), *b = strrchr(s, ':');
            if (!b) { free(s); goto bad; }
            *b = '\0';
            char *a2 = strrchr(s, ':');
            if (!a2) { free(s); goto bad; }
            *a2 = '\0';
            hops[n_hops] = (chain_hop){s, atoi(a2 + 1), atoi(b + 1), NULL};
            hop_addr[n_hops++] = s;
            break;
        }
        case 's': co.secret = optarg; break;
        case 'C': co.tls_ca = optarg; break;
        case 'i': co.insecure = true; break;
        case 'f': co.forward = true; break;
        case 'w':
            if (!strcmp(optarg, "f32")) co.wire_dtype = WIRE_F32;
            else if (!strcmp(optarg, "bf16")) co.wire_dtype = WIRE_BF16;
            else if (!strcmp(optarg, "f16")) co.wire_dtype = WIRE_F16;
            else if (!strcmp(optarg, "int8")) co.wire_dtype = WIRE_INT8_BLOCK;
            else goto bad;
            break;
        case 'p': prompt_ids = optarg; break;
        case 'n': max_tokens = atoi(optarg); break;
        case 'S': sessions = atoi(optarg); break;
        case 't': sp.temperature = strtof(optarg, NULL); break;
        case 'e': sp.seed = strtoull(optarg, NULL, 10); break;
        case 'L': logits_prefix = optarg; break;
        case 'j': json = 1; break;
        default:
        bad:
            fprintf(stderr, "usage: fusion-chain --hop HOST:PORT:FIRST:LAST ... --prompt-ids 1,2,3 "
                            "[--secret S] [--insecure | --tls-ca F] [--forward] [--wire f32|bf16|f16|int8] "
                            "[--max-tokens N] [--sessions K] [--temperature T --seed S] "
                            "[--logits-out PREFIX] [--json]\n");
            return 2;
        }
    }
    int32_t *prompt = NULL;
    size_t n_prompt_z = 0;
    if (!n_hops || !prompt_ids || fu_parse_ids(prompt_ids, &prompt, &n_prompt_z) || n_prompt_z > 1000000 ||
        max_tokens < 1 ||
        sessions < 1 || sessions > MAX_SESSIONS)
        goto bad;
    int n_prompt = (int)n_prompt_z;
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
                   calloc((size_t)max_tokens, sizeof(double)), {{{0}, 0, 0, 0, 0, 0}}, 0};
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
    for (int i = 0; i < n_hops; i++) free(hop_addr[i]);
    free(prompt);
    return status;
}
