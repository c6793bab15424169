/* bakron — byte-level BPE tokenizer read from a model's own tokenizer.json
 * (the Hugging Face `tokenizers` format), for calibration from plain text.
 *
 * Supported (docs/tokenizer.md): model BPE (merges by rank, ignore_merges,
 * unk_token, continuing_subword_prefix / end_of_word_suffix); normalizers NFC,
 * NFD, NFKC, NFKD and Sequence of them; pre-tokenizers Split (regex through
 * PCRE2, or a literal string; every split behaviour, invert), ByteLevel
 * (add_prefix_space, use_regex), Digits and Sequence; added and special
 * tokens (split out first; single_word, lstrip, rstrip, normalized); post-
 * processors TemplateProcessing, ByteLevel, RobertaProcessing,
 * BertProcessing and Sequence. This covers Llama-3, Qwen2/Qwen3 and GPT-2
 * style (SmolLM2) tokenizers. Anything else is refused when the file is
 * loaded (BK_ERR_UNSUPPORTED, naming the file and the feature).
 *
 * Token ids are those of the `tokenizers` library (and so of transformers'
 * fast tokenizers): tests/data/tokenizer/ holds ids made by it.
 */
#ifndef BAKRON_TOKENIZER_H
#define BAKRON_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bk_tokenizer bk_tokenizer;

/* Load a tokenizer.json. BK_ERR_IO when it cannot be read, BK_ERR_CONFIG when
 * it is malformed, BK_ERR_UNSUPPORTED for a model type, normalizer, pre-
 * tokenizer or post-processor that is not implemented. */
bk_status bk_tokenizer_load(const char *path, bk_tokenizer **out);
void bk_tokenizer_free(bk_tokenizer *t);

/* A growable list of token ids. */
typedef struct bk_token_ids {
    int32_t *ids;
    size_t n, cap;
} bk_token_ids;
void bk_token_ids_free(bk_token_ids *v);

/* Tokenize len bytes of UTF-8 text, appending the ids to out. add_special:
 * apply the post-processor (e.g. Llama-3's BOS), as transformers does with
 * its default add_special_tokens=True; 0 = the plain ids of the text.
 * Added/special tokens written in the text are recognized either way.
 * Text that is not valid UTF-8 -> BK_ERR_INVALID_ARG. Thread-compatible: one
 * tokenizer may be used from one thread at a time. */
bk_status bk_tokenizer_encode(bk_tokenizer *t, const char *text, size_t len, int add_special,
                              bk_token_ids *out);

/* 1 + the largest id of the vocabulary and the added tokens. */
int64_t bk_tokenizer_vocab_size(const bk_tokenizer *t);

/* Id of a token string (vocabulary or added token), -1 when absent. */
int32_t bk_tokenizer_token_id(const bk_tokenizer *t, const char *token);

#ifdef __cplusplus
}
#endif
#endif /* BAKRON_TOKENIZER_H */
