/* Rotary position embedding tables (internal). Hugging Face convention
 * ("rotate_half"): for head_dim d and i < d/2,
 *   y[i]       = x[i] cos(t w_i) - x[i+d/2] sin(t w_i)
 *   y[i+d/2]   = x[i+d/2] cos(t w_i) + x[i] sin(t w_i)
 * with w_i = theta^(-2i/d), modified by linear or llama3 scaling.
 * The tables are computed in float32 exactly as transformers does (see
 * rope.c), so cos/sin agree with the reference to about one ulp. */
#ifndef BK_ROPE_H
#define BK_ROPE_H

#include <stdint.h>

#include "bakron/model.h"

typedef struct bk_rope {
    int64_t head_dim;
    int64_t max_pos;   /* tables cover positions 0..max_pos-1 */
    double *inv_freq;  /* [head_dim/2] (float32 values, widened) */
    float *cos, *sin;  /* [max_pos, head_dim/2] */
} bk_rope;

bk_status bk_rope_init(bk_rope *r, const bk_model_config *cfg, int64_t max_pos);
void bk_rope_free(bk_rope *r);
/* CONFIG naming `label` and the field when a RoPE frequency or its angle at
 * position max_pos - 1 is not finite in float32 (a rope_theta that underflows:
 * below ~1e-38 the frequencies overflow), BK_OK otherwise. */
bk_status bk_rope_check_config(const bk_model_config *cfg, int64_t max_pos, const char *label);

/* Rotate n_heads consecutive head vectors of one token at position pos, in
 * place (sign = +1), or apply the inverse rotation (sign = -1). */
void bk_rope_apply(const bk_rope *r, float *x, int64_t n_heads, int64_t pos, int sign);

#endif
