#include "rope.h"

#include <math.h>
#include <stdlib.h>

#include "util.h"

bk_status bk_rope_init(bk_rope *r, const bk_model_config *cfg, int64_t max_pos)
{
    r->head_dim = cfg->head_dim;
    r->max_pos = max_pos;
    r->inv_freq = NULL;
    r->cos = r->sin = NULL;
    int64_t d = cfg->head_dim, h = d / 2;
    if (d <= 0 || d % 2 != 0 || max_pos <= 0)
        return bk_error(BK_ERR_INVALID_ARG, "rope: head_dim %lld must be even and positive",
                        (long long)d);
    r->inv_freq = malloc((size_t)h * sizeof(double));
    r->cos = bk_alloc((size_t)(max_pos * h), sizeof(float));
    r->sin = bk_alloc((size_t)(max_pos * h), sizeof(float));
    if (!r->inv_freq || !r->cos || !r->sin) {
        bk_rope_free(r);
        return bk_error(BK_ERR_NOMEM, "rope: out of memory for %lld positions",
                        (long long)max_pos);
    }
    for (int64_t i = 0; i < h; i++) {
        double w = pow(cfg->rope_theta, -(double)(2 * i) / (double)d);
        if (cfg->rope_type == BK_ROPE_LINEAR) {
            w /= cfg->rope_factor;
        } else if (cfg->rope_type == BK_ROPE_LLAMA3) {
            double orig = (double)cfg->rope_original_max_positions;
            double lo = cfg->rope_low_freq_factor, hi = cfg->rope_high_freq_factor;
            double low_wl = orig / lo, high_wl = orig / hi;
            double wl = 2.0 * M_PI / w;
            if (wl < high_wl) {
                /* high frequency: unchanged */
            } else if (wl > low_wl) {
                w /= cfg->rope_factor;
            } else {
                double smooth = (orig / wl - lo) / (hi - lo);
                w = (1.0 - smooth) * w / cfg->rope_factor + smooth * w;
            }
        }
        r->inv_freq[i] = w;
    }
    for (int64_t t = 0; t < max_pos; t++) {
        for (int64_t i = 0; i < h; i++) {
            double a = (double)t * r->inv_freq[i];
            r->cos[t * h + i] = (float)cos(a);
            r->sin[t * h + i] = (float)sin(a);
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
