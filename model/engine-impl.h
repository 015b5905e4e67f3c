/* engine-impl.h -- the engine's internals, shared with the training pass (train.c).
 *
 * Internal to model/. The structs are what engine.h's opaque handles point
 * to; train.c reads an engine's prepared weights (lw, head, out_norm, embd)
 * and never its scratch. Threading and ownership: as engine.h says.
 */
#ifndef FU_ENGINE_IMPL_H
#define FU_ENGINE_IMPL_H

#include "engine.h"

struct eng_seq {
    eng_engine *e;    /* the engine it belongs to */
    const lora_adapter *ad; /* borrowed; NULL: none */
    int len;          /* positions held */
    int max_len;
    void *kv;         /* backend memory: n_span x {K, V} x (max_len, KVH * hd) */
    op_tensor *k3, *v3; /* (n_span) (max_len, KVH, hd) head-major caches (op_tensor_kv_cache) */
};

struct eng_engine {
    const mdl_model *m;
    op_backend *be;
    eng_options opts;
    int n_span;            /* blocks in the span */
    int64_t qd, kd;        /* H * hd, KVH * hd */
    size_t kv_elem;        /* bytes per cached element */

    /* the span's tensors as the backend reads them: matrices through
     * op_weight_prepare (the model's tensors, or the engine's own copies in
     * another layout or in device memory), vectors and the embeddings through
     * op_tensor_upload (copies only where the backend cannot read host memory) */
    mdl_layer *lw;         /* (n_span) the model's layers, prepared */
    op_tensor head;        /* the LM head, prepared, when the model has it */
    op_tensor out_norm;    /* when the model has its head */
    op_tensor embd;        /* the token embeddings, when the model has them */
    void **owned;          /* backend buffers of the copies */
    int n_owned;

    /* scratch, backend memory, sized for max_batch_tokens rows */
    float *x;      /* (T, D) residual stream */
    float *xn;     /* (T, D) normed */
    float *q;      /* (T, H * hd) */
    float *k;      /* (T, KVH * hd) */
    float *v;      /* (T, KVH * hd) */
    float *att;    /* (T, H * hd) */
    float *tmp;    /* (T, D) */
    float *gate;   /* (T, F) */
    float *up;     /* (T, F) */
    float *logits; /* (T, V) when the model has its head */

    /* host scratch for one chunk */
    int32_t *pos;        /* (T) */
    int32_t *seq_idx;    /* (T) */
    int32_t *rows;       /* (T) wanted rows */
    eng_seq **useq;      /* (T) distinct sequences of the chunk */
    int *base_len;       /* (T) each distinct sequence's length before the chunk */
    op_tensor *kview, *vview;   /* (T) per distinct sequence, one layer */
    op_tensor **kptr, **vptr;   /* (T) */

    /* LoRA: the chunk's adapted rows grouped by adapter (host, T each), and
     * backend scratch that eng_seq_set_adapter sizes for the largest rank set */
    const lora_adapter **lad;   /* (n_lgroups) distinct adapters of the chunk */
    int32_t *lgrp;              /* (T) group of row t, -1 for none */
    int32_t *lrows;             /* (T) rows of group g at [loff[g], loff[g + 1]) */
    int *loff;                  /* (T + 1) */
    int n_lgroups;
    int64_t max_k;              /* the inner dimension op_reserve was given */
    int lora_r;                 /* rank lu holds (0: no LoRA scratch yet) */
    float *lx;                  /* (T, max_k) a group's gathered inputs */
    float *lu;                  /* (T, lora_r) A x */
    float *ld;                  /* (T, max_k) B A x */
};

#endif
