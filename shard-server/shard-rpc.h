/* shard-rpc.h -- a shard server's services: fusion.Shard (sessions, stateless forward, adapters, info, health) and fusion.Train.
 *
 * Serves the span of a shard_core over net/'s typed Shard service
 * (shard-svc.h): each Session stream becomes a session in the core (with
 * forwarding, also one on the next hop), Forward a batch of scratch sessions,
 * LoadAdapter / UnloadAdapter the core's LoRA adapters (which sessions and
 * Forward calls name by id), Info and Health the core's figures; Echo is
 * answered by net/ itself. A
 * server may start as a spare without a core and later get one, or move to a
 * new span while the old one drains.
 *
 * Threads: the server runs each Session stream on its own thread and unary
 * calls on its worker threads; the functions below are thread-safe except
 * _free, which must come last. Ownership: the server borrows its cores (the
 * caller frees them, shard_server_old_core says when) and copies the
 * configuration struct (its strings are borrowed for the server's life).
 */
#ifndef FU_SHARD_RPC_H
#define FU_SHARD_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shard-core.h"
#include "shard-train.h"

typedef struct shard_server shard_server;

typedef struct shard_server_config {
    const char *listen;          /* "host:port" (port 0: any free port) */
    const char *advertise;       /* the name this server reports in timings; NULL: listen */
    const char *tls_cert;        /* PEM text or path; NULL with allow_insecure: plaintext */
    const char *tls_key;
    const char *tls_ca;          /* to verify next hops when forwarding; NULL: system roots */
    bool allow_insecure;         /* plaintext, loopback only (also for next hops) */
    const char *secret;          /* swarm secret, required */
    size_t max_message_bytes;    /* 0: the RPC layer's default */
    int idle_timeout_ms;         /* default session expiry (0: 120 s) */
    int n_workers;               /* unary handler threads (0: 4) */
    const char *model_name;
    const char *device;          /* "cpu", ... */
    double tokens_per_s;         /* measured at start-up */
    const char *tls_client_ca;   /* PEM text or path: require client certificates signed by it
                                    (mTLS; needs tls_cert); NULL: clients show none */
    const char *tls_client_cert; /* shown to next hops that require one (mTLS); NULL: none */
    const char *tls_client_key;  /* its key */
    /* Caps on what one caller may hold or cost; beyond them a call is refused with
     * RESOURCE_EXHAUSTED and the figures (the gateway never retires this server for it: a
     * step over budget is its client's "request too large", a full server is busy). */
    int max_sessions;            /* Session streams at once (0: RPC_DEFAULT_MAX_STREAMS) */
    int max_forward_tokens;      /* positions of one Forward, all sequences together
                                    (0: SHARD_DEFAULT_FORWARD_TOKENS) */
    int max_step_tokens;         /* positions of one Session step (0: only the session's max_length) */
    /* Fine-tuning (fusion.Train, shard-train.h): memory of all training jobs together (0: 2 GiB),
     * jobs at once (0: 4) and the largest LoRA rank accepted (0: 256). */
    uint64_t train_budget_bytes;
    int max_train_jobs;
    int max_lora_rank;
    shard_train_priority train_priority; /* whether training yields to inference (default: it does) */
    /* One block's step times measured at start-up, reported by Info for the gateway's planner
     * (shard_svc_info's step tables; borrowed, n 0: none). */
    const double *prompt_step_tokens, *prompt_step_s, *decode_step_tokens, *decode_step_s;
    int n_prompt_steps, n_decode_steps;
} shard_server_config;

/* Largest LoRA rank accepted when max_lora_rank is 0 (LoadAdapter, fusion.Train). */
#define SHARD_DEFAULT_LORA_RANK 256

/* Default budget of one Forward call, in positions (8192 cost 27 s of CPU on a small model). */
#define SHARD_DEFAULT_FORWARD_TOKENS 2048

/* Creates the server for `core` (borrowed) and binds its port. core NULL: a spare that
 * holds no span yet: sessions, Forward and Info are refused with UNAVAILABLE (Health and
 * Echo answer) until shard_server_set_core. */
int shard_server_new(shard_core *core, const shard_server_config *cfg, shard_server **out);
/* Starts serving calls. FU_OK or a status. */
int shard_server_start(shard_server *s);
/* The bound TCP port. */
int shard_server_port(const shard_server *s);
/* Gives a spare server (created with core NULL) its core (borrowed) and the span's measured
 * tokens/s; once only. */
int shard_server_set_core(shard_server *s, shard_core *core, double tokens_per_s);
/* A move: `core` (borrowed) becomes the current span -- new sessions and calls naming its
 * blocks, and Info, go to it -- while the previous one keeps serving the sessions and calls that
 * name its blocks until shard_server_old_core hands it back. FU_ERR_INVALID while a previous
 * move still drains. */
int shard_server_move(shard_server *s, shard_core *core, double tokens_per_s);
/* The previous span's core once no session or call uses it (the caller frees it), else NULL;
 * close: from now on its sessions' next steps fail with UNAVAILABLE ("moved away"), so that
 * the gateway replays them elsewhere. */
shard_core *shard_server_old_core(shard_server *s, bool close);
/* "host:port" the server reports itself as (--advertise, or the listen host and bound port). */
const char *shard_server_address(const shard_server *s);
/* Stops accepting sessions (they are refused with UNAVAILABLE), lets running
 * ones go on for up to grace_ms, then cancels the rest and waits. */
int shard_server_drain(shard_server *s, int grace_ms);
/* Shuts the server down (if not yet) and frees it; the cores stay the caller's. NULL is a no-op. */
void shard_server_free(shard_server *s);

/* Decodes `len` bytes as a SessionRequest and handles it as the session
 * handler would, without a transport: an open is validated against the core's
 * span; a valid step runs on `scratch` (then rolled back to empty) and its
 * outputs are encoded and packed. Returns an rpc_code; never crashes on any
 * input. For fuzzing the message path. */
int shard_rpc_fuzz_one(shard_core *core, shard_session *scratch, const void *data, size_t len);

#endif
