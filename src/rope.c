#include "rope.h"

#include <math.h>
#include <stdlib.h>

#include "util.h"

/* The tables are computed the way transformers computes them in float32
 * (modeling_rope_utils + LlamaRotaryEmbedding.forward), so that cos/sin agree
 * with the reference to the last bit or so:
 *   inv_freq_i = 1 / theta^(f32(2i) / d)                       (float32)
 *   linear:      inv_freq_i / factor                           (float32)
 *   llama3:      wavelen = (1 / inv_freq) * f32(2 pi); low/high/medium
 *                bands as in Llama 3.1, all in float32
 *   angle(t, i) = f32(t) * inv_freq_i rounded to float32; cos/sin of that.
 * Only the elementary functions (pow, cos, sin) are evaluated in double and
 * rounded once, which is at least as accurate as torch's float kernels. */

static float f32_inv_freq_default(double theta, int64_t i, int64_t d)
{
    float e = (float)(2 * i) / (float)d;
    float p = (float)pow((double)(float)theta, (double)e);
    return 1.0f / p;
}

/* inv_freq_i in float32 as transformers computes it (default, linear or llama3) */
static float inv_freq_one(const bk_model_config *cfg, int64_t i, int64_t d)
{
    const float two_pi = (float)(2.0 * M_PI);
    float w = f32_inv_freq_default(cfg->rope_theta, i, d);
    if (cfg->rope_type == BK_ROPE_LINEAR) {
        w = w / (float)cfg->rope_factor;
    } else if (cfg->rope_type == BK_ROPE_LLAMA3) {
        float factor = (float)cfg->rope_factor;
        float lo = (float)cfg->rope_low_freq_factor;
        double orig = (double)cfg->rope_original_max_positions;
        /* the band limits are Python floats, compared with a float32
         * tensor: torch casts them to float32 */
        float low_wl = (float)(orig / cfg->rope_low_freq_factor);
        float high_wl = (float)(orig / cfg->rope_high_freq_factor);
        float wl = (1.0f / w) * two_pi; /* scalar / tensor = reciprocal * scalar */
        float scaled = wl > low_wl ? w / factor : w;
        if (!(wl < high_wl) && !(wl > low_wl)) {
            float smooth = ((1.0f / wl) * (float)orig - lo) /
                           (float)(cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
            scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
        }
        w = scaled;
    }
    return w;
}

bk_status bk_rope_check_config(const bk_model_config *cfg, int64_t max_pos, const char *label)
{
    int64_t d = cfg->head_dim;
    if (d <= 0 || d % 2 != 0 || !(cfg->rope_theta > 0) || !isfinite(cfg->rope_theta))
        return BK_OK; /* reported by the parser / bk_rope_init */
    const float tmax = (float)(max_pos > 1 ? max_pos - 1 : 1);
    for (int64_t i = 0; i < d / 2; i++) {
        float base = f32_inv_freq_default(cfg->rope_theta, i, d);
        float w = inv_freq_one(cfg, i, d);
        if (!isfinite(base) || !isfinite(tmax * base))
            return bk_error(BK_ERR_CONFIG,
                            "%s: rope_theta = %g makes a RoPE frequency non-finite in float32 "
                            "(inv_freq[%lld] = 1 / rope_theta^(%lld/%lld) = %g, its angle at "
                            "position %lld = %g): rope_theta underflows",
                            label, cfg->rope_theta, (long long)i, (long long)(2 * i), (long long)d,
                            (double)base, (long long)(max_pos - 1), (double)(tmax * base));
        if (!isfinite(w) || !isfinite(tmax * w))
            return bk_error(BK_ERR_CONFIG,
                            "%s: the RoPE scaling (%s, factor %g) makes inv_freq[%lld] = %g "
                            "non-finite (or its angle at position %lld) in float32",
                            label, cfg->rope_type == BK_ROPE_LLAMA3 ? "llama3" : "linear",
                            cfg->rope_factor, (long long)i, (double)w, (long long)(max_pos - 1));
    }
    return BK_OK;
}

bk_status bk_rope_init(bk_rope *r, const bk_model_config *cfg, int64_t max_pos)
{
    r->head_dim = cfg->head_dim;
    r->max_pos = max_pos;
    r->inv_freq = NULL;
    r->cos = r->sin = NULL;
    int64_t d = cfg->head_dim, h = d / 2;
    if (d <= 0 || d % 2 != 0)
        return bk_error(BK_ERR_INVALID_ARG, "rope: head_dim %lld must be even and positive",
                        (long long)d);
    if (max_pos <= 0)
        return bk_error(BK_ERR_INVALID_ARG, "rope: number of positions %lld must be positive",
                        (long long)max_pos);
    if (!(cfg->rope_theta > 0) || !isfinite(cfg->rope_theta))
        return bk_error(BK_ERR_CONFIG, "rope: rope_theta must be a positive number (got %g)",
                        cfg->rope_theta);
    if (cfg->rope_type == BK_ROPE_LINEAR || cfg->rope_type == BK_ROPE_LLAMA3) {
        if (!(cfg->rope_factor > 0) || !isfinite(cfg->rope_factor))
            return bk_error(BK_ERR_CONFIG, "rope: scaling factor must be positive (got %g)",
                            cfg->rope_factor);
    }
    if (cfg->rope_type == BK_ROPE_LLAMA3) {
        if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
            !(cfg->rope_low_freq_factor > 0) || cfg->rope_original_max_positions <= 0)
            return bk_error(BK_ERR_CONFIG,
                            "rope: llama3 scaling needs 0 < low_freq_factor < high_freq_factor "
                            "and original_max_position_embeddings > 0 (got %g, %g, %lld)",
                            cfg->rope_low_freq_factor, cfg->rope_high_freq_factor,
                            (long long)cfg->rope_original_max_positions);
    }
    bk_status st0;
    uint64_t cells;
    if (bk_mul_u64((uint64_t)max_pos, (uint64_t)h, &cells) || cells > SIZE_MAX / sizeof(float))
        return bk_error(BK_ERR_INVALID_ARG, "rope: table for %lld positions overflows",
                        (long long)max_pos);
    r->inv_freq = malloc((size_t)h * sizeof(double));
    r->cos = bk_alloc((size_t)cells, sizeof(float));
    r->sin = bk_alloc((size_t)cells, sizeof(float));
    if (!r->inv_freq || !r->cos || !r->sin) {
        bk_rope_free(r);
        return bk_error(BK_ERR_NOMEM, "rope: out of memory for %lld positions",
                        (long long)max_pos);
    }
    for (int64_t i = 0; i < h; i++) {
        float w = inv_freq_one(cfg, i, d);
        r->inv_freq[i] = (double)w;
    }
    if ((st0 = bk_rope_check_config(cfg, max_pos, "rope")) != BK_OK) {
        bk_rope_free(r);
        return st0;
    }
    for (int64_t t = 0; t < max_pos; t++) {
        for (int64_t i = 0; i < h; i++) {
            float a = (float)t * (float)r->inv_freq[i];
            r->cos[t * h + i] = (float)cos((double)a);
            r->sin[t * h + i] = (float)sin((double)a);
        }
    }
    return BK_OK;
}

void bk_rope_free(bk_rope *r)
{
    free(r->inv_freq);
    free(r->cos);
    free(r->sin);
    r->inv_freq = NULL;
    r->cos = r->sin = NULL;
}

void bk_rope_apply(const bk_rope *r, float *x, int64_t n_heads, int64_t pos, int sign)
{
    int64_t d = r->head_dim, h = d / 2;
    const float *c = r->cos + pos * h, *s = r->sin + pos * h;
    for (int64_t k = 0; k < n_heads; k++) {
        float *v = x + k * d;
        for (int64_t i = 0; i < h; i++) {
            float a = v[i], b = v[i + h];
            float sn = sign > 0 ? s[i] : -s[i];
            v[i] = a * c[i] - b * sn;
            v[i + h] = b * c[i] + a * sn;
        }
    }
}
