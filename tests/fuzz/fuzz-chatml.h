/* fuzz-chatml.h -- what the chat-format fuzz targets share: the Qwen3 tokenizer of shared/tokenizers
 * beside the checkout ($FUSION_TOKENIZERS overrides) and a ChatML template, loaded once. */
#ifndef FU_FUZZ_CHATML_H
#define FU_FUZZ_CHATML_H

#include <stdio.h>
#include <stdlib.h>

#include "chat-template.h"
#include "tokenizer.h"

static const char fuzz_chatml_source[] =
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* Loads the tokenizer and compiles the template into *tok and *tpl; both stay NULL when the
 * tokenizer is not there (the targets then reach only what needs neither). */
static void fuzz_chatml_load(tok_tokenizer **tok, tpl_template **tpl) {
    const char *dir = getenv("FUSION_TOKENIZERS");
    char path[4096];
    snprintf(path, sizeof path, "%s/qwen3/tokenizer.json", dir ? dir : FUSION_FUZZ_SOURCE_DIR "/../shared/tokenizers");
    *tok = NULL;
    *tpl = NULL;
    if (tok_load_hf(path, tok) == 0 && tpl_compile(fuzz_chatml_source, tpl) != 0) {
        tok_free(*tok);
        *tok = NULL;
    }
}

#endif
