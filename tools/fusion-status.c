/* fusion-status.c -- `fusion status`: a gateway's health and swarm as a terminal table.
 *
 * GET /health (200 ok, or 503 with the reason) and GET /v1/swarm: one row per member (address,
 * span, state, device, tokens/s, KV free/total), then the flow on each hop of the router's plan.
 * Threading: one thread. Ownership: the JSON documents are freed here.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format.h"
#include "fusion-cli.h"
#include "options.h"
#include "status.h"

typedef struct fz_status_args {
    char *url, *api_key;
    int json;
} fz_status_args;

static fz_status_args sta;

static const fu_opt fz_status_options[] = {
    {"url", 0, FU_OPT_STRING, FU_OPT_TO(sta.url), "URL", "the gateway (default $FUSION_URL, else\n" FZ_DEFAULT_URL ")"},
    {"api-key", 0, FU_OPT_STRING, FU_OPT_TO(sta.api_key), "KEY", "bearer token (default $FUSION_API_KEY)"},
    {"json", 0, FU_OPT_FLAG, FU_OPT_TO(sta.json), .help = "print /v1/swarm as JSON instead of the table"},
    FU_OPT_END,
};

static const fu_opt_spec fz_status_spec = {
    "fusion status",
    "usage: fusion status [options]\n"
    "Shows a gateway's health (GET /health) and its swarm (GET /v1/swarm) as a table:\n"
    "each shard's address, span, state, device, tokens/s and free/total KV cache, then\n"
    "the flow on each hop.\n",
    fz_status_options,
    "\nExit status: 0 healthy; 1 the gateway cannot be reached or asked; 2 a usage error;\n"
    "4 the gateway answers but cannot serve (its /health is 503).\n"
    "Environment: FUSION_URL, FUSION_API_KEY.\n"};

/* "a:b", "spare" or "-" for a member's span. */
static void fz_status_span(const json_t *m, char *out, size_t cap) {
    const json_t *span = json_object_get(m, "span");
    if (json_is_array(span))
        snprintf(out, cap, "%lld:%lld", (long long)json_integer_value(json_array_get(span, 0)),
                 (long long)json_integer_value(json_array_get(span, 1)));
    else snprintf(out, cap, "%s", json_is_string(span) ? json_string_value(span) : "-");
}

/* "free / total" of a member's KV cache, or "-". */
static void fz_status_kv(const json_t *m, char *out, size_t cap) {
    const json_t *fr = json_object_get(m, "free_kv_bytes"), *tot = json_object_get(m, "total_kv_bytes");
    char a[32], b[32];
    if (!json_is_integer(fr) || !json_is_integer(tot)) {
        snprintf(out, cap, "-");
        return;
    }
    fu_format_bytes((double)json_integer_value(fr), a, sizeof a);
    fu_format_bytes((double)json_integer_value(tot), b, sizeof b);
    snprintf(out, cap, "%s / %s", a, b);
}

/* One row per member of /v1/swarm. */
static void fz_status_members(const json_t *swarm) {
    const json_t *servers = json_object_get(swarm, "servers"), *m;
    size_t i;
    printf("%-22s %-8s %-10s %-28s %9s  %s\n", "ADDRESS", "SPAN", "STATE", "DEVICE", "TOK/S", "KV FREE / TOTAL");
    json_array_foreach(servers, i, m) {
        char span[32], kv[80], tps[32] = "-";
        fz_status_span(m, span, sizeof span);
        fz_status_kv(m, kv, sizeof kv);
        const json_t *t = json_object_get(m, "tokens_per_s");
        if (json_is_number(t)) snprintf(tps, sizeof tps, "%.1f", json_number_value(t));
        printf("%-22s %-8s %-10s %-28.28s %9s  %s\n", fz_str(m, "address", "?"), span, fz_str(m, "state", "-"),
               fz_str(m, "device", "-"), tps, kv);
    }
    if (!json_array_size(servers)) printf("(no shards)\n");
}

/* The hops of the flow: along the chain from the gateway first, then any others. */
static void fz_status_hops(const json_t *flow) {
    size_t n = json_array_size(flow);
    char *done = calloc(n + 1, 1);
    const char *from = "gateway";
    for (size_t shown = 0; done && shown < n; shown++) {
        size_t pick = n;
        for (size_t i = 0; i < n && pick == n; i++)
            if (!done[i] && !strcmp(fz_str(json_array_get(flow, i), "from", ""), from)) pick = i;
        for (size_t i = 0; i < n && pick == n; i++) /* a branch: the first hop not shown */
            if (!done[i]) pick = i;
        const json_t *hop = json_array_get(flow, pick);
        printf("  %-22s -> %-22s %9.1f tokens/s\n", fz_str(hop, "from", "?"), fz_str(hop, "to", "?"),
               json_number_value(json_object_get(hop, "tokens_per_s")));
        done[pick] = 1;
        from = fz_str(hop, "to", "");
    }
    free(done);
}

/* The summary line and the flow on each hop. */
static void fz_status_flow(const json_t *swarm) {
    if (!strcmp(fz_str(swarm, "mode", ""), "static")) {
        printf("\na static chain (no router)\n");
        return;
    }
    printf("\nblocks %lld, uncovered %lld, %lld active, %lld spare; max flow %.1f tokens/s\n",
           (long long)json_integer_value(json_object_get(swarm, "n_layers")),
           (long long)json_integer_value(json_object_get(swarm, "uncovered_blocks")),
           (long long)json_integer_value(json_object_get(swarm, "active")),
           (long long)json_integer_value(json_object_get(swarm, "spares")),
           json_number_value(json_object_get(swarm, "max_flow")));
    const json_t *plan = json_object_get(swarm, "planner");
    if (plan)
        printf("planned %.1f decode tokens/s for %.0f-token prompts and %.0f-token outputs (%lld members profiled)\n",
               json_number_value(json_object_get(plan, "decode_tokens_per_s")),
               json_number_value(json_object_get(plan, "prompt_tokens")),
               json_number_value(json_object_get(plan, "output_tokens")),
               (long long)json_integer_value(json_object_get(plan, "profiled_members")));
    fz_status_hops(json_object_get(swarm, "flow"));
}

/* Asks the gateway and prints; the exit status. */
static int fz_status_show(fz_http *h, const fz_status_args *a) {
    long status = 0;
    json_t *health = NULL, *swarm = NULL;
    int hrc = fz_http_json(h, "/health", NULL, &status, &health);
    char reason[300];
    snprintf(reason, sizeof reason, "%s", hrc ? fu_last_error() : "ok");
    if (hrc && !status) {
        json_decref(health);
        return fprintf(stderr, "fusion status: %s\n", reason), FZ_EXIT_FAIL;
    }
    int rc = fz_http_json(h, "/v1/swarm", NULL, &status, &swarm);
    if (rc) fprintf(stderr, "fusion status: GET /v1/swarm: %s\n", fu_last_error());
    else if (a->json) json_dumpf(swarm, stdout, JSON_INDENT(2)), printf("\n");
    else {
        printf("%s  health: %s\n\n", h->base, reason);
        fz_status_members(swarm);
        fz_status_flow(swarm);
    }
    json_decref(health);
    json_decref(swarm);
    return rc ? FZ_EXIT_FAIL : hrc ? 4 : FZ_EXIT_OK;
}

int fz_status_main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&fz_status_spec, argc, argv, &n);
    if (status < 0 && n) status = fu_opt_fail(&fz_status_spec, "no arguments expected ('%s')", argv[1]);
    if (status >= 0) return fu_opt_free(fz_status_options), status;
    fz_http h;
    if (fz_http_init(&h, sta.url, sta.api_key)) status = (fprintf(stderr, "fusion status: out of memory\n"), 1);
    else status = fz_status_show(&h, &sta);
    fz_http_free(&h);
    fu_opt_free(fz_status_options);
    return status;
}
