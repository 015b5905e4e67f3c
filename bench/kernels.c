/* kernels.c -- fusion-bench-kernels: one transformer block of a model, run op by op on a
 * backend (the CPU's or a GPU's) as the engine runs it, and timed for decode and prefill
 * against the device's datasheet peaks and a streaming bound measured in the same run.
 *
 * These are the kernel-efficiency figures that the planner's card profiles
 * (scripts/gen-scenarios.py) scale the cards' datasheets by: decode reads every weight of
 * the block once a step, so its matmuls' GB/s over the datasheet's memory bandwidth is the
 * bandwidth efficiency; prefill is compute-bound, so its matmuls' TFLOP/s over the
 * datasheet's dense FP16 tensor peak is the FLOPs efficiency.
 *
 * For each weight type it prints:
 *   decode T=t:  a block step of t sequences, each at --context tokens: the whole block
 *                (norms, q/k/v, rope, KV store, attention, o, gate/up, swiglu, down, the
 *                residual adds), its matmuls alone (weights' GB/s and the fraction of the
 *                peak and of the stream bound) and its attention alone (the KV read's GB/s);
 *   prefill T=t: one sequence's prompt of t tokens: the whole block, its matmuls (TFLOP/s
 *                and the fraction of the peak) and its causal attention alone (TFLOP/s).
 * A last line per type, "efficiency TYPE bandwidth B flops F", gives decode T=1's and the
 * longest prefill's fractions of the peaks (or of the stream bound, without --peak-gbs).
 *
 * Timing: ops are queued back to back and the backend is synchronized once per pass of
 * several blocks, so launch gaps count but no host round trip does; each figure is the best
 * of three passes of at least --min-s seconds.
 *
 * Usage: fusion-bench-kernels [--device cpu|cuda[:N]] [--block llama2-70b|...] [--types f16,q4_0]
 *          [--decode-t 1,8,32] [--prefill-t 750] [--context 870] [--peak-gbs G] [--peak-tflops F]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench-util.h"
#include "clock.h"
#include "ops.h"
#include "options.h"
#include "parse.h"
#include "status.h"

/* ---- the block's shape ----------------------------------------------------------------- */

typedef struct kb_shape {
    int64_t dim, ffn, heads, kv_heads, head_dim;
} kb_shape;

static const fu_opt_choice kb_block_names[] = {
    {"llama2-70b", 0}, {"llama-3.1-8b", 1}, {"llama-3.2-1b", 2}, {"smollm2-135m", 3}, {"tiny", 4}, {NULL, 0}};
static const kb_shape kb_shapes[] = {
    {8192, 28672, 64, 8, 128}, {4096, 14336, 32, 8, 128}, {2048, 8192, 32, 8, 64},
    {576, 1536, 9, 3, 64},     {256, 512, 4, 2, 64},
};

/* The block's 7 matmul weights, in the engine's order: q, k, v, o, gate, up, down. */
enum { KB_Q, KB_K, KB_V, KB_O, KB_GATE, KB_UP, KB_DOWN, KB_N };

static void kb_weight_dims(const kb_shape *s, int i, int64_t *n, int64_t *k) {
    const int64_t q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    const int64_t ns[KB_N] = {q, kv, kv, s->dim, s->ffn, s->ffn, s->dim};
    const int64_t ks[KB_N] = {s->dim, s->dim, s->dim, q, s->dim, s->dim, s->ffn};
    *n = ns[i];
    *k = ks[i];
}

/* ---- options --------------------------------------------------------------------------- */

typedef struct kb_args {
    char *device, *types;
    int threads, block, context;
    int32_t *decode_t, *prefill_t;
    size_t n_decode, n_prefill;
    double peak_gbs, peak_tflops, min_s;
    int stream_mib;
} kb_args;

static kb_args args;

/* --decode-t / --prefill-t: a list of token counts in [1, 4096]. */
static int kb_set_list(int32_t **dst, size_t *n, const char *v) {
    int32_t *ids;
    size_t m;
    int rc = fu_parse_ids(v, &ids, &m);
    if (rc) return rc;
    for (size_t i = 0; i < m; i++)
        if (ids[i] < 1 || ids[i] > 4096) {
            free(ids);
            return fu_errorf(FU_ERR_INVALID, "%d outside [1, 4096]", ids[i]);
        }
    free(*dst);
    *dst = ids;
    *n = m;
    return FU_OK;
}
static int kb_set_decode(void *ctx, const char *v) {
    (void)ctx;
    return kb_set_list(&args.decode_t, &args.n_decode, v);
}
static int kb_set_prefill(void *ctx, const char *v) {
    (void)ctx;
    return kb_set_list(&args.prefill_t, &args.n_prefill, v);
}

static const fu_opt kb_options[] = {
    {"device", 'D', FU_OPT_STRING, FU_OPT_TO(args.device), "cpu|cuda|cuda:N", "the backend", .def = "cpu"},
    {"threads", 't', FU_OPT_INT, FU_OPT_TO(args.threads), .help = "CPU threads (default: all CPUs)", .lo = 0,
     .hi = 4096},
    {"block", 'b', FU_OPT_CHOICE, FU_OPT_TO(args.block), .help = "the block's dimensions", .def = "llama2-70b",
     .choices = kb_block_names},
    {"types", 0, FU_OPT_STRING, FU_OPT_TO(args.types), "f16,q4_0,...", "weight types", .def = "f16,q8_0,q4_0"},
    {"decode-t", 0, FU_OPT_CALL, .arg = "1,8,...", .help = "decode batch sizes (default 1,8,32)",
     .fn = kb_set_decode},
    {"prefill-t", 0, FU_OPT_CALL, .arg = "512,...", .help = "prompt lengths (default 750)", .fn = kb_set_prefill},
    {"context", 'c', FU_OPT_INT, FU_OPT_TO(args.context), .help = "tokens in each decode sequence's cache",
     .def = "870", .lo = 1, .hi = 1 << 20},
    {"peak-gbs", 0, FU_OPT_FLOAT, FU_OPT_TO(args.peak_gbs), "GB/s", "the datasheet's memory bandwidth"},
    {"peak-tflops", 0, FU_OPT_FLOAT, FU_OPT_TO(args.peak_tflops), "TFLOP/s", "the datasheet's dense FP16 peak"},
    {"min-s", 0, FU_OPT_FLOAT, FU_OPT_TO(args.min_s), "S", "seconds per timed pass", .def = "0.3"},
    {"stream-mib", 0, FU_OPT_INT, FU_OPT_TO(args.stream_mib), .help = "MiB of each stream operand",
     .def = "1024", .lo = 1, .hi = 1 << 16},
    FU_OPT_END,
};

static const fu_opt_spec kb_spec = {
    "fusion-bench-kernels",
    "usage: fusion-bench-kernels [options]\n"
    "One transformer block, op by op on a backend, against its datasheet peaks and a measured stream.\n",
    kb_options, NULL};

/* ---- the block on the backend ---------------------------------------------------------- */

/* A tensor the backend reads: a backend buffer (dev) or host memory it uses as it is. */
typedef struct kb_tensor {
    op_tensor t;
    bool dev;
} kb_tensor;

/* One block of one weight type, its activations for up to max_t tokens and the KV caches of
 * up to max_seqs sequences of max_len positions (f16), all in the backend's memory. */
typedef struct kb_block {
    op_backend *be;
    kb_shape s;
    kb_tensor w[KB_N], attn_norm, ffn_norm;
    float *inv_freq; /* host (head_dim / 2) */
    float *act[9];   /* x, xn, q, k, v, att, tmp, gate, up */
    int64_t max_t, max_len;
    int max_seqs;
    op_tensor *k3, *v3, **kptr, **vptr;
    int32_t *seq, *pos; /* host (max_t) */
} kb_block;

enum { KB_X, KB_XN, KB_AQ, KB_AK, KB_AV, KB_ATT, KB_TMP, KB_AGATE, KB_AUP };

static void kb_tensor_free(op_backend *be, kb_tensor *t) {
    if (t->dev) op_buffer_free(be, t->t.data);
    else free(t->t.data);
    memset(t, 0, sizeof *t);
}

/* Hands host tensor h (malloc'd) to the backend: a matmul weight through op_weight_prepare,
 * anything else through op_tensor_upload. h's memory is freed or kept by *out. */
static int kb_put(op_backend *be, op_tensor h, bool weight, kb_tensor *out) {
    op_tensor d;
    int rc = weight ? op_weight_prepare(be, &h, &d) : op_tensor_upload(be, &h, &d);
    if (rc < 0) {
        free(h.data);
        return rc;
    }
    if (rc == 1) free(h.data);
    *out = (kb_tensor){rc == 1 ? d : h, rc == 1};
    return FU_OK;
}

/* A weight (n, k) of `type`, scaled by 1/sqrt(k): 16 random rows, repeated. */
static int kb_weight(op_backend *be, op_type type, int64_t n, int64_t k, kb_tensor *out) {
    const size_t rb = op_row_bytes(type, k);
    uint8_t *data = malloc(rb * (size_t)n);
    float *row = malloc((size_t)k * sizeof *row);
    if (!data || !row) {
        free(data);
        free(row);
        return fu_errorf(FU_ERR_NOMEM, "out of memory for a %lld x %lld weight", (long long)n, (long long)k);
    }
    for (int64_t r = 0; r < n; r++) {
        if (r < 16) {
            for (int64_t i = 0; i < k; i++) row[i] = bench_randf() / sqrtf((float)k);
            op_quantize_row(type, row, k, data + (size_t)r * rb, NULL);
        } else {
            memcpy(data + (size_t)r * rb, data + (size_t)(r % 16) * rb, rb);
        }
    }
    free(row);
    return kb_put(be, op_tensor_2d(type, data, k, n), true, out);
}

/* A vector of n ones, for the norms' weights. */
static int kb_ones(op_backend *be, int64_t n, kb_tensor *out) {
    float *v = malloc((size_t)n * sizeof *v);
    if (!v) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < n; i++) v[i] = 1.0f;
    return kb_put(be, op_tensor_1d(OP_TYPE_F32, v, n), false, out);
}

static void kb_block_free(kb_block *b) {
    for (int i = 0; i < KB_N; i++) kb_tensor_free(b->be, &b->w[i]);
    kb_tensor_free(b->be, &b->attn_norm);
    kb_tensor_free(b->be, &b->ffn_norm);
    for (int i = 0; i < 9; i++) op_buffer_free(b->be, b->act[i]);
    for (int j = 0; b->k3 && j < b->max_seqs; j++) {
        op_buffer_free(b->be, b->k3[j].data);
        op_buffer_free(b->be, b->v3[j].data);
    }
    free(b->k3);
    free(b->v3);
    free(b->kptr);
    free(b->vptr);
    free(b->seq);
    free(b->pos);
    free(b->inv_freq);
    memset(b, 0, sizeof *b);
}

/* The activations (random x) and the KV caches, in backend memory. */
static int kb_block_buffers(kb_block *b) {
    const kb_shape *s = &b->s;
    const int64_t qd = s->heads * s->head_dim, kvd = s->kv_heads * s->head_dim;
    const int64_t widths[9] = {s->dim, s->dim, qd, kvd, kvd, qd, s->dim, s->ffn, s->ffn};
    for (int i = 0; i < 9; i++)
        if (!(b->act[i] = op_buffer_alloc(b->be, (size_t)(b->max_t * widths[i]) * sizeof(float))))
            return fu_errorf(FU_ERR_NOMEM, "out of backend memory for activations");
    float *x = malloc((size_t)(b->max_t * s->dim) * sizeof *x);
    if (!x) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < b->max_t * s->dim; i++) x[i] = bench_randf();
    int rc = op_buffer_set(b->be, b->act[KB_X], x, (size_t)(b->max_t * s->dim) * sizeof *x);
    free(x);
    if (rc) return rc;
    b->k3 = calloc((size_t)b->max_seqs, sizeof *b->k3);
    b->v3 = calloc((size_t)b->max_seqs, sizeof *b->v3);
    b->kptr = calloc((size_t)b->max_seqs, sizeof *b->kptr);
    b->vptr = calloc((size_t)b->max_seqs, sizeof *b->vptr);
    if (!b->k3 || !b->v3 || !b->kptr || !b->vptr) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    const size_t cache = (size_t)(b->max_len * kvd) * sizeof(uint16_t);
    for (int j = 0; j < b->max_seqs; j++) {
        void *kp = op_buffer_alloc(b->be, cache), *vp = op_buffer_alloc(b->be, cache);
        b->k3[j] = op_tensor_kv_cache(OP_TYPE_F16, kp, s->head_dim, s->kv_heads, b->max_len);
        b->v3[j] = op_tensor_kv_cache(OP_TYPE_F16, vp, s->head_dim, s->kv_heads, b->max_len);
        b->kptr[j] = &b->k3[j];
        b->vptr[j] = &b->v3[j];
        if (!kp || !vp) return fu_errorf(FU_ERR_NOMEM, "out of backend memory for KV caches");
    }
    return FU_OK;
}

/* Makes block b of `type` on be for up to max_t tokens, max_seqs sequences, max_len positions. */
static int kb_block_new(kb_block *b, op_backend *be, const kb_shape *s, op_type type, int64_t max_t,
                        int max_seqs, int64_t max_len) {
    *b = (kb_block){.be = be, .s = *s, .max_t = max_t, .max_len = max_len, .max_seqs = max_seqs};
    int rc = FU_OK;
    for (int i = 0; i < KB_N && !rc; i++) {
        int64_t n, k;
        kb_weight_dims(s, i, &n, &k);
        rc = kb_weight(be, type, n, k, &b->w[i]);
    }
    if (!rc) rc = kb_ones(be, s->dim, &b->attn_norm);
    if (!rc) rc = kb_ones(be, s->dim, &b->ffn_norm);
    b->inv_freq = malloc((size_t)(s->head_dim / 2) * sizeof(float));
    b->seq = calloc((size_t)max_t, sizeof(int32_t));
    b->pos = calloc((size_t)max_t, sizeof(int32_t));
    if (!rc && (!b->inv_freq || !b->seq || !b->pos)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; !rc && i < s->head_dim / 2; i++)
        b->inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)s->head_dim);
    if (!rc) rc = kb_block_buffers(b);
    if (rc) kb_block_free(b);
    return rc;
}

/* ---- one step of the block --------------------------------------------------------------- */

typedef enum kb_part { KB_WHOLE, KB_MATMULS, KB_ATTENTION } kb_part;

static op_tensor kb_act(const kb_block *b, int i, int64_t width, int64_t t) {
    return op_tensor_2d(OP_TYPE_F32, b->act[i], width, t);
}

/* The attention half for t tokens over n_seqs caches (seq/pos set): norm, q/k/v, rope, KV
 * store, attention, o, residual add; only the matmuls or only the attention as `part` says. */
static int kb_attention_half(kb_block *b, int64_t t, int n_seqs, kb_part part) {
    const kb_shape *s = &b->s;
    op_backend *be = b->be;
    const int64_t qd = s->heads * s->head_dim, kvd = s->kv_heads * s->head_dim;
    op_tensor x = kb_act(b, KB_X, s->dim, t), xn = kb_act(b, KB_XN, s->dim, t), q = kb_act(b, KB_AQ, qd, t),
              k = kb_act(b, KB_AK, kvd, t), v = kb_act(b, KB_AV, kvd, t), att = kb_act(b, KB_ATT, qd, t),
              tmp = kb_act(b, KB_TMP, s->dim, t);
    op_tensor q3 = op_tensor_3d(OP_TYPE_F32, b->act[KB_AQ], s->head_dim, s->heads, t),
              k3 = op_tensor_3d(OP_TYPE_F32, b->act[KB_AK], s->head_dim, s->kv_heads, t),
              att3 = op_tensor_3d(OP_TYPE_F32, b->act[KB_ATT], s->head_dim, s->heads, t);
    op_rope_params rp = {OP_ROPE_NEOX, (int)s->head_dim, b->inv_freq, 1.0f};
    op_attn a = {(int)s->heads, (int)s->kv_heads, (int)s->head_dim, 1.0f / sqrtf((float)s->head_dim),
                 n_seqs, b->seq, b->pos, b->k3, b->v3};
    int rc = FU_OK;
    if (part == KB_ATTENTION) return op_attention(be, &q3, &a, &att3);
    if (part == KB_WHOLE) rc = op_rmsnorm(be, &x, &b->attn_norm.t, 1e-5f, &xn);
    if (!rc)
        rc = op_matmul_n(be, 3, (const op_tensor *[]){&b->w[KB_Q].t, &b->w[KB_K].t, &b->w[KB_V].t}, &xn,
                         (op_tensor *[]){&q, &k, &v});
    if (!rc && part == KB_WHOLE &&
        ((rc = op_rope(be, &q3, b->pos, &rp)) || (rc = op_rope(be, &k3, b->pos, &rp)) ||
         (rc = op_kv_store(be, &k, b->kptr, n_seqs, b->seq, b->pos)) ||
         (rc = op_kv_store(be, &v, b->vptr, n_seqs, b->seq, b->pos)) || (rc = op_attention(be, &q3, &a, &att3))))
        return rc;
    if (!rc) rc = op_matmul(be, &b->w[KB_O].t, &att, &tmp);
    if (!rc && part == KB_WHOLE) rc = op_add(be, &x, &tmp);
    return rc;
}

/* The MLP half: norm, gate/up, swiglu, down, residual add (only the matmuls for KB_MATMULS). */
static int kb_mlp_half(kb_block *b, int64_t t, kb_part part) {
    const kb_shape *s = &b->s;
    op_backend *be = b->be;
    op_tensor x = kb_act(b, KB_X, s->dim, t), xn = kb_act(b, KB_XN, s->dim, t),
              gate = kb_act(b, KB_AGATE, s->ffn, t), up = kb_act(b, KB_AUP, s->ffn, t),
              tmp = kb_act(b, KB_TMP, s->dim, t);
    int rc = FU_OK;
    if (part == KB_ATTENTION) return FU_OK;
    if (part == KB_WHOLE) rc = op_rmsnorm(be, &x, &b->ffn_norm.t, 1e-5f, &xn);
    if (!rc)
        rc = op_matmul_n(be, 2, (const op_tensor *[]){&b->w[KB_GATE].t, &b->w[KB_UP].t}, &xn,
                         (op_tensor *[]){&gate, &up});
    if (!rc && part == KB_WHOLE) rc = op_swiglu(be, &gate, &up, &gate);
    if (!rc) rc = op_matmul(be, &b->w[KB_DOWN].t, &gate, &tmp);
    if (!rc && part == KB_WHOLE) rc = op_add(be, &x, &tmp);
    return rc;
}

/* Sets the tokens' sequences and positions: decode (one token in each of t sequences at
 * the last of `context` positions) or prefill (t tokens of sequence 0 at 0..t-1). */
static void kb_set_tokens(kb_block *b, int64_t t, bool decode, int64_t context) {
    for (int64_t i = 0; i < t; i++) {
        b->seq[i] = decode ? (int32_t)i : 0;
        b->pos[i] = decode ? (int32_t)(context - 1) : (int32_t)i;
    }
}

/* One call of the work a timing repeats: FU_OK or an op's error. */
typedef int (*kb_call_fn)(void *ctx);

/* Seconds per call of fn(ctx): a warm-up pass sizes the others to at least min_s each, every
 * pass ends with one synchronization of be, and the best of three passes counts. -1 on an
 * error (reported). */
static double kb_best_s(op_backend *be, kb_call_fn fn, void *ctx, double min_s) {
    int reps = 1, rc = FU_OK;
    double best = 1e30;
    for (int pass = -1; pass < 3 && !rc; pass++) {
        double t0 = fu_now_s();
        for (int r = 0; r < reps && !rc; r++) rc = fn(ctx);
        if (!rc) rc = op_synchronize(be);
        double dt = fu_now_s() - t0;
        if (pass < 0) reps = dt > 0 ? (int)(min_s / dt) + 1 : 1000;
        else if (dt / reps < best) best = dt / reps;
    }
    if (rc) fprintf(stderr, "fusion-bench-kernels: %s\n", fu_last_error());
    return rc ? -1 : best;
}

/* One block step of `part` for t tokens over n_seqs caches. */
typedef struct kb_step {
    kb_block *b;
    int64_t t;
    int n_seqs;
    kb_part part;
} kb_step;

static int kb_step_call(void *ctx) {
    kb_step *s = ctx;
    int rc = kb_attention_half(s->b, s->t, s->n_seqs, s->part);
    return rc ? rc : kb_mlp_half(s->b, s->t, s->part);
}

/* Seconds per block step of `part` (kb_best_s). */
static double kb_time(kb_block *b, int64_t t, int n_seqs, kb_part part, double min_s) {
    kb_step s = {b, t, n_seqs, part};
    return kb_best_s(b->be, kb_step_call, &s, min_s);
}

/* ---- the run --------------------------------------------------------------------------- */

/* x += y over the stream's operands. */
typedef struct kb_stream {
    op_backend *be;
    op_tensor x, y;
} kb_stream;

static int kb_stream_call(void *ctx) {
    kb_stream *s = ctx;
    return op_add(s->be, &s->x, &s->y);
}

/* GB/s of op_add over two operands of `mib` MiB (2 read + 1 written), timed by kb_best_s. */
static double kb_stream_gbs(op_backend *be, int mib, double min_s) {
    const int64_t cols = 1024, rows = (int64_t)mib * 256;
    const size_t bytes = (size_t)(rows * cols) * sizeof(float);
    float *x = op_buffer_alloc(be, bytes), *y = op_buffer_alloc(be, bytes);
    kb_stream s = {be, op_tensor_2d(OP_TYPE_F32, x, cols, rows), op_tensor_2d(OP_TYPE_F32, y, cols, rows)};
    double sec = -1;
    if (x && y) sec = kb_best_s(be, kb_stream_call, &s, min_s);
    else fprintf(stderr, "fusion-bench-kernels: out of backend memory for the stream\n");
    op_buffer_free(be, x);
    op_buffer_free(be, y);
    return sec > 0 ? 3.0 * (double)bytes / sec * 1e-9 : -1;
}

/* Bytes of the block's weights of `type`, and their count. */
static double kb_weight_bytes(const kb_shape *s, op_type type, double *params) {
    double bytes = 0, p = 0;
    for (int i = 0; i < KB_N; i++) {
        int64_t n, k;
        kb_weight_dims(s, i, &n, &k);
        bytes += (double)op_row_bytes(type, k) * (double)n;
        p += (double)n * (double)k;
    }
    *params = p;
    return bytes;
}

/* " = 0.60 of G" (or nothing when the peak is not given). */
static void kb_print_frac(double v, double peak, const char *what) {
    if (peak > 0) printf(" = %.3f of %s %.0f", v / peak, what, peak);
}

/* Decode at t sequences: the whole block, its matmuls, its attention. Fraction of the peak
 * bandwidth (or else of the stream) reached by the matmuls at t = 1 in *eff_bw. */
static int kb_decode(kb_block *b, op_type type, int64_t t, double stream, double *eff_bw) {
    double params, wbytes = kb_weight_bytes(&b->s, type, &params);
    double kv = (double)t * (double)args.context * (double)(b->s.kv_heads * b->s.head_dim) * 2 * 2;
    kb_set_tokens(b, t, true, args.context);
    double whole = kb_time(b, t, (int)t, KB_WHOLE, args.min_s);
    double mm = kb_time(b, t, (int)t, KB_MATMULS, args.min_s);
    double at = kb_time(b, t, (int)t, KB_ATTENTION, args.min_s);
    if (whole < 0 || mm < 0 || at < 0) return FU_ERR_INTERNAL;
    const double gbs = wbytes / mm * 1e-9;
    printf("decode  %-5s T=%-4lld ctx %d: block %8.3f ms | matmuls %8.3f ms %7.1f GB/s", op_type_name(type),
           (long long)t, args.context, whole * 1e3, mm * 1e3, gbs);
    kb_print_frac(gbs, args.peak_gbs, "peak");
    printf(" = %.3f of stream | attention %7.3f ms %7.1f GB/s of KV\n", gbs / stream, at * 1e3, kv / at * 1e-9);
    if (t == 1) *eff_bw = gbs / (args.peak_gbs > 0 ? args.peak_gbs : stream);
    return FU_OK;
}

/* Prefill of one t-token prompt: the whole block, its matmuls' TFLOP/s and its causal
 * attention's (4 * hd * H FLOPs per position attended); the fraction of the peak reached by
 * the matmuls in *eff_fl (0 without --peak-tflops). */
static int kb_prefill(kb_block *b, op_type type, int64_t t, double *eff_fl) {
    double params;
    kb_weight_bytes(&b->s, type, &params);
    kb_set_tokens(b, t, false, 0);
    double whole = kb_time(b, t, 1, KB_WHOLE, args.min_s);
    double mm = kb_time(b, t, 1, KB_MATMULS, args.min_s);
    double at = kb_time(b, t, 1, KB_ATTENTION, args.min_s);
    if (whole < 0 || mm < 0 || at < 0) return FU_ERR_INTERNAL;
    const double tflops = 2.0 * params * (double)t / mm * 1e-12;
    const double at_flops = 4.0 * (double)(b->s.head_dim * b->s.heads) * (double)t * (double)(t + 1) / 2;
    printf("prefill %-5s T=%-4lld: block %8.3f ms | matmuls %8.3f ms %7.2f TFLOP/s", op_type_name(type),
           (long long)t, whole * 1e3, mm * 1e3, tflops);
    kb_print_frac(tflops, args.peak_tflops, "peak");
    printf(" | attention %8.3f ms %7.3f TFLOP/s\n", at * 1e3, at_flops / at * 1e-12);
    *eff_fl = args.peak_tflops > 0 ? tflops / args.peak_tflops : 0;
    return FU_OK;
}

static int32_t kb_max(const int32_t *v, size_t n) {
    int32_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (v[i] > m) m = v[i];
    return m;
}

/* Every decode and prefill size for one weight type, then its efficiency line. */
static int kb_type(op_backend *be, const kb_shape *s, op_type type, double stream) {
    const int32_t max_d = kb_max(args.decode_t, args.n_decode), max_p = kb_max(args.prefill_t, args.n_prefill);
    const int64_t max_t = max_d > max_p ? max_d : max_p;
    const int64_t max_len = args.context > max_p ? args.context : max_p;
    kb_block b;
    int rc = kb_block_new(&b, be, s, type, max_t, max_d > 0 ? max_d : 1, max_len);
    if (!rc) rc = op_reserve(be, max_t, s->ffn > s->dim ? s->ffn : s->dim);
    double eff_bw = 0, eff_fl = 0;
    for (size_t i = 0; i < args.n_decode && !rc; i++) rc = kb_decode(&b, type, args.decode_t[i], stream, &eff_bw);
    for (size_t i = 0; i < args.n_prefill && !rc; i++) rc = kb_prefill(&b, type, args.prefill_t[i], &eff_fl);
    if (!rc)
        printf("efficiency %s bandwidth %.3f flops %.3f (matmuls: decode T=1 of the %s, prefill T=%d of the "
               "peak)\n",
               op_type_name(type), eff_bw, eff_fl, args.peak_gbs > 0 ? "peak" : "stream", max_p);
    fflush(stdout);
    if (b.be) kb_block_free(&b);
    return rc;
}

/* A --types name: a weight type whose rows stand alone and need no row scales. */
static int kb_parse_type(const char *name, size_t len, op_type *out) {
    for (int i = 0; i < OP_TYPE_COUNT; i++)
        if (op_type_is_weight((op_type)i) && op_type_row_group((op_type)i) == 1 && i != OP_TYPE_I8 &&
            strlen(op_type_name((op_type)i)) == len && strncmp(name, op_type_name((op_type)i), len) == 0) {
            *out = (op_type)i;
            return FU_OK;
        }
    return fu_errorf(FU_ERR_INVALID, "--types: no weight type '%.*s'", (int)len, name);
}

static int kb_run(void) {
    if (!args.decode_t && kb_set_list(&args.decode_t, &args.n_decode, "1,8,32")) return 1;
    if (!args.prefill_t && kb_set_list(&args.prefill_t, &args.n_prefill, "750")) return 1;
    op_backend *be;
    char desc[300];
    if (op_backend_open(args.device, args.threads, OP_CPU_ISA_AUTO, &be, desc, sizeof desc)) {
        fprintf(stderr, "fusion-bench-kernels: %s\n", fu_last_error());
        return 1;
    }
    const kb_shape *s = &kb_shapes[args.block];
    printf("device: %s\nblock: %s: dim %lld, heads %lld/%lld of %lld, ffn %lld\n", desc,
           kb_block_names[args.block].name, (long long)s->dim, (long long)s->heads, (long long)s->kv_heads,
           (long long)s->head_dim, (long long)s->ffn);
    double stream = kb_stream_gbs(be, args.stream_mib, args.min_s);
    int rc = stream > 0 ? FU_OK : FU_ERR_INTERNAL;
    if (!rc) printf("stream: op_add over 2 x %d MiB: %.1f GB/s (2 read + 1 written)\n", args.stream_mib, stream);
    for (const char *p = args.types; !rc && p && *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        op_type type = OP_TYPE_F16;
        if ((rc = kb_parse_type(p, len, &type))) fprintf(stderr, "fusion-bench-kernels: %s\n", fu_last_error());
        else if (!op_backend_supports(be, type)) printf("%s: not supported on this backend\n", op_type_name(type));
        else rc = kb_type(be, s, type, stream);
        p = e ? e + 1 : p + len;
    }
    op_backend_free(be);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&kb_spec, argc, argv, NULL);
    if (status < 0) status = kb_run();
    free(args.decode_t);
    free(args.prefill_t);
    fu_opt_free(kb_options);
    return status;
}
