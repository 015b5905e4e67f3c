/* gw-file-check.h -- an uploaded fine-tuning file checked as OpenAI checks one: JSONL in its chat format, line by line.
 *
 * Each line is one example, {"messages": [...], "tools"?, "parallel_tool_calls"?}, rendered
 * through the served model's chat template and tokenizer (chat-train.h): it must train
 * (an assistant message), fit the model's context, name no key OpenAI does not know and
 * carry none of the tokenizer's special strings in its messages. Errors name the line in
 * OpenAI's wording ("Line 3: Missing 'messages' key.").
 *
 * Threading: a checker is read-only once made; any number of threads may use one.
 * Ownership: it borrows the tokenizer and template (which must outlive it) and owns its
 * copy of the special strings.
 */
#ifndef FU_GW_FILE_CHECK_H
#define FU_GW_FILE_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "chat-template.h"
#include "gw.h"
#include "tokenizer.h"

/* The fewest examples a fine-tuning file may hold (OpenAI's rule). */
#define GW_FILE_MIN_EXAMPLES 10

typedef struct gw_file_check {
    const tok_tokenizer *tok; /* borrowed */
    const tpl_template *tpl;  /* borrowed; NULL: every chat line is refused */
    int ctx;                  /* an example's tokens at most */
    char **specials;          /* the tokenizer's special strings (n_specials, malloc'd) */
    size_t n_specials;
} gw_file_check;

/* Makes a checker for tok and tpl (borrowed) and context ctx. FU_OK or FU_ERR_NOMEM. */
int gw_file_check_init(gw_file_check *fc, const tok_tokenizer *tok, const tpl_template *tpl, int ctx);
void gw_file_check_free(gw_file_check *fc); /* zeroes *fc; safe on a zeroed one */

/* Checks line number `lineno` (1-based), text[0..len) without its newline. 0, or 400 with
 * *err (param "file", code "invalid_file_format"); 500 when out of memory. */
int gw_file_check_line(const gw_file_check *fc, const char *text, size_t len, size_t lineno, gw_error *err);
/* Checks a whole file data[0..len): at most max_lines lines (blank ones are skipped), each
 * gw_file_check_line, at least one example (else code "invalid_n_examples"; a training file
 * needs GW_FILE_MIN_EXAMPLES, which job creation checks, while a validation file may hold
 * fewer). 0 with *n_examples, or the HTTP status with *err (the first problem). */
int gw_file_check_text(const gw_file_check *fc, const char *data, size_t len, int max_lines, int64_t *n_examples,
                       gw_error *err);

#endif
