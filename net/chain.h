/* chain.h -- the client side of a chain of shard servers: a session across every hop.
 *
 * A chain is a list of hops whose spans tile the model: hop 0 starts at block 0
 * and holds the embeddings, each hop starts where the previous one ends, the last
 * holds the LM head. A session opens one session per hop (or, with forwarding,
 * one on hop 0 that opens the rest itself, so a step never returns to the
 * client between hops). Steps carry token ids in; sampled tokens, log-probs and
 * optionally logits come back. The requests are the Shard service's own
 * (shard-svc.h), the same a forwarding shard sends to its next hop.
 *
 * Threads: a client is thread-safe (its channels are shared under a lock); a
 * session is used by one thread at a time. Ownership: the client owns its
 * channels, a session its streams and result buffers; options and hops are
 * copied at creation.
 */
#ifndef FU_CHAIN_H
#define FU_CHAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sampler.h"

typedef struct chain_hop {
    const char *address;          /* "host:port" */
    int first_block, last_block;  /* the span it holds */
    const char *tls_server_name;  /* NULL: the address's host */
} chain_hop;

typedef struct chain_options {
    const char *secret;           /* swarm secret, required */
    const char *tls_ca;           /* CA (PEM text or path); NULL: system roots */
    bool insecure;                /* plaintext, loopback hops only */
    size_t max_message_bytes;     /* 0: the RPC default */
    int wire_dtype;               /* WIRE_* (wire.h); 0: bf16 */
    int int8_block;               /* with WIRE_INT8_BLOCK; 0: server default */
    bool forward;                 /* server-to-server forwarding */
    int timeout_ms;               /* per open / step; 0: 60 s */
    const char *tls_client_cert;  /* certificate (PEM text or path) shown to shards that require
                                     one (mTLS); NULL: none */
    const char *tls_client_key;   /* its key; with tls_client_cert or not at all */
} chain_options;

typedef struct chain_client chain_client;
typedef struct chain_session chain_session;

/* Creates a client (o and its strings copied). It keeps one channel per address, shared by its
 * sessions. FU_ERR_INVALID without a secret, with an unknown wire dtype or with half a client
 * pair; PEM files are read when a channel opens (its errors then name the hop). */
int chain_client_new(const chain_options *o, chain_client **out);
/* Frees the client and its channels, after every session is closed. NULL is a no-op. */
void chain_client_free(chain_client *c);

/* Opens a session of max_length positions across hops[0..n), with LoRA
 * adapter `adapter_id` on every hop (NULL or "": the base model). Fails with
 * the first hop's error (fu_last_error() names the hop): FU_ERR_EXHAUSTED when
 * a server's KV cache cannot admit it, FU_ERR_NETWORK when a hop is down,
 * FU_ERR_NOT_FOUND when a hop does not hold the adapter (chain_adapter_load),
 * ... */
int chain_session_open(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                       int max_length, const char *adapter_id, chain_session **out);

/* As chain_session_open, naming the tokens its first step will send, prefix[0..n_prefix)
 * (copied): every hop pins the blocks of the longest prefix of them in its prefix cache, and a
 * first step that sends them, without a rollback and without outputs for every position, takes
 * as many leading positions as every hop holds from the caches instead of computing them
 * (chain_result.prefix_reused). The results are the same either way. */
int chain_session_open_prefix(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                              int max_length, const char *adapter_id, const int32_t *prefix, int n_prefix,
                              chain_session **out);

/* Positions of the open's prefix that every hop holds in its prefix cache (0 after the first step). */
int64_t chain_session_cached(const chain_session *s);

/* Loads LoRA adapter `whole` (every block of the model, in PEFT's row order:
 * qk_interleaved false) into the server of `hop` as `adapter_id`: the blocks of
 * the hop's span, which the server checks against its own. FU_OK, or the
 * server's refusal (FU_ERR_INVALID naming the field, FU_ERR_EXHAUSTED past its
 * adapter limits, FU_ERR_NETWORK when it is down), fu_last_error() naming the
 * hop. */
struct lora_adapter;
int chain_adapter_load(chain_client *c, const chain_hop *hop, const char *adapter_id, const struct lora_adapter *whole);

/* Unloads adapter `adapter_id` from the server of `hop`; FU_ERR_NOT_FOUND
 * when it holds none of that id. */
int chain_adapter_unload(chain_client *c, const chain_hop *hop, const char *adapter_id);
/* Closes the session on every hop (best effort, without waiting) and frees it. NULL is a no-op. */
void chain_session_close(chain_session *s);

typedef struct chain_spec {
    bool want_logits;
    bool all_positions;
    bool sample;
    smp_params sampling;          /* sampling.seed: the seed of the step's last position; the
                                   * last hop derives the earlier rows' (fusion.proto, Sampling.seed) */
    int64_t penalty_start;
    int top_logprobs;
    bool score_inputs;            /* with sample and all_positions: rows but the last report the
                                   * next input token's log-prob and top alternatives */
    int timeout_ms;               /* the wait for this step's reply; 0: the client's timeout_ms */
} chain_spec;

typedef struct chain_timing {
    char server[64];
    int first_block, last_block;
    int64_t queue_us, compute_us, total_us;
    int64_t prefix_hit_tokens;    /* positions it took from its prefix cache */
} chain_timing;

typedef struct chain_result {
    int n_out;
    const float *logits;        /* (n_out, V) when want_logits */
    int vocab;
    const int32_t *tokens;      /* (n_out) when sample */
    const float *logprobs;      /* (n_out) */
    const int32_t *top_ids;     /* (n_out, top_k) */
    const float *top_logprobs;  /* (n_out, top_k) */
    int top_k;
    int64_t position;           /* session length after the step */
    int n_timing;
    const chain_timing *timing; /* per hop */
    int64_t total_us;           /* client-side wall time of the step */
    int64_t prefix_reused;      /* leading positions every hop took from its prefix cache */
} chain_result;

/* Runs one step of n positions (token ids). If rollback_to >= 0 the session
 * is first rolled back to that many positions on every hop. The result is
 * owned by the session and valid until its next step or close. */
int chain_session_step(chain_session *s, const int32_t *tokens, int n, int64_t rollback_to,
                       const chain_spec *spec, const chain_result **out);

/* What a watch says about a step still awaited. */
enum {
    CHAIN_WAIT = 0,    /* go on waiting */
    CHAIN_CANCEL = 1,  /* cancel the step on every hop (a shard stops the prefill in flight):
                        * it fails with FU_ERR_CANCELLED */
    CHAIN_GIVE_UP = 2, /* stop waiting: the step fails with FU_ERR_NETWORK ("no reply after ...") */
};
/* Called on the stepping thread about every 50 ms while a step's reply is awaited, with the time
 * waited so far (it may take time itself, e.g. to probe the hops); returns one of the above. */
typedef int (*chain_watch_fn)(void *arg, int64_t waited_ms);

/* Sets the session's watch (NULL: none); timeout_ms (and a step's own) still bounds each wait. */
void chain_session_set_watch(chain_session *s, chain_watch_fn fn, void *arg);

/* Sends a small Echo to every hop of the session, each waited for up to timeout_ms: the index of
 * the first hop that does not answer (it is down or hung), or -1 when every hop answered. */
int chain_session_probe(chain_session *s, int timeout_ms);

/* Positions the session holds (after its last successful step). */
int64_t chain_session_len(const chain_session *s);

#endif
