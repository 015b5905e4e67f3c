/* lora.c -- fusion-lora: write fresh LoRA adapters in PEFT's format and inspect adapter directories. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lora.h"
#include "mapped-file.h"
#include "model.h"
#include "options.h"
#include "status.h"

typedef struct lora_args {
    char *model, *targets, *base_model;
    int r, max_rank;
    double alpha, dropout, random_b;
    bool rslora;
    long seed;
    int span[2];
} lora_args;

static lora_args args = {.span = {0, -1}};

static const fu_opt lora_options[] = {
    {"model", 'm', FU_OPT_PATH, FU_OPT_TO(args.model), "DIR",
     "the base model: a Hugging Face directory or its config.json"},
    {"r", 'r', FU_OPT_INT, FU_OPT_TO(args.r), "N", "init: rank", "8", .lo = 1, .hi = 4096},
    {"alpha", 0, FU_OPT_FLOAT, FU_OPT_TO(args.alpha), "X", "init: lora_alpha", "8"},
    {"dropout", 0, FU_OPT_FLOAT, FU_OPT_TO(args.dropout), "P", "init: lora_dropout", "0"},
    {"rslora", 0, FU_OPT_FLAG, FU_OPT_TO(args.rslora), .help = "init: scale alpha / sqrt(r)"},
    {"targets", 't', FU_OPT_STRING, FU_OPT_TO(args.targets), "LIST",
     "init: comma-separated PEFT module names, or all-linear", "q_proj,v_proj"},
    {"base-model", 0, FU_OPT_STRING, FU_OPT_TO(args.base_model), "NAME",
     "init: base_model_name_or_path (default: --model)"},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), "N", "init: seed of A's initialisation", "0"},
    {"span", 0, FU_OPT_SPAN, FU_OPT_TO(args.span), "A:B", "blocks [A, B) only (default: all)"},
    {"random-b", 0, FU_OPT_FLOAT, FU_OPT_TO(args.random_b), "X",
     "init: B uniform(-X, X) instead of zero (for tests)", "0"},
    {"max-rank", 0, FU_OPT_INT, FU_OPT_TO(args.max_rank), "N", "inspect: largest r accepted",
     "1024", .lo = 1, .hi = 1 << 20},
    FU_OPT_END,
};

static const fu_opt_spec lora_spec = {
    "fusion-lora",
    "usage: fusion-lora --model DIR [options] init OUT_DIR\n"
    "       fusion-lora --model DIR [options] inspect ADAPTER_DIR\n"
    "init writes a fresh adapter (adapter_config.json, adapter_model.safetensors)\n"
    "initialised as PEFT does (A kaiming-uniform, B zero); inspect checks an\n"
    "adapter against the model and prints its config and tensor stats as JSON.\n",
    lora_options, NULL};

/* The model's config from DIR/config.json or a .json path. */
static int read_model_config(const char *path, mdl_config *out) {
    struct stat st;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s%s", path,
             stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? "/config.json" : "");
    char *text;
    size_t len;
    int rc = mf_read(buf, 1 << 20, &text, &len);
    if (rc) return rc;
    rc = mdl_config_read_hf(text, len, buf, out);
    free(text);
    return rc;
}

static int cmd_init(const mdl_config *m, const char *dir) {
    lora_config cfg = lora_config_default();
    cfg.r = args.r;
    cfg.alpha = (float)args.alpha;
    cfg.dropout = (float)args.dropout;
    cfg.use_rslora = args.rslora;
    snprintf(cfg.base_model, sizeof cfg.base_model, "%s", args.base_model ? args.base_model : args.model);
    int rc = lora_targets_parse(args.targets, &cfg.targets);
    lora_adapter *ad = NULL;
    if (!rc) rc = lora_new(&cfg, m, args.span[0], args.span[1] < 0 ? m->n_layers : args.span[1],
                           (uint64_t)args.seed, &ad);
    if (!rc && args.random_b > 0) lora_randomize_b(ad, (uint64_t)args.seed + 1, (float)args.random_b);
    if (!rc && mkdir(dir, 0755) != 0 && !(errno == EEXIST))
        rc = fu_errorf(FU_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    if (!rc) rc = lora_save(ad, dir);
    lora_free(ad);
    return rc;
}

/* Appends {"name", "shape", "sum", "max_abs"} of one matrix to the array `user`. */
static int tensor_stats(const lora_matrix *m, void *user) {
    double sum = 0, max_abs = 0;
    for (size_t i = 0; i < (size_t)m->rows * (size_t)m->cols; i++) {
        sum += m->data[i];
        if (fabs(m->data[i]) > max_abs) max_abs = fabs(m->data[i]);
    }
    json_t *j = json_pack("{s:s,s:[i,i],s:f,s:f}", "name", m->name, "shape", m->rows, m->cols,
                          "sum", sum, "max_abs", max_abs);
    return j && json_array_append_new(user, j) == 0 ? 0 : FU_ERR_NOMEM;
}

static json_t *adapter_json(const lora_adapter *ad) {
    json_t *tensors = json_array(), *targets = json_array();
    for (int t = 0; t < LORA_N_TARGETS; t++)
        if (ad->cfg.targets & LORA_TARGET_BIT(t)) json_array_append_new(targets, json_string(lora_target_name(t)));
    if (lora_foreach(ad, tensor_stats, tensors)) {
        json_decref(tensors);
        json_decref(targets);
        return NULL;
    }
    return json_pack("{s:{s:i,s:f,s:f,s:b,s:o,s:s,s:f},s:i,s:i,s:o}", "config", "r", ad->cfg.r,
                     "lora_alpha", (double)ad->cfg.alpha, "lora_dropout", (double)ad->cfg.dropout,
                     "use_rslora", ad->cfg.use_rslora, "target_modules", targets,
                     "base_model_name_or_path", ad->cfg.base_model, "scale",
                     (double)lora_scale(&ad->cfg), "first", ad->first, "last", ad->last, "tensors", tensors);
}

static int cmd_inspect(const mdl_config *m, const char *dir) {
    lora_adapter *ad;
    int rc = lora_load(dir, m, args.span[0], args.span[1], args.max_rank, &ad);
    if (rc) return rc;
    json_t *j = adapter_json(ad);
    lora_free(ad);
    if (!j) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    json_dumpf(j, stdout, JSON_INDENT(1) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
    printf("\n");
    json_decref(j);
    return FU_OK;
}

int main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&lora_spec, argc, argv, &n);
    if (status < 0 && (n != 2 || (strcmp(argv[1], "init") && strcmp(argv[1], "inspect"))))
        status = fu_opt_fail(&lora_spec, "expected a command, init OUT_DIR or inspect ADAPTER_DIR");
    if (status < 0 && !args.model) status = fu_opt_fail(&lora_spec, "--model is required");
    if (status < 0) {
        mdl_config m;
        int rc = read_model_config(args.model, &m);
        if (!rc) rc = strcmp(argv[1], "init") == 0 ? cmd_init(&m, argv[2]) : cmd_inspect(&m, argv[2]);
        if (rc) fprintf(stderr, "fusion-lora: %s: %s\n", fu_status_str(rc), fu_last_error());
        status = rc ? 1 : 0;
    }
    fu_opt_free(lora_options);
    return status;
}
