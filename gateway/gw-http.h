/* gw-http.h -- the gateway's HTTP server (libmicrohttpd): routes, API keys, limits, SSE streaming.
 *
 * Threads: libmicrohttpd's polling thread routes requests and resumes
 * suspended connections; body threads parse request bodies and run the
 * CPU-bound routes; a watchdog thread cancels the jobs of clients that left and
 * closes connections whose request is past its read deadline (slow clients: see
 * the header and body timeouts, the per-address cap and the reserve in gw_config).
 * The server borrows the config, model, engine and metrics it is given and
 * owns its connections.
 */
#ifndef FU_GW_HTTP_H
#define FU_GW_HTTP_H

#include "gw-gen.h"
#include "gw.h"

typedef struct gw_server gw_server;

/* Refuses (FU_ERR_INVALID, fu_last_error() says why) a cfg->listen that resolves to an
 * address beyond loopback when no API key is configured, unless cfg->no_auth; FU_OK otherwise.
 * gw_server_start checks it too; a program calls it early to fail before loading a model. */
int gw_listen_check(const gw_config *cfg);

/* Binds cfg->listen and starts serving; everything passed in is borrowed and must
 * outlive the server. *port receives the bound port (useful with port 0). */
/* The bound port of --metrics-listen (0: none). */
int gw_server_metrics_port(const gw_server *s);
int gw_server_start(const gw_config *cfg, const gw_model *model, gw_engine *engine, gw_metrics *metrics,
                    gw_server **out, int *port);
/* Cancels every generation, answers waiting clients and stops the server; frees it.
 * NULL is a no-op. Call before gw_engine_free(). */
void gw_server_stop(gw_server *s);

#endif
