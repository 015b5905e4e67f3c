/* ops.h -- the numeric engine's one op interface: self-describing tensors and a backend vtable.
 *
 * Callers (the transformer engine, the shard server, tests) build op_tensor
 * descriptors over backend memory and call op_* functions; each backend (CPU in
 * kernels/cpu/, CUDA in kernels/cuda/) implements the vtable in ops-impl.h.
 *
 * Conventions
 *   - Shapes follow ggml: ne[0] is the innermost, contiguous dimension. A matrix
 *     written "(rows, cols)" in comments has ne[0] = cols, ne[1] = rows.
 *   - A weight W of a linear layer is (n_out, n_in), as Hugging Face and GGUF
 *     store it: row r holds the n_in inputs of output r.
 *   - Activations are f32 and contiguous unless an op says otherwise.
 *   - Ops return FU_OK or a negative fu_status (shape/type mismatch,
 *     unsupported type); they never allocate on the per-token path once
 *     op_reserve() has been called with the largest sizes in use.
 *
 * Threads: ops on one backend may be called from any thread; the backend
 * serializes them (its lock) and runs each on its own workers (the CPU pool,
 * the GPU stream). The caller owns backends and buffers and frees them with
 * op_backend_free() and op_buffer_free(); tensors only describe memory.
 */
#ifndef FU_OPS_H
#define FU_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "options.h"

#define OP_QK 32 /* elements per block of the quantized types */

typedef enum op_type {
    OP_TYPE_F32 = 0,
    OP_TYPE_F16,  /* IEEE half */
    OP_TYPE_BF16, /* bfloat16 (upper half of an f32) */
    OP_TYPE_Q8_0, /* blocks of 32: f16 d, int8 q[32];            x = d * q            */
    OP_TYPE_Q4_0, /* blocks of 32: f16 d, uint8 qs[16];          x = d * (nibble - 8) */
    OP_TYPE_Q4_1, /* blocks of 32: f16 d, f16 m, uint8 qs[16];   x = d * nibble + m   */
                  /* (Q4: element j < 16 is the low nibble of qs[j], element j + 16 the high one) */
    OP_TYPE_I8,   /* int8 per row, with one f32 scale per row in op_tensor.row_scale: x = s[row] * q */
    OP_TYPE_I32,  /* int32 (token ids, positions) */
    OP_TYPE_Q4_0_R16, /* Q4_0 with rows interleaved in groups of 16 (see below) */
    OP_TYPE_Q4_1_R16, /* Q4_1 with rows interleaved in groups of 16 */
    OP_TYPE_F16_R16,  /* f16 with rows interleaved in groups of 16 */
    OP_TYPE_BF16_R16, /* bf16 with rows interleaved in groups of 16 */
    OP_TYPE_Q8_0_R16, /* Q8_0 with rows interleaved in groups of 16 */
    OP_TYPE_COUNT
} op_type;

/* Block layouts, byte-compatible with GGUF/ggml. */
typedef struct op_block_q8_0 {
    uint16_t d;        /* f16 scale */
    int8_t qs[OP_QK];
} op_block_q8_0;

typedef struct op_block_q4_0 {
    uint16_t d;        /* f16 scale */
    uint8_t qs[OP_QK / 2];
} op_block_q4_0;

typedef struct op_block_q4_1 {
    uint16_t d;        /* f16 scale */
    uint16_t m;        /* f16 minimum */
    uint8_t qs[OP_QK / 2];
} op_block_q4_1;

/* Row-interleaved weights (the _R16 types): the values of F16 / BF16 / Q8_0 /
 * Q4_0 / Q4_1, laid out so that a vector of 16 lanes holds one weight of 16
 * consecutive rows, which is how the AVX-512 decode kernels want them. They
 * are made from a plain matrix with op_repack_weight() (the number of rows
 * must be a multiple of 16) and never read from files. Rows are stored in
 * groups of 16, group g at byte g * 16 * nb[1]. F16_R16 / BF16_R16: input k
 * of the group's 16 rows at 32k (row r at 32k + 2r). Block types: for block b
 * (inputs 32b .. 32b + 31) of group g, at byte (g * K/32 + b) * 16 * block_bytes:
 *   - the 16 rows' f16 scales d (row r at 2r), for Q4_1 followed by their 16
 *     f16 minimums m;
 *   - Q4: 4 chunks of 64 bytes: in chunk c, the 32-bit little-endian word r
 *     holds row r's inputs 32b + 8c + j (j = 0..7) as nibbles, input
 *     32b + 8c + j in bits 4j .. 4j + 3;
 *   - Q8_0: 8 chunks of 64 bytes: in chunk 2c + i (c < 4, i < 2), word r
 *     holds row r's inputs 32b + 8c + 2i + {0, 1, 4, 5} in its bytes 0..3,
 *     each as q + 128 (0..255).
 * A tensor of such a type has the plain type's sizes (nb[0], nb[1], total
 * bytes); rows are only addressed through the group layout. */
#define OP_R16_ROWS 16

typedef struct op_tensor {
    op_type type;
    int ndim;               /* 1..4 */
    int64_t ne[4];          /* elements per dimension, ne[0] innermost; unused dims are 1 */
    size_t nb[4];           /* bytes between consecutive indices of each dimension
                               (nb[0] is the element size, or the block size for
                               quantized types, whose ne[0] is a multiple of 32) */
    void *data;             /* backend memory (host memory for the CPU backend) */
    const float *row_scale; /* OP_TYPE_I8 only: (ne[1]) per-row scales, backend memory */
    const char *name;       /* optional, for error messages; not owned */
} op_tensor;

/* ---- type traits ------------------------------------------------------ */

const char *op_type_name(op_type type);
/* Elements per block (1 for plain types, 32 for Q*). */
int op_type_block_elems(op_type type);
/* Bytes per block (element size for plain types). */
size_t op_type_block_bytes(op_type type);
/* Bytes of one row of n elements (n must be a multiple of the block size). */
size_t op_row_bytes(op_type type, int64_t n);
/* True for types that can be a matmul weight. */
bool op_type_is_weight(op_type type);
/* Rows per interleaved group: OP_R16_ROWS for the _R16 types, 1 for the others. */
int op_type_row_group(op_type type);
/* The plain type an interleaved type repacks (itself for the others). */
op_type op_type_plain(op_type type);

/* Contiguous descriptors. Shapes are given innermost first. */
op_tensor op_tensor_1d(op_type type, void *data, int64_t ne0);
op_tensor op_tensor_2d(op_type type, void *data, int64_t ne0, int64_t ne1);
op_tensor op_tensor_3d(op_type type, void *data, int64_t ne0, int64_t ne1, int64_t ne2);
int64_t op_tensor_nelems(const op_tensor *t);
/* Bytes spanned by a contiguous tensor. */
size_t op_tensor_nbytes(const op_tensor *t);
bool op_tensor_is_contiguous(const op_tensor *t);

/* Scalar conversions (exact, round-to-nearest-even). */
float op_f16_to_f32(uint16_t h);
uint16_t op_f32_to_f16(float f);
float op_bf16_to_f32(uint16_t h);
uint16_t op_f32_to_bf16(float f);

/* Dequantizes row `row` of a 2-D tensor of any type into out (ne[0] floats).
 * Host memory only (used by loaders and tests). */
void op_dequantize_row(const op_tensor *t, int64_t row, float *out);

/* Quantizes n floats (n % 32 == 0 for Q types) into dst of `type`; for
 * OP_TYPE_I8 writes the row's scale to *row_scale. Host memory only. Not for
 * the interleaved (_R16) types, which op_repack_weight() makes. */
void op_quantize_row(op_type type, const float *x, int64_t n, void *dst, float *row_scale);

/* Writes the 2-D host tensor src (F16, BF16, Q8_0, Q4_0 or Q4_1, rows a
 * multiple of OP_R16_ROWS) into dst (op_tensor_nbytes(src) bytes of host
 * memory) as `type` (its _R16 type). FU_ERR_INVALID for any other pairing or
 * shape. */
int op_repack_weight(const op_tensor *src, op_type type, void *dst);

/* ---- backends --------------------------------------------------------- */

typedef struct op_backend op_backend;

typedef enum op_cpu_isa {
    OP_CPU_ISA_AUTO = 0, /* best the CPU supports */
    OP_CPU_ISA_PORTABLE, /* plain C */
    OP_CPU_ISA_AVX2,     /* AVX2 + FMA + F16C */
    OP_CPU_ISA_AVX512,   /* AVX-512 F/BW/VL (+BF16/VNNI/FP16 where present) */
} op_cpu_isa;

typedef struct op_cpu_options {
    int n_threads;  /* 0: number of online CPUs */
    op_cpu_isa isa; /* forced level; one the CPU lacks falls back to the best it has */
    /* false (the default, also for zero-initialised or positional {n_threads, isa}
     * options): every matmul is f32 math on the dequantized weights, whatever T,
     * except Q8_0 / Q4_0 / Q4_1 weights on the AVX-512 path (run as Q8_0_R16 /
     * Q4_0_R16 / Q4_1_R16), whose kernels round each token's activations to
     * integers per block of 32 (d = amax/32639, so at most 1/65278 of the
     * block's largest |x| off, far below the weights' own 8- or 4-bit
     * rounding) and sum exactly in integers: results are the same whatever T.
     * true (opt-in, llama.cpp style): decode matmuls (T <= 8) with Q8_0/Q4_0/Q4_1
     * weights and K % 64 == 0 on the AVX2/AVX-512 paths first round each token's
     * activations to int8 per block of 32 (d = amax/127) and use integer dot
     * products: results then depend on T and differ from the f32 ones by up to
     * ~d/2 * sum|w| per block. */
    bool quantized_activations;
} op_cpu_options;

/* Creates the CPU backend; returns NULL on failure (fu_last_error() says why).
 * The caller owns the backend and frees it with op_backend_free(). */
op_backend *op_backend_cpu_new(const op_cpu_options *opts);

/* Creates the CUDA backend on `device`, or NULL when CUDA is not compiled in or
 * no usable GPU is present (fu_last_error() says which). */
op_backend *op_backend_cuda_new(int device);

/* Opens the backend a --device value names into *out: "cpu" (n_threads CPU
 * threads, 0 for all, with `isa`), "cuda" (GPU 0) or "cuda:N". Writes a
 * one-line description to desc ("cpu (avx512, 2 threads)", "cuda:0 (NVIDIA
 * H100 80GB HBM3)"). FU_OK, FU_ERR_INVALID (no such device name) or the
 * backend's failure (FU_ERR_UNSUPPORTED where no GPU can be used). The caller
 * owns *out. */
int op_backend_open(const char *device, int n_threads, op_cpu_isa isa, op_backend **out, char *desc,
                    size_t desc_size);

/* For the programs' option tables (options.h), each ending with a NULL name: the --isa
 * names of op_cpu_isa ("auto", "portable", "avx2", "avx512") and the --kv names of the KV
 * cache types (op_type: "f32", "f16"). */
extern const fu_opt_choice op_cpu_isa_choices[];
extern const fu_opt_choice op_kv_type_choices[];

void op_backend_free(op_backend *be); /* NULL is a no-op */
const char *op_backend_name(const op_backend *be);
/* For the CPU backend: the ISA actually in use ("portable", "avx2", "avx512");
 * for the CUDA backend: the device's name. */
const char *op_backend_isa(const op_backend *be);
int op_backend_n_threads(const op_backend *be);
bool op_backend_supports(const op_backend *be, op_type weight_type);

/* Backend memory. op_buffer_alloc returns zeroed memory or NULL. */
void *op_buffer_alloc(op_backend *be, size_t nbytes);
void op_buffer_free(op_backend *be, void *ptr);
int op_buffer_set(op_backend *be, void *dst, const void *src_host, size_t nbytes);
int op_buffer_get(op_backend *be, void *dst_host, const void *src, size_t nbytes);

/* Puts a matmul weight into the layout and memory the backend runs it from
 * (the CPU backend on AVX-512: F16 / BF16 / Q8_0 / Q4_0 / Q4_1 with a
 * multiple of 16 rows become the _R16 types; the CUDA backend copies w to the
 * device as it is). w is host memory. Returns 1 with *out describing a new
 * backend buffer (the caller frees out->data with op_buffer_free), 0 with
 * *out = *w when the backend uses w as it is, or a negative fu_status. */
int op_weight_prepare(op_backend *be, const op_tensor *w, op_tensor *out);
/* The type op_weight_prepare gives a 2-D weight of `type` with `rows` rows on
 * this backend (`type` itself when the backend keeps it). */
op_type op_weight_layout(const op_backend *be, op_type type, int64_t rows);

/* Makes host tensor t (contiguous; an I8 tensor with its row scales) readable
 * by the backend's ops, as it is: for the vectors and tables that ops read
 * besides matmul weights (norm weights, biases, embeddings). Returns 0 with
 * *out = *t on a backend whose ops read host memory (the CPU), 1 with *out
 * describing a copy in a new backend buffer (the caller frees out->data with
 * op_buffer_free), or a negative fu_status. */
int op_tensor_upload(op_backend *be, const op_tensor *t, op_tensor *out);

/* Pre-sizes scratch so that ops over at most max_tokens rows with inner
 * dimension at most max_k never allocate afterwards. */
int op_reserve(op_backend *be, int64_t max_tokens, int64_t max_k);

/* Waits for queued work (a no-op on the CPU). */
int op_synchronize(op_backend *be);

/* ---- ops ---------------------------------------------------------------- */

/* y (T, N) f32 = x (T, K) f32 @ W (N, K)^T, W of any weight type; f32 accumulation. */
int op_matmul(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y);

/* The most weights one op_matmul_n takes. */
#define OP_MATMUL_N_MAX 4

/* y[i] = x @ w[i]^T for i < n (1..OP_MATMUL_N_MAX): matmuls of the same
 * activations (a layer's q, k and v projections; its gate and up), each as
 * op_matmul would compute it, bit for bit. A backend may run them as one:
 * the CPU backend rounds x once and streams all the weights in one pass over
 * its threads, so that the small ones do not each pay a start and a join. */
int op_matmul_n(op_backend *be, int n, const op_tensor *const *w, const op_tensor *x, op_tensor *const *y);

/* y (R, D) = x (R, D) / sqrt(mean(x^2) + eps) * w (D); w may be NULL (no scale).
 * y may alias x. */
int op_rmsnorm(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y);

typedef enum op_rope_mode {
    OP_ROPE_NEOX = 0, /* rotates pairs (i, i + rot_dim/2): Hugging Face's rotate_half */
    OP_ROPE_NORM = 1, /* rotates pairs (2i, 2i + 1): GGUF llama's permuted Q/K */
} op_rope_mode;

typedef struct op_rope_params {
    op_rope_mode mode;
    int rot_dim;           /* dimensions rotated (<= head_dim, even) */
    const float *inv_freq; /* (rot_dim/2) host memory: frequency of pair i, scaling applied */
    float attn_factor;     /* multiplies cos/sin (1 unless a scaling scheme says otherwise) */
} op_rope_params;

/* In place on x (T, H, hd): token t is rotated by angle pos[t] * inv_freq[i].
 * pos is host memory (T). A negative position rotates backwards: rope with
 * -pos is the transpose of rope with pos, which is how a backward pass takes
 * the gradient through it. */
int op_rope(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p);

typedef struct op_attn {
    int n_heads;          /* H: query heads */
    int n_kv_heads;       /* KVH: H % KVH == 0; head h reads kv head h / (H / KVH) */
    int head_dim;         /* hd */
    float scale;          /* logit scale, usually 1/sqrt(hd) */
    int n_seqs;           /* number of caches in k / v */
    const int32_t *seq;   /* (T) host: cache index of token t */
    const int32_t *pos;   /* (T) host: token t attends to positions [0, pos[t]] of its cache */
    const op_tensor *k;   /* (n_seqs) each (max_len, KVH, hd), F32 or F16, any strides
                             (nb[1] between heads, nb[2] between positions) */
    const op_tensor *v;   /* (n_seqs) each (max_len, KVH, hd), same type as k */
} op_attn;

/* A KV cache view (hd, KVH, max_len) over `data`, laid out head by head: the
 * max_len positions of head 0, then of head 1, ... (nb[1] = max_len * hd
 * elements, nb[2] = hd), so that attention reads each head's rows in
 * sequence, which the hardware prefetchers follow, instead of one row per
 * whole cache row. Takes the bytes of a (max_len, KVH, hd) tensor. */
op_tensor op_tensor_kv_cache(op_type type, void *data, int64_t head_dim, int64_t n_kv_heads, int64_t max_len);

/* Causal attention with grouped-query heads over per-sequence KV caches:
 * out (T, H, hd) = softmax(q . K^T * scale) V for each token and head.
 * The caches must already hold positions [0, pos[t]] (see op_kv_store). */
int op_attention(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out);

/* Writes row t of src (T, C) f32 into position pos[t] of dst[seq[t]], F32 or
 * F16, converting: a (max_len, C) matrix, or a (max_len, KVH, hd) cache with
 * KVH * hd = C and any strides (op_tensor_kv_cache), where head h takes
 * elements [h * hd, (h + 1) * hd) of the row. dst holds n_seqs caches;
 * seq/pos host memory (T).
 * A sequence index outside [0, n_seqs) or a position outside its cache is an
 * error (FU_ERR_RANGE) and nothing is written. */
int op_kv_store(op_backend *be, const op_tensor *src, op_tensor *const *dst, int n_seqs,
                const int32_t *seq, const int32_t *pos);

/* out (T, F) = silu(gate (T, F)) * up (T, F); out may alias gate. */
int op_swiglu(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out);

/* x (R, D) += y (R, D). */
int op_add(op_backend *be, op_tensor *x, const op_tensor *y);

/* x (R, N) += b (N) on every row. */
int op_add_row(op_backend *be, op_tensor *x, const op_tensor *b);

/* x (R, N) row rows[i] += scale * y (n, N) row i, for i < n (y->ne[1]);
 * rows host memory (n), distinct. A row outside [0, R) is an error
 * (FU_ERR_RANGE) and nothing is written. A backend without this op answers
 * FU_ERR_UNSUPPORTED whatever the arguments, so a call with n = 0 asks
 * whether it has it (the CPU and CUDA backends both have it). */
int op_add_rows(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale);

/* out (T, D) f32 = rows ids[t] of table (V, D) of any weight type; ids host (T).
 * Ids out of [0, V) are an error. */
int op_get_rows(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out);

/* In place on x (R, N): softmax over each row. */
int op_softmax(op_backend *be, op_tensor *x);

/* In place on x (R, N): log-softmax over each row. */
int op_log_softmax(op_backend *be, op_tensor *x);


/* ---- training (backward) ops ---------------------------------------------------
 *
 * The gradients of the forward ops above, for LoRA fine-tuning through frozen
 * base weights. All activations and gradients are f32 and contiguous. A
 * backend without them answers FU_ERR_UNSUPPORTED from each, whatever the
 * arguments; the CPU and CUDA backends have them all. */

/* True when the backend runs every op of this section. */
bool op_backend_can_train(const op_backend *be);

/* dx (T, K) = beta * dx + dy (T, N) @ W (N, K): the input gradient of
 * op_matmul(W, x, y), W of any weight type op_matmul takes (the interleaved
 * _R16 layouts included), read in its held type a panel at a time (no whole
 * dequantized copy). beta is 0 (overwrite) or 1 (accumulate). */
int op_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta);

/* dw (N, K) += alpha * dy (T, N)^T @ x (T, K): the weight gradient of an f32
 * matrix (LoRA's A and B), accumulated. */
int op_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x, float alpha);

/* dx (R, D) = beta * dx + the gradient of y = op_rmsnorm(x, w, eps) given dy
 * (R, D), w (D) or NULL as in the forward (frozen: no gradient of its own).
 * beta is 0 or 1; dx may not alias x or dy. */
int op_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, const op_tensor *dy,
                    op_tensor *dx, float beta);

/* The gradients of out = silu(gate) * up given dout (T, F):
 * dgate = dout * up * silu'(gate), dup = dout * silu(gate). dgate may alias
 * dout; dup may not alias gate or up. */
int op_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up, const op_tensor *dout,
                   op_tensor *dgate, op_tensor *dup);

/* Attention of a training micro-batch: q (T, H, hd) after RoPE, k and v (T,
 * KVH, hd) f32 rows of the same batch. Token t attends to the rows [first[t],
 * t] (first host memory (T), first[t] <= t, and first[u] = first[t] for every
 * u in that range): examples are runs of consecutive rows, packed or padded,
 * each causal within itself. */
typedef struct op_attn_train {
    int n_heads, n_kv_heads, head_dim; /* H, KVH (H % KVH == 0), hd */
    float scale;                       /* logit scale, usually 1/sqrt(hd) */
    const int32_t *first;              /* (T) host: first row of token t's example */
} op_attn_train;

/* The gradients of out = attention(q, k, v) (the forward is op_attention over
 * per-example views, or any equal computation) given out (T, H, hd) and dout:
 * dq (T, H, hd), dk and dv (T, KVH, hd), overwritten; grouped query heads sum
 * into their KV head. Softmax is recomputed (nothing stored by the forward). */
int op_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q, const op_tensor *k,
                      const op_tensor *v, const op_tensor *out, const op_tensor *dout, op_tensor *dq,
                      op_tensor *dk, op_tensor *dv);

/* Token cross-entropy over logits (R, V), in place: for each row r with
 * target[r] in [0, V), loss[r] = logsumexp(row) - row[target[r]] and the row
 * becomes weight * (softmax(row) - onehot(target[r])), the gradient of
 * weight * loss[r]; correct[r] = 1 when the row's largest logit (the first,
 * on ties) is the target's. A row with target -1 is skipped: loss 0, correct
 * 0, gradient 0. target, loss and correct (may be NULL) are host memory (R).
 * A target outside [-1, V) is FU_ERR_RANGE and nothing is written. */
int op_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight, float *loss,
                     uint8_t *correct);

/* Inverted dropout, in place on x (R, N): element (r, c) is kept (and
 * multiplied by 1/(1 - p)) when a hash of (seed, row0 + r, c) falls at or
 * above p, else zeroed; the same seed, row0 and p give the same mask on every
 * backend, so a backward pass recomputes it. p in [0, 1); p = 0 is a no-op.
 * The hash, in uint64_t arithmetic (wrapping), with row = row0 + r:
 *   z = seed ^ (row * 0xD1B54A32D192ED03) ^ (c * 0x9E3779B97F4A7C15)
 *   z += 0x9E3779B97F4A7C15                     (splitmix64's finalizer:)
 *   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
 *   z = (z ^ (z >> 27)) * 0x94D049BB133111EB
 *   z ^= z >> 31
 *   u = (float)(z >> 40) * 0x1p-24f            (uniform in [0, 1), exact)
 * and the element is kept when u >= p, then x * (1.0f / (1.0f - p)) in f32. */
int op_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0);

#endif
