/* hessian.c — Kronecker-factored Hessians H ≈ A ⊗ B per linear module
 * (paper section 4, appendix A, Table 4). The derivations, the exact formulas
 * implemented here and their cost are in docs/hessians.md; the notation below
 * follows it:
 *
 *   W [m, n] = [out, in]; vec column-major; H = A ⊗ B, A [n, n], B [m, m].
 *   N tokens per micro-batch (S sequences of T), P = S·T(T+1)/2 causal pairs.
 *
 *   gptq          A = (1/N) Σ x xᵀ                          B = I (NULL)
 *   gate/up K-FAC A = (1/N) Σ x xᵀ                          B = ((1/N) Σ g gᵀ) ⊙ DᵀD
 *   gate/up Shampoo A = (1/N) Σ (gᵀ diag(DᵀD) g) x xᵀ       B = ((1/N) Σ |x|² g gᵀ) ⊙ DᵀD
 *                                       (f in place of g for gate_proj)
 *   q K-FAC       A = (1/N) Σ x xᵀ          B = (1/P) Σ_t blockdiag_j B_t^j
 *   q Shampoo     A = (1/P) Σ_t tr(B_t) x_t x_tᵀ            B = (1/P) Σ_t |x_t|² B_t
 *       B_t^j = J_tjᵀ R_tᵀ (Σ_{u<=t} k_u k_uᵀ) R_t J_tj   (k of the kv head of j)
 *   k             the same with B_u^κ = J_uκᵀ R_uᵀ (Σ_{t>=u} Σ_{j in κ} q_t^j q_t^jᵀ) R_u J_uκ
 *   v K-FAC       A = (1/N) Σ x xᵀ          B = blockdiag_κ Σ_{j in κ} O_jᵀ O_j
 *   v Shampoo     A = tr(B_O) (1/N) Σ x xᵀ  B = ((1/N) Σ |x|²) B_O
 *
 * R_t is the RoPE rotation of position t, J the Jacobian of q_norm / k_norm
 * (identity without them). Shampoo factors are one power-iteration step of
 * the rearranged Hessian from the identity; bk_hess_set_start replaces the
 * identity by given factors, so that repeated passes continue the iteration.
 *
 * Large Gram matrices are accumulated with ?syrk in F32 or F64; the small
 * per-head h×h blocks of the attention factors are always accumulated in
 * double. */
#include "bakron/hessian.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backward_internal.h"
#include "forward_internal.h"
#include "hess_blocks.h"
#include "rope.h"
#include "util.h"

/* ------------------------------------------------------------------ names */

/* The registry of the kinds, one line each in bk_hessian_kind's order: the
 * name (--hessian, report.json) and what the factors need. mlp2: gate/up
 * two-sided (the MLP-local output factors); attn2: q/k/v two-sided (the
 * attention-local output factors: the stages hand the full-precision
 * queries/keys); shampoo: one Shampoo power step (the GPTQ proxy loss of a
 * two-sided module needs the plain E[x xᵀ] too); backprop: every module
 * two-sided from the backpropagated output gradients (bk_hess_add_grad). */
static const struct kind_info {
    const char *name;
    unsigned char mlp2, attn2, shampoo, backprop;
} kinds[BK_HESS_COUNT] = {
    {"rtn", 0, 0, 0, 0},
    {"gptq", 0, 0, 0, 0},
    {"mlplocal-kfac", 1, 0, 0, 0},
    {"mlplocal-shampoo", 1, 0, 1, 0},
    {"fullylocal-kfac", 1, 1, 0, 0},
    {"fullylocal-shampoo", 1, 1, 1, 0},
    {"backprop-kfac", 0, 0, 0, 1},
    {"backprop-shampoo", 0, 0, 1, 1},
};

static const struct kind_info *kind_of(bk_hessian_kind k)
{
    static const struct kind_info none = {"?", 0, 0, 0, 0};
    return (unsigned)k < BK_HESS_COUNT ? &kinds[k] : &none;
}

const char *bk_hessian_name(bk_hessian_kind k)
{
    return kind_of(k)->name;
}

bk_status bk_hessian_from_name(const char *name, bk_hessian_kind *out)
{
    if (!name || !out)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL name");
    char expected[512] = "";
    size_t len = 0;
    for (int k = 0; k < BK_HESS_COUNT; k++) {
        if (strcmp(name, kinds[k].name) == 0) {
            *out = (bk_hessian_kind)k;
            return BK_OK;
        }
        const char *sep = k == 0 ? "" : k + 1 < BK_HESS_COUNT ? ", " : " or ";
        int n = snprintf(expected + len, sizeof expected - len, "%s%s", sep, kinds[k].name);
        if (n > 0 && (size_t)n < sizeof expected - len)
            len += (size_t)n;
    }
    return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown Hessian '%s' (expected %s)", name,
                    expected);
}

static int kind_mlp2(bk_hessian_kind k)
{
    return kind_of(k)->mlp2;
}

static int kind_attn2(bk_hessian_kind k)
{
    return kind_of(k)->attn2;
}

static int kind_shampoo(bk_hessian_kind k)
{
    return kind_of(k)->shampoo;
}

int bk_hessian_is_backprop(bk_hessian_kind k)
{
    return kind_of(k)->backprop;
}

int bk__hessian_needs_qk(bk_hessian_kind k)
{
    return kind_attn2(k);
}

int bk__hessian_keeps_plain(bk_hessian_kind k)
{
    return kind_shampoo(k);
}

int bk_hessian_is_two_sided(bk_hessian_kind k, bk_module mod)
{
    if (bk_hessian_is_backprop(k) && (unsigned)mod < BK_MOD_COUNT)
        return 1;
    if ((mod == BK_MOD_GATE || mod == BK_MOD_UP) && kind_mlp2(k))
        return 1;
    if ((mod == BK_MOD_Q || mod == BK_MOD_K || mod == BK_MOD_V) && kind_attn2(k))
        return 1;
    return 0;
}

/* ------------------------------------------------------------ the struct */

/* Sum of (weighted) outer products, n×n, upper triangle of a row-major
 * array, in float or double. */
typedef struct gram {
    int64_t n;
    void *s;
} gram;


struct bk_hess_acc {
    bk_model_config cfg;
    bk_hessian_kind kind;
    int fp64, mlp2, attn2, shampoo, qknorm;
    bk_dims dim;
    bk_rope rope;
    int have_rope;

    int layer;                /* layer of the first add since reset, -1 before */
    int broken;               /* an add failed half-way: only reset helps */
    int64_t count[G_COUNT];   /* tokens added per group */
    int64_t n_pairs;          /* causal (query, key) pairs, fully-local */

    gram x_attn, x_o, x_mlp, x_down;   /* Σ x xᵀ */
    gram a_q, a_k, a_gate, a_up;       /* Shampoo: weighted Σ w x xᵀ */
    gram b_gate, b_up;                 /* Σ w f fᵀ, Σ w g gᵀ */
    double *bq;                        /* [H][hd][hd] (no qk-norm: block of the group's first head) */
    double *bk;                        /* [G][hd][hd] */
    double *bv;                        /* [G][hd][hd] Σ_{j in κ} O_jᵀ O_j, set by the first add */
    int have_bv;
    double v_wb;                       /* Shampoo v: Σ |x|² (or Σ xᵀ A0 x) */
    double down_fp[3];                 /* fingerprint of W_down at the first add_mlp */
    int have_down_fp;
    float *dcol2;                      /* [NI] diag(DᵀD) */

    /* power-iteration starts (Shampoo kinds; NULL = identity) */
    float *startA[BK_MOD_COUNT];       /* [n, n] */
    float *startB[BK_MOD_COUNT];       /* gate/up: [NI, NI]; NULL for q/k/v (see blocks) */
    double *startBblk[BK_MOD_COUNT];   /* q: [H][hd][hd], k/v: [G][hd][hd] diagonal blocks */
    float *mlpE[BK_MOD_COUNT];         /* gate/up: start B ⊙ DᵀD, made at the first add */

    float *outA[BK_MOD_COUNT], *outB[BK_MOD_COUNT];

    /* backprop kinds (docs/hessians.md "Backprop") */
    int bp;
    gram a_bp[BK_MOD_COUNT];           /* Shampoo: Σ |g|² a aᵀ per module */
    double *gB[BK_MOD_COUNT];          /* Σ w g gᵀ, upper triangle, double (w = |a|² or 1) */
    int64_t gcount[BK_MOD_COUNT];      /* gradient rows added */
    double *gw[BK_MOD_COUNT];          /* Shampoo: |g_t|² of every token added, in order */
    int64_t gw_cap[BK_MOD_COUNT];
    /* this process's own tokens (gcount and count also hold the sums received
     * from other MPI ranks): the Shampoo weights gw are indexed by these */
    int64_t gw_n[BK_MOD_COUNT];        /* token weights recorded here */
    int64_t own[G_COUNT];              /* input tokens added here */
};

static bk_status bp_add_input(bk_hess_acc *a, int layer, int grp, const float *x, int64_t S,
                              int64_t width, const char *what);
static bk_status grad_room(bk_hess_acc *a, int layer, bk_module mod, int64_t m, int64_t more);
static float *out_buf(float **slot, int64_t n);

int bk__hess_module_group(bk_module mod)
{
    switch (mod) {
    case BK_MOD_Q:
    case BK_MOD_K:
    case BK_MOD_V: return G_ATTN;
    case BK_MOD_O: return G_O;
    case BK_MOD_GATE:
    case BK_MOD_UP: return G_MLP;
    default: return G_DOWN;
    }
}

void bk__hess_groups(unsigned modules, int grp[G_COUNT])
{
    for (int g = 0; g < G_COUNT; g++)
        grp[g] = 0;
    for (int m = 0; m < BK_MOD_COUNT; m++)
        if (modules & (1u << m))
            grp[bk__hess_module_group((bk_module)m)] = 1;
}

bk_status bk__hess_check_broken(int broken, const char *what, const char *reset)
{
    if (broken)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: an earlier add failed part-way and left the accumulator "
                        "inconsistent (call %s)",
                        what, reset);
    return BK_OK;
}

bk_status bk__hess_check_layer(int broken, int has_lw, int lw_layer, int acc_layer,
                               const char *what, const char *reset)
{
    bk_status st = bk__hess_check_broken(broken, what, reset);
    if (st != BK_OK)
        return st;
    if (!has_lw)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: %s: NULL layer weights", what);
    if (acc_layer >= 0 && lw_layer != acc_layer)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: weights of layer %d given to an accumulator holding layer "
                        "%d (call %s between layers)",
                        what, lw_layer, acc_layer, reset);
    return BK_OK;
}

bk_status bk__hess_check_input(int has_acc, int broken, const void *x, const char *what,
                               const char *reset)
{
    if (!has_acc)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if (!x)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: %s is NULL", what);
    return bk__hess_check_broken(broken, what, reset);
}

bk_status bk__hess_check_factors(const char *what, int64_t count, const char *add, int has_lw,
                                 int lw_layer, int acc_layer)
{
    if (count == 0)
        return bk_error(BK_ERR_CALIB,
                        "hessian: %s: no calibration samples were added for this layer (call "
                        "%s first)",
                        what, add);
    if (has_lw && lw_layer != acc_layer)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: factors asked with the weights of layer %d, accumulated "
                        "for layer %d",
                        what, lw_layer, acc_layer);
    return BK_OK;
}

bk_status bk__hess_check_attn(bk_hessian_kind kind, int attn2, int qknorm, int lw_layer,
                              const void *attn_in, int has_qk_rot, int has_o, int has_qk_norm)
{
    if (!attn_in)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: layer %d: attn_in is NULL", lw_layer);
    if (!attn2)
        return BK_OK;
    if (!has_qk_rot)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: layer %d: %s needs the rotated queries and keys (q_rot "
                        "and k_rot are required)",
                        lw_layer, bk_hessian_name(kind));
    if (!has_o)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: layer %d: self_attn.o_proj weight missing (needed for the "
                        "v_proj output factor)",
                        lw_layer);
    if (qknorm && !has_qk_norm)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: layer %d: q_norm/k_norm model needs self_attn.q_proj, "
                        "k_proj, q_norm and k_norm weights",
                        lw_layer);
    return BK_OK;
}

bk_status bk__hess_check_mlp(bk_hessian_kind kind, int mlp2, int lw_layer, int has_weights)
{
    if (mlp2 && !has_weights)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: layer %d: %s needs the mlp.gate_proj, up_proj and down_proj "
                        "weights",
                        lw_layer, bk_hessian_name(kind));
    return BK_OK;
}

size_t bk__hess_scalars_pack(const int grp[G_COUNT], const int64_t count[G_COUNT],
                             int64_t n_pairs, double v_wb, double *sc)
{
    size_t k = 0;
    for (int g = 0; g < G_COUNT; g++)
        if (grp[g])
            sc[k++] = (double)count[g];
    if (grp[G_ATTN]) {
        sc[k++] = (double)n_pairs;
        sc[k++] = v_wb;
    }
    return k;
}

void bk__hess_scalars_unpack(const int grp[G_COUNT], const double *sc, int64_t count[G_COUNT],
                             int64_t *n_pairs, double *v_wb)
{
    size_t k = 0;
    for (int g = 0; g < G_COUNT; g++)
        if (grp[g])
            count[g] = (int64_t)sc[k++];
    if (grp[G_ATTN]) {
        *n_pairs = (int64_t)sc[k++];
        *v_wb = sc[k++];
    }
}

static const char *group_add_name(int g)
{
    static const char *const n[G_COUNT] = {"bk_hess_add_attn", "bk_hess_add_o", "bk_hess_add_mlp",
                                           "bk_hess_add_down"};
    return n[g];
}

/* ---------------------------------------------------------------- grams */

static bk_status gram_init(bk_hess_acc *a, gram *g, int64_t n)
{
    g->n = n;
    g->s = bk_calloc((size_t)n * (size_t)n, a->fp64 ? sizeof(double) : sizeof(float));
    if (!g->s)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory for a %lld x %lld accumulator",
                        (long long)n, (long long)n);
    return BK_OK;
}

static void gram_zero(bk_hess_acc *a, gram *g)
{
    if (g->s)
        memset(g->s, 0, (size_t)g->n * (size_t)g->n * (a->fp64 ? sizeof(double) : sizeof(float)));
}

#define GRAM_CHUNK 256

/* g += Σ_r w_r x_r x_rᵀ over `rows` rows of X [rows, n] (w NULL: all 1;
 * every w_r >= 0). */
static bk_status gram_add(bk_hess_acc *a, gram *g, const float *X, int64_t rows,
                          const double *w)
{
    int64_t n = g->n;
    if (rows <= 0)
        return BK_OK;
    if (!a->fp64 && !w) {
        for (int64_t r0 = 0; r0 < rows; r0 += 65536) {
            int64_t k = rows - r0 < 65536 ? rows - r0 : 65536;
            cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)k, 1.0f,
                        X + r0 * n, (int)n, 1.0f, (float *)g->s, (int)n);
        }
        return BK_OK;
    }
    int64_t ch = rows < GRAM_CHUNK ? rows : GRAM_CHUNK;
    void *buf = bk_alloc((size_t)(ch * n), a->fp64 ? sizeof(double) : sizeof(float));
    if (!buf)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory for a %lld x %lld block",
                        (long long)ch, (long long)n);
    for (int64_t r0 = 0; r0 < rows; r0 += ch) {
        int64_t k = rows - r0 < ch ? rows - r0 : ch;
        for (int64_t i = 0; i < k; i++) {
            double s = w ? sqrt(w[r0 + i]) : 1.0;
            const float *x = X + (r0 + i) * n;
            if (a->fp64) {
                double *y = (double *)buf + i * n;
                for (int64_t c = 0; c < n; c++)
                    y[c] = s * (double)x[c];
            } else {
                float *y = (float *)buf + i * n;
                for (int64_t c = 0; c < n; c++)
                    y[c] = (float)(s * (double)x[c]);
            }
        }
        if (a->fp64)
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)k, 1.0,
                        (const double *)buf, (int)n, 1.0, (double *)g->s, (int)n);
        else
            cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)n, (int)k, 1.0f,
                        (const float *)buf, (int)n, 1.0f, (float *)g->s, (int)n);
    }
    free(buf);
    return BK_OK;
}

static double gram_get(const bk_hess_acc *a, const gram *g, int64_t i, int64_t j)
{
    if (i > j) {
        int64_t t = i;
        i = j;
        j = t;
    }
    size_t at = (size_t)i * (size_t)g->n + (size_t)j;
    return a->fp64 ? ((const double *)g->s)[at] : (double)((const float *)g->s)[at];
}

/* dst = scale · G, both triangles. */
static void gram_out(const bk_hess_acc *a, const gram *g, double scale, float *dst)
{
    int64_t n = g->n;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i; j < n; j++) {
            float v = (float)(scale * gram_get(a, g, i, j));
            dst[i * n + j] = v;
            dst[j * n + i] = v;
        }
}

/* -------------------------------------------------------------- helpers */

static bk_status check_finite(const float *x, int64_t rows, int64_t cols, int layer,
                              const char *what)
{
    char lab[64] = "";
    if (layer >= 0)
        snprintf(lab, sizeof lab, "layer %d ", layer);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            float v = x[i * cols + j];
            if (!isfinite(v))
                return bk_error(BK_ERR_NONFINITE,
                                "hessian: %s%s: non-finite value %g at row %lld, column %lld "
                                "(activations must be finite)",
                                lab, what, (double)v, (long long)i, (long long)j);
        }
    return BK_OK;
}

/* Number of rows N = S·T, with the size checks shared by every add. */
static bk_status batch_rows(const bk_hess_acc *a, int64_t S, int64_t width, const char *what,
                            int64_t *N)
{
    uint64_t n, cells, bytes;
    if (S <= 0)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: sequence count must be positive (got %lld)", what,
                        (long long)S);
    if (bk_mul_u64((uint64_t)S, (uint64_t)a->dim.T, &n) || n > (uint64_t)INT32_MAX ||
        bk_mul_u64(n, (uint64_t)width, &cells) || bk_mul_u64(cells, sizeof(double), &bytes) ||
        bytes > (uint64_t)SIZE_MAX / 2)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: micro-batch of %lld sequences x %lld tokens is too large",
                        what, (long long)S, (long long)a->dim.T);
    *N = (int64_t)n;
    return BK_OK;
}

static bk_status check_broken(const bk_hess_acc *a, const char *what)
{
    return bk__hess_check_broken(a->broken, what, "bk_hess_acc_reset");
}

static bk_status check_layer(bk_hess_acc *a, const bk_layer_weights *lw, const char *what)
{
    return bk__hess_check_layer(a->broken, lw != NULL, lw ? lw->layer : -1, a->layer, what,
                                "bk_hess_acc_reset");
}

/* Fingerprint of a weight matrix (exactly reproducible: fixed order). */
static void fingerprint(const float *w, int64_t n, double fp[3])
{
    double s = 0, s2 = 0, si = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = w[i];
        s += v;
        s2 += v * v;
        si += v * (double)(i % 9973);
    }
    fp[0] = s;
    fp[1] = s2;
    fp[2] = si;
}

/* w_r = x_rᵀ A0 x_r for rows of X [rows, n]; A0 [n, n] symmetric. */
static bk_status quad_weights(const float *X, int64_t rows, int64_t n, const float *A0,
                              double *w)
{
    float *y = bk_alloc((size_t)(rows * n), sizeof(float));
    if (!y)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory for %lld x %lld weights",
                        (long long)rows, (long long)n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, (int)n, (int)n, 1.0f, X,
                (int)n, A0, (int)n, 0.0f, y, (int)n);
    for (int64_t i = 0; i < rows; i++) {
        double s = 0;
        for (int64_t c = 0; c < n; c++)
            s += (double)y[i * n + c] * (double)X[i * n + c];
        w[i] = s;
    }
    free(y);
    return BK_OK;
}

static double sq_norm(const float *x, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * (double)x[i];
    return s;
}

/* Weights of a power step must be >= 0 (they come from PSD factors);
 * rounding may leave tiny negative values, which are zeroed. */
static bk_status clamp_weights(double *w, int64_t n, int layer, bk_module mod)
{
    double mx = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(w[i]) > mx)
            mx = fabs(w[i]);
    for (int64_t i = 0; i < n; i++) {
        if (w[i] < 0) {
            if (w[i] >= -1e-5 * mx) {
                w[i] = 0;
            } else {
                return bk_error(BK_ERR_INVALID_ARG,
                                "hessian: layer %d %s: the start factors given to "
                                "bk_hess_set_start are not positive semidefinite (weight %g at "
                                "row %lld)",
                                layer, bk_module_name(mod), w[i], (long long)i);
            }
        }
    }
    return BK_OK;
}

/* --------------------------------------------------------- create / free */

void bk_hess_acc_free(bk_hess_acc *a)
{
    if (!a)
        return;
    gram *gs[] = {BK_HESS_GRAMS(a)};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
        free(gs[i]->s);
    free(a->bq);
    free(a->bk);
    free(a->bv);
    free(a->dcol2);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        free(a->startA[m]);
        free(a->startB[m]);
        free(a->startBblk[m]);
        free(a->mlpE[m]);
        free(a->outA[m]);
        free(a->outB[m]);
        free(a->a_bp[m].s);
        free(a->gB[m]);
        free(a->gw[m]);
    }
    if (a->have_rope)
        bk_rope_free(&a->rope);
    free(a);
}

bk_status bk_hess_acc_create(const bk_model_config *cfg, bk_hessian_kind kind, int fp64,
                             int64_t seqlen, bk_hess_acc **out)
{
    bk_status st;
    if (!out)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL output pointer");
    *out = NULL;
    if (!cfg)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL model config");
    if ((unsigned)kind >= BK_HESS_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown Hessian kind %d", (int)kind);
    if (seqlen <= 0)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: sequence length must be positive (got %lld)",
                        (long long)seqlen);
    if (cfg->hidden <= 0 || cfg->intermediate <= 0 || cfg->n_heads <= 0 ||
        cfg->n_kv_heads <= 0 || cfg->head_dim <= 0)
        return bk_error(BK_ERR_SHAPE,
                        "hessian: config: hidden %lld, intermediate %lld, heads %lld, kv heads "
                        "%lld, head_dim %lld must all be positive",
                        (long long)cfg->hidden, (long long)cfg->intermediate,
                        (long long)cfg->n_heads, (long long)cfg->n_kv_heads,
                        (long long)cfg->head_dim);
    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return bk_error(BK_ERR_SHAPE,
                        "hessian: config: num_attention_heads %lld is not a multiple of "
                        "num_key_value_heads %lld",
                        (long long)cfg->n_heads, (long long)cfg->n_kv_heads);
    const int64_t lim = 1 << 20; /* BLAS takes int dimensions */
    if (cfg->hidden > lim || cfg->intermediate > lim || cfg->n_heads * cfg->head_dim > lim ||
        seqlen > lim)
        return bk_error(BK_ERR_SHAPE,
                        "hessian: config: dimensions above %lld are not supported (hidden %lld, "
                        "intermediate %lld, heads x head_dim %lld, seqlen %lld)",
                        (long long)lim, (long long)cfg->hidden, (long long)cfg->intermediate,
                        (long long)(cfg->n_heads * cfg->head_dim), (long long)seqlen);
    if (kind_mlp2(kind) && cfg->hidden_act[0] && strcmp(cfg->hidden_act, "silu") != 0)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "hessian: %s: hidden_act '%s' is not supported (only silu)",
                        bk_hessian_name(kind), cfg->hidden_act);
    if (kind_attn2(kind) && cfg->head_dim % 2 != 0)
        return bk_error(BK_ERR_SHAPE, "hessian: %s: head_dim %lld must be even (RoPE)",
                        bk_hessian_name(kind), (long long)cfg->head_dim);

    bk_hess_acc *a = calloc(1, sizeof *a);
    if (!a)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory");
    a->cfg = *cfg;
    a->kind = kind;
    a->fp64 = fp64 ? 1 : 0;
    a->mlp2 = kind_mlp2(kind);
    a->attn2 = kind_attn2(kind);
    a->shampoo = kind_shampoo(kind);
    a->qknorm = cfg->qk_norm ? 1 : 0;
    bk__dims_set(&a->dim, cfg, 1, seqlen); /* (max_seqs and rows unused) */
    a->layer = -1;
    a->bp = bk_hessian_is_backprop(kind);

    if (kind == BK_HESS_RTN) {
        *out = a;
        return BK_OK;
    }
    if ((st = gram_init(a, &a->x_attn, a->dim.hidden)) != BK_OK || (st = gram_init(a, &a->x_o, a->dim.qdim)) ||
        (st = gram_init(a, &a->x_down, a->dim.inter)))
        goto fail;
    if (!a->mlp2 || !a->shampoo)
        if ((st = gram_init(a, &a->x_mlp, a->dim.hidden)) != BK_OK)
            goto fail;
    if (a->mlp2) {
        if ((st = gram_init(a, &a->b_gate, a->dim.inter)) || (st = gram_init(a, &a->b_up, a->dim.inter)))
            goto fail;
        if (a->shampoo)
            if ((st = gram_init(a, &a->a_gate, a->dim.hidden)) || (st = gram_init(a, &a->a_up, a->dim.hidden)))
                goto fail;
        a->dcol2 = bk_alloc((size_t)a->dim.inter, sizeof(float));
        if (!a->dcol2)
            goto nomem;
    }
    if (a->bp && a->shampoo) {
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            int64_t o, in;
            bk_module_shape(cfg, (bk_module)m, &o, &in);
            if ((st = gram_init(a, &a->a_bp[m], in)) != BK_OK)
                goto fail;
        }
    }
    if (a->attn2) {
        size_t hh = (size_t)(a->dim.hd * a->dim.hd);
        a->bq = bk_calloc((size_t)a->dim.nh * hh, sizeof(double));
        a->bk = bk_calloc((size_t)a->dim.nkv * hh, sizeof(double));
        a->bv = bk_calloc((size_t)a->dim.nkv * hh, sizeof(double));
        if (!a->bq || !a->bk || !a->bv)
            goto nomem;
        if (a->shampoo)
            if ((st = gram_init(a, &a->a_q, a->dim.hidden)) || (st = gram_init(a, &a->a_k, a->dim.hidden)))
                goto fail;
        if ((st = bk_rope_init(&a->rope, cfg, seqlen)) != BK_OK) {
            bk_error_prefix(st, "hessian");
            goto fail;
        }
        a->have_rope = 1;
    }
    *out = a;
    return BK_OK;
nomem:
    st = bk_error(BK_ERR_NOMEM, "hessian: out of memory for the %s accumulators",
                  bk_hessian_name(kind));
fail:
    bk_hess_acc_free(a);
    return st;
}

void bk_hess_acc_reset(bk_hess_acc *a)
{
    if (!a)
        return;
    gram *gs[] = {BK_HESS_GRAMS(a)};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
        gram_zero(a, gs[i]);
    size_t hh = (size_t)(a->dim.hd * a->dim.hd);
    if (a->bq)
        memset(a->bq, 0, (size_t)a->dim.nh * hh * sizeof(double));
    if (a->bk)
        memset(a->bk, 0, (size_t)a->dim.nkv * hh * sizeof(double));
    if (a->bv)
        memset(a->bv, 0, (size_t)a->dim.nkv * hh * sizeof(double));
    a->have_bv = 0;
    a->have_down_fp = 0;
    a->broken = 0;
    a->v_wb = 0;
    a->n_pairs = 0;
    for (int g = 0; g < G_COUNT; g++)
        a->count[g] = a->own[g] = 0;
    a->layer = -1;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        gram_zero(a, &a->a_bp[m]);
        if (a->gB[m]) {
            int64_t o, in;
            bk_module_shape(&a->cfg, (bk_module)m, &o, &in);
            memset(a->gB[m], 0, (size_t)(o * o) * sizeof(double));
        }
        a->gcount[m] = a->gw_n[m] = 0;
        free(a->startA[m]);
        free(a->startB[m]);
        free(a->startBblk[m]);
        free(a->mlpE[m]);
        a->startA[m] = a->startB[m] = a->mlpE[m] = NULL;
        a->startBblk[m] = NULL;
    }
}

/* ------------------------------------------------------ sums (MPI ranks) */

static bk_status sums_gram(bk_hess_acc *a, gram *g, bk_hess_sum_fn fn, void *user)
{
    if (!g->s)
        return BK_OK;
    return fn(user, g->s, (size_t)g->n * (size_t)g->n, a->fp64);
}

static const bk_module grp_mods[G_COUNT][3];
static gram *kfac_gram(bk_hess_acc *a, int grp);

int bk__hess_bp_sum_items(unsigned modules, int shampoo, int plain, int items[])
{
    int grp[G_COUNT], k = 0;
    bk__hess_groups(modules, grp);
    for (int g = 0; g < G_COUNT; g++) {
        if (!grp[g])
            continue;
        if (plain)
            items[k++] = -1 - g;
        for (int i = 0; shampoo && i < 3 && grp_mods[g][i] != BK_MOD_COUNT; i++)
            items[k++] = (int)grp_mods[g][i];
    }
    return k;
}

size_t bk__hess_bp_counts_pack(const int grp[G_COUNT], const int64_t count[G_COUNT], double *sc)
{
    size_t k = 0;
    for (int g = 0; g < G_COUNT; g++)
        if (grp[g])
            sc[k++] = (double)count[g];
    return k;
}

void bk__hess_bp_counts_unpack(const int grp[G_COUNT], const double *sc, int64_t count[G_COUNT])
{
    size_t k = 0;
    for (int g = 0; g < G_COUNT; g++)
        if (grp[g])
            count[g] = (int64_t)sc[k++];
}

/* The backprop kinds' input side of the modules' groups: Σ a aᵀ (K-FAC) or
 * per module Σ |g_t|² a_t a_tᵀ (Shampoo, each rank with the weights of its
 * own tokens; E[x xᵀ] is in the job's separate GPTQ accumulator), then the
 * token counts. */
static bk_status bp_input_sums(bk_hess_acc *a, unsigned modules, bk_hess_sum_fn fn, void *user)
{
    int grp[G_COUNT], items[BK_HESS_BP_SUM_ITEMS];
    bk__hess_groups(modules, grp);
    const int n = bk__hess_bp_sum_items(modules, a->shampoo, !a->shampoo, items);
    bk_status st = BK_OK;
    for (int i = 0; i < n && st == BK_OK; i++)
        st = sums_gram(a, items[i] < 0 ? kfac_gram(a, -1 - items[i]) : &a->a_bp[items[i]], fn,
                       user);
    double sc[G_COUNT];
    const size_t k = bk__hess_bp_counts_pack(grp, a->count, sc);
    if (st == BK_OK && k)
        st = fn(user, sc, k, 1);
    if (st != BK_OK)
        return st;
    bk__hess_bp_counts_unpack(grp, sc, a->count);
    return BK_OK;
}

bk_status bk__hess_bp_grad_sums(bk_hess_acc *a, int layer, bk_hess_sum_fn fn, void *user)
{
    if (!a || !a->bp)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: bk__hess_bp_grad_sums: a backprop "
                        "accumulator");
    bk_status st = BK_OK;
    double sc[BK_MOD_COUNT];
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++) {
        int64_t o, in;
        bk_module_shape(&a->cfg, (bk_module)m, &o, &in);
        st = grad_room(a, layer, (bk_module)m, o, 0); /* a rank that receives first */
        if (st == BK_OK)
            st = fn(user, a->gB[m], (size_t)(o * o), 1);
        sc[m] = (double)a->gcount[m];
    }
    if (st == BK_OK)
        st = fn(user, sc, BK_MOD_COUNT, 1);
    if (st != BK_OK)
        return st;
    for (int m = 0; m < BK_MOD_COUNT; m++)
        a->gcount[m] = (int64_t)sc[m];
    return BK_OK;
}

bk_status bk__hess_bp_grad_take(bk_hess_acc *a, bk_module mod, double *G, int *set)
{
    if (!a || !a->bp || (unsigned)mod >= BK_MOD_COUNT || !G || !set)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: bk__hess_bp_grad_take: bad argument");
    *set = 0;
    if (!a->gB[mod])
        return BK_OK;
    int64_t o, in;
    bk_module_shape(&a->cfg, mod, &o, &in);
    memcpy(G, a->gB[mod], (size_t)(o * o) * sizeof(double));
    memset(a->gB[mod], 0, (size_t)(o * o) * sizeof(double));
    *set = 1;
    return BK_OK;
}

bk_status bk_hess_acc_sums(bk_hess_acc *a, unsigned modules, bk_hess_sum_fn fn, void *user)
{
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if (a->bp)
        return bp_input_sums(a, modules, fn, user);
    int grp[G_COUNT];
    bk__hess_groups(modules, grp);
    bk_status st = BK_OK;
    const size_t hh = (size_t)(a->dim.hd * a->dim.hd);
    if (grp[G_ATTN]) {
        if (st == BK_OK)
            st = sums_gram(a, &a->x_attn, fn, user);
        if (st == BK_OK)
            st = sums_gram(a, &a->a_q, fn, user);
        if (st == BK_OK)
            st = sums_gram(a, &a->a_k, fn, user);
        if (st == BK_OK && a->bq)
            st = fn(user, a->bq, (size_t)a->dim.nh * hh, 1);
        if (st == BK_OK && a->bk)
            st = fn(user, a->bk, (size_t)a->dim.nkv * hh, 1);
    }
    if (grp[G_O] && st == BK_OK)
        st = sums_gram(a, &a->x_o, fn, user);
    if (grp[G_MLP]) {
        gram *gs[] = {&a->x_mlp, &a->a_gate, &a->a_up, &a->b_gate, &a->b_up};
        for (size_t i = 0; i < sizeof gs / sizeof gs[0] && st == BK_OK; i++)
            st = sums_gram(a, gs[i], fn, user);
    }
    if (grp[G_DOWN] && st == BK_OK)
        st = sums_gram(a, &a->x_down, fn, user);
    if (st != BK_OK)
        return st;
    /* counts and scalar sums of the groups */
    double sc[G_COUNT + 2];
    st = fn(user, sc, bk__hess_scalars_pack(grp, a->count, a->n_pairs, a->v_wb, sc), 1);
    if (st != BK_OK)
        return st;
    bk__hess_scalars_unpack(grp, sc, a->count, &a->n_pairs, &a->v_wb);
    return BK_OK;
}

/* ------------------------------------------------------ power-step starts */

bk_status bk_hess_set_start(bk_hess_acc *a, bk_module mod, const float *A0, int64_t n,
                            const float *B0, int64_t m)
{
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if ((unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown module %d", (int)mod);
    const char *mn = bk_module_name(mod);
    if (!a->shampoo || !bk_hessian_is_two_sided(a->kind, mod))
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: start factors only apply to two-sided modules of the "
                        "Shampoo kinds (Hessian is %s)",
                        mn, bk_hessian_name(a->kind));
    int64_t mo, ni;
    bk_module_shape(&a->cfg, mod, &mo, &ni);
    if (n != ni || m != mo)
        return bk_error(BK_ERR_SHAPE,
                        "hessian: %s: start factors must be A [%lld, %lld] and B [%lld, %lld] "
                        "(got A [%lld, %lld], B [%lld, %lld])",
                        mn, (long long)ni, (long long)ni, (long long)mo, (long long)mo,
                        (long long)n, (long long)n, (long long)m, (long long)m);
    if (a->count[bk__hess_module_group(mod)] > 0)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: start factors must be set before the first add of the "
                        "layer (call bk_hess_acc_reset first)",
                        mn);
    const float *src[2] = {A0, B0};
    int64_t dim[2] = {n, m};
    for (int s = 0; s < 2; s++) {
        if (!src[s])
            continue;
        const float *M = src[s];
        double mx = 0;
        for (int64_t i = 0; i < dim[s] * dim[s]; i++) {
            if (!isfinite(M[i]))
                return bk_error(BK_ERR_NONFINITE,
                                "hessian: %s: start factor %c has a non-finite value at %lld", mn,
                                s ? 'B' : 'A', (long long)i);
            if (fabs(M[i]) > mx)
                mx = fabs(M[i]);
        }
        for (int64_t i = 0; i < dim[s]; i++)
            for (int64_t j = i + 1; j < dim[s]; j++)
                if (fabs((double)M[i * dim[s] + j] - (double)M[j * dim[s] + i]) > 1e-5 * mx)
                    return bk_error(BK_ERR_INVALID_ARG,
                                    "hessian: %s: start factor %c is not symmetric (entries "
                                    "(%lld, %lld) and (%lld, %lld) differ)",
                                    mn, s ? 'B' : 'A', (long long)i, (long long)j, (long long)j,
                                    (long long)i);
    }
    free(a->startA[mod]);
    free(a->startB[mod]);
    free(a->startBblk[mod]);
    free(a->mlpE[mod]);
    a->startA[mod] = a->startB[mod] = a->mlpE[mod] = NULL;
    a->startBblk[mod] = NULL;
    if (A0) {
        a->startA[mod] = bk_alloc((size_t)(n * n), sizeof(float));
        if (!a->startA[mod])
            return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for the start factor", mn);
        memcpy(a->startA[mod], A0, (size_t)(n * n) * sizeof(float));
    }
    if (B0) {
        if (mod == BK_MOD_GATE || mod == BK_MOD_UP) {
            a->startB[mod] = bk_alloc((size_t)(m * m), sizeof(float));
            if (!a->startB[mod])
                return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for the start factor",
                                mn);
            memcpy(a->startB[mod], B0, (size_t)(m * m) * sizeof(float));
        } else {
            /* only the diagonal head blocks meet the block-structured b */
            int64_t h = a->dim.hd, nb = m / h;
            double *blk = bk_alloc((size_t)(nb * h * h), sizeof(double));
            if (!blk)
                return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for the start factor",
                                mn);
            for (int64_t b = 0; b < nb; b++)
                for (int64_t i = 0; i < h; i++)
                    for (int64_t j = 0; j < h; j++)
                        blk[(b * h + i) * h + j] = B0[(b * h + i) * m + b * h + j];
            a->startBblk[mod] = blk;
        }
    }
    return BK_OK;
}

/* ---------------------------------------------------- attention (q, k, v) */

/* out = R_tᵀ C R_t for a symmetric h×h C (RoPE rotation R_t of position t,
 * rotate_half pairing (i, i + h/2)). tmp: h×h scratch. */
static void rot_sandwich(const bk_rope *rp, int64_t t, const double *C, double *tmp,
                         double *out)
{
    int64_t h = rp->head_dim, h2 = h / 2;
    const float *cs = rp->cos + t * h2, *sn = rp->sin + t * h2;
    /* tmp = C R_t: row a of C R_t is R_tᵀ (row a of C) */
    for (int64_t a = 0; a < h; a++) {
        const double *c = C + a * h;
        double *y = tmp + a * h;
        for (int64_t i = 0; i < h2; i++) {
            double co = cs[i], si = sn[i];
            y[i] = c[i] * co + c[i + h2] * si;
            y[i + h2] = c[i + h2] * co - c[i] * si;
        }
    }
    /* out = R_tᵀ tmp: rows i and i + h/2 mix */
    for (int64_t i = 0; i < h2; i++) {
        double co = cs[i], si = sn[i];
        const double *lo = tmp + i * h, *hi = tmp + (i + h2) * h;
        double *olo = out + i * h, *ohi = out + (i + h2) * h;
        for (int64_t b = 0; b < h; b++) {
            olo[b] = lo[b] * co + hi[b] * si;
            ohi[b] = hi[b] * co - lo[b] * si;
        }
    }
}

/* out = Jᵀ M J with J the Jacobian of z -> γ ⊙ z / sqrt(mean(z²) + eps)
 * (RMSNorm over one head): J = ρ diag(γ) (I - ρ² z zᵀ / h). v: h scratch. */
static void norm_sandwich(const double *M, const float *z, const float *gamma, double eps,
                          int64_t h, double *v, double *out)
{
    double ms = 0;
    for (int64_t i = 0; i < h; i++)
        ms += (double)z[i] * (double)z[i];
    ms /= (double)h;
    double rho2 = 1.0 / (ms + eps), beta = rho2 / (double)h;
    /* out = diag(γ) M diag(γ) */
    for (int64_t i = 0; i < h; i++)
        for (int64_t j = 0; j < h; j++)
            out[i * h + j] = (double)gamma[i] * M[i * h + j] * (double)gamma[j];
    double alpha = 0;
    for (int64_t i = 0; i < h; i++) {
        double s = 0;
        for (int64_t j = 0; j < h; j++)
            s += out[i * h + j] * (double)z[j];
        v[i] = s;
        alpha += (double)z[i] * s;
    }
    /* P out P with P = I - β z zᵀ, times ρ² */
    for (int64_t i = 0; i < h; i++)
        for (int64_t j = 0; j < h; j++) {
            double zi = z[i], zj = z[j];
            double val = out[i * h + j] - beta * zi * v[j] - beta * v[i] * zj +
                         beta * beta * alpha * zi * zj;
            out[i * h + j] = rho2 * val;
        }
}

static double trace(const double *M, int64_t h)
{
    double s = 0;
    for (int64_t i = 0; i < h; i++)
        s += M[i * h + i];
    return s;
}

static double frob_dot(const double *X, const double *Y, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += X[i] * Y[i];
    return s;
}

/* z = X Wᵀ + b over `rows` rows: X [rows, n], W [m, n], z [rows, m]. */
static void project(const float *X, int64_t rows, int64_t n, const float *W, const float *b,
                    int64_t m, float *z)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)m, (int)n, 1.0f, X,
                (int)n, W, (int)n, 0.0f, z, (int)m);
    if (b)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < m; j++)
                z[i * m + j] += b[j];
}

/* B_O^κ = Σ_{j in κ} O_jᵀ O_j, O_j = W_o[:, j h : (j+1) h] (one syrk per
 * query head). */
static bk_status make_bv(bk_hess_acc *a, const float *wo)
{
    int64_t h = a->dim.hd;
    float *tmp = bk_calloc((size_t)(h * h), sizeof(float));
    if (!tmp)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory");
    for (int64_t j = 0; j < a->dim.nh; j++) {
        double *blk = a->bv + (j / a->dim.rep) * h * h;
        memset(tmp, 0, (size_t)(h * h) * sizeof(float));
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)h, (int)a->dim.hidden, 1.0f, wo + j * h,
                    (int)a->dim.qdim, 0.0f, tmp, (int)h);
        for (int64_t p = 0; p < h; p++)
            for (int64_t q = p; q < h; q++) {
                blk[p * h + q] += tmp[p * h + q];
                if (q != p)
                    blk[q * h + p] += tmp[p * h + q];
            }
    }
    free(tmp);
    a->have_bv = 1;
    return BK_OK;
}

bk_status bk_hess_add_attn(bk_hess_acc *a, const bk_layer_weights *lw, const float *attn_in,
                           const float *q_rot, const float *k_rot, int64_t S)
{
    bk_status st;
    int64_t N = 0;
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if ((st = check_layer(a, lw, "bk_hess_add_attn")) != BK_OK)
        return st;
    if (a->bp)
        return bp_add_input(a, lw->layer, G_ATTN, attn_in, S, a->dim.hidden, "attn_in");
    if ((st = bk__hess_check_attn(a->kind, a->attn2, a->qknorm, lw->layer, attn_in,
                                  q_rot && k_rot, lw->w[BK_MOD_O] != NULL,
                                  lw->q_norm && lw->k_norm && lw->w[BK_MOD_Q] && lw->w[BK_MOD_K])) !=
        BK_OK)
        return st;
    if ((st = batch_rows(a, S, a->dim.qdim > a->dim.hidden ? a->dim.qdim : a->dim.hidden,
                         "attn_in", &N)) != BK_OK)
        return st;
    if ((st = check_finite(attn_in, N, a->dim.hidden, lw->layer, "attn_in")) != BK_OK)
        return st;
    if (a->attn2) {
        if ((st = check_finite(q_rot, N, a->dim.qdim, lw->layer, "q_rot")) != BK_OK ||
            (st = check_finite(k_rot, N, a->dim.kvdim, lw->layer, "k_rot")) != BK_OK)
            return st;
    }
    a->layer = lw->layer;
    if (a->kind == BK_HESS_RTN) {
        a->count[G_ATTN] += N;
        return BK_OK;
    }
    if ((st = gram_add(a, &a->x_attn, attn_in, N, NULL)) != BK_OK) {
        a->broken = 1;
        return st;
    }
    if (!a->attn2) {
        a->count[G_ATTN] += N;
        return BK_OK;
    }

    /* ---- fully-local: q, k output blocks; v output block from W_o */
    const int64_t T = a->dim.T, h = a->dim.hd, hh = h * h, r = a->dim.rep, d = a->dim.hidden;
    const double eps = a->cfg.rms_eps;
    double *C = NULL, *tmp = NULL, *M = NULL, *Bt = NULL, *v = NULL;
    double *wq = NULL, *wk = NULL, *sq = NULL, *sk = NULL, *sv = NULL;
    float *zq = NULL, *zk = NULL;
    st = BK_OK;
    C = bk_alloc((size_t)hh, sizeof(double));
    tmp = bk_alloc((size_t)hh, sizeof(double));
    M = bk_alloc((size_t)hh, sizeof(double));
    Bt = bk_alloc((size_t)hh, sizeof(double));
    v = bk_alloc((size_t)h, sizeof(double));
    wq = bk_alloc((size_t)T, sizeof(double));
    wk = bk_alloc((size_t)T, sizeof(double));
    sq = bk_alloc((size_t)T, sizeof(double));
    sk = bk_alloc((size_t)T, sizeof(double));
    sv = bk_alloc((size_t)T, sizeof(double));
    if (a->qknorm) {
        zq = bk_alloc((size_t)(T * a->dim.qdim), sizeof(float));
        zk = bk_alloc((size_t)(T * a->dim.kvdim), sizeof(float));
    }
    if (!C || !tmp || !M || !Bt || !v || !wq || !wk || !sq || !sk || !sv ||
        (a->qknorm && (!zq || !zk))) {
        st = bk_error(BK_ERR_NOMEM, "hessian: layer %d: out of memory for attention scratch",
                      lw->layer);
        goto done;
    }
    if (!a->have_bv && (st = make_bv(a, lw->w[BK_MOD_O])) != BK_OK)
        goto done;

    for (int64_t s = 0; s < S; s++) {
        const float *X = attn_in + s * T * d;
        const float *Qr = q_rot + s * T * a->dim.qdim, *Kr = k_rot + s * T * a->dim.kvdim;
        /* B-side weights s_t: |x_t|² from the identity start, else x_tᵀ A0 x_t */
        const float *A0[3] = {a->startA[BK_MOD_Q], a->startA[BK_MOD_K], a->startA[BK_MOD_V]};
        double *sw[3] = {sq, sk, sv};
        for (int i = 0; i < 3; i++) {
            if (a->shampoo && A0[i]) {
                if ((st = quad_weights(X, T, d, A0[i], sw[i])) != BK_OK)
                    goto done;
                if ((st = clamp_weights(sw[i], T, lw->layer, (bk_module)(BK_MOD_Q + i))) !=
                    BK_OK)
                    goto done;
            } else {
                for (int64_t t = 0; t < T; t++)
                    sw[i][t] = a->shampoo ? sq_norm(X + t * d, d) : 1.0;
            }
        }
        for (int64_t t = 0; t < T; t++)
            a->v_wb += sv[t];
        if (a->qknorm) {
            project(X, T, d, lw->w[BK_MOD_Q], lw->b[BK_MOD_Q], a->dim.qdim, zq);
            project(X, T, d, lw->w[BK_MOD_K], lw->b[BK_MOD_K], a->dim.kvdim, zk);
        }
        memset(wq, 0, (size_t)T * sizeof(double));
        memset(wk, 0, (size_t)T * sizeof(double));
        const double *B0q = a->startBblk[BK_MOD_Q], *B0k = a->startBblk[BK_MOD_K];

        for (int64_t kv = 0; kv < a->dim.nkv; kv++) {
            /* q_proj: keys u <= t of this kv head, prefix Gram C_t */
            memset(C, 0, (size_t)hh * sizeof(double));
            for (int64_t t = 0; t < T; t++) {
                const float *kf = Kr + t * a->dim.kvdim + kv * h;
                for (int64_t i = 0; i < h; i++)
                    v[i] = kf[i];
                cblas_dger(CblasRowMajor, (int)h, (int)h, 1.0, v, 1, v, 1, C, (int)h);
                rot_sandwich(&a->rope, t, C, tmp, M);
                for (int64_t j = kv * r; j < (kv + 1) * r; j++) {
                    const double *Bj = M;
                    if (a->qknorm) {
                        norm_sandwich(M, zq + t * a->dim.qdim + j * h, lw->q_norm, eps, h, v, Bt);
                        Bj = Bt;
                    }
                    wq[t] += B0q ? frob_dot(B0q + j * hh, Bj, hh) : trace(Bj, h);
                    if (a->qknorm || j == kv * r)
                        cblas_daxpy((int)hh, sq[t], Bj, 1, a->bq + j * hh, 1);
                }
            }
            /* k_proj: queries t >= u of the heads of this kv head, suffix Gram */
            memset(C, 0, (size_t)hh * sizeof(double));
            for (int64_t u = T - 1; u >= 0; u--) {
                for (int64_t j = kv * r; j < (kv + 1) * r; j++) {
                    const float *qf = Qr + u * a->dim.qdim + j * h;
                    for (int64_t i = 0; i < h; i++)
                        v[i] = qf[i];
                    cblas_dger(CblasRowMajor, (int)h, (int)h, 1.0, v, 1, v, 1, C, (int)h);
                }
                rot_sandwich(&a->rope, u, C, tmp, M);
                const double *Bk = M;
                if (a->qknorm) {
                    norm_sandwich(M, zk + u * a->dim.kvdim + kv * h, lw->k_norm, eps, h, v, Bt);
                    Bk = Bt;
                }
                wk[u] += B0k ? frob_dot(B0k + kv * hh, Bk, hh) : trace(Bk, h);
                cblas_daxpy((int)hh, sk[u], Bk, 1, a->bk + kv * hh, 1);
            }
        }
        if (a->shampoo) {
            if ((st = clamp_weights(wq, T, lw->layer, BK_MOD_Q)) != BK_OK ||
                (st = clamp_weights(wk, T, lw->layer, BK_MOD_K)) != BK_OK)
                goto done;
            if ((st = gram_add(a, &a->a_q, X, T, wq)) != BK_OK ||
                (st = gram_add(a, &a->a_k, X, T, wk)) != BK_OK)
                goto done;
        }
    }
    a->count[G_ATTN] += N;
    a->n_pairs += S * (T * (T + 1) / 2);
done:
    if (st != BK_OK)
        a->broken = 1;
    free(C);
    free(tmp);
    free(M);
    free(Bt);
    free(v);
    free(wq);
    free(wk);
    free(sq);
    free(sk);
    free(sv);
    free(zq);
    free(zk);
    return st;
}

/* ------------------------------------------------------------ backprop */

static const bk_module grp_mods[G_COUNT][3] = {
    {BK_MOD_Q, BK_MOD_K, BK_MOD_V},
    {BK_MOD_O, BK_MOD_COUNT, BK_MOD_COUNT},
    {BK_MOD_GATE, BK_MOD_UP, BK_MOD_COUNT},
    {BK_MOD_DOWN, BK_MOD_COUNT, BK_MOD_COUNT},
};

static gram *kfac_gram(bk_hess_acc *a, int grp)
{
    switch (grp) {
    case G_ATTN: return &a->x_attn;
    case G_O: return &a->x_o;
    case G_MLP: return &a->x_mlp;
    default: return &a->x_down;
    }
}

/* Input side of the backprop kinds: A = Σ a aᵀ (K-FAC), or per module
 * Σ |g_t|² a_t a_tᵀ (Shampoo) with the |g_t|² recorded by bk_hess_add_grad
 * for the same tokens (rows count[grp] .. count[grp] + N). layer < 0: the
 * layer of the accumulator (o, down adds). */
static bk_status bp_add_input(bk_hess_acc *a, int layer, int grp, const float *x, int64_t S,
                              int64_t width, const char *what)
{
    bk_status st;
    int64_t N = 0;
    if (!x)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: %s is NULL", what);
    if ((st = batch_rows(a, S, width, what, &N)) != BK_OK)
        return st;
    if (layer >= 0 && a->layer < 0)
        a->layer = layer;
    if ((st = check_finite(x, N, width, a->layer, what)) != BK_OK)
        return st;
    if (!a->shampoo) {
        if ((st = gram_add(a, kfac_gram(a, grp), x, N, NULL)) != BK_OK) {
            a->broken = 1;
            return st;
        }
    } else {
        for (int k = 0; k < 3 && grp_mods[grp][k] != BK_MOD_COUNT; k++) {
            bk_module mod = grp_mods[grp][k];
            if (a->gw_n[mod] < a->own[grp] + N)
                return bk_error(BK_ERR_INVALID_ARG,
                                "hessian: layer %d %s: backprop-shampoo inputs of tokens %lld.."
                                "%lld come before their gradients (add every gradient of the "
                                "layer first, bk_hess_add_grad)",
                                a->layer, bk_module_name(mod), (long long)a->own[grp],
                                (long long)(a->own[grp] + N));
            if ((st = gram_add(a, &a->a_bp[mod], x, N, a->gw[mod] + a->own[grp])) != BK_OK) {
                a->broken = 1;
                return st;
            }
        }
    }
    a->count[grp] += N;
    a->own[grp] += N;
    return BK_OK;
}

/* The checks before output gradients of layer/mod enter accumulator a (fn:
 * the caller's name; what: "gradients" or "gradient Grams", both as the
 * messages say them): x (the gradients or their Gram) given, and w (the
 * inputs or the token weights) for the Shampoo kind; missing names them. */
static bk_status grad_check(const bk_hess_acc *a, int layer, bk_module mod, const char *fn,
                            const char *what, const double *x, const double *w,
                            const char *missing)
{
    bk_status st;
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if (!a->bp)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s only enter the backprop kinds (Hessian is %s)", what,
                        bk_hessian_name(a->kind));
    if ((unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown module %d", (int)mod);
    if ((st = check_broken(a, fn)) != BK_OK)
        return st;
    if (a->layer >= 0 && layer != a->layer)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s of layer %d given to an accumulator holding layer %d (call "
                        "bk_hess_acc_reset between layers)",
                        what, layer, a->layer);
    if (!x || (a->shampoo && !w))
        return bk_error(BK_ERR_INVALID_ARG, "hessian: layer %d %s: NULL %s", layer,
                        bk_module_name(mod), missing);
    return BK_OK;
}

/* Module mod's output factor [m, m] (zero at first) and room for `more` token
 * weights (the Shampoo kind). */
static bk_status grad_room(bk_hess_acc *a, int layer, bk_module mod, int64_t m, int64_t more)
{
    if (!a->gB[mod]) {
        a->gB[mod] = bk_calloc((size_t)(m * m), sizeof(double));
        if (!a->gB[mod])
            return bk_error(BK_ERR_NOMEM,
                            "hessian: layer %d %s: out of memory for the output factor [%lld, "
                            "%lld]",
                            layer, bk_module_name(mod), (long long)m, (long long)m);
    }
    int64_t need = a->gw_n[mod] + more;
    if (a->shampoo && need > a->gw_cap[mod]) {
        int64_t cap = a->gw_cap[mod] ? a->gw_cap[mod] : 1024;
        while (cap < need)
            cap *= 2;
        double *nw = realloc(a->gw[mod], (size_t)cap * sizeof(double));
        if (!nw)
            return bk_error(BK_ERR_NOMEM, "hessian: out of memory for token weights");
        a->gw[mod] = nw;
        a->gw_cap[mod] = cap;
    }
    return BK_OK;
}

bk_status bk_hess_add_grad(bk_hess_acc *a, int layer, bk_module mod, const double *g,
                           const double *a_fp, int64_t S)
{
    int64_t N = 0;
    bk_status st = grad_check(a, layer, mod, "bk_hess_add_grad", "bk_hess_add_grad: gradients",
                              g, a_fp, "gradient or input");
    if (st != BK_OK)
        return st;
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    if ((st = batch_rows(a, S, m > n ? m : n, "gradient", &N)) != BK_OK)
        return st;
    for (int64_t i = 0; i < N * m; i++)
        if (!isfinite(g[i]))
            return bk_error(BK_ERR_NONFINITE,
                            "hessian: layer %d %s: non-finite output gradient at row %lld",
                            layer, bk_module_name(mod), (long long)(i / m));
    if ((st = grad_room(a, layer, mod, m, N)) != BK_OK)
        return st;
    a->layer = layer;
    if (!a->shampoo) {
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)m, (int)N, 1.0, g, (int)m, 1.0,
                    a->gB[mod], (int)m);
    } else {
        int64_t ch = N < GRAM_CHUNK ? N : GRAM_CHUNK;
        double *buf = bk_alloc((size_t)(ch * m), sizeof(double));
        if (!buf)
            return bk_error(BK_ERR_NOMEM, "hessian: out of memory for a %lld x %lld block",
                            (long long)ch, (long long)m);
        for (int64_t r0 = 0; r0 < N; r0 += ch) {
            int64_t k = N - r0 < ch ? N - r0 : ch;
            for (int64_t i = 0; i < k; i++) {
                const double *gi = g + (r0 + i) * m, *ai = a_fp + (r0 + i) * n;
                double na = 0, ng = 0;
                for (int64_t c = 0; c < n; c++)
                    na += ai[c] * ai[c];
                for (int64_t c = 0; c < m; c++)
                    ng += gi[c] * gi[c];
                a->gw[mod][a->gw_n[mod] + r0 + i] = ng;
                double sa = sqrt(na);
                for (int64_t c = 0; c < m; c++)
                    buf[i * m + c] = sa * gi[c];
            }
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)m, (int)k, 1.0, buf, (int)m,
                        1.0, a->gB[mod], (int)m);
        }
        free(buf);
    }
    a->gcount[mod] += N;
    a->gw_n[mod] += a->shampoo ? N : 0;
    return BK_OK;
}

bk_status bk__hess_add_grad_gram(bk_hess_acc *a, int layer, bk_module mod, const double *G,
                                 const double *gw, int64_t S)
{
    int64_t N = 0;
    bk_status st = grad_check(a, layer, mod, "bk__hess_add_grad_gram", "gradient Grams", G, gw,
                              "Gram or token weights");
    if (st != BK_OK)
        return st;
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    if ((st = batch_rows(a, S, 1, "gradient Gram", &N)) != BK_OK)
        return st;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = i; j < m; j++)
            if (!isfinite(G[i * m + j]))
                return bk_error(BK_ERR_NONFINITE,
                                "hessian: layer %d %s: non-finite output gradient (in the Gram, "
                                "row %lld)",
                                layer, bk_module_name(mod), (long long)i);
    if ((st = grad_room(a, layer, mod, m, N)) != BK_OK)
        return st;
    if (a->shampoo)
        memcpy(a->gw[mod] + a->gw_n[mod], gw, (size_t)N * sizeof(double));
    a->layer = layer;
    double *gb = a->gB[mod];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = i; j < m; j++)
            gb[i * m + j] += G[i * m + j];
    a->gcount[mod] += N;
    a->gw_n[mod] += a->shampoo ? N : 0;
    return BK_OK;
}

bk_status bk__hess_bp_output(const bk_hess_acc *a, int layer, bk_module mod, float *B,
                             int64_t *count)
{
    if (!a || !B || !count)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL argument to bk__hess_bp_output");
    if (!a->bp || (unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: bk__hess_bp_output: a backprop accumulator and a module");
    const char *mn = bk_module_name(mod);
    if (a->gcount[mod] == 0 || !a->gB[mod])
        return bk_error(BK_ERR_CALIB,
                        "hessian: %s: no output gradients were added for this layer (call "
                        "bk_hess_add_grad first)",
                        mn);
    if (a->layer != layer)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: %s: output gradients of layer %d asked for layer %d", mn,
                        a->layer, layer);
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    const double N = (double)a->gcount[mod];
    const double *gb = a->gB[mod];
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = i; j < m; j++) {
            float v = (float)(gb[i * m + j] / N);
            B[i * m + j] = v;
            B[j * m + i] = v;
        }
    *count = a->gcount[mod];
    return BK_OK;
}

bk_status bk__hess_bp_token_weights(const bk_hess_acc *a, bk_module mod, const double **w,
                                    int64_t *n)
{
    if (!a || !w || !n || !a->bp || (unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: bk__hess_bp_token_weights: bad argument");
    *w = a->shampoo ? a->gw[mod] : NULL;
    *n = a->shampoo ? a->gw_n[mod] : 0;
    return BK_OK;
}

static bk_status bp_factors(bk_hess_acc *a, bk_module mod, const float **A, const float **B)
{
    const char *mn = bk_module_name(mod);
    int grp = bk__hess_module_group(mod);
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    if (a->gcount[mod] == 0)
        return bk_error(BK_ERR_CALIB,
                        "hessian: %s: no output gradients were added for this layer (call "
                        "bk_hess_add_grad first)",
                        mn);
    if (a->gcount[mod] != a->count[grp])
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: layer %d %s: %lld gradient rows but %lld input rows were added",
                        a->layer, mn, (long long)a->gcount[mod], (long long)a->count[grp]);
    float *fa = out_buf(&a->outA[mod], n), *fb = out_buf(&a->outB[mod], m);
    if (!fa || !fb)
        return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for the factors", mn);
    const double N = (double)a->count[grp];
    gram_out(a, a->shampoo ? &a->a_bp[mod] : kfac_gram(a, grp), 1.0 / N, fa);
    int64_t gc = 0;
    bk_status st = bk__hess_bp_output(a, a->layer, mod, fb, &gc);
    if (st != BK_OK)
        return st;
    *A = fa;
    *B = fb;
    return BK_OK;
}

/* ---------------------------------------------------------- o_proj, down */

static bk_status add_plain(bk_hess_acc *a, gram *g, int grp, const float *x, int64_t S,
                           int64_t width, const char *what)
{
    int64_t N = 0;
    bk_status st = bk__hess_check_input(a != NULL, a && a->broken, x, what, "bk_hess_acc_reset");
    if (st != BK_OK)
        return st;
    if (a->bp)
        return bp_add_input(a, a->layer, grp, x, S, width, what);
    if ((st = batch_rows(a, S, width, what, &N)) != BK_OK)
        return st;
    if ((st = check_finite(x, N, width, a->layer, what)) != BK_OK)
        return st;
    if (a->kind != BK_HESS_RTN)
        if ((st = gram_add(a, g, x, N, NULL)) != BK_OK) {
            a->broken = 1;
            return st;
        }
    a->count[grp] += N;
    return BK_OK;
}

bk_status bk_hess_add_o(bk_hess_acc *a, const float *o_in, int64_t S)
{
    return add_plain(a, a ? &a->x_o : NULL, G_O, o_in, S, a ? a->dim.qdim : 0, "o_in");
}

bk_status bk_hess_add_down(bk_hess_acc *a, const float *down_in, int64_t S)
{
    return add_plain(a, a ? &a->x_down : NULL, G_DOWN, down_in, S, a ? a->dim.inter : 0, "down_in");
}

/* ------------------------------------------------------------ gate / up */

static double silu(double z)
{
    return z / (1.0 + exp(-z));
}

static double silu_prime(double z)
{
    double s = 1.0 / (1.0 + exp(-z));
    return s * (1.0 + z * (1.0 - s));
}

#define MLP_CHUNK 256

/* E = B0 ⊙ DᵀD for a power start on gate/up. */
static bk_status make_mlpE(bk_hess_acc *a, const float *wdown, bk_module mod)
{
    int64_t NI = a->dim.inter;
    float *E = bk_calloc((size_t)(NI * NI), sizeof(float));
    if (!E)
        return bk_error(BK_ERR_NOMEM, "hessian: out of memory for a %lld x %lld matrix",
                        (long long)NI, (long long)NI);
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)NI, (int)a->dim.hidden, 1.0f, wdown, (int)NI,
                0.0f, E, (int)NI);
    const float *B0 = a->startB[mod];
    for (int64_t i = 0; i < NI; i++)
        for (int64_t j = i; j < NI; j++) {
            float v = E[i * NI + j];
            E[i * NI + j] = v * B0[i * NI + j];
            E[j * NI + i] = v * B0[j * NI + i];
        }
    a->mlpE[mod] = E;
    return BK_OK;
}

bk_status bk_hess_add_mlp(bk_hess_acc *a, const bk_layer_weights *lw, const float *mlp_in,
                          int64_t S)
{
    bk_status st;
    int64_t N = 0;
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    if ((st = check_layer(a, lw, "bk_hess_add_mlp")) != BK_OK)
        return st;
    if (a->bp)
        return bp_add_input(a, lw->layer, G_MLP, mlp_in, S, a->dim.hidden, "mlp_in");
    if (!mlp_in)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: layer %d: mlp_in is NULL", lw->layer);
    if ((st = batch_rows(a, S, a->dim.inter > a->dim.hidden ? a->dim.inter : a->dim.hidden, "mlp_in", &N)) != BK_OK)
        return st;
    if ((st = bk__hess_check_mlp(a->kind, a->mlp2, lw->layer,
                                 lw->w[BK_MOD_GATE] && lw->w[BK_MOD_UP] && lw->w[BK_MOD_DOWN])) !=
        BK_OK)
        return st;
    if ((st = check_finite(mlp_in, N, a->dim.hidden, lw->layer, "mlp_in")) != BK_OK)
        return st;
    a->layer = lw->layer;
    if (a->kind == BK_HESS_RTN) {
        a->count[G_MLP] += N;
        return BK_OK;
    }
    if (!a->mlp2) {
        if ((st = gram_add(a, &a->x_mlp, mlp_in, N, NULL)) != BK_OK) {
            a->broken = 1;
            return st;
        }
        a->count[G_MLP] += N;
        return BK_OK;
    }

    const int64_t d = a->dim.hidden, NI = a->dim.inter;
    const float *wd = lw->w[BK_MOD_DOWN];
    if (!a->have_down_fp) {
        fingerprint(wd, d * NI, a->down_fp);
        for (int64_t i = 0; i < NI; i++) {
            double s = 0;
            for (int64_t r = 0; r < d; r++)
                s += (double)wd[r * NI + i] * (double)wd[r * NI + i];
            a->dcol2[i] = (float)s;
        }
        a->have_down_fp = 1;
    }
    if (a->shampoo) {
        for (int m = BK_MOD_GATE; m <= BK_MOD_UP; m++)
            if (a->startB[m] && !a->mlpE[m])
                if ((st = make_mlpE(a, wd, (bk_module)m)) != BK_OK)
                    return st; /* nothing accumulated yet */
    }

    int64_t ch = N < MLP_CHUNK ? N : MLP_CHUNK;
    float *zg = bk_alloc((size_t)(ch * NI), sizeof(float));
    float *zu = bk_alloc((size_t)(ch * NI), sizeof(float));
    float *y = a->shampoo ? bk_alloc((size_t)(ch * NI), sizeof(float)) : NULL;
    double *w = bk_alloc((size_t)ch * 4, sizeof(double));
    st = BK_OK;
    if (!zg || !zu || !w || (a->shampoo && !y)) {
        st = bk_error(BK_ERR_NOMEM, "hessian: layer %d: out of memory for MLP scratch",
                      lw->layer);
        goto done;
    }
    for (int64_t r0 = 0; r0 < N; r0 += ch) {
        int64_t k = N - r0 < ch ? N - r0 : ch;
        const float *X = mlp_in + r0 * d;
        project(X, k, d, lw->w[BK_MOD_GATE], lw->b[BK_MOD_GATE], NI, zg);
        project(X, k, d, lw->w[BK_MOD_UP], lw->b[BK_MOD_UP], NI, zu);
        /* zg <- g = silu(zg), zu <- f = silu'(zg) ⊙ zu */
        for (int64_t i = 0; i < k * NI; i++) {
            double zgi = zg[i];
            zu[i] = (float)(silu_prime(zgi) * (double)zu[i]);
            zg[i] = (float)silu(zgi);
        }
        if (!a->shampoo) {
            if ((st = gram_add(a, &a->x_mlp, X, k, NULL)) != BK_OK ||
                (st = gram_add(a, &a->b_up, zg, k, NULL)) != BK_OK ||
                (st = gram_add(a, &a->b_gate, zu, k, NULL)) != BK_OK)
                goto done;
            continue;
        }
        /* Shampoo: w[0..k) A-weights of up (from g), w[k..2k) of gate (from f),
         * w[2k..3k) B-weights of up, w[3k..4k) of gate. */
        const float *vec[2] = {zg, zu};
        const bk_module mods[2] = {BK_MOD_UP, BK_MOD_GATE};
        for (int p = 0; p < 2; p++) {
            double *wa = w + p * k, *wb = w + (2 + p) * k;
            bk_module mo = mods[p];
            const float *V = vec[p];
            if (a->mlpE[mo]) {
                /* tr(bᵀ B0 b) = vᵀ (B0 ⊙ DᵀD) v */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)k, (int)NI, (int)NI,
                            1.0f, V, (int)NI, a->mlpE[mo], (int)NI, 0.0f, y, (int)NI);
                for (int64_t t = 0; t < k; t++) {
                    double s = 0;
                    for (int64_t i = 0; i < NI; i++)
                        s += (double)y[t * NI + i] * (double)V[t * NI + i];
                    wa[t] = s;
                }
            } else {
                /* tr(bᵀ b) = vᵀ diag(DᵀD) v */
                for (int64_t t = 0; t < k; t++) {
                    double s = 0;
                    for (int64_t i = 0; i < NI; i++) {
                        double vi = V[t * NI + i];
                        s += vi * vi * (double)a->dcol2[i];
                    }
                    wa[t] = s;
                }
            }
            if (a->startA[mo]) {
                if ((st = quad_weights(X, k, d, a->startA[mo], wb)) != BK_OK)
                    goto done;
            } else {
                for (int64_t t = 0; t < k; t++)
                    wb[t] = sq_norm(X + t * d, d);
            }
            if ((st = clamp_weights(wa, k, lw->layer, mo)) != BK_OK ||
                (st = clamp_weights(wb, k, lw->layer, mo)) != BK_OK)
                goto done;
            gram *ga = p == 0 ? &a->a_up : &a->a_gate, *gb = p == 0 ? &a->b_up : &a->b_gate;
            if ((st = gram_add(a, ga, X, k, wa)) != BK_OK ||
                (st = gram_add(a, gb, V, k, wb)) != BK_OK)
                goto done;
        }
    }
    a->count[G_MLP] += N;
done:
    if (st != BK_OK)
        a->broken = 1;
    free(zg);
    free(zu);
    free(y);
    free(w);
    return st;
}

/* ------------------------------------------------------------- factors */

static float *out_buf(float **slot, int64_t n)
{
    if (!*slot)
        *slot = bk_alloc((size_t)(n * n), sizeof(float));
    return *slot;
}

void bk_hess_head_blocks(float *dst, const double *blk, int64_t blk_stride, int64_t heads,
                         int64_t rep, int64_t h, double mul, double div)
{
    const int64_t m = heads * h;
    memset(dst, 0, (size_t)(m * m) * sizeof(float));
    for (int64_t j = 0; j < heads; j++) {
        const double *s = blk + (j / rep) * blk_stride;
        for (int64_t i = 0; i < h; i++)
            for (int64_t c = 0; c < h; c++) {
                const double v = 0.5 * (s[i * h + c] + s[c * h + i]);
                dst[(j * h + i) * m + j * h + c] = (float)(mul * v / div);
            }
    }
}

bk_status bk_hess_factors(bk_hess_acc *a, const bk_layer_weights *lw, bk_module mod,
                          const float **A, const float **B)
{
    if (!a || !A || !B)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL argument to bk_hess_factors");
    *A = NULL;
    *B = NULL;
    if ((unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown module %d", (int)mod);
    const char *mn = bk_module_name(mod);
    bk_status st0 = check_broken(a, mn);
    if (st0 != BK_OK)
        return st0;
    if (a->kind == BK_HESS_RTN)
        return BK_OK; /* plain rounding: no factors */
    int grp = bk__hess_module_group(mod);
    if (a->bp && a->count[grp] > 0 && (!lw || lw->layer == a->layer))
        return bp_factors(a, mod, A, B);
    st0 = bk__hess_check_factors(mn, a->count[grp], group_add_name(grp), lw != NULL,
                                 lw ? lw->layer : -1, a->layer);
    if (st0 != BK_OK)
        return st0;
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    float *fa = out_buf(&a->outA[mod], n);
    if (!fa)
        return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for A [%lld, %lld]", mn,
                        (long long)n, (long long)n);
    int two = bk_hessian_is_two_sided(a->kind, mod);
    float *fb = NULL;
    if (two) {
        fb = out_buf(&a->outB[mod], m);
        if (!fb)
            return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for B [%lld, %lld]", mn,
                            (long long)m, (long long)m);
    }
    const double N = (double)a->count[grp];
    const double P = (double)a->n_pairs;
    const int64_t h = a->dim.hd;

    switch (mod) {
    case BK_MOD_Q:
    case BK_MOD_K:
        if (!two) {
            gram_out(a, &a->x_attn, 1.0 / N, fa);
            break;
        }
        if (a->shampoo)
            gram_out(a, mod == BK_MOD_Q ? &a->a_q : &a->a_k, 1.0 / P, fa);
        else
            gram_out(a, &a->x_attn, 1.0 / N, fa);
        if (mod == BK_MOD_K)
            bk_hess_head_blocks(fb, a->bk, h * h, a->dim.nkv, 1, h, 1.0 / P, 1.0);
        else if (a->qknorm)
            bk_hess_head_blocks(fb, a->bq, h * h, a->dim.nh, 1, h, 1.0 / P, 1.0);
        else /* without q_norm every head of a group has the same block, stored
              * at the group's first head */
            bk_hess_head_blocks(fb, a->bq, a->dim.rep * h * h, a->dim.nh, a->dim.rep, h, 1.0, P);
        break;
    case BK_MOD_V:
        if (!two) {
            gram_out(a, &a->x_attn, 1.0 / N, fa);
            break;
        }
        if (a->shampoo) {
            /* A = tr(bᵀ B0 b) E[x xᵀ], tr(bᵀ B0 b) = <B0, B_O> (B0 = I: tr B_O) */
            double wa = 0;
            const double *B0 = a->startBblk[BK_MOD_V];
            for (int64_t b = 0; b < a->dim.nkv; b++)
                wa += B0 ? frob_dot(B0 + b * h * h, a->bv + b * h * h, h * h)
                         : trace(a->bv + b * h * h, h);
            gram_out(a, &a->x_attn, wa / N, fa);
            bk_hess_head_blocks(fb, a->bv, h * h, a->dim.nkv, 1, h, a->v_wb / N, 1.0);
        } else {
            gram_out(a, &a->x_attn, 1.0 / N, fa);
            bk_hess_head_blocks(fb, a->bv, h * h, a->dim.nkv, 1, h, 1.0, 1.0);
        }
        break;
    case BK_MOD_O:
        gram_out(a, &a->x_o, 1.0 / N, fa);
        break;
    case BK_MOD_GATE:
    case BK_MOD_UP: {
        if (!two) {
            gram_out(a, &a->x_mlp, 1.0 / N, fa);
            break;
        }
        if (!lw)
            return bk_error(BK_ERR_INVALID_ARG,
                            "hessian: %s: the layer weights are needed (output factor from "
                            "mlp.down_proj)",
                            mn);
        if (!lw->w[BK_MOD_DOWN])
            return bk_error(BK_ERR_INVALID_ARG, "hessian: layer %d %s: mlp.down_proj weight "
                            "missing", a->layer, mn);
        double fp[3];
        fingerprint(lw->w[BK_MOD_DOWN], a->dim.hidden * a->dim.inter, fp);
        if (fp[0] != a->down_fp[0] || fp[1] != a->down_fp[1] || fp[2] != a->down_fp[2])
            return bk_error(BK_ERR_INVALID_ARG,
                            "hessian: layer %d %s: mlp.down_proj weights differ from those "
                            "seen by bk_hess_add_mlp (pass the original weights)",
                            a->layer, mn);
        if (a->shampoo)
            gram_out(a, mod == BK_MOD_UP ? &a->a_up : &a->a_gate, 1.0 / N, fa);
        else
            gram_out(a, &a->x_mlp, 1.0 / N, fa);
        /* B = (Σ w v vᵀ / N) ⊙ DᵀD */
        int64_t NI = a->dim.inter;
        const gram *gb = mod == BK_MOD_UP ? &a->b_up : &a->b_gate;
        memset(fb, 0, (size_t)(NI * NI) * sizeof(float));
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)NI, (int)a->dim.hidden, 1.0f,
                    lw->w[BK_MOD_DOWN], (int)NI, 0.0f, fb, (int)NI);
        for (int64_t i = 0; i < NI; i++)
            for (int64_t j = i; j < NI; j++) {
                float v = (float)((double)fb[i * NI + j] * gram_get(a, gb, i, j) / N);
                fb[i * NI + j] = v;
                fb[j * NI + i] = v;
            }
        break;
    }
    case BK_MOD_DOWN:
        gram_out(a, &a->x_down, 1.0 / N, fa);
        break;
    default:
        break;
    }
    *A = fa;
    *B = fb;
    return BK_OK;
}
