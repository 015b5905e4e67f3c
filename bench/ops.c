/* ops.c -- fusion-bench-ops: matmul throughput of the CPU backend against the machine's limits.
 *
 * Measures the read bandwidth (a streaming sum over 1 GiB with the backend's
 * thread count) and the clock (a chain of dependent adds), then prints for each
 * ISA path and weight type:
 *   decode:  T=1 matvec at Llama-3.2-1B shapes, GB/s of weights streamed and the
 *            fraction of the bandwidth bound, on the default (exact, f32
 *            activations) path; for Q8_0/Q4_0/Q4_1 on the SIMD ISAs also a
 *            second line "int8-x" for the opt-in quantized_activations path. Weights rotate through >= 1 GiB of
 *            copies so that they never sit in the last-level cache, and the bound
 *            is a plain streaming sum over the same copies with the same threads,
 *            alternated with the matvec passes (the machine's bandwidth varies
 *            with its other tenants, so the pair is measured together);
 *   batch:   batched decode (the steps of T sessions merged into one forward) at
 *            N=8192 K=2048 for T = 1, 8, 16, 32 (or --batch-t): GFLOP/s, the
 *            fraction of the AVX-512 FMA peak (twice the AVX2 one), and the
 *            weights' GB/s as a fraction of the read bandwidth measured at the
 *            start; the weights rotate through >= 1 GiB of copies as in decode;
 *   prefill: GFLOP/s at T=128 and T=512 and the fraction of the AVX2 FMA peak
 *            (threads x 2 FMA ports x 8 lanes x 2 flops x clock);
 *   train:   op_matmul_back (dx = dy @ W) beside op_matmul at W 1536 x 576 and
 *            T=2048 (512 with --quick or portable), in the engine's layout:
 *            the ms and GFLOP/s of each and the ratio of their times.
 *
 * Usage: fusion-bench-ops [--threads N] [--isa portable|avx2|avx512|all]
 *                         [--types f16,q4_0,...] [--quick] [--no-prefill] [--no-decode]
 *                         [--no-batch] [--no-train] [--batch-t 1,8,16,32]
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench-util.h"
#include "ops.h"
#include "options.h"
#include "parse.h"
#include "status.h"

/* ---- machine limits -------------------------------------------------------- */

typedef struct bench_sum_list {
    const op_tensor *t;
    int copies, ith, nth;
    double sum;
} bench_sum_list;

/* Thread ith of nth sums its share of the rows of every copy (like the matvec split). */
static void *bench_sum_list_thread(void *p) {
    bench_sum_list *a = p;
    for (int c = 0; c < a->copies; c++) {
        size_t bytes = op_tensor_nbytes(&a->t[c]);
        size_t lo = bytes * (size_t)a->ith / (size_t)a->nth / 128 * 128;
        size_t hi = bytes * (size_t)(a->ith + 1) / (size_t)a->nth / 128 * 128;
        const uint8_t *base = (const uint8_t *)a->t[c].data + lo;
        a->sum += bench_sum(base, hi - lo);
    }
    return NULL;
}

/* Seconds to stream-read all copies once with nth threads. */
static double bench_sum_pass(const op_tensor *t, int copies, int nth) {
    pthread_t th[64];
    bench_sum_list args[64];
    if (nth > 64) nth = 64;
    double t0 = fu_now_s();
    for (int i = 0; i < nth; i++) {
        args[i] = (bench_sum_list){t, copies, i, nth, 0};
        pthread_create(&th[i], NULL, bench_sum_list_thread, &args[i]);
    }
    for (int i = 0; i < nth; i++) pthread_join(th[i], NULL);
    return fu_now_s() - t0;
}

static double bench_thread_cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Clock in GHz: a chain of dependent 1-cycle adds, timed in thread CPU time
 * so that other processes on the machine do not make it look slower. */
static double bench_clock_ghz(void) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t x = 1, iters = 20000000;
        double t0 = bench_thread_cpu_now();
        for (uint64_t i = 0; i < iters; i++)
            __asm__ volatile("add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
                             "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
                             "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
                             "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
                             : "+r"(x));
        double dt = bench_thread_cpu_now() - t0;
        double ghz = (double)iters * 16 / dt * 1e-9;
        if (ghz > best) best = ghz;
    }
    return best;
}

/* ---- matmul runs ------------------------------------------------------------- */

static const op_type bench_types[] = {OP_TYPE_F32,  OP_TYPE_F16,  OP_TYPE_BF16, OP_TYPE_Q8_0,
                                      OP_TYPE_Q4_0, OP_TYPE_Q4_1, OP_TYPE_I8};

/* A weight of `type` (n, k) with random content, plus `copies - 1` copies. */
typedef struct bench_weight {
    op_tensor t[64];
    int copies;
    float *scales;
} bench_weight;

static int bench_weight_make(op_backend *be, bench_weight *w, op_type type, int64_t n, int64_t k,
                             size_t min_total) {
    size_t bytes = op_row_bytes(type, k) * (size_t)n;
    w->copies = (int)((min_total + bytes - 1) / bytes);
    if (w->copies < 1) w->copies = 1;
    if (w->copies > 64) w->copies = 64;
    w->scales = malloc((size_t)n * sizeof(float));
    float *row = malloc((size_t)k * sizeof(float));
    uint8_t *data = op_buffer_alloc(be, bytes);
    if (!w->scales || !row || !data) {
        free(row);
        return -1;
    }
    for (int64_t r = 0; r < n; r++) {
        for (int64_t i = 0; i < k; i++) row[i] = bench_randf();
        op_quantize_row(type, row, k, data + (size_t)r * op_row_bytes(type, k), &w->scales[r]);
    }
    free(row);
    for (int c = 0; c < w->copies; c++) {
        uint8_t *d = c == 0 ? data : op_buffer_alloc(be, bytes);
        if (!d) {
            w->copies = c;
            break;
        }
        if (c) memcpy(d, data, bytes);
        w->t[c] = op_tensor_2d(type, d, k, n);
        w->t[c].row_scale = w->scales;
    }
    return 0;
}

/* Puts every copy into the layout the engine would run it in (op_weight_prepare). */
static int bench_weight_prepare(op_backend *be, bench_weight *w) {
    for (int c = 0; c < w->copies; c++) {
        op_tensor p;
        int rc = op_weight_prepare(be, &w->t[c], &p);
        if (rc < 0) return rc;
        if (rc == 1) {
            op_buffer_free(be, w->t[c].data);
            w->t[c] = p;
        }
    }
    return 0;
}

static void bench_weight_free(op_backend *be, bench_weight *w) {
    for (int c = 0; c < w->copies; c++) op_buffer_free(be, w->t[c].data);
    free(w->scales);
}

/* One timed call: y = x @ W^T, or with `back` (op_matmul_back) x (t, n) @ W into y (t, k). */
static int bench_call(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y, bool back) {
    return back ? op_matmul_back(be, w, x, y, 0.0f) : op_matmul(be, w, x, y);
}

/* Seconds per matmul of (t, k) x (n, k)^T -- with `back`, per op_matmul_back
 * of (t, n) x (n, k) -- best of several runs that together take at least min_s. */
static double bench_matmul(op_backend *be, bench_weight *w, int64_t t, double min_s, bool back) {
    int64_t n = w->t[0].ne[1], k = w->t[0].ne[0], xn = back ? n : k, yn = back ? k : n;
    float *x = malloc((size_t)(t * xn) * sizeof(float)), *y = malloc((size_t)(t * yn) * sizeof(float));
    if (!x || !y) {
        free(x);
        free(y);
        return -1;
    }
    for (int64_t i = 0; i < t * xn; i++) x[i] = bench_randf();
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, xn, t), yt = op_tensor_2d(OP_TYPE_F32, y, yn, t);
    op_reserve(be, t, xn);
    double best = 1e30, total = 0;
    int it = 0;
    /* warm up every copy once, then time */
    for (int c = 0; c < w->copies; c++) bench_call(be, &w->t[c], &xt, &yt, back);
    while (total < min_s || it < 3) {
        double t0 = fu_now_s();
        int rc = bench_call(be, &w->t[it % w->copies], &xt, &yt, back);
        double dt = fu_now_s() - t0;
        if (rc) {
            fprintf(stderr, "matmul failed: %s\n", fu_last_error());
            best = -1;
            break;
        }
        total += dt;
        if (dt < best) best = dt;
        it++;
        if (it > 2000) break;
    }
    free(x);
    free(y);
    return best;
}

/* Decode at T=1: alternates a pass of matvecs over all copies with a pass of
 * plain streaming sums over the same bytes; returns the best seconds per
 * matvec and, in *sum_s, the best seconds to stream one copy. */
static double bench_decode(op_backend *be, bench_weight *w, int reps, double *sum_s) {
    int64_t n = w->t[0].ne[1], k = w->t[0].ne[0];
    float *x = malloc((size_t)k * sizeof(float)), *y = malloc((size_t)n * sizeof(float));
    if (!x || !y) {
        free(x);
        free(y);
        return -1;
    }
    for (int64_t i = 0; i < k; i++) x[i] = bench_randf();
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, k, 1), yt = op_tensor_2d(OP_TYPE_F32, y, n, 1);
    double best = 1e30, best_sum = 1e30;
    for (int r = 0; r < reps; r++) {
        double s = bench_sum_pass(w->t, w->copies, op_backend_n_threads(be));
        if (s < best_sum) best_sum = s;
        double t0 = fu_now_s();
        for (int c = 0; c < w->copies; c++) op_matmul(be, &w->t[c], &xt, &yt);
        double dt = fu_now_s() - t0;
        if (dt < best) best = dt;
    }
    free(x);
    free(y);
    *sum_s = best_sum / w->copies;
    return best / w->copies;
}

static bool bench_type_selected(const char *list, op_type type) {
    if (!list) return true;
    const char *name = op_type_name(type);
    size_t len = strlen(name);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == len && strncmp(p, name, len) == 0) return true;
        if (!e) break;
        p = e + 1;
    }
    return false;
}

/* ---- the run -------------------------------------------------------------- */

/* What the command line chose, and the machine's limits measured at the start. */
typedef struct bench_args {
    int nth;
    char *isa, *types;
    bool quick, decode, prefill, batch, train;
    int32_t *batch_t;
    size_t n_batch;
    double peak; /* AVX2 FMA peak, GFLOP/s */
} bench_args;

static bench_args args = {.batch = true, .decode = true, .prefill = true, .train = true};

/* --batch-t: a list of batch sizes in [1, 4096]. */
static int bench_set_batch_t(void *ctx, const char *v) {
    bench_args *a = ctx;
    int32_t *ids;
    size_t n;
    int rc = fu_parse_ids(v, &ids, &n);
    if (rc) return rc;
    for (size_t b = 0; b < n; b++)
        if (ids[b] < 1 || ids[b] > 4096) {
            free(ids);
            return fu_errorf(FU_ERR_INVALID, "%d outside [1, 4096]", ids[b]);
        }
    free(a->batch_t);
    a->batch_t = ids;
    a->n_batch = n;
    return FU_OK;
}

static const fu_opt bench_options[] = {
    {"threads", 0, FU_OPT_INT, FU_OPT_TO(args.nth), .help = "threads (default: all CPUs)", .lo = 1, .hi = 4096},
    {"isa", 0, FU_OPT_STRING, FU_OPT_TO(args.isa), "portable|avx2|avx512|all", "the ISA paths to measure",
     .def = "all"},
    {"types", 0, FU_OPT_STRING, FU_OPT_TO(args.types), "f16,q4_0,...", "weight types (default: all)"},
    {"quick", 0, FU_OPT_FLAG, FU_OPT_TO(args.quick), .help = "fewer shapes and repetitions"},
    {"no-prefill", 0, FU_OPT_FLAG, FU_OPT_TO(args.prefill), .help = "leave out prefill", .flags = FU_OPT_NEGATE},
    {"no-decode", 0, FU_OPT_FLAG, FU_OPT_TO(args.decode), .help = "leave out decode", .flags = FU_OPT_NEGATE},
    {"no-batch", 0, FU_OPT_FLAG, FU_OPT_TO(args.batch), .help = "leave out batched decode", .flags = FU_OPT_NEGATE},
    {"no-train", 0, FU_OPT_FLAG, FU_OPT_TO(args.train), .help = "leave out matmul_back beside matmul",
     .flags = FU_OPT_NEGATE},
    {"batch-t", 0, FU_OPT_CALL, .dest = &args, .arg = "1,8,...", .help = "batch sizes (default 1,8,16,32)",
     .fn = bench_set_batch_t},
    FU_OPT_END,
};

static const fu_opt_spec bench_spec = {
    "fusion-bench-ops",
    "usage: fusion-bench-ops [options]\n"
    "Matmul throughput of the CPU backend against the machine's read bandwidth and FMA peak.\n",
    bench_options, NULL};

/* Makes w: `type` weights (n, k) in copies over at least rotate bytes. FU_OK or FU_ERR_NOMEM. */
static int bench_weight_new(op_backend *be, bench_weight *w, op_type type, int64_t n, int64_t k, size_t rotate) {
    memset(w, 0, sizeof *w);
    if (bench_weight_make(be, w, type, n, k, rotate)) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    return FU_OK;
}

/* One decode line: T=1 matvec time, GB/s, and the fraction of the paired stream read. */
static void bench_print_decode(const char *isa, op_type type, int64_t n, int64_t k, double sec, double sum_s,
                               double bytes, const char *note) {
    printf("[%-8s] decode  %-8s N=%-6lld K=%-5lld T=1   %8.3f ms  %6.1f GB/s  %5.2f of bandwidth (%s",
           isa, op_type_name(type), (long long)n, (long long)k, sec * 1e3, bytes / sec * 1e-9, sum_s / sec, note);
    fflush(stdout);
}

/* Decode (T=1) at one shape: the plain path, the opt-in int8 activations, the
 * layout the engine runs. FU_OK or an error. */
static int bench_decode_shape(op_backend *be, op_backend *beq, const char *isa, op_type type, int64_t n,
                              int64_t k) {
    bool portable = !strcmp(isa, "portable");
    bench_weight w;
    int rc = bench_weight_new(be, &w, type, n, k, portable ? 0 : (size_t)1 << 30);
    if (rc) return rc;
    double sum_s = 0;
    double sec = bench_decode(be, &w, portable ? 2 : args.quick ? 3 : 6, &sum_s);
    double bytes = (double)(op_row_bytes(type, k) * (size_t)n);
    bench_print_decode(isa, type, n, k, sec, sum_s, bytes, "");
    printf("stream-read of the same %.0f MiB x %d: %.1f GB/s)\n", bytes / 1048576.0, w.copies,
           bytes / sum_s * 1e-9);
    if (!portable && (type == OP_TYPE_Q8_0 || type == OP_TYPE_Q4_0 || type == OP_TYPE_Q4_1)) {
        sec = bench_decode(beq, &w, args.quick ? 3 : 6, &sum_s);
        bench_print_decode(isa, type, n, k, sec, sum_s, bytes, "int8-x: opt-in quantized_activations; ");
        printf("stream-read %.1f GB/s)\n", bytes / sum_s * 1e-9);
    }
    if (op_weight_layout(be, type, n) != type) {
        if ((rc = bench_weight_prepare(be, &w)) == FU_OK) {
            sec = bench_decode(be, &w, args.quick ? 3 : 6, &sum_s);
            bench_print_decode(isa, w.t[0].type, n, k, sec, sum_s, bytes, "the layout the engine runs; ");
            printf("stream-read %.1f GB/s)\n", bytes / sum_s * 1e-9);
        }
    }
    bench_weight_free(be, &w);
    return rc;
}

/* Matmuls of T rows for each T of ts[0..n_ts) at N x K, plain layout then the
 * engine's; `batch` lines compare with the AVX-512 peak and the weights'
 * bandwidth, prefill lines with the AVX2 peak. FU_OK or an error. */
static int bench_matmul_shapes(op_backend *be, const char *isa, op_type type, bool batch, const int32_t *ts,
                               size_t n_ts, int64_t max_t, bool short_runs) {
    const int64_t n = batch ? 8192 : 2048, k = 2048;
    bench_weight w;
    int rc = bench_weight_new(be, &w, type, n, k, batch && !short_runs ? (size_t)1 << 30 : 0);
    if (rc) return rc;
    double bytes = (double)(op_row_bytes(type, k) * (size_t)n);
    const int passes = op_weight_layout(be, type, n) != type ? 2 : 1;
    for (int pass = 0; pass < passes && !rc; pass++) {
        if (pass == 1 && (rc = bench_weight_prepare(be, &w))) break;
        for (size_t b = 0; b < n_ts; b++) {
            int64_t t = ts[b];
            if (t > max_t) continue;
            double sec = bench_matmul(be, &w, t, short_runs ? 0.1 : 0.5, false);
            double gf = 2.0 * (double)t * (double)n * (double)k / sec * 1e-9;
            printf("[%-8s] %-7s %-8s N=%-6lld K=%-5lld T=%-4lld %8.3f ms  %6.1f GFLOP/s  ", isa,
                   batch ? "batch" : "prefill", op_type_name(w.t[0].type), (long long)n, (long long)k, (long long)t,
                   sec * 1e3, gf);
            if (batch)
                printf("%5.2f of AVX-512 peak  %6.1f GB/s of weights\n", gf / (2 * args.peak), bytes / sec * 1e-9);
            else
                printf("%5.2f of AVX2 peak\n", gf / args.peak);
            fflush(stdout);
        }
    }
    bench_weight_free(be, &w);
    return rc;
}

/* Training: op_matmul_back beside op_matmul at a LoRA fine-tuning shape
 * (W 1536 x 576, T tokens), in the layout the engine runs. */
static int bench_train_shape(op_backend *be, const char *isa, op_type type, int64_t t, bool short_runs) {
    const int64_t n = 1536, k = 576;
    bench_weight w;
    int rc = bench_weight_new(be, &w, type, n, k, 0);
    if (!rc) rc = bench_weight_prepare(be, &w);
    double fwd = rc ? -1 : bench_matmul(be, &w, t, short_runs ? 0.1 : 0.5, false);
    double back = rc ? -1 : bench_matmul(be, &w, t, short_runs ? 0.1 : 0.5, true);
    if (fwd > 0 && back > 0) {
        const double flop = 2.0 * (double)t * (double)n * (double)k * 1e-9;
        printf("[%-8s] train   %-8s N=%-6lld K=%-5lld T=%-4lld matmul %8.3f ms %6.1f GFLOP/s  matmul_back %8.3f ms "
               "%6.1f GFLOP/s  (%.2fx the forward's time)\n",
               isa, op_type_name(w.t[0].type), (long long)n, (long long)k, (long long)t, fwd * 1e3, flop / fwd,
               back * 1e3, flop / back, back / fwd);
        fflush(stdout);
    } else if (!rc) {
        rc = FU_ERR_INTERNAL;
    }
    bench_weight_free(be, &w);
    return rc;
}

/* Every selected measurement of one weight type on one ISA path. */
static int bench_type(op_backend *be, op_backend *beq, const char *isa, op_type type) {
    static const int64_t dshapes[][2] = {{8192, 2048}, {2048, 8192}, {128256, 2048}}; /* (N, K) */
    static const int32_t prefill_t[] = {128, 512};
    bool portable = !strcmp(isa, "portable"), short_runs = args.quick || portable;
    int rc = FU_OK;
    for (int s = 0; args.decode && s < 3 && !rc; s++)
        if (!(short_runs && dshapes[s][0] > 8192))
            rc = bench_decode_shape(be, beq, isa, type, dshapes[s][0], dshapes[s][1]);
    if (!rc && args.batch)
        rc = bench_matmul_shapes(be, isa, type, true, args.batch_t, args.n_batch, portable ? 32 : 4096, short_runs);
    if (!rc && args.prefill)
        rc = bench_matmul_shapes(be, isa, type, false, prefill_t, 2, short_runs ? 128 : 512, short_runs);
    if (!rc && args.train) rc = bench_train_shape(be, isa, type, short_runs ? 512 : 2048, short_runs);
    return rc;
}

/* All selected types on one ISA path; a path the CPU lacks is reported and skipped. */
static int bench_isa(op_cpu_isa isa, const char *name) {
    op_backend *be = op_backend_cpu_new(&(op_cpu_options){.n_threads = args.nth, .isa = isa});
    op_backend *beq =
        op_backend_cpu_new(&(op_cpu_options){.n_threads = args.nth, .isa = isa, .quantized_activations = true});
    int rc = be && beq ? FU_OK : FU_ERR_INTERNAL;
    if (!rc && strcmp(op_backend_isa(be), name)) {
        printf("[%s] not available on this CPU\n", name);
    } else {
        for (size_t ti = 0; !rc && ti < sizeof bench_types / sizeof bench_types[0]; ti++)
            if (bench_type_selected(args.types, bench_types[ti])) rc = bench_type(be, beq, name, bench_types[ti]);
    }
    op_backend_free(be);
    op_backend_free(beq);
    return rc;
}

/* The machine's limits, printed first. */
static void bench_print_machine(void) {
    double bw = bench_read_bandwidth(args.nth, (size_t)1 << 30, 5);
    double ghz = bench_clock_ghz();
    args.peak = args.nth * 2.0 * 8 * 2 * ghz;
    double load[3] = {0};
    FILE *la = fopen("/proc/loadavg", "r");
    if (la) {
        if (fscanf(la, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
        fclose(la);
    }
    printf("threads %d  read bandwidth %.1f GB/s  clock %.2f GHz  AVX2 FMA peak %.0f GFLOP/s  "
           "(load average %.2f: other processes share these cores)\n",
           args.nth, bw, ghz, args.peak, load[0]);
}

/* Measures the machine, then every selected ISA path. Returns the exit status. */
static int bench_run(void) {
    static const struct {
        op_cpu_isa isa;
        const char *name;
    } isas[] = {{OP_CPU_ISA_PORTABLE, "portable"}, {OP_CPU_ISA_AVX2, "avx2"}, {OP_CPU_ISA_AVX512, "avx512"}};
    if (!args.batch_t && bench_set_batch_t(&args, "1,8,16,32")) return FU_ERR_NOMEM;
    if (args.nth < 1) args.nth = (int)sysconf(_SC_NPROCESSORS_ONLN);
    bench_print_machine();
    int rc = FU_OK;
    for (size_t i = 0; !rc && i < sizeof isas / sizeof isas[0]; i++)
        if (!strcmp(args.isa, "all") || !strcmp(args.isa, isas[i].name)) rc = bench_isa(isas[i].isa, isas[i].name);
    if (rc) fprintf(stderr, "fusion-bench-ops: %s\n", fu_last_error());
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&bench_spec, argc, argv, NULL);
    if (status < 0) status = bench_run();
    free(args.batch_t);
    fu_opt_free(bench_options);
    return status;
}
