/* opcheck.c -- fusion-opcheck: runs one op of the CPU backend on raw arrays, for oracle tests.
 *
 * Usage: fusion-opcheck [--isa auto|portable|avx2|avx512] [--threads N] [--int8-x] OP ARGS...
 * (--int8-x: the opt-in op_cpu_options.quantized_activations)
 * Reads the op's inputs as raw little-endian arrays, concatenated, from stdin
 * and writes its f32 output to stdout:
 *   matmul TYPE T N K        W (N rows of TYPE: f32|f16|bf16|q8_0|q4_0|q4_1, the Q types
 *                            as GGUF blocks), x (T,K) f32                 -> y (T,N)
 *   rmsnorm R D EPS          x (R,D), w (D)                               -> y (R,D)
 *   rope neox|norm T H HD ROT  x (T,H,HD), pos (T) i32, inv_freq (ROT/2)  -> x rotated
 *   attention f32|f16 T H KVH HD  q (T,H,HD), k (T,KVH,HD), v (T,KVH,HD): one
 *                            sequence, token t at position t (causal)      -> out (T,H,HD)
 *   softmax R N | log_softmax R N   x (R,N)                                -> y (R,N)
 *   swiglu R F               gate (R,F), up (R,F)                          -> out (R,F)
 * Exit status 0 on success, 1 on an op error (message on stderr), 2 on usage.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "parse.h"
#include "status.h"

/* Reads exactly n bytes from stdin into a new buffer; NULL on short input. */
static void *oc_read(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p && fread(p, 1, n, stdin) != n) {
        free(p);
        return NULL;
    }
    return p;
}

static int oc_write(const float *y, size_t n) {
    return fwrite(y, sizeof(float), n, stdout) == n ? 0 : 1;
}

/* A whole integer in [0, 2^31] (a size). */
static bool oc_int(const char *s, long long *out) {
    long v;
    if (fu_parse_long(s, 0, 1L << 31, &v)) return false;
    *out = v;
    return true;
}

static int oc_usage(void) {
    fprintf(stderr, "usage: fusion-opcheck [--isa auto|portable|avx2|avx512] [--threads N] [--int8-x] OP ARGS... "
                    "(see the header of tools/opcheck.c)\n");
    return 2;
}

static int oc_fail(const char *what) {
    fprintf(stderr, "fusion-opcheck: %s: %s\n", what, fu_last_error());
    return 1;
}

/* Each op: its arguments argv[0..nargs) after the op's name; reads its inputs,
 * runs, writes the output. Returns 0, 1 (an op error) or 2 (bad arguments or
 * short input). */
typedef int (*oc_fn)(op_backend *be, char **argv);

/* Parses n sizes from argv into a. */
static bool oc_ints(char **argv, int n, long long *a) {
    for (int j = 0; j < n; j++)
        if (!oc_int(argv[j], &a[j])) return false;
    return true;
}

static int oc_matmul(op_backend *be, char **argv) {
    static const op_type mm_types[] = {OP_TYPE_F32, OP_TYPE_F16, OP_TYPE_BF16, OP_TYPE_Q8_0, OP_TYPE_Q4_0,
                                       OP_TYPE_Q4_1};
    long long a[3];
    if (!oc_ints(argv + 1, 3, a)) return 2;
    op_type type = OP_TYPE_COUNT;
    for (size_t ti = 0; ti < sizeof mm_types / sizeof mm_types[0]; ti++)
        if (!strcmp(argv[0], op_type_name(mm_types[ti]))) type = mm_types[ti];
    int64_t t = a[0], n = a[1], k = a[2];
    if (type == OP_TYPE_COUNT || k % op_type_block_elems(type)) return 2;
    int rc = 2;
    void *w = oc_read(op_row_bytes(type, k) * (size_t)n);
    float *x = oc_read((size_t)(t * k) * 4), *y = malloc((size_t)(t * n) * 4 + 4);
    if (w && x && y) {
        op_tensor wt = op_tensor_2d(type, w, k, n), xt = op_tensor_2d(OP_TYPE_F32, x, k, t);
        op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, n, t);
        op_reserve(be, t, k);
        rc = op_matmul(be, &wt, &xt, &yt) ? oc_fail("matmul") : oc_write(y, (size_t)(t * n));
    }
    free(w);
    free(x);
    free(y);
    return rc;
}

static int oc_rmsnorm(op_backend *be, char **argv) {
    long long a[2];
    float eps;
    if (!oc_ints(argv, 2, a) || fu_parse_float(argv[2], &eps)) return 2;
    int rc = 2;
    float *x = oc_read((size_t)(a[0] * a[1]) * 4), *w = oc_read((size_t)a[1] * 4);
    if (x && w) {
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, a[1], a[0]), wt = op_tensor_1d(OP_TYPE_F32, w, a[1]);
        rc = op_rmsnorm(be, &xt, &wt, eps, &xt) ? oc_fail("rmsnorm") : oc_write(x, (size_t)(a[0] * a[1]));
    }
    free(x);
    free(w);
    return rc;
}

static int oc_rope(op_backend *be, char **argv) {
    long long a[4];
    if (!oc_ints(argv + 1, 4, a)) return 2;
    int64_t t = a[0], h = a[1], hd = a[2], rot = a[3];
    int rc = 2;
    float *x = oc_read((size_t)(t * h * hd) * 4);
    int32_t *pos = oc_read((size_t)t * 4);
    float *inv = oc_read((size_t)(rot / 2) * 4);
    if (x && pos && inv) {
        op_tensor xt = op_tensor_3d(OP_TYPE_F32, x, hd, h, t);
        op_rope_params p = {!strcmp(argv[0], "norm") ? OP_ROPE_NORM : OP_ROPE_NEOX, (int)rot, inv, 1.0f};
        rc = op_rope(be, &xt, pos, &p) ? oc_fail("rope") : oc_write(x, (size_t)(t * h * hd));
    }
    free(x);
    free(pos);
    free(inv);
    return rc;
}

/* Causal attention of one sequence: q, k and v from stdin, k and v stored into
 * caches of `ct` first, as the engine does. */
static int oc_attention_run(op_backend *be, op_type ct, int64_t t, int64_t h, int64_t kvh, int64_t hd) {
    int rc = 2;
    float *q = oc_read((size_t)(t * h * hd) * 4), *k = oc_read((size_t)(t * kvh * hd) * 4);
    float *v = oc_read((size_t)(t * kvh * hd) * 4), *o = malloc((size_t)(t * h * hd) * 4 + 4);
    void *kc = calloc((size_t)(t * kvh * hd), 4), *vc = calloc((size_t)(t * kvh * hd), 4);
    int32_t *seq = calloc((size_t)t + 1, 4), *pos = malloc((size_t)t * 4 + 4);
    if (q && k && v && o && kc && vc && seq && pos) {
        for (int64_t j = 0; j < t; j++) pos[j] = (int32_t)j;
        op_tensor kct = op_tensor_3d(ct, kc, hd, kvh, t), vct = op_tensor_3d(ct, vc, hd, kvh, t);
        op_tensor *kp[1] = {&kct}, *vp[1] = {&vct};
        op_tensor ks = op_tensor_2d(OP_TYPE_F32, k, kvh * hd, t), vs = op_tensor_2d(OP_TYPE_F32, v, kvh * hd, t);
        op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, hd, h, t), ot = op_tensor_3d(OP_TYPE_F32, o, hd, h, t);
        op_attn at = {(int)h, (int)kvh, (int)hd, 1.0f / sqrtf((float)hd), 1, seq, pos, &kct, &vct};
        if (op_kv_store(be, &ks, kp, 1, seq, pos) || op_kv_store(be, &vs, vp, 1, seq, pos))
            rc = oc_fail("kv_store");
        else
            rc = op_attention(be, &qt, &at, &ot) ? oc_fail("attention") : oc_write(o, (size_t)(t * h * hd));
    }
    void *bufs[] = {q, k, v, o, kc, vc, seq, pos};
    for (size_t j = 0; j < sizeof bufs / sizeof bufs[0]; j++) free(bufs[j]);
    return rc;
}

static int oc_attention(op_backend *be, char **argv) {
    long long a[4];
    if (!oc_ints(argv + 1, 4, a)) return 2;
    return oc_attention_run(be, !strcmp(argv[0], "f16") ? OP_TYPE_F16 : OP_TYPE_F32, a[0], a[1], a[2], a[3]);
}

/* softmax and log_softmax: argv[-1] is the op's name. */
static int oc_softmax(op_backend *be, char **argv) {
    long long a[2];
    if (!oc_ints(argv, 2, a)) return 2;
    const char *op = argv[-1];
    int rc = 2;
    float *x = oc_read((size_t)(a[0] * a[1]) * 4);
    if (x) {
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, a[1], a[0]);
        int r = !strcmp(op, "softmax") ? op_softmax(be, &xt) : op_log_softmax(be, &xt);
        rc = r ? oc_fail(op) : oc_write(x, (size_t)(a[0] * a[1]));
    }
    free(x);
    return rc;
}

static int oc_swiglu(op_backend *be, char **argv) {
    long long a[2];
    if (!oc_ints(argv, 2, a)) return 2;
    int rc = 2;
    float *g = oc_read((size_t)(a[0] * a[1]) * 4), *u = oc_read((size_t)(a[0] * a[1]) * 4);
    if (g && u) {
        op_tensor gt = op_tensor_2d(OP_TYPE_F32, g, a[1], a[0]), ut = op_tensor_2d(OP_TYPE_F32, u, a[1], a[0]);
        rc = op_swiglu(be, &gt, &ut, &gt) ? oc_fail("swiglu") : oc_write(g, (size_t)(a[0] * a[1]));
    }
    free(g);
    free(u);
    return rc;
}

static const struct {
    const char *name;
    int nargs;
    oc_fn fn;
} oc_ops[] = {
    {"matmul", 4, oc_matmul},       {"rmsnorm", 3, oc_rmsnorm}, {"rope", 5, oc_rope},
    {"attention", 5, oc_attention}, {"softmax", 2, oc_softmax}, {"log_softmax", 2, oc_softmax},
    {"swiglu", 2, oc_swiglu},
};

/* The options before the op: --isa, --threads, --int8-x. Returns the index of
 * the op's name in argv, or -1 on bad usage. */
static int oc_options(int argc, char **argv, op_cpu_options *opts) {
    int i = 1;
    for (; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
        if (!strcmp(argv[i], "--int8-x")) { /* opt-in quantized_activations; takes no value */
            opts->quantized_activations = true;
            i--;
        } else if (!strcmp(argv[i], "--threads")) {
            long long n;
            if (!oc_int(argv[i + 1], &n)) return -1;
            opts->n_threads = (int)n;
        } else if (!strcmp(argv[i], "--isa")) {
            const char *v = argv[i + 1];
            opts->isa = !strcmp(v, "portable") ? OP_CPU_ISA_PORTABLE
                        : !strcmp(v, "avx2")   ? OP_CPU_ISA_AVX2
                        : !strcmp(v, "avx512") ? OP_CPU_ISA_AVX512
                                               : OP_CPU_ISA_AUTO;
        } else {
            return -1;
        }
    }
    return i < argc ? i : -1;
}

int main(int argc, char **argv) {
    op_cpu_options opts = {.n_threads = 0, .isa = OP_CPU_ISA_AUTO};
    int i = oc_options(argc, argv, &opts);
    if (i < 0) return oc_usage();
    const char *op = argv[i++];
    op_backend *be = op_backend_cpu_new(&opts);
    if (!be) return oc_fail("backend");
    fprintf(stderr, "fusion-opcheck: %s on %s with %d threads\n", op, op_backend_isa(be), op_backend_n_threads(be));
    int rc = 2;
    for (size_t j = 0; j < sizeof oc_ops / sizeof oc_ops[0]; j++)
        if (!strcmp(op, oc_ops[j].name) && argc - i == oc_ops[j].nargs) rc = oc_ops[j].fn(be, argv + i);
    if (rc == 2 && !feof(stdin) && !ferror(stdin))
        oc_usage();
    else if (rc == 2)
        fprintf(stderr, "fusion-opcheck: %s: short input\n", op);
    op_backend_free(be);
    return rc;
}
