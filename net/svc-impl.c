/* svc-impl.c -- the message helpers the typed services share: names, ids, Tensors and Inputs. */
#include "svc-impl.h"

#include <stdio.h>
#include <string.h>

int svc_name_check(const char *s, size_t max, const char *what, rpc_status *st) {
    size_t n = strlen(s);
    if (n > max) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: longer than %zu bytes", what, max);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: control character 0x%02x at byte %zu", what,
                                   (unsigned char)s[i], i);
    return RPC_OK;
}

int svc_ids_view(const int64_t *src, size_t n, int32_t *dst, const char *what, rpc_status *st) {
    for (size_t k = 0; k < n; k++) {
        if (src[k] < 0 || src[k] > INT32_MAX)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s[%zu]: token id %lld is not a valid id", what, k,
                                   (long long)src[k]);
        dst[k] = (int32_t)src[k];
    }
    return RPC_OK;
}

int svc_i32s_view(const int64_t *src, size_t n, int32_t *dst, const char *what, rpc_status *st) {
    for (size_t k = 0; k < n; k++) {
        if (src[k] < INT32_MIN || src[k] > INT32_MAX)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s[%zu]: %lld is out of range", what, k,
                                   (long long)src[k]);
        dst[k] = (int32_t)src[k];
    }
    return RPC_OK;
}

void svc_tensor_pack(const wire_tensor *v, Fusion__Tensor *m) {
    fusion__tensor__init(m);
    m->dtype = (Fusion__Dtype)v->dtype;
    m->n_shape = v->n_shape;
    m->shape = (int64_t *)v->shape;
    m->data.data = (uint8_t *)v->data;
    m->data.len = v->data_len;
    m->scales.data = (uint8_t *)v->scales;
    m->scales.len = v->scales_len;
    m->block_size = v->block_size;
    m->scale_dtype = (Fusion__Dtype)v->scale_dtype;
}

int svc_tensor_view(const Fusion__Tensor *m, wire_tensor *v, const char *what, rpc_status *st) {
    v->dtype = (int)m->dtype;
    v->n_shape = m->n_shape;
    v->shape = m->shape;
    v->data = m->data.data;
    v->data_len = m->data.len;
    v->scales = m->scales.data;
    v->scales_len = m->scales.len;
    v->scale_dtype = (int)m->scale_dtype;
    svc_i32 f[] = {{".block_size", m->block_size, &v->block_size}};
    return svc_narrow(f, 1, what, st);
}

void svc_input_pack(const shard_svc_input *v, int64_t *tokens, Fusion__Input *m, Fusion__Tensor *hidden) {
    fusion__input__init(m);
    for (size_t i = 0; i < v->n_tokens; i++) tokens[i] = v->tokens[i];
    m->n_tokens = v->n_tokens;
    m->tokens = v->n_tokens ? tokens : NULL;
    if (v->hidden) {
        svc_tensor_pack(v->hidden, hidden);
        m->hidden = hidden;
    }
}

int svc_input_view(const Fusion__Input *m, int32_t *tokens, shard_svc_input *v, wire_tensor *hidden,
                   const char *what, rpc_status *st) {
    char sub[80];
    snprintf(sub, sizeof sub, "%s.tokens", what);
    int rc = svc_ids_view(m->tokens, m->n_tokens, tokens, sub, st);
    if (rc) return rc;
    v->tokens = m->n_tokens ? tokens : NULL;
    v->n_tokens = m->n_tokens;
    v->hidden = NULL;
    if (m->hidden) {
        snprintf(sub, sizeof sub, "%s.hidden", what);
        if ((rc = svc_tensor_view(m->hidden, hidden, sub, st))) return rc;
        v->hidden = hidden;
    }
    return RPC_OK;
}

/* ---- adapter states -------------------------------------------------------------------- */

void svc_lora_pack(const shard_svc_lora *v, Fusion__LoraSpec *m) {
    fusion__lora_spec__init(m);
    m->r = v->r;
    m->lora_alpha = v->alpha;
    m->lora_dropout = v->dropout;
    m->use_rslora = v->use_rslora;
    m->n_target_modules = v->n_targets;
    m->target_modules = v->n_targets ? (char **)v->targets : NULL;
    m->init_seed = v->init_seed;
}

Fusion__Tensor *svc_tensor_opt_pack(const wire_tensor *v, Fusion__Tensor *m) {
    if (!v) return NULL;
    svc_tensor_pack(v, m);
    return m;
}

void svc_state_pack(const shard_svc_state *v, svc_state_msg *m) {
    fusion__adapter_state__init(&m->s);
    m->s.first_block = v->first_block;
    m->s.last_block = v->last_block;
    if (v->lora) {
        svc_lora_pack(v->lora, &m->lora);
        m->s.lora = &m->lora;
    }
    m->s.params = svc_tensor_opt_pack(v->params, &m->params);
    m->s.moment1 = svc_tensor_opt_pack(v->moment1, &m->moment1);
    m->s.moment2 = svc_tensor_opt_pack(v->moment2, &m->moment2);
}

Fusion__AdapterState *svc_state_opt_pack(const shard_svc_state *v, svc_state_msg *m) {
    if (!v) return NULL;
    svc_state_pack(v, m);
    return &m->s;
}

int svc_lora_view(const Fusion__LoraSpec *m, shard_svc_lora *v, const char *what, rpc_status *st) {
    *v = (shard_svc_lora){.alpha = m->lora_alpha, .dropout = m->lora_dropout, .use_rslora = m->use_rslora,
                          .targets = (const char *const *)m->target_modules, .n_targets = m->n_target_modules,
                          .init_seed = m->init_seed};
    char name[96];
    snprintf(name, sizeof name, "%s.", what);
    svc_i32 f[] = {{"r", m->r, &v->r}};
    int rc = svc_narrow(f, 1, name, st);
    if (rc) return rc;
    if (m->n_target_modules > SHARD_SVC_MAX_TARGETS)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s.target_modules: %zu names, at most %d", what,
                               m->n_target_modules, SHARD_SVC_MAX_TARGETS);
    for (size_t i = 0; i < m->n_target_modules && !rc; i++) {
        snprintf(name, sizeof name, "%s.target_modules[%zu]", what, i);
        rc = svc_name_check(m->target_modules[i], SHARD_SVC_MAX_TARGET_NAME, name, st);
    }
    return rc;
}

int svc_tensor_opt_view(const Fusion__Tensor *m, wire_tensor *v, const wire_tensor **out, const char *what,
                        const char *field, rpc_status *st) {
    *out = NULL;
    if (!m) return RPC_OK;
    char name[96];
    snprintf(name, sizeof name, "%s%s", what, field);
    int rc = svc_tensor_view(m, v, name, st);
    if (!rc) *out = v;
    return rc;
}

int svc_state_view_set(const Fusion__AdapterState *m, svc_state_view *b, const char *what, rpc_status *st) {
    shard_svc_state *v = &b->state;
    *v = (shard_svc_state){0};
    char name[96];
    snprintf(name, sizeof name, "%s.", what);
    svc_i32 f[] = {{"first_block", m->first_block, &v->first_block}, {"last_block", m->last_block, &v->last_block}};
    int rc = svc_narrow(f, 2, name, st);
    if (!rc && m->lora) {
        snprintf(name, sizeof name, "%s.lora", what);
        rc = svc_lora_view(m->lora, &b->lora, name, st);
        v->lora = &b->lora;
    }
    if (!rc) rc = svc_tensor_opt_view(m->params, &b->params, &v->params, what, ".params", st);
    if (!rc) rc = svc_tensor_opt_view(m->moment1, &b->moment1, &v->moment1, what, ".moment1", st);
    if (!rc) rc = svc_tensor_opt_view(m->moment2, &b->moment2, &v->moment2, what, ".moment2", st);
    return rc;
}

