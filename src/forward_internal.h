/* Internal pieces of the forward pass shared by the CPU (src/forward.c) and
 * GPU (cuda/forward.cu) implementations. */
#ifndef BK_FORWARD_INTERNAL_H
#define BK_FORWARD_INTERNAL_H

#include <stdint.h>

#include "bakron/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Token sequences [S, T] for a whole-model run: at least one sequence of at
 * least min_T tokens, T within max_position_embeddings, every id in
 * [0, vocab). BK_ERR_CALIB naming the sequence and position otherwise. */
bk_status bk_fwd_check_sequences(const bk_model_config *c, const int32_t *tokens, int64_t S,
                                 int64_t T, int64_t min_T);

#ifdef __cplusplus
}
#endif
#endif
