/* test_chat_template.c -- chat-template interpreter: error paths, limits, concurrency and malformed input. */
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <jansson.h>
#include <pthread.h>

#include "chat-template.h"
#include "status.h"

/* Renders `src` with the JSON context `ctx_json` (NULL: empty); returns the
 * status and sets *out (caller frees) on success. */
static int render(const char *src, const char *ctx_json, char **out) {
    tpl_template *t = NULL;
    *out = NULL;
    int rc = tpl_compile(src, &t);
    if (rc)
        return rc;
    json_t *ctx = ctx_json ? json_loads(ctx_json, 0, NULL) : NULL;
    if (ctx_json)
        assert_non_null(ctx);
    rc = tpl_render(t, ctx, out);
    json_decref(ctx);
    tpl_free(t);
    return rc;
}

static void expect_render(const char *src, const char *ctx, const char *want) {
    char *out = NULL;
    int rc = render(src, ctx, &out);
    if (rc)
        fail_msg("render of %s failed: %s", src, fu_last_error());
    assert_string_equal(out, want);
    free(out);
}

static void expect_error(const char *src, const char *ctx, int status, const char *needle) {
    char *out = NULL;
    int rc = render(src, ctx, &out);
    if (rc != status)
        fail_msg("%.80s: expected status %d, got %d (%s) output=%.80s", src, status, rc, fu_last_error(),
                 out ? out : "(null)");
    assert_null(out);
    if (needle && !strstr(fu_last_error(), needle))
        fail_msg("%s: error \"%s\" lacks \"%s\"", src, fu_last_error(), needle);
}

static const char *CHATML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static void test_basic_renders(void **state) {
    (void)state;
    expect_render("Hello {{ name }}!", "{\"name\": \"w\\u00f6rld\"}", "Hello wörld!");
    expect_render("{% for x in xs %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
                  "{\"xs\": [\"a\", \"b\"]}", "1a,2b");
    expect_render("[{{ missing }}][{{ d.missing }}]", "{\"d\": {}}", "[][]");
    expect_render("{{ d|tojson }}", "{\"d\": {\"k\": [1, 2.5, null, true, \"\\u00e9\"]}}",
                  "{\"k\": [1, 2.5, null, true, \"é\"]}");
    expect_render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
                  NULL, "6");
    expect_render("a\n  {% if true %}\n  b\n  {% endif %}\nc", NULL, "a\n  b\nc");
    expect_render("{{ 'a,b'.split(',')[::-1]|join('-') }} {{ 7 // 2 }} {{ 7 / 2 }} {{ 1e16 }}", NULL, "b-a 3 3.5 1e+16");
    expect_render("{% macro m(x, y='d') %}<{{ x }}{{ y }}>{% endmacro %}{{ m(1) }}{{ m(2, y='e') }}", NULL, "<1d><2e>");
    expect_render("", NULL, "");
    expect_render("trailing newline dropped\n", NULL, "trailing newline dropped");
}

static void test_apply_chat(void **state) {
    (void)state;
    tpl_template *t = NULL;
    assert_int_equal(tpl_compile(CHATML, &t), FU_OK);
    json_t *msgs = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"},"
                              " {\"role\": \"user\", \"content\": \"Hi \\u2603\"}]",
                              0, NULL);
    assert_non_null(msgs);
    char *out = NULL;
    assert_int_equal(tpl_apply_chat(t, msgs, NULL, 1, "<s>", "</s>", NULL, &out), FU_OK);
    assert_string_equal(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n"
                             "<|im_start|>assistant\n");
    free(out);

    /* tools=None is defined-but-none; bos undefined when NULL; kwargs override. */
    tpl_template *t2 = NULL;
    assert_int_equal(tpl_compile("{{ tools is defined }}{{ tools is none }}{{ bos_token is defined }}"
                                 "{{ eos_token }}{{ add_generation_prompt }}{{ flag }}",
                                 &t2),
                     FU_OK);
    json_t *kw = json_loads("{\"flag\": false, \"eos_token\": \"E\"}", 0, NULL);
    assert_int_equal(tpl_apply_chat(t2, msgs, NULL, 0, NULL, "</s>", kw, &out), FU_OK);
    assert_string_equal(out, "TrueTrueFalseEFalseFalse");
    free(out);

    /* Bad arguments. */
    assert_int_equal(tpl_apply_chat(t2, kw, NULL, 0, NULL, NULL, NULL, &out), FU_ERR_INVALID);
    assert_null(out);
    assert_int_equal(tpl_apply_chat(t2, msgs, NULL, 0, NULL, NULL, msgs, &out), FU_ERR_INVALID);
    assert_int_equal(tpl_apply_chat(NULL, msgs, NULL, 0, NULL, NULL, NULL, &out), FU_ERR_INVALID);
    assert_int_equal(tpl_render(t2, msgs, &out), FU_ERR_INVALID); /* context must be an object */
    json_decref(kw);
    json_decref(msgs);
    tpl_free(t);
    tpl_free(t2);
}

static void test_syntax_errors(void **state) {
    (void)state;
    static const struct {
        const char *src, *needle;
    } cases[] = {
        {"line1\n{% if x %}\nline3", "line 3"},
        {"{% for x in xs %}{% endif %}", "endif"},
        {"a\nb\n{{ 1 + }}", "line 3"},
        {"{{ 'unterminated }}", "unterminated string"},
        {"{% frobnicate %}", "unknown tag 'frobnicate'"},
        {"{# open comment", "comment"},
        {"{{ (1, 2 }}", NULL},
        {"{{ x | }}", NULL},
        {"{% break %}", "outside loop"},
        {"{% macro m(a=1, b) %}{% endmacro %}", "non-default argument"},
        {"{{ 99999999999999999999 }}", "too large"},
        {"{{ '\\x4' }}", "escape"},
        {"{% set %}", NULL},
        {"{% include 'x' %}", "not supported"},
        {"ok\n\xff\xfe", "invalid UTF-8"},
        {"{{ x|nosuchfilter }}", "No filter named 'nosuchfilter'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tpl_template *t = (tpl_template *)0x1;
        int rc = tpl_compile(cases[i].src, &t);
        if (rc != FU_ERR_TEMPLATE)
            fail_msg("%s: expected a syntax error, got %d", cases[i].src, rc);
        assert_null(t);
        assert_non_null(strstr(fu_last_error(), "syntax error"));
        if (cases[i].needle && !strstr(fu_last_error(), cases[i].needle))
            fail_msg("%s: \"%s\" lacks \"%s\"", cases[i].src, fu_last_error(), cases[i].needle);
    }
    /* Deep nesting fails cleanly instead of exhausting the stack. */
    size_t n = 20000;
    char *deep = malloc(2 * n + 16);
    assert_non_null(deep);
    memcpy(deep, "{{ ", 3);
    memset(deep + 3, '(', n);
    memcpy(deep + 3 + n, "1 }}", 5);
    tpl_template *t = NULL;
    assert_int_equal(tpl_compile(deep, &t), FU_ERR_TEMPLATE);
    size_t k = 0;
    for (size_t i = 0; i < 2000; i++)
        k += (size_t)snprintf(deep + k, 2 * n + 16 - k, "{%% if x %%}");
    assert_int_equal(tpl_compile(deep, &t), FU_ERR_TEMPLATE);
    assert_non_null(strstr(fu_last_error(), "nested too deeply"));
    free(deep);

    assert_int_equal(tpl_compile(NULL, &t), FU_ERR_INVALID);
    assert_int_equal(tpl_compile("x", NULL), FU_ERR_INVALID);
    tpl_free(NULL);
}

static void test_runtime_errors(void **state) {
    (void)state;
    expect_error("{{ raise_exception('Conversation roles must alternate') }}", NULL, FU_ERR_TEMPLATE,
                 "Conversation roles must alternate");
    expect_error("ok\n{{ missing.attr }}", NULL, FU_ERR_TEMPLATE, "line 2: 'missing' is undefined");
    expect_error("{{ d.a.b }}", "{\"d\": {}}", FU_ERR_TEMPLATE, "'dict object' has no attribute 'a'");
    expect_error("{{ 'a' + 1 }}", NULL, FU_ERR_TEMPLATE, "can only concatenate str");
    expect_error("{{ 1 / 0 }}", NULL, FU_ERR_TEMPLATE, "division by zero");
    expect_error("{{ xs.append(1) }}", "{\"xs\": []}", FU_ERR_TEMPLATE, "unsafe");
    expect_error("{% for x in 3 %}{% endfor %}", NULL, FU_ERR_TEMPLATE, "not iterable");
    expect_error("{% if x %}{{ x|nosuchfilter }}{% endif %}", "{\"x\": 1}", FU_ERR_TEMPLATE,
                 "No filter named 'nosuchfilter'");
    expect_render("{% if x %}{{ x|nosuchfilter }}{% endif %}ok", NULL, "ok");
    expect_error("{{ missing() }}", NULL, FU_ERR_TEMPLATE, "undefined");
    /* a literal that fails while it is built, then called: its half-built value is freed once */
    expect_error("{{ {'a': x.s}() }}", NULL, FU_ERR_TEMPLATE, "'x' is undefined");
    expect_error("{{ [1, x.s]() }}", NULL, FU_ERR_TEMPLATE, "'x' is undefined");
    expect_error("{{ range(100001)|length }}", NULL, FU_ERR_TEMPLATE, "Range too big");
    expect_error("{% set n = 1 %}{% set n.a = 2 %}", NULL, FU_ERR_TEMPLATE, "non-namespace");
    expect_error("{% set ns = namespace() %}{% set ns.self = [ns] %}", NULL, FU_ERR_TEMPLATE, "inside itself");
    expect_error("{% set ns = namespace() %}{% for x in [ns] %}{% set ns.l = loop %}{% endfor %}", NULL,
                 FU_ERR_TEMPLATE, "inside itself");
    expect_error("{% for x in [1] %}{{ loop.changed([loop]) }}{% endfor %}", NULL, FU_ERR_TEMPLATE, "loop itself");
    expect_error("{% set a = namespace() %}{% set b = namespace(x=a) %}{% set a.y = {'k': [b]} %}", NULL,
                 FU_ERR_TEMPLATE, "inside itself");
    expect_render("{% set a = namespace() %}{% set b = namespace(x=a) %}{% set b.y = [a, {'k': a}] %}{{ b.y|length }}",
                  NULL, "2");
    expect_error("{{ 9223372036854775807 + 1 }}", NULL, FU_ERR_TEMPLATE, "overflow");
    /* An error inside a macro, a loop and a captured block unwinds cleanly. */
    expect_error("{% macro m() %}{% for i in [1] %}{% set x %}{{ 1 / 0 }}{% endset %}{% endfor %}{% endmacro %}{{ m() }}",
                 NULL, FU_ERR_TEMPLATE, "division by zero");
}

static int render_limited(const char *src, const tpl_limits *lim) {
    tpl_template *t = NULL;
    int rc = tpl_compile(src, &t);
    assert_int_equal(rc, FU_OK);
    char *out = NULL;
    rc = tpl_render_ex(t, NULL, lim, &out, NULL);
    free(out);
    tpl_free(t);
    return rc;
}

static void test_limits(void **state) {
    (void)state;
    tpl_limits lim = {.max_work = 10000};
    assert_int_equal(render_limited("{% for i in range(100000) %}{% endfor %}", &lim), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "work limit"));
    lim = (tpl_limits){.max_output = 1000};
    assert_int_equal(render_limited("{% for i in range(1000) %}xx{% endfor %}", &lim), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "output"));
    lim = (tpl_limits){.max_memory = 1 << 20};
    assert_int_equal(render_limited("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                                    &lim),
                     FU_ERR_EXHAUSTED);
    assert_int_equal(render_limited("{{ 'x' * 100000000000 }}", &lim), FU_ERR_EXHAUSTED);
    assert_int_equal(render_limited("{{ [1, 2] * 100000000000 }}", &lim), FU_ERR_EXHAUSTED);
    lim = (tpl_limits){.max_depth = 8};
    assert_int_equal(render_limited("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", &lim), FU_ERR_EXHAUSTED);
    /* Runaway templates stop (the default work budget is exercised by the oracle test, unsanitized). */
    lim = (tpl_limits){.max_work = 1000000};
    assert_int_equal(render_limited("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                                    &lim),
                     FU_ERR_EXHAUSTED);
    assert_int_equal(render_limited("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL), FU_ERR_EXHAUSTED);
    assert_int_equal(render_limited("{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = [ns.l] %}"
                                    "{% endfor %}{{ ns.l }}{{ ns.l == ns.l }}",
                                    NULL),
                     FU_ERR_TEMPLATE);
    /* Within limits, the same constructs are fine. */
    lim = (tpl_limits){.max_work = 100000, .max_output = 100000, .max_depth = 8};
    assert_int_equal(render_limited("{% for i in range(1000) %}{{ i }}{% endfor %}", &lim), FU_OK);
}

static void test_output_with_nul(void **state) {
    (void)state;
    tpl_template *t = NULL;
    assert_int_equal(tpl_compile("a{{ s }}b", &t), FU_OK);
    json_t *ctx = json_pack("{s:s%}", "s", "x\0y", (size_t)3);
    assert_non_null(ctx);
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(tpl_render_ex(t, ctx, NULL, &out, &len), FU_OK);
    assert_int_equal(len, 5);
    assert_memory_equal(out, "ax\0yb", 5);
    free(out);
    json_decref(ctx);
    tpl_free(t);
}

/* Concurrent renders of one compiled template give identical output. */
typedef struct worker {
    const tpl_template *t;
    const json_t *ctx;
    const char *want;
    int failures;
} worker;

static void *render_worker(void *arg) {
    worker *w = arg;
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        if (tpl_render(w->t, w->ctx, &out) != FU_OK || strcmp(out, w->want) != 0)
            w->failures++;
        free(out);
    }
    return NULL;
}

static void test_concurrent_renders(void **state) {
    (void)state;
    const char *src =
        "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}"
        "[{{ loop.index }}:{{ m.role|upper }}:{{ m.content|trim }}:{{ m|tojson }}]{%- endfor -%}"
        "{{ ns.n }}{{ 'x' ~ 'literal' }}";
    tpl_template *t = NULL;
    assert_int_equal(tpl_compile(src, &t), FU_OK);
    json_t *ctx = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \" hi \"},"
                             " {\"role\": \"assistant\", \"content\": \"yo\"}]}",
                             0, NULL);
    char *want = NULL;
    assert_int_equal(tpl_render(t, ctx, &want), FU_OK);
    assert_string_equal(want, "[1:USER:hi:{\"role\": \"user\", \"content\": \" hi \"}]"
                              "[2:ASSISTANT:yo:{\"role\": \"assistant\", \"content\": \"yo\"}]2xliteral");
    pthread_t th[4];
    worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker){.t = t, .ctx = ctx, .want = want};
        assert_int_equal(pthread_create(&th[i], NULL, render_worker, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(w[i].failures, 0);
    }
    free(want);
    json_decref(ctx);
    tpl_free(t);
}

/* Random token soup: compile and render must never crash, leak or hang. */
static void test_random_templates(void **state) {
    (void)state;
    static const char *const pieces[] = {
        "{{", "}}", "{%", "%}", "{#", "#}", "-", "+", " ", "\n", "for ", "in ", "if ", "else", "elif ", "endif",
        "endfor", "set ", "=", "x", "xs", "d", "loop", ".", "index", "[", "]", "(", ")", "{", "}", ",", ":",
        "'s'", "\"t\"", "1", "2.5", "|", "upper", "tojson", "length", "join", "is ", "defined", "not ", "and ",
        "or ", "~", "*", "/", "%", "macro ", "endmacro", "namespace", "range", "items()", "raw", "endraw",
        "break", "continue", "none", "true", "'\\n'", "é", "\t", "**", "//", "==", "!=", "<", ">", "[::-1]",
    };
    const size_t np = sizeof pieces / sizeof pieces[0];
    json_t *ctx = json_loads("{\"x\": 3, \"xs\": [1, \"a\", null], \"d\": {\"k\": [1, {\"z\": 2}]}}", 0, NULL);
    tpl_limits lim = {.max_work = 20000, .max_output = 1 << 16, .max_memory = 1 << 22, .max_depth = 8};
    unsigned seed = 12345;
    int compiled = 0, rendered = 0;
    for (int iter = 0; iter < 3000; iter++) {
        char src[512];
        size_t len = 0;
        int npieces = 1 + (int)(rand_r(&seed) % 40);
        for (int k = 0; k < npieces; k++) {
            const char *p = pieces[rand_r(&seed) % np];
            size_t pl = strlen(p);
            if (len + pl + 1 >= sizeof src)
                break;
            memcpy(src + len, p, pl);
            len += pl;
        }
        src[len] = '\0';
        tpl_template *t = NULL;
        if (tpl_compile(src, &t) != FU_OK) {
            assert_null(t);
            continue;
        }
        compiled++;
        char *out = NULL;
        int rc = tpl_render_ex(t, ctx, &lim, &out, NULL);
        if (rc == FU_OK) {
            rendered++;
            assert_non_null(out);
        } else {
            assert_null(out);
            assert_true(rc == FU_ERR_TEMPLATE || rc == FU_ERR_EXHAUSTED);
        }
        free(out);
        tpl_free(t);
    }
    assert_true(compiled > 100);
    assert_true(rendered > 50);
    json_decref(ctx);
}

/* `prefix` + `piece` * n + `suffix` as a malloc'd string. */
static char *repeat(const char *prefix, const char *piece, size_t n, const char *suffix) {
    size_t lp = strlen(prefix), lc = strlen(piece), ls = strlen(suffix);
    char *s = malloc(lp + lc * n + ls + 1);
    assert_non_null(s);
    memcpy(s, prefix, lp);
    for (size_t i = 0; i < n; i++)
        memcpy(s + lp + i * lc, piece, lc);
    memcpy(s + lp + lc * n, suffix, ls + 1);
    return s;
}

/* One compile (and, if it compiles, render) run on a small thread stack. */
typedef struct stack_job {
    const char *src;
    tpl_limits lim;
    int rc;
    char out[64];
    char err[256];
} stack_job;

static void *stack_job_run(void *arg) {
    stack_job *j = arg;
    tpl_template *t = NULL;
    j->rc = tpl_compile(j->src, &t);
    char *out = NULL;
    if (!j->rc)
        j->rc = tpl_render_ex(t, NULL, &j->lim, &out, NULL);
    snprintf(j->out, sizeof j->out, "%s", out ? out : "");
    snprintf(j->err, sizeof j->err, "%s", j->rc ? fu_last_error() : "");
    free(out);
    tpl_free(t);
    return NULL;
}

#define ANY_STATUS INT_MIN

/* Compiles and renders `src` in a thread with a 192 KiB stack, a margin
 * below the 256 KiB that the interpreter's nesting limits are sized for (a
 * crash there is a stack overflow), and checks the status (unless
 * ANY_STATUS) and the error or the output. */
static void expect_on_small_stack(const char *src, const tpl_limits *lim, int status, const char *want) {
    stack_job j = {.src = src};
    if (lim)
        j.lim = *lim;
    pthread_attr_t attr;
    pthread_t th;
    assert_int_equal(pthread_attr_init(&attr), 0);
    assert_int_equal(pthread_attr_setstacksize(&attr, 192 << 10), 0);
    assert_int_equal(pthread_create(&th, &attr, stack_job_run, &j), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    pthread_attr_destroy(&attr);
    if (status != ANY_STATUS && j.rc != status)
        fail_msg("%.60s...: expected status %d, got %d (%s)", src, status, j.rc, j.err);
    if (want && !strstr(status ? j.err : j.out, want))
        fail_msg("%.60s...: \"%s\" lacks \"%s\"", src, status ? j.err : j.out, want);
}

/* Long chains (a + b + c..., a|f|g..., a.b.c..., elif...) nest the tree one
 * level per link: they fail to compile with a clear error instead of
 * overflowing the stack in the parser, the name check, eval or free. */
static void test_deep_chains(void **state) {
    (void)state;
    static const struct {
        const char *prefix, *piece, *suffix;
    } chains[] = {
        {"{{ 1", " + 1", " }}"},       {"{{ 'a'", " ~ 'a'", " }}"}, {"{{ 2", " ** 1", " }}"},
        {"{{ x", "|e", " }}"},         {"{{ x", ".a", " }}"},       {"{{ x", "[0]", " }}"},
        {"{{ x", "()", " }}"},         {"{{ x", " or x", " }}"},    {"{{ x", " and x", " }}"},
        {"{{ 1", " if x", " }}"},      {"{{ 1", " * 1", " }}"},     {"{{ x", " is defined or x", " }}"},
        {"{% if x %}", "{% elif x %}", "{% endif %}"},
        {"{% set y | e", "|e", " %}{% endset %}"},
        {"{{ ", "-", "1 }}"},          {"{{ ", "not ", "1 }}"},     {"{{ ", "(", "1 }}"},
        {"{{ ", "[", "1 }}"},          {"", "{% if x %}", ""},      {"", "{% for x in y %}", ""},
    };
    for (size_t i = 0; i < sizeof chains / sizeof chains[0]; i++) {
        char *src = repeat(chains[i].prefix, chains[i].piece, 150000, chains[i].suffix);
        expect_on_small_stack(src, NULL, FU_ERR_TEMPLATE, "nested too deeply");
        free(src);
    }
    /* Chains and nesting as deep as real templates go compile and render. */
    char *src = repeat("{{ 0", " + 1", 150, " }}");
    expect_on_small_stack(src, NULL, FU_OK, "150");
    free(src);
    src = repeat("{{ 'x'", "|upper", 100, " }}");
    expect_on_small_stack(src, NULL, FU_OK, "X");
    free(src);
    src = repeat("", "{% if true %}", 60, "ok");
    char *end = repeat(src, "{% endif %}", 60, "");
    expect_on_small_stack(end, NULL, FU_OK, "ok");
    free(src);
    free(end);
}

/* The deepest templates that compile, and runaway recursion at run time,
 * stay inside a small thread stack. */
static void test_deep_runtime(void **state) {
    (void)state;
    tpl_limits lim = {.max_depth = 100000};
    /* Recursion through macros with deep expressions inside. */
    expect_on_small_stack("{% macro r(n) %}{{ r(((((((n + 1))))))) ~ [[[[[n]]]]] }}{% endmacro %}{{ r(0) }}", &lim,
                          FU_ERR_EXHAUSTED, "nested too deeply at run time");
    expect_on_small_stack("{% macro r(n) %}{% with a = n %}{% for i in [1] %}{% if true %}{% set x %}{{ r(a) }}"
                          "{% endset %}{% endif %}{% endfor %}{% endwith %}{% endmacro %}{{ r(0) }}",
                          &lim, FU_ERR_EXHAUSTED, "nested too deeply at run time");
    expect_on_small_stack("{% macro r(n) %}{% filter upper %}{{ r(n)|e|e|e }}{% endfilter %}{% endmacro %}{{ r(0) }}",
                          &lim, FU_ERR_EXHAUSTED, "nested too deeply at run time");
    /* Macro recursion far deeper than real templates use works. */
    expect_on_small_stack("{% macro r(n) %}{% if n %}{{ r(n - 1) }}{% endif %}{{ n }}{% endmacro %}{{ r(40)|length }}",
                          NULL, FU_OK, "72");
    /* Printing, serializing and comparing the most deeply nested values at the deepest recursion. */
    expect_on_small_stack("{% set ns = namespace(l=[]) %}{% for i in range(99) %}{% set ns.l = [ns.l] %}{% endfor %}"
                          "{% macro r(n) %}{% if n %}{{ r(n - 1) }}{% else %}{{ ns.l|tojson|length }}{{ ns.l|string|length }}"
                          "{{ ns.l == ns.l }}{{ ns.l < ns.l }}{% endif %}{% endmacro %}{{ r(48) }}",
                          NULL, ANY_STATUS, NULL);
    /* The deepest expressions and blocks the parser accepts. */
    for (size_t n = 1; n < 400; n += 7) {
        char *open = repeat("{{ ", "(", n, "1");
        char *src = repeat(open, ")", n, " }}");
        expect_on_small_stack(src, NULL, ANY_STATUS, NULL);
        free(open);
        free(src);
        open = repeat("{{ ", "[", n, "1");
        src = repeat(open, "]", n, "|tojson }}");
        expect_on_small_stack(src, NULL, ANY_STATUS, NULL);
        free(open);
        free(src);
        open = repeat("", "{% if true %}{% for i in [1] %}{% with %}", n, "ok");
        src = repeat(open, "{% endwith %}{% endfor %}{% endif %}", n, "");
        expect_on_small_stack(src, NULL, ANY_STATUS, NULL);
        free(open);
        free(src);
    }
}

/* Deeply nested JSON variables fail cleanly (jansson itself builds up to 2048 levels). */
static void test_deep_json(void **state) {
    (void)state;
    json_t *v = json_array();
    for (int i = 0; i < 5000 && v; i++) {
        json_t *w = json_array();
        if (w && json_array_append_new(w, v)) {
            json_decref(w);
            w = NULL;
        }
        v = w;
    }
    json_t *ctx = json_pack("{s:o}", "x", v);
    assert_non_null(ctx);
    tpl_template *t = NULL;
    assert_int_equal(tpl_compile("{{ x|length }}", &t), FU_OK);
    char *out = NULL;
    assert_int_equal(tpl_render(t, ctx, &out), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "nested too deeply"));
    assert_null(out);
    tpl_free(t);
    json_decref(ctx);
}

/* Each render has a step budget: tens of thousands of statements (here
 * assignments to distinct variables, whose tables are searched linearly) fail
 * fast with a clear error instead of running for seconds. */
static void test_step_budget(void **state) {
    (void)state;
    size_t n = 60000;
    char *src = malloc(n * 32);
    assert_non_null(src);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += (size_t)snprintf(src + k, n * 32 - k, "{%% set v%zu = %zu %%}", i, i);
    struct timespec t0, t1;
    char *out = NULL;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = render(src, NULL, &out);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(src);
    free(out);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (rc != FU_ERR_EXHAUSTED || !strstr(fu_last_error(), "step limit"))
        fail_msg("60000 assignments: expected the step limit, got %d (%s) after %.2f s", rc,
                 rc ? fu_last_error() : "ok", secs);
    /* ~0.1 s unsanitized; the unbounded render took 5 s (30 s under ASan) */
    if (secs > 10.0)
        fail_msg("the step budget took %.2f s to stop the render", secs);
    /* The budget is configurable and counts loop iterations. */
    tpl_limits lim = {.max_steps = 1000};
    assert_int_equal(render_limited("{% for i in range(1000) %}{% endfor %}", &lim), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "step limit (1000 steps)"));
    assert_int_equal(render_limited("{% for i in range(100) %}{{ i }}{% endfor %}", &lim), FU_OK);
    lim.max_steps = 0; /* the default */
    assert_int_equal(render_limited("{% for i in range(100000) %}{% set x = i %}{% endfor %}", &lim), FU_OK);
}

/* Dicts of many keys are indexed: lookups keep Python's key equality (1 == 1.0 == true, -0.0 == 0),
 * a repeated key replaces its value in place, and a 60,000-key object from the request renders at
 * once (a linear search per key made it quadratic: 3.8 s unsanitized). */
static void test_big_dicts(void **state) {
    (void)state;
    char src[2048];
    size_t k = (size_t)snprintf(src, sizeof src, "{%% set d = {");
    for (int i = 0; i < 40; i++) /* int keys, then 'k0'..'k29', then a repeated 'k3' */
        k += (size_t)snprintf(src + k, sizeof src - k, "%d: %d, ", i, 2 * i);
    for (int i = 0; i < 30; i++)
        k += (size_t)snprintf(src + k, sizeof src - k, "'k%d': %d, ", i, i);
    snprintf(src + k, sizeof src - k,
             "'k3': 'again'} %%}{{ d[1.0] }} {{ d[true] }} {{ d[39] }} {{ d[-0.0] }} {{ d|length }} {{ 40 in d }} "
             "{{ d.k3 }} {{ d['k29'] }} {{ (d|list)[38:42] }} {{ dict(d, extra=1)|length }}");
    expect_render(src, NULL, "2 2 78 0 70 False again 29 [38, 39, 'k0', 'k1'] 71");
    size_t n = 60000, cap = n * 24 + 64;
    k = 0;
    char *ctx = malloc(cap);
    assert_non_null(ctx);
    k += (size_t)snprintf(ctx + k, cap - k, "{\"big\": {");
    for (size_t i = 0; i < n; i++)
        k += (size_t)snprintf(ctx + k, cap - k, "%s\"k%zu\": %zu", i ? ", " : "", i, i);
    snprintf(ctx + k, cap - k, "}}");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    expect_render("{{ big.k59999 }} {{ big['k0'] }} {{ big|length }} {{ big.k60000 is defined }}", ctx,
                  "59999 0 60000 False");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(ctx);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (secs > 10.0)
        fail_msg("a 60000-key object took %.2f s to render", secs);
}

/* Every builtin is found by name (the interpreter's tables are searched by
 * bisection, so this also checks that they are sorted), and no other name is. */
static void test_builtin_names(void **state) {
    (void)state;
    static const char *const filters[] = {
        "abs", "attr", "batch", "capitalize", "center", "count", "d", "default", "dictsort", "e", "escape",
        "first", "float", "forceescape", "format", "indent", "int", "items", "join", "last", "length", "list",
        "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round", "safe", "select",
        "selectattr", "slice", "sort", "string", "sum", "title", "tojson", "trim", "truncate", "unique", "upper",
        "wordcount",
    };
    static const char *const tests[] = {
        "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false", "filter",
        "float", "ge", "greaterthan", "gt", "in", "integer", "iterable", "le", "lessthan", "lower", "lt",
        "mapping", "ne", "none", "number", "odd", "sameas", "sequence", "string", "test", "true", "undefined",
        "upper",
    };
    static const char *const methods[] = {
        "''.capitalize", "''.casefold", "''.center", "''.count", "''.endswith", "''.find", "''.format",
        "''.index", "''.isalnum", "''.isalpha", "''.isdecimal", "''.isdigit", "''.islower", "''.isnumeric",
        "''.isspace", "''.isupper", "''.join", "''.ljust", "''.lower", "''.lstrip", "''.removeprefix",
        "''.removesuffix", "''.replace", "''.rfind", "''.rindex", "''.rjust", "''.rsplit", "''.rstrip",
        "''.split", "''.splitlines", "''.startswith", "''.strip", "''.swapcase", "''.title", "''.upper",
        "''.zfill", "{}.copy", "{}.get", "{}.items", "{}.keys", "{}.values", "[].copy", "[].count", "[].index",
        "range", "namespace", "dict", "raise_exception", "strftime_now",
    };
    char src[128];
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++) {
        snprintf(src, sizeof src, "{{ '%s' is filter }}", filters[i]);
        expect_render(src, NULL, "True");
    }
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        snprintf(src, sizeof src, "{{ '%s' is test }}", tests[i]);
        expect_render(src, NULL, "True");
    }
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        snprintf(src, sizeof src, "{{ %s is defined }}", methods[i]);
        expect_render(src, NULL, "True");
    }
    expect_render("{{ 'groupby' is filter }}{{ 'aaa' is test }}{{ 'zzz' is filter }}", NULL, "FalseFalseFalse");
    expect_render("{{ ''.get is defined }}{{ {}.index is defined }}{{ [].upper is defined }}", NULL,
                  "FalseFalseFalse");
    expect_render("{{ cycle is defined }}{{ changed is defined }}", NULL, "FalseFalse");
}

/* Renders a chat with tpl_apply_chat_spans (bos "<s>", eos "</s>") and returns the text with
 * each data range in brackets (caller frees); checks the text equals tpl_apply_chat's. */
static char *render_marked(const char *src, const char *messages, const char *tools, const char *kwargs) {
    tpl_template *t;
    if (tpl_compile(src, &t))
        fail_msg("compile %s: %s", src, fu_last_error());
    json_t *m = json_loads(messages, 0, NULL), *tl = tools ? json_loads(tools, 0, NULL) : NULL;
    json_t *kw = kwargs ? json_loads(kwargs, 0, NULL) : NULL;
    assert_non_null(m);
    char *text, *plain;
    size_t len, n;
    tpl_span *sp;
    if (tpl_apply_chat_spans(t, m, tl, 0, "<s>", "</s>", kw, &text, &len, &sp, &n))
        fail_msg("render %s: %s", src, fu_last_error());
    assert_int_equal(tpl_apply_chat(t, m, tl, 0, "<s>", "</s>", kw, &plain), FU_OK);
    assert_string_equal(text, plain);
    char *out = malloc(len + 2 * n + 1);
    assert_non_null(out);
    size_t o = 0, k = 0;
    for (size_t i = 0; i <= len; i++) {
        if (k < n && sp[k].end == i) {
            out[o++] = ']';
            k++;
        }
        if (k < n && sp[k].start == i) {
            assert_true(sp[k].start < sp[k].end && (k == 0 || sp[k - 1].end < sp[k].start));
            out[o++] = '[';
        }
        if (i < len)
            out[o++] = text[i];
    }
    out[o] = '\0';
    assert_int_equal(k, n);
    free(text);
    free(plain);
    free(sp);
    json_decref(m);
    json_decref(tl);
    json_decref(kw);
    tpl_free(t);
    return out;
}

/* Data ranges: strings from messages, tools and kwargs are data; concatenation keeps exact
 * ranges, other operations on data make their whole result data. [..] marks data. */
static void test_data_spans(void **state) {
    (void)state;
    static const char *const msgs = "[{\"role\": \"user\", \"content\": \" hi \"}, {\"role\": \"bot\", \"content\": \"yo\"}]";
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"{{ '<|im_start|>' + messages[0].role + '\\n' + messages[0].content + '<|im_end|>' }}",
         "<|im_start|>[user]\n[ hi ]<|im_end|>"},
        {"{{ bos_token ~ messages[1].content ~ 1 ~ eos_token }}", "<s>[yo]1</s>"},
        {"{{ messages|map(attribute='content')|join('<sep>') }}", "[ hi ]<sep>[yo]"},
        {"{{ '<sep>'.join([messages[1].content, 'x']) }}", "[yo]<sep>x"},
        {"{{ '<a>%s</a>' % messages[1].content }}{{ '<b>%s%d</b>'|format(messages[1].content, 2) }}",
         "<a>[yo]</a><b>[yo]2</b>"},
        {"{{ '<a>{}</a>'.format(messages[1].content) }}", "<a>[yo]</a>"},
        {"{% macro r(m) %}<a>{{ m.content }}</a>{% endmacro %}{{ r(messages[1]) }}", "<a>[yo]</a>"},
        {"{% set ns = namespace(p='') %}{% for m in messages %}{% set ns.p = ns.p + '<a>' + m.content %}{% endfor %}"
         "{{ ns.p }}",
         "<a>[ hi ]<a>[yo]"},
        {"{% set x %}<a>{{ messages[1].content }}{% endset %}{{ x }}", "<a>[yo]"},
        {"{{ ('<a>' + messages[1].content)|upper }}", "[<A>YO]"},
        {"{{ messages[0].content[1:] }}|{{ messages[0].content|trim }}|{{ messages[1].content[0] }}", "[hi ]|[hi]|[y]"},
        {"{{ messages[1].content.replace('y', '<a>') }}", "[<a>o]"},
        {"{{ (' <a>' + messages[0].content).strip() }}|{{ ('<a>' + messages[1].content)|trim('<') }}", "<a>[ hi]|a>[yo]"},
        {"{{ '<a>y'.strip(messages[1].content) }}", "[<a>]"},
        {"{% for c in messages[1].content %}{{ c }}<a>{% endfor %}", "[y]<a>[o]<a>"},
        {"{{ messages[0].content }}{{ messages[1].content }}", "[ hi yo]"},
        {"{% if messages[1].content == 'yo' %}<a>{% endif %}{{ messages|length }}", "<a>2"},
        {"{{ tools|tojson }}", "[[{\"a\": 1}]]"},
        {"{{ custom }}|{{ messages[1].content * 2 }}", "[zz]|[yoyo]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *got = render_marked(cases[i].src, msgs, "[{\"a\": 1}]", "{\"custom\": \"zz\"}");
        if (strcmp(got, cases[i].want))
            fail_msg("%s\n  got  %s\n  want %s", cases[i].src, got, cases[i].want);
        free(got);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_basic_renders),   cmocka_unit_test(test_apply_chat),
        cmocka_unit_test(test_syntax_errors),   cmocka_unit_test(test_runtime_errors),
        cmocka_unit_test(test_limits),          cmocka_unit_test(test_output_with_nul),
        cmocka_unit_test(test_concurrent_renders), cmocka_unit_test(test_random_templates),
        cmocka_unit_test(test_builtin_names),   cmocka_unit_test(test_data_spans),
        cmocka_unit_test(test_deep_chains),     cmocka_unit_test(test_deep_runtime),
        cmocka_unit_test(test_deep_json),       cmocka_unit_test(test_step_budget),
        cmocka_unit_test(test_big_dicts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
