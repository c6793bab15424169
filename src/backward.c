/* Backward pass through the native model on the CPU, in double precision
 * (docs/hessians.md "Backprop"). The forward arithmetic is that of
 * src/forward.c (docs/forward.md), step by step, in double:
 *
 *   xa = RMSNorm_1(h)                      (input of q, k, v)
 *   zq = xa Wqᵀ + bq, zk, zv               (outputs of q, k, v)
 *   qr = RoPE(q_norm(zq)), kr = RoPE(k_norm(zk))   (norms: Qwen3 only)
 *   P  = causal softmax(qr krᵀ / √hd) per head, o = P v   (GQA: head j reads kv head j/r)
 *   h1 = h + (o Woᵀ + bo)                  (o is the input of o_proj)
 *   xm = RMSNorm_2(h1)                     (input of gate, up)
 *   zg = xm Wgᵀ + bg, zu = xm Wuᵀ + bu, m = silu(zg) ⊙ zu   (m: input of down)
 *   h2 = h1 + (m Wdᵀ + bd)
 *
 * and the backward is its exact adjoint. The layer's forward is recomputed
 * from its input during the backward (activation checkpointing at layer
 * boundaries). */
#include "bakron/backward.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backward_internal.h"
#include "forward_internal.h"
#include "rope.h"
#include "util.h"

struct bk_bwd {
    bk_model_config cfg;
    bk_dims dim;
    double eps;
    bk_rope rope;
    /* the layer's weights as double */
    double *w[BK_MOD_COUNT];
    /* saved forward of the last layer_fwd */
    double *xa, *r1, *zq, *zk, *zv, *qr, *kr, *rq, *rk, *o, *h1, *r2, *xm, *zg, *zu, *m;
    double *tmp;                  /* [R, d] */
    /* backward */
    double *gdown, *dh1, *dx, *dm, *dzg, *dzu, *dob, *dq, *dk, *dv;
    double *P, *dP;               /* [T, T] */
    /* head */
    double *xf, *rf, *dxf;        /* [R, d], [R], [R, d] */
    double *lg, *wb, *mx, *se, *tg; /* logit block, head rows, per-row max/sum/target */
    int64_t vc;                   /* vocabulary rows per block */
    bk_bwd_perturb pert;
};

static double *alloc_d(int64_t a, int64_t b)
{
    uint64_t n;
    if (a < 0 || b < 0 || bk_mul_u64((uint64_t)a, (uint64_t)b, &n) || n > SIZE_MAX / 8)
        return NULL;
    return bk_alloc(n ? (size_t)n : 1, sizeof(double));
}

/* The names of the two-valued enums (index = value). */
static const char *const fisher_names[] = {"model", "empirical"};
static const char *const flow_names[] = {"halving", "naive"};

/* name's index in names[2], or -1 */
static int name_index(const char *const names[2], const char *name)
{
    for (int i = 0; i < 2; i++)
        if (name && !strcmp(name, names[i]))
            return i;
    return -1;
}

const char *bk_fisher_name(bk_fisher_kind k)
{
    return (unsigned)k < 2 ? fisher_names[k] : "?";
}

bk_status bk_fisher_from_name(const char *name, bk_fisher_kind *out)
{
    const int i = name_index(fisher_names, name);
    if (i < 0)
        return bk_error(BK_ERR_INVALID_ARG, "unknown Fisher '%s' (expected model or empirical)",
                        name ? name : "(null)");
    *out = (bk_fisher_kind)i;
    return BK_OK;
}

const char *bk_bwd_flow_name(bk_bwd_flow_kind k)
{
    return (unsigned)k < 2 ? flow_names[k] : "?";
}

bk_status bk_bwd_flow_from_name(const char *name, bk_bwd_flow_kind *out)
{
    const int i = name_index(flow_names, name);
    if (i < 0)
        return bk_error(BK_ERR_INVALID_ARG,
                        "unknown backward flow '%s' (expected halving or naive)",
                        name ? name : "(null)");
    *out = (bk_bwd_flow_kind)i;
    return BK_OK;
}

/* Logit blocks of at most this many entries; LM head rows converted at a time. */
#define BW_LOGIT_BLOCK ((int64_t)1 << 22)
#define BW_HEAD_BLOCK ((int64_t)1 << 21)

int64_t bk__bwd_vocab_block(int64_t rows, int64_t hidden, int64_t vocab)
{
    int64_t vc = BW_LOGIT_BLOCK / rows;
    if (vc > BW_HEAD_BLOCK / hidden)
        vc = BW_HEAD_BLOCK / hidden;
    if (vc < 16)
        vc = 16;
    if (vc > vocab)
        vc = vocab;
    return vc;
}

/* ------------------------------------------------------------ context */

void bk_bwd_free(bk_bwd *b)
{
    if (!b)
        return;
    bk_rope_free(&b->rope);
    for (int i = 0; i < BK_MOD_COUNT; i++)
        free(b->w[i]);
    double *bufs[] = {b->xa,  b->r1,  b->zq,  b->zk,  b->zv,  b->qr,  b->kr,  b->rq,  b->rk,
                      b->o,   b->h1,  b->r2,  b->xm,  b->zg,  b->zu,  b->m,   b->tmp, b->gdown,
                      b->dh1, b->dx,  b->dm,  b->dzg, b->dzu, b->dob, b->dq,  b->dk,  b->dv,
                      b->P,   b->dP,  b->xf,  b->rf,  b->dxf, b->lg,  b->wb,  b->mx,  b->se,
                      b->tg};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    free(b);
}

bk_status bk_bwd_create(const bk_model_config *cfg, int64_t max_seqs, int64_t seqlen,
                        bk_bwd **out)
{
    *out = NULL;
    if (!cfg)
        return bk_error(BK_ERR_INVALID_ARG, "backward: NULL config");
    /* the forward's checks of the config and the micro-batch */
    bk_fwd *probe = NULL;
    bk_status st = bk_fwd_create(cfg, 1, seqlen, &probe);
    bk_fwd_free(probe);
    if (st != BK_OK)
        return bk_error_prefix(st, "backward");
    uint64_t rows;
    if (max_seqs < 1 || bk_mul_u64((uint64_t)max_seqs, (uint64_t)seqlen, &rows) ||
        rows > (uint64_t)INT_MAX)
        return bk_error(BK_ERR_INVALID_ARG,
                        "backward: micro-batch of %lld sequences x %lld tokens is invalid",
                        (long long)max_seqs, (long long)seqlen);
    bk_bwd *b = calloc(1, sizeof *b);
    if (!b)
        return bk_error(BK_ERR_NOMEM, "backward: out of memory");
    b->cfg = *cfg;
    bk__dims_set(&b->dim, cfg, max_seqs, seqlen);
    b->eps = cfg->rms_eps;
    b->pert.layer = -1;
    st = bk_rope_init(&b->rope, cfg, seqlen);
    if (st != BK_OK) {
        free(b);
        return bk_error_prefix(st, "backward");
    }
    const int64_t R = b->dim.rows, d = b->dim.hidden, NI = b->dim.inter, qd = b->dim.qdim, kvd = b->dim.kvdim;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(cfg, (bk_module)i, &o, &in);
        b->w[i] = alloc_d(o, in);
    }
    const int64_t vc = bk__bwd_vocab_block(R, d, cfg->vocab);
    b->vc = vc;
    /* every buffer of doubles with its [rows, cols] */
    const struct {
        double **p;
        int64_t rows, cols;
    } bufs[] = {
        {&b->xa, R, d}, {&b->r1, R, 1}, {&b->zq, R, qd}, {&b->zk, R, kvd}, {&b->zv, R, kvd},
        {&b->qr, R, qd}, {&b->kr, R, kvd}, {&b->rq, R, b->dim.nh}, {&b->rk, R, b->dim.nkv},
        {&b->o, R, qd}, {&b->h1, R, d}, {&b->r2, R, 1}, {&b->xm, R, d}, {&b->zg, R, NI},
        {&b->zu, R, NI}, {&b->m, R, NI}, {&b->tmp, R, d}, {&b->gdown, R, d}, {&b->dh1, R, d},
        {&b->dx, R, d}, {&b->dm, R, NI}, {&b->dzg, R, NI}, {&b->dzu, R, NI}, {&b->dob, R, qd},
        {&b->dq, R, qd}, {&b->dk, R, kvd}, {&b->dv, R, kvd}, {&b->P, seqlen, seqlen},
        {&b->dP, seqlen, seqlen}, {&b->xf, R, d}, {&b->rf, R, 1}, {&b->dxf, R, d}, {&b->lg, R, vc},
        {&b->wb, vc, d}, {&b->mx, R, 1}, {&b->se, R, 1}, {&b->tg, R, 1}
    };
    int ok = 1;
    for (int i = 0; i < BK_MOD_COUNT; i++)
        ok = ok && b->w[i];
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        ok = (*bufs[i].p = alloc_d(bufs[i].rows, bufs[i].cols)) != NULL && ok;
    if (!ok) {
        bk_bwd_free(b);
        return bk_error(BK_ERR_NOMEM,
                        "backward: out of memory for buffers of %lld sequences x %lld tokens "
                        "(use a smaller --batch)",
                        (long long)max_seqs, (long long)seqlen);
    }
    *out = b;
    return BK_OK;
}

void bk__bwd_set_perturb(bk_bwd *b, const bk_bwd_perturb *p)
{
    if (!b)
        return;
    if (p)
        b->pert = *p;
    else {
        memset(&b->pert, 0, sizeof b->pert);
        b->pert.layer = -1;
    }
}

static bk_status check_batch(const bk_bwd *b, int64_t S, const char *what)
{
    if (!b)
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: NULL context", what);
    if (S < 1 || S > b->dim.max_seqs)
        return bk_error(BK_ERR_INVALID_ARG,
                        "backward %s: %lld sequences, the context holds 1..%lld", what,
                        (long long)S, (long long)b->dim.max_seqs);
    return BK_OK;
}

/* ------------------------------------------------------------ kernels */

/* Y[N, out] = X[N, in] W[out, in]^T (+ b) */
static void lin(const double *X, int64_t N, int64_t in, const double *W, int64_t out,
                const float *bias, double *Y)
{
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)out, (int)in, 1.0, X,
                (int)in, W, (int)in, 0.0, Y, (int)out);
    if (bias)
        for (int64_t r = 0; r < N; r++)
            for (int64_t j = 0; j < out; j++)
                Y[r * out + j] += (double)bias[j];
}

/* dX[N, in] (= or +=) dY[N, out] W[out, in] */
static void lin_back(const double *dY, int64_t N, int64_t out, const double *W, int64_t in,
                     double beta, double *dX)
{
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, (int)in, (int)out, 1.0, dY,
                (int)out, W, (int)in, beta, dX, (int)in);
}

/* y = w ⊙ x r, r = (mean(x²) + eps)^(-1/2) per row of n; r[rows] saved. */
static void rms_fwd(const double *x, int64_t rows, int64_t n, const float *w, double eps,
                    double *r, double *y)
{
    for (int64_t i = 0; i < rows; i++) {
        const double *xr = x + i * n;
        double *yr = y + i * n;
        double ss = 0;
        for (int64_t k = 0; k < n; k++)
            ss += xr[k] * xr[k];
        double inv = 1.0 / sqrt(ss / (double)n + eps);
        r[i] = inv;
        for (int64_t k = 0; k < n; k++)
            yr[k] = (double)w[k] * (xr[k] * inv);
    }
}

/* dx (= or +=) adjoint of rms_fwd: dx = r (w ⊙ dy) - r³ x (Σ w dy x) / n. */
static void rms_back(const double *x, const double *r, int64_t rows, int64_t n, const float *w,
                     const double *dy, int accumulate, double *dx)
{
    for (int64_t i = 0; i < rows; i++) {
        const double *xr = x + i * n, *dyr = dy + i * n;
        double *dxr = dx + i * n;
        double ri = r[i], dot = 0;
        for (int64_t k = 0; k < n; k++)
            dot += (double)w[k] * dyr[k] * xr[k];
        double c = ri * ri * ri * dot / (double)n;
        for (int64_t k = 0; k < n; k++) {
            double v = ri * (double)w[k] * dyr[k] - c * xr[k];
            dxr[k] = accumulate ? dxr[k] + v : v;
        }
    }
}

/* Rotate n_heads head vectors of one token at position pos (sign -1: the
 * transpose), with the forward's float32 tables. */
static void rope_d(const bk_rope *rp, double *x, int64_t n_heads, int64_t pos, int sign)
{
    int64_t dd = rp->head_dim, h = dd / 2;
    const float *c = rp->cos + pos * h, *s = rp->sin + pos * h;
    for (int64_t k = 0; k < n_heads; k++) {
        double *v = x + k * dd;
        for (int64_t i = 0; i < h; i++) {
            double a = v[i], bb = v[i + h];
            double sn = sign > 0 ? (double)s[i] : -(double)s[i];
            double cs = (double)c[i];
            v[i] = a * cs - bb * sn;
            v[i + h] = bb * cs + a * sn;
        }
    }
}

static double sigm(double z)
{
    return 1.0 / (1.0 + exp(-z));
}

static void perturb(const bk_bwd *b, int layer, bk_module mod, double *Y, int64_t N,
                    int64_t out)
{
    const bk_bwd_perturb *p = &b->pert;
    if (p->layer == layer && p->mod == mod && p->row >= 0 && p->row < N && p->col >= 0 &&
        p->col < out)
        Y[p->row * out + p->col] += p->delta;
}

static bk_status check_lw(const bk_bwd *b, const bk_layer_weights *lw, const char *what)
{
    if (!lw)
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: NULL layer weights", what);
    for (int i = 0; i < BK_MOD_COUNT; i++)
        if (!lw->w[i])
            return bk_error(BK_ERR_INVALID_ARG, "backward %s: layer %d lacks %s", what,
                            lw->layer, bk_module_name((bk_module)i));
    if (!lw->attn_norm || !lw->mlp_norm)
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: layer %d lacks its norms", what,
                        lw->layer);
    if (b->cfg.qk_norm && (!lw->q_norm || !lw->k_norm))
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: layer %d lacks q_norm/k_norm", what,
                        lw->layer);
    return BK_OK;
}

static void load_weights(bk_bwd *b, const bk_layer_weights *lw)
{
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(&b->cfg, (bk_module)i, &o, &in);
        const float *src = lw->w[i];
        double *dst = b->w[i];
        for (int64_t k = 0; k < o * in; k++)
            dst[k] = (double)src[k];
    }
}

/* One head's attention probabilities P [T, T] = causal softmax(scale q kᵀ)
 * of q [T, hd] (row stride ldq) and k [T, hd] (row stride ldk); the entries
 * above the diagonal 0. The forward and the backward (which forms P again)
 * share it, so both have the same P. */
static void head_probs(const double *q, int ldq, const double *k, int ldk, int64_t T, int64_t hd,
                       double scale, double *P)
{
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)T, (int)hd, scale, q, ldq,
                k, ldk, 0.0, P, (int)T);
    for (int64_t t = 0; t < T; t++) {
        double *row = P + t * T;
        double mx = row[0];
        for (int64_t u = 1; u <= t; u++)
            mx = row[u] > mx ? row[u] : mx;
        double sum = 0;
        for (int64_t u = 0; u <= t; u++) {
            row[u] = exp(row[u] - mx);
            sum += row[u];
        }
        for (int64_t u = 0; u <= t; u++)
            row[u] /= sum;
        for (int64_t u = t + 1; u < T; u++)
            row[u] = 0;
    }
}

/* The layer's forward from hin, saving what the backward needs; hout
 * (may equal hin, or be NULL) receives the output. Weights already loaded. */
static void layer_fwd(bk_bwd *b, const bk_layer_weights *lw, int64_t S, const double *hin,
                      double *hout)
{
    const int64_t T = b->dim.T, N = S * T, d = b->dim.hidden, qd = b->dim.qdim, kvd = b->dim.kvdim, hd = b->dim.hd,
                  NI = b->dim.inter;
    const int L = lw->layer;
    rms_fwd(hin, N, d, lw->attn_norm, b->eps, b->r1, b->xa);
    lin(b->xa, N, d, b->w[BK_MOD_Q], qd, lw->b[BK_MOD_Q], b->zq);
    perturb(b, L, BK_MOD_Q, b->zq, N, qd);
    lin(b->xa, N, d, b->w[BK_MOD_K], kvd, lw->b[BK_MOD_K], b->zk);
    perturb(b, L, BK_MOD_K, b->zk, N, kvd);
    lin(b->xa, N, d, b->w[BK_MOD_V], kvd, lw->b[BK_MOD_V], b->zv);
    perturb(b, L, BK_MOD_V, b->zv, N, kvd);
    if (lw->q_norm) {
        rms_fwd(b->zq, N * b->dim.nh, hd, lw->q_norm, b->eps, b->rq, b->qr);
        rms_fwd(b->zk, N * b->dim.nkv, hd, lw->k_norm, b->eps, b->rk, b->kr);
    } else {
        memcpy(b->qr, b->zq, (size_t)(N * qd) * sizeof(double));
        memcpy(b->kr, b->zk, (size_t)(N * kvd) * sizeof(double));
    }
    for (int64_t n = 0; n < N; n++) {
        rope_d(&b->rope, b->qr + n * qd, b->dim.nh, n % T, +1);
        rope_d(&b->rope, b->kr + n * kvd, b->dim.nkv, n % T, +1);
    }
    const double scale = 1.0 / sqrt((double)hd);
    double *P = b->P;
    for (int64_t s = 0; s < S; s++) {
        const double *qs = b->qr + s * T * qd, *ks = b->kr + s * T * kvd,
                     *vs = b->zv + s * T * kvd;
        double *os = b->o + s * T * qd;
        for (int64_t j = 0; j < b->dim.nh; j++) {
            int64_t g = j / b->dim.rep;
            head_probs(qs + j * hd, (int)qd, ks + g * hd, (int)kvd, T, hd, scale, P);
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)hd, (int)T, 1.0,
                        P, (int)T, vs + g * hd, (int)kvd, 0.0, os + j * hd, (int)qd);
        }
    }
    lin(b->o, N, qd, b->w[BK_MOD_O], d, lw->b[BK_MOD_O], b->tmp);
    perturb(b, L, BK_MOD_O, b->tmp, N, d);
    for (int64_t i = 0; i < N * d; i++)
        b->h1[i] = hin[i] + b->tmp[i];
    rms_fwd(b->h1, N, d, lw->mlp_norm, b->eps, b->r2, b->xm);
    lin(b->xm, N, d, b->w[BK_MOD_GATE], NI, lw->b[BK_MOD_GATE], b->zg);
    perturb(b, L, BK_MOD_GATE, b->zg, N, NI);
    lin(b->xm, N, d, b->w[BK_MOD_UP], NI, lw->b[BK_MOD_UP], b->zu);
    perturb(b, L, BK_MOD_UP, b->zu, N, NI);
    for (int64_t i = 0; i < N * NI; i++) {
        double z = b->zg[i];
        b->m[i] = z * sigm(z) * b->zu[i];
    }
    if (!hout)
        return;
    lin(b->m, N, NI, b->w[BK_MOD_DOWN], d, lw->b[BK_MOD_DOWN], b->tmp);
    perturb(b, L, BK_MOD_DOWN, b->tmp, N, d);
    for (int64_t i = 0; i < N * d; i++)
        hout[i] = b->h1[i] + b->tmp[i];
}

bk_status bk_bwd_layer_forward(bk_bwd *b, const bk_layer_weights *lw, int64_t S, double *h)
{
    bk_status st = check_batch(b, S, "layer forward");
    if (st == BK_OK)
        st = check_lw(b, lw, "layer forward");
    if (st != BK_OK)
        return st;
    if (!h)
        return bk_error(BK_ERR_INVALID_ARG, "backward layer forward: NULL hidden states");
    load_weights(b, lw);
    layer_fwd(b, lw, S, h, h);
    return BK_OK;
}

static bk_status check_grad(const double *g, int64_t rows, int64_t cols, int layer,
                            const char *what)
{
    for (int64_t i = 0; i < rows * cols; i++)
        if (!isfinite(g[i]))
            return bk_error(BK_ERR_NONFINITE,
                            "backward: layer %d %s: non-finite gradient (%s) at token row %lld, "
                            "column %lld",
                            layer, what, isnan(g[i]) ? "NaN" : "Inf", (long long)(i / cols),
                            (long long)(i % cols));
    return BK_OK;
}

bk_status bk_bwd_layer_backward(bk_bwd *b, const bk_layer_weights *lw, int64_t S,
                                const double *h_in, double *dh, bk_grad_taps *taps)
{
    bk_status st = check_batch(b, S, "layer backward");
    if (st == BK_OK)
        st = check_lw(b, lw, "layer backward");
    if (st == BK_OK && (!h_in || !dh))
        st = bk_error(BK_ERR_INVALID_ARG, "backward layer backward: NULL activations");
    if (st != BK_OK)
        return st;
    const int64_t T = b->dim.T, N = S * T, d = b->dim.hidden, qd = b->dim.qdim, kvd = b->dim.kvdim, hd = b->dim.hd,
                  NI = b->dim.inter;
    const int L = lw->layer;
    st = check_grad(dh, N, d, L, "mlp.down_proj (gradient of the layer's output)");
    if (st != BK_OK)
        return st;
    load_weights(b, lw);
    layer_fwd(b, lw, S, h_in, NULL);

    /* MLP: g_down = dh2 */
    memcpy(b->gdown, dh, (size_t)(N * d) * sizeof(double));
    lin_back(dh, N, d, b->w[BK_MOD_DOWN], NI, 0.0, b->dm);
    for (int64_t i = 0; i < N * NI; i++) {
        double z = b->zg[i], sg = sigm(z);
        double dmi = b->dm[i];
        b->dzu[i] = dmi * z * sg;
        b->dzg[i] = dmi * b->zu[i] * sg * (1.0 + z * (1.0 - sg));
    }
    lin_back(b->dzg, N, NI, b->w[BK_MOD_GATE], d, 0.0, b->dx);
    lin_back(b->dzu, N, NI, b->w[BK_MOD_UP], d, 1.0, b->dx);
    /* dh1 = dh2 + RMSNorm_2 adjoint */
    memcpy(b->dh1, dh, (size_t)(N * d) * sizeof(double));
    rms_back(b->h1, b->r2, N, d, lw->mlp_norm, b->dx, 1, b->dh1);

    /* attention: g_o = dh1 */
    lin_back(b->dh1, N, d, b->w[BK_MOD_O], qd, 0.0, b->dob);
    memset(b->dq, 0, (size_t)(N * qd) * sizeof(double));
    memset(b->dk, 0, (size_t)(N * kvd) * sizeof(double));
    memset(b->dv, 0, (size_t)(N * kvd) * sizeof(double));
    const double scale = 1.0 / sqrt((double)hd);
    double *P = b->P, *dP = b->dP;
    for (int64_t s = 0; s < S; s++) {
        const double *qs = b->qr + s * T * qd, *ks = b->kr + s * T * kvd,
                     *vs = b->zv + s * T * kvd, *dos = b->dob + s * T * qd;
        double *dqs = b->dq + s * T * qd, *dks = b->dk + s * T * kvd, *dvs = b->dv + s * T * kvd;
        for (int64_t j = 0; j < b->dim.nh; j++) {
            int64_t g = j / b->dim.rep;
            /* P again (the forward's head_probs) */
            head_probs(qs + j * hd, (int)qd, ks + g * hd, (int)kvd, T, hd, scale, P);
            /* dV[g] += Pᵀ dO; dP = dO Vᵀ */
            cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)T, (int)hd, (int)T, 1.0, P,
                        (int)T, dos + j * hd, (int)qd, 1.0, dvs + g * hd, (int)kvd);
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)T, (int)hd, 1.0,
                        dos + j * hd, (int)qd, vs + g * hd, (int)kvd, 0.0, dP, (int)T);
            /* dS = P ⊙ (dP - rowsum(P ⊙ dP)), into dP */
            for (int64_t t = 0; t < T; t++) {
                double *pr = P + t * T, *dr = dP + t * T;
                double dot = 0;
                for (int64_t u = 0; u <= t; u++)
                    dot += pr[u] * dr[u];
                for (int64_t u = 0; u <= t; u++)
                    dr[u] = pr[u] * (dr[u] - dot);
                for (int64_t u = t + 1; u < T; u++)
                    dr[u] = 0;
            }
            /* dQ = scale dS K; dK[g] += scale dSᵀ Q */
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)hd, (int)T, scale,
                        dP, (int)T, ks + g * hd, (int)kvd, 0.0, dqs + j * hd, (int)qd);
            cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)T, (int)hd, (int)T, scale,
                        dP, (int)T, qs + j * hd, (int)qd, 1.0, dks + g * hd, (int)kvd);
        }
    }
    /* RoPE adjoint (the transposed rotation), then the q/k norm adjoints:
     * dq, dk become the gradients of zq, zk (the q_proj / k_proj outputs) */
    for (int64_t n = 0; n < N; n++) {
        rope_d(&b->rope, b->dq + n * qd, b->dim.nh, n % T, -1);
        rope_d(&b->rope, b->dk + n * kvd, b->dim.nkv, n % T, -1);
    }
    if (lw->q_norm) {
        /* reuse dzg/dzu-sized? no: qd, kvd buffers are small; go through tmp copies */
        double *cq = b->dob; /* do_in is no longer needed */
        memcpy(cq, b->dq, (size_t)(N * qd) * sizeof(double));
        rms_back(b->zq, b->rq, N * b->dim.nh, hd, lw->q_norm, cq, 0, b->dq);
        double *ck = b->tmp; /* [R, d] >= [R, kvd]? use a dedicated copy when not */
        double *own = NULL;
        if (kvd > d) {
            own = alloc_d(N, kvd);
            if (!own)
                return bk_error(BK_ERR_NOMEM, "backward: out of memory");
            ck = own;
        }
        memcpy(ck, b->dk, (size_t)(N * kvd) * sizeof(double));
        rms_back(b->zk, b->rk, N * b->dim.nkv, hd, lw->k_norm, ck, 0, b->dk);
        free(own);
    }
    /* dxa = dq Wq + dk Wk + dv Wv; dh = dh1 + RMSNorm_1 adjoint */
    lin_back(b->dq, N, qd, b->w[BK_MOD_Q], d, 0.0, b->dx);
    lin_back(b->dk, N, kvd, b->w[BK_MOD_K], d, 1.0, b->dx);
    lin_back(b->dv, N, kvd, b->w[BK_MOD_V], d, 1.0, b->dx);
    memcpy(dh, b->dh1, (size_t)(N * d) * sizeof(double));
    rms_back(h_in, b->r1, N, d, lw->attn_norm, b->dx, 1, dh);

    /* every module's output gradient must be finite */
    const double *gs[BK_MOD_COUNT] = {b->dq, b->dk, b->dv, b->dh1, b->dzg, b->dzu, b->gdown};
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(&b->cfg, (bk_module)i, &o, &in);
        st = check_grad(gs[i], N, o, L, bk_module_name((bk_module)i));
        if (st != BK_OK)
            return st;
    }
    st = check_grad(dh, N, d, L, "input_layernorm (gradient of the layer's input)");
    if (st != BK_OK)
        return st;
    if (taps) {
        taps->a[BK_MOD_Q] = taps->a[BK_MOD_K] = taps->a[BK_MOD_V] = b->xa;
        taps->a[BK_MOD_O] = b->o;
        taps->a[BK_MOD_GATE] = taps->a[BK_MOD_UP] = b->xm;
        taps->a[BK_MOD_DOWN] = b->m;
        for (int i = 0; i < BK_MOD_COUNT; i++)
            taps->g[i] = gs[i];
    }
    return BK_OK;
}

/* ------------------------------------------------------------ embedding, head */

static bk_status check_model(const bk_bwd *b, const bk_model *m, const char *what)
{
    if (!m)
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: NULL model", what);
    const bk_model_config *c = bk_model_get_config(m);
    if (c->hidden != b->dim.hidden || c->vocab != b->cfg.vocab)
        return bk_error(BK_ERR_INVALID_ARG, "backward %s: model does not match the context", what);
    return BK_OK;
}

bk_status bk_bwd_embed(bk_bwd *b, const bk_model *m, const int32_t *tokens, int64_t S, double *h)
{
    bk_status st = check_batch(b, S, "embed");
    if (st == BK_OK)
        st = check_model(b, m, "embed");
    if (st == BK_OK)
        st = bk_fwd_check_sequences(&b->cfg, tokens, S, b->dim.T, 1);
    const bk_tensor_info *t = NULL;
    if (st == BK_OK)
        st = bk__fwd_find_matrix_for(m, "embed_tokens.weight", b->cfg.vocab, b->dim.hidden,
                                     "the embedding", &t);
    return st == BK_OK ? bk__fwd_embed_rows(t, tokens, S * b->dim.T, h, BK_DT_F64) : st;
}

typedef struct head {
    const bk_tensor_info *w;
    float *norm;
} head;

bk_status bk__bwd_head_check(const bk_model *m)
{
    const bk_model_config *c = bk_model_get_config(m);
    const bk_tensor_info *t;
    const char *which = c->tie_embeddings ? "embed_tokens.weight" : "lm_head.weight";
    bk_status st = bk__fwd_find_matrix_for(m, which, c->vocab, c->hidden,
                               "the backprop Hessians need the LM head", &t);
    if (st == BK_OK && !bk_model_find(m, -1, "norm.weight"))
        st = bk_error(BK_ERR_MISSING_TENSOR,
                      "model.norm.weight: missing (the backprop Hessians need the final norm)");
    return st;
}

static bk_status head_open(const bk_bwd *b, const bk_model *m, head *hc)
{
    hc->w = NULL;
    hc->norm = NULL;
    bk_status st = bk__bwd_head_check(m);
    if (st != BK_OK)
        return st;
    const char *which = b->cfg.tie_embeddings ? "embed_tokens.weight" : "lm_head.weight";
    st = bk__fwd_find_matrix_for(m, which, b->cfg.vocab, b->dim.hidden, "the LM head", &hc->w);
    const bk_tensor_info *nt = bk_model_find(m, -1, "norm.weight");
    if (st == BK_OK && (nt->ndim != 1 || nt->shape[0] != b->dim.hidden))
        st = bk_error(BK_ERR_SHAPE, "%s: expected shape [%lld]", nt->name, (long long)b->dim.hidden);
    if (st == BK_OK) {
        hc->norm = bk_alloc((size_t)b->dim.hidden, sizeof(float));
        if (!hc->norm)
            return bk_error(BK_ERR_NOMEM, "backward: out of memory");
        st = bk_tensor_to_f32(nt, hc->norm);
    }
    if (st != BK_OK) {
        free(hc->norm);
        hc->norm = NULL;
    }
    return st;
}

/* Pass over the vocabulary blocks: per-row max and Σ exp(l - max) of the
 * logits of xf [N, d]. */
static bk_status head_lse(bk_bwd *b, const head *hc, int64_t N)
{
    const int64_t V = b->cfg.vocab, d = b->dim.hidden;
    for (int64_t r = 0; r < N; r++) {
        b->mx[r] = -INFINITY;
        b->se[r] = 0;
    }
    for (int64_t v0 = 0; v0 < V; v0 += b->vc) {
        int64_t n = V - v0 < b->vc ? V - v0 : b->vc;
        bk_status st = bk__fwd_matrix_rows(hc->w, v0, v0 + n, b->wb, BK_DT_F64);
        if (st != BK_OK)
            return st;
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)n, (int)d, 1.0, b->xf,
                    (int)d, b->wb, (int)d, 0.0, b->lg, (int)n);
        for (int64_t r = 0; r < N; r++) {
            const double *row = b->lg + r * n;
            double cm = row[0];
            for (int64_t j = 1; j < n; j++)
                cm = row[j] > cm ? row[j] : cm;
            if (cm > b->mx[r]) {
                b->se[r] *= exp(b->mx[r] - cm);
                b->mx[r] = cm;
            }
            double acc = 0;
            for (int64_t j = 0; j < n; j++)
                acc += exp(row[j] - b->mx[r]);
            b->se[r] += acc;
        }
    }
    for (int64_t r = 0; r < N; r++)
        if (!isfinite(b->mx[r]) || !isfinite(b->se[r]) || !(b->se[r] > 0))
            return bk_error(BK_ERR_NONFINITE,
                            "backward: non-finite logits at token row %lld (the model produced "
                            "NaN/Inf)",
                            (long long)r);
    return BK_OK;
}

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double bk__bwd_uniform(uint64_t seed, int64_t seq, int64_t pos)
{
    uint64_t z = mix64(mix64(mix64(seed) ^ (uint64_t)seq) ^ (uint64_t)pos);
    return (double)(z >> 11) * 0x1.0p-53;
}

bk_status bk_bwd_labels(bk_bwd *b, const bk_model *m, const double *h, const int32_t *tokens,
                        int64_t S, int64_t seq0, bk_fisher_kind fisher, uint64_t seed,
                        int32_t *labels)
{
    bk_status st = check_batch(b, S, "labels");
    if (st == BK_OK)
        st = check_model(b, m, "labels");
    if (st != BK_OK)
        return st;
    const int64_t T = b->dim.T, N = S * T, V = b->cfg.vocab, d = b->dim.hidden;
    if (fisher == BK_FISHER_EMPIRICAL) {
        if (!tokens)
            return bk_error(BK_ERR_INVALID_ARG, "backward labels: the empirical Fisher needs tokens");
        if (T < 2)
            return bk_error(BK_ERR_CALIB,
                            "calibration sequences of %lld token have no next-token label "
                            "(--fisher empirical needs --seqlen >= 2)",
                            (long long)T);
        for (int64_t r = 0; r < N; r++)
            labels[r] = (r % T == T - 1) ? -1 : tokens[r + 1];
        return BK_OK;
    }
    if (fisher != BK_FISHER_MODEL)
        return bk_error(BK_ERR_INVALID_ARG, "backward labels: unknown Fisher %d", (int)fisher);
    head hc;
    st = head_open(b, m, &hc);
    if (st != BK_OK)
        return st;
    rms_fwd(h, N, d, hc.norm, b->eps, b->rf, b->xf);
    st = head_lse(b, &hc, N);
    if (st == BK_OK) {
        /* inverse CDF: label = the first v with Σ_{u<=v} exp(l_u - max) > U·Σ */
        for (int64_t r = 0; r < N; r++) {
            b->tg[r] = bk__bwd_uniform(seed, seq0 + r / T, r % T) * b->se[r];
            labels[r] = -1;
        }
        double *cum = b->dxf; /* [R, d] >= R doubles: running sums */
        int32_t *last = malloc((size_t)N * sizeof(int32_t));
        if (!last) {
            free(hc.norm);
            return bk_error(BK_ERR_NOMEM, "backward labels: out of memory");
        }
        for (int64_t r = 0; r < N; r++) {
            cum[r] = 0;
            last[r] = (int32_t)(V - 1);
        }
        for (int64_t v0 = 0; v0 < V && st == BK_OK; v0 += b->vc) {
            int64_t n = V - v0 < b->vc ? V - v0 : b->vc;
            st = bk__fwd_matrix_rows(hc.w, v0, v0 + n, b->wb, BK_DT_F64);
            if (st != BK_OK)
                break;
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)n, (int)d, 1.0,
                        b->xf, (int)d, b->wb, (int)d, 0.0, b->lg, (int)n);
            for (int64_t r = 0; r < N; r++) {
                if (labels[r] >= 0)
                    continue;
                const double *row = b->lg + r * n;
                for (int64_t j = 0; j < n; j++) {
                    double e = exp(row[j] - b->mx[r]);
                    if (e > 0)
                        last[r] = (int32_t)(v0 + j);
                    cum[r] += e;
                    if (cum[r] > b->tg[r]) {
                        labels[r] = (int32_t)(v0 + j);
                        break;
                    }
                }
            }
        }
        /* rounding left U·Σ above the total: the last token of positive probability */
        for (int64_t r = 0; r < N && st == BK_OK; r++)
            if (labels[r] < 0)
                labels[r] = last[r];
        free(last);
    }
    free(hc.norm);
    return st;
}

bk_status bk_bwd_head(bk_bwd *b, const bk_model *m, const double *h, const int32_t *labels,
                      int64_t S, double *dh, double *loss)
{
    bk_status st = check_batch(b, S, "head");
    if (st == BK_OK)
        st = check_model(b, m, "head");
    if (st == BK_OK && (!h || !labels))
        st = bk_error(BK_ERR_INVALID_ARG, "backward head: NULL argument");
    if (st != BK_OK)
        return st;
    const int64_t T = b->dim.T, N = S * T, V = b->cfg.vocab, d = b->dim.hidden;
    for (int64_t r = 0; r < N; r++)
        if (labels[r] >= V)
            return bk_error(BK_ERR_INVALID_ARG, "backward head: label %d outside [0, %lld)",
                            (int)labels[r], (long long)V);
    head hc;
    st = head_open(b, m, &hc);
    if (st != BK_OK)
        return st;
    rms_fwd(h, N, d, hc.norm, b->eps, b->rf, b->xf);
    st = head_lse(b, &hc, N);
    double lsum = 0;
    if (st == BK_OK && dh)
        memset(b->dxf, 0, (size_t)(N * d) * sizeof(double));
    for (int64_t v0 = 0; v0 < V && st == BK_OK; v0 += b->vc) {
        int64_t n = V - v0 < b->vc ? V - v0 : b->vc;
        st = bk__fwd_matrix_rows(hc.w, v0, v0 + n, b->wb, BK_DT_F64);
        if (st != BK_OK)
            break;
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)N, (int)n, (int)d, 1.0, b->xf,
                    (int)d, b->wb, (int)d, 0.0, b->lg, (int)n);
        for (int64_t r = 0; r < N; r++) {
            double *row = b->lg + r * n;
            int32_t y = labels[r];
            if (y < 0) {
                for (int64_t j = 0; j < n; j++)
                    row[j] = 0;
                continue;
            }
            double lse = b->mx[r] + log(b->se[r]);
            if (y >= v0 && y < v0 + n)
                lsum += lse - row[y - v0];
            for (int64_t j = 0; j < n; j++)
                row[j] = exp(row[j] - lse) - (v0 + j == y ? 1.0 : 0.0);
        }
        if (dh) /* dxf += dlogits W_block */
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)N, (int)d, (int)n, 1.0,
                        b->lg, (int)n, b->wb, (int)d, 1.0, b->dxf, (int)d);
    }
    if (st == BK_OK && dh) {
        rms_back(h, b->rf, N, d, hc.norm, b->dxf, 0, dh);
        st = check_grad(dh, N, d, (int)b->cfg.n_layers, "model.norm (gradient of the last layer's output)");
    }
    if (st == BK_OK && loss)
        *loss += lsum;
    free(hc.norm);
    return st;
}
