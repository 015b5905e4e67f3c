/* fuzz_template.c -- libFuzzer target: arbitrary bytes compiled as a chat template and, when they
 * compile, rendered over a small fixed conversation under tight limits. Any error status is fine;
 * crashes, leaks, undefined behaviour and hangs are not. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chat-template.h"

static json_t *messages, *tools, *kwargs;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    messages = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"},"
                          " {\"role\": \"user\", \"content\": \"Hi \\u2603 <b>&</b>\"},"
                          " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\","
                          "  \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1, \"y\": [true, null, 2.5]}}}]},"
                          " {\"role\": \"tool\", \"content\": \"{\\\"ok\\\": 1}\"}]",
                          0, NULL);
    tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\","
                       " \"parameters\": {\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"integer\"}}}}}]",
                       0, NULL);
    kwargs = json_loads("{\"enable_thinking\": false}", 0, NULL);
    if (!messages || !tools || !kwargs)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *src = malloc(size + 1);
    if (!src)
        return 0;
    memcpy(src, data, size);
    src[size] = '\0'; /* an embedded NUL ends the template early, as in a C string */
    tpl_template *t = NULL;
    if (tpl_compile(src, &t) == FU_OK) {
        /* tpl_apply_chat's variables, rendered under limits small enough to keep each run fast */
        json_t *ctx = json_pack("{s:O, s:O, s:n, s:b, s:s, s:s, s:O}", "messages", messages, "tools", tools,
                                "documents", "add_generation_prompt", 1, "bos_token", "<s>", "eos_token", "</s>",
                                "kw", kwargs);
        tpl_limits lim = {.max_output = 1 << 16, .max_memory = 1 << 22, .max_work = 200000, .max_depth = 16,
                          .max_steps = 50000};
        char *out = NULL;
        if (ctx && tpl_render_ex(t, ctx, &lim, &out, NULL) == FU_OK && !out)
            abort(); /* success must yield a string */
        free(out);
        json_decref(ctx);
        if (tpl_apply_chat(t, messages, tools, 0, "<s>", NULL, kwargs, &out) == FU_OK && !out)
            abort();
        free(out);
        tpl_free(t);
    } else if (t) {
        abort(); /* a failed compile leaves no template */
    }
    free(src);
    return 0;
}
