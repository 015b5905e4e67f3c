/* chat-train.h -- OpenAI chat fine-tuning examples as tokens and loss masks, through the model's chat template.
 *
 * An example is {"messages": [...], "tools"?: [...], "parallel_tool_calls"?: b}
 * as OpenAI's fine-tuning API takes it; the loss is taken on the tokens of
 * each assistant message (its content and the template's end-of-turn
 * markers after it), except those marked "weight": 0. The tokens of
 * assistant message i are found by rendering the conversation up to it with
 * the generation prompt and up to and including it without: the template
 * must render each such prefix as the start of the longer one (every chat
 * template of the supported families does), else the example is refused.
 * Message text is tokenized with the template's markers special and markers
 * inside messages as plain text (tok_encode_spans).
 *
 * Threads: stateless; the template and tokenizer are read only. Ownership:
 * outputs are malloc'd for the caller.
 */
#ifndef FU_CHAT_TRAIN_H
#define FU_CHAT_TRAIN_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "chat-template.h"
#include "tokenizer.h"

/* Tokenizes example `ex` with template tpl and tokenizer tok: *ids (n
 * tokens) and *train (n flags, 1: the token is one the loss is taken on).
 * FU_ERR_FORMAT with OpenAI's wording for a malformed example (no messages,
 * a message without a known role, an assistant weight other than 0 or 1, no
 * assistant message), FU_ERR_TEMPLATE when the template fails or does not
 * render the conversation incrementally, FU_ERR_NOMEM. */
int chat_train_example(const tpl_template *tpl, const tok_tokenizer *tok, const json_t *ex, int32_t **ids,
                       uint8_t **train, size_t *n);

#endif
