/* GPU forward pass (cuda/forward.cu) against the CPU forward pass, the
 * oracle (src/forward.c, itself tested against transformers' golden outputs
 * in test_forward.c). Suite cuda; exit 77 = skipped without a GPU.
 *
 *  - every stage of every layer of the golden models (tests/data/models/NAME,
 *    the kerneldocs example with its golden input): each stage gets the
 *    CPU's input, so errors do not compound, and its outputs (including the
 *    optional ones: rotated queries/keys, values, gate/up projections) are
 *    compared with the CPU's within 1e-4 relative (max |gpu - cpu| /
 *    max |cpu|, F32);
 *  - the whole model: logits of the golden inputs, and the negative
 *    log-likelihood of the kerneldocs evaluation sequences in micro-batches;
 *  - attention at 4096 tokens (one kv group of 8 query heads: the score
 *    buffer is split by rows) and several (sequence, group) pairs per chunk;
 *  - the fused attention of BF16 mode (head_dim 64 / 128) against the CPU,
 *    the unfused path and exact causality, and where it is used; in fused
 *    mode the unfused path's buffers are allocated by its first call only;
 *  - the rotated queries and keys alone (bk_gfwd_qk_rot, the fully-local
 *    stage QKV) are bitwise those of the full attention: test models in
 *    fp32 / TF32 / BF16 GEMM modes, fused and unfused BF16 attention;
 *  - bad inputs give the CPU's statuses;
 *  - weight uploads (bk_gpu_upload_f32: BF16 chunks widened on the device,
 *    others as F32) leave byte-identical device copies.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/bakron.h"
#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"
#include "bk_config.h"
#include "forward_internal.h"
#include "pipeline_gpu.h"
#include "test_cm_util.h"
#include "util.h"

#if !BK_HAVE_CUDA
int main(void)
{
    fprintf(stderr, "no CUDA backend in this build: skipped\n");
    return 77;
}
#else

#define TOL 1e-4

static bk_backend *g_gpu;

/* Relative error of device d against host ref (n floats). */
static double dcmp(bk_gfwd *f, const float *d, const float *ref, int64_t n)
{
    float *h = tu_hbuf(n);
    if (bk_gpu_download(f, h, d, (size_t)n * sizeof(float)) != BK_OK)
        fail_msg("download: %s", bk_last_error());
    double e = tu_rel_err_f(h, ref, (size_t)n);
    free(h);
    return e;
}

typedef struct worst {
    double e;
    char what[128];
} worst;

static void note(worst *w, double e, const char *fmt, int layer)
{
    if (!(e <= w->e)) {
        w->e = isnan(e) ? INFINITY : e;
        snprintf(w->what, sizeof w->what, fmt, layer);
    }
}

static bk_model *open_model(const char *dir)
{
    bk_model *m = NULL;
    if (bk_model_open(dir, &m) != BK_OK)
        fail_msg("%s: %s", dir, bk_last_error());
    return m;
}

static int32_t *golden_ids(const char *path, int64_t *B, int64_t *T)
{
    bk_st_file *g = NULL;
    if (bk_st_open(path, &g) != BK_OK)
        fail_msg("%s: %s", path, bk_last_error());
    const bk_tensor_info *t = bk_st_find(g, "input_ids");
    assert_non_null(t);
    assert_int_equal(t->dtype, BK_DT_I32);
    *B = t->shape[0];
    *T = t->shape[1];
    int32_t *ids = malloc((size_t)(*B * *T) * sizeof(int32_t));
    assert_non_null(ids);
    memcpy(ids, t->data, (size_t)(*B * *T) * sizeof(int32_t));
    bk_st_close(g);
    return ids;
}

/* Stage-by-stage and whole-model parity on one model and input. */
static void stages_model(const char *label, const char *dir, const char *golden_path)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    int64_t B, T;
    int32_t *ids = golden_ids(golden_path, &B, &T);
    const int64_t N = B * T, H = c->hidden, I = c->intermediate, V = c->vocab;
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    bk_fwd *f = NULL;
    bk_gfwd *gf = NULL;
    OKS(bk_fwd_create(c, B, T, &f));
    OKS(bk_gfwd_create(g_gpu, c, B, T, &gf));
    worst w = {0, ""};
    /* host: CPU values */
    float *h = tu_hbuf(N * H), *h1 = tu_hbuf(N * H), *x = tu_hbuf(N * H), *o = tu_hbuf(N * qd);
    float *qr = tu_hbuf(N * qd), *kr = tu_hbuf(N * kd), *v = tu_hbuf(N * kd), *x2 = tu_hbuf(N * H);
    float *dn = tu_hbuf(N * I), *gp = tu_hbuf(N * I), *upp = tu_hbuf(N * I), *h2 = tu_hbuf(N * H);
    float *lg = tu_hbuf(N * V), *lg2 = tu_hbuf(N * V);
    /* device */
    float *dh = tu_dbuf(gf, N * H), *dx = tu_dbuf(gf, N * H), *dor = tu_dbuf(gf, N * qd);
    float *dqr = tu_dbuf(gf, N * qd), *dkr = tu_dbuf(gf, N * kd), *dv = tu_dbuf(gf, N * kd);
    float *ddn = tu_dbuf(gf, N * I), *dgp = tu_dbuf(gf, N * I), *dup = tu_dbuf(gf, N * I);
    float *dmi = tu_dbuf(gf, N * H);

    OKS(bk_fwd_embed(f, m, ids, B, h));
    OKS(bk_gfwd_embed(gf, m, ids, B, dh));
    note(&w, dcmp(gf, dh, h, N * H), "embed", 0);
    bk_gfwd_embed_release(gf);
    for (int L = 0; L < c->n_layers; L++) {
        bk_layer_weights lw;
        OKS(bk_layer_weights_load(m, L, &lw));
        bk_glayer *gl = NULL;
        OKS(bk_glayer_upload(gf, &lw, &gl));
        assert_int_equal(bk_glayer_index(gl), L);
        /* attn_in */
        OKS(bk_fwd_attn_in(f, &lw, h, B, x));
        tu_up(gf, dh, h, N * H);
        OKS(bk_gfwd_attn_in(gf, gl, dh, B, dx));
        note(&w, dcmp(gf, dx, x, N * H), "layer %d attn_in", L);
        /* attention (all outputs) from the CPU's x */
        OKS(bk_fwd_attention(f, &lw, x, B, o, qr, kr, v));
        tu_up(gf, dx, x, N * H);
        OKS(bk_gfwd_attention(gf, gl, dx, B, dor, dqr, dkr, dv));
        note(&w, dcmp(gf, dor, o, N * qd), "layer %d attention output", L);
        note(&w, dcmp(gf, dqr, qr, N * qd), "layer %d q_rot", L);
        note(&w, dcmp(gf, dkr, kr, N * kd), "layer %d k_rot", L);
        note(&w, dcmp(gf, dv, v, N * kd), "layer %d v", L);
        /* attn_out from the CPU's o and h */
        memcpy(h1, h, (size_t)(N * H) * sizeof(float));
        OKS(bk_fwd_attn_out(f, &lw, o, B, h1));
        tu_up(gf, dor, o, N * qd);
        OKS(bk_gfwd_attn_out(gf, gl, dor, B, dh));
        note(&w, dcmp(gf, dh, h1, N * H), "layer %d attn_out", L);
        /* mlp_in */
        OKS(bk_fwd_mlp_in(f, &lw, h1, B, x2));
        tu_up(gf, dh, h1, N * H);
        OKS(bk_gfwd_mlp_in(gf, gl, dh, B, dx));
        note(&w, dcmp(gf, dx, x2, N * H), "layer %d mlp_in", L);
        /* mlp_hidden with the pre-activation outputs */
        OKS(bk_fwd_mlp_hidden(f, &lw, x2, B, dn, gp, upp));
        tu_up(gf, dx, x2, N * H);
        OKS(bk_gfwd_mlp_hidden(gf, gl, dx, B, ddn, dgp, dup));
        note(&w, dcmp(gf, ddn, dn, N * I), "layer %d down_in", L);
        note(&w, dcmp(gf, dgp, gp, N * I), "layer %d gate_pre", L);
        note(&w, dcmp(gf, dup, upp, N * I), "layer %d up_pre", L);
        /* mlp_out */
        memcpy(h2, h1, (size_t)(N * H) * sizeof(float));
        OKS(bk_fwd_mlp_out(f, &lw, dn, B, h2));
        tu_up(gf, dh, h1, N * H);
        tu_up(gf, ddn, dn, N * I);
        OKS(bk_gfwd_mlp_out(gf, gl, ddn, B, dh));
        note(&w, dcmp(gf, dh, h2, N * H), "layer %d mlp_out", L);
        /* the whole layer with taps, from the CPU's layer input */
        tu_up(gf, dh, h, N * H);
        bk_layer_taps ct = {x, o, x2, dn, qr, kr};
        bk_layer_taps gt = {dx, dor, dmi, ddn, dqr, dkr};
        OKS(bk_fwd_layer(f, &lw, B, h, &ct));
        OKS(bk_gfwd_layer(gf, gl, B, dh, &gt));
        note(&w, dcmp(gf, dh, h, N * H), "layer %d output", L);
        note(&w, dcmp(gf, dx, x, N * H), "layer %d tap attn_in", L);
        note(&w, dcmp(gf, dor, o, N * qd), "layer %d tap o_in", L);
        note(&w, dcmp(gf, dmi, x2, N * H), "layer %d tap mlp_in", L);
        note(&w, dcmp(gf, ddn, dn, N * I), "layer %d tap down_in", L);
        note(&w, dcmp(gf, dqr, qr, N * qd), "layer %d tap q_rot", L);
        note(&w, dcmp(gf, dkr, kr, N * kd), "layer %d tap k_rot", L);
        bk_glayer_free(gf, gl);
        bk_layer_weights_free(&lw);
    }
    /* the head from the CPU's final hidden states */
    OKS(bk_fwd_logits(f, m, h, B, lg));
    tu_up(gf, dh, h, N * H);
    OKS(bk_gfwd_logits(gf, m, dh, B, lg2));
    note(&w, tu_rel_err_f(lg2, lg, (size_t)(N * V)), "logits (head)", 0);
    /* NLL of the micro-batch from the same states */
    double n1 = 0, n2 = 0;
    int64_t c1 = 0, c2 = 0;
    OKS(bk_fwd_nll(f, m, h, ids, B, &n1, &c1));
    OKS(bk_gfwd_nll(gf, m, dh, ids, B, &n2, &c2));
    assert_int_equal(c1, c2);
    note(&w, fabs(n2 - n1) / fabs(n1), "nll (head)", 0);
    /* the whole model, layer-streamed on each side */
    OKS(bk_model_logits(m, ids, B, T, lg));
    OKS(bk_backend_model_logits(g_gpu, m, ids, B, T, lg2));
    note(&w, tu_rel_err_f(lg2, lg, (size_t)(N * V)), "logits (whole model)", 0);
    printf("  %-16s %lld x %lld tokens, %lld layers: worst relative error %.3e (%s)\n", label,
           (long long)B, (long long)T, (long long)c->n_layers, w.e, w.what);

    float *dd[] = {dh, dx, dor, dqr, dkr, dv, ddn, dgp, dup, dmi};
    for (size_t i = 0; i < sizeof dd / sizeof dd[0]; i++)
        bk_gpu_free(gf, dd[i]);
    float *hh[] = {h, h1, x, o, qr, kr, v, x2, dn, gp, upp, h2, lg, lg2};
    for (size_t i = 0; i < sizeof hh / sizeof hh[0]; i++)
        free(hh[i]);
    free(ids);
    bk_gfwd_free(gf);
    bk_fwd_free(f);
    bk_model_close(m);
    assert_true(w.e <= TOL);
}

static void golden_model(const char *model)
{
    char dir[1024], gp[1100];
    snprintf(dir, sizeof dir, "%s/models/%s", tu_env_or("BK_TEST_DATA", "tests/data"), model);
    snprintf(gp, sizeof gp, "%s/golden.safetensors", dir);
    stages_model(model, dir, gp);
}

static void test_tiny_llama3(void **state)
{
    (void)state;
    golden_model("tiny-llama3");
}

static void test_tiny_qwen2(void **state)
{
    (void)state;
    golden_model("tiny-qwen2");
}

static void test_tiny_qwen3(void **state)
{
    (void)state;
    golden_model("tiny-qwen3");
}

static void test_kerneldocs(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    stages_model("kerneldocs-1.6m", dir, gp);
}

/* Perplexity inputs: the kerneldocs evaluation sequences, micro-batches of 3. */
static void test_nll_kerneldocs(void **state)
{
    (void)state;
    char dir[1024], tp[1100];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", tu_env_or("BK_SOURCE_ROOT", "."));
    snprintf(tp, sizeof tp, "%s/eval.safetensors", dir);
    bk_model *m = open_model(dir);
    int32_t *ids = NULL;
    int64_t S = 0, T = 0;
    OKS(bk_load_tokens(tp, bk_model_get_config(m)->vocab, 8, 0, &ids, &S, &T));
    double a = 0, b = 0;
    int64_t ca = 0, cb = 0;
    OKS(bk_model_nll(m, ids, S, T, 3, &a, &ca));
    OKS(bk_backend_model_nll(g_gpu, m, ids, S, T, 3, &b, &cb));
    assert_int_equal(ca, cb);
    printf("  kerneldocs nll: cpu %.9g gpu %.9g (%lld tokens), ppl %.6f vs %.6f\n", a, b,
           (long long)ca, exp(a / (double)ca), exp(b / (double)cb));
    assert_true(fabs(a - b) <= TOL * fabs(a));
    free(ids);
    bk_model_close(m);
}

/* ------------------------------------------------- synthetic attention */

static bk_model_config syn_cfg(int64_t heads, int64_t kv, int64_t hd, int64_t T)
{
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = BK_ARCH_LLAMA;
    strcpy(c.model_type, "llama");
    c.n_layers = 1;
    c.hidden = 32;
    c.intermediate = 48;
    c.n_heads = heads;
    c.n_kv_heads = kv;
    c.head_dim = hd;
    c.vocab = 17;
    c.max_positions = T;
    c.rms_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.rope_type = BK_ROPE_LLAMA3;
    c.rope_factor = 8.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.rope_original_max_positions = 1024;
    strcpy(c.hidden_act, "silu");
    c.bos_token_id = c.eos_token_id = -1;
    return c;
}

static float *randn(bk_rng *r, int64_t n, double scale, double offset)
{
    float *p = tu_hbuf(n);
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)(offset + scale * bk_rng_normal(r));
    return p;
}

static void random_layer(const bk_model_config *c, uint64_t seed, bk_layer_weights *lw)
{
    bk_rng r;
    bk_rng_seed(&r, seed);
    memset(lw, 0, sizeof *lw);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)m, &o, &in);
        lw->w[m] = randn(&r, o * in, 1.0 / sqrt((double)in), 0.0);
    }
    lw->attn_norm = randn(&r, c->hidden, 0.1, 1.0);
    lw->mlp_norm = randn(&r, c->hidden, 0.1, 1.0);
}

static void attention_case(int64_t heads, int64_t kv, int64_t hd, int64_t S, int64_t T)
{
    bk_model_config c = syn_cfg(heads, kv, hd, T);
    bk_layer_weights lw;
    random_layer(&c, 77 + (uint64_t)T, &lw);
    const int64_t N = S * T, qd = heads * hd;
    bk_rng r;
    bk_rng_seed(&r, 5);
    float *x = randn(&r, N * c.hidden, 1.0, 0.0), *o = tu_hbuf(N * qd);
    bk_fwd *f = NULL;
    bk_gfwd *gf = NULL;
    OKS(bk_fwd_create(&c, S, T, &f));
    OKS(bk_gfwd_create(g_gpu, &c, S, T, &gf));
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &lw, &gl));
    float *dx = tu_dbuf(gf, N * c.hidden), *dor = tu_dbuf(gf, N * qd);
    OKS(bk_fwd_attention(f, &lw, x, S, o, NULL, NULL, NULL));
    tu_up(gf, dx, x, N * c.hidden);
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, NULL, NULL, NULL));
    double e = dcmp(gf, dor, o, N * qd);
    printf("  attention %lld heads / %lld kv, head_dim %lld, %lld x %lld tokens: %.3e\n",
           (long long)heads, (long long)kv, (long long)hd, (long long)S, (long long)T, e);
    bk_gpu_free(gf, dx);
    bk_gpu_free(gf, dor);
    bk_glayer_free(gf, gl);
    bk_gfwd_free(gf);
    bk_fwd_free(f);
    bk_layer_weights_free(&lw);
    free(x);
    free(o);
    assert_true(e <= TOL);
}

static void test_attention_4096(void **state)
{
    (void)state;
    attention_case(8, 1, 8, 1, 4096); /* 8 x 4096^2 scores: split by rows */
}

static void test_attention_pairs(void **state)
{
    (void)state;
    attention_case(4, 2, 16, 3, 512); /* 6 (sequence, group) pairs per chunk */
}

/* causal chunks of query positions: uneven last chunk (1000 = 7 x 128 + 104),
 * 3 heads per group; and 32 heads per group at 4096, where the last chunks'
 * rows (512 positions x 32 heads x up to 4096 keys) exceed the score buffer
 * and are split by rows */
static void test_attention_chunks(void **state)
{
    (void)state;
    attention_case(6, 2, 16, 2, 1000);
    attention_case(32, 1, 8, 1, 4096);
}

/* ------------------------------------------- fused attention (BF16 mode) */

/* BF16 GEMM mode with head_dim 64 or 128 runs the fused kernel
 * (cuda/attn_flash.cu: Q, K, V and the probabilities in BF16, F32 softmax and
 * accumulation). Checked on the same forward (the same BF16 projections):
 *  - against the CPU (F32), max |gpu - cpu| / max |cpu| <= BF16_ATTN_TOL;
 *  - against the unfused path (TF32 scores, F32 softmax), per (token, head)
 *    row max |fused - unfused| / max |unfused| <= BF16_ATTN_ROW_TOL: a key
 *    wrongly in or out of a row's softmax over n keys moves that row by about
 *    1/sqrt(n) (>= 0.03 up to n = 1000), the BF16 roundings by about 5e-3;
 *  - causality exactly: new inputs at positions >= cut leave the outputs at
 *    positions < cut bit-identical (masked probabilities are exact zeros)
 *    and change the others.
 * Shapes: T not a multiple of the key blocks (32 / 64) or of the 128-row
 * query blocks, T below one block, 1, 3 and 4 query heads per kv group, and
 * Qwen3's q/k norm. */
#define BF16_ATTN_TOL 2e-2
#define BF16_ATTN_ROW_TOL 3e-2

static bk_backend *g_bf16;

/* max over rows of max_c |a - b| / max_c |b| (rows of n) */
static double row_rel_err(const float *a, const float *b, int64_t rows, int64_t n)
{
    double worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        double e = 0, m = 0;
        for (int64_t c = 0; c < n; c++) {
            double d = fabs((double)a[r * n + c] - (double)b[r * n + c]);
            e = d > e || isnan(d) ? d : e;
            m = fabs((double)b[r * n + c]) > m ? fabs((double)b[r * n + c]) : m;
        }
        double q = m > 0 ? e / m : e;
        if (!(q <= worst))
            worst = isnan(q) ? INFINITY : q;
    }
    return worst;
}

static float *dl(bk_gfwd *gf, const float *d, int64_t n)
{
    float *h = tu_hbuf(n);
    OKS(bk_gpu_download(gf, h, d, (size_t)n * sizeof(float)));
    return h;
}

static void fused_case(int64_t heads, int64_t kv, int64_t hd, int64_t S, int64_t T, int64_t cut,
                       int qk_norm)
{
    bk_model_config c = syn_cfg(heads, kv, hd, T);
    bk_layer_weights lw;
    random_layer(&c, 91 + (uint64_t)T, &lw);
    if (qk_norm) { /* Qwen3: q_norm / k_norm before RoPE */
        bk_rng rq;
        bk_rng_seed(&rq, 17);
        c.qk_norm = 1;
        lw.q_norm = randn(&rq, hd, 0.1, 1.0);
        lw.k_norm = randn(&rq, hd, 0.1, 1.0);
    }
    const int64_t N = S * T, qd = heads * hd, H = c.hidden;
    bk_rng r;
    bk_rng_seed(&r, 6);
    float *x = randn(&r, N * H, 1.0, 0.0), *o = tu_hbuf(N * qd);
    bk_fwd *f = NULL;
    bk_gfwd *gf = NULL;
    OKS(bk_fwd_create(&c, S, T, &f));
    OKS(bk_gfwd_create(g_bf16, &c, S, T, &gf));
    assert_int_equal(bk_gfwd_attn_fused(gf), 1);
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &lw, &gl));
    float *dx = tu_dbuf(gf, N * H), *dor = tu_dbuf(gf, N * qd);
    OKS(bk_fwd_attention(f, &lw, x, S, o, NULL, NULL, NULL));
    tu_up(gf, dx, x, N * H);
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, NULL, NULL, NULL));
    float *fu = dl(gf, dor, N * qd);
    /* the unfused path's F32 head-major buffers come with its first call
     * (cuda/forward.cu, bk_g_attn_unfused_alloc): the tracked memory grows by
     * at least their size then, and not on the next call */
    const size_t unfused_bytes = (size_t)(N * (2 * qd + 2 * kv * hd)) * sizeof(float);
    bk_backend_reset_peak_memory(g_bf16);
    const size_t mem0 = bk_backend_peak_memory(g_bf16);
    OKS(bk_gfwd_set_attn_fused(gf, 0));
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, NULL, NULL, NULL));
    const size_t mem1 = bk_backend_peak_memory(g_bf16);
    bk_backend_reset_peak_memory(g_bf16);
    const size_t mem1r = bk_backend_peak_memory(g_bf16);
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, NULL, NULL, NULL));
    const size_t mem2 = bk_backend_peak_memory(g_bf16);
    float *un = dl(gf, dor, N * qd);
    OKS(bk_gfwd_set_attn_fused(gf, 1));
    const double e_cpu = tu_rel_err_f(fu, o, N * qd), e_un = tu_rel_err_f(un, o, N * qd);
    const double e_row = row_rel_err(fu, un, N * heads, hd);
    /* causality: positions >= cut of every sequence get new inputs */
    float *x2 = tu_hbuf(N * H);
    memcpy(x2, x, (size_t)(N * H) * sizeof(float));
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = cut; t < T; t++)
            for (int64_t i = 0; i < H; i++)
                x2[(s * T + t) * H + i] = (float)bk_rng_normal(&r);
    tu_up(gf, dx, x2, N * H);
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, NULL, NULL, NULL));
    float *fu2 = dl(gf, dor, N * qd);
    int64_t before_diff = 0, after_same = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < T; t++) {
            const size_t at = (size_t)((s * T + t) * qd);
            const int same = !memcmp(fu + at, fu2 + at, (size_t)qd * sizeof(float));
            if (t < cut)
                before_diff += !same;
            else
                after_same += same;
        }
    printf("  fused attention %lld heads / %lld kv, head_dim %lld, %lld x %lld tokens%s: vs cpu "
           "%.3e (unfused %.3e), per row vs unfused %.3e; cut %lld: %lld positions before "
           "changed, %lld after unchanged\n",
           (long long)heads, (long long)kv, (long long)hd, (long long)S, (long long)T,
           qk_norm ? " (q/k norm)" : "", e_cpu,
           e_un, e_row, (long long)cut, (long long)before_diff, (long long)after_same);
    bk_gpu_free(gf, dx);
    bk_gpu_free(gf, dor);
    bk_glayer_free(gf, gl);
    bk_gfwd_free(gf);
    bk_fwd_free(f);
    bk_layer_weights_free(&lw);
    free(x);
    free(x2);
    free(o);
    free(fu);
    free(fu2);
    free(un);
    assert_true(e_cpu <= BF16_ATTN_TOL);
    assert_true(e_row <= BF16_ATTN_ROW_TOL);
    if (mem1 < mem0 + unfused_bytes)
        fail_msg("the first unfused call allocated %zu bytes, expected at least %zu (allocated "
                 "before it?)",
                 mem1 - mem0, unfused_bytes);
    assert_int_equal(mem2, mem1r); /* kept: nothing allocated by the second call */
    assert_int_equal(before_diff, 0);
    assert_int_equal(after_same, 0);
}

static void test_attention_fused(void **state)
{
    (void)state;
    fused_case(4, 4, 128, 2, 200, 37, 0);  /* rep 1: 200 rows, keys 6 x 32 + 8 */
    fused_case(8, 2, 128, 2, 300, 64, 0);  /* rep 4: 1200 rows = 9 x 128 + 48; cut at a block */
    fused_case(4, 1, 64, 3, 40, 31, 0);    /* rep 4, T below a key block, 160 rows */
    fused_case(2, 2, 64, 1, 5, 4, 0);      /* T = 5 */
    fused_case(6, 2, 64, 1, 1000, 500, 0); /* rep 3 (warps straddle positions), 16 key blocks */
    fused_case(8, 2, 128, 1, 130, 100, 1); /* Qwen3 q/k norm */
}

/* which forward uses the fused kernel: BF16 mode with head_dim 64 / 128 only */
static void test_attention_fused_where(void **state)
{
    (void)state;
    const int64_t hds[] = {16, 64, 128};
    for (int i = 0; i < 3; i++) {
        bk_model_config c = syn_cfg(4, 2, hds[i], 8);
        bk_gfwd *a = NULL, *b = NULL;
        OKS(bk_gfwd_create(g_gpu, &c, 1, 8, &a));   /* fp32: the oracle path */
        OKS(bk_gfwd_create(g_bf16, &c, 1, 8, &b));
        assert_int_equal(bk_gfwd_attn_fused(a), 0);
        assert_int_equal(bk_gfwd_attn_fused(b), hds[i] != 16);
        assert_int_equal(bk_gfwd_set_attn_fused(a, 1), BK_ERR_INVALID_ARG);
        if (hds[i] == 16)
            assert_int_equal(bk_gfwd_set_attn_fused(b, 1), BK_ERR_INVALID_ARG);
        bk_gfwd_free(a);
        bk_gfwd_free(b);
    }
}

/* ------------------------------------- rotated queries and keys only */

/* bk_gfwd_qk_rot (the fully-local Hessians' stage QKV) gives the same bits as
 * bk_gfwd_attention's d_qrot / d_krot on the same input: every layer of the
 * test models (Llama 3 RoPE scaling; Qwen2 q/k/v biases; Qwen3 q/k norm, F32
 * and BF16 checkpoints; kerneldocs) in fp32, TF32 and BF16 GEMM modes, the
 * layer input from the GPU forward itself; and synthetic layers with head_dim
 * 64 / 128 in BF16 mode, where bk_gfwd_attention runs the fused kernel (its
 * RoPE writes BF16 head copies), with q/k norm and biases. The q/k-only
 * outputs start as NaN (every entry must be written) and are taken before
 * and after a full attention on the same context (no state carried over). */

static bk_backend *g_tf32;

/* Differing entries of a and b (n floats, bitwise), and whether a has a
 * non-finite entry. */
static int64_t bits_differ(const float *a, const float *b, int64_t n, int *nonfinite)
{
    int64_t d = 0;
    *nonfinite = 0;
    for (int64_t i = 0; i < n; i++) {
        d += memcmp(a + i, b + i, sizeof(float)) != 0;
        *nonfinite |= !isfinite(a[i]);
    }
    return d;
}

static void nan_fill(bk_gfwd *gf, float *d, int64_t n)
{
    float *h = tu_hbuf(n);
    for (int64_t i = 0; i < n; i++)
        h[i] = NAN;
    tu_up(gf, d, h, n);
    free(h);
}

/* One layer on input dx: q/k-only, the full attention, q/k-only again; the
 * differing entries are added to *diff. */
static void qk_same(bk_gfwd *gf, const bk_glayer *gl, float *dx, int64_t S, int64_t N,
                    int64_t qd, int64_t kd, int64_t *diff, const char *what)
{
    float *dq = tu_dbuf(gf, N * qd), *dk = tu_dbuf(gf, N * kd), *dor = tu_dbuf(gf, N * qd);
    float *dq2 = tu_dbuf(gf, N * qd), *dk2 = tu_dbuf(gf, N * kd);
    nan_fill(gf, dq2, N * qd);
    nan_fill(gf, dk2, N * kd);
    OKS(bk_gfwd_qk_rot(gf, gl, dx, S, dq2, dk2));
    float *q0 = dl(gf, dq2, N * qd), *k0 = dl(gf, dk2, N * kd);
    OKS(bk_gfwd_attention(gf, gl, dx, S, dor, dq, dk, NULL));
    float *q1 = dl(gf, dq, N * qd), *k1 = dl(gf, dk, N * kd);
    nan_fill(gf, dq2, N * qd);
    nan_fill(gf, dk2, N * kd);
    OKS(bk_gfwd_qk_rot(gf, gl, dx, S, dq2, dk2));
    float *q2 = dl(gf, dq2, N * qd), *k2 = dl(gf, dk2, N * kd);
    int nf[4];
    const int64_t d = bits_differ(q0, q1, N * qd, &nf[0]) + bits_differ(k0, k1, N * kd, &nf[1]) +
                      bits_differ(q2, q1, N * qd, &nf[2]) + bits_differ(k2, k1, N * kd, &nf[3]);
    if (d || nf[0] || nf[1] || nf[2] || nf[3])
        printf("  %s: %lld entries differ from the full attention's%s\n", what, (long long)d,
               nf[0] || nf[1] || nf[2] || nf[3] ? " (non-finite q/k-only outputs)" : "");
    *diff += d + nf[0] + nf[1] + nf[2] + nf[3];
    float *dd[] = {dq, dk, dor, dq2, dk2};
    for (size_t i = 0; i < sizeof dd / sizeof dd[0]; i++)
        bk_gpu_free(gf, dd[i]);
    float *hh[] = {q0, k0, q1, k1, q2, k2};
    for (size_t i = 0; i < sizeof hh / sizeof hh[0]; i++)
        free(hh[i]);
}

static void qk_model(const char *label, const char *dir)
{
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t S = 3, T = 29, N = S * T, H = c->hidden;
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int32_t *ids = tu_random_tokens(41, N, c->vocab);
    bk_backend *const bes[] = {g_gpu, g_tf32, g_bf16};
    const char *const names[] = {"fp32", "tf32", "bf16"};
    int64_t diff = 0;
    for (int b = 0; b < 3; b++) {
        bk_gfwd *gf = NULL;
        OKS(bk_gfwd_create(bes[b], c, S, T, &gf));
        float *dh = tu_dbuf(gf, N * H), *dx = tu_dbuf(gf, N * H);
        OKS(bk_gfwd_embed(gf, m, ids, S, dh));
        bk_gfwd_embed_release(gf);
        for (int L = 0; L < c->n_layers; L++) {
            bk_layer_weights lw;
            OKS(bk_layer_weights_load(m, L, &lw));
            bk_glayer *gl = NULL;
            OKS(bk_glayer_upload(gf, &lw, &gl));
            OKS(bk_gfwd_attn_in(gf, gl, dh, S, dx));
            char what[160];
            snprintf(what, sizeof what, "%s %s layer %d", label, names[b], L);
            qk_same(gf, gl, dx, S, N, qd, kd, &diff, what);
            OKS(bk_gfwd_layer(gf, gl, S, dh, NULL)); /* the next layer's input */
            bk_glayer_free(gf, gl);
            bk_layer_weights_free(&lw);
        }
        bk_gpu_free(gf, dh);
        bk_gpu_free(gf, dx);
        bk_gfwd_free(gf);
    }
    printf("  q/k only vs attention, %s (%lld layers, fp32/tf32/bf16): %lld entries differ\n",
           label, (long long)c->n_layers, (long long)diff);
    free(ids);
    bk_model_close(m);
    assert_int_equal(diff, 0);
}

static void test_qk_rot_models(void **state)
{
    (void)state;
    const char *const models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-bf16",
                                  "kerneldocs-1.6m"};
    tu_each_model(models, sizeof models / sizeof models[0], qk_model);
}

static void qk_fused_case(int64_t heads, int64_t kv, int64_t hd, int64_t S, int64_t T,
                          int qk_norm, int bias)
{
    bk_model_config c = syn_cfg(heads, kv, hd, T);
    bk_layer_weights lw;
    random_layer(&c, 123 + (uint64_t)T, &lw);
    bk_rng r;
    bk_rng_seed(&r, 19);
    if (qk_norm) {
        c.qk_norm = 1;
        lw.q_norm = randn(&r, hd, 0.1, 1.0);
        lw.k_norm = randn(&r, hd, 0.1, 1.0);
    }
    if (bias) {
        lw.b[BK_MOD_Q] = randn(&r, heads * hd, 0.1, 0.0);
        lw.b[BK_MOD_K] = randn(&r, kv * hd, 0.1, 0.0);
        lw.b[BK_MOD_V] = randn(&r, kv * hd, 0.1, 0.0);
    }
    const int64_t N = S * T, H = c.hidden;
    float *x = randn(&r, N * H, 1.0, 0.0);
    bk_gfwd *gf = NULL;
    OKS(bk_gfwd_create(g_bf16, &c, S, T, &gf));
    assert_int_equal(bk_gfwd_attn_fused(gf), 1);
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &lw, &gl));
    float *dx = tu_dbuf(gf, N * H);
    tu_up(gf, dx, x, N * H);
    int64_t diff = 0;
    char what[128];
    snprintf(what, sizeof what, "fused %lld/%lld heads, head_dim %lld, %lld x %lld%s%s",
             (long long)heads, (long long)kv, (long long)hd, (long long)S, (long long)T,
             qk_norm ? ", q/k norm" : "", bias ? ", biases" : "");
    qk_same(gf, gl, dx, S, N, heads * hd, kv * hd, &diff, what);
    OKS(bk_gfwd_set_attn_fused(gf, 0)); /* the unfused path's RoPE writes F32 heads */
    qk_same(gf, gl, dx, S, N, heads * hd, kv * hd, &diff, what);
    printf("  q/k only vs attention, %s (fused and unfused): %lld entries differ\n", what,
           (long long)diff);
    bk_gpu_free(gf, dx);
    bk_glayer_free(gf, gl);
    bk_gfwd_free(gf);
    bk_layer_weights_free(&lw);
    free(x);
    assert_int_equal(diff, 0);
}

static void test_qk_rot_fused(void **state)
{
    (void)state;
    qk_fused_case(8, 2, 128, 2, 150, 0, 0);
    qk_fused_case(8, 2, 128, 2, 150, 1, 0); /* Qwen3 */
    qk_fused_case(6, 2, 64, 1, 70, 0, 1);   /* Qwen2-like biases, rep 3 */
    qk_fused_case(4, 4, 64, 3, 33, 1, 1);
}

/* bad inputs: NULL outputs, a layer without q/k/v weights, too many sequences */
static void test_qk_rot_bad(void **state)
{
    (void)state;
    bk_model_config c = syn_cfg(4, 2, 16, 8);
    bk_layer_weights lw;
    random_layer(&c, 5, &lw);
    bk_gfwd *gf = NULL;
    OKS(bk_gfwd_create(g_gpu, &c, 1, 8, &gf));
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &lw, &gl));
    float *dx = tu_dbuf(gf, 8 * c.hidden), *dq = tu_dbuf(gf, 8 * 64), *dk = tu_dbuf(gf, 8 * 32);
    assert_int_equal(bk_gfwd_qk_rot(gf, gl, dx, 1, NULL, dk), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_gfwd_qk_rot(gf, gl, dx, 1, dq, NULL), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_gfwd_qk_rot(gf, NULL, dx, 1, dq, dk), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_gfwd_qk_rot(gf, gl, dx, 2, dq, dk), BK_ERR_INVALID_ARG);
    OKS(bk_gfwd_qk_rot(gf, gl, dx, 1, dq, dk));
    bk_gpu_free(gf, dx);
    bk_gpu_free(gf, dq);
    bk_gpu_free(gf, dk);
    bk_glayer_free(gf, gl);
    bk_gfwd_free(gf);
    bk_layer_weights_free(&lw);
}

/* ------------------------------------------------------------ bad inputs */

static void test_bad_inputs(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", tu_env_or("BK_SOURCE_ROOT", "."));
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    bk_gfwd *gf = NULL;
    /* the CPU backend is refused */
    bk_backend *cpu = NULL;
    OKS(bk_backend_create(BK_BACKEND_CPU, &cpu));
    assert_int_equal(bk_gfwd_create(cpu, c, 1, 8, &gf), BK_ERR_INVALID_ARG);
    assert_null(gf);
    bk_backend_destroy(cpu);
    /* the CPU forward's configuration checks */
    bk_model_config bad = *c;
    bad.n_kv_heads = 4; /* 6 heads are not a multiple of 4 */
    assert_int_equal(bk_gfwd_create(g_gpu, &bad, 1, 8, &gf), BK_ERR_CONFIG);
    OKS(bk_gfwd_create(g_gpu, c, 2, 8, &gf));
    float *dh = tu_dbuf(gf, 2 * 8 * c->hidden);
    int32_t ids[16];
    for (int i = 0; i < 16; i++)
        ids[i] = i;
    ids[11] = (int32_t)c->vocab; /* sequence 1, position 3 */
    assert_int_equal(bk_gfwd_embed(gf, m, ids, 2, dh), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "sequence 1 position 3"));
    ids[11] = 3;
    assert_int_equal(bk_gfwd_embed(gf, m, ids, 3, dh), BK_ERR_INVALID_ARG); /* > max_seqs */
    OKS(bk_gfwd_embed(gf, m, ids, 2, dh));
    assert_int_equal(bk_gfwd_attn_in(gf, NULL, dh, 2, dh), BK_ERR_INVALID_ARG);
    double nll = 0;
    int64_t cnt = 0;
    ids[0] = -1;
    assert_int_equal(bk_gfwd_nll(gf, m, dh, ids, 2, &nll, &cnt), BK_ERR_CALIB);
    assert_int_equal(bk_backend_model_nll(g_gpu, m, ids, 2, 8, 0, &nll, &cnt), BK_ERR_CALIB);
    assert_int_equal(cnt, 0);
    bk_gpu_free(gf, dh);
    bk_gfwd_free(gf);
    bk_model_close(m);
}

/* bk_gpu_upload_f32 leaves a byte-identical copy: BF16-exact chunks (special
 * values included), chunks with one value that is not a BF16 number (first,
 * last), random bits (NaN payloads), a short tail; several host threads. */
static void upload_check(bk_gfwd *gf, const float *h, int64_t n)
{
    float *d = tu_dbuf(gf, n);
    float *back = malloc(sizeof(float) * (size_t)n);
    assert_non_null(back);
    OKS(bk_gpu_upload_f32(gf, d, h, n));
    OKS(bk_gpu_download(gf, back, d, sizeof(float) * (size_t)n));
    assert_memory_equal(back, h, sizeof(float) * (size_t)n);
    free(back);
    bk_gpu_free(gf, d);
}

static void test_upload(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", tu_env_or("BK_SOURCE_ROOT", "."));
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    bk_gfwd *gf = NULL;
    OKS(bk_gfwd_create(g_gpu, c, 1, 8, &gf));

    const int64_t ch = 4096, n = 5 * ch + 77;
    uint32_t *u = malloc(sizeof(uint32_t) * (size_t)n);
    assert_non_null(u);
    uint64_t x = 88172645463325252ull;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        u[i] = (uint32_t)(x >> 32) & 0xffff0000u; /* BF16 numbers */
    }
    const uint32_t special[] = {0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0xffc10000u, 0x00010000u, 0x807f0000u, 0x7f7f0000u, 0u};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        u[10 + i] = special[i];
    u[2 * ch - 1] |= 1u;        /* chunk 1: its last value is not a BF16 number */
    u[2 * ch] = 0x7fc00001u;    /* chunk 2: its first value, a NaN with a payload */
    for (int64_t i = 3 * ch; i < 4 * ch; i++) { /* chunk 3: random bits */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        u[i] = (uint32_t)x;
    }
    float *h = malloc(sizeof(float) * (size_t)n);
    assert_non_null(h);
    memcpy(h, u, sizeof(float) * (size_t)n);
    bk_gpu_upload_tune(gf, ch, 512, 3);
    upload_check(gf, h, n);
    upload_check(gf, h, 100);          /* one short chunk */
    upload_check(gf, h + 1, n - 1);    /* chunks not aligned with the above */
    bk_gpu_upload_tune(gf, ch, 100000, 1); /* one thread */
    upload_check(gf, h, n);

    /* a layer of the model (BF16 numbers or not, as the checkpoint has them),
     * with small chunks and with the defaults */
    bk_layer_weights lw;
    OKS(bk_layer_weights_load(m, 0, &lw));
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0)
            bk_gpu_upload_tune(gf, 1000, 100, 4);
        else
            bk_gpu_upload_tune(gf, (int64_t)1 << 24, (int64_t)1 << 20, 4);
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int64_t o, in;
            bk_module_shape(c, (bk_module)i, &o, &in);
            upload_check(gf, lw.w[i], o * in);
        }
    }
    bk_glayer *g = NULL;
    OKS(bk_glayer_upload(gf, &lw, &g));
    OKS(bk_glayer_set(gf, g, BK_MOD_DOWN, lw.w[BK_MOD_DOWN]));
    bk_glayer_free(gf, g);
    bk_layer_weights_free(&lw);
    free(u);
    free(h);
    bk_gfwd_free(gf);
    bk_model_close(m);
}

/* The layer driver's BF16 read for the GPU stages (branch bf16up): a layer
 * uploaded from the mapped BF16 matrices (bk_gpu_upload_bf16, widened on the
 * device; in BF16 GEMM mode landed in the BF16 copy) is bit for bit the layer
 * uploaded from the F32 load: every matrix's F32 and BF16 copies, and the
 * layer's forward output, with the F32, TF32 and BF16 GEMM backends; small
 * staging chunks and the defaults. bk_gpu_upload_bf16 alone: random BF16
 * bits (specials, NaN payloads), a short tail, unaligned starts. */
static void upload_bf16_check(bk_gfwd *gf, const uint16_t *h, int64_t n)
{
    float *d = tu_dbuf(gf, n);
    uint16_t *db = NULL;
    OKS(bk_gpu_alloc(gf, (void **)&db, sizeof(uint16_t) * (size_t)n, "test"));
    float *back = malloc(sizeof(float) * (size_t)n), *want = malloc(sizeof(float) * (size_t)n);
    uint16_t *backb = malloc(sizeof(uint16_t) * (size_t)n);
    assert_true(back && want && backb);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)h[i] << 16;
        memcpy(&want[i], &u, sizeof u);
    }
    OKS(bk_gpu_upload_bf16(gf, d, NULL, h, n));
    OKS(bk_gpu_download(gf, back, d, sizeof(float) * (size_t)n));
    assert_memory_equal(back, want, sizeof(float) * (size_t)n);
    memset(back, 0, sizeof(float) * (size_t)n);
    OKS(bk_gpu_upload_bf16(gf, d, db, h, n));
    OKS(bk_gpu_download(gf, back, d, sizeof(float) * (size_t)n));
    OKS(bk_gpu_download(gf, backb, db, sizeof(uint16_t) * (size_t)n));
    assert_memory_equal(back, want, sizeof(float) * (size_t)n);
    assert_memory_equal(backb, h, sizeof(uint16_t) * (size_t)n);
    free(back);
    free(want);
    free(backb);
    bk_gpu_free(gf, db);
    bk_gpu_free(gf, d);
}

static void test_upload_bf16(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", tu_env_or("BK_SOURCE_ROOT", "."));
    bk_model *m = open_model(dir);
    const bk_model_config *c = bk_model_get_config(m);
    assert_true(bk_model_linears_mapped_bf16(m)); /* (the example is a BF16 checkpoint) */
    {
        bk_gfwd *gf = NULL;
        OKS(bk_gfwd_create(g_gpu, c, 1, 8, &gf));
        const int64_t ch = 4096, n = 5 * ch + 77;
        uint16_t *u = malloc(sizeof(uint16_t) * (size_t)n);
        assert_non_null(u);
        uint64_t x = 88172645463325252ull;
        for (int64_t i = 0; i < n; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            u[i] = (uint16_t)(x >> 48);
        }
        const uint16_t special[] = {0x8000u, 0x7f80u, 0xff80u, 0x7fc0u, 0xffc1u,
                                    0x0001u, 0x807fu, 0x7f7fu, 0u};
        for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
            u[10 + i] = special[i];
        bk_gpu_upload_tune(gf, ch, 512, 3);
        upload_bf16_check(gf, u, n);
        upload_bf16_check(gf, u, 100);
        upload_bf16_check(gf, u + 1, n - 1);
        bk_gpu_upload_tune(gf, ch, 100000, 1);
        upload_bf16_check(gf, u, n);
        free(u);
        bk_gfwd_free(gf);
    }
    bk_backend *bes[3] = {g_gpu, g_tf32, g_bf16};
    const int64_t S = 2, T = 8, N = S * T, H = c->hidden;
    for (int b = 0; b < 3; b++) {
        bk_gfwd *gf = NULL;
        OKS(bk_gfwd_create(bes[b], c, S, T, &gf));
        float *h = tu_hbuf(N * H), *o1 = tu_hbuf(N * H), *o2 = tu_hbuf(N * H);
        for (int64_t i = 0; i < N * H; i++)
            h[i] = (float)sin(0.37 * (double)i) * 0.5f;
        float *dh = tu_dbuf(gf, N * H);
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 0)
                bk_gpu_upload_tune(gf, 1000, 100, 4);
            else
                bk_gpu_upload_tune(gf, (int64_t)1 << 24, (int64_t)1 << 20, 4);
            for (int L = 0; L < c->n_layers; L++) {
                bk_layer_weights lw, lb;
                OKS(bk_layer_weights_load(m, L, &lw));
                OKS(bk__layer_weights_load_mapped_bf16(m, L, &lb));
                for (int i = 0; i < BK_MOD_COUNT; i++)
                    assert_true(lb.wb[i] && !lb.w[i]);
                bk_glayer *g1 = NULL, *g2 = NULL;
                OKS(bk_glayer_upload(gf, &lw, &g1));
                OKS(bk_glayer_upload(gf, &lb, &g2));
                for (int i = 0; i < BK_MOD_COUNT; i++) {
                    int64_t o, in;
                    bk_module_shape(c, (bk_module)i, &o, &in);
                    const size_t k = (size_t)(o * in);
                    float *w1 = malloc(k * 4), *w2 = malloc(k * 4);
                    uint16_t *b1 = malloc(k * 2), *b2 = malloc(k * 2);
                    assert_true(w1 && w2 && b1 && b2);
                    int hb1 = -1, hb2 = -1;
                    OKS(bk_glayer_download(gf, g1, (bk_module)i, w1, b1, &hb1));
                    OKS(bk_glayer_download(gf, g2, (bk_module)i, w2, b2, &hb2));
                    assert_int_equal(hb1, hb2);
                    assert_int_equal(hb1, b == 2);
                    assert_memory_equal(w1, lw.w[i], k * 4);
                    assert_memory_equal(w2, lw.w[i], k * 4);
                    if (hb1) {
                        assert_memory_equal(b1, b2, k * 2);
                        assert_memory_equal(b2, lb.wb[i], k * 2);
                    }
                    free(w1);
                    free(w2);
                    free(b1);
                    free(b2);
                }
                tu_up(gf, dh, h, N * H);
                OKS(bk_gfwd_layer(gf, g1, S, dh, NULL));
                OKS(bk_gpu_download(gf, o1, dh, sizeof(float) * (size_t)(N * H)));
                tu_up(gf, dh, h, N * H);
                OKS(bk_gfwd_layer(gf, g2, S, dh, NULL));
                OKS(bk_gpu_download(gf, o2, dh, sizeof(float) * (size_t)(N * H)));
                if (memcmp(o1, o2, sizeof(float) * (size_t)(N * H)) != 0)
                    fail_msg("backend %d layer %d: BF16-uploaded layer's output differs", b, L);
                bk_glayer_free(gf, g1);
                bk_glayer_free(gf, g2);
                bk_layer_weights_free(&lw);
                bk_layer_weights_free(&lb);
            }
        }
        free(h);
        free(o1);
        free(o2);
        bk_gpu_free(gf, dh);
        bk_gfwd_free(gf);
    }
    bk_model_close(m);
}

int main(void)
{
    int rc0 = tu_gpu_begin(&g_gpu);
    if (rc0)
        return rc0;
    if (bk_backend_create(BK_BACKEND_CUDA, &g_bf16) != BK_OK) {
        fprintf(stderr, "cannot create the CUDA backend: %s\n", bk_last_error());
        return 1;
    }
    bk_backend_set_gemm_math(g_bf16, BK_GEMM_BF16);
    if (bk_backend_create(BK_BACKEND_CUDA, &g_tf32) != BK_OK) {
        fprintf(stderr, "cannot create the CUDA backend: %s\n", bk_last_error());
        return 1;
    }
    bk_backend_set_gemm_math(g_tf32, BK_GEMM_TF32);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama3),     cmocka_unit_test(test_tiny_qwen2),
        cmocka_unit_test(test_tiny_qwen3),      cmocka_unit_test(test_kerneldocs),
        cmocka_unit_test(test_nll_kerneldocs),  cmocka_unit_test(test_attention_4096),
        cmocka_unit_test(test_attention_pairs),
        cmocka_unit_test(test_attention_chunks), cmocka_unit_test(test_attention_fused),
        cmocka_unit_test(test_attention_fused_where), cmocka_unit_test(test_qk_rot_models),
        cmocka_unit_test(test_qk_rot_fused),    cmocka_unit_test(test_qk_rot_bad),
        cmocka_unit_test(test_bad_inputs),      cmocka_unit_test(test_upload),
        cmocka_unit_test(test_upload_bf16),
    };
    int rc = cmocka_run_group_tests_name("cuda_forward", tests, NULL, NULL);
    bk_backend_destroy(g_tf32);
    bk_backend_destroy(g_bf16);
    bk_backend_destroy(g_gpu);
    return rc;
}
#endif
