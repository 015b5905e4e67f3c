/* tokenize.c -- fusion-tokenize: encode / decode JSON-lines requests with a tokenizer.json or GGUF tokenizer.
 *
 * Usage: fusion-tokenize (--hf DIR_OR_TOKENIZER_JSON | --gguf FILE) < requests > responses
 *
 * One JSON object per input line, one JSON object per output line:
 *   {"op":"encode","text":"...","add_special":false,"parse_special":true}  -> {"ids":[...]}
 *     ("text_hex":"48e4" instead of "text" encodes raw bytes, e.g. invalid UTF-8;
 *      "plain":[[start,end],...] byte ranges where special tokens stay text: tok_encode_spans)
 *   {"op":"chat","messages":[...],"tools":[...],"add_generation_prompt":true,"kwargs":{...}}
 *     -> {"text":"...","spans":[[start,end],...],"ids":[...],"ids_parsed":[...]}
 *        (the tokenizer's chat template rendered with tpl_apply_chat_spans; ids:
 *         tok_encode_spans of the text with its data ranges, as the gateway does;
 *         ids_parsed: tok_encode with every special token parsed)
 *   {"op":"decode","ids":[...],"skip_special":false}
 *     -> {"text":"...","pieces":["...", ...]}  (pieces: what the streaming decoder
 *        emitted after each id, then after the flush)
 *   {"op":"info"} -> {"vocab_size":N,"bos":..,"eos":..,"add_bos":..,"add_eos":..,
 *                     "eog":[...],"kind":"...","bos_str":..,"eos_str":..,"chat_template":..}
 * A failed request answers {"error":"...","status":"..."}; the exit status is
 * 0 unless the tokenizer cannot be loaded or the input is not JSON.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat-template.h"
#include "gguf.h"
#include "status.h"
#include "tokenizer.h"

static void usage(void) {
    fprintf(stderr, "usage: fusion-tokenize (--hf DIR_OR_TOKENIZER_JSON | --gguf FILE) < requests.jsonl\n");
}

static json_t *error_obj(int rc) {
    return json_pack("{s:s,s:s}", "error", fu_last_error(), "status", fu_status_str(rc));
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static json_t *ids_json(const int32_t *ids, size_t n) {
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    return arr;
}

/* Reads "plain": [[start, end], ...] into *out (malloc'd; NULL when absent). */
static int read_plain(const json_t *jp, tok_span **out, size_t *n) {
    *out = NULL;
    *n = json_array_size(jp);
    if (!*n) return 0;
    *out = malloc(*n * sizeof **out);
    if (!*out) return -1;
    for (size_t i = 0; i < *n; i++) {
        const json_t *r = json_array_get(jp, i);
        (*out)[i] = (tok_span){(size_t)json_integer_value(json_array_get(r, 0)),
                               (size_t)json_integer_value(json_array_get(r, 1))};
    }
    return 0;
}

static json_t *do_encode(const tok_tokenizer *t, const json_t *req) {
    const json_t *jt = json_object_get(req, "text"), *jh = json_object_get(req, "text_hex");
    char *buf = NULL;
    const char *text;
    size_t len;
    if (json_is_string(jh)) {
        const char *h = json_string_value(jh);
        size_t hl = json_string_length(jh);
        if (hl % 2) return json_pack("{s:s}", "error", "text_hex has odd length");
        buf = malloc(hl / 2 + 1);
        if (!buf) return json_pack("{s:s}", "error", "out of memory");
        for (size_t i = 0; i < hl / 2; i++) {
            int a = hexval(h[2 * i]), b = hexval(h[2 * i + 1]);
            if (a < 0 || b < 0) {
                free(buf);
                return json_pack("{s:s}", "error", "text_hex is not hex");
            }
            buf[i] = (char)(a * 16 + b);
        }
        text = buf;
        len = hl / 2;
    } else if (json_is_string(jt)) {
        text = json_string_value(jt);
        len = json_string_length(jt);
    } else {
        return json_pack("{s:s}", "error", "encode needs text or text_hex");
    }
    bool add_special = json_is_true(json_object_get(req, "add_special"));
    const json_t *ps = json_object_get(req, "parse_special");
    bool parse_special = ps ? json_is_true(ps) : true;
    const json_t *jp = json_object_get(req, "plain");
    tok_span *plain = NULL;
    size_t n_plain = 0;
    if (read_plain(jp, &plain, &n_plain)) {
        free(buf);
        return json_pack("{s:s}", "error", "out of memory");
    }
    int32_t *ids;
    size_t n;
    int rc = jp ? tok_encode_spans(t, text, len, add_special, plain, n_plain, &ids, &n)
                : tok_encode(t, text, len, add_special, parse_special, &ids, &n);
    free(plain);
    free(buf);
    if (rc) return error_obj(rc);
    json_t *arr = ids_json(ids, n);
    free(ids);
    return json_pack("{s:o}", "ids", arr);
}

static json_t *do_chat(const tok_tokenizer *t, const json_t *req) {
    const char *src = tok_chat_template(t);
    if (!src) return json_pack("{s:s}", "error", "the tokenizer has no chat template");
    tpl_template *tpl;
    int rc = tpl_compile(src, &tpl);
    if (rc) return error_obj(rc);
    const json_t *tools = json_object_get(req, "tools"), *kw = json_object_get(req, "kwargs");
    char *text = NULL;
    size_t len = 0, n_spans = 0, n = 0, n_parsed = 0;
    tpl_span *spans = NULL;
    tok_span *plain = NULL;
    int32_t *ids = NULL, *parsed = NULL;
    rc = tpl_apply_chat_spans(tpl, json_object_get(req, "messages"), json_is_array(tools) ? tools : NULL,
                              json_is_true(json_object_get(req, "add_generation_prompt")), tok_bos_str(t),
                              tok_eos_str(t), json_is_object(kw) ? kw : NULL, &text, &len, &spans, &n_spans);
    tpl_free(tpl);
    json_t *jspans = json_array();
    if (!rc && n_spans && !(plain = malloc(n_spans * sizeof *plain))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (size_t i = 0; !rc && i < n_spans; i++) {
        plain[i] = (tok_span){spans[i].start, spans[i].end};
        json_array_append_new(jspans, json_pack("[I,I]", (json_int_t)spans[i].start, (json_int_t)spans[i].end));
    }
    if (!rc) rc = tok_encode_spans(t, text, len, false, plain, n_spans, &ids, &n);
    if (!rc) rc = tok_encode(t, text, len, false, true, &parsed, &n_parsed);
    json_t *res = rc ? error_obj(rc)
                     : json_pack("{s:s%,s:O,s:o,s:o}", "text", text, len, "spans", jspans, "ids", ids_json(ids, n),
                                 "ids_parsed", ids_json(parsed, n_parsed));
    json_decref(jspans);
    free(text);
    free(spans);
    free(plain);
    free(ids);
    free(parsed);
    return res;
}

static json_t *do_decode(const tok_tokenizer *t, const json_t *req) {
    const json_t *jids = json_object_get(req, "ids");
    if (!json_is_array(jids)) return json_pack("{s:s}", "error", "decode needs ids");
    size_t n = json_array_size(jids);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return json_pack("{s:s}", "error", "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(jids, i);
        ids[i] = json_is_integer(v) ? (int32_t)json_integer_value(v) : -1;
    }
    bool skip = json_is_true(json_object_get(req, "skip_special"));
    char *text;
    size_t len;
    int rc = tok_decode(t, ids, n, skip, &text, &len);
    if (rc) {
        free(ids);
        return error_obj(rc);
    }
    json_t *pieces = json_array();
    tok_decoder *d;
    rc = tok_decoder_init(t, skip, &d);
    for (size_t i = 0; i <= n && !rc; i++) {
        const char *p;
        size_t pl;
        rc = i < n ? tok_decoder_push(d, ids[i], &p, &pl) : tok_decoder_flush(d, &p, &pl);
        /* json_stringn refuses invalid UTF-8: a broken piece shows as null */
        if (!rc) json_array_append_new(pieces, pl ? json_stringn(p, pl) : json_string(""));
    }
    tok_decoder_free(d);
    free(ids);
    json_t *res;
    if (rc) {
        json_decref(pieces);
        res = error_obj(rc);
    } else {
        json_t *jtext = json_stringn(text, len);
        res = json_pack("{s:o,s:o}", "text", jtext ? jtext : json_null(), "pieces", pieces);
    }
    free(text);
    return res;
}

static json_t *opt_str(const char *s) { return s ? json_string(s) : json_null(); }

static json_t *do_info(const tok_tokenizer *t) {
    const int32_t *eog;
    size_t neog = tok_eog_ids(t, &eog);
    json_t *je = json_array();
    for (size_t i = 0; i < neog; i++) json_array_append_new(je, json_integer(eog[i]));
    return json_pack("{s:i,s:i,s:i,s:i,s:i,s:b,s:b,s:o,s:s,s:o,s:o,s:o}", "vocab_size",
                     (int)tok_vocab_size(t), "bos", (int)tok_bos(t), "eos", (int)tok_eos(t), "unk",
                     (int)tok_unk(t), "pad", (int)tok_pad(t), "add_bos", tok_add_bos(t), "add_eos",
                     tok_add_eos(t), "eog", je, "kind", tok_kind(t), "bos_str", opt_str(tok_bos_str(t)),
                     "eos_str", opt_str(tok_eos_str(t)), "chat_template",
                     opt_str(tok_chat_template(t)));
}

int main(int argc, char **argv) {
    const char *hf = NULL, *gg = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--hf") && i + 1 < argc) {
            hf = argv[++i];
        } else if (!strcmp(argv[i], "--gguf") && i + 1 < argc) {
            gg = argv[++i];
        } else {
            usage();
            return 2;
        }
    }
    if (!hf == !gg) {
        usage();
        return 2;
    }
    tok_tokenizer *t = NULL;
    int rc;
    if (hf) {
        rc = tok_load_hf(hf, &t);
    } else {
        gguf_file *f;
        rc = gguf_open(gg, &f);
        if (!rc) {
            rc = tok_load_gguf(f, &t);
            gguf_close(f);
        }
    }
    if (rc) {
        fprintf(stderr, "fusion-tokenize: %s (%s)\n", fu_last_error(), fu_status_str(rc));
        return 1;
    }
    size_t cap = 1 << 16;
    char *line = malloc(cap);
    int status = 0;
    ssize_t got;
    while (line && (got = getline(&line, &cap, stdin)) > 0) {
        json_error_t jerr;
        json_t *req = json_loadb(line, (size_t)got, JSON_ALLOW_NUL, &jerr);
        if (!json_is_object(req)) {
            fprintf(stderr, "fusion-tokenize: bad request line: %s\n", req ? "not an object" : jerr.text);
            json_decref(req);
            status = 1;
            break;
        }
        const char *op = json_string_value(json_object_get(req, "op"));
        json_t *res;
        if (op && !strcmp(op, "decode")) res = do_decode(t, req);
        else if (op && !strcmp(op, "info")) res = do_info(t);
        else if (op && !strcmp(op, "chat")) res = do_chat(t, req);
        else if (!op || !strcmp(op, "encode")) res = do_encode(t, req);
        else res = json_pack("{s:s}", "error", "unknown op");
        json_decref(req);
        char *s = res ? json_dumps(res, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
        json_decref(res);
        if (!s) {
            fputs("{\"error\":\"cannot serialize response\"}\n", stdout);
        } else {
            fputs(s, stdout);
            fputc('\n', stdout);
            free(s);
        }
        fflush(stdout);
    }
    free(line);
    tok_free(t);
    return status;
}
