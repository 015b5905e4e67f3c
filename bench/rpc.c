/* rpc.c -- RPC round-trip latency on loopback: unary calls and stream steps, plaintext and TLS.
 *
 *   fusion-bench-rpc [N]     N round trips per small case (default 2000)
 *
 * An in-process server echoes fusion.Tensor messages; one client thread
 * times each round trip. Payloads: 16 B (a control message), 8 KiB (one
 * decode step's hidden state, 4096 x bf16) and 1 MiB (a prefill chunk). TLS
 * uses a self-signed certificate made with the openssl CLI in a temporary
 * directory. Numbers are printed, not checked.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench-util.h"
#include "fusion.pb-c.h"
#include "parse.h"
#include "rpc.h"
#include "status.h"

#define SECRET "bench-secret"
#define ECHO "/bench.Echo/Echo"
#define CHAT "/bench.Echo/Chat"

static int echo_unary(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                      rpc_status *st) {
    /* The request is freed by the layer after the reply is packed, so the
     * reply may borrow its data: free only the top-level struct. */
    const Fusion__Tensor *t = (const Fusion__Tensor *)req;
    Fusion__Tensor *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__tensor__init(r);
    r->data = t->data;
    *reply = &r->base;
    return RPC_OK;
}

static void free_shallow(void *ctx, ProtobufCMessage *reply) { free(reply); }

static int echo_stream(void *ctx, rpc_stream *s, rpc_status *st) {
    for (;;) {
        ProtobufCMessage *m;
        int rc = rpc_stream_recv(s, NULL, &m, -1, st);
        if (rc != RPC_OK) return rc;
        Fusion__Tensor r = FUSION__TENSOR__INIT;
        r.data = ((Fusion__Tensor *)m)->data;
        rc = rpc_stream_send(s, &r.base, st);
        rpc_msg_free(m);
        if (rc != RPC_OK) return rc;
    }
}

static void report(const char *what, double *us, int n) {
    qsort(us, (size_t)n, sizeof *us, bench_cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += us[i];
    printf("  %-34s n=%-5d mean %8.1f us  p50 %8.1f us  p99 %8.1f us\n", what, n, sum / n,
           us[n / 2], us[(int)(n * 0.99)]);
}

/* Times n unary echoes of `len` bytes (after a warm-up). */
static int bench_unary(rpc_channel *ch, size_t len, int n, const char *label) {
    uint8_t *buf = calloc(1, len + 1);
    double *us = malloc((size_t)n * sizeof *us);
    if (!buf || !us) return 1;
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.data.data = buf;
    t.data.len = len;
    rpc_status st;
    for (int i = -n / 10 - 1; i < n; i++) {
        ProtobufCMessage *reply;
        double t0 = fu_now_s();
        int rc = rpc_call_unary(ch, ECHO, &t.base, &fusion__tensor__descriptor, &reply, 10000,
                                &st);
        double dt = (fu_now_s() - t0) * 1e6;
        if (rc != RPC_OK) {
            fprintf(stderr, "unary: %s: %s\n", rpc_code_str(rc), st.message);
            return 1;
        }
        if (((Fusion__Tensor *)reply)->data.len != len) return 1;
        rpc_msg_free(reply);
        if (i >= 0) us[i] = dt;
    }
    report(label, us, n);
    free(us);
    free(buf);
    return 0;
}

/* Times n send+recv steps of `len` bytes on one long-lived stream. */
static int bench_stream(rpc_channel *ch, size_t len, int n, const char *label) {
    uint8_t *buf = calloc(1, len + 1);
    double *us = malloc((size_t)n * sizeof *us);
    if (!buf || !us) return 1;
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.data.data = buf;
    t.data.len = len;
    rpc_status st;
    rpc_stream *s;
    if (rpc_stream_open(ch, CHAT, 0, &s, &st) != RPC_OK) return 1;
    for (int i = -n / 10 - 1; i < n; i++) {
        ProtobufCMessage *m;
        double t0 = fu_now_s();
        int rc = rpc_stream_send(s, &t.base, &st);
        if (rc == RPC_OK) rc = rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 10000, &st);
        double dt = (fu_now_s() - t0) * 1e6;
        if (rc != RPC_OK) {
            fprintf(stderr, "stream: %s: %s\n", rpc_code_str(rc), st.message);
            return 1;
        }
        if (((Fusion__Tensor *)m)->data.len != len) return 1;
        rpc_msg_free(m);
        if (i >= 0) us[i] = dt;
    }
    int rc = rpc_stream_finish(s, &st);
    rpc_stream_free(s);
    report(label, us, n);
    free(us);
    free(buf);
    return rc == RPC_OK ? 0 : 1;
}

static int run_case(bool tls, const char *cert, const char *key, int n) {
    rpc_server_options so = {.address = "127.0.0.1:0", .secret = SECRET};
    if (tls) {
        so.tls_cert = cert;
        so.tls_key = key;
    } else {
        so.allow_insecure = true;
    }
    rpc_server *srv;
    if (rpc_server_new(&so, &srv) ||
        rpc_server_add_unary(srv, ECHO, &fusion__tensor__descriptor, echo_unary, free_shallow,
                             NULL) ||
        rpc_server_add_stream(srv, CHAT, &fusion__tensor__descriptor, echo_stream, NULL) ||
        rpc_server_start(srv)) {
        fprintf(stderr, "server: %s\n", fu_last_error());
        return 1;
    }
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_options co = {.insecure = !tls, .tls_ca = tls ? cert : NULL, .secret = SECRET};
    rpc_channel *ch;
    if (rpc_channel_new(target, &co, &ch)) {
        fprintf(stderr, "channel: %s\n", fu_last_error());
        return 1;
    }
    printf("%s:\n", tls ? "TLS" : "plaintext");
    int bad = bench_unary(ch, 16, n, "unary 16 B") || bench_stream(ch, 16, n, "stream step 16 B") ||
              bench_unary(ch, 8192, n, "unary 8 KiB") ||
              bench_stream(ch, 8192, n, "stream step 8 KiB (4096 x bf16)") ||
              bench_stream(ch, 1 << 20, n / 20 > 10 ? n / 20 : 10, "stream step 1 MiB");
    rpc_channel_free(ch);
    rpc_server_free(srv);
    return bad;
}

int main(int argc, char **argv) {
    long n = 2000;
    if (argc > 2 || (argc == 2 && fu_parse_long(argv[1], 0, INT_MAX, &n))) {
        fprintf(stderr, "usage: fusion-bench-rpc [ROUND_TRIPS] (default 2000, at least 10)\n");
        return 2;
    }
    if (n < 10) n = 10;
    char dir[] = "/tmp/fusion-bench-rpc-XXXXXX";
    if (!mkdtemp(dir)) return 1;
    char cert[128], key[128], cmd[1024];
    snprintf(cert, sizeof cert, "%s/cert.pem", dir);
    snprintf(key, sizeof key, "%s/key.pem", dir);
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout %s -out %s -days 1 -subj /CN=localhost "
             "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 >/dev/null 2>&1",
             key, cert);
    int have_tls = system(cmd) == 0;
    printf("fusion-bench-rpc: round trips on loopback, one client thread\n");
    int bad = run_case(false, NULL, NULL, (int)n);
    if (have_tls) bad |= run_case(true, cert, key, (int)n);
    else printf("TLS: skipped (openssl CLI failed)\n");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) bad = 1;
    return bad;
}
