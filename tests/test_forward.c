/* Tests of the native forward pass (src/forward.c, src/rope.c) and of
 * `bakron eval`.
 *
 * Expected values come from independent constructions:
 *  - hand-computed numbers (RMSNorm, RoPE angles, llama3 frequencies);
 *  - a brute-force double-precision re-implementation of attention and the
 *    MLP written here with plain loops (no BLAS, no shared code);
 *  - golden outputs of Hugging Face transformers (tests/data/models/<m>/golden.safetensors,
 *    tests/data/golden/kerneldocs-1.6m/golden.safetensors) and the perplexity
 *    transformers measured on the example model (examples/kerneldocs-1.6m/README.md).
 *
 * Run with --slow for the full-eval-set perplexity test only.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"
#include "forward_internal.h"
#include "prefetch.h"
#include "rope.h"
#include "test_cm_util.h" /* (includes test_util.h) */
#include "util.h"

/* --------------------------------------------------------------- helpers */

static void path2(char *buf, size_t cap, const char *a, const char *b)
{
    int n = snprintf(buf, cap, "%s/%s", a, b);
    assert_true(n > 0 && (size_t)n < cap);
}

static float *randn(bk_rng *r, size_t n, double scale, double offset)
{
    float *p = malloc(n * sizeof(float));
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(offset + scale * bk_rng_normal(r));
    return p;
}

/* A small Qwen3-like configuration: GQA (4 heads / 2 kv), q/k/v biases and
 * q/k norms, head_dim 4 (== hidden / heads here; the golden tests cover
 * head_dim != hidden / heads). */
static bk_model_config small_cfg(void)
{
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = BK_ARCH_QWEN3;
    strcpy(c.model_type, "qwen3");
    c.n_layers = 1;
    c.hidden = 8;
    c.intermediate = 6;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 4;
    c.vocab = 11;
    c.max_positions = 64;
    c.rms_eps = 1e-6;
    c.rope_theta = 10000.0;
    c.rope_type = BK_ROPE_DEFAULT;
    c.rope_factor = 1.0;
    c.qkv_bias = 1;
    c.qk_norm = 1;
    strcpy(c.hidden_act, "silu");
    c.bos_token_id = c.eos_token_id = -1;
    return c;
}

/* Module shapes written out here (not taken from the library). */
static void shapes(const bk_model_config *c, int64_t out[BK_MOD_COUNT], int64_t in[BK_MOD_COUNT])
{
    int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    out[BK_MOD_Q] = qd, in[BK_MOD_Q] = c->hidden;
    out[BK_MOD_K] = kd, in[BK_MOD_K] = c->hidden;
    out[BK_MOD_V] = kd, in[BK_MOD_V] = c->hidden;
    out[BK_MOD_O] = c->hidden, in[BK_MOD_O] = qd;
    out[BK_MOD_GATE] = c->intermediate, in[BK_MOD_GATE] = c->hidden;
    out[BK_MOD_UP] = c->intermediate, in[BK_MOD_UP] = c->hidden;
    out[BK_MOD_DOWN] = c->hidden, in[BK_MOD_DOWN] = c->intermediate;
}

static void random_layer(const bk_model_config *c, uint64_t seed, bk_layer_weights *lw)
{
    bk_rng r;
    bk_rng_seed(&r, seed);
    int64_t out[BK_MOD_COUNT], in[BK_MOD_COUNT];
    shapes(c, out, in);
    memset(lw, 0, sizeof *lw);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        lw->w[m] = randn(&r, (size_t)(out[m] * in[m]), 0.4, 0.0);
        if (c->qkv_bias && m <= BK_MOD_V)
            lw->b[m] = randn(&r, (size_t)out[m], 0.2, 0.0);
    }
    lw->attn_norm = randn(&r, (size_t)c->hidden, 0.2, 1.0);
    lw->mlp_norm = randn(&r, (size_t)c->hidden, 0.2, 1.0);
    if (c->qk_norm) {
        lw->q_norm = randn(&r, (size_t)c->head_dim, 0.2, 1.0);
        lw->k_norm = randn(&r, (size_t)c->head_dim, 0.2, 1.0);
    }
}

/* ------------------------------------------- brute-force double reference */

static void ref_linear(const double *x, int64_t in, const float *W, const float *b, int64_t out,
                       double *y)
{
    for (int64_t j = 0; j < out; j++) {
        double s = b ? (double)b[j] : 0.0;
        for (int64_t i = 0; i < in; i++)
            s += (double)W[j * in + i] * x[i];
        y[j] = s;
    }
}

static void ref_rmsnorm(double *v, int64_t n, const float *w, double eps)
{
    double ss = 0;
    for (int64_t i = 0; i < n; i++)
        ss += v[i] * v[i];
    double r = 1.0 / sqrt(ss / (double)n + eps);
    for (int64_t i = 0; i < n; i++)
        v[i] = v[i] * r * (double)w[i];
}

/* Rotate-half RoPE with angle t * theta^(-2i/d), in double. */
static void ref_rope(double *v, int64_t d, int64_t t, double theta)
{
    for (int64_t i = 0; i < d / 2; i++) {
        double a = (double)t * pow(theta, -2.0 * (double)i / (double)d);
        double x1 = v[i], x2 = v[i + d / 2];
        v[i] = x1 * cos(a) - x2 * sin(a);
        v[i + d / 2] = x2 * cos(a) + x1 * sin(a);
    }
}

/* The attention block of one layer, from the normalized input x [S*T, hidden]. */
static void ref_attention(const bk_model_config *c, const bk_layer_weights *lw, const float *x,
                          int64_t S, int64_t T, double *o, double *qr, double *kr, double *vv)
{
    int64_t H = c->hidden, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    int64_t qd = nh * hd, kd = nkv * hd, N = S * T;
    double *xd = malloc((size_t)H * sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        for (int64_t i = 0; i < H; i++)
            xd[i] = x[n * H + i];
        ref_linear(xd, H, lw->w[BK_MOD_Q], lw->b[BK_MOD_Q], qd, qr + n * qd);
        ref_linear(xd, H, lw->w[BK_MOD_K], lw->b[BK_MOD_K], kd, kr + n * kd);
        ref_linear(xd, H, lw->w[BK_MOD_V], lw->b[BK_MOD_V], kd, vv + n * kd);
        for (int64_t h = 0; h < nh; h++) {
            if (lw->q_norm)
                ref_rmsnorm(qr + n * qd + h * hd, hd, lw->q_norm, c->rms_eps);
            ref_rope(qr + n * qd + h * hd, hd, n % T, c->rope_theta);
        }
        for (int64_t h = 0; h < nkv; h++) {
            if (lw->k_norm)
                ref_rmsnorm(kr + n * kd + h * hd, hd, lw->k_norm, c->rms_eps);
            ref_rope(kr + n * kd + h * hd, hd, n % T, c->rope_theta);
        }
    }
    free(xd);
    double *p = malloc((size_t)T * sizeof(double));
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < nh; h++) {
            int64_t g = h / (nh / nkv);
            for (int64_t i = 0; i < T; i++) {
                const double *q = qr + (s * T + i) * qd + h * hd;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= i; j++) {
                    const double *k = kr + (s * T + j) * kd + g * hd;
                    double d = 0;
                    for (int64_t e = 0; e < hd; e++)
                        d += q[e] * k[e];
                    p[j] = d / sqrt((double)hd);
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = 0; j <= i; j++)
                    sum += (p[j] = exp(p[j] - mx));
                double *oo = o + (s * T + i) * qd + h * hd;
                for (int64_t e = 0; e < hd; e++) {
                    double a = 0;
                    for (int64_t j = 0; j <= i; j++)
                        a += p[j] / sum * vv[(s * T + j) * kd + g * hd + e];
                    oo[e] = a;
                }
            }
        }
    free(p);
}

/* ============================================================ unit tests */

static void test_sliding_window_refused(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    c.sliding_window = 16;
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(&c, 1, 16, &f), BK_OK);
    bk_fwd_free(f);
    f = NULL;
    assert_int_equal(bk_fwd_create(&c, 1, 17, &f), BK_ERR_UNSUPPORTED);
    assert_null(f);
    assert_non_null(strstr(bk_last_error(), "sliding window"));
}

static void test_rmsnorm_hand(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    c.hidden = 4;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 2;
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(&c, 1, 2, &f), BK_OK);
    float w[4] = {1.0f, 0.5f, 2.0f, -1.0f};
    float h[8] = {1, 2, 3, 4, 0, 0, 0, 1e-3f};
    float x[8];
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    lw.attn_norm = w;
    assert_int_equal(bk_fwd_attn_in(f, &lw, h, 1, x), BK_OK);
    /* mean(x^2) = 30/4 = 7.5; 1/sqrt(7.5 + 1e-6) = 0.36514834732688 */
    const double r = 0.36514834732688;
    double want[4] = {1 * r, 0.5 * 2 * r, 2 * 3 * r, -1 * 4 * r};
    for (int i = 0; i < 4; i++)
        assert_true(fabs(x[i] - want[i]) < 1e-6);
    /* second row: mean = 2.5e-7, eps dominates: 1e-3 / sqrt(1.25e-6) = 0.894427 */
    assert_true(fabs(x[7] - (-1.0 * 0.8944271909999159)) < 1e-5);
    assert_true(x[4] == 0.0f);
    bk_fwd_free(f);
}

static void test_rope_hand(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    c.head_dim = 4;
    c.rope_theta = 100.0; /* inv_freq = [1, 0.1] */
    bk_rope r;
    assert_int_equal(bk_rope_init(&r, &c, 4), BK_OK);
    assert_true(fabs(r.inv_freq[0] - 1.0) < 1e-7);
    assert_true(fabs(r.inv_freq[1] - 0.1) < 1e-7);
    /* position 2: angles 2 and 0.2 */
    assert_true(fabs(r.cos[2 * 2 + 0] - (-0.4161468365471424)) < 1e-6);
    assert_true(fabs(r.sin[2 * 2 + 0] - 0.9092974268256817) < 1e-6);
    assert_true(fabs(r.cos[2 * 2 + 1] - 0.9800665778412416) < 1e-6);
    assert_true(fabs(r.sin[2 * 2 + 1] - 0.19866933079506122) < 1e-6);
    /* rotate-half convention: pairs (i, i + d/2) */
    float v[4] = {1, 0, 0, 1}; /* (x0, x2) = (1, 0), (x1, x3) = (0, 1) */
    bk_rope_apply(&r, v, 1, 2, +1);
    assert_true(fabs(v[0] - (-0.4161468)) < 1e-6 && fabs(v[2] - 0.9092974) < 1e-6);
    assert_true(fabs(v[1] - (-0.1986693)) < 1e-6 && fabs(v[3] - 0.9800666) < 1e-6);
    bk_rope_apply(&r, v, 1, 2, -1);
    assert_true(fabs(v[0] - 1) < 1e-6 && fabs(v[1]) < 1e-6 && fabs(v[2]) < 1e-6 &&
                fabs(v[3] - 1) < 1e-6);
    /* position 0 is the identity */
    float u[4] = {0.3f, -2, 5, 7};
    bk_rope_apply(&r, u, 1, 0, +1);
    assert_true(u[0] == 0.3f && u[1] == -2 && u[2] == 5 && u[3] == 7);
    bk_rope_free(&r);

    /* linear scaling divides every frequency by the factor */
    c.rope_type = BK_ROPE_LINEAR;
    c.rope_factor = 4.0;
    assert_int_equal(bk_rope_init(&r, &c, 2), BK_OK);
    assert_true(fabs(r.inv_freq[0] - 0.25) < 1e-7 && fabs(r.inv_freq[1] - 0.025) < 1e-8);
    bk_rope_free(&r);
}

static void test_rope_llama3(void **state)
{
    (void)state;
    /* tiny-llama3: theta 5e5, head_dim 16, factor 8, low 1, high 4, original 64.
     * Frequencies from the Llama 3.1 rule evaluated in double by hand
     * (wavelength < 16: kept; > 64: divided by 8; between: interpolated). */
    static const double want[8] = {1.000000000e+00, 7.940300918e-02, 4.700753866e-03,
                                   9.115830922e-04, 1.767766953e-04, 3.428102196e-05,
                                   6.647869871e-06, 1.289173172e-06};
    bk_model_config c = small_cfg();
    c.head_dim = 16;
    c.rope_theta = 500000.0;
    c.rope_type = BK_ROPE_LLAMA3;
    c.rope_factor = 8.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.rope_original_max_positions = 64;
    bk_rope r;
    assert_int_equal(bk_rope_init(&r, &c, 300), BK_OK);
    for (int i = 0; i < 8; i++)
        assert_true(fabs(r.inv_freq[i] - want[i]) <= 1e-6 * want[i]);
    /* position 299, lowest frequency */
    double a = 299.0 * want[7];
    assert_true(fabs(r.cos[299 * 8 + 7] - cos(a)) < 1e-6);
    assert_true(fabs(r.sin[299 * 8 + 7] - sin(a)) < 1e-6);
    bk_rope_free(&r);
    /* inconsistent llama3 parameters are a config error */
    c.rope_high_freq_factor = 0.5;
    assert_int_equal(bk_rope_init(&r, &c, 4), BK_ERR_CONFIG);
}

static void test_attention_bruteforce(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    const int64_t S = 2, T = 5, N = S * T;
    bk_layer_weights lw;
    random_layer(&c, 11, &lw);
    bk_rng r;
    bk_rng_seed(&r, 12);
    float *x = randn(&r, (size_t)(N * c.hidden), 1.0, 0.0);
    int64_t qd = c.n_heads * c.head_dim, kd = c.n_kv_heads * c.head_dim;
    float *o = malloc((size_t)(N * qd) * sizeof(float));
    float *qr = malloc((size_t)(N * qd) * sizeof(float));
    float *kr = malloc((size_t)(N * kd) * sizeof(float));
    float *v = malloc((size_t)(N * kd) * sizeof(float));
    double *o_ref = malloc((size_t)(N * qd) * sizeof(double));
    double *qr_ref = malloc((size_t)(N * qd) * sizeof(double));
    double *kr_ref = malloc((size_t)(N * kd) * sizeof(double));
    double *v_ref = malloc((size_t)(N * kd) * sizeof(double));
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(&c, S, T, &f), BK_OK);
    assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, qr, kr, v), BK_OK);
    ref_attention(&c, &lw, x, S, T, o_ref, qr_ref, kr_ref, v_ref);
    double e1 = tu_rel_err_fd(qr, qr_ref, (size_t)(N * qd));
    double e2 = tu_rel_err_fd(kr, kr_ref, (size_t)(N * kd));
    double e3 = tu_rel_err_fd(v, v_ref, (size_t)(N * kd));
    double e4 = tu_rel_err_fd(o, o_ref, (size_t)(N * qd));
    printf("  attention vs brute force: q_rot %.2e k_rot %.2e v %.2e o_in %.2e\n", e1, e2, e3, e4);
    assert_true(e1 < 1e-5 && e2 < 1e-5 && e3 < 1e-5 && e4 < 1e-5);
    /* without q/k norms and biases (Llama) */
    free(lw.q_norm);
    free(lw.k_norm);
    lw.q_norm = lw.k_norm = NULL;
    for (int m = 0; m < 3; m++) {
        free(lw.b[m]);
        lw.b[m] = NULL;
    }
    assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, NULL, NULL, NULL), BK_OK);
    ref_attention(&c, &lw, x, S, T, o_ref, qr_ref, kr_ref, v_ref);
    e4 = tu_rel_err_fd(o, o_ref, (size_t)(N * qd));
    assert_true(e4 < 1e-5);
    /* causality: the first token's output depends on itself only, so it
     * equals v of its kv head */
    for (int64_t h = 0; h < c.n_heads; h++)
        for (int64_t e = 0; e < c.head_dim; e++)
            assert_true(fabs(o[h * c.head_dim + e] - v_ref[(h / 2) * c.head_dim + e]) < 1e-5);
    bk_fwd_free(f);
    bk_layer_weights_free(&lw);
    free(x), free(o), free(qr), free(kr), free(v);
    free(o_ref), free(qr_ref), free(kr_ref), free(v_ref);
}

static void test_mlp_bruteforce(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    const int64_t S = 1, T = 3, N = S * T, H = c.hidden, I = c.intermediate;
    bk_layer_weights lw;
    random_layer(&c, 21, &lw);
    bk_rng r;
    bk_rng_seed(&r, 22);
    float *h = randn(&r, (size_t)(N * H), 1.0, 0.0);
    float *h0 = malloc((size_t)(N * H) * sizeof(float));
    memcpy(h0, h, (size_t)(N * H) * sizeof(float));
    float *x = malloc((size_t)(N * H) * sizeof(float));
    float *d = malloc((size_t)(N * I) * sizeof(float));
    float *g = malloc((size_t)(N * I) * sizeof(float));
    float *u = malloc((size_t)(N * I) * sizeof(float));
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(&c, S, T, &f), BK_OK);
    assert_int_equal(bk_fwd_mlp_in(f, &lw, h, S, x), BK_OK);
    assert_int_equal(bk_fwd_mlp_hidden(f, &lw, x, S, d, g, u), BK_OK);
    assert_int_equal(bk_fwd_mlp_out(f, &lw, d, S, h), BK_OK);
    double xd[64], gd[64], ud[64], dd[64], yd[64];
    double worst = 0;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t i = 0; i < H; i++)
            xd[i] = h0[n * H + i];
        ref_rmsnorm(xd, H, lw.mlp_norm, c.rms_eps);
        ref_linear(xd, H, lw.w[BK_MOD_GATE], NULL, I, gd);
        ref_linear(xd, H, lw.w[BK_MOD_UP], NULL, I, ud);
        for (int64_t j = 0; j < I; j++) {
            dd[j] = gd[j] / (1.0 + exp(-gd[j])) * ud[j];
            worst = fmax(worst, fabs(g[n * I + j] - gd[j]) + fabs(u[n * I + j] - ud[j]) +
                                    fabs(d[n * I + j] - dd[j]));
        }
        ref_linear(dd, I, lw.w[BK_MOD_DOWN], NULL, H, yd);
        for (int64_t i = 0; i < H; i++)
            worst = fmax(worst, fabs(h[n * H + i] - (h0[n * H + i] + yd[i])));
    }
    printf("  MLP vs brute force: max abs error %.2e\n", worst);
    assert_true(worst < 1e-5);
    bk_fwd_free(f);
    bk_layer_weights_free(&lw);
    free(h), free(h0), free(x), free(d), free(g), free(u);
}

/* bk_fwd_layer == the stage functions composed, taps == the stage values. */
static void test_layer_equals_stages(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    c.intermediate = 10;
    const int64_t S = 3, T = 7, N = S * T, H = c.hidden, I = c.intermediate;
    const int64_t qd = c.n_heads * c.head_dim, kd = c.n_kv_heads * c.head_dim;
    bk_layer_weights lw;
    random_layer(&c, 31, &lw);
    bk_rng r;
    bk_rng_seed(&r, 32);
    float *hA = randn(&r, (size_t)(N * H), 1.0, 0.0);
    float *hB = malloc((size_t)(N * H) * sizeof(float));
    float *hC = malloc((size_t)(N * H) * sizeof(float));
    memcpy(hB, hA, (size_t)(N * H) * sizeof(float));
    memcpy(hC, hA, (size_t)(N * H) * sizeof(float));
    bk_layer_taps tp = {
        .attn_in = malloc((size_t)(N * H) * sizeof(float)),
        .o_in = malloc((size_t)(N * qd) * sizeof(float)),
        .mlp_in = malloc((size_t)(N * H) * sizeof(float)),
        .down_in = malloc((size_t)(N * I) * sizeof(float)),
        .q_rot = malloc((size_t)(N * qd) * sizeof(float)),
        .k_rot = malloc((size_t)(N * kd) * sizeof(float)),
    };
    float *x = malloc((size_t)(N * H) * sizeof(float));
    float *o = malloc((size_t)(N * qd) * sizeof(float));
    float *qr = malloc((size_t)(N * qd) * sizeof(float));
    float *kr = malloc((size_t)(N * kd) * sizeof(float));
    float *x2 = malloc((size_t)(N * H) * sizeof(float));
    float *d = malloc((size_t)(N * I) * sizeof(float));
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(&c, S, T, &f), BK_OK);
    assert_int_equal(bk_fwd_layer(f, &lw, S, hA, &tp), BK_OK);
    assert_int_equal(bk_fwd_attn_in(f, &lw, hB, S, x), BK_OK);
    assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, qr, kr, NULL), BK_OK);
    assert_int_equal(bk_fwd_attn_out(f, &lw, o, S, hB), BK_OK);
    assert_int_equal(bk_fwd_mlp_in(f, &lw, hB, S, x2), BK_OK);
    assert_int_equal(bk_fwd_mlp_hidden(f, &lw, x2, S, d, NULL, NULL), BK_OK);
    assert_int_equal(bk_fwd_mlp_out(f, &lw, d, S, hB), BK_OK);
    assert_memory_equal(hA, hB, (size_t)(N * H) * sizeof(float));
    assert_memory_equal(tp.attn_in, x, (size_t)(N * H) * sizeof(float));
    assert_memory_equal(tp.o_in, o, (size_t)(N * qd) * sizeof(float));
    assert_memory_equal(tp.q_rot, qr, (size_t)(N * qd) * sizeof(float));
    assert_memory_equal(tp.k_rot, kr, (size_t)(N * kd) * sizeof(float));
    assert_memory_equal(tp.mlp_in, x2, (size_t)(N * H) * sizeof(float));
    assert_memory_equal(tp.down_in, d, (size_t)(N * I) * sizeof(float));
    /* without taps: same result */
    assert_int_equal(bk_fwd_layer(f, &lw, S, hC, NULL), BK_OK);
    assert_memory_equal(hA, hC, (size_t)(N * H) * sizeof(float));
    bk_fwd_free(f);
    bk_layer_weights_free(&lw);
    free(hA), free(hB), free(hC), free(x), free(o), free(qr), free(kr), free(x2), free(d);
    free(tp.attn_in), free(tp.o_in), free(tp.mlp_in), free(tp.down_in), free(tp.q_rot),
        free(tp.k_rot);
}

/* One call over 3 sequences == three calls over one sequence each. */
static void test_layer_microbatch(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    const int64_t S = 3, T = 6, H = c.hidden;
    bk_layer_weights lw;
    random_layer(&c, 41, &lw);
    bk_rng r;
    bk_rng_seed(&r, 42);
    float *hA = randn(&r, (size_t)(S * T * H), 1.0, 0.0);
    float *hB = malloc((size_t)(S * T * H) * sizeof(float));
    memcpy(hB, hA, (size_t)(S * T * H) * sizeof(float));
    bk_fwd *f3 = NULL, *f1 = NULL;
    assert_int_equal(bk_fwd_create(&c, S, T, &f3), BK_OK);
    assert_int_equal(bk_fwd_create(&c, 1, T, &f1), BK_OK);
    assert_int_equal(bk_fwd_layer(f3, &lw, S, hA, NULL), BK_OK);
    for (int64_t s = 0; s < S; s++)
        assert_int_equal(bk_fwd_layer(f1, &lw, 1, hB + s * T * H, NULL), BK_OK);
    double e = tu_rel_err_f(hB, hA, (size_t)(S * T * H));
    assert_true(e < 1e-6);
    /* more sequences than the context was made for */
    assert_int_equal(bk_fwd_layer(f1, &lw, 2, hB, NULL), BK_ERR_INVALID_ARG);
    bk_fwd_free(f3);
    bk_fwd_free(f1);
    bk_layer_weights_free(&lw);
    free(hA), free(hB);
}

static void test_create_rejects(void **state)
{
    (void)state;
    bk_model_config c = small_cfg();
    bk_fwd *f = NULL;
    c.n_kv_heads = 3;
    assert_int_equal(bk_fwd_create(&c, 1, 4, &f), BK_ERR_CONFIG);
    assert_null(f);
    assert_non_null(strstr(bk_last_error(), "num_key_value_heads"));
    c = small_cfg();
    strcpy(c.hidden_act, "gelu");
    assert_int_equal(bk_fwd_create(&c, 1, 4, &f), BK_ERR_UNSUPPORTED);
    assert_non_null(strstr(bk_last_error(), "gelu"));
    c = small_cfg();
    c.head_dim = 3;
    assert_int_equal(bk_fwd_create(&c, 1, 4, &f), BK_ERR_CONFIG);
    c = small_cfg();
    assert_int_equal(bk_fwd_create(&c, 0, 4, &f), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_fwd_create(&c, (int64_t)1 << 40, (int64_t)1 << 30, &f),
                     BK_ERR_INVALID_ARG);
    assert_null(f);
}

/* ======================================================== golden tests */

typedef struct golden {
    bk_st_file *g;
    int64_t B, T;
    int32_t *ids;
} golden;

static void golden_open(const char *path, golden *gd)
{
    memset(gd, 0, sizeof *gd);
    bk_status st = bk_st_open(path, &gd->g);
    if (st != BK_OK)
        fail_msg("%s: %s", path, bk_last_error());
    const bk_tensor_info *t = bk_st_find(gd->g, "input_ids");
    assert_non_null(t);
    assert_int_equal(t->dtype, BK_DT_I32);
    assert_int_equal(t->ndim, 2);
    gd->B = t->shape[0];
    gd->T = t->shape[1];
    gd->ids = malloc((size_t)(gd->B * gd->T) * sizeof(int32_t));
    memcpy(gd->ids, t->data, (size_t)(gd->B * gd->T) * sizeof(int32_t));
}

static void golden_close(golden *gd)
{
    bk_st_close(gd->g);
    free(gd->ids);
}

/* Relative error of got against golden tensor `name` (n elements). */
static double golden_cmp(const golden *gd, const char *name, const float *got, size_t n)
{
    const bk_tensor_info *t = bk_st_find(gd->g, name);
    if (!t)
        fail_msg("golden tensor %s missing", name);
    assert_int_equal((int64_t)t->numel, (int64_t)n);
    float *ref = malloc(n * sizeof(float));
    assert_int_equal(bk_tensor_to_f32(t, ref), BK_OK);
    double e = tu_rel_err_f(got, ref, n);
    free(ref);
    return e;
}

static bk_model *open_model(const char *dir)
{
    bk_model *m = NULL;
    bk_status st = bk_model_open(dir, &m);
    if (st != BK_OK)
        fail_msg("%s: %s", dir, bk_last_error());
    return m;
}

/* Runs the model on the golden input stage by stage and returns the worst
 * relative error over every compared tensor (printing each). */
static double run_golden(const char *label, const char *model_dir, const char *golden_path)
{
    bk_model *m = open_model(model_dir);
    const bk_model_config *c = bk_model_get_config(m);
    golden gd;
    golden_open(golden_path, &gd);
    const int64_t N = gd.B * gd.T, H = c->hidden, I = c->intermediate;
    const int64_t qd = c->n_heads * c->head_dim;
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(c, gd.B, gd.T, &f), BK_OK);
    float *h = malloc((size_t)(N * H) * sizeof(float));
    bk_layer_taps tp = {
        .attn_in = malloc((size_t)(N * H) * sizeof(float)),
        .o_in = malloc((size_t)(N * qd) * sizeof(float)),
        .mlp_in = malloc((size_t)(N * H) * sizeof(float)),
        .down_in = malloc((size_t)(N * I) * sizeof(float)),
    };
    float *logits = malloc((size_t)(N * c->vocab) * sizeof(float));
    assert_int_equal(bk_fwd_embed(f, m, gd.ids, gd.B, h), BK_OK);
    double worst = 0;
    char name[128], wname[128] = "";
#define CMP(NM, PTR, CNT)                                                                     \
    do {                                                                                      \
        double e_ = golden_cmp(&gd, NM, PTR, (size_t)(CNT));                                  \
        if (!(e_ <= worst)) {                                                                 \
            worst = isnan(e_) ? INFINITY : e_;                                                \
            snprintf(wname, sizeof wname, "%s", NM);                                          \
        }                                                                                     \
    } while (0)
    for (int L = 0; L < c->n_layers; L++) {
        bk_layer_weights lw;
        bk_status st = bk_layer_weights_load(m, L, &lw);
        if (st != BK_OK)
            fail_msg("%s layer %d: %s", label, L, bk_last_error());
        assert_int_equal(bk_fwd_layer(f, &lw, gd.B, h, &tp), BK_OK);
        bk_layer_weights_free(&lw);
        snprintf(name, sizeof name, "layers.%d.self_attn.q_proj.input", L);
        CMP(name, tp.attn_in, N * H);
        snprintf(name, sizeof name, "layers.%d.self_attn.o_proj.input", L);
        CMP(name, tp.o_in, N * qd);
        snprintf(name, sizeof name, "layers.%d.mlp.gate_proj.input", L);
        CMP(name, tp.mlp_in, N * H);
        snprintf(name, sizeof name, "layers.%d.mlp.down_proj.input", L);
        CMP(name, tp.down_in, N * I);
        snprintf(name, sizeof name, "layers.%d.output", L);
        CMP(name, h, N * H);
    }
    assert_int_equal(bk_fwd_logits(f, m, h, gd.B, logits), BK_OK);
    CMP("logits", logits, N * c->vocab);
#undef CMP
    printf("  %-16s %lld x %lld tokens, %lld layers: worst relative error %.3e (%s)\n", label,
           (long long)gd.B, (long long)gd.T, (long long)c->n_layers, worst, wname);
    free(h), free(logits);
    free(tp.attn_in), free(tp.o_in), free(tp.mlp_in), free(tp.down_in);
    bk_fwd_free(f);
    golden_close(&gd);
    bk_model_close(m);
    return worst;
}

static void golden_model(const char *model)
{
    char dir[1024], gp[1024];
    snprintf(dir, sizeof dir, "%s/models/%s", tu_env_or("BK_TEST_DATA", "tests/data"), model);
    path2(gp, sizeof gp, dir, "golden.safetensors");
    double w = run_golden(model, dir, gp);
    assert_true(w <= 1e-4);
}

static void test_golden_tiny_llama3(void **state)
{
    (void)state;
    golden_model("tiny-llama3");
}

static void test_golden_tiny_qwen2(void **state)
{
    (void)state;
    golden_model("tiny-qwen2");
}

static void test_golden_tiny_qwen3(void **state)
{
    (void)state;
    golden_model("tiny-qwen3");
}

static void test_golden_kerneldocs(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    double w = run_golden("kerneldocs-1.6m", dir, gp);
    assert_true(w <= 1e-4);
}

/* BF16 storage of the tiny-qwen3 weights against the F32 golden. Rounding a
 * weight to BF16 changes it by at most u = 2^-9 relative; over a dot product
 * of random-sign terms the per-projection error is of order u, and it
 * compounds through 7 projections x 3 layers, the norms and the head.
 * Bound: 16 u = 3.1e-2 (measured: 1.7e-2 = 8.8 u, in layers.2.mlp.gate_proj.input). */
#define BF16_BOUND (16.0 / 512.0)
static void test_golden_tiny_qwen3_bf16(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    const char *data = tu_env_or("BK_TEST_DATA", "tests/data");
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3-bf16", data);
    snprintf(gp, sizeof gp, "%s/models/tiny-qwen3/golden.safetensors", data);
    double w = run_golden("tiny-qwen3-bf16", dir, gp);
    assert_true(w <= BF16_BOUND);
    /* and it really is a different (rounded) model: not bit-identical */
    assert_true(w > 1e-6);
}

/* bk__fwd_qk_rot (the fully-local Hessians' stage QKV) against
 * bk_fwd_attention's q_rot / k_rot: bitwise, every layer of the test models
 * (Llama 3 RoPE scaling, Qwen2 biases, Qwen3 q/k norm in F32 and BF16,
 * kerneldocs) on random tokens; its non-finite checks are the q/k side's
 * (a q_proj overflow is named as by bk_fwd_attention, a v_proj one is not
 * seen); NULL outputs refused. */
static int64_t qk_differ(const float *a, const float *b, int64_t n)
{
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++)
        d += memcmp(a + i, b + i, sizeof(float)) != 0;
    return d;
}

static void qk_rot_model(const char *label, const char *dir)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t S = 2, T = 23, N = S * T, H = c->hidden;
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int32_t *ids = malloc((size_t)N * sizeof(int32_t));
    assert_non_null(ids);
    bk_rng r;
    bk_rng_seed(&r, 43);
    for (int64_t i = 0; i < N; i++)
        ids[i] = (int32_t)(bk_rng_next(&r) % (uint64_t)c->vocab);
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(c, S, T, &f), BK_OK);
    const size_t fs = sizeof(float);
    float *h = malloc((size_t)(N * H) * fs), *x = malloc((size_t)(N * H) * fs);
    float *o = malloc((size_t)(N * qd) * fs);
    float *q1 = malloc((size_t)(N * qd) * fs), *k1 = malloc((size_t)(N * kd) * fs);
    float *q2 = malloc((size_t)(N * qd) * fs), *k2 = malloc((size_t)(N * kd) * fs);
    assert_true(h && x && o && q1 && k1 && q2 && k2);
    assert_int_equal(bk_fwd_embed(f, m, ids, S, h), BK_OK);
    int64_t diff = 0;
    for (int L = 0; L < c->n_layers; L++) {
        bk_layer_weights lw;
        assert_int_equal(bk_layer_weights_load(m, L, &lw), BK_OK);
        assert_int_equal(bk_fwd_attn_in(f, &lw, h, S, x), BK_OK);
        for (int64_t i = 0; i < N * qd; i++)
            q2[i] = NAN;
        for (int64_t i = 0; i < N * kd; i++)
            k2[i] = NAN;
        assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S, q2, k2), BK_OK);
        assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, q1, k1, NULL), BK_OK);
        diff += qk_differ(q1, q2, N * qd) + qk_differ(k1, k2, N * kd);
        assert_int_equal(bk_fwd_layer(f, &lw, S, h, NULL), BK_OK);
        bk_layer_weights_free(&lw);
    }
    printf("  q/k only vs attention, %s (%lld layers): %lld entries differ\n", label,
           (long long)c->n_layers, (long long)diff);
    assert_int_equal(diff, 0);
    /* layer 0: NULL outputs; a q_proj overflow as the attention names it; a
     * v_proj overflow left to the attention (stage O) */
    bk_layer_weights lw;
    assert_int_equal(bk_layer_weights_load(m, 0, &lw), BK_OK);
    assert_int_equal(bk_fwd_embed(f, m, ids, S, h), BK_OK);
    assert_int_equal(bk_fwd_attn_in(f, &lw, h, S, x), BK_OK);
    assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S, NULL, k2), BK_ERR_INVALID_ARG);
    assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S, q2, NULL), BK_ERR_INVALID_ARG);
    assert_int_equal(bk__fwd_qk_rot(f, NULL, x, S, q2, k2), BK_ERR_INVALID_ARG);
    assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S + 1, q2, k2), BK_ERR_INVALID_ARG);
    for (int64_t j = 0; j < H; j++)
        lw.w[BK_MOD_V][j] = 3.4e38f;
    assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S, q2, k2), BK_OK);
    assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, NULL, NULL, NULL), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "v_proj output"));
    for (int64_t j = 0; j < H; j++)
        lw.w[BK_MOD_Q][j] = 3.4e38f;
    assert_int_equal(bk__fwd_qk_rot(f, &lw, x, S, q2, k2), BK_ERR_NONFINITE);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", bk_last_error());
    assert_non_null(strstr(msg, "q_proj output"));
    assert_int_equal(bk_fwd_attention(f, &lw, x, S, o, NULL, NULL, NULL), BK_ERR_NONFINITE);
    assert_string_equal(msg, bk_last_error());
    bk_layer_weights_free(&lw);
    free(h), free(x), free(o), free(q1), free(k1), free(q2), free(k2), free(ids);
    bk_fwd_free(f);
    bk_model_close(m);
}

static void test_qk_rot(void **state)
{
    (void)state;
    const char *const models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-bf16",
                                  "kerneldocs-1.6m"};
    tu_each_model(models, sizeof models / sizeof models[0], qk_rot_model);
}

/* The GPU backprop flow loads every layer's host weights on up to 8 threads
 * at once (cuda/backward.cu, preload_host_weights): bk_layer_weights_load
 * must be reentrant. Here 8 threads each load every layer at once (each
 * starting at another layer) and must get the serial load's bits; a thread
 * asking for a layer past the end gets its own error message (the error
 * buffer is per thread). The CPU half of the preload, runnable without a GPU. */
#define LW_THREADS 8
typedef struct {
    const bk_model *m;
    int L, t;
    bk_layer_weights *out; /* [L] */
    bk_status bad_st;
    char bad_msg[256];
} lw_job;

static void *lw_thread(void *x)
{
    lw_job *j = x;
    for (int k = 0; k < j->L; k++) {
        const int l = (k + j->t) % j->L;
        if (bk_layer_weights_load(j->m, l, &j->out[l]) != BK_OK)
            return x; /* (out[l] stays zeroed: the comparison fails) */
    }
    j->bad_st = bk_layer_weights_load(j->m, j->L + j->t, &(bk_layer_weights){0});
    snprintf(j->bad_msg, sizeof j->bad_msg, "%s", bk_last_error());
    return NULL;
}

static int lw_same(const float *a, const float *b, size_t n)
{
    if (!a || !b)
        return a == b;
    return memcmp(a, b, n * sizeof(float)) == 0;
}

static void layer_weights_threads_model(const char *label, const char *dir)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    bk_layer_weights *ref = calloc((size_t)L, sizeof *ref);
    assert_non_null(ref);
    for (int l = 0; l < L; l++)
        assert_int_equal(bk_layer_weights_load(m, l, &ref[l]), BK_OK);
    lw_job jobs[LW_THREADS];
    pthread_t tid[LW_THREADS];
    for (int t = 0; t < LW_THREADS; t++) {
        jobs[t] = (lw_job){.m = m, .L = L, .t = t, .bad_st = BK_OK};
        jobs[t].out = calloc((size_t)L, sizeof(bk_layer_weights));
        assert_non_null(jobs[t].out);
    }
    for (int t = 0; t < LW_THREADS; t++)
        assert_int_equal(pthread_create(&tid[t], NULL, lw_thread, &jobs[t]), 0);
    for (int t = 0; t < LW_THREADS; t++)
        assert_int_equal(pthread_join(tid[t], NULL), 0);
    for (int t = 0; t < LW_THREADS; t++) {
        for (int l = 0; l < L; l++) {
            const bk_layer_weights *a = &ref[l], *b = &jobs[t].out[l];
            int ok = b->layer == l;
            for (int i = 0; i < BK_MOD_COUNT; i++) {
                int64_t o, in;
                bk_module_shape(c, (bk_module)i, &o, &in);
                ok = ok && lw_same(a->w[i], b->w[i], (size_t)(o * in)) &&
                     lw_same(a->b[i], b->b[i], (size_t)o);
            }
            ok = ok && lw_same(a->attn_norm, b->attn_norm, (size_t)c->hidden) &&
                 lw_same(a->mlp_norm, b->mlp_norm, (size_t)c->hidden) &&
                 lw_same(a->q_norm, b->q_norm, (size_t)c->head_dim) &&
                 lw_same(a->k_norm, b->k_norm, (size_t)c->head_dim);
            if (!ok)
                fail_msg("%s: thread %d, layer %d: not the serial load's weights", label, t, l);
            bk_layer_weights_free(&jobs[t].out[l]);
        }
        free(jobs[t].out);
        /* its own error: the layer it asked for */
        char want[64];
        snprintf(want, sizeof want, "layer %d outside", L + t);
        assert_int_equal(jobs[t].bad_st, BK_ERR_INVALID_ARG);
        if (!strstr(jobs[t].bad_msg, want))
            fail_msg("%s: thread %d: error '%s' lacks '%s'", label, t, jobs[t].bad_msg, want);
    }
    for (int l = 0; l < L; l++)
        bk_layer_weights_free(&ref[l]);
    free(ref);
    bk_model_close(m);
}

static void test_layer_weights_threads(void **state)
{
    (void)state;
    const char *const models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3-bf16", "kerneldocs-1.6m"};
    tu_each_model(models, sizeof models / sizeof models[0], layer_weights_threads_model);
}

/* The GPU backward's bf16 host weights (bk_layer_weights_bf16_load, issue
 * 16): every matrix's bits are bk_f32_to_bf16_rn_dev of the F32 load's (what
 * the device's k_to_bf16_rn made of the F32 upload before), pointing into
 * the mapped file for a BF16 checkpoint (no copy) and copied otherwise;
 * biases and norms the F32 load's; host_bytes what the struct owns
 * (src/bwd_mem.c's plan numbers); loads on 8 threads at once give the same. */
typedef struct {
    const bk_model *m;
    int L;
    bk_layer_weights_bf16 *out;
} lwb_job;

static void *lwb_thread(void *x)
{
    lwb_job *j = x;
    for (int l = 0; l < j->L; l++)
        if (bk_layer_weights_bf16_load(j->m, l, &j->out[l]) != BK_OK)
            return x;
    return NULL;
}

static void layer_weights_bf16_model(const char *label, const char *dir)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    const int mapped = bk_model_linears_mapped_bf16(m);
    int64_t copied = 0, total = 0;
    lwb_job jobs[LW_THREADS];
    pthread_t tid[LW_THREADS];
    for (int t = 0; t < LW_THREADS; t++) {
        jobs[t] = (lwb_job){.m = m, .L = L};
        jobs[t].out = calloc((size_t)L, sizeof(bk_layer_weights_bf16));
        assert_non_null(jobs[t].out);
        assert_int_equal(pthread_create(&tid[t], NULL, lwb_thread, &jobs[t]), 0);
    }
    for (int t = 0; t < LW_THREADS; t++)
        assert_int_equal(pthread_join(tid[t], NULL), 0);
    for (int l = 0; l < L; l++) {
        bk_layer_weights lw;
        bk_layer_weights_bf16 lb;
        assert_int_equal(bk_layer_weights_load(m, l, &lw), BK_OK);
        assert_int_equal(bk_layer_weights_bf16_load(m, l, &lb), BK_OK);
        assert_int_equal(lb.layer, l);
        uint64_t own = 0;
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int64_t o, in;
            bk_module_shape(c, (bk_module)i, &o, &in);
            uint16_t *want = malloc((size_t)(o * in) * 2);
            assert_non_null(want);
            bk_f32_to_bf16_rn_dev(lw.w[i], want, (size_t)(o * in));
            assert_non_null(lb.w[i]);
            if (memcmp(want, lb.w[i], (size_t)(o * in) * 2) != 0)
                fail_msg("%s: layer %d %s: BF16 bits differ from the F32 load rounded", label, l,
                         bk_module_name((bk_module)i));
            for (int t = 0; t < LW_THREADS; t++)
                if (memcmp(want, jobs[t].out[l].w[i], (size_t)(o * in) * 2) != 0)
                    fail_msg("%s: thread %d layer %d: not the serial load's bits", label, t, l);
            free(want);
            total++;
            if (lb.own[i]) {
                assert_ptr_equal(lb.own[i], lb.w[i]);
                copied++;
                own += (uint64_t)(o * in) * 2;
            } else {
                assert_ptr_equal(lb.w[i], bk_model_linear_bf16_mapped(m, l, (bk_module)i));
            }
            assert_true(lw_same(lw.b[i], lb.b[i], (size_t)o));
            if (lb.b[i])
                own += (uint64_t)o * 4;
        }
        assert_true(lw_same(lw.attn_norm, lb.attn_norm, (size_t)c->hidden));
        assert_true(lw_same(lw.mlp_norm, lb.mlp_norm, (size_t)c->hidden));
        assert_true(lw_same(lw.q_norm, lb.q_norm, (size_t)c->head_dim));
        assert_true(lw_same(lw.k_norm, lb.k_norm, (size_t)c->head_dim));
        own += 2 * (uint64_t)c->hidden * 4 + (c->qk_norm ? 2 * (uint64_t)c->head_dim * 4 : 0);
        assert_true(lb.host_bytes == own);
        bk_layer_weights_free(&lw);
        bk_layer_weights_bf16_free(&lb);
        assert_null(lb.w[0]);
        for (int t = 0; t < LW_THREADS; t++)
            bk_layer_weights_bf16_free(&jobs[t].out[l]);
    }
    for (int t = 0; t < LW_THREADS; t++)
        free(jobs[t].out);
    printf("  %s: %lld of %lld matrices copied (mapped BF16: %d)\n", label, (long long)copied,
           (long long)total, mapped);
    assert_int_equal(mapped, copied == 0);
    assert_true(mapped || copied == total || bk_model_is_quantized(m));
    bk_model_close(m);
}

static void test_layer_weights_bf16(void **state)
{
    (void)state;
    const char *const models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-bf16",
                                  "kerneldocs-1.6m"};
    tu_each_model(models, sizeof models / sizeof models[0], layer_weights_bf16_model);
}

/* The layer driver's BF16 read for the GPU stages (branch bf16up):
 * bk__layer_weights_load_mapped_bf16 leaves a mapped-BF16 checkpoint's
 * matrices in the mapping (wb[i] == the mapped tensor, w[i] NULL), biases and
 * norms the F32 load's; widened, it is the F32 load bit for bit; any other
 * checkpoint gets the F32 load itself. The read-ahead (src/prefetch.c) hands
 * over the form it was started with; a take of another layer drops the read
 * in flight (freed) and reads the asked form now; drop frees a read. */
static void lw_same_f32(const bk_model_config *c, const bk_layer_weights *a,
                        const bk_layer_weights *b)
{
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        assert_non_null(a->w[i]);
        assert_non_null(b->w[i]);
        assert_null(a->wb[i]);
        assert_null(b->wb[i]);
        assert_memory_equal(a->w[i], b->w[i], (size_t)(o * in) * sizeof(float));
        assert_true(lw_same(a->b[i], b->b[i], (size_t)o));
    }
    assert_true(lw_same(a->attn_norm, b->attn_norm, (size_t)c->hidden));
    assert_true(lw_same(a->mlp_norm, b->mlp_norm, (size_t)c->hidden));
    assert_true(lw_same(a->q_norm, b->q_norm, (size_t)c->head_dim));
    assert_true(lw_same(a->k_norm, b->k_norm, (size_t)c->head_dim));
}

/* lb: the BF16 read of layer l (mapped form when the model is mapped BF16) */
static void check_bf16_read(const bk_model *m, int l, bk_layer_weights *lb)
{
    const bk_model_config *c = bk_model_get_config(m);
    const int mapped = bk_model_linears_mapped_bf16(m);
    bk_layer_weights lw;
    assert_int_equal(bk_layer_weights_load(m, l, &lw), BK_OK);
    assert_int_equal(lb->layer, l);
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        if (mapped) {
            assert_null(lb->w[i]);
            assert_ptr_equal(lb->wb[i], bk_model_linear_bf16_mapped(m, l, (bk_module)i));
        } else {
            assert_null(lb->wb[i]);
        }
    }
    assert_int_equal(bk__layer_weights_widen(c, lb), BK_OK);
    lw_same_f32(c, &lw, lb);
    bk_layer_weights_free(&lw);
}

static void prefetch_bf16_model(const char *label, const char *dir)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    printf("  %s: mapped BF16: %d\n", label, bk_model_linears_mapped_bf16(m));
    for (int l = 0; l < L; l++) {
        bk_layer_weights lb;
        assert_int_equal(bk__layer_weights_load_mapped_bf16(m, l, &lb), BK_OK);
        check_bf16_read(m, l, &lb);
        bk_layer_weights_free(&lb);
        for (int i = 0; i < BK_MOD_COUNT; i++)
            assert_true(lb.w[i] == NULL && lb.wb[i] == NULL && lb.b[i] == NULL);
    }
    bk_prefetch pf;
    memset(&pf, 0, sizeof pf);
    bk_layer_weights w;
    /* started as BF16, taken with bf16 0: handed over as read */
    bk_prefetch_start(&pf, m, 0, 1);
    assert_int_equal(bk_prefetch_take(&pf, m, 0, 0, &w), BK_OK);
    assert_int_equal(pf.running, 0);
    check_bf16_read(m, 0, &w);
    bk_layer_weights_free(&w);
    if (L > 1) {
        /* a take of another layer: the read of layer 0 is dropped, layer 1
         * read now in the asked form */
        bk_prefetch_start(&pf, m, 0, 1);
        assert_int_equal(bk_prefetch_take(&pf, m, 1, 1, &w), BK_OK);
        assert_int_equal(pf.running, 0);
        check_bf16_read(m, 1, &w);
        bk_layer_weights_free(&w);
    }
    /* F32 read ahead, taken: the F32 load */
    bk_prefetch_start(&pf, m, L - 1, 0);
    assert_int_equal(bk_prefetch_take(&pf, m, L - 1, 1, &w), BK_OK);
    {
        bk_layer_weights lw;
        assert_int_equal(bk_layer_weights_load(m, L - 1, &lw), BK_OK);
        lw_same_f32(c, &lw, &w);
        bk_layer_weights_free(&lw);
    }
    bk_layer_weights_free(&w);
    /* out of range: nothing started; a read in flight dropped */
    bk_prefetch_start(&pf, m, L, 1);
    assert_int_equal(pf.running, 0);
    bk_prefetch_start(&pf, m, 0, 1);
    bk_prefetch_drop(&pf);
    assert_int_equal(pf.running, 0);
    for (int i = 0; i < BK_MOD_COUNT; i++)
        assert_true(pf.w.w[i] == NULL && pf.w.wb[i] == NULL && pf.w.b[i] == NULL);
    bk_model_close(m);
}

static void test_prefetch_bf16(void **state)
{
    (void)state;
    const char *const models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-bf16",
                                  "kerneldocs-1.6m"};
    tu_each_model(models, sizeof models / sizeof models[0], prefetch_bf16_model);
}

/* NLL from the native forward == NLL computed here from transformers' logits. */
static double nll_from_logits(const float *lg, const int32_t *ids, int64_t B, int64_t T,
                              int64_t V, int64_t *count)
{
    double sum = 0;
    *count = 0;
    for (int64_t s = 0; s < B; s++)
        for (int64_t t = 0; t + 1 < T; t++) {
            const float *row = lg + (s * T + t) * V;
            double mx = -INFINITY, se = 0;
            for (int64_t j = 0; j < V; j++)
                mx = fmax(mx, row[j]);
            for (int64_t j = 0; j < V; j++)
                se += exp(row[j] - mx);
            sum += log(se) + mx - row[ids[s * T + t + 1]];
            (*count)++;
        }
    return sum;
}

static void check_nll_against_golden(const char *dir, const char *gp)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    golden gd;
    golden_open(gp, &gd);
    const bk_tensor_info *t = bk_st_find(gd.g, "logits");
    assert_non_null(t);
    float *lg = malloc((size_t)t->numel * sizeof(float));
    assert_int_equal(bk_tensor_to_f32(t, lg), BK_OK);
    int64_t cnt_ref;
    double ref = nll_from_logits(lg, gd.ids, gd.B, gd.T, c->vocab, &cnt_ref);
    double sum = 0;
    int64_t cnt = 0;
    assert_int_equal(bk_model_nll(m, gd.ids, gd.B, gd.T, 0, &sum, &cnt), BK_OK);
    assert_int_equal(cnt, cnt_ref);
    printf("  NLL: native %.6f, from transformers' logits %.6f (per token)\n", sum / cnt,
           ref / cnt_ref);
    assert_true(fabs(sum - ref) <= 1e-5 * fabs(ref));
    /* the whole-model logits agree with the golden ones too */
    float *mine = malloc((size_t)t->numel * sizeof(float));
    assert_int_equal(bk_model_logits(m, gd.ids, gd.B, gd.T, mine), BK_OK);
    assert_true(tu_rel_err_f(mine, lg, (size_t)t->numel) <= 1e-4);
    free(mine);
    free(lg);
    golden_close(&gd);
    bk_model_close(m);
}

static void test_nll_golden(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    check_nll_against_golden(dir, gp);
    const char *data = tu_env_or("BK_TEST_DATA", "tests/data");
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen2", data);
    snprintf(gp, sizeof gp, "%s/models/tiny-qwen2/golden.safetensors", data);
    check_nll_against_golden(dir, gp);
}

/* Tokens [S, T] from the example's eval file. */
static int32_t *eval_tokens(int64_t S, int64_t T)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/examples/kerneldocs-1.6m/eval.safetensors",
             tu_env_or("BK_SOURCE_ROOT", "."));
    bk_st_file *f = NULL;
    if (bk_st_open(p, &f) != BK_OK)
        fail_msg("%s: %s", p, bk_last_error());
    const bk_tensor_info *t = bk_st_find(f, "input_ids");
    assert_non_null(t);
    assert_int_equal(t->dtype, BK_DT_I32);
    assert_true(t->shape[0] >= S && t->shape[1] >= T);
    int32_t *ids = malloc((size_t)(S * T) * sizeof(int32_t));
    for (int64_t s = 0; s < S; s++)
        memcpy(ids + s * T, (const int32_t *)t->data + s * t->shape[1],
               (size_t)T * sizeof(int32_t));
    bk_st_close(f);
    return ids;
}

static void test_model_nll_microbatch(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    bk_model *m = open_model(dir);
    const int64_t S = 5, T = 64;
    int32_t *ids = eval_tokens(S, T);
    double s0 = 0, s1 = 0, s2 = 0;
    int64_t c0 = 0, c1 = 0, c2 = 0;
    assert_int_equal(bk_model_nll(m, ids, S, T, 0, &s0, &c0), BK_OK);
    assert_int_equal(bk_model_nll(m, ids, S, T, 1, &s1, &c1), BK_OK);
    assert_int_equal(bk_model_nll(m, ids, S, T, 2, &s2, &c2), BK_OK);
    assert_int_equal(c0, S * (T - 1));
    assert_int_equal(c1, c0);
    assert_int_equal(c2, c0);
    printf("  NLL sums: batch auto %.9f, 1 %.9f, 2 %.9f\n", s0, s1, s2);
    assert_true(fabs(s1 - s0) <= 1e-6 * fabs(s0));
    assert_true(fabs(s2 - s0) <= 1e-6 * fabs(s0));
    /* accumulates into the caller's totals */
    assert_int_equal(bk_model_nll(m, ids, S, T, 0, &s0, &c0), BK_OK);
    assert_int_equal(c0, 2 * S * (T - 1));
    free(ids);
    bk_model_close(m);
}

static void test_model_bad_tokens(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    bk_model *m = open_model(dir);
    int32_t ids[2 * 8];
    for (int i = 0; i < 16; i++)
        ids[i] = 65 + i;
    double s = 0;
    int64_t c = 0;
    ids[8 + 3] = 256;
    assert_int_equal(bk_model_nll(m, ids, 2, 8, 0, &s, &c), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "sequence 1 position 3"));
    ids[8 + 3] = -1;
    assert_int_equal(bk_model_nll(m, ids, 2, 8, 0, &s, &c), BK_ERR_CALIB);
    ids[8 + 3] = 7;
    assert_int_equal(bk_model_nll(m, ids, 2, 1, 0, &s, &c), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "too short"));
    int32_t *big = calloc(1025, sizeof(int32_t));
    assert_int_equal(bk_model_nll(m, big, 1, 1025, 0, &s, &c), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "max_position_embeddings"));
    free(big);
    assert_true(s == 0 && c == 0);
    /* embed checks too */
    bk_fwd *f = NULL;
    assert_int_equal(bk_fwd_create(bk_model_get_config(m), 2, 8, &f), BK_OK);
    float *h = malloc(16 * 192 * sizeof(float));
    ids[5] = 300;
    assert_int_equal(bk_fwd_embed(f, m, ids, 2, h), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "sequence 0 position 5"));
    free(h);
    bk_fwd_free(f);
    bk_model_close(m);
}

/* ================================================================ CLI */

/* Runs a command line; returns the exit status, stdout and stderr (malloc'd). */
static int run_cmd(const char *cmd, char **out, char **err)
{
    char of[] = "/tmp/bk-fwd-out-XXXXXX", ef[] = "/tmp/bk-fwd-err-XXXXXX";
    int fo = mkstemp(of), fe = mkstemp(ef);
    assert_true(fo >= 0 && fe >= 0);
    close(fo), close(fe);
    char full[4096];
    snprintf(full, sizeof full, "%s >%s 2>%s", cmd, of, ef);
    int rc = system(full);
    size_t n;
    if (bk_read_file(of, 1 << 20, out, &n) != BK_OK)
        *out = NULL;
    if (bk_read_file(ef, 1 << 20, err, &n) != BK_OK)
        *err = NULL;
    unlink(of), unlink(ef);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

static void write_ids(const char *path, bk_dtype dt, int ndim, const int64_t *shape,
                      int64_t bad_at, int64_t bad_value)
{
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= (uint64_t)shape[i];
    size_t es = bk_dtype_bits(dt) / 8;
    unsigned char *buf = calloc(n ? n : 1, es);
    for (uint64_t i = 0; i < n; i++) {
        int64_t v = (int64_t)(i == 0 ? 1 : 32 + i % 90);
        if ((int64_t)i == bad_at)
            v = bad_value;
        if (dt == BK_DT_I32) {
            int32_t x = (int32_t)v;
            memcpy(buf + i * 4, &x, 4);
        } else if (dt == BK_DT_I64) {
            memcpy(buf + i * 8, &v, 8);
        } else {
            float x = (float)v;
            memcpy(buf + i * 4, &x, 4);
        }
    }
    bk_st_writer *w = NULL;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    assert_int_equal(bk_st_writer_add(w, "input_ids", dt, ndim, shape, buf, 1), BK_OK);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    bk_st_writer_free(w);
    free(buf);
}

/* `bakron eval` rejects bad token files with exit 2 and one line naming the
 * file (and the sequence/position where it applies). */
static void test_cli_eval_bad_input(void **state)
{
    (void)state;
    const char *exe = getenv("BK_BAKRON");
    if (!exe)
        skip();
    char model[1024], gp[1024];
    tu_kerneldocs_paths(model, sizeof model, gp, sizeof gp);
    char tmpd[] = "/tmp/bk-fwd-eval-XXXXXX";
    assert_non_null(mkdtemp(tmpd));
    char p[1200], cmd[4096];
    char *out = NULL, *err = NULL;
    struct {
        const char *name;
        bk_dtype dt;
        int ndim;
        int64_t shape[2];
        int64_t bad_at, bad_value;
        const char *expect; /* substring of the error line */
    } cases[] = {
        {"vocab.safetensors", BK_DT_I32, 2, {2, 16}, 16 + 5, 256, "[1][5]"},
        {"neg64.safetensors", BK_DT_I64, 2, {2, 16}, 3, -4, "[0][3]"},
        {"huge64.safetensors", BK_DT_I64, 2, {2, 16}, 7, (int64_t)1 << 40, "[0][7]"},
        {"long.safetensors", BK_DT_I32, 2, {1, 1025}, -1, 0, "max_position_embeddings"},
        {"short.safetensors", BK_DT_I32, 2, {3, 1}, -1, 0, "short.safetensors"},
        {"float.safetensors", BK_DT_F32, 2, {2, 16}, -1, 0, "F32"},
        {"rank1.safetensors", BK_DT_I32, 1, {16, 0}, -1, 0, "rank"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        path2(p, sizeof p, tmpd, cases[i].name);
        write_ids(p, cases[i].dt, cases[i].ndim, cases[i].shape, cases[i].bad_at,
                  cases[i].bad_value);
        snprintf(cmd, sizeof cmd, "'%s' eval '%s' --tokens '%s'", exe, model, p);
        int rc = run_cmd(cmd, &out, &err);
        printf("  %-20s exit %d: %s", cases[i].name, rc, err ? err : "(no stderr)\n");
        assert_int_equal(rc, 2);
        assert_non_null(err);
        assert_int_equal(count_lines(err), 1);
        assert_non_null(strstr(err, cases[i].name));
        assert_non_null(strstr(err, cases[i].expect));
        free(out), free(err);
        unlink(p);
    }
    /* --samples beyond the file */
    path2(p, sizeof p, tmpd, "ok.safetensors");
    int64_t shp[2] = {2, 16};
    write_ids(p, BK_DT_I32, 2, shp, -1, 0);
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' --tokens '%s' --samples 3", exe, model, p);
    assert_int_equal(run_cmd(cmd, &out, &err), 2);
    assert_int_equal(count_lines(err), 1);
    free(out), free(err);
    /* usage errors: exit 1 */
    snprintf(cmd, sizeof cmd, "'%s' eval '%s'", exe, model);
    assert_int_equal(run_cmd(cmd, &out, &err), 1);
    free(out), free(err);
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' --tokens '%s' --batch -2", exe, model, p);
    assert_int_equal(run_cmd(cmd, &out, &err), 1);
    free(out), free(err);
    /* a missing model folder: exit 2 */
    snprintf(cmd, sizeof cmd, "'%s' eval '%s/nope' --tokens '%s'", exe, tmpd, p);
    assert_int_equal(run_cmd(cmd, &out, &err), 2);
    assert_int_equal(count_lines(err), 1);
    free(out), free(err);
    /* a good run on the small file, JSON */
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' --tokens '%s' --json --batch 1", exe, model, p);
    assert_int_equal(run_cmd(cmd, &out, &err), 0);
    cJSON *j = cJSON_Parse(out);
    assert_non_null(j);
    assert_int_equal((int)cJSON_GetObjectItem(j, "tokens")->valuedouble, 2 * 15);
    assert_true(cJSON_GetObjectItem(j, "perplexity")->valuedouble > 1.0);
    cJSON_Delete(j);
    free(out), free(err);
    unlink(p);
    rmdir(tmpd);
}

/* The perplexity transformers measured on the example's eval tokens:
 * 3.035 (NLL 1.1102 nats/byte), examples/kerneldocs-1.6m/README.md. */
static void test_cli_eval_ppl(void **state)
{
    (void)state;
    const char *exe = getenv("BK_BAKRON");
    if (!exe)
        skip();
    const char *root = tu_env_or("BK_SOURCE_ROOT", ".");
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "'%s' eval '%s/examples/kerneldocs-1.6m' --tokens "
             "'%s/examples/kerneldocs-1.6m/eval.safetensors' --json",
             exe, root, root);
    char *out = NULL, *err = NULL;
    int rc = run_cmd(cmd, &out, &err);
    if (rc != 0)
        fail_msg("eval failed (%d): %s", rc, err ? err : "");
    cJSON *j = cJSON_Parse(out);
    assert_non_null(j);
    double ppl = cJSON_GetObjectItem(j, "perplexity")->valuedouble;
    double nll = cJSON_GetObjectItem(j, "nll")->valuedouble;
    double tok = cJSON_GetObjectItem(j, "tokens")->valuedouble;
    printf("  eval: perplexity %.5f, NLL %.6f over %.0f tokens (transformers: 3.035, 1.1102)\n",
           ppl, nll, tok);
    assert_true(tok == 64.0 * 255.0);
    assert_true(fabs(ppl - 3.035) < 5e-4);
    assert_true(fabs(nll - 1.1102) < 5e-5);
    cJSON_Delete(j);
    free(out), free(err);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--slow")) {
        const struct CMUnitTest slow[] = {
            cmocka_unit_test(test_cli_eval_ppl),
        };
        return cmocka_run_group_tests_name("forward_slow", slow, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm_hand),
        cmocka_unit_test(test_sliding_window_refused),
        cmocka_unit_test(test_rope_hand),
        cmocka_unit_test(test_rope_llama3),
        cmocka_unit_test(test_attention_bruteforce),
        cmocka_unit_test(test_mlp_bruteforce),
        cmocka_unit_test(test_layer_equals_stages),
        cmocka_unit_test(test_layer_microbatch),
        cmocka_unit_test(test_create_rejects),
        cmocka_unit_test(test_golden_tiny_llama3),
        cmocka_unit_test(test_golden_tiny_qwen2),
        cmocka_unit_test(test_golden_tiny_qwen3),
        cmocka_unit_test(test_qk_rot),
        cmocka_unit_test(test_layer_weights_threads),
        cmocka_unit_test(test_layer_weights_bf16),
        cmocka_unit_test(test_prefetch_bf16),
        cmocka_unit_test(test_golden_kerneldocs),
        cmocka_unit_test(test_golden_tiny_qwen3_bf16),
        cmocka_unit_test(test_nll_golden),
        cmocka_unit_test(test_model_nll_microbatch),
        cmocka_unit_test(test_model_bad_tokens),
        cmocka_unit_test(test_cli_eval_bad_input),
    };
    return cmocka_run_group_tests_name("forward", tests, NULL, NULL);
}
