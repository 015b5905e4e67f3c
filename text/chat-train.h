/* chat-train.h -- fine-tuning examples as tokens and loss masks: OpenAI's chat format through the model's chat template, or token ids.
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

/* One line of a fine-tuning JSONL file: OpenAI's chat format ({"messages":
 * ...}, through chat_train_example) or token ids ({"input_ids": [...],
 * "labels": [...]}, labels aligned with input_ids as Hugging Face's: -100
 * for no loss; all of input_ids when absent). *ids and *targets (n each,
 * malloc'd): targets[t] is the token row t predicts, label t + 1, or -1.
 * Token ids must lie in [0, vocab). tpl and tok may be NULL: a chat line is
 * then refused (FU_ERR_UNSUPPORTED). FU_ERR_FORMAT naming the problem for a
 * line that is not a JSON object, has neither key, or bad ids or labels;
 * chat_train_example's errors. */
int chat_train_line(const tpl_template *tpl, const tok_tokenizer *tok, int vocab, const char *line, size_t len,
                    int32_t **ids, int32_t **targets, size_t *n);

#endif
