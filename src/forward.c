/* Native forward pass of decoder-only Llama / Mistral / Qwen2 / Qwen3 models
 * on the CPU: F32 compute, every projection and the per-head attention
 * products through cblas_sgemm, everything else plain loops.
 *
 * The arithmetic follows transformers' float32 path step by step (docs/forward.md):
 *   RMSNorm   y = w * (x * rsqrt(mean(x^2) + eps))
 *   attention q/k/v = x W^T (+b); Qwen3: RMSNorm of every head of q and k
 *             (q_norm / k_norm, before RoPE); RoPE (rope.c); scores = q k^T
 *             / sqrt(head_dim), causal, softmax with max subtraction; o = P v;
 *             query head h reads kv head h / (heads / kv_heads)
 *   MLP       down_in = silu(x Wg^T) * (x Wu^T), silu(z) = z / (1 + exp(-z))
 *   residual  h = h + (module output), the module output formed first.
 */
#include "bakron/forward.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward_internal.h"
#include "rope.h"
#include "util.h"

struct bk_fwd {
    bk_model_config cfg;
    bk_dims dim;
    float eps;
    bk_rope rope;
    float *q, *k, *v;   /* [rows, qdim], [rows, kvdim] x 2 */
    float *o;           /* [rows, qdim] */
    float *x;           /* [rows, hidden] normalized input */
    float *tmp;         /* [rows, hidden] module output before the residual add */
    float *gate, *up;   /* [rows, intermediate] */
    float *down;        /* [rows, intermediate] */
    float *scores;      /* [T, T] */
};

/* Largest dimension handed to BLAS (its integers are 32-bit). */
#define BK_BLAS_MAX ((int64_t)INT_MAX)

/* Logits are formed in blocks of at most this many floats. */
#define BK_LOGIT_BLOCK ((int64_t)1 << 24)
/* Rows of the LM head converted to F32 at a time: at most this many floats. */
#define BK_HEAD_BLOCK ((int64_t)1 << 22)

static float *alloc_f32(int64_t a, int64_t b)
{
    uint64_t n;
    if (a < 0 || b < 0 || bk_mul_u64((uint64_t)a, (uint64_t)b, &n) || n > SIZE_MAX / 4)
        return NULL;
    return bk_alloc(n ? (size_t)n : 1, sizeof(float));
}

/* ------------------------------------------------------------ kernels */

/* Y[N, out] = X[N, in] W[out, in]^T (+ b) */
static void linear(const float *X, int64_t N, int64_t in, const float *W, int64_t out,
                   const float *b, float *Y)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)N, (blasint)out, (blasint)in,
                1.0f, X, (blasint)in, W, (blasint)in, 0.0f, Y, (blasint)out);
    if (b) {
        for (int64_t r = 0; r < N; r++) {
            float *y = Y + r * out;
            for (int64_t j = 0; j < out; j++)
                y[j] += b[j];
        }
    }
}

/* y = w * (x * rsqrt(mean(x^2) + eps)) over rows of n; y may equal x. */
static void rmsnorm_rows(const float *x, int64_t rows, int64_t n, const float *w, float eps,
                         float *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++)
            ss += (double)xr[i] * (double)xr[i];
        float var = (float)(ss / (double)n);
        float inv = 1.0f / sqrtf(var + eps);
        for (int64_t i = 0; i < n; i++)
            yr[i] = w[i] * (xr[i] * inv);
    }
}

static void add_into(float *h, const float *d, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        h[i] += d[i];
}

/* Causal softmax of the rows of sc [T, T] in place (entries j > i set to 0). */
static void causal_softmax(float *sc, int64_t T)
{
    for (int64_t i = 0; i < T; i++) {
        float *row = sc + i * T;
        float mx = row[0];
        for (int64_t j = 1; j <= i; j++)
            mx = row[j] > mx ? row[j] : mx;
        double sum = 0.0;
        for (int64_t j = 0; j <= i; j++) {
            float e = expf(row[j] - mx);
            row[j] = e;
            sum += (double)e;
        }
        float fs = (float)sum;
        for (int64_t j = 0; j <= i; j++)
            row[j] = row[j] / fs;
        for (int64_t j = i + 1; j < T; j++)
            row[j] = 0.0f;
    }
}

/* --------------------------------------------------------- the context */

void bk_fwd_free(bk_fwd *f)
{
    if (!f)
        return;
    bk_rope_free(&f->rope);
    free(f->q);
    free(f->k);
    free(f->v);
    free(f->o);
    free(f->x);
    free(f->tmp);
    free(f->gate);
    free(f->up);
    free(f->down);
    free(f->scores);
    free(f);
}

void bk__dims_set(bk_dims *d, const bk_model_config *c, int64_t max_seqs, int64_t seqlen)
{
    d->max_seqs = max_seqs;
    d->T = seqlen;
    d->rows = max_seqs * seqlen;
    d->hidden = c->hidden;
    d->nh = c->n_heads;
    d->nkv = c->n_kv_heads;
    d->hd = c->head_dim;
    d->inter = c->intermediate;
    d->qdim = d->nh * d->hd;
    d->kvdim = d->nkv * d->hd;
    d->rep = d->nh / d->nkv;
    d->vocab = c->vocab;
}

static bk_status check_config(const bk_model_config *c)
{
    if (c->hidden <= 0 || c->intermediate <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
        c->head_dim <= 0 || c->vocab <= 0 || c->n_layers <= 0)
        return bk_error(BK_ERR_CONFIG,
                        "forward: sizes must be positive (hidden %lld, intermediate %lld, heads "
                        "%lld, kv heads %lld, head_dim %lld, vocab %lld, layers %lld)",
                        (long long)c->hidden, (long long)c->intermediate, (long long)c->n_heads,
                        (long long)c->n_kv_heads, (long long)c->head_dim, (long long)c->vocab,
                        (long long)c->n_layers);
    if (c->n_heads % c->n_kv_heads != 0)
        return bk_error(BK_ERR_CONFIG,
                        "forward: num_attention_heads %lld is not a multiple of "
                        "num_key_value_heads %lld",
                        (long long)c->n_heads, (long long)c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return bk_error(BK_ERR_CONFIG, "forward: head_dim %lld must be even for RoPE",
                        (long long)c->head_dim);
    if (c->hidden > BK_BLAS_MAX || c->intermediate > BK_BLAS_MAX || c->vocab > BK_BLAS_MAX ||
        c->n_heads * c->head_dim > BK_BLAS_MAX)
        return bk_error(BK_ERR_UNSUPPORTED, "forward: a dimension exceeds %lld",
                        (long long)BK_BLAS_MAX);
    if (!(c->rms_eps >= 0) || !isfinite(c->rms_eps))
        return bk_error(BK_ERR_CONFIG, "forward: rms_norm_eps must be a finite number >= 0 (got %g)",
                        c->rms_eps);
    if (c->hidden_act[0] && strcmp(c->hidden_act, "silu") != 0 &&
        strcmp(c->hidden_act, "swish") != 0)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "forward: hidden_act '%s' is not supported (only silu)", c->hidden_act);
    return BK_OK;
}

bk_status bk_fwd_create(const bk_model_config *cfg, int64_t max_seqs, int64_t seqlen,
                        bk_fwd **out)
{
    *out = NULL;
    if (!cfg)
        return bk_error(BK_ERR_INVALID_ARG, "forward: NULL config");
    if (max_seqs < 1 || seqlen < 1)
        return bk_error(BK_ERR_INVALID_ARG,
                        "forward: need at least 1 sequence of at least 1 token (got %lld x %lld)",
                        (long long)max_seqs, (long long)seqlen);
    bk_status st = check_config(cfg);
    if (st != BK_OK)
        return st;
    if (cfg->sliding_window > 0 && seqlen > cfg->sliding_window)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "forward: sequences of %lld tokens exceed the model's sliding window of "
                        "%lld (sliding-window attention is not implemented; use --seqlen %lld)",
                        (long long)seqlen, (long long)cfg->sliding_window,
                        (long long)cfg->sliding_window);
    uint64_t rows;
    if (bk_mul_u64((uint64_t)max_seqs, (uint64_t)seqlen, &rows) || rows > (uint64_t)BK_BLAS_MAX)
        return bk_error(BK_ERR_INVALID_ARG,
                        "forward: micro-batch of %lld sequences x %lld tokens is too large "
                        "(at most %lld rows)",
                        (long long)max_seqs, (long long)seqlen, (long long)BK_BLAS_MAX);
    bk_fwd *f = calloc(1, sizeof *f);
    if (!f)
        return bk_error(BK_ERR_NOMEM, "forward: out of memory");
    f->cfg = *cfg;
    bk__dims_set(&f->dim, cfg, max_seqs, seqlen);
    f->eps = (float)cfg->rms_eps;
    st = bk_rope_init(&f->rope, cfg, seqlen);
    if (st != BK_OK) {
        free(f);
        return bk_error_prefix(st, "forward");
    }
    int64_t R = f->dim.rows;
    f->q = alloc_f32(R, f->dim.qdim);
    f->k = alloc_f32(R, f->dim.kvdim);
    f->v = alloc_f32(R, f->dim.kvdim);
    f->o = alloc_f32(R, f->dim.qdim);
    f->x = alloc_f32(R, f->dim.hidden);
    f->tmp = alloc_f32(R, f->dim.hidden);
    f->gate = alloc_f32(R, f->dim.inter);
    f->up = alloc_f32(R, f->dim.inter);
    f->down = alloc_f32(R, f->dim.inter);
    f->scores = alloc_f32(seqlen, seqlen);
    if (!f->q || !f->k || !f->v || !f->o || !f->x || !f->tmp || !f->gate || !f->up ||
        !f->down || !f->scores) {
        bk_fwd_free(f);
        return bk_error(BK_ERR_NOMEM,
                        "forward: out of memory for buffers of %lld sequences x %lld tokens",
                        (long long)max_seqs, (long long)seqlen);
    }
    *out = f;
    return BK_OK;
}

bk_status bk__fwd_check_batch(const bk_dims *d, int64_t S, const char *who, const char *what)
{
    if (!d)
        return bk_error(BK_ERR_INVALID_ARG, "%s %s: NULL context", who, what);
    if (S < 1 || S > d->max_seqs)
        return bk_error(BK_ERR_INVALID_ARG, "%s %s: %lld sequences, the context holds 1..%lld",
                        who, what, (long long)S, (long long)d->max_seqs);
    return BK_OK;
}

static bk_status check_batch(const bk_fwd *f, int64_t S, const char *what)
{
    return bk__fwd_check_batch(f ? &f->dim : NULL, S, "forward", what);
}

/* ------------------------------------------------------- layer weights */

static void fmt_layer_name(char *buf, size_t cap, int layer, const char *suffix)
{
    if (layer >= 0)
        snprintf(buf, cap, "model.layers.%d.%s", layer, suffix);
    else
        snprintf(buf, cap, "%s", suffix);
}

static const char *fmt_shape(const bk_tensor_info *t, char *buf, size_t cap)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "[");
    for (int i = 0; i < t->ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (k < cap)
        snprintf(buf + k, cap - k, "]");
    return buf;
}

static bk_status check_finite(const float *a, uint64_t n, const char *name)
{
    for (uint64_t i = 0; i < n; i++)
        if (!isfinite(a[i]))
            return bk_error(BK_ERR_NONFINITE, "%s: element %llu is %s (weights must be finite)",
                            name, (unsigned long long)i, isnan(a[i]) ? "NaN" : "Inf");
    return BK_OK;
}

/* ---------------------------------------------- non-finite activations */

static const char *const site_names[BK_FS_COUNT] = {
    [BK_FS_ATTN_IN] = "q/k/v_proj input (input_layernorm)",
    [BK_FS_Q] = "q_proj output",
    [BK_FS_K] = "k_proj output",
    [BK_FS_V] = "v_proj output",
    [BK_FS_QROT] = "queries (q_norm, RoPE)",
    [BK_FS_KROT] = "keys (k_norm, RoPE)",
    [BK_FS_O_IN] = "o_proj input (attention: softmax(q k^T) v)",
    [BK_FS_O_OUT] = "o_proj output",
    [BK_FS_RESID_ATTN] = "residual stream after attention",
    [BK_FS_MLP_IN] = "gate/up_proj input (post_attention_layernorm)",
    [BK_FS_GATE] = "gate_proj output",
    [BK_FS_UP] = "up_proj output",
    [BK_FS_DOWN_IN] = "down_proj input (silu(gate) * up)",
    [BK_FS_DOWN_OUT] = "down_proj output",
    [BK_FS_RESID_MLP] = "residual stream after the MLP",
};

/* The weights feeding each site, in the order ties are broken (the first
 * largest wins). */
#define FW_W(m) {BK_FW_WEIGHT, BK_MOD_##m}
#define FW_B(m) {BK_FW_BIAS, BK_MOD_##m}
#define FW_N(k) {BK_FW_##k, BK_MOD_Q}
static const struct {
    int n;
    bk_fwd_wref r[8];
} site_src[BK_FS_COUNT] = {
    [BK_FS_ATTN_IN] = {1, {FW_N(ATTN_NORM)}},
    [BK_FS_Q] = {2, {FW_W(Q), FW_B(Q)}},
    [BK_FS_K] = {2, {FW_W(K), FW_B(K)}},
    [BK_FS_V] = {2, {FW_W(V), FW_B(V)}},
    [BK_FS_QROT] = {3, {FW_W(Q), FW_B(Q), FW_N(Q_NORM)}},
    [BK_FS_KROT] = {3, {FW_W(K), FW_B(K), FW_N(K_NORM)}},
    [BK_FS_O_IN] = {8, {FW_W(Q), FW_W(K), FW_W(V), FW_B(Q), FW_B(K), FW_B(V), FW_N(Q_NORM),
                        FW_N(K_NORM)}},
    [BK_FS_O_OUT] = {2, {FW_W(O), FW_B(O)}},
    [BK_FS_RESID_ATTN] = {2, {FW_W(O), FW_B(O)}},
    [BK_FS_MLP_IN] = {1, {FW_N(MLP_NORM)}},
    [BK_FS_GATE] = {2, {FW_W(GATE), FW_B(GATE)}},
    [BK_FS_UP] = {2, {FW_W(UP), FW_B(UP)}},
    [BK_FS_DOWN_IN] = {4, {FW_W(GATE), FW_W(UP), FW_B(GATE), FW_B(UP)}},
    [BK_FS_DOWN_OUT] = {2, {FW_W(DOWN), FW_B(DOWN)}},
    [BK_FS_RESID_MLP] = {2, {FW_W(DOWN), FW_B(DOWN)}},
};
#undef FW_W
#undef FW_B
#undef FW_N

const char *bk_fwd_site_name(bk_fwd_site s)
{
    return (unsigned)s < BK_FS_COUNT ? site_names[s] : "?";
}

int64_t bk_fwd_site_width(const bk_model_config *c, bk_fwd_site s)
{
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    switch (s) {
    case BK_FS_Q:
    case BK_FS_QROT:
    case BK_FS_O_IN: return qd;
    case BK_FS_K:
    case BK_FS_V:
    case BK_FS_KROT: return kd;
    case BK_FS_GATE:
    case BK_FS_UP:
    case BK_FS_DOWN_IN: return c->intermediate;
    default: return c->hidden;
    }
}

/* The weight's name without "model.layers.L." and its element count. */
static void wref_describe(const bk_model_config *c, bk_fwd_wref r, char *name, size_t cap,
                          int64_t *n)
{
    int64_t o = 0, in = 0;
    switch (r.kind) {
    case BK_FW_WEIGHT:
    case BK_FW_BIAS:
        bk_module_shape(c, r.mod, &o, &in);
        snprintf(name, cap, "%s.%s", bk_module_name(r.mod),
                 r.kind == BK_FW_WEIGHT ? "weight" : "bias");
        *n = r.kind == BK_FW_WEIGHT ? o * in : o;
        return;
    case BK_FW_ATTN_NORM:
        snprintf(name, cap, "input_layernorm.weight");
        *n = c->hidden;
        return;
    case BK_FW_MLP_NORM:
        snprintf(name, cap, "post_attention_layernorm.weight");
        *n = c->hidden;
        return;
    case BK_FW_Q_NORM:
    case BK_FW_K_NORM:
        snprintf(name, cap, "self_attn.%s_norm.weight", r.kind == BK_FW_Q_NORM ? "q" : "k");
        *n = c->head_dim;
        return;
    }
    snprintf(name, cap, "?");
    *n = 0;
}

bk_status bk_fwd_nonfinite_error(const bk_model_config *c, int layer, bk_fwd_site site,
                                 float value, int64_t row, int64_t col, bk_fwd_wget get,
                                 void *ctx)
{
    char wname[80] = "";
    float wmax = 0.0f;
    int64_t wat = 0;
    int have = 0;
    if ((unsigned)site < BK_FS_COUNT) {
        for (int k = 0; k < site_src[site].n; k++) {
            char name[80];
            int64_t n = 0;
            wref_describe(c, site_src[site].r[k], name, sizeof name, &n);
            const float *w = get ? get(ctx, site_src[site].r[k], n) : NULL;
            if (!w)
                continue;
            for (int64_t e = 0; e < n; e++) {
                float v = fabsf(w[e]);
                if (!have || v > wmax) {
                    snprintf(wname, sizeof wname, "%s", name);
                    have = 1;
                    wmax = v;
                    wat = e;
                }
            }
        }
    }
    char cause[200] = "";
    if (have)
        snprintf(cause, sizeof cause,
                 "; the largest weight feeding it is model.layers.%d.%s = %g (element %lld)",
                 layer, wname, (double)wmax, (long long)wat);
    return bk_error(BK_ERR_NONFINITE,
                    "layer %d %s: non-finite value %g at row %lld, column %lld: the float32 "
                    "forward pass overflowed here%s",
                    layer, bk_fwd_site_name(site), (double)value, (long long)row,
                    (long long)col, cause);
}

/* The host weights of a CPU layer. */
static const float *cpu_wget(void *ctx, bk_fwd_wref r, int64_t n)
{
    const bk_layer_weights *lw = ctx;
    (void)n;
    switch (r.kind) {
    case BK_FW_WEIGHT: return lw->w[r.mod];
    case BK_FW_BIAS: return lw->b[r.mod];
    case BK_FW_ATTN_NORM: return lw->attn_norm;
    case BK_FW_MLP_NORM: return lw->mlp_norm;
    case BK_FW_Q_NORM: return lw->q_norm;
    case BK_FW_K_NORM: return lw->k_norm;
    }
    return NULL;
}

/* BK_ERR_NONFINITE when the output a[rows, cols] of the site holds a NaN/Inf
 * (bk_fwd_nonfinite_error). The forward pass checks each operation's output
 * this way, so the first operation that produced a non-finite value is the
 * one named. */
static bk_status fwd_check(const bk_fwd *f, const float *a, int64_t rows, int64_t cols,
                           const bk_layer_weights *lw, bk_fwd_site site)
{
    int64_t n = rows * cols, i = 0;
    for (; i < n; i++)
        if (!isfinite(a[i]))
            break;
    if (i == n)
        return BK_OK;
    return bk_fwd_nonfinite_error(&f->cfg, lw->layer, site, a[i], i / cols, i % cols, cpu_wget,
                                  (void *)lw);
}

/* A 1-D tensor of n elements as F32 (finite). */
static bk_status load_vec(const bk_model *m, int layer, const char *suffix, int64_t n,
                          float **out)
{
    *out = NULL;
    char name[256];
    const bk_tensor_info *t = bk_model_find(m, layer, suffix);
    if (!t) {
        fmt_layer_name(name, sizeof name, layer, suffix);
        return bk_error(BK_ERR_MISSING_TENSOR, "%s: missing (the config implies it)", name);
    }
    const char *tn = t->name ? t->name : suffix;
    char sb[128];
    if (t->ndim != 1 || t->shape[0] != n)
        return bk_error(BK_ERR_SHAPE, "%s: expected shape [%lld], got %s", tn, (long long)n,
                        fmt_shape(t, sb, sizeof sb));
    float *v = alloc_f32(n, 1);
    if (!v)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", tn);
    bk_status st = bk_tensor_to_f32(t, v);
    if (st == BK_OK)
        st = check_finite(v, (uint64_t)n, tn);
    if (st != BK_OK) {
        free(v);
        return st;
    }
    *out = v;
    return BK_OK;
}

static int module_has_bias(const bk_model_config *c, bk_module mod)
{
    switch (mod) {
    case BK_MOD_Q:
    case BK_MOD_K:
    case BK_MOD_V: return c->qkv_bias;
    case BK_MOD_O: return c->o_bias;
    default: return c->mlp_bias;
    }
}

void bk_layer_weights_free(bk_layer_weights *lw)
{
    if (!lw)
        return;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        free(lw->w[i]);
        free(lw->b[i]);
        lw->w[i] = lw->b[i] = NULL;
        lw->wb[i] = NULL; /* (mapped: not owned) */
    }
    free(lw->attn_norm);
    free(lw->mlp_norm);
    free(lw->q_norm);
    free(lw->k_norm);
    lw->attn_norm = lw->mlp_norm = lw->q_norm = lw->k_norm = NULL;
}

/* the arguments of the layer loaders: model and layer index */
static bk_status layer_args(const bk_model *m, int layer, const bk_model_config **c)
{
    if (!m)
        return bk_error(BK_ERR_INVALID_ARG, "layer weights: NULL model");
    *c = bk_model_get_config(m);
    if (layer < 0 || layer >= (*c)->n_layers)
        return bk_error(BK_ERR_INVALID_ARG, "layer weights: layer %d outside [0, %lld)", layer,
                        (long long)(*c)->n_layers);
    return BK_OK;
}

/* module i's weight [o, in] as F32 (allocated), checked finite; *out NULL
 * on failure. name: its tensor name (messages). */
static bk_status load_matrix_f32(const bk_model *m, int layer, int i, const char *name,
                                 int64_t o, int64_t in, float **out)
{
    float *w = alloc_f32(o, in);
    *out = NULL;
    if (!w)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for [%lld, %lld]", name, (long long)o,
                        (long long)in);
    bk_status st = bk_model_linear_f32(m, layer, (bk_module)i, w);
    if (st == BK_OK)
        st = check_finite(w, (uint64_t)(o * in), name);
    if (st != BK_OK)
        free(w);
    else
        *out = w;
    return st;
}

/* the layer's RMSNorm weights (q/k norms with qk_norm) */
static bk_status load_norms(const bk_model *m, int layer, const bk_model_config *c, float **an,
                            float **mn, float **qn, float **kn)
{
    bk_status st = load_vec(m, layer, "input_layernorm.weight", c->hidden, an);
    if (st == BK_OK)
        st = load_vec(m, layer, "post_attention_layernorm.weight", c->hidden, mn);
    if (st == BK_OK && c->qk_norm) {
        st = load_vec(m, layer, "self_attn.q_norm.weight", c->head_dim, qn);
        if (st == BK_OK)
            st = load_vec(m, layer, "self_attn.k_norm.weight", c->head_dim, kn);
    }
    return st;
}

bk_status bk_layer_weights_load(const bk_model *m, int layer, bk_layer_weights *lw)
{
    if (!lw)
        return bk_error(BK_ERR_INVALID_ARG, "layer weights: NULL output");
    memset(lw, 0, sizeof *lw);
    lw->layer = layer;
    const bk_model_config *c = NULL;
    bk_status st = layer_args(m, layer, &c);
    if (st != BK_OK)
        return st;
    char name[256], suffix[128];
    for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        snprintf(suffix, sizeof suffix, "%s.weight", bk_module_name((bk_module)i));
        fmt_layer_name(name, sizeof name, layer, suffix);
        st = load_matrix_f32(m, layer, i, name, o, in, &lw->w[i]);
        if (st == BK_OK && module_has_bias(c, (bk_module)i)) {
            snprintf(suffix, sizeof suffix, "%s.bias", bk_module_name((bk_module)i));
            st = load_vec(m, layer, suffix, o, &lw->b[i]);
        }
    }
    if (st == BK_OK)
        st = load_norms(m, layer, c, &lw->attn_norm, &lw->mlp_norm, &lw->q_norm, &lw->k_norm);
    if (st != BK_OK)
        bk_layer_weights_free(lw);
    return st;
}

void bk_layer_weights_bf16_free(bk_layer_weights_bf16 *lw)
{
    if (!lw)
        return;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        free(lw->own[i]);
        free(lw->b[i]);
        lw->own[i] = NULL;
        lw->w[i] = NULL;
        lw->b[i] = NULL;
    }
    free(lw->attn_norm);
    free(lw->mlp_norm);
    free(lw->q_norm);
    free(lw->k_norm);
    lw->attn_norm = lw->mlp_norm = lw->q_norm = lw->k_norm = NULL;
    lw->host_bytes = 0;
}

/* the finiteness check of check_finite on BF16 elements (same message) */
static bk_status check_finite_bf16(const uint16_t *a, uint64_t n, const char *name)
{
    for (uint64_t i = 0; i < n; i++)
        if ((a[i] & 0x7f80u) == 0x7f80u)
            return bk_error(BK_ERR_NONFINITE, "%s: element %llu is %s (weights must be finite)",
                            name, (unsigned long long)i, (a[i] & 0x7fu) ? "NaN" : "Inf");
    return BK_OK;
}

bk_status bk_layer_weights_bf16_load(const bk_model *m, int layer, bk_layer_weights_bf16 *lw)
{
    if (!lw)
        return bk_error(BK_ERR_INVALID_ARG, "layer weights: NULL output");
    memset(lw, 0, sizeof *lw);
    lw->layer = layer;
    const bk_model_config *c = NULL;
    bk_status st = layer_args(m, layer, &c);
    if (st != BK_OK)
        return st;
    char name[256], suffix[128];
    for (int i = 0; i < BK_MOD_COUNT && st == BK_OK; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        snprintf(suffix, sizeof suffix, "%s.weight", bk_module_name((bk_module)i));
        fmt_layer_name(name, sizeof name, layer, suffix);
        const uint16_t *mapped = bk_model_linear_bf16_mapped(m, layer, (bk_module)i);
        if (mapped) {
            lw->w[i] = mapped;
        } else {
            /* one F32 matrix at a time, rounded as the device rounds */
            lw->own[i] = (uint16_t *)malloc((size_t)(o * in) * sizeof(uint16_t));
            if (!lw->own[i]) {
                st = bk_error(BK_ERR_NOMEM, "%s: out of memory for [%lld, %lld]", name,
                              (long long)o, (long long)in);
                break;
            }
            float *f;
            st = load_matrix_f32(m, layer, i, name, o, in, &f);
            if (st == BK_OK)
                bk_f32_to_bf16_rn_dev(f, lw->own[i], (size_t)(o * in));
            free(f);
            lw->w[i] = lw->own[i];
            lw->host_bytes += (uint64_t)(o * in) * sizeof(uint16_t);
        }
        if (st == BK_OK && mapped)
            st = check_finite_bf16(mapped, (uint64_t)(o * in), name);
        if (st == BK_OK && module_has_bias(c, (bk_module)i)) {
            snprintf(suffix, sizeof suffix, "%s.bias", bk_module_name((bk_module)i));
            st = load_vec(m, layer, suffix, o, &lw->b[i]);
            lw->host_bytes += (uint64_t)o * sizeof(float);
        }
    }
    if (st == BK_OK)
        st = load_norms(m, layer, c, &lw->attn_norm, &lw->mlp_norm, &lw->q_norm, &lw->k_norm);
    lw->host_bytes += 2 * (uint64_t)c->hidden * sizeof(float);
    if (c->qk_norm)
        lw->host_bytes += 2 * (uint64_t)c->head_dim * sizeof(float);
    if (st != BK_OK)
        bk_layer_weights_bf16_free(lw);
    return st;
}

bk_status bk__layer_weights_load_mapped_bf16(const bk_model *m, int layer, bk_layer_weights *lw)
{
    bk_layer_weights_bf16 b;
    bk_status st = bk_layer_weights_bf16_load(m, layer, &b);
    if (st != BK_OK) {
        if (lw)
            memset(lw, 0, sizeof *lw);
        return st;
    }
    int mapped = 1;
    for (int i = 0; i < BK_MOD_COUNT; i++)
        mapped &= b.own[i] == NULL;
    if (!mapped) { /* (a rounded copy is not the checkpoint's value: F32) */
        bk_layer_weights_bf16_free(&b);
        return bk_layer_weights_load(m, layer, lw);
    }
    memset(lw, 0, sizeof *lw);
    lw->layer = layer;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        lw->wb[i] = b.w[i];
        lw->b[i] = b.b[i];
    }
    lw->attn_norm = b.attn_norm;
    lw->mlp_norm = b.mlp_norm;
    lw->q_norm = b.q_norm;
    lw->k_norm = b.k_norm;
    return BK_OK;
}

bk_status bk__layer_weights_widen(const bk_model_config *c, bk_layer_weights *lw)
{
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        if (!lw->wb[i] || lw->w[i])
            continue;
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        const size_t n = (size_t)(o * in);
        float *w = alloc_f32(o, in);
        if (!w)
            return bk_error(BK_ERR_NOMEM, "layer %d: out of memory for [%lld, %lld]", lw->layer,
                            (long long)o, (long long)in);
        const uint16_t *s = lw->wb[i];
        uint32_t *d = (uint32_t *)w;
        for (size_t k = 0; k < n; k++) /* (exact: BF16 is the top half of an F32) */
            d[k] = (uint32_t)s[k] << 16;
        lw->w[i] = w;
        lw->wb[i] = NULL;
    }
    return BK_OK;
}

int bk_model_linears_mapped_bf16(const bk_model *m)
{
    if (!m)
        return 0;
    const bk_model_config *c = bk_model_get_config(m);
    for (int l = 0; l < c->n_layers; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++)
            if (!bk_model_linear_bf16_mapped(m, l, (bk_module)i))
                return 0;
    return 1;
}

/* ------------------------------------------------------------- stages */

/* Every token id of the sequences [S, T] inside the vocabulary [0, vocab). */
static bk_status check_tokens(const int32_t *tokens, int64_t S, int64_t T, int64_t vocab)
{
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < T; t++) {
            int32_t id = tokens[s * T + t];
            if (id < 0 || (int64_t)id >= vocab)
                return bk_error(BK_ERR_CALIB,
                                "input_ids: sequence %lld position %lld: token id %d is outside "
                                "the vocabulary [0, %lld)",
                                (long long)s, (long long)t, (int)id, (long long)vocab);
        }
    return BK_OK;
}

bk_status bk__fwd_find_matrix_for(const bk_model *m, const char *suffix, int64_t rows,
                                  int64_t cols, const char *why, const bk_tensor_info **out)
{
    const bk_tensor_info *t = bk_model_find(m, -1, suffix);
    *out = NULL;
    if (!t)
        return why ? bk_error(BK_ERR_MISSING_TENSOR, "model.%s: missing (%s)", suffix, why)
                   : bk_error(BK_ERR_MISSING_TENSOR, "model.%s: missing", suffix);
    const char *tn = t->name ? t->name : suffix;
    char sb[128];
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return bk_error(BK_ERR_SHAPE, "%s: expected shape [%lld, %lld], got %s", tn,
                        (long long)rows, (long long)cols, fmt_shape(t, sb, sizeof sb));
    if (!bk_dtype_is_numeric(t->dtype) || bk_dtype_bits(t->dtype) % 8 != 0)
        return bk_error(BK_ERR_DTYPE, "%s: dtype %s cannot be converted", tn,
                        bk_dtype_name(t->dtype));
    *out = t;
    return BK_OK;
}

bk_status bk__fwd_find_matrix(const bk_model *m, const char *suffix, int64_t rows, int64_t cols,
                              const bk_tensor_info **out)
{
    return bk__fwd_find_matrix_for(m, suffix, rows, cols, NULL, out);
}

bk_status bk__fwd_matrix_rows(const bk_tensor_info *t, int64_t r0, int64_t r1, void *dst,
                              bk_dtype dt)
{
    size_t es = bk_dtype_bits(t->dtype) / 8;
    size_t cols = (size_t)t->shape[1];
    const unsigned char *src = (const unsigned char *)t->data + (size_t)r0 * cols * es;
    bk_status st = bk_convert(src, t->dtype, dst, dt, (size_t)(r1 - r0) * cols);
    if (st != BK_OK)
        return bk_error_prefix(st, t->name ? t->name : "tensor");
    return BK_OK;
}

bk_status bk__fwd_embed_rows(const bk_tensor_info *t, const int32_t *tokens, int64_t N, void *h,
                             bk_dtype dt)
{
    const size_t row = (size_t)t->shape[1] * (dt == BK_DT_F64 ? sizeof(double) : sizeof(float));
    for (int64_t n = 0; n < N; n++) {
        bk_status st = bk__fwd_matrix_rows(t, tokens[n], (int64_t)tokens[n] + 1,
                                           (char *)h + (size_t)n * row, dt);
        if (st != BK_OK)
            return st;
    }
    return BK_OK;
}

bk_status bk__fwd_check_call(const bk_dims *d, const bk_model *m, const int32_t *tokens,
                             int64_t S, const char *who, const char *what)
{
    bk_status st = bk__fwd_check_batch(d, S, who, what);
    if (st != BK_OK)
        return st;
    if (!m)
        return bk_error(BK_ERR_INVALID_ARG, "%s %s: NULL model", who, what);
    const bk_model_config *c = bk_model_get_config(m);
    if (c->hidden != d->hidden || c->vocab != d->vocab)
        return bk_error(BK_ERR_INVALID_ARG,
                        "%s %s: model (hidden %lld, vocab %lld) does not match the context "
                        "(hidden %lld, vocab %lld)",
                        who, what, (long long)c->hidden, (long long)c->vocab,
                        (long long)d->hidden, (long long)d->vocab);
    return tokens ? check_tokens(tokens, S, d->T, d->vocab) : BK_OK;
}

bk_status bk__fwd_check_embed(const bk_dims *d, const bk_model *m, const int32_t *tokens,
                              int64_t S, const char *who, const bk_tensor_info **t)
{
    *t = NULL;
    bk_status st = bk__fwd_check_call(d, m, tokens, S, who, "embed");
    return st == BK_OK ? bk__fwd_find_matrix(m, "embed_tokens.weight", d->vocab, d->hidden, t)
                       : st;
}

bk_status bk__fwd_check_nll(const bk_dims *d, const bk_model *m, const int32_t *tokens, int64_t S,
                            const char *who, int *predict)
{
    *predict = 0;
    bk_status st = bk__fwd_check_call(d, m, tokens, S, who, "nll");
    *predict = st == BK_OK && d->T >= 2;
    return st;
}

/* check_op (the stages' checks) and bk_fwd_layer */
#define FWD_CTX bk_fwd
#define FWD_LW bk_layer_weights
#define FWD(op) bk_fwd_##op
#define FWD_EXPORT
#define FWD_WHO "forward"
#include "fwd_layer_tmpl.h" /* (undefines its parameters) */

bk_status bk_fwd_embed(bk_fwd *f, const bk_model *m, const int32_t *tokens, int64_t S, float *h)
{
    const bk_tensor_info *t;
    bk_status st = bk__fwd_check_embed(f ? &f->dim : NULL, m, tokens, S, "forward", &t);
    if (st != BK_OK)
        return st;
    return bk__fwd_embed_rows(t, tokens, S * f->dim.T, h, BK_DT_F32);
}

/* A block's input x = RMSNorm(h) (site): the attention's (op FWD_ATTN_IN,
 * input_layernorm) or the MLP's (FWD_MLP_IN, post_attention_layernorm). */
static bk_status norm_in(bk_fwd *f, const bk_layer_weights *lw, const float *h, int64_t S,
                         float *x, int op, bk_fwd_site site)
{
    bk_status st = check_op(f, S, lw, op);
    if (st != BK_OK)
        return st;
    const float *w = op == FWD_MLP_IN ? lw->mlp_norm : lw->attn_norm;
    rmsnorm_rows(h, S * f->dim.T, f->dim.hidden, w, f->eps, x);
    return fwd_check(f, x, S * f->dim.T, f->dim.hidden, lw, site);
}

bk_status bk_fwd_attn_in(bk_fwd *f, const bk_layer_weights *lw, const float *h, int64_t S,
                         float *x)
{
    return norm_in(f, lw, h, S, x, FWD_ATTN_IN, BK_FS_ATTN_IN);
}

/* The projections of bk_fwd_attention into f->q, f->k (and f->v with
 * with_v), each checked as it is made, then q_norm / k_norm and RoPE of the
 * queries and keys in place (checked after): the same operations in the same
 * order whether the values are made or not, so bk__fwd_qk_rot's queries and
 * keys are bk_fwd_attention's bits. */
static bk_status attn_project(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                              int with_v)
{
    const int64_t T = f->dim.T, N = S * T, hd = f->dim.hd, qd = f->dim.qdim, kd = f->dim.kvdim;
    bk_status st;
    linear(x, N, f->dim.hidden, lw->w[BK_MOD_Q], qd, lw->b[BK_MOD_Q], f->q);
    if ((st = fwd_check(f, f->q, N, qd, lw, BK_FS_Q)) != BK_OK)
        return st;
    linear(x, N, f->dim.hidden, lw->w[BK_MOD_K], kd, lw->b[BK_MOD_K], f->k);
    if ((st = fwd_check(f, f->k, N, kd, lw, BK_FS_K)) != BK_OK)
        return st;
    if (with_v) {
        linear(x, N, f->dim.hidden, lw->w[BK_MOD_V], kd, lw->b[BK_MOD_V], f->v);
        if ((st = fwd_check(f, f->v, N, kd, lw, BK_FS_V)) != BK_OK)
            return st;
    }
    if (lw->q_norm)
        rmsnorm_rows(f->q, N * f->dim.nh, hd, lw->q_norm, f->eps, f->q);
    if (lw->k_norm)
        rmsnorm_rows(f->k, N * f->dim.nkv, hd, lw->k_norm, f->eps, f->k);
    for (int64_t n = 0; n < N; n++) {
        int64_t pos = n % T;
        bk_rope_apply(&f->rope, f->q + n * qd, f->dim.nh, pos, +1);
        bk_rope_apply(&f->rope, f->k + n * kd, f->dim.nkv, pos, +1);
    }
    if ((st = fwd_check(f, f->q, N, qd, lw, BK_FS_QROT)) != BK_OK ||
        (st = fwd_check(f, f->k, N, kd, lw, BK_FS_KROT)) != BK_OK)
        return st;
    return BK_OK;
}

bk_status bk__fwd_qk_rot(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                         float *q_rot, float *k_rot)
{
    bk_status st = check_op(f, S, lw, FWD_ATTENTION);
    if (st != BK_OK)
        return st;
    if (!q_rot || !k_rot)
        return bk_error(BK_ERR_INVALID_ARG, "forward qk_rot: layer %d: NULL output", lw->layer);
    if ((st = attn_project(f, lw, x, S, 0)) != BK_OK)
        return st;
    const int64_t N = S * f->dim.T;
    memcpy(q_rot, f->q, (size_t)(N * f->dim.qdim) * sizeof(float));
    memcpy(k_rot, f->k, (size_t)(N * f->dim.kvdim) * sizeof(float));
    return BK_OK;
}

bk_status bk_fwd_attention(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                           float *o_in, float *q_rot, float *k_rot, float *v)
{
    bk_status st = check_op(f, S, lw, FWD_ATTENTION);
    if (st != BK_OK)
        return st;
    const int64_t T = f->dim.T, N = S * T, hd = f->dim.hd, qd = f->dim.qdim, kd = f->dim.kvdim;
    if ((st = attn_project(f, lw, x, S, 1)) != BK_OK)
        return st;
    if (q_rot)
        memcpy(q_rot, f->q, (size_t)(N * qd) * sizeof(float));
    if (k_rot)
        memcpy(k_rot, f->k, (size_t)(N * kd) * sizeof(float));
    if (v)
        memcpy(v, f->v, (size_t)(N * kd) * sizeof(float));

    const float scale = (float)(1.0 / sqrt((double)hd));
    const int64_t rep = f->dim.nh / f->dim.nkv;
    float *sc = f->scores;
    for (int64_t s = 0; s < S; s++) {
        const float *qs = f->q + s * T * qd;
        const float *ks = f->k + s * T * kd;
        const float *vs = f->v + s * T * kd;
        float *os = o_in + s * T * qd;
        for (int64_t hh = 0; hh < f->dim.nh; hh++) {
            int64_t g = hh / rep;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)T, (blasint)T,
                        (blasint)hd, scale, qs + hh * hd, (blasint)qd, ks + g * hd, (blasint)kd,
                        0.0f, sc, (blasint)T);
            causal_softmax(sc, T);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)T, (blasint)hd,
                        (blasint)T, 1.0f, sc, (blasint)T, vs + g * hd, (blasint)kd, 0.0f,
                        os + hh * hd, (blasint)qd);
        }
    }
    return fwd_check(f, o_in, N, qd, lw, BK_FS_O_IN);
}

/* A block's output projection (module mod, in_width inputs, site out) added
 * into the residual stream h (site resid): o_proj after the attention,
 * down_proj after the MLP. */
static bk_status out_residual(bk_fwd *f, const bk_layer_weights *lw, const float *in, int64_t S,
                              float *h, int op, bk_module mod, int64_t in_width, bk_fwd_site out,
                              bk_fwd_site resid)
{
    bk_status st = check_op(f, S, lw, op);
    if (st != BK_OK)
        return st;
    int64_t N = S * f->dim.T;
    linear(in, N, in_width, lw->w[mod], f->dim.hidden, lw->b[mod], f->tmp);
    if ((st = fwd_check(f, f->tmp, N, f->dim.hidden, lw, out)) != BK_OK)
        return st;
    add_into(h, f->tmp, N * f->dim.hidden);
    return fwd_check(f, h, N, f->dim.hidden, lw, resid);
}

bk_status bk_fwd_attn_out(bk_fwd *f, const bk_layer_weights *lw, const float *o_in, int64_t S,
                          float *h)
{
    return out_residual(f, lw, o_in, S, h, FWD_ATTN_OUT, BK_MOD_O, f->dim.qdim, BK_FS_O_OUT,
                        BK_FS_RESID_ATTN);
}

bk_status bk_fwd_mlp_in(bk_fwd *f, const bk_layer_weights *lw, const float *h, int64_t S,
                        float *x)
{
    return norm_in(f, lw, h, S, x, FWD_MLP_IN, BK_FS_MLP_IN);
}

bk_status bk_fwd_mlp_hidden(bk_fwd *f, const bk_layer_weights *lw, const float *x, int64_t S,
                            float *down_in, float *gate_pre, float *up_pre)
{
    bk_status st = check_op(f, S, lw, FWD_MLP_HIDDEN);
    if (st != BK_OK)
        return st;
    int64_t N = S * f->dim.T, ni = f->dim.inter;
    float *g = gate_pre ? gate_pre : f->gate;
    float *u = up_pre ? up_pre : f->up;
    linear(x, N, f->dim.hidden, lw->w[BK_MOD_GATE], ni, lw->b[BK_MOD_GATE], g);
    if ((st = fwd_check(f, g, N, ni, lw, BK_FS_GATE)) != BK_OK)
        return st;
    linear(x, N, f->dim.hidden, lw->w[BK_MOD_UP], ni, lw->b[BK_MOD_UP], u);
    if ((st = fwd_check(f, u, N, ni, lw, BK_FS_UP)) != BK_OK)
        return st;
    for (int64_t i = 0; i < N * ni; i++) {
        float z = g[i];
        down_in[i] = (z / (1.0f + expf(-z))) * u[i];
    }
    return fwd_check(f, down_in, N, ni, lw, BK_FS_DOWN_IN);
}

bk_status bk_fwd_mlp_out(bk_fwd *f, const bk_layer_weights *lw, const float *down_in, int64_t S,
                         float *h)
{
    return out_residual(f, lw, down_in, S, h, FWD_MLP_OUT, BK_MOD_DOWN, f->dim.inter,
                        BK_FS_DOWN_OUT, BK_FS_RESID_MLP);
}


/* ------------------------------------------------------------- the head */

typedef struct head_ctx {
    const bk_tensor_info *w; /* [vocab, hidden] */
    float *norm;             /* final norm weight [hidden] */
} head_ctx;

static bk_status head_open(const bk_fwd *f, const bk_model *m, head_ctx *hc)
{
    hc->w = NULL;
    hc->norm = NULL;
    const char *which = f->cfg.tie_embeddings ? "embed_tokens.weight" : "lm_head.weight";
    bk_status st = bk__fwd_find_matrix(m, which, f->cfg.vocab, f->dim.hidden, &hc->w);
    if (st == BK_OK)
        st = load_vec(m, -1, "norm.weight", f->dim.hidden, &hc->norm);
    return st;
}

/* The logits [N, n] (row stride ldo) of the vocabulary rows v0 .. v0+n of
 * the normed hidden states f->x [N, hidden]; wb [n, hidden] receives the
 * head's rows. */
static bk_status head_block(bk_fwd *f, const head_ctx *hc, int64_t N, int64_t v0, int64_t n,
                            float *wb, float *out, int64_t ldo)
{
    bk_status st = bk__fwd_matrix_rows(hc->w, v0, v0 + n, wb, BK_DT_F32);
    if (st == BK_OK)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)N, (blasint)n,
                    (blasint)f->dim.hidden, 1.0f, f->x, (blasint)f->dim.hidden, wb,
                    (blasint)f->dim.hidden, 0.0f, out, (blasint)ldo);
    return st;
}

int64_t bk__fwd_vocab_block(const bk_dims *d, int64_t rows)
{
    int64_t a = BK_LOGIT_BLOCK / (rows > 0 ? rows : 1);
    int64_t b = BK_HEAD_BLOCK / d->hidden;
    int64_t vc = a < b ? a : b;
    if (vc < 64)
        vc = 64;
    if (vc > d->vocab)
        vc = d->vocab;
    return vc;
}

bk_status bk_fwd_logits(bk_fwd *f, const bk_model *m, const float *h, int64_t S, float *logits)
{
    bk_status st = bk__fwd_check_call(f ? &f->dim : NULL, m, NULL, S, "forward", "logits");
    if (st != BK_OK)
        return st;
    head_ctx hc;
    st = head_open(f, m, &hc);
    int64_t N = S * f->dim.T, V = f->cfg.vocab;
    int64_t vc = bk__fwd_vocab_block(&f->dim, 0);
    float *wb = NULL;
    if (st == BK_OK) {
        wb = alloc_f32(vc, f->dim.hidden);
        if (!wb)
            st = bk_error(BK_ERR_NOMEM, "forward logits: out of memory");
    }
    if (st == BK_OK) {
        rmsnorm_rows(h, N, f->dim.hidden, hc.norm, f->eps, f->x);
        for (int64_t v0 = 0; v0 < V && st == BK_OK; v0 += vc) {
            int64_t n = V - v0 < vc ? V - v0 : vc;
            st = head_block(f, &hc, N, v0, n, wb, logits + v0, V);
        }
    }
    free(wb);
    free(hc.norm);
    return st;
}

bk_status bk_fwd_nll_rows(const double *se, const float *mx, const float *tgt, int64_t S,
                          int64_t T, double *nll_sum, int64_t *count)
{
    double sum = 0.0;
    for (int64_t r = 0; r < S * T; r++) {
        int64_t t = r % T;
        if (t == T - 1)
            continue;
        double l = log(se[r]) + (double)mx[r] - (double)tgt[r];
        if (!isfinite(l))
            return bk_error(BK_ERR_NONFINITE,
                            "forward nll: non-finite logits at sequence %lld position %lld "
                            "(the model produced NaN/Inf)",
                            (long long)(r / T), (long long)t);
        sum += l;
    }
    *nll_sum += sum;
    *count += S * (T - 1);
    return BK_OK;
}

bk_status bk_fwd_nll(bk_fwd *f, const bk_model *m, const float *h, const int32_t *tokens,
                     int64_t S, double *nll_sum, int64_t *count)
{
    int predict;
    bk_status st = bk__fwd_check_nll(f ? &f->dim : NULL, m, tokens, S, "forward", &predict);
    if (st != BK_OK || !predict)
        return st;
    const int64_t T = f->dim.T, N = S * T, V = f->cfg.vocab;
    head_ctx hc;
    float *wb = NULL, *lg = NULL, *mx = NULL, *tgt = NULL;
    double *se = NULL;
    st = head_open(f, m, &hc);
    int64_t vc = bk__fwd_vocab_block(&f->dim, N);
    if (st == BK_OK) {
        wb = alloc_f32(vc, f->dim.hidden);
        lg = alloc_f32(N, vc);
        mx = alloc_f32(N, 1);
        tgt = alloc_f32(N, 1);
        se = bk_calloc((size_t)N, sizeof(double));
        if (!wb || !lg || !mx || !tgt || !se)
            st = bk_error(BK_ERR_NOMEM, "forward nll: out of memory for %lld rows",
                          (long long)N);
    }
    if (st == BK_OK) {
        rmsnorm_rows(h, N, f->dim.hidden, hc.norm, f->eps, f->x);
        for (int64_t r = 0; r < N; r++) {
            mx[r] = -INFINITY;
            tgt[r] = NAN;
        }
        /* online log-sum-exp over vocabulary blocks */
        for (int64_t v0 = 0; v0 < V; v0 += vc) {
            int64_t n = V - v0 < vc ? V - v0 : vc;
            if ((st = head_block(f, &hc, N, v0, n, wb, lg, n)) != BK_OK)
                break;
            for (int64_t r = 0; r < N; r++) {
                int64_t t = r % T;
                if (t == T - 1)
                    continue;
                const float *row = lg + r * n;
                float cm = row[0];
                for (int64_t j = 1; j < n; j++)
                    cm = row[j] > cm ? row[j] : cm;
                if (cm > mx[r]) {
                    if (se[r] > 0.0)
                        se[r] *= exp((double)mx[r] - (double)cm);
                    mx[r] = cm;
                }
                double acc = 0.0;
                float m0 = mx[r];
                for (int64_t j = 0; j < n; j++)
                    acc += (double)expf(row[j] - m0);
                se[r] += acc;
                int64_t y = tokens[r + 1];
                if (y >= v0 && y < v0 + n)
                    tgt[r] = row[y - v0];
            }
        }
    }
    if (st == BK_OK)
        st = bk_fwd_nll_rows(se, mx, tgt, S, T, nll_sum, count);
    free(wb);
    free(lg);
    free(mx);
    free(tgt);
    free(se);
    free(hc.norm);
    return st;
}

/* ---------------------------------------------------------- whole model */

bk_status bk_fwd_check_sequences(const bk_model_config *c, const int32_t *tokens, int64_t S,
                                 int64_t T, int64_t min_T)
{
    if (!tokens || S < 1)
        return bk_error(BK_ERR_CALIB, "input_ids: need at least one sequence (got %lld)",
                        (long long)S);
    if (T < min_T)
        return bk_error(BK_ERR_CALIB,
                        "input_ids: sequence length %lld is too short (need at least %lld tokens)",
                        (long long)T, (long long)min_T);
    if (c->max_positions > 0 && T > c->max_positions)
        return bk_error(BK_ERR_CALIB,
                        "input_ids: sequence length %lld exceeds max_position_embeddings %lld",
                        (long long)T, (long long)c->max_positions);
    return check_tokens(tokens, S, T, c->vocab);
}

int64_t bk_fwd_auto_batch(const bk_model_config *c, int64_t S, int64_t T)
{
    /* keep one micro-batch's widest activation (intermediate) and attention
     * scores around 64 MiB */
    int64_t per_seq = T * (c->intermediate + 4 * c->hidden) * 4 + c->n_heads * T * T * 4;
    int64_t b = (int64_t)(64ll << 20) / (per_seq > 0 ? per_seq : 1);
    if (b < 1)
        b = 1;
    if (b > 64)
        b = 64;
    if (S > 0 && b > S)
        b = S;
    return b;
}
