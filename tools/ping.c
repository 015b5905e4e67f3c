/* ping.c -- fusion-ping: asks a shard server's Health RPC whether it serves (a container healthcheck).
 *
 *   FUSION_SECRET=... fusion-ping [--tls-ca PEM [--tls-server-name NAME] | --insecure] HOST:PORT
 *
 * Calls /fusion.Shard/Health with the swarm secret and prints the answer ("serving"). Exit
 * status: 0 the shard answers SERVING; 1 it cannot be reached, refuses the call (a wrong secret,
 * TLS) or answers anything else (draining, not serving); 2 a usage error.
 * Threading: one thread. Ownership: the reply is freed here.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "fusion.pb-c.h"
#include "options.h"
#include "rpc.h"
#include "status.h"

typedef struct ping_args {
    char *secret, *tls_ca, *tls_server_name;
    bool insecure;
    int timeout_ms;
} ping_args;

static ping_args args;

static const fu_opt ping_options[] = {
    {"secret-file", 0, FU_OPT_FILE_TEXT, FU_OPT_TO(args.secret), "F", "the swarm secret from a file (default $FUSION_SECRET)"},
    {"tls-ca", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_ca), "F", "CA that signed the shard's certificate"},
    {"tls-server-name", 0, FU_OPT_STRING, FU_OPT_TO(args.tls_server_name), "NAME",
     "name to verify in the certificate (default: the host)"},
    {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(args.insecure), .help = "plaintext, loopback addresses only"},
    {"timeout", 0, FU_OPT_INT, FU_OPT_TO(args.timeout_ms), "MS", "give up after MS milliseconds", .def = "3000",
     .lo = 1, .hi = 600000},
    FU_OPT_END,
};

static const fu_opt_spec ping_spec = {
    "fusion-ping",
    "usage: fusion-ping [options] HOST:PORT\n"
    "Asks a shard server's Health RPC, with the swarm secret, whether it serves.\n",
    ping_options,
    "\nExit status: 0 serving; 1 unreachable, refused or not serving; 2 a usage error.\n"
    "Environment: FUSION_SECRET.\n"};

/* Calls Health on target; the exit status. */
static int ping(const char *target, const ping_args *a) {
    rpc_channel_options o = {.tls_ca = a->tls_ca, .insecure = a->insecure, .tls_server_name = a->tls_server_name,
                             .secret = a->secret ? a->secret : getenv("FUSION_SECRET")};
    if (!o.secret || !o.secret[0]) return fprintf(stderr, "fusion-ping: no swarm secret (--secret-file or FUSION_SECRET)\n"), 2;
    rpc_channel *ch = NULL;
    if (rpc_channel_new(target, &o, &ch)) return fprintf(stderr, "fusion-ping: %s: %s\n", target, fu_last_error()), 1;
    Fusion__HealthRequest req = FUSION__HEALTH_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    rpc_status st = {0};
    int rc = rpc_call_unary(ch, RPC_SHARD_HEALTH, &req.base, &fusion__health_reply__descriptor, &reply,
                            a->timeout_ms, &st);
    int status = 1;
    if (rc != RPC_OK) fprintf(stderr, "fusion-ping: %s: %s\n", target, st.message[0] ? st.message : "no answer");
    else {
        const Fusion__HealthReply *h = (const Fusion__HealthReply *)reply;
        status = h->status == FUSION__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING ? 0 : 1;
        printf("%s: %s\n", target, h->message && h->message[0] ? h->message : status ? "not serving" : "serving");
    }
    rpc_msg_free(reply);
    rpc_channel_free(ch);
    return status;
}

int main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&ping_spec, argc, argv, &n);
    if (status < 0 && n != 1) status = fu_opt_fail(&ping_spec, "one HOST:PORT expected");
    if (status < 0) status = ping(argv[1], &args);
    fu_opt_free(ping_options);
    return status;
}
