/* test_options.c -- base/options: flags and their forms, config files and their precedence, every
 * error path, defaults and the help text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "options.h"
#include "status.h"

/* The destinations of the test table: one of every kind and size. */
typedef struct args {
    bool verbose, head;
    int json;
    bool measure;
    char *model, *listen, *secret;
    fu_opt_list files;
    int workers;
    long budget;
    size_t body;
    uint64_t seed;
    float temperature;
    double latency;
    int kv;
    int span[2];
    int calls;
    char last_call[64];
} args;

static const fu_opt_choice kv_types[] = {{"f32", 32}, {"f16", 16}, {NULL, 0}};

/* FU_OPT_CALL: counts the calls, keeps the value; "bad" is refused. */
static int on_hop(void *ctx, const char *v) {
    args *a = ctx;
    if (!strcmp(v, "bad")) return fu_errorf(FU_ERR_INVALID, "no good");
    a->calls++;
    snprintf(a->last_call, sizeof a->last_call, "%s", v);
    return FU_OK;
}

/* The table over a; t has room for it and its end. */
static void table(args *a, fu_opt t[24]) {
    const fu_opt opts[] = {
        {"config", 0, FU_OPT_CONFIG, .help = "JSON config"},
        {"verbose", 'v', FU_OPT_FLAG, FU_OPT_TO(a->verbose), .help = "say more"},
        {"no-head", 0, FU_OPT_FLAG, FU_OPT_TO(a->head), .help = "leave out the head", .flags = FU_OPT_NEGATE},
        {"json", 'j', FU_OPT_FLAG, FU_OPT_TO(a->json), .help = "JSON output"},
        {"measure", 0, FU_OPT_BOOL, FU_OPT_TO(a->measure), .help = "measure links", .def = "true"},
        {"model", 'm', FU_OPT_PATH, FU_OPT_TO(a->model), .arg = "PATH", .help = "the model\nas a path"},
        {"listen", 0, FU_OPT_STRING, FU_OPT_TO(a->listen), .arg = "HOST:PORT", .def = "127.0.0.1:7001",
         .help = "address", .flags = FU_OPT_NOFILE},
        {"secret-file", 0, FU_OPT_FILE_TEXT, FU_OPT_TO(a->secret), .help = "the secret"},
        {"file", 0, FU_OPT_LIST, FU_OPT_TO(a->files), .help = "a file (repeatable)", .alias = "files"},
        {"workers", 'w', FU_OPT_INT, FU_OPT_TO(a->workers), .def = "32", .lo = 1, .hi = 4096,
         .help = "threads"},
        {"kv-budget-mib", 0, FU_OPT_INT, FU_OPT_TO(a->budget), .lo = 1, .hi = 1L << 40, .help = "KV"},
        {"max-body-bytes", 0, FU_OPT_INT, FU_OPT_TO(a->body), .lo = 0, .hi = 1L << 30},
        {"seed", 0, FU_OPT_INT, FU_OPT_TO(a->seed), .lo = 0, .hi = INT64_MAX, .help = "seed"},
        {"temperature", 't', FU_OPT_FLOAT, FU_OPT_TO(a->temperature), .help = "T"},
        {"latency", 0, FU_OPT_FLOAT, FU_OPT_TO(a->latency), .help = "seconds"},
        {"kv", 0, FU_OPT_CHOICE, FU_OPT_TO(a->kv), .choices = kv_types, .def = "f32", .help = "KV type"},
        {"blocks", 0, FU_OPT_SPAN, FU_OPT_TO(a->span), .hi = 100, .help = "span"},
        {"hop", 0, FU_OPT_CALL, .dest = a, .fn = on_hop, .arg = "H", .help = "a hop",
         .alias = "hops|chain", .flags = FU_OPT_REPEAT},
        FU_OPT_END,
    };
    _Static_assert(sizeof opts / sizeof *opts <= 24, "room for the table");
    memcpy(t, opts, sizeof opts);
}

/* A test's arguments and the table over them: the cmocka state. */
typedef struct fixture {
    args a;
    fu_opt t[24];
} fixture;

static int fixture_setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    if (!f) return -1;
    table(&f->a, f->t);
    *state = f;
    return 0;
}

static int fixture_teardown(void **state) {
    fixture *f = *state;
    fu_opt_free(f->t);
    free(f);
    return 0;
}

/* fu_opt_parse over a NULL-terminated list of arguments (argv[0] added). */
static int parse(const fu_opt *t, int *n_operands, char **out_argv, ...) {
    static char prog[] = "prog";
    va_list ap;
    va_start(ap, out_argv);
    int argc = 0;
    out_argv[argc++] = prog;
    for (char *s; (s = va_arg(ap, char *));) out_argv[argc++] = s;
    va_end(ap);
    out_argv[argc] = NULL;
    return fu_opt_parse(t, argc, out_argv, n_operands);
}

/* Writes text to a new temporary file; returns its path (static buffer). */
static const char *temp_file(const char *text) {
    static char path[64];
    snprintf(path, sizeof path, "/tmp/fu-opt-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_defaults_and_flags(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *argv[32];
    assert_int_equal(parse(t, NULL, argv, NULL), FU_OK);
    assert_int_equal(a->workers, 32);
    assert_true(a->measure);
    assert_string_equal(a->listen, "127.0.0.1:7001");
    assert_int_equal(a->kv, 32);
    assert_false(a->verbose);
    assert_null(a->model);

    /* both forms, short names, attached short values, flags alone and with a value, '_' for '-' */
    assert_int_equal(parse(t, NULL, argv, "--workers", "8", "--kv=f16", "-v", "--json=false", "-m", "/m",
                           "-w12", "--no-head", "--measure", "off", "--kv_budget_mib", "64", "--seed=7",
                           "-t", "0.5", "--latency", "0.02", "--blocks", "0:15", "--max-body-bytes", "4096",
                           "--listen=[::1]:0", NULL),
                     FU_OK);
    assert_int_equal(a->workers, 12);
    assert_int_equal(a->kv, 16);
    assert_true(a->verbose);
    assert_int_equal(a->json, 0);
    assert_string_equal(a->model, "/m");
    assert_false(a->head);
    assert_false(a->measure);
    assert_int_equal(a->budget, 64);
    assert_int_equal(a->seed, 7);
    assert_true(a->temperature == 0.5f);
    assert_true(a->latency == 0.02);
    assert_int_equal(a->span[0], 0);
    assert_int_equal(a->span[1], 15);
    assert_int_equal(a->body, 4096);
    assert_string_equal(a->listen, "[::1]:0");

    /* wide ranges reach the 8-byte destinations */
    assert_int_equal(parse(t, NULL, argv, "--kv-budget-mib", "1099511627776", "--seed", "9223372036854775807",
                           "-j", NULL),
                     FU_OK);
    assert_int_equal(a->budget, 1L << 40);
    assert_true(a->seed == (uint64_t)INT64_MAX);
    assert_int_equal(a->json, 1);
    fu_opt_free(t);
    assert_null(a->model);
    assert_null(a->listen);
    assert_null(a->secret);
}

static void test_lists_paths_calls(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *argv[32];
    setenv("HOME", "/home/u", 1);
    assert_int_equal(parse(t, NULL, argv, "--file", "a", "--files=b", "--model", "~/m.gguf", "--hop", "h1",
                           "--chain", "h2", NULL),
                     FU_OK);
    assert_int_equal(a->files.n, 2);
    assert_string_equal(a->files.items[0], "a");
    assert_string_equal(a->files.items[1], "b");
    assert_string_equal(a->model, "/home/u/m.gguf");
    assert_int_equal(a->calls, 2);
    assert_string_equal(a->last_call, "h2");
    /* a file's text, its trailing newlines dropped; a missing file */
    const char *path = temp_file("s3cret \r\n\n");
    assert_int_equal(parse(t, NULL, argv, "--secret-file", path, NULL), FU_OK);
    assert_string_equal(a->secret, "s3cret");
    unlink(path);
    assert_int_equal(parse(t, NULL, argv, "--secret-file", "/nonexistent/s", NULL), FU_ERR_NOT_FOUND);
    assert_string_equal(fu_last_error(), "--secret-file: /nonexistent/s: cannot open: No such file or directory");
    assert_string_equal(a->secret, "s3cret");
    /* a FIFO is refused at once (no writer would ever come) */
    char fifo[] = "/tmp/fu-opt-fifo-XXXXXX";
    assert_non_null(mkdtemp(fifo));
    char fifo_path[64];
    snprintf(fifo_path, sizeof fifo_path, "%s/p", fifo);
    assert_int_equal(mkfifo(fifo_path, 0600), 0);
    assert_int_equal(parse(t, NULL, argv, "--secret-file", fifo_path, NULL), FU_ERR_IO);
    assert_non_null(strstr(fu_last_error(), "not a regular file"));
    assert_string_equal(a->secret, "s3cret");
    unlink(fifo_path);
    rmdir(fifo);
    /* a string keeps "~/" */
    assert_int_equal(fu_opt_set(t, "listen", "~/x"), FU_OK);
    assert_string_equal(a->listen, "~/x");
    /* a callback's error is labelled with the option */
    assert_int_equal(parse(t, NULL, argv, "--hop", "bad", NULL), FU_ERR_INVALID);
    assert_string_equal(fu_last_error(), "--hop: no good");
    fu_opt_free(t);
    assert_null(a->secret);
    assert_int_equal(a->files.n, 0);
    assert_null(a->files.items);
}

static void test_operands(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *argv[32];
    int n = -1;
    assert_int_equal(parse(t, &n, argv, "repo", "-v", "--", "--json", "-", NULL), FU_OK);
    assert_int_equal(n, 3);
    assert_string_equal(argv[1], "repo");
    assert_string_equal(argv[2], "--json");
    assert_string_equal(argv[3], "-");
    assert_true(a->verbose);
    assert_int_equal(a->json, 0);
    /* without room for operands, one is an error */
    assert_int_equal(parse(t, NULL, argv, "-v", "repo", NULL), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "unexpected argument 'repo'"));
}

static void test_errors(void **state) {
    const fu_opt *t = ((fixture *)*state)->t;
    char *argv[32];
    static const struct {
        const char *args[3];
        const char *message;
    } cases[] = {
        {{"--nope"}, "unknown option '--nope'"},
        {{"--nope=1"}, "unknown option '--nope'"},
        {{"-x"}, "unknown option '-x'"},
        {{"--workers"}, "--workers needs a value"},
        {{"-w"}, "-w needs a value"},
        {{"-vj"}, "-v takes no value"},
        {{"--workers", "0"}, "--workers: expected an integer in [1, 4096], got '0'"},
        {{"--workers", "12abc"}, "--workers: expected an integer in [1, 4096], got '12abc'"},
        {{"-w", "5000"}, "-w: expected an integer in [1, 4096], got '5000'"},
        {{"--seed", "-1"}, "--seed: expected an integer in [0, 9223372036854775807], got '-1'"},
        {{"--temperature", "hot"}, "--temperature: expected a number, got 'hot'"},
        {{"--temperature", "1e39"}, "--temperature: expected a number, got '1e39'"},
        {{"--kv", "q8"}, "--kv: expected f32|f16, got 'q8'"},
        {{"--measure", "maybe"}, "--measure: expected true or false, got 'maybe'"},
        {{"--verbose=maybe"}, "--verbose: expected true or false, got 'maybe'"},
        {{"--blocks", "5:5"}, "--blocks: the span '5:5' is empty"},
        {{"--blocks", "5:101"}, "--blocks: expected A:B with 0 <= A <= B <= 100, got '5:101'"},
        {{"--blocks", "7"}, "--blocks: expected A:B with 0 <= A <= B <= 100, got '7'"},
        {{"--config", "/nonexistent/x.json"}, "unable to open /nonexistent/x.json"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *const *c = cases[i].args;
        int rc = parse(t, NULL, argv, c[0], c[1], c[2], NULL);
        assert_true(rc < 0);
        if (!strstr(fu_last_error(), cases[i].message))
            fail_msg("case %zu: '%s' lacks '%s'", i, fu_last_error(), cases[i].message);
    }
    /* fu_opt_set: the bare name */
    assert_int_equal(fu_opt_set(t, "no-such-option", "1"), FU_ERR_INVALID);
    assert_string_equal(fu_last_error(), "unknown option 'no-such-option'");
    assert_int_equal(fu_opt_set(t, "workers", "0"), FU_ERR_INVALID);
    assert_string_equal(fu_last_error(), "workers: expected an integer in [1, 4096], got '0'");
}

static void test_help_asked(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *argv[32];
    /* --help wins over what follows and applies nothing, the config files included */
    assert_int_equal(parse(t, NULL, argv, "--workers", "7", "--help", "--nope", NULL), FU_OPT_HELP_ASKED);
    assert_int_equal(parse(t, NULL, argv, "--config", "/nonexistent", "-h", NULL), FU_OPT_HELP_ASKED);
    assert_int_equal(a->workers, 0);
    /* after "--" it is an operand */
    int n;
    assert_int_equal(parse(t, &n, argv, "--", "--help", NULL), FU_OK);
    assert_int_equal(n, 1);
}

static void test_config_file(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *argv[32];
    const char *path = temp_file("{\"_comment\": \"x\", \"comment\": \"y\", \"workers\": 4, \"kv\": \"f16\","
                                 " \"model\": \"/file.gguf\", \"verbose\": true, \"measure\": \"no\","
                                 " \"files\": [\"f1\", \"f2\"], \"hops\": [\"a\", \"b\", \"c\"],"
                                 " \"kv_budget_mib\": \"12\", \"latency\": 0.25, \"temperature\": 1,"
                                 " \"seed\": null, \"blocks\": \"2:9\", \"json\": 1}");
    /* the file first, then the flags, wherever --config stands */
    assert_int_equal(parse(t, NULL, argv, "--workers", "9", "--file", "f3", "--config", path, NULL), FU_OK);
    assert_int_equal(a->workers, 9);
    assert_int_equal(a->kv, 16);
    assert_string_equal(a->model, "/file.gguf");
    assert_true(a->verbose);
    assert_false(a->measure);
    assert_int_equal(a->files.n, 3);
    assert_string_equal(a->files.items[2], "f3");
    assert_int_equal(a->calls, 3);
    assert_int_equal(a->budget, 12);
    assert_true(a->latency == 0.25);
    assert_true(a->temperature == 1.0f);
    assert_int_equal(a->seed, 0);
    assert_int_equal(a->span[1], 9);
    assert_int_equal(a->json, 1);
    unlink(path);
    fu_opt_free(t);

    /* fu_opt_load alone, the '-' form of a key */
    memset(a, 0, sizeof *a);
    path = temp_file("{\"kv-budget-mib\": 3}");
    assert_int_equal(fu_opt_load(t, path), FU_OK);
    assert_int_equal(a->budget, 3);
    unlink(path);
}

static void test_config_errors(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    static const struct {
        const char *text;
        int status;
        const char *message;
    } cases[] = {
        {"{\"workers\": ", FU_ERR_FORMAT, ":1: "},
        {"[1, 2]", FU_ERR_FORMAT, "the config must be a JSON object"},
        {"{\"a\": 1, \"a\": 2}", FU_ERR_FORMAT, "duplicate"},
        {"{\"nope\": 1}", FU_ERR_INVALID, "unknown option 'nope'"},
        {"{\"listen\": \"x\"}", FU_ERR_INVALID, "unknown option 'listen'"},
        {"{\"config\": \"x\"}", FU_ERR_INVALID, "unknown option 'config'"},
        {"{\"workers\": true}", FU_ERR_INVALID, "workers: expected an integer, got a boolean"},
        {"{\"workers\": 1.5}", FU_ERR_INVALID, "workers: expected an integer, got a number"},
        {"{\"workers\": [1]}", FU_ERR_INVALID, "workers: expected an integer, got an array"},
        {"{\"model\": {}}", FU_ERR_INVALID, "model: expected a string, got an object"},
        {"{\"model\": false}", FU_ERR_INVALID, "model: expected a string, got a boolean"},
        {"{\"verbose\": 2}", FU_ERR_INVALID, "verbose: expected true or false, got '2'"},
        {"{\"workers\": 0}", FU_ERR_INVALID, "workers: expected an integer in [1, 4096], got '0'"},
        {"{\"hops\": [\"ok\", \"bad\"]}", FU_ERR_INVALID, "hops: no good"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = temp_file(cases[i].text);
        int rc = fu_opt_load(t, path);
        if (rc != cases[i].status || !strstr(fu_last_error(), cases[i].message) ||
            strncmp(fu_last_error(), path, strlen(path)))
            fail_msg("case %zu: %d '%s'", i, rc, fu_last_error());
        unlink(path);
    }
    assert_int_equal(fu_opt_load(t, "/nonexistent/x.json"), FU_ERR_IO);
    /* a bad file named on the command line stops the parse before the flags apply */
    char *argv[8];
    const char *path = temp_file("{\"workers\": \"x\"}");
    assert_int_equal(parse(t, NULL, argv, "--json", "--config", path, NULL), FU_ERR_INVALID);
    assert_int_equal(a->json, 0);
    unlink(path);
}

/* fu_opt_help's text for the test table. */
static char *help_text(const fu_opt *t, const char *epilog) {
    fu_opt_spec spec = {"prog", "usage: prog [options]", t, epilog};
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    assert_non_null(f);
    fu_opt_help(f, &spec);
    fclose(f);
    return text;
}

static void test_help_text(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    char *text = help_text(t, "More words.\n");
    static const char *const lines[] = {
        "usage: prog [options]\n",
        "  --config FILE         JSON config\n",
        "  -v, --verbose         say more\n",
        "  --measure true|false  measure links (default true)\n",
        "  -m, --model PATH      the model\n                        as a path\n",
        "  --listen HOST:PORT    address (default 127.0.0.1:7001)\n",
        "  -w, --workers N       threads (default 32)\n",
        "  --kv f32|f16          KV type (default f32)\n",
        "  --blocks A:B          span\n",
        "  --hop H               a hop\n",
        "  -h, --help            this text\n"
        "  --print-config        every option as a JSON config file with its default\nMore words.\n",
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
        if (!strstr(text, lines[i])) fail_msg("no '%s' in:\n%s", lines[i], text);
    assert_null(strstr(text, "max-body-bytes")); /* no help text: left out */
    assert_true(strstr(text, "--verbose") < strstr(text, "--hop")); /* in table order */
    free(text);

    /* an option longer than the column puts its help on the next line */
    const fu_opt long_one[] = {{"a-very-very-long-option-name", 0, FU_OPT_FLAG, FU_OPT_TO(a->verbose), .help = "x"},
                               {"b", 0, FU_OPT_FLAG, FU_OPT_TO(a->verbose), .help = "y"},
                               FU_OPT_END};
    text = help_text(long_one, NULL);
    assert_non_null(strstr(text, "  --a-very-very-long-option-name\n              x\n  --b         y\n"));
    free(text);
}

/* --print-config: every option a file takes, with its default, and it loads back. */
static void test_print_config(void **state) {
    fixture *f = *state;
    const fu_opt *t = f->t;
    char *argv[8];
    assert_int_equal(parse(t, NULL, argv, "--workers", "7", "--print-config", NULL), FU_OPT_CONFIG_ASKED);
    fu_opt_spec spec = {"prog", "usage: prog [options]", t, NULL};
    char *text = NULL;
    size_t n = 0;
    FILE *mf = open_memstream(&text, &n);
    assert_non_null(mf);
    assert_int_equal(fu_opt_print_config(mf, &spec), FU_OK);
    fclose(mf);
    assert_non_null(strstr(text, "\"_workers\": \"N: threads\",\n  \"workers\": 32,"));
    assert_non_null(strstr(text, "\"measure\": true,"));
    assert_non_null(strstr(text, "\"kv\": \"f32\","));
    assert_non_null(strstr(text, "\"model\": null,"));
    assert_null(strstr(text, "\"config\""));       /* the file option itself is no key */
    assert_null(strstr(text, "\"max_body_bytes\"")); /* no help text: left out */
    char path[] = "/tmp/fusion-print-config-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0 && write(fd, text, n) == (ssize_t)n);
    close(fd);
    assert_int_equal(fu_opt_load(t, path), FU_OK); /* it loads as a config file */
    unlink(path);
    free(text);
}

static void test_main_and_fail(void **state) {
    fixture *f = *state;
    args *a = &f->a;
    const fu_opt *t = f->t;
    fu_opt_spec spec = {"prog", "usage: prog [options]", t, NULL};
    char *argv[8];
    static char prog[] = "prog", w[] = "--workers", three[] = "3", bad[] = "--nope";
    argv[0] = prog;
    argv[1] = w;
    argv[2] = three;
    assert_int_equal(fu_opt_main(&spec, 3, argv, NULL), -1);
    assert_int_equal(a->workers, 3);
    argv[1] = bad;
    /* the message and the help go to stderr: here a file */
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    FILE *err = tmpfile();
    assert_non_null(err);
    dup2(fileno(err), STDERR_FILENO);
    assert_int_equal(fu_opt_main(&spec, 2, argv, NULL), 2);
    assert_int_equal(fu_opt_fail(&spec, "no %s", "model"), 2);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    char text[4096];
    rewind(err);
    text[fread(text, 1, sizeof text - 1, err)] = '\0';
    fclose(err);
    assert_memory_equal(text, "prog: unknown option '--nope'\nusage: prog [options]\n", 51);
    assert_non_null(strstr(text, "with its default\nprog: no model\nusage: prog [options]\n"));
}

static void test_split_span(void **state) {
    char *addr = NULL;
    int span[2];
    assert_int_equal(fu_opt_split_span("127.0.0.1:7001:0:15", 1000000, &addr, span), FU_OK);
    assert_string_equal(addr, "127.0.0.1:7001");
    assert_int_equal(span[0], 0);
    assert_int_equal(span[1], 15);
    free(addr);
    assert_int_equal(fu_opt_split_span("[::1]:7002:15:30", 1000000, &addr, span), FU_OK);
    assert_string_equal(addr, "[::1]:7002");
    free(addr);
    addr = NULL;
    static const char *const bad[] = {"127.0.0.1:7003", ":0:15", "h:1:30:30", "h:1:x:3", "h:1:2:2000001", "0:1", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fu_opt_split_span(bad[i], 2000000, &addr, span), FU_ERR_INVALID);
        assert_null(addr);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
#define FIXTURE_TEST(fn) cmocka_unit_test_setup_teardown(fn, fixture_setup, fixture_teardown)
        FIXTURE_TEST(test_defaults_and_flags), FIXTURE_TEST(test_lists_paths_calls), FIXTURE_TEST(test_operands),
        FIXTURE_TEST(test_errors),             FIXTURE_TEST(test_help_asked),        FIXTURE_TEST(test_config_file),
        FIXTURE_TEST(test_config_errors),      FIXTURE_TEST(test_help_text),         FIXTURE_TEST(test_print_config),
        FIXTURE_TEST(test_main_and_fail),
        cmocka_unit_test(test_split_span),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
