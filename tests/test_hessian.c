/* Tests of the Kronecker-factored Hessians (src/hessian.c, docs/hessians.md).
 *
 * Every expected value is built here from the definitions, independently of
 * the implementation: a small double-precision forward pass (projections,
 * q_norm/k_norm, RoPE by the rotate_half formula, SiLU MLP) evaluates each
 * module's local-loss outputs; the per-sample Jacobian of those outputs with
 * respect to vec(W) (column-major) comes from central finite differences;
 * the exact Hessian H = (1/Z) Σ_s J_sᵀ J_s is assembled as an mn × mn matrix.
 * From H and the Jacobians:
 *   - each Jacobian row factors as vec(c aᵀ) with a = the module's input
 *     (checked), which gives per-sample a and b b ᵀ = (N/Z) Σ_rows c cᵀ;
 *   - K-FAC factors must equal E[a aᵀ] and E[b bᵀ];
 *   - Shampoo factors must equal one power step of R(H) from the identity,
 *     and repeated steps (bk_hess_set_start) must reach the top singular pair
 *     of R(H) computed by LAPACK (the best Kronecker approximation).
 * Plus micro-batching invariance, F32 vs F64, symmetry/PSD and the errors. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <lapacke.h>

#include "bakron/hessian.h"
#include "util.h"

/* ---------------------------------------------------------------- fixture */

typedef struct tiny {
    bk_model_config cfg;
    int64_t S, T, N, d, NI, H, G, h, r, qd, kvd;
    bk_layer_weights lw;
    float *attn_in, *q_rot, *k_rot, *o_in, *mlp_in, *down_in;
} tiny;

static float *randn(bk_rng *g, int64_t n, double scale)
{
    float *x = malloc((size_t)n * sizeof(float));
    assert_non_null(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(scale * bk_rng_normal(g));
    return x;
}

/* RoPE of the paper / transformers (rotate_half), in double. */
static void ref_rope(const tiny *tn, double *v, int64_t t)
{
    int64_t h = tn->h, h2 = h / 2;
    for (int64_t i = 0; i < h2; i++) {
        double w = pow(tn->cfg.rope_theta, -(double)(2 * i) / (double)h);
        double c = cos((double)t * w), s = sin((double)t * w);
        double a = v[i], b = v[i + h2];
        v[i] = a * c - b * s;
        v[i + h2] = b * c + a * s;
    }
}

static void ref_norm(const tiny *tn, double *v, const float *gamma)
{
    if (!tn->cfg.qk_norm)
        return;
    double ms = 0;
    for (int64_t i = 0; i < tn->h; i++)
        ms += v[i] * v[i];
    ms /= (double)tn->h;
    double rho = 1.0 / sqrt(ms + tn->cfg.rms_eps);
    for (int64_t i = 0; i < tn->h; i++)
        v[i] = (double)gamma[i] * v[i] * rho;
}

/* One head's projection rows [row0, row0 + h) of W [*, n] (+ bias) on x. */
static void ref_proj(const double *W, const float *b, int64_t row0, int64_t h, int64_t n,
                     const float *x, double *out)
{
    for (int64_t i = 0; i < h; i++) {
        double s = b ? (double)b[row0 + i] : 0.0;
        for (int64_t l = 0; l < n; l++)
            s += W[(row0 + i) * n + l] * (double)x[l];
        out[i] = s;
    }
}

static double *to_double(const float *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof(double));
    assert_non_null(y);
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i];
    return y;
}

/* variant 0: Llama-like, 2 heads / 1 kv head, no biases, no q/k norm.
 * variant 1: Qwen3-like q_norm/k_norm, 4 heads / 2 kv heads, plus q/k/v and
 *            MLP biases (to exercise every input of the derivation). */
static void tiny_make(tiny *tn, int variant, uint64_t seed)
{
    memset(tn, 0, sizeof *tn);
    bk_model_config *c = &tn->cfg;
    c->arch = variant ? BK_ARCH_QWEN3 : BK_ARCH_LLAMA;
    c->n_layers = 1;
    c->hidden = 8;
    c->intermediate = 12;
    c->n_heads = variant ? 4 : 2;
    c->n_kv_heads = variant ? 2 : 1;
    c->head_dim = 4;
    c->vocab = 16;
    c->max_positions = 64;
    c->rms_eps = 1e-6;
    c->rope_theta = 10000.0;
    c->rope_type = BK_ROPE_DEFAULT;
    c->qkv_bias = variant;
    c->mlp_bias = variant;
    c->qk_norm = variant;
    strcpy(c->hidden_act, "silu");
    tn->S = 3;
    tn->T = 5;
    tn->N = tn->S * tn->T;
    tn->d = c->hidden;
    tn->NI = c->intermediate;
    tn->H = c->n_heads;
    tn->G = c->n_kv_heads;
    tn->h = c->head_dim;
    tn->r = tn->H / tn->G;
    tn->qd = tn->H * tn->h;
    tn->kvd = tn->G * tn->h;

    bk_rng g;
    bk_rng_seed(&g, seed);
    bk_layer_weights *lw = &tn->lw;
    lw->layer = 0;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int64_t o, i;
        bk_module_shape(c, (bk_module)m, &o, &i);
        lw->w[m] = randn(&g, o * i, 1.0 / sqrt((double)i));
        int bias = (variant && m <= BK_MOD_V) || (variant && m >= BK_MOD_GATE && m <= BK_MOD_UP);
        lw->b[m] = bias ? randn(&g, o, 0.3) : NULL;
    }
    if (variant) {
        lw->q_norm = malloc((size_t)tn->h * sizeof(float));
        lw->k_norm = malloc((size_t)tn->h * sizeof(float));
        assert_non_null(lw->q_norm);
        assert_non_null(lw->k_norm);
        for (int64_t i = 0; i < tn->h; i++) {
            lw->q_norm[i] = (float)(0.5 + bk_rng_uniform(&g));
            lw->k_norm[i] = (float)(0.5 + bk_rng_uniform(&g));
        }
    }
    tn->attn_in = randn(&g, tn->N * tn->d, 1.0);
    tn->mlp_in = randn(&g, tn->N * tn->d, 1.0);
    tn->o_in = randn(&g, tn->N * tn->qd, 1.0);
    tn->down_in = randn(&g, tn->N * tn->NI, 1.0);
    /* queries and keys after norm and RoPE, by the reference forward */
    tn->q_rot = malloc((size_t)(tn->N * tn->qd) * sizeof(float));
    tn->k_rot = malloc((size_t)(tn->N * tn->kvd) * sizeof(float));
    assert_non_null(tn->q_rot);
    assert_non_null(tn->k_rot);
    double *Wq = to_double(lw->w[BK_MOD_Q], tn->qd * tn->d);
    double *Wk = to_double(lw->w[BK_MOD_K], tn->kvd * tn->d);
    double v[64];
    for (int64_t row = 0; row < tn->N; row++) {
        int64_t t = row % tn->T;
        const float *x = tn->attn_in + row * tn->d;
        for (int64_t j = 0; j < tn->H; j++) {
            ref_proj(Wq, lw->b[BK_MOD_Q], j * tn->h, tn->h, tn->d, x, v);
            ref_norm(tn, v, lw->q_norm);
            ref_rope(tn, v, t);
            for (int64_t i = 0; i < tn->h; i++)
                tn->q_rot[row * tn->qd + j * tn->h + i] = (float)v[i];
        }
        for (int64_t j = 0; j < tn->G; j++) {
            ref_proj(Wk, lw->b[BK_MOD_K], j * tn->h, tn->h, tn->d, x, v);
            ref_norm(tn, v, lw->k_norm);
            ref_rope(tn, v, t);
            for (int64_t i = 0; i < tn->h; i++)
                tn->k_rot[row * tn->kvd + j * tn->h + i] = (float)v[i];
        }
    }
    free(Wq);
    free(Wk);
}

static void tiny_free(tiny *tn)
{
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        free(tn->lw.w[m]);
        free(tn->lw.b[m]);
    }
    free(tn->lw.q_norm);
    free(tn->lw.k_norm);
    free(tn->attn_in);
    free(tn->q_rot);
    free(tn->k_rot);
    free(tn->o_in);
    free(tn->mlp_in);
    free(tn->down_in);
}

/* Feed sequences [s0, s0 + ns) to every add. */
static void feed(bk_hess_acc *a, const tiny *tn, int64_t s0, int64_t ns)
{
    int64_t r0 = s0 * tn->T;
    assert_int_equal(bk_hess_add_attn(a, &tn->lw, tn->attn_in + r0 * tn->d,
                                      tn->q_rot + r0 * tn->qd, tn->k_rot + r0 * tn->kvd, ns),
                     BK_OK);
    assert_int_equal(bk_hess_add_o(a, tn->o_in + r0 * tn->qd, ns), BK_OK);
    assert_int_equal(bk_hess_add_mlp(a, &tn->lw, tn->mlp_in + r0 * tn->d, ns), BK_OK);
    assert_int_equal(bk_hess_add_down(a, tn->down_in + r0 * tn->NI, ns), BK_OK);
}

static bk_hess_acc *make_acc(const tiny *tn, bk_hessian_kind k, int fp64)
{
    bk_hess_acc *a = NULL;
    bk_status st = bk_hess_acc_create(&tn->cfg, k, fp64, tn->T, &a);
    if (st != BK_OK)
        fail_msg("create %s: %s", bk_hessian_name(k), bk_last_error());
    return a;
}

/* ---------------------------------------------------- local-loss outputs */

static double silu(double z)
{
    return z / (1.0 + exp(-z));
}

static int64_t loss_rows(const tiny *tn, bk_module mod, int64_t t)
{
    switch (mod) {
    case BK_MOD_Q: return tn->H * (t + 1);
    case BK_MOD_K: return tn->H * (tn->T - t);
    case BK_MOD_V: return tn->H * tn->d;
    default: return tn->d;
    }
}

/* Local-loss outputs of sample `row` (token s·T + t) with the module's
 * weight replaced by W [m, n] (docs/hessians.md, "local losses"):
 *   q: logits q_t^j(W) · k_u^{κ(j)} for every query head j and key u <= t;
 *   k: logits q_t^j · k_u^{κ(j)}(W) for u = this token, every j, t >= u;
 *   v: O_j v_u^{κ(j)}(W) for every query head j (value through o_proj);
 *   gate/up: the MLP output W_down (silu(W_gate x) ⊙ W_up x). */
static void loss_eval(const tiny *tn, bk_module mod, const double *W, int64_t row, double *out)
{
    const bk_layer_weights *lw = &tn->lw;
    int64_t T = tn->T, s = row / T, t = row % T, h = tn->h, d = tn->d;
    double v[64];
    int64_t k = 0;
    switch (mod) {
    case BK_MOD_Q: {
        const float *x = tn->attn_in + row * d;
        for (int64_t j = 0; j < tn->H; j++) {
            ref_proj(W, lw->b[BK_MOD_Q], j * h, h, d, x, v);
            ref_norm(tn, v, lw->q_norm);
            ref_rope(tn, v, t);
            int64_t kv = j / tn->r;
            for (int64_t u = 0; u <= t; u++) {
                const float *kk = tn->k_rot + (s * T + u) * tn->kvd + kv * h;
                double dot = 0;
                for (int64_t i = 0; i < h; i++)
                    dot += v[i] * (double)kk[i];
                out[k++] = dot;
            }
        }
        break;
    }
    case BK_MOD_K: {
        const float *x = tn->attn_in + row * d;
        for (int64_t j = 0; j < tn->H; j++) {
            int64_t kv = j / tn->r;
            ref_proj(W, lw->b[BK_MOD_K], kv * h, h, d, x, v);
            ref_norm(tn, v, lw->k_norm);
            ref_rope(tn, v, t);
            for (int64_t tq = t; tq < T; tq++) {
                const float *qq = tn->q_rot + (s * T + tq) * tn->qd + j * h;
                double dot = 0;
                for (int64_t i = 0; i < h; i++)
                    dot += (double)qq[i] * v[i];
                out[k++] = dot;
            }
        }
        break;
    }
    case BK_MOD_V: {
        const float *x = tn->attn_in + row * d;
        const float *wo = lw->w[BK_MOD_O];
        for (int64_t j = 0; j < tn->H; j++) {
            int64_t kv = j / tn->r;
            ref_proj(W, lw->b[BK_MOD_V], kv * h, h, d, x, v);
            for (int64_t rr = 0; rr < d; rr++) {
                double sum = 0;
                for (int64_t p = 0; p < h; p++)
                    sum += (double)wo[rr * tn->qd + j * h + p] * v[p];
                out[k++] = sum;
            }
        }
        break;
    }
    case BK_MOD_GATE:
    case BK_MOD_UP: {
        const float *x = tn->mlp_in + row * d;
        double hid[64];
        for (int64_t i = 0; i < tn->NI; i++) {
            double zg = lw->b[BK_MOD_GATE] ? lw->b[BK_MOD_GATE][i] : 0.0;
            double zu = lw->b[BK_MOD_UP] ? lw->b[BK_MOD_UP][i] : 0.0;
            for (int64_t l = 0; l < d; l++) {
                double wg = mod == BK_MOD_GATE ? W[i * d + l] : lw->w[BK_MOD_GATE][i * d + l];
                double wu = mod == BK_MOD_UP ? W[i * d + l] : lw->w[BK_MOD_UP][i * d + l];
                zg += wg * (double)x[l];
                zu += wu * (double)x[l];
            }
            hid[i] = silu(zg) * zu;
        }
        for (int64_t rr = 0; rr < d; rr++) {
            double sum = 0;
            for (int64_t i = 0; i < tn->NI; i++)
                sum += (double)lw->w[BK_MOD_DOWN][rr * tn->NI + i] * hid[i];
            out[k++] = sum;
        }
        break;
    }
    default: break;
    }
}

/* ------------------------------------------------- reference Hessians */

typedef struct ref {
    int64_t m, n, mn;
    double *H;    /* [mn, mn], vec column-major: index l*m + i for W[i][l] */
    double *Ea;   /* [n, n] E[a aᵀ] */
    double *Eb;   /* [m, m] E[b bᵀ] */
    double *aab;  /* [mn, mn] (1/N) Σ a aᵀ ⊗ b bᵀ, must equal H */
    double struct_err; /* worst relative residual of a Jacobian row vs vec(c aᵀ) */
} ref;

static void ref_free(ref *R)
{
    free(R->H);
    free(R->Ea);
    free(R->Eb);
    free(R->aab);
}

static void ref_build(const tiny *tn, bk_module mod, ref *R)
{
    int64_t m, n;
    bk_module_shape(&tn->cfg, mod, &m, &n);
    int64_t mn = m * n, N = tn->N, T = tn->T;
    R->m = m;
    R->n = n;
    R->mn = mn;
    R->H = calloc((size_t)(mn * mn), sizeof(double));
    R->aab = calloc((size_t)(mn * mn), sizeof(double));
    R->Ea = calloc((size_t)(n * n), sizeof(double));
    R->Eb = calloc((size_t)(m * m), sizeof(double));
    R->struct_err = 0;
    assert_true(R->H && R->aab && R->Ea && R->Eb);
    double Z = (mod == BK_MOD_Q || mod == BK_MOD_K) ? (double)(tn->S * T * (T + 1) / 2)
                                                    : (double)N;
    double *W = to_double(tn->lw.w[mod], mn);
    int64_t maxrows = loss_rows(tn, mod, 0) > loss_rows(tn, mod, T - 1)
                          ? loss_rows(tn, mod, 0)
                          : loss_rows(tn, mod, T - 1);
    double *J = malloc((size_t)(maxrows * mn) * sizeof(double));
    double *fp = malloc((size_t)maxrows * sizeof(double));
    double *fm = malloc((size_t)maxrows * sizeof(double));
    double *c = malloc((size_t)m * sizeof(double));
    double *bb = malloc((size_t)(m * m) * sizeof(double));
    assert_true(J && fp && fm && c && bb);
    const float *X = (mod == BK_MOD_GATE || mod == BK_MOD_UP) ? tn->mlp_in : tn->attn_in;
    const double eps = 1e-5;
    for (int64_t row = 0; row < N; row++) {
        int64_t t = row % T, rows = loss_rows(tn, mod, t);
        for (int64_t i = 0; i < m; i++)
            for (int64_t l = 0; l < n; l++) {
                double w0 = W[i * n + l];
                W[i * n + l] = w0 + eps;
                loss_eval(tn, mod, W, row, fp);
                W[i * n + l] = w0 - eps;
                loss_eval(tn, mod, W, row, fm);
                W[i * n + l] = w0;
                for (int64_t q = 0; q < rows; q++)
                    J[q * mn + l * m + i] = (fp[q] - fm[q]) / (2 * eps);
            }
        /* H += J^T J / Z */
        for (int64_t q = 0; q < rows; q++)
            for (int64_t p1 = 0; p1 < mn; p1++) {
                double jp = J[q * mn + p1];
                if (jp == 0)
                    continue;
                for (int64_t p2 = 0; p2 < mn; p2++)
                    R->H[p1 * mn + p2] += jp * J[q * mn + p2] / Z;
            }
        /* per sample: a = x, rows of J = vec(c aᵀ) */
        const float *a = X + row * n;
        double a2 = 0;
        for (int64_t l = 0; l < n; l++)
            a2 += (double)a[l] * (double)a[l];
        memset(bb, 0, (size_t)(m * m) * sizeof(double));
        for (int64_t q = 0; q < rows; q++) {
            double rn = 0, res = 0;
            for (int64_t i = 0; i < m; i++) {
                double s = 0;
                for (int64_t l = 0; l < n; l++)
                    s += (double)a[l] * J[q * mn + l * m + i];
                c[i] = s / a2;
            }
            for (int64_t i = 0; i < m; i++)
                for (int64_t l = 0; l < n; l++) {
                    double jv = J[q * mn + l * m + i], e = jv - c[i] * (double)a[l];
                    rn += jv * jv;
                    res += e * e;
                }
            if (rn > 0 && sqrt(res / rn) > R->struct_err)
                R->struct_err = sqrt(res / rn);
            for (int64_t i = 0; i < m; i++)
                for (int64_t i2 = 0; i2 < m; i2++)
                    bb[i * m + i2] += c[i] * c[i2] * (double)N / Z;
        }
        for (int64_t l = 0; l < n; l++)
            for (int64_t l2 = 0; l2 < n; l2++)
                R->Ea[l * n + l2] += (double)a[l] * (double)a[l2] / (double)N;
        for (int64_t i = 0; i < m * m; i++)
            R->Eb[i] += bb[i] / (double)N;
        for (int64_t l = 0; l < n; l++)
            for (int64_t i = 0; i < m; i++)
                for (int64_t l2 = 0; l2 < n; l2++)
                    for (int64_t i2 = 0; i2 < m; i2++)
                        R->aab[(l * m + i) * mn + l2 * m + i2] +=
                            (double)a[l] * (double)a[l2] * bb[i * m + i2] / (double)N;
    }
    free(W);
    free(J);
    free(fp);
    free(fm);
    free(c);
    free(bb);
}

/* R(H) [n², m²]: R[(l + l' n), (i + i' m)] = H[l m + i, l' m + i']. */
static double *rearrange(const ref *R)
{
    int64_t m = R->m, n = R->n, mn = R->mn;
    double *M = malloc((size_t)(n * n * m * m) * sizeof(double));
    assert_non_null(M);
    for (int64_t l = 0; l < n; l++)
        for (int64_t l2 = 0; l2 < n; l2++)
            for (int64_t i = 0; i < m; i++)
                for (int64_t i2 = 0; i2 < m; i2++)
                    M[(l + l2 * n) * (m * m) + (i + i2 * m)] =
                        R->H[(l * m + i) * mn + l2 * m + i2];
    return M;
}

/* ---------------------------------------------------------------- checks */

static double rel_err_fd(const float *x, const double *y, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)x[i] - y[i];
        num += e * e;
        den += y[i] * y[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}

static double rel_err_dd(const double *x, const double *y, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = x[i] - y[i];
        num += e * e;
        den += y[i] * y[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}

static double rel_err_ff(const float *x, const float *y, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)x[i] - (double)y[i];
        num += e * e;
        den += (double)y[i] * (double)y[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-300));
}

#define CHECK_CLOSE(err, tol, ...)                                                         \
    do {                                                                                   \
        double e_ = (err);                                                                 \
        if (getenv("BK_TEST_VERBOSE")) {                                                   \
            print_message("err %.3e (tol %.0e): ", e_, (double)(tol));                     \
            print_message(__VA_ARGS__);                                                    \
        }                                                                                  \
        if (!(e_ <= (tol))) {                                                              \
            print_error(__VA_ARGS__);                                                      \
            fail_msg("relative error %.3e > %.1e", e_, (double)(tol));                     \
        }                                                                                  \
    } while (0)

static void get_factors(bk_hess_acc *a, const tiny *tn, bk_module mod, const float **A,
                        const float **B)
{
    bk_status st = bk_hess_factors(a, &tn->lw, mod, A, B);
    if (st != BK_OK)
        fail_msg("factors %s: %s", bk_module_name(mod), bk_last_error());
}

/* ------------------------------------------------------------------ tests */

static const bk_module two_sided[] = {BK_MOD_Q, BK_MOD_K, BK_MOD_V, BK_MOD_GATE, BK_MOD_UP};

/* The test's own construction is consistent: J rows are rank one with a = x,
 * and (1/N) Σ a aᵀ ⊗ b bᵀ rebuilds H. */
static void test_reference_structure(void **state)
{
    (void)state;
    for (int variant = 0; variant < 2; variant++) {
        tiny tn;
        tiny_make(&tn, variant, 11 + (uint64_t)variant);
        for (size_t k = 0; k < sizeof two_sided / sizeof two_sided[0]; k++) {
            ref R;
            ref_build(&tn, two_sided[k], &R);
            CHECK_CLOSE(R.struct_err, 1e-7, "variant %d %s: Jacobian rows are not c aᵀ\n",
                        variant, bk_module_name(two_sided[k]));
            CHECK_CLOSE(rel_err_dd(R.aab, R.H, R.mn * R.mn), 1e-9,
                        "variant %d %s: H != E[aaᵀ ⊗ bbᵀ]\n", variant,
                        bk_module_name(two_sided[k]));
            ref_free(&R);
        }
        tiny_free(&tn);
    }
}

static void check_kfac(int variant, int fp64)
{
    tiny tn;
    tiny_make(&tn, variant, 21 + (uint64_t)variant);
    bk_hess_acc *a = make_acc(&tn, BK_HESS_FULLYLOCAL_KFAC, fp64);
    feed(a, &tn, 0, tn.S);
    double tol = fp64 ? 1e-5 : 1e-4;
    for (size_t k = 0; k < sizeof two_sided / sizeof two_sided[0]; k++) {
        bk_module mod = two_sided[k];
        ref R;
        ref_build(&tn, mod, &R);
        const float *A, *B;
        get_factors(a, &tn, mod, &A, &B);
        assert_non_null(B);
        CHECK_CLOSE(rel_err_fd(A, R.Ea, R.n * R.n), tol, "variant %d fp64 %d %s: K-FAC A\n",
                    variant, fp64, bk_module_name(mod));
        CHECK_CLOSE(rel_err_fd(B, R.Eb, R.m * R.m), tol, "variant %d fp64 %d %s: K-FAC B\n",
                    variant, fp64, bk_module_name(mod));
        ref_free(&R);
    }
    bk_hess_acc_free(a);
    tiny_free(&tn);
}

static void test_kfac_llama(void **state)
{
    (void)state;
    check_kfac(0, 0);
    check_kfac(0, 1);
}

static void test_kfac_qwen3(void **state)
{
    (void)state;
    check_kfac(1, 0);
    check_kfac(1, 1);
}

/* One power step of R(H) from the identity. */
static void power_step_ref(const ref *R, double *A1, double *B1)
{
    int64_t m = R->m, n = R->n, mn = R->mn;
    for (int64_t l = 0; l < n; l++)
        for (int64_t l2 = 0; l2 < n; l2++) {
            double s = 0;
            for (int64_t i = 0; i < m; i++)
                s += R->H[(l * m + i) * mn + l2 * m + i];
            A1[l * n + l2] = s;
        }
    for (int64_t i = 0; i < m; i++)
        for (int64_t i2 = 0; i2 < m; i2++) {
            double s = 0;
            for (int64_t l = 0; l < n; l++)
                s += R->H[(l * m + i) * mn + l * m + i2];
            B1[i * m + i2] = s;
        }
}

static void check_shampoo(int variant, int fp64)
{
    tiny tn;
    tiny_make(&tn, variant, 31 + (uint64_t)variant);
    bk_hess_acc *a = make_acc(&tn, BK_HESS_FULLYLOCAL_SHAMPOO, fp64);
    feed(a, &tn, 0, tn.S);
    double tol = fp64 ? 1e-5 : 1e-4;
    for (size_t k = 0; k < sizeof two_sided / sizeof two_sided[0]; k++) {
        bk_module mod = two_sided[k];
        ref R;
        ref_build(&tn, mod, &R);
        double *A1 = malloc((size_t)(R.n * R.n) * sizeof(double));
        double *B1 = malloc((size_t)(R.m * R.m) * sizeof(double));
        assert_true(A1 && B1);
        /* the same step written as R(H) vec(I) with the explicit R(H) */
        double *M = rearrange(&R);
        int64_t n2 = R.n * R.n, m2 = R.m * R.m;
        for (int64_t p = 0; p < n2; p++) {
            double s = 0;
            for (int64_t i = 0; i < R.m; i++)
                s += M[p * m2 + i + i * R.m];
            A1[p % R.n * R.n + p / R.n] = s; /* vec⁻¹, column-major */
        }
        for (int64_t q = 0; q < m2; q++) {
            double s = 0;
            for (int64_t l = 0; l < R.n; l++)
                s += M[(l + l * R.n) * m2 + q];
            B1[q % R.m * R.m + q / R.m] = s;
        }
        double *A1b = malloc((size_t)n2 * sizeof(double)), *B1b = malloc((size_t)m2 * sizeof(double));
        assert_true(A1b && B1b);
        power_step_ref(&R, A1b, B1b);
        CHECK_CLOSE(rel_err_dd(A1, A1b, n2), 1e-12, "R(H) vec(I) disagrees with itself\n");
        CHECK_CLOSE(rel_err_dd(B1, B1b, m2), 1e-12, "R(H)ᵀ vec(I) disagrees with itself\n");
        const float *A, *B;
        get_factors(a, &tn, mod, &A, &B);
        assert_non_null(B);
        CHECK_CLOSE(rel_err_fd(A, A1, n2), tol, "variant %d fp64 %d %s: Shampoo A\n", variant,
                    fp64, bk_module_name(mod));
        CHECK_CLOSE(rel_err_fd(B, B1, m2), tol, "variant %d fp64 %d %s: Shampoo B\n", variant,
                    fp64, bk_module_name(mod));
        free(A1);
        free(B1);
        free(A1b);
        free(B1b);
        free(M);
        ref_free(&R);
    }
    bk_hess_acc_free(a);
    tiny_free(&tn);
}

static void test_shampoo_llama(void **state)
{
    (void)state;
    check_shampoo(0, 0);
    check_shampoo(0, 1);
}

static void test_shampoo_qwen3(void **state)
{
    (void)state;
    check_shampoo(1, 0);
    check_shampoo(1, 1);
}

/* MLP-local kinds give gate/up the same factors as fully-local, and the
 * gptq factors to q/k/v. */
static void test_mlplocal_and_gptq(void **state)
{
    (void)state;
    tiny tn;
    tiny_make(&tn, 1, 41);
    const bk_hessian_kind pairs[2][2] = {{BK_HESS_MLPLOCAL_KFAC, BK_HESS_FULLYLOCAL_KFAC},
                                         {BK_HESS_MLPLOCAL_SHAMPOO, BK_HESS_FULLYLOCAL_SHAMPOO}};
    for (int p = 0; p < 2; p++) {
        bk_hess_acc *ml = make_acc(&tn, pairs[p][0], 0), *fl = make_acc(&tn, pairs[p][1], 0);
        feed(ml, &tn, 0, tn.S);
        feed(fl, &tn, 0, tn.S);
        for (int m = BK_MOD_GATE; m <= BK_MOD_UP; m++) {
            const float *A1, *B1, *A2, *B2;
            get_factors(ml, &tn, (bk_module)m, &A1, &B1);
            get_factors(fl, &tn, (bk_module)m, &A2, &B2);
            assert_true(B1 && B2);
            assert_true(rel_err_ff(A1, A2, tn.d * tn.d) < 1e-6);
            assert_true(rel_err_ff(B1, B2, tn.NI * tn.NI) < 1e-6);
        }
        bk_hess_acc_free(ml);
        bk_hess_acc_free(fl);
    }
    /* gptq: A = E[x xᵀ] of each module's own input, B = I (NULL), for every
     * module; the same for the one-sided modules of every other kind */
    for (int k = BK_HESS_GPTQ; k <= BK_HESS_FULLYLOCAL_SHAMPOO; k++) { /* backprop: test_backward.c */
        bk_hess_acc *a = make_acc(&tn, (bk_hessian_kind)k, 0);
        feed(a, &tn, 0, tn.S);
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            if (bk_hessian_is_two_sided((bk_hessian_kind)k, (bk_module)m))
                continue;
            int64_t o, n;
            bk_module_shape(&tn.cfg, (bk_module)m, &o, &n);
            const float *X = m <= BK_MOD_V ? tn.attn_in
                             : m == BK_MOD_O ? tn.o_in
                             : m == BK_MOD_DOWN ? tn.down_in
                                                : tn.mlp_in;
            double *E = calloc((size_t)(n * n), sizeof(double));
            assert_non_null(E);
            for (int64_t row = 0; row < tn.N; row++)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t j = 0; j < n; j++)
                        E[i * n + j] += (double)X[row * n + i] * (double)X[row * n + j] /
                                        (double)tn.N;
            const float *A, *B;
            get_factors(a, &tn, (bk_module)m, &A, &B);
            assert_null(B);
            CHECK_CLOSE(rel_err_fd(A, E, n * n), 1e-5, "%s %s: gptq A\n",
                        bk_hessian_name((bk_hessian_kind)k), bk_module_name((bk_module)m));
            free(E);
        }
        bk_hess_acc_free(a);
    }
    tiny_free(&tn);
}

/* The exact RoPE treatment differs from the paper's simplification
 * B_q = E[Σ_u k_u k_uᵀ] (keys without the relative rotation) on this
 * example, so the K-FAC test above would catch an implementation of the
 * simplification. */
static void test_rope_matters(void **state)
{
    (void)state;
    tiny tn;
    tiny_make(&tn, 0, 51);
    bk_hess_acc *a = make_acc(&tn, BK_HESS_FULLYLOCAL_KFAC, 1);
    feed(a, &tn, 0, tn.S);
    const float *A, *B;
    get_factors(a, &tn, BK_MOD_Q, &A, &B);
    int64_t m = tn.qd, h = tn.h, T = tn.T;
    double *Bs = calloc((size_t)(m * m), sizeof(double));
    assert_non_null(Bs);
    double P = (double)(tn.S * T * (T + 1) / 2);
    for (int64_t s = 0; s < tn.S; s++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t u = 0; u <= t; u++)
                for (int64_t j = 0; j < tn.H; j++) {
                    const float *k = tn.k_rot + (s * T + u) * tn.kvd + (j / tn.r) * h;
                    for (int64_t i = 0; i < h; i++)
                        for (int64_t i2 = 0; i2 < h; i2++)
                            Bs[(j * h + i) * m + j * h + i2] += (double)k[i] * (double)k[i2] / P;
                }
    double e = rel_err_fd(B, Bs, m * m);
    if (getenv("BK_TEST_VERBOSE"))
        print_message("exact vs simplified q output factor: relative difference %.3f\n", e);
    if (!(e > 0.05))
        fail_msg("exact and simplified q factors agree to %.3e: the example does not test RoPE",
                 e);
    free(Bs);
    bk_hess_acc_free(a);
    tiny_free(&tn);
}

/* Normalize to unit Frobenius norm (sign: positive trace). */
static void unit(double *x, int64_t n, int64_t dim)
{
    double s = 0, tr = 0;
    for (int64_t i = 0; i < n; i++)
        s += x[i] * x[i];
    for (int64_t i = 0; i < dim; i++)
        tr += x[i * dim + i];
    s = sqrt(s) * (tr < 0 ? -1.0 : 1.0);
    for (int64_t i = 0; i < n; i++)
        x[i] /= s;
}

/* Repeated power steps (bk_hess_set_start) reach the best Kronecker
 * approximation: the top singular pair of R(H) (LAPACK dgesvd). */
static void test_shampoo_converges(void **state)
{
    (void)state;
    for (int variant = 0; variant < 2; variant++) {
        tiny tn;
        tiny_make(&tn, variant, 61 + (uint64_t)variant);
        bk_hess_acc *a = make_acc(&tn, BK_HESS_FULLYLOCAL_SHAMPOO, 1);
        for (size_t k = 0; k < sizeof two_sided / sizeof two_sided[0]; k++) {
            bk_module mod = two_sided[k];
            ref R;
            ref_build(&tn, mod, &R);
            int64_t n2 = R.n * R.n, m2 = R.m * R.m, kk = n2 < m2 ? n2 : m2;
            double *M = rearrange(&R);
            double *sv = malloc((size_t)kk * sizeof(double));
            double *U = malloc((size_t)(n2 * kk) * sizeof(double));
            double *VT = malloc((size_t)(kk * m2) * sizeof(double));
            double *sup = malloc((size_t)kk * sizeof(double));
            assert_true(sv && U && VT && sup);
            assert_int_equal(LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'S', 'S', (lapack_int)n2,
                                            (lapack_int)m2, M, (lapack_int)m2, sv, U,
                                            (lapack_int)kk, VT, (lapack_int)m2, sup),
                             0);
            double *Astar = malloc((size_t)n2 * sizeof(double));
            double *Bstar = malloc((size_t)m2 * sizeof(double));
            assert_true(Astar && Bstar);
            for (int64_t p = 0; p < n2; p++)
                Astar[p % R.n * R.n + p / R.n] = U[p * kk];
            for (int64_t q = 0; q < m2; q++)
                Bstar[q % R.m * R.m + q / R.m] = VT[q];
            unit(Astar, n2, R.n);
            unit(Bstar, m2, R.m);

            /* iterate with the implementation */
            double *Ak = malloc((size_t)n2 * sizeof(double));
            double *Bk = malloc((size_t)m2 * sizeof(double));
            float *Af = malloc((size_t)n2 * sizeof(float));
            float *Bf = malloc((size_t)m2 * sizeof(float));
            assert_true(Ak && Bk && Af && Bf);
            double ea = 1, eb = 1;
            int it;
            for (it = 0; it < 200; it++) {
                bk_hess_acc_reset(a);
                if (it > 0) {
                    bk_status st = bk_hess_set_start(a, mod, Af, R.n, Bf, R.m);
                    if (st != BK_OK)
                        fail_msg("set_start: %s", bk_last_error());
                }
                feed(a, &tn, 0, tn.S);
                const float *A, *B;
                get_factors(a, &tn, mod, &A, &B);
                for (int64_t i = 0; i < n2; i++)
                    Ak[i] = A[i];
                for (int64_t i = 0; i < m2; i++)
                    Bk[i] = B[i];
                unit(Ak, n2, R.n);
                unit(Bk, m2, R.m);
                for (int64_t i = 0; i < n2; i++)
                    Af[i] = (float)Ak[i];
                for (int64_t i = 0; i < m2; i++)
                    Bf[i] = (float)Bk[i];
                ea = rel_err_dd(Ak, Astar, n2);
                eb = rel_err_dd(Bk, Bstar, m2);
                if (ea < 1e-6 && eb < 1e-6)
                    break;
            }
            if (!(ea < 1e-5 && eb < 1e-5))
                fail_msg("variant %d %s: power iteration after %d steps is %.2e / %.2e from "
                         "the top singular pair (sigma2/sigma1 = %.3f)",
                         variant, bk_module_name(mod), it, ea, eb, kk > 1 ? sv[1] / sv[0] : 0.0);
            /* the limit is at least as good a Kronecker approximation as
             * K-FAC's E[aaᵀ] ⊗ E[bbᵀ] (best scalar multiple of each) */
            double best_err2 = 0;
            for (int64_t i = 1; i < kk; i++)
                best_err2 += sv[i] * sv[i];
            double hh = 0, hk = 0, kk2 = 0;
            for (int64_t l = 0; l < R.n; l++)
                for (int64_t i = 0; i < R.m; i++)
                    for (int64_t l2 = 0; l2 < R.n; l2++)
                        for (int64_t i2 = 0; i2 < R.m; i2++) {
                            double hv = R.H[(l * R.m + i) * R.mn + l2 * R.m + i2];
                            double kv = R.Ea[l * R.n + l2] * R.Eb[i * R.m + i2];
                            hh += hv * hv;
                            hk += hv * kv;
                            kk2 += kv * kv;
                        }
            double kfac_err2 = hh - hk * hk / kk2;
            assert_true(best_err2 <= kfac_err2 * (1 + 1e-9) + 1e-12 * hh);
            free(M);
            free(sv);
            free(U);
            free(VT);
            free(sup);
            free(Astar);
            free(Bstar);
            free(Ak);
            free(Bk);
            free(Af);
            free(Bf);
            ref_free(&R);
        }
        bk_hess_acc_free(a);
        tiny_free(&tn);
    }
}

/* Adding the sequences in one or three micro-batches gives the same
 * factors; F32 and F64 accumulation agree; every factor is symmetric PSD. */
static void test_batching_precision_psd(void **state)
{
    (void)state;
    tiny tn;
    tiny_make(&tn, 1, 71);
    for (int k = BK_HESS_GPTQ; k <= BK_HESS_FULLYLOCAL_SHAMPOO; k++) { /* the local kinds */
        bk_hessian_kind kind = (bk_hessian_kind)k;
        bk_hess_acc *one = make_acc(&tn, kind, 0), *three = make_acc(&tn, kind, 0);
        bk_hess_acc *d64 = make_acc(&tn, kind, 1);
        feed(one, &tn, 0, tn.S);
        for (int64_t s = 0; s < tn.S; s++)
            feed(three, &tn, s, 1);
        feed(d64, &tn, 0, tn.S);
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            const float *A1, *B1, *A3, *B3, *A6, *B6;
            get_factors(one, &tn, (bk_module)m, &A1, &B1);
            get_factors(three, &tn, (bk_module)m, &A3, &B3);
            get_factors(d64, &tn, (bk_module)m, &A6, &B6);
            int64_t o, n;
            bk_module_shape(&tn.cfg, (bk_module)m, &o, &n);
            CHECK_CLOSE(rel_err_ff(A3, A1, n * n), 1e-5, "%s %s: A, 1 vs 3 batches\n",
                        bk_hessian_name(kind), bk_module_name((bk_module)m));
            CHECK_CLOSE(rel_err_ff(A6, A1, n * n), 1e-5, "%s %s: A, F64 vs F32\n",
                        bk_hessian_name(kind), bk_module_name((bk_module)m));
            assert_int_equal(B1 != NULL, bk_hessian_is_two_sided(kind, (bk_module)m));
            assert_int_equal(B3 != NULL, B1 != NULL);
            assert_int_equal(B6 != NULL, B1 != NULL);
            if (B1) {
                CHECK_CLOSE(rel_err_ff(B3, B1, o * o), 1e-5, "%s %s: B, 1 vs 3 batches\n",
                            bk_hessian_name(kind), bk_module_name((bk_module)m));
                CHECK_CLOSE(rel_err_ff(B6, B1, o * o), 1e-5, "%s %s: B, F64 vs F32\n",
                            bk_hessian_name(kind), bk_module_name((bk_module)m));
            }
            const float *F[2] = {A1, B1};
            int64_t dim[2] = {n, o};
            for (int f = 0; f < 2; f++) {
                if (!F[f])
                    continue;
                int64_t q = dim[f];
                double *S = malloc((size_t)(q * q) * sizeof(double));
                double *w = malloc((size_t)q * sizeof(double));
                assert_true(S && w);
                for (int64_t i = 0; i < q; i++)
                    for (int64_t j = 0; j < q; j++) {
                        assert_true(F[f][i * q + j] == F[f][j * q + i]);
                        S[i * q + j] = F[f][i * q + j];
                    }
                assert_int_equal(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'U', (lapack_int)q, S,
                                               (lapack_int)q, w),
                                 0);
                if (!(w[q - 1] > 0 && w[0] >= -1e-5 * w[q - 1]))
                    fail_msg("%s %s %c: eigenvalues %.3e .. %.3e (not PSD)",
                             bk_hessian_name(kind), bk_module_name((bk_module)m), f ? 'B' : 'A',
                             w[0], w[q - 1]);
                free(S);
                free(w);
            }
        }
        bk_hess_acc_free(one);
        bk_hess_acc_free(three);
        bk_hess_acc_free(d64);
    }
    tiny_free(&tn);
}

/* Reset empties the accumulator: a second layer gives the same factors as
 * a fresh accumulator. */
static void test_reset(void **state)
{
    (void)state;
    tiny tn;
    tiny_make(&tn, 0, 81);
    bk_hess_acc *a = make_acc(&tn, BK_HESS_FULLYLOCAL_SHAMPOO, 0);
    bk_hess_acc *b = make_acc(&tn, BK_HESS_FULLYLOCAL_SHAMPOO, 0);
    feed(a, &tn, 0, 2);
    bk_hess_acc_reset(a);
    tn.lw.layer = 1;
    feed(a, &tn, 0, tn.S);
    feed(b, &tn, 0, tn.S);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        const float *A1, *B1, *A2, *B2;
        get_factors(a, &tn, (bk_module)m, &A1, &B1);
        get_factors(b, &tn, (bk_module)m, &A2, &B2);
        int64_t o, n;
        bk_module_shape(&tn.cfg, (bk_module)m, &o, &n);
        assert_true(rel_err_ff(A1, A2, n * n) == 0);
        if (B1)
            assert_true(rel_err_ff(B1, B2, o * o) == 0);
    }
    bk_hess_acc_free(a);
    bk_hess_acc_free(b);
    tiny_free(&tn);
}

static void expect_err(bk_status got, bk_status want, const char *needle)
{
    if (got != want)
        fail_msg("got status %s (%s), expected %s", bk_status_name(got), bk_last_error(),
                 bk_status_name(want));
    const char *msg = bk_last_error();
    assert_true(msg[0] != '\0');
    assert_null(strchr(msg, '\n'));
    if (needle && !strstr(msg, needle))
        fail_msg("message '%s' does not mention '%s'", msg, needle);
}

static void test_names(void **state)
{
    (void)state;
    for (int k = 0; k < BK_HESS_COUNT; k++) {
        bk_hessian_kind out;
        assert_int_equal(bk_hessian_from_name(bk_hessian_name((bk_hessian_kind)k), &out), BK_OK);
        assert_int_equal(out, k);
    }
    bk_hessian_kind out;
    expect_err(bk_hessian_from_name("kfac", &out), BK_ERR_INVALID_ARG, "kfac");
    /* Table 4 */
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        int mlp = m == BK_MOD_GATE || m == BK_MOD_UP, qkv = m <= BK_MOD_V;
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_RTN, (bk_module)m), 0);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_GPTQ, (bk_module)m), 0);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_MLPLOCAL_KFAC, (bk_module)m), mlp);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_MLPLOCAL_SHAMPOO, (bk_module)m), mlp);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_FULLYLOCAL_KFAC, (bk_module)m),
                         mlp || qkv);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_FULLYLOCAL_SHAMPOO, (bk_module)m),
                         mlp || qkv);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_BACKPROP_KFAC, (bk_module)m), 1);
        assert_int_equal(bk_hessian_is_two_sided(BK_HESS_BACKPROP_SHAMPOO, (bk_module)m), 1);
    }
}

static void test_errors(void **state)
{
    (void)state;
    tiny tn;
    tiny_make(&tn, 1, 91);
    bk_hess_acc *a = NULL;
    const float *A = (const float *)&tn, *B = (const float *)&tn;

    /* shapes in the config */
    bk_model_config bad = tn.cfg;
    bad.n_heads = 3;
    expect_err(bk_hess_acc_create(&bad, BK_HESS_GPTQ, 0, tn.T, &a), BK_ERR_SHAPE,
               "num_key_value_heads");
    assert_null(a);
    bad = tn.cfg;
    bad.hidden = 0;
    expect_err(bk_hess_acc_create(&bad, BK_HESS_GPTQ, 0, tn.T, &a), BK_ERR_SHAPE, "hidden");
    bad = tn.cfg;
    bad.head_dim = 3;
    bad.n_heads = 2;
    bad.n_kv_heads = 1;
    expect_err(bk_hess_acc_create(&bad, BK_HESS_FULLYLOCAL_KFAC, 0, tn.T, &a), BK_ERR_SHAPE,
               "head_dim");
    bad = tn.cfg;
    strcpy(bad.hidden_act, "gelu");
    expect_err(bk_hess_acc_create(&bad, BK_HESS_MLPLOCAL_KFAC, 0, tn.T, &a), BK_ERR_UNSUPPORTED,
               "gelu");
    expect_err(bk_hess_acc_create(&tn.cfg, BK_HESS_GPTQ, 0, 0, &a), BK_ERR_INVALID_ARG,
               "sequence length");

    /* factors before any add */
    a = make_acc(&tn, BK_HESS_FULLYLOCAL_KFAC, 0);
    expect_err(bk_hess_factors(a, &tn.lw, BK_MOD_Q, &A, &B), BK_ERR_CALIB, "self_attn.q_proj");
    assert_null(A);
    assert_null(B);
    assert_int_equal(bk_hess_add_mlp(a, &tn.lw, tn.mlp_in, tn.S), BK_OK);
    expect_err(bk_hess_factors(a, &tn.lw, BK_MOD_DOWN, &A, &B), BK_ERR_CALIB, "mlp.down_proj");

    /* fully-local needs q_rot / k_rot */
    expect_err(bk_hess_add_attn(a, &tn.lw, tn.attn_in, NULL, tn.k_rot, tn.S),
               BK_ERR_INVALID_ARG, "q_rot");
    /* bad sequence count */
    expect_err(bk_hess_add_o(a, tn.o_in, 0), BK_ERR_INVALID_ARG, "sequence count");
    /* another layer's weights without reset */
    tn.lw.layer = 5;
    expect_err(bk_hess_add_attn(a, &tn.lw, tn.attn_in, tn.q_rot, tn.k_rot, tn.S),
               BK_ERR_INVALID_ARG, "layer 5");
    tn.lw.layer = 0;
    /* down_proj changed between add and factors */
    tn.lw.w[BK_MOD_DOWN][3] += 0.25f;
    expect_err(bk_hess_factors(a, &tn.lw, BK_MOD_UP, &A, &B), BK_ERR_INVALID_ARG,
               "mlp.down_proj");
    tn.lw.w[BK_MOD_DOWN][3] -= 0.25f;
    /* non-finite input: named, with its row */
    tn.attn_in[2 * tn.d + 1] = NAN;
    expect_err(bk_hess_add_attn(a, &tn.lw, tn.attn_in, tn.q_rot, tn.k_rot, tn.S),
               BK_ERR_NONFINITE, "attn_in");
    assert_non_null(strstr(bk_last_error(), "row 2"));
    tn.attn_in[2 * tn.d + 1] = 0.5f;
    /* start factors: wrong kind, one-sided module, wrong shape, too late */
    expect_err(bk_hess_set_start(a, BK_MOD_Q, NULL, tn.d, NULL, tn.qd), BK_ERR_INVALID_ARG,
               "Shampoo");
    bk_hess_acc_free(a);
    a = make_acc(&tn, BK_HESS_FULLYLOCAL_SHAMPOO, 0);
    expect_err(bk_hess_set_start(a, BK_MOD_O, NULL, tn.qd, NULL, tn.d), BK_ERR_INVALID_ARG,
               "self_attn.o_proj");
    expect_err(bk_hess_set_start(a, BK_MOD_UP, NULL, tn.d, NULL, tn.NI + 1), BK_ERR_SHAPE,
               "mlp.up_proj");
    float *Bbad = calloc((size_t)(tn.NI * tn.NI), sizeof(float));
    assert_non_null(Bbad);
    Bbad[1] = 1.0f; /* not symmetric */
    expect_err(bk_hess_set_start(a, BK_MOD_UP, NULL, tn.d, Bbad, tn.NI), BK_ERR_INVALID_ARG,
               "symmetric");
    Bbad[1] = 0.0f;
    Bbad[0] = -1.0f; /* symmetric but negative definite: the weights would be negative */
    assert_int_equal(bk_hess_set_start(a, BK_MOD_UP, NULL, tn.d, Bbad, tn.NI), BK_OK);
    expect_err(bk_hess_add_mlp(a, &tn.lw, tn.mlp_in, tn.S), BK_ERR_INVALID_ARG,
               "positive semidefinite");
    /* the failed add poisoned the accumulator until reset */
    expect_err(bk_hess_add_o(a, tn.o_in, tn.S), BK_ERR_INVALID_ARG, "reset");
    bk_hess_acc_reset(a);
    assert_int_equal(bk_hess_add_mlp(a, &tn.lw, tn.mlp_in, tn.S), BK_OK);
    expect_err(bk_hess_set_start(a, BK_MOD_UP, NULL, tn.d, NULL, tn.NI), BK_ERR_INVALID_ARG,
               "before the first add");
    free(Bbad);
    bk_hess_acc_free(a);

    /* rtn: no factors, no error */
    a = make_acc(&tn, BK_HESS_RTN, 0);
    feed(a, &tn, 0, tn.S);
    assert_int_equal(bk_hess_factors(a, &tn.lw, BK_MOD_GATE, &A, &B), BK_OK);
    assert_null(A);
    assert_null(B);
    bk_hess_acc_free(a);
    bk_hess_acc_free(NULL);
    tiny_free(&tn);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_reference_structure),
        cmocka_unit_test(test_kfac_llama),
        cmocka_unit_test(test_kfac_qwen3),
        cmocka_unit_test(test_shampoo_llama),
        cmocka_unit_test(test_shampoo_qwen3),
        cmocka_unit_test(test_mlplocal_and_gptq),
        cmocka_unit_test(test_rope_matters),
        cmocka_unit_test(test_shampoo_converges),
        cmocka_unit_test(test_batching_precision_psd),
        cmocka_unit_test(test_reset),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
