/* gw.h -- fusion-gateway's internal interface: buffers, errors, request parsing, stop strings, SSE, config, metrics.
 *
 * The pieces here are pure (no network, no model) so that the unit tests can
 * drive them directly; gw-gen.h (generation over a shard chain) and
 * gw-http.h (the libmicrohttpd server) build on them.
 *
 * Threading: nothing here holds hidden state; a request, a stop matcher or a
 * configuration is used by one thread at a time. The metrics are the shared
 * exception: every gw_metrics_* call is thread-safe.
 * Ownership: a struct filled here owns what it points to (strings are copied)
 * unless a field says "borrowed", and is released by its _free function.
 */
#ifndef FU_GW_H
#define FU_GW_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "grammar.h"
#include "options.h"
#include "sampler.h"

/* ---- UTF-8 ------------------------------------------------------------------------ */

/* Length of the longest prefix of s[0..len) that ends on a complete UTF-8 character
 * boundary (a trailing incomplete sequence is excluded). Invalid bytes count as one
 * character each. */
size_t gw_utf8_complete_prefix(const char *s, size_t len);
/* Whether s[0..len) is valid UTF-8 (no overlongs, surrogates or values > U+10FFFF). */
bool gw_utf8_valid(const char *s, size_t len);
/* A JSON string of s[0..len) with each invalid sequence replaced by U+FFFD
 * (new reference, NULL only on allocation failure). */
json_t *gw_json_string_lossy(const char *s, size_t len);

/* ---- seeds ------------------------------------------------------------------------ */

/* The sampling seed of one step: a deterministic mix of the request seed, the
 * choice index and the position in the sequence, so that the same seed gives the
 * same output however steps are batched or scheduled. */
uint64_t gw_step_seed(uint64_t seed, int choice, int64_t position);

/* ---- errors (OpenAI's shape) --------------------------------------------------------- */

typedef struct gw_error {
    int http;            /* HTTP status, 0: no error */
    char message[512];
    const char *type;    /* "invalid_request_error", "authentication_error", ... */
    char param[64];      /* "" when none */
    const char *code;    /* NULL when none */
} gw_error;

/* Fills *e (http, type chosen from the status, message from fmt). Returns e->http. */
int gw_error_set(gw_error *e, int http, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* {"error": {"message", "type", "param", "code"}} as a new malloc'd string. */
char *gw_error_json(const gw_error *e);
/* The same as a JSON object (new reference). */
json_t *gw_error_object(const gw_error *e);
/* Makes *e fit for a client, at the gateway's boundary (HTTP bodies, stream error events):
 * a server error (5xx) may carry internal details (a shard's address, a library's error
 * text), so its message becomes a fixed one chosen by its code ("a shard of the swarm is
 * unavailable; retry later") and the original goes to the log under `id` (NULL: none).
 * Other errors are left as they are. Idempotent. */
void gw_error_public(gw_error *e, const char *id);

/* ---- requests ------------------------------------------------------------------------ */

typedef enum gw_kind {
    GW_KIND_CHAT = 0,   /* /v1/chat/completions */
    GW_KIND_COMPLETION, /* /v1/completions */
    GW_KIND_TEMPLATE,   /* /apply-template: a chat whose `model` may be left out (parsed as GW_KIND_CHAT) */
} gw_kind;

/* Bounds on what one request may ask for. */
typedef struct gw_limits {
    int max_n;               /* choices per prompt */
    int max_choices;         /* prompts x n */
    int max_prompts;         /* entries of a completions prompt list */
    int max_stop;            /* stop strings */
    int max_stop_bytes;      /* bytes per stop string */
    int max_logit_bias;      /* logit_bias entries (at most SMP_MAX_LOGIT_BIAS) */
    int max_top_logprobs;    /* top_logprobs / integer logprobs */
    int max_messages;        /* chat messages */
    int max_request_tokens;  /* positions a request may have computed: (prompt + max_tokens) x
                              * choices, summed over its prompts; 0: no bound beyond the context */
} gw_limits;

/* Fills *l with the default bounds (logit_bias: SMP_MAX_LOGIT_BIAS, the sampler's own). */
void gw_limits_default(gw_limits *l);

typedef struct gw_prompt {
    char *text;        /* a text prompt (NUL-terminated), or NULL */
    size_t text_len;
    int32_t *ids;      /* a token-id prompt, or NULL */
    size_t n_ids;
} gw_prompt;

typedef struct gw_request {
    gw_kind kind;
    char *model;             /* NULL: the default model */
    json_t *messages;        /* chat: normalized array of messages (content as strings) */
    json_t *tools;           /* chat: tools array or NULL */
    json_t *tool_choice;     /* chat: "none", "auto", "required" or {"type": "function", ...}; NULL: unset */
    gw_prompt *prompts;      /* completions */
    int n_prompts;
    int max_tokens;          /* -1: unset */
    smp_params sampling;     /* temperature, top_p, top_k, min_p, penalties; bias points into `bias` */
    bool has_seed;
    uint64_t seed;
    char **stop;             /* n_stop NUL-terminated strings */
    int n_stop;
    int n;                   /* choices per prompt */
    smp_bias *bias;          /* n_bias entries */
    int n_bias;
    bool logprobs;           /* return log-probabilities */
    int top_logprobs;        /* alternatives per token */
    bool echo;               /* completions: prepend the prompt */
    bool stream;
    bool include_usage;      /* stream_options.include_usage */
    bool ignore_eos;         /* extension: keep going past end-of-generation tokens */
    bool tokens_as_ids;      /* extension (vLLM): logprob tokens as "token_id:N" */
    char *user;
    gm_grammar *grammar;     /* the output's grammar: response_format json_object / json_schema,
                              * llama.cpp's `grammar` or `json_schema`; NULL: free text */
} gw_request;

/* Parses and validates a request body against limits; `vocab` bounds token ids
 * (0: unchecked). Strict like OpenAI: `model` is required (except for
 * GW_KIND_TEMPLATE), roles must be known, and a top-level key that is neither
 * OpenAI's nor one of the extensions this gateway implements is refused
 * ("Unrecognized request argument supplied: X"). response_format, `grammar` and
 * `json_schema` are compiled into r->grammar here (a bad schema or grammar is a 400
 * naming the parameter and, for an unsupported keyword, the keyword). On success
 * fills *r (release with gw_request_free) and returns 0; on failure returns the
 * HTTP status (400) with *err naming the parameter. */
int gw_request_parse(const json_t *body, gw_kind kind, const gw_limits *lim, int vocab, gw_request *r,
                     gw_error *err);
void gw_request_free(gw_request *r); /* zeroes *r; safe on a zeroed request */

/* ---- stop strings ------------------------------------------------------------------- */

/* Matches stop strings against streamed text. Text goes in piece by piece (each
 * piece complete UTF-8); what can safely be shown comes out: text that could still
 * turn out to be the start of a stop string is held back until it cannot. */
typedef struct gw_stop {
    char **stops; /* borrowed */
    size_t *lens;
    int n;
    size_t max_len;
    fu_buf held;  /* text not yet released */
    bool matched;
} gw_stop;

/* Borrows stops[0..n) (NUL-terminated, non-empty). Returns FU_OK or FU_ERR_NOMEM. */
int gw_stop_init(gw_stop *s, char *const *stops, int n);
void gw_stop_free(gw_stop *s); /* frees what init and feed allocated and zeroes *s; safe on a zeroed one */
/* Feeds text[0..len); appends the releasable text to *out. Once a stop string is
 * found, the text before it is released, the rest dropped, s->matched set and
 * further feeds ignored. Returns FU_OK or FU_ERR_NOMEM. */
int gw_stop_feed(gw_stop *s, const char *text, size_t len, fu_buf *out);
/* End of generation: releases what is held back (no match can complete now).
 * Returns FU_OK or FU_ERR_NOMEM. */
int gw_stop_flush(gw_stop *s, fu_buf *out);

/* ---- server-sent events ----------------------------------------------------------------- */

/* Appends "data: <compact json>\n\n" to *out. Returns FU_OK or FU_ERR_NOMEM. */
int gw_sse_event(fu_buf *out, const json_t *obj);
/* Appends "data: [DONE]\n\n". Returns FU_OK or FU_ERR_NOMEM. */
int gw_sse_done(fu_buf *out);

/* ---- HTTP header checks (pure: the server and the fuzz target use them) ------------------- */

/* Splits an HTTP authority v[0..len), "NAME", "NAME:PORT", "[V6]" or "[V6]:PORT": *name_len
 * is NAME's length ("[V6]" with its brackets), *port the port or -1 when none. Returns false
 * when malformed (an empty name, a byte no host name holds, a port beyond 65535). */
bool gw_http_authority(const char *v, size_t len, size_t *name_len, int *port);
/* Whether name[0..len) names loopback: localhost, 127.0.0.1 or [::1] (case-insensitive). */
bool gw_http_loopback_name(const char *name, size_t len);
/* Splits an Origin v[0..len), "http://AUTHORITY" or "https://AUTHORITY" (no path): *host
 * points into v at the name (*host_len bytes) and *port is the port, 80 or 443 when none.
 * Returns false for anything else ("null", other schemes, paths). */
bool gw_http_origin(const char *v, size_t len, const char **host, size_t *host_len, int *port);
/* Whether a Content-Type value v[0..len) is application/json, parameters allowed
 * ("application/json; charset=utf-8"), case-insensitive. */
bool gw_http_json_type(const char *v, size_t len);

/* ---- configuration ------------------------------------------------------------------------ */

#define GW_MAX_HOPS 32
#define GW_MAX_KEYS 64
#define GW_MAX_SHARDS 64

typedef struct gw_hop_cfg {
    char *address;
    int first, last;
} gw_hop_cfg;

/* A link figure given in the configuration (for simulation, or where measuring is not wanted):
 * from/to are member addresses or "gateway". */
typedef struct gw_link_cfg {
    char *from, *to;
    double bandwidth;       /* bytes/s */
    double latency;         /* seconds */
} gw_link_cfg;

#define GW_MAX_LINKS 256

typedef struct gw_config {
    char *model;            /* path or repo id: tokenizer, template, context length */
    char *model_name;       /* id served in /v1/models; NULL: the model's name */
    char *listen;           /* "127.0.0.1:8080" */
    char *port_file;
    char *metrics_listen;    /* "host:port" serving /metrics, /health, /livez without a key; NULL: none */
    char *metrics_port_file; /* write that listener's bound port here */
    gw_hop_cfg hops[GW_MAX_HOPS];
    int n_hops;             /* a static chain ... */
    char *shards[GW_MAX_SHARDS]; /* ... or a routed swarm: shard addresses ("host:port"), spans from Info */
    int n_shards;
    char *secret;           /* swarm secret for the shards */
    char *tls_ca;           /* CA for TLS shards */
    char *tls_client_cert, *tls_client_key; /* shown to shards that require one (mTLS); gw_client_pair */
    bool insecure;          /* plaintext to loopback shards */
    bool forward;           /* server-to-server forwarding */
    char *api_keys[GW_MAX_KEYS];
    int n_api_keys;
    bool no_auth;           /* serve without API keys beyond loopback (explicit; else refused) */
    fu_opt_list allowed_hosts; /* Host names accepted besides loopback and the listen host ("*": any) */
    fu_opt_list cors_origins;  /* browser Origins accepted besides this gateway's loopback ones ("*": any) */
    char *https_cert, *https_key; /* serve HTTPS */
    int workers;            /* generation threads (concurrent sessions) */
    int max_queue;          /* waiting generations beyond the workers; more: 429 */
    size_t max_body_bytes;
    int connection_timeout_s;
    int max_connections;
    int max_connections_per_ip; /* open connections from one address at most; 0: no cap */
    int connection_reserve; /* past max_connections - this, a new connection evicts the oldest unfinished request */
    int header_timeout_s;   /* a request's headers arrive within this, however they trickle */
    int body_timeout_s;     /* its body within this after the headers */
    int default_max_tokens;
    int step_timeout_ms;    /* per chain step; routed: the wait before a path is measured (gw-pace.h) */
    int step_deadline_floor_ms; /* routed: the floor of a step's measured deadline */
    int max_request_seconds; /* a request still generating after this long fails with 408 (0: never) */
    gw_limits limits;
    /* swarm membership (fusion.Swarm): shards join, heartbeat, get spans or wait as spares */
    char *swarm_listen;     /* "host:port" of the membership service; NULL: none */
    char *swarm_tls_cert, *swarm_tls_key; /* its TLS (default: the HTTPS pair); plaintext: --insecure, loopback */
    char *swarm_tls_client_ca; /* members must show a certificate signed by it (mTLS); NULL: none asked */
    char *swarm_port_file;  /* write its bound port here */
    int spares;             /* spares kept waiting once every block is covered (default 1) */
    int max_members;        /* joined members at once; a Join beyond is refused (256) */
    int min_gain_percent;   /* a surplus spare serves when that raises the max flow by this much (5) */
    int heartbeat_ms;       /* interval asked of members (500) */
    int heartbeat_timeout_ms; /* retire a member silent this long (3000) */
    int route_wait_ms;      /* a request waits this long for a spare loading an uncovered span (5000) */
    bool measure_links;     /* RTT + bandwidth to every member, refreshed (default true) */
    int measure_interval_ms; /* (5000) */
    int rebalance_interval_ms; /* least time between two moves of serving members (30000; 0: never move) */
    int hidden_size;        /* the model's hidden size: bytes per token between servers = this x 2 (bf16) */
    gw_link_cfg links[GW_MAX_LINKS]; /* given figures; they override measurements */
    int n_links;
    fu_opt_list loras;      /* "NAME=DIR": LoRA adapters served from the start (gw-lora.h) */
    char *lora_dir;         /* runtime loads (POST /v1/load_lora_adapter) from within it; NULL: refused */
    int max_lora_rank;      /* (256) */
    int max_loras;          /* adapters at once (8) */
    /* files (/v1/files) */
    char *data_dir;         /* files and the database; NULL: $XDG_DATA_HOME/fusion, else ~/.local/share/fusion */
    int64_t max_file_bytes; /* an uploaded file's size at most (512 MiB) */
    int max_file_lines;     /* an uploaded file's lines at most (1000000) */
    char *admin_keys[GW_MAX_KEYS]; /* keys that see every owner's files and jobs (also accepted as API keys) */
    int n_admin_keys;
    char *ft_org;           /* fine-tuning: the organization in "ft:BASE:ORG:SUFFIX:JOB" ("fusion") */
    int max_ft_jobs;        /* fine-tuning jobs trained at once (1: one after another) */
} gw_config;

/* The most fine-tuning jobs a gateway trains at once. */
#define GW_MAX_FT_JOBS 16

/* The shortest swarm secret accepted (bytes). */
#define GW_MIN_SECRET_BYTES 16

/* Fills *c with the defaults (nothing allocated). */
void gw_config_init(gw_config *c);
/* Frees every string the configuration owns and zeroes *c. */
void gw_config_free(gw_config *c);
/* Applies one option by its long name ("listen", "hop", "api-key", ...; '_' and
 * '-' are the same). Returns FU_OK, FU_ERR_INVALID (fu_last_error() says why) or
 * FU_ERR_IO (a file option's file cannot be read). */
int gw_config_set(gw_config *c, const char *name, const char *value);
/* Loads a JSON object whose keys are option names; arrays apply each element
 * (e.g. "hops": ["127.0.0.1:7001:0:15", ...], "shards": ["127.0.0.1:7001", ...], "api_keys": [...]). */
int gw_config_load(gw_config *c, const char *path);
/* Checks the whole configuration after loading. */
int gw_config_check(const gw_config *c);
/* The certificate and key the gateway shows to shards that require one (mTLS): --tls-client-cert/
 * --tls-client-key, else its own pair (--swarm-tls-cert, else --https-cert), else none (NULL,
 * NULL). Borrowed from c. */
void gw_client_pair(const gw_config *c, const char **cert, const char **key);
/* A channel to the shard at `address` as the gateway calls every shard: the shards' CA (or
 * plaintext with --insecure), the swarm secret and the gateway's client pair (gw_client_pair).
 * rpc_channel_new's statuses. */
struct rpc_channel;
int gw_channel_new(const gw_config *c, const char *address, struct rpc_channel **out);
/* fusion-gateway's command line into c (after gw_config_init): the --config files, then the
 * flags over them, then the environment (FUSION_SECRET where no secret is given,
 * FUSION_API_KEY_FILE, FUSION_API_KEY), then gw_config_check(). Returns -1 to go on, else the
 * exit status: 0 after --help (the help on stdout), 2 after a usage error (the message and the
 * help on stderr), 1 when the environment's keys cannot be read. */
int gw_config_args(gw_config *c, int argc, char **argv);

/* ---- metrics -------------------------------------------------------------------------------- */

typedef enum gw_route {
    GW_ROUTE_CHAT = 0,
    GW_ROUTE_COMPLETIONS,
    GW_ROUTE_MODELS,
    GW_ROUTE_TOKENIZE,
    GW_ROUTE_DETOKENIZE,
    GW_ROUTE_APPLY_TEMPLATE,
    GW_ROUTE_HEALTH,
    GW_ROUTE_METRICS,
    GW_ROUTE_SWARM,
    GW_ROUTE_LOAD_LORA,   /* POST /v1/load_lora_adapter */
    GW_ROUTE_UNLOAD_LORA, /* POST /v1/unload_lora_adapter */
    GW_ROUTE_FILES,       /* /v1/files, /v1/files/{id}, /v1/files/{id}/content */
    GW_ROUTE_FINE_TUNING, /* /v1/fine_tuning/jobs and below */
    GW_ROUTE_EMBEDDINGS,  /* POST /v1/embeddings */
    GW_ROUTE_OTHER,
    GW_ROUTE_COUNT
} gw_route;

typedef struct gw_metrics gw_metrics;

/* Counters and histograms of the gateway, zeroed. FU_OK or FU_ERR_NOMEM. */
int gw_metrics_new(gw_metrics **out);
void gw_metrics_free(gw_metrics *m); /* NULL is a no-op */
/* Counts one answered request by route and HTTP status (uncommon statuses as "other"). */
void gw_metrics_request(gw_metrics *m, gw_route route, int http_status);
/* Adds one finished generation request's token counts. */
void gw_metrics_tokens(gw_metrics *m, int64_t prompt, int64_t completion);
/* A chain session's first step: `prompt` positions, `reused` of them from the shards' prefix caches. */
void gw_metrics_prefix(gw_metrics *m, int64_t prompt, int64_t reused);
/* Latency observations: time to first token, between tokens, request end to end. */
void gw_metrics_ttft(gw_metrics *m, double seconds);
/* A choice waited this long from its request's arrival until a worker took it. */
void gw_metrics_queue_wait(gw_metrics *m, double seconds);
void gw_metrics_itl(gw_metrics *m, double seconds);
void gw_metrics_e2e(gw_metrics *m, double seconds);
void gw_metrics_sessions(gw_metrics *m, int delta);  /* chain sessions open */
void gw_metrics_running(gw_metrics *m, int delta);   /* generation requests in flight */
/* Prometheus text exposition (queue depth passed in); appends to *out. FU_OK or FU_ERR_NOMEM. */
int gw_metrics_render(gw_metrics *m, int queue_depth, fu_buf *out);

/* The route's label in the metrics (its path, e.g. "/v1/models", or "other"); never NULL. */
const char *gw_route_name(gw_route r);

#endif
