/* test_hub.c -- hub names, validation, cache paths, listing parsing, download plans and offline resolution. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hub-impl.h"
#include "hub.h"
#include "status.h"

#define C40 "0123456789abcdef0123456789abcdef01234567"

/* --- helpers -------------------------------------------------------------- */

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static void rm_rf(const char *path) { nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

static void mkdirs(const char *path) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", path);
    assert_int_equal(system(cmd), 0);
}

/* Restores an environment variable after a test changed it. */
typedef struct saved_env {
    const char *name;
    char *value;
} saved_env;

static saved_env env_save(const char *name) {
    const char *v = getenv(name);
    saved_env s = {name, v ? strdup(v) : NULL};
    return s;
}

static void env_restore(saved_env *s) {
    if (s->value) setenv(s->name, s->value, 1);
    else unsetenv(s->name);
    free(s->value);
}

/* --- names ---------------------------------------------------------------- */

static void test_parse_name(void **state) {
    (void)state;
    hub_ref r;
    assert_int_equal(hub_parse_name("meta-llama/Llama-3.2-1B", &r), FU_OK);
    assert_string_equal(r.repo_id, "meta-llama/Llama-3.2-1B");
    assert_string_equal(r.revision, "main");
    assert_int_equal(hub_parse_name("Qwen/Qwen3-0.6B@v1.0_rc", &r), FU_OK);
    assert_string_equal(r.repo_id, "Qwen/Qwen3-0.6B");
    assert_string_equal(r.revision, "v1.0_rc");
    assert_int_equal(hub_parse_name("a/b@refs/pr/12", &r), FU_OK);
    assert_string_equal(r.revision, "refs/pr/12");
    assert_int_equal(hub_parse_name("a/b@" C40, &r), FU_OK);
    assert_string_equal(r.revision, C40);

    static const char *const bad[] = {
        "", "org", "/name", "org/", "org/name/x", "a--b/c", "a/b--c", "org/..", "org/a..b",
        "org/na me", "org/name@", "org/name@../x", "org/name@a//b", "org/name@/a", "org/name@a/",
        "org/name@a/./b", "org/name@a b", "or\x01g/x", ".org/x", "org./x", "-org/x", "org/x-",
        "org/name@a@b", "org\\x/y", "org/x\n", "~/model", "./org/x",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fu_error_clear();
        if (hub_parse_name(bad[i], &r) != FU_ERR_INVALID) fail_msg("accepted '%s'", bad[i]);
        assert_true(strlen(fu_last_error()) > 0);
        assert_int_equal(hub_is_repo_name(bad[i]), 0);
    }
    char long_part[200];
    memset(long_part, 'a', sizeof long_part);
    long_part[0] = 'o';
    long_part[1] = '/';
    long_part[2 + 96] = '\0';
    assert_int_equal(hub_parse_name(long_part, &r), FU_OK); /* 96 is the limit */
    long_part[2 + 96] = 'a';
    long_part[2 + 97] = '\0';
    assert_int_equal(hub_parse_name(long_part, &r), FU_ERR_INVALID);
    char long_rev[400] = "a/b@";
    memset(long_rev + 4, 'r', 256);
    long_rev[4 + 256] = '\0';
    assert_int_equal(hub_parse_name(long_rev, &r), FU_ERR_INVALID);

    /* the predicate does not disturb the caller's last error */
    fu_errorf(FU_ERR_IO, "keep me");
    assert_int_equal(hub_is_repo_name("org/x"), 1);
    assert_int_equal(hub_is_repo_name("org/../x"), 0);
    assert_string_equal(fu_last_error(), "keep me");
}

static void test_validate_filename(void **state) {
    (void)state;
    static const char *const good[] = {"config.json", "sub/dir/m.gguf", "a..b", "...", ".gitattributes",
                                       "x.incomplete.json", "unicode-\xc3\xa9.txt"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        if (hub_validate_filename(good[i]) != FU_OK) fail_msg("rejected '%s': %s", good[i], fu_last_error());
    static const char *const bad[] = {"", "/abs", "../x", "a/../b", "a/..", "..", ".", "a/./b", "a//b", "a/",
                                      "a\\b", "a\nb", "a\x1b[2Jb", "\x7f", "x.incomplete", "d/x.incomplete/y"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (hub_validate_filename(bad[i]) != FU_ERR_INVALID) fail_msg("accepted '%s'", bad[i]);
    /* escapes are not echoed raw into the message */
    assert_int_equal(hub_validate_filename("a\x1b[2Jb"), FU_ERR_INVALID);
    assert_null(strchr(fu_last_error(), '\x1b'));
    assert_non_null(strstr(fu_last_error(), "\\x1b"));
    char longp[1100];
    memset(longp, 'a', sizeof longp);
    longp[1024] = '\0';
    assert_int_equal(hub_validate_filename(longp), FU_ERR_INVALID);
    longp[1023] = '\0'; /* 1023 bytes: the longest allowed */
    assert_int_equal(hub_validate_filename(longp), FU_OK);
}

static void test_is_commit(void **state) {
    (void)state;
    assert_int_equal(hub_is_commit(C40), 1);
    assert_int_equal(hub_is_commit(C40 "0123456789abcdef01234567"), 1); /* 64 digits */
    assert_int_equal(hub_is_commit(C40 "0"), 0);
    assert_int_equal(hub_is_commit("0123456789ABCDEF0123456789abcdef01234567"), 0);
    assert_int_equal(hub_is_commit("0123456789abcdef"), 0);
    assert_int_equal(hub_is_commit("main"), 0);
    assert_int_equal(hub_is_commit(NULL), 0);
}

/* --- environment and paths -------------------------------------------------- */

static void test_cache_root(void **state) {
    (void)state;
    saved_env e1 = env_save("FUSION_CACHE"), e2 = env_save("XDG_CACHE_HOME"), e3 = env_save("HOME");
    hub_options o;
    hub_options_init(&o);
    char *root = NULL;

    o.cache_dir = "/x/y//";
    setenv("FUSION_CACHE", "/ignored", 1);
    assert_int_equal(hub_cache_root(&o, &root), FU_OK);
    assert_string_equal(root, "/x/y");
    free(root);
    o.cache_dir = NULL;

    assert_int_equal(hub_cache_root(&o, &root), FU_OK);
    assert_string_equal(root, "/ignored/hub");
    free(root);
    setenv("FUSION_CACHE", "/c/", 1);
    assert_int_equal(hub_cache_root(NULL, &root), FU_OK);
    assert_string_equal(root, "/c/hub");
    free(root);

    unsetenv("FUSION_CACHE");
    setenv("XDG_CACHE_HOME", "/xdg", 1);
    setenv("HOME", "/home/u", 1);
    assert_int_equal(hub_cache_root(&o, &root), FU_OK);
    assert_string_equal(root, "/xdg/fusion/hub");
    free(root);

    setenv("XDG_CACHE_HOME", "relative", 1); /* the XDG spec says: ignore */
    assert_int_equal(hub_cache_root(&o, &root), FU_OK);
    assert_string_equal(root, "/home/u/.cache/fusion/hub");
    free(root);

    unsetenv("XDG_CACHE_HOME");
    unsetenv("HOME");
    assert_int_equal(hub_cache_root(&o, &root), FU_ERR_INVALID);
    assert_null(root);
    env_restore(&e1);
    env_restore(&e2);
    env_restore(&e3);
}

static void test_endpoint_and_offline(void **state) {
    (void)state;
    saved_env e1 = env_save("HF_ENDPOINT"), e2 = env_save("HF_HUB_OFFLINE");
    hub_options o;
    hub_options_init(&o);
    char *ep = NULL;
    unsetenv("HF_ENDPOINT");
    assert_int_equal(hub_endpoint(&o, &ep), FU_OK);
    assert_string_equal(ep, "https://huggingface.co");
    free(ep);
    setenv("HF_ENDPOINT", "http://mirror.local:8080/", 1);
    assert_int_equal(hub_endpoint(&o, &ep), FU_OK);
    assert_string_equal(ep, "http://mirror.local:8080");
    free(ep);
    o.endpoint = "https://hf-mirror.com";
    assert_int_equal(hub_endpoint(&o, &ep), FU_OK);
    assert_string_equal(ep, "https://hf-mirror.com");
    free(ep);
    o.endpoint = "ftp://x";
    assert_int_equal(hub_endpoint(&o, &ep), FU_ERR_INVALID);
    o.endpoint = "http://a b";
    assert_int_equal(hub_endpoint(&o, &ep), FU_ERR_INVALID);
    assert_null(ep);

    unsetenv("HF_HUB_OFFLINE");
    assert_int_equal(hub_is_offline(&o), 0);
    static const char *const on[] = {"1", "true", "YES", "On"};
    for (int i = 0; i < 4; i++) {
        setenv("HF_HUB_OFFLINE", on[i], 1);
        assert_int_equal(hub_is_offline(&o), 1);
        assert_int_equal(hub_is_offline(NULL), 1);
    }
    setenv("HF_HUB_OFFLINE", "0", 1);
    assert_int_equal(hub_is_offline(&o), 0);
    o.offline = 1;
    assert_int_equal(hub_is_offline(&o), 1);
    setenv("HF_HUB_OFFLINE", "1", 1);
    o.offline = 0;
    assert_int_equal(hub_is_offline(&o), 0);
    env_restore(&e1);
    env_restore(&e2);
}

static void test_cache_paths(void **state) {
    (void)state;
    char *p = NULL;
    assert_int_equal(hub_repo_dir("/c/hub", "meta-llama/Llama-3.2-1B", &p), FU_OK);
    assert_string_equal(p, "/c/hub/meta-llama--Llama-3.2-1B");
    free(p);
    assert_int_equal(hub_snapshot_dir("/c/hub", "a/b", C40, &p), FU_OK);
    assert_string_equal(p, "/c/hub/a--b/snapshots/" C40);
    free(p);
    assert_int_equal(hub_repo_dir("/c", "../x", &p), FU_ERR_INVALID);
    assert_null(p);
    assert_int_equal(hub_snapshot_dir("/c", "a/b", "main", &p), FU_ERR_INVALID);
    assert_int_equal(hub_snapshot_dir("/c", "a/b", "../../" C40, &p), FU_ERR_INVALID);
    assert_null(p);
}

/* --- listing -------------------------------------------------------------- */

#define SHA_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define SHA_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"

static int parse(const char *json, hub_listing *l) { return hub_listing_parse(json, strlen(json), l); }

static void test_listing_parse(void **state) {
    (void)state;
    hub_listing l;
    const char *ok = "{\"sha\":\"" C40 "\",\"private\":false,\"siblings\":["
                     "{\"rfilename\":\"config.json\",\"size\":12},"
                     "{\"rfilename\":\"model.safetensors\",\"size\":100,\"lfs\":{\"sha256\":\"" SHA_A "\",\"size\":100}},"
                     "{\"rfilename\":\"README.md\"},"
                     "{\"rfilename\":\"w.gguf\",\"lfs\":{\"sha256\":\"" SHA_B "\",\"size\":7}}]}";
    assert_int_equal(parse(ok, &l), FU_OK);
    assert_string_equal(l.commit, C40);
    assert_int_equal(l.n_files, 4);
    const hub_file *f = hub_listing_find(&l, "model.safetensors");
    assert_non_null(f);
    assert_int_equal(f->size, 100);
    assert_string_equal(f->sha256, SHA_A);
    f = hub_listing_find(&l, "config.json");
    assert_int_equal(f->size, 12);
    assert_string_equal(f->sha256, "");
    assert_int_equal(hub_listing_find(&l, "README.md")->size, -1);
    assert_int_equal(hub_listing_find(&l, "w.gguf")->size, 7);
    assert_null(hub_listing_find(&l, "nope"));
    hub_listing_free(&l);
    hub_listing_free(&l); /* zeroed: no-op */
    hub_listing_free(NULL);

    static const char *const bad[] = {
        "", "[]", "{\"siblings\":[]}", "{\"sha\":\"main\",\"siblings\":[]}", "{\"sha\":\"" C40 "\"}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"size\":1}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"../x\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\"},{\"rfilename\":\"/etc/passwd\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\\u0000b\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\\nb\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\"},{\"rfilename\":\"a\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"size\":-1}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"size\":\"1\"}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"lfs\":{\"sha256\":\"abc\"}}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"lfs\":{\"sha256\":\"" SHA_A "\",\"size\":-5}}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"size\":3,\"lfs\":{\"sha256\":\"" SHA_A "\",\"size\":4}}]}",
        "{\"sha\":\"" C40 "\",\"siblings\":[{\"rfilename\":\"a\",\"lfs\":[]}]}",
        "{\"sha\":\"" C40 "\",\"sha\":\"" C40 "\",\"siblings\":[]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = parse(bad[i], &l);
        if (rc != FU_ERR_FORMAT) fail_msg("listing %zu: rc %d for %s", i, rc, bad[i]);
        assert_null(l.files);
        assert_int_equal(l.n_files, 0);
    }
    assert_int_equal(parse(bad[6], &l), FU_ERR_FORMAT);
    assert_non_null(strstr(fu_last_error(), "unsafe file name"));
}

/* --- plans ---------------------------------------------------------------- */

static void listing_of(hub_listing *l, const char *const *names) {
    char json[8192];
    size_t k = (size_t)snprintf(json, sizeof json, "{\"sha\":\"" C40 "\",\"siblings\":[");
    for (size_t i = 0; names[i]; i++)
        k += (size_t)snprintf(json + k, sizeof json - k, "%s{\"rfilename\":\"%s\",\"size\":1}", i ? "," : "", names[i]);
    snprintf(json + k, sizeof json - k, "]}");
    assert_int_equal(parse(json, l), FU_OK);
}

static void assert_plan(const hub_plan *p, const char *const *want) {
    size_t n = 0;
    while (want[n]) n++;
    if (p->n_paths != n) fail_msg("plan has %zu files, want %zu", p->n_paths, n);
    for (size_t i = 0; i < n; i++) assert_string_equal(p->paths[i], want[i]);
}

static void test_plan_safetensors(void **state) {
    (void)state;
    hub_listing l;
    hub_plan p;
    static const char *const repo[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                       "generation_config.json", "model.safetensors.index.json",
                                       "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                       "consolidated.safetensors", "pytorch_model.bin", "README.md",
                                       "original/model.safetensors", "tokenizer.model", NULL};
    listing_of(&l, repo);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_OK);
    assert_int_equal(p.weights, HUB_WEIGHTS_SAFETENSORS);
    static const char *const phase1[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                         "generation_config.json", "model.safetensors.index.json", NULL};
    assert_plan(&p, phase1);
    assert_non_null(p.index_path);
    assert_string_equal(p.index_path, "model.safetensors.index.json");
    const char *index = "{\"metadata\":{},\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                        "\"b\":\"model-00002-of-00002.safetensors\",\"c\":\"model-00001-of-00002.safetensors\"}}";
    assert_int_equal(hub_plan_add_index(&p, &l, index, strlen(index)), FU_OK);
    assert_null(p.index_path);
    static const char *const full[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                       "generation_config.json", "model.safetensors.index.json",
                                       "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                       NULL};
    assert_plan(&p, full);
    /* unsafe, unlisted or malformed shard names */
    static const char *const bad_index[] = {
        "{\"weight_map\":{\"a\":\"../../evil.safetensors\"}}", "{\"weight_map\":{\"a\":\"unlisted.safetensors\"}}",
        "{\"weight_map\":{\"a\":7}}", "{\"weight_map\":{}}", "{\"weight\":{}}", "not json",
        "{\"weight_map\":{\"a\":\"/abs.safetensors\"}}"};
    for (size_t i = 0; i < sizeof bad_index / sizeof bad_index[0]; i++)
        if (hub_plan_add_index(&p, &l, bad_index[i], strlen(bad_index[i])) != FU_ERR_FORMAT)
            fail_msg("accepted index %s", bad_index[i]);
    assert_plan(&p, full);
    hub_plan_free(&p);
    hub_plan_free(&p);
    hub_plan_free(NULL);

    /* extra requested file */
    const char *extra[] = {"tokenizer.model"};
    assert_int_equal(hub_plan_init(&p, &l, extra, 1), FU_OK);
    assert_true(p.n_paths == 6 && strcmp(p.paths[4], "tokenizer.model") == 0);
    hub_plan_free(&p);
    const char *missing[] = {"nope.txt"};
    assert_int_equal(hub_plan_init(&p, &l, missing, 1), FU_ERR_NOT_FOUND);
    const char *unsafe[] = {"../x"};
    assert_int_equal(hub_plan_init(&p, &l, unsafe, 1), FU_ERR_INVALID);
    hub_listing_free(&l);

    /* no index: model.safetensors only, even next to other safetensors */
    static const char *const single[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                         "special_tokens_map.json", "model.safetensors", "adapter.safetensors",
                                         NULL};
    listing_of(&l, single);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_OK);
    static const char *const want_single[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                              "special_tokens_map.json", "model.safetensors", NULL};
    assert_plan(&p, want_single);
    assert_null(p.index_path);
    hub_plan_free(&p);
    hub_listing_free(&l);

    /* neither: every top-level safetensors */
    static const char *const several[] = {"config.json", "tokenizer.json", "tokenizer_config.json", "a.safetensors",
                                          "sub/c.safetensors", "b.safetensors", NULL};
    listing_of(&l, several);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_OK);
    static const char *const want_several[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                               "a.safetensors", "b.safetensors", NULL};
    assert_plan(&p, want_several);
    hub_plan_free(&p);
    hub_listing_free(&l);

    /* a required file missing */
    static const char *const no_tok[] = {"config.json", "tokenizer_config.json", "model.safetensors", NULL};
    listing_of(&l, no_tok);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "tokenizer.json"));
    assert_null(p.paths);
    hub_listing_free(&l);
}

static void test_plan_gguf(void **state) {
    (void)state;
    hub_listing l;
    hub_plan p;
    static const char *const multi[] = {"README.md", "m.Q4_0.gguf", "q8/m.Q8_0.gguf", "big-00001-of-00002.gguf",
                                        "big-00002-of-00002.gguf", NULL};
    listing_of(&l, multi);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "--file"));
    const char *q8[] = {"q8/m.Q8_0.gguf"};
    assert_int_equal(hub_plan_init(&p, &l, q8, 1), FU_OK);
    assert_int_equal(p.weights, HUB_WEIGHTS_GGUF);
    static const char *const want_q8[] = {"q8/m.Q8_0.gguf", NULL};
    assert_plan(&p, want_q8);
    hub_plan_free(&p);
    const char *part2[] = {"big-00002-of-00002.gguf"};
    assert_int_equal(hub_plan_init(&p, &l, part2, 1), FU_OK);
    static const char *const want_split[] = {"big-00001-of-00002.gguf", "big-00002-of-00002.gguf", NULL};
    assert_plan(&p, want_split);
    hub_plan_free(&p);
    hub_listing_free(&l);

    /* one model, split in parts: taken without asking; a missing part is an error */
    static const char *const split[] = {"x-00002-of-00003.gguf", "x-00001-of-00003.gguf", "x-00003-of-00003.gguf",
                                        NULL};
    listing_of(&l, split);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_OK);
    static const char *const want3[] = {"x-00001-of-00003.gguf", "x-00002-of-00003.gguf", "x-00003-of-00003.gguf",
                                        NULL};
    assert_plan(&p, want3);
    hub_plan_free(&p);
    hub_listing_free(&l);
    static const char *const gap[] = {"x-00001-of-00003.gguf", "x-00003-of-00003.gguf", NULL};
    listing_of(&l, gap);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_ERR_NOT_FOUND);
    hub_listing_free(&l);

    /* a .gguf request wins over safetensors in the same repo */
    static const char *const both[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                       "model.safetensors", "model.gguf", NULL};
    listing_of(&l, both);
    const char *g[] = {"model.gguf"};
    assert_int_equal(hub_plan_init(&p, &l, g, 1), FU_OK);
    assert_int_equal(p.weights, HUB_WEIGHTS_GGUF);
    assert_int_equal(p.n_paths, 1);
    hub_plan_free(&p);
    hub_listing_free(&l);

    static const char *const none[] = {"config.json", "pytorch_model.bin", NULL};
    listing_of(&l, none);
    assert_int_equal(hub_plan_init(&p, &l, NULL, 0), FU_ERR_UNSUPPORTED);
    hub_listing_free(&l);
}

/* --- files and resolution without network ---------------------------------- */

static void test_sha256_file(void **state) {
    (void)state;
    char dir[] = "/tmp/fusion-hub-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256], hex[65];
    snprintf(path, sizeof path, "%s/abc", dir);
    write_text(path, "abc");
    assert_int_equal(hub_sha256_file(path, hex), FU_OK);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    snprintf(path, sizeof path, "%s/missing", dir);
    assert_int_equal(hub_sha256_file(path, hex), FU_ERR_IO);
    rm_rf(dir);
}

/* Builds a cache with refs/main -> C40, its listing and the snapshot files. */
static void make_cache(const char *root, int with_shard) {
    char path[1024];
    snprintf(path, sizeof path, "%s/org--model/refs", root);
    mkdirs(path);
    snprintf(path, sizeof path, "%s/org--model/refs/main", root);
    write_text(path, C40 "\n");
    snprintf(path, sizeof path, "%s/org--model/meta", root);
    mkdirs(path);
    snprintf(path, sizeof path, "%s/org--model/meta/" C40 ".json", root);
    write_text(path, "{\"sha\":\"" C40 "\",\"siblings\":["
                     "{\"rfilename\":\"config.json\",\"size\":2},{\"rfilename\":\"tokenizer.json\",\"size\":2},"
                     "{\"rfilename\":\"tokenizer_config.json\",\"size\":2},"
                     "{\"rfilename\":\"model.safetensors\",\"size\":5,\"lfs\":{\"sha256\":\"" SHA_A "\",\"size\":5}},"
                     "{\"rfilename\":\"README.md\",\"size\":99}]}");
    snprintf(path, sizeof path, "%s/org--model/snapshots/" C40, root);
    mkdirs(path);
    static const char *const names[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/org--model/snapshots/" C40 "/%s", root, names[i]);
        write_text(path, "{}");
    }
    if (with_shard) {
        snprintf(path, sizeof path, "%s/org--model/snapshots/" C40 "/model.safetensors", root);
        write_text(path, "12345");
    }
}

static void test_resolve_offline(void **state) {
    (void)state;
    char dir[] = "/tmp/fusion-hub-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    hub_options o;
    hub_options_init(&o);
    o.cache_dir = dir;
    o.offline = 1;
    o.quiet = 1;
    char *out = NULL;

    /* nothing cached */
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_NOT_FOUND);
    assert_null(out);
    assert_non_null(strstr(fu_last_error(), "offline"));

    make_cache(dir, 0);
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "model.safetensors"));

    make_cache(dir, 1);
    char want[1024];
    snprintf(want, sizeof want, "%s/org--model/snapshots/" C40, dir);
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_OK);
    assert_string_equal(out, want);
    free(out);
    assert_int_equal(hub_resolve("org/model@" C40, &o, &out), FU_OK);
    assert_string_equal(out, want);
    free(out);
    assert_int_equal(hub_resolve("org/model@dev", &o, &out), FU_ERR_NOT_FOUND);

    /* a truncated file is not a cached file */
    char path[1100];
    snprintf(path, sizeof path, "%s/model.safetensors", want);
    write_text(path, "123");
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_NOT_FOUND);

    /* a corrupt ref is an error, not a path */
    snprintf(path, sizeof path, "%s/org--model/refs/main", dir);
    write_text(path, "../../../etc");
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_NOT_FOUND);
    assert_null(out);

    /* local paths pass through; other names are errors */
    assert_int_equal(hub_resolve(dir, &o, &out), FU_OK);
    assert_string_equal(out, dir);
    free(out);
    assert_int_equal(hub_resolve("no/such/dir", &o, &out), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "not an existing path"));
    assert_int_equal(hub_resolve("", &o, &out), FU_ERR_INVALID);
    const char *bad_files[] = {"../x.gguf"};
    o.files = bad_files;
    o.n_files = 1;
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_INVALID);
    rm_rf(dir);
}

static void test_resolve_network_failure(void **state) {
    (void)state;
    char dir[] = "/tmp/fusion-hub-test-XXXXXX";
    assert_non_null(mkdtemp(dir));
    hub_options o;
    hub_options_init(&o);
    o.cache_dir = dir;
    o.offline = 0;
    o.quiet = 1;
    o.endpoint = "http://127.0.0.1:1"; /* nothing listens on port 1 */
    o.max_retries = 1;
    o.retry_base_ms = 1;
    o.connect_timeout_s = 5;
    char *out = NULL;
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_ERR_NETWORK);
    assert_null(out);
    assert_non_null(strstr(fu_last_error(), "cannot reach the hub"));

    /* with the revision cached, the cache answers */
    make_cache(dir, 1);
    assert_int_equal(hub_resolve("org/model", &o, &out), FU_OK);
    assert_non_null(strstr(out, "/org--model/snapshots/" C40));
    free(out);
    rm_rf(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_name),          cmocka_unit_test(test_validate_filename),
        cmocka_unit_test(test_is_commit),           cmocka_unit_test(test_cache_root),
        cmocka_unit_test(test_endpoint_and_offline), cmocka_unit_test(test_cache_paths),
        cmocka_unit_test(test_listing_parse),       cmocka_unit_test(test_plan_safetensors),
        cmocka_unit_test(test_plan_gguf),           cmocka_unit_test(test_sha256_file),
        cmocka_unit_test(test_resolve_offline),     cmocka_unit_test(test_resolve_network_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
