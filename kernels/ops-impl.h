/* ops-impl.h -- what a backend implements: the vtable behind op_backend.
 *
 * Internal to kernels/. ops.c validates arguments and takes the backend's lock
 * before calling any vtable entry, so an implementation runs one op at a time
 * and may keep per-backend scratch without locking. The backend owns what its
 * constructor allocated; its `free` entry releases it.
 */
#ifndef FU_OPS_IMPL_H
#define FU_OPS_IMPL_H

#include <pthread.h>

#include "ops.h"

typedef struct op_backend_vtbl {
    const char *name;
    void (*free)(op_backend *be);
    const char *(*isa)(const op_backend *be);
    bool (*supports)(const op_backend *be, op_type weight_type);

    void *(*buffer_alloc)(op_backend *be, size_t nbytes);
    void (*buffer_free)(op_backend *be, void *ptr);
    int (*buffer_set)(op_backend *be, void *dst, const void *src, size_t nbytes);
    int (*buffer_get)(op_backend *be, void *dst, const void *src, size_t nbytes);
    int (*reserve)(op_backend *be, int64_t max_tokens, int64_t max_k);
    /* optional (NULL: weights are used as they are, in their own type); see
     * op_weight_prepare and op_weight_layout */
    int (*weight_prepare)(op_backend *be, const op_tensor *w, op_tensor *out);
    op_type (*weight_layout)(const op_backend *be, op_type type, int64_t rows);
    /* optional (NULL: the backend's ops read host memory); see op_tensor_upload */
    int (*upload)(op_backend *be, const op_tensor *t, op_tensor *out);
    int (*synchronize)(op_backend *be);

    int (*matmul)(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y);
    /* optional (NULL: op_matmul_n calls matmul n times); called with checked
     * arguments */
    int (*matmul_n)(op_backend *be, int n, const op_tensor *const *w, const op_tensor *x, op_tensor *const *y);
    int (*rmsnorm)(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y);
    int (*rope)(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p);
    int (*attention)(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out);
    int (*kv_store)(op_backend *be, const op_tensor *src, op_tensor *const *dst, const int32_t *seq,
                    const int32_t *pos);
    int (*swiglu)(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out);
    int (*add)(op_backend *be, op_tensor *x, const op_tensor *y);
    int (*add_row)(op_backend *be, op_tensor *x, const op_tensor *b);
    int (*get_rows)(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out);
    int (*softmax)(op_backend *be, op_tensor *x);
    int (*log_softmax)(op_backend *be, op_tensor *x);
    /* optional (NULL: op_add_rows answers FU_ERR_UNSUPPORTED); called with checked arguments */
    int (*add_rows)(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale);

    /* Training (backward) ops, all optional: NULL makes the op answer
     * FU_ERR_UNSUPPORTED, and op_backend_can_train is true only when none is
     * NULL. Called with checked arguments (shapes, f32 contiguity, first[] and
     * target ranges; see ops.h). */
    int (*matmul_back)(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta);
    int (*outer_acc)(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x, float alpha);
    int (*rmsnorm_back)(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, const op_tensor *dy,
                        op_tensor *dx, float beta);
    int (*swiglu_back)(op_backend *be, const op_tensor *gate, const op_tensor *up, const op_tensor *dout,
                       op_tensor *dgate, op_tensor *dup);
    int (*attention_back)(op_backend *be, const op_attn_train *a, const op_tensor *q, const op_tensor *k,
                          const op_tensor *v, const op_tensor *out, const op_tensor *dout, op_tensor *dq,
                          op_tensor *dk, op_tensor *dv);
    int (*cross_entropy)(op_backend *be, op_tensor *logits, const int32_t *target, float weight, float *loss,
                         uint8_t *correct);
    int (*dropout)(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0);
} op_backend_vtbl;

/* Elements [k0, k0 + n) (multiples of OP_QK) of row r of an interleaved
 * (_R16) weight at w whose rows are row_bytes long on average (nb[1]),
 * dequantized to out. */
void op_r16_dequant(op_type type, const uint8_t *w, size_t row_bytes, int64_t r, int64_t k0, int64_t n,
                    float *out);

/* Where op_kv_store puts a row of C values in a cache (see op_kv_store):
 * C / hd heads of hd elements, head h of position p at
 * p * pos_stride + h * head_stride bytes. */
typedef struct op_kv_layout {
    int64_t len;        /* positions */
    int64_t hd;         /* elements per head (C for a (max_len, C) matrix) */
    size_t pos_stride;  /* bytes between positions */
    size_t head_stride; /* bytes between heads */
} op_kv_layout;

/* The layout of cache d for rows of C values; FU_ERR_INVALID (naming cache
 * `index`) unless d is F32/F16, a (max_len, C) matrix or a (max_len, KVH, hd)
 * cache with KVH * hd = C, with elements contiguous and data set. */
int op_kv_layout_of(const op_tensor *d, int64_t cols, int index, op_kv_layout *out);

/* Every backend struct begins with this header, set up by op_backend_base_init. */
struct op_backend {
    const op_backend_vtbl *v;
    int n_threads;
    pthread_mutex_t lock; /* serializes the ops called on this backend (ops.c) */
};

void op_backend_base_init(op_backend *be, const op_backend_vtbl *v, int n_threads);

#endif
