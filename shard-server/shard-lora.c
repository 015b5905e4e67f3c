/* shard-lora.c -- LoRA configs and adapters read from fusion's messages on a shard server. */
#include "shard-lora.h"

#include <string.h>

#include "status.h"

int shard_lora_config(const shard_svc_lora *l, int max_rank, const char *what, lora_config *c, rpc_status *st) {
    *c = lora_config_default();
    if (!l) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: missing", what);
    if (l->r < 1 || l->r > max_rank)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s.r: %d outside [1, %d] (this server's limit)", what, l->r,
                               max_rank);
    c->r = l->r;
    c->alpha = l->alpha;
    c->dropout = l->dropout;
    c->use_rslora = l->use_rslora;
    c->targets = 0;
    for (size_t i = 0; i < l->n_targets; i++) {
        lora_target tg;
        if (!strcmp(l->targets[i], "all-linear")) c->targets |= LORA_TARGETS_ALL;
        else if (lora_target_parse(l->targets[i], &tg))
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s.target_modules: unknown module '%s'", what,
                                   l->targets[i]);
        else c->targets |= LORA_TARGET_BIT(tg);
    }
    int rc = lora_config_check(c);
    return rc ? rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: %s", what, fu_last_error()) : RPC_OK;
}

int shard_lora_floats(const wire_tensor *w, size_t n, const char *what, float *out, rpc_status *st) {
    if (w->dtype != WIRE_F32 || w->n_shape != 1 || w->shape[0] != (int64_t)n)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: must be F32 of shape (%zu)", what, n);
    int rc = wire_decode(w->data, w->data_len, NULL, 0, WIRE_F32, 0, n, out, what);
    return rc ? rpc_status_from_fu(st, rc) : RPC_OK;
}

int shard_lora_from_state(const mdl_model *m, const shard_svc_state *s, int max_rank, lora_adapter **out,
                          rpc_status *st) {
    *out = NULL;
    if (s->first_block != m->first || s->last_block != m->last)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state: blocks [%d, %d), this server holds [%d, %d)",
                               s->first_block, s->last_block, m->first, m->last);
    lora_config cfg;
    int rc = shard_lora_config(s->lora, max_rank, "state.lora", &cfg, st);
    if (rc) return rc;
    if (!s->params) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state.params: missing");
    lora_adapter *ad = NULL;
    int frc = lora_new(&cfg, &m->cfg, m->first, m->last, 0, &ad);
    if (frc) return rpc_status_from_fu(st, frc);
    ad->qk_interleaved = false; /* the params below are in PEFT's order */
    rc = shard_lora_floats(s->params, ad->n_floats, "state.params", ad->data, st);
    if (!rc && (frc = lora_set_qk_order(ad, m->cfg.rope_mode == OP_ROPE_NORM))) rc = rpc_status_from_fu(st, frc);
    if (rc) {
        lora_free(ad);
        return rc;
    }
    *out = ad;
    return RPC_OK;
}
