/* CUDA backend — Kronecker-factored Hessians accumulated on the GPU with the
 * formulas of src/hessian.c (docs/hessians.md; notation there):
 *
 *   Gram matrices Σ x xᵀ      cuBLAS SYRK into F32 (or F64 with fp64),
 *                             weighted rows scaled by sqrt(w) first, as the CPU;
 *   gate/up (MLP-local)       g = silu(z_g), f = silu'(z_g) z_u in double from
 *                             the F32 projections; Shampoo weights in double;
 *                             B = (Σ w v vᵀ / N) ⊙ DᵀD on the device;
 *   q/k/v (fully-local)       per (sequence, kv head) and 2x2 entry block
 *                             ("quad": rows i, i+h/2 x columns j, j+h/2, the
 *                             pairs RoPE mixes), one thread runs the prefix
 *                             (q) or suffix (k) Gram of that quad and its RoPE
 *                             sandwich R_tᵀ C_t R_t over the positions, in
 *                             double, exactly as rot_sandwich (a block per
 *                             head, the positions staged in shared memory:
 *                             hess_attn.cuh quads_launch); with q_norm /
 *                             k_norm (Qwen3) each position takes five steps
 *                             (Gram update, sandwich, J-products, scalars,
 *                             accumulation) on the whole blocks, as
 *                             norm_sandwich, run for a round of up to 64
 *                             positions by four launches (the Gram and the
 *                             accumulation in position order, the rest
 *                             per position); per-sequence partial sums are
 *                             reduced in sequence order (deterministic);
 *   v                         B_O = Σ_{j in κ} O_jᵀ O_j by SYRK from W_o.
 *
 * The small per-head blocks are finished on the host with the CPU's loops;
 * A and the gate/up B are formed on the device and downloaded. One layer's
 * accumulators are resident; bk_ghess_reset clears them.
 */
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fwd_internal.cuh"
#include "hess_attn.cuh"
#include "hess_blocks.h"

extern "C" {
#include "backward_internal.h"
#include "util.h"
}

namespace {

struct dgram {
    int64_t n;
    void *s; /* device [n, n]: row-major upper triangle valid (column-major lower) */
};

/* Rows per chunk when rows are scaled or converted before a SYRK: at most
 * 64 Mi elements of scratch. */
const int64_t SCRATCH_ELEMS = (int64_t)1 << 26;

/* Per-position state of a q/k-norm round (sandwiched Grams, norm products
 * and scalars for each position of the round): about 64 MiB at most. */
const int64_t QN_ROUND_BYTES = (int64_t)64 << 20;

/* ------------------------------------------------------------- kernels */

#define GRID_LOOP(i, n)                                                              \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);       \
         i += (int64_t)gridDim.x * blockDim.x)

/* y = sqrt(w_r) x (rounded to float), or x itself (w NULL). */
__global__ void k_scale_rows_f(const float *X, int64_t rows, int64_t n, const double *w, float *y)
{
    GRID_LOOP(i, rows * n)
    {
        const int64_t r = i / n;
        const double s = w ? sqrt(w[r]) : 1.0;
        y[i] = (float)(s * (double)X[i]);
    }
}

__global__ void k_scale_rows_d(const float *X, int64_t rows, int64_t n, const double *w, double *y)
{
    GRID_LOOP(i, rows * n)
    {
        const int64_t r = i / n;
        const double s = w ? sqrt(w[r]) : 1.0;
        y[i] = s * (double)X[i];
    }
}

/* dst [n, n] = scale * G, both triangles (G: upper triangle row-major). */
__global__ void k_gram_out(const void *G, int fp64, int64_t n, double scale, float *dst)
{
    GRID_LOOP(idx, n * n)
    {
        int64_t i = idx / n, j = idx % n;
        const int64_t a = i < j ? i : j, b = i < j ? j : i;
        const double g = fp64 ? static_cast<const double *>(G)[a * n + b]
                              : (double)static_cast<const float *>(G)[a * n + b];
        dst[idx] = (float)(scale * g);
    }
}

/* dst [n, n] = (float)(G / N), both triangles (G: double, upper triangle row-major). */
__global__ void k_gram_div(const double *G, int64_t n, double N, float *dst)
{
    GRID_LOOP(idx, n * n)
    {
        int64_t i = idx / n, j = idx % n;
        const int64_t a = i < j ? i : j, b = i < j ? j : i;
        dst[idx] = (float)(G[a * n + b] / N);
    }
}

/* gate/up B: dst = (DᵀD)_ij * G_ij / N (DtD: upper triangle row-major). */
__global__ void k_mlp_b(const float *DtD, const void *G, int fp64, int64_t n, double N, float *dst)
{
    GRID_LOOP(idx, n * n)
    {
        int64_t i = idx / n, j = idx % n;
        const int64_t a = i < j ? i : j, b = i < j ? j : i;
        const double g = fp64 ? static_cast<const double *>(G)[a * n + b]
                              : (double)static_cast<const float *>(G)[a * n + b];
        dst[idx] = (float)((double)DtD[a * n + b] * g / N);
    }
}

__device__ __forceinline__ double d_silu(double z)
{
    return z / (1.0 + exp(-z));
}

__device__ __forceinline__ double d_silu_prime(double z)
{
    const double s = 1.0 / (1.0 + exp(-z));
    return s * (1.0 + z * (1.0 - s));
}

/* zg <- g = silu(zg), zu <- f = silu'(zg) zu (double, rounded to float). */
__global__ void k_mlp_gf(float *zg, float *zu, int64_t n)
{
    GRID_LOOP(i, n)
    {
        const double z = zg[i];
        zu[i] = (float)(d_silu_prime(z) * (double)zu[i]);
        zg[i] = (float)d_silu(z);
    }
}

/* out[r] = Σ_c X[r, c]^2 (times dcol2[c] when given), double; one warp per row. */
__global__ void k_row_sq(const float *X, int64_t rows, int64_t n, const float *dcol2, double *out)
{
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (r >= rows)
        return;
    const float *x = X + r * n;
    double s = 0.0;
    for (int64_t c = lane; c < n; c += 32) {
        const double v = x[c];
        s += dcol2 ? v * v * (double)dcol2[c] : v * v;
    }
    for (int o = 16; o; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0)
        out[r] = s;
}

/* dcol2[i] = Σ_r W[r, i]^2 (W [d, NI]), double sum rounded to float. */
__global__ void k_colsq(const float *W, int64_t d, int64_t ni, float *dcol2)
{
    GRID_LOOP(i, ni)
    {
        double s = 0.0;
        for (int64_t r = 0; r < d; r++) {
            const double v = W[r * ni + i];
            s += v * v;
        }
        dcol2[i] = (float)s;
    }
}

/* Rounding may leave tiny negative power-step weights: zero them. */
__global__ void k_clamp(double *w, int64_t n)
{
    GRID_LOOP(i, n)
    if (w[i] < 0.0)
        w[i] = 0.0;
}

/* acc[b, e] += Σ_s part[s, b, e] in sequence order. */
__global__ void k_sum_parts(const double *part, int64_t S, int64_t nb, int64_t hh, double *acc)
{
    GRID_LOOP(idx, nb * hh)
    {
        double s = acc[idx];
        for (int64_t q = 0; q < S; q++)
            s += part[q * nb * hh + idx];
        acc[idx] = s;
    }
}

/* ---- fully-local attention (items in hess_attn.cuh) ---- */

__global__ void k_trace_rows(const float *vec, int64_t vstride, int nv, int64_t S, int64_t T,
                             int64_t nb, int64_t h, double *rows)
{
    GRID_LOOP(idx, S * nb * T)
    trace_rows_item(vec, vstride, nv, T, nb, h, rows, idx);
}

__global__ void k_trace_scan(double *rows, int64_t n, int64_t T, int backward)
{
    GRID_LOOP(idx, n)
    trace_scan_item(rows, T, backward, idx);
}

__global__ void k_trace_blocks(const double *rows, int64_t S, int64_t T, int64_t nb, int mult,
                               double *wout)
{
    GRID_LOOP(idx, S * T)
    trace_sum_item(rows, T, nb, mult, wout, idx);
}

/* wout[s*T + t] = Σ_m tr[s, m, t] in head order. */
__global__ void k_trace_sum(const double *tr, int64_t S, int64_t nn, int64_t T, double *wout)
{
    GRID_LOOP(idx, S * T)
    {
        const int64_t t = idx % T, s = idx / T;
        double acc = 0.0;
        for (int64_t m = 0; m < nn; m++)
            acc += tr[(s * nn + m) * T + t];
        wout[idx] = acc;
    }
}

/* bv[κ] += Σ_{j in κ} tmp_j (tmp_j = O_jᵀ O_j, upper triangle row-major). */
__global__ void k_bv_sum(const float *tmp, int64_t H, int64_t r, int64_t h, double *bv)
{
    const int64_t hh = h * h, G = H / r;
    GRID_LOOP(idx, G * hh)
    {
        const int64_t e = idx % hh, g = idx / hh;
        const int64_t p = e / h, q = e % h;
        const int64_t a = p < q ? p : q, b = p < q ? q : p;
        double s = 0.0;
        for (int64_t j = g * r; j < (g + 1) * r; j++)
            s += (double)tmp[j * hh + a * h + b];
        bv[idx] = s;
    }
}

/* ---------------------------------------------------------- host helpers */

double trace_h(const double *M, int64_t h)
{
    double s = 0;
    for (int64_t i = 0; i < h; i++)
        s += M[i * h + i];
    return s;
}

} // namespace

/* ------------------------------------------------------------ the struct */

struct bk_ghess {
    bk_gfwd *f;
    bk_cuda_ctx *c;
    bk_model_config cfg;
    bk_hessian_kind kind;
    int fp64, mlp2, attn2, shampoo, qknorm, keep_plain;
    bk_dims dim;
    int layer, broken;
    /* bk_ghess_inputs_checked: the adds' activations were checked by the
     * caller's forward (its per-operation non-finite flags), so the adds skip
     * their own scans */
    int inputs_checked;
    int64_t count[G_COUNT];
    int64_t n_pairs;
    double v_wb;
    dgram x_attn, x_o, x_mlp, x_down, a_q, a_k, a_gate, a_up, b_gate, b_up;
    double *bq;      /* [nq, h, h], nq = H with q_norm else G (the group's block) */
    double *bk;      /* [G, h, h] */
    float *dcol2;    /* [NI] diag(DᵀD) of the layer (first add_mlp) */
    int have_dcol2;
    /* scratch */
    void *scr;       /* scr_elems floats or doubles */
    int64_t scr_elems;
    double *w1, *w2, *w3; /* [R] row weights */
    double *part;    /* [max_seqs, max(H, G), h, h] */
    float *zq, *zk;  /* q/k norm: pre-norm projections [R, qd], [R, kvd] */
    double *qC, *qM, *qv, *qsc, *qtr; /* q/k norm state; qM, qv, qsc per position of a round */
    int64_t qn_round;                  /* positions a q/k-norm round holds */
    float *dev_out;  /* factor output staging on the device */
    size_t dev_out_elems;
    float *outA[BK_MOD_COUNT], *outB[BK_MOD_COUNT], *outP[BK_MOD_COUNT];
    /* backprop kinds: the input side here, the output side from the flow's
     * host accumulator (bk_ghess_set_grads); Shampoo: per module
     * Σ |g_t|² a_t a_tᵀ with the token weights |g_t|² on the device */
    int bp, bp_shampoo;
    const bk_hess_acc *grads;  /* host output side, or */
    const double *Gdev[BK_MOD_COUNT]; /* the GPU flow's device Grams (bk_ghess_set_grads_dev) */
    int64_t Gdev_N;
    int Gdev_layer;
    /* this process's own input rows per group (the token weights' offset):
     * count[] less what the ranks before passed on (MPI ranks, ordered) */
    int64_t own[G_COUNT];
    dgram a_bp[BK_MOD_COUNT];
    double *dw[BK_MOD_COUNT]; /* [dw_cap] token weights uploaded from the host accumulator */
    int64_t dw_n[BK_MOD_COUNT], dw_cap;
    const double *wsrc[BK_MOD_COUNT]; /* the token weights in use: dw, or the flow's */
    /* device factor outputs of bk_ghess_factors_dev (grown on demand) */
    float *devA, *devB, *devP;
    size_t devA_n, devB_n, devP_n;
    /* what the last successful factors call formed A from (bk_ghess_factor_key) */
    const dgram *akey_src, *akey_try;
    double akey_scale, akey_try_scale;
    uint64_t akey_gen;
    /* the generation of the accumulated state (session-11 review R2): a new
     * value (gen_bump) whenever a Gram, the output blocks, the counts or the
     * output side may change, taken before the change (a failed add counts
     * too): the adds, bk_ghess_reset, bk_ghess_sums, bk_ghess_set_grads(_dev),
     * and gram_add / gram_zero themselves. bk_ghess_factor_key hands it out
     * with the name of A, so that a kept input side (bk_dshare) of an earlier
     * state is never taken for the current one, even where a caller forgot
     * bk_dshare_drop. Process-wide (g_gen): a new accumulator at the address
     * of a freed one never repeats a generation. */
    uint64_t gen;
};

namespace {

std::atomic<uint64_t> g_gen{0};

/* A new generation of a's state (bk_ghess::gen): before every change. */
void gen_bump(bk_ghess *a)
{
    a->gen = ++g_gen;
}

bk_status gram_init(bk_ghess *a, dgram *g, int64_t n)
{
    g->n = n;
    return bk_dev_alloc(a->c, &g->s, (size_t)(n * n) * (a->fp64 ? 8 : 4), "Hessian accumulator");
}

void gram_zero(bk_ghess *a, dgram *g)
{
    gen_bump(a);
    if (g->s)
        cudaMemsetAsync(g->s, 0, (size_t)(g->n * g->n) * (a->fp64 ? 8 : 4), a->c->stream);
}

/* g += Σ_r w_r x_r x_rᵀ over rows of X [rows, n] (device; w device or NULL). */
bk_status gram_add(bk_ghess *a, dgram *g, const float *X, int64_t rows, const double *w)
{
    gen_bump(a);
    const int64_t n = g->n;
    if (rows <= 0)
        return BK_OK;
    cublasHandle_t h = a->c->cublas;
    if (!a->fp64 && !w)
        return bk_g_syrk(a->f, n, rows, X, static_cast<float *>(g->s));
    int64_t ch = a->scr_elems / n;
    if (ch < 1)
        ch = 1;
    for (int64_t r0 = 0; r0 < rows; r0 += ch) {
        const int64_t k = rows - r0 < ch ? rows - r0 : ch;
        bk_status st;
        if (a->fp64) {
            double *y = static_cast<double *>(a->scr);
            k_scale_rows_d<<<bk_grid(k * n), 256, 0, a->c->stream>>>(X + r0 * n, k, n,
                                                                     w ? w + r0 : NULL, y);
            if ((st = BK_LAUNCHED("k_scale_rows_d")) != BK_OK)
                return st;
            const double one = 1.0;
            BK_CUBLAS_CHECK(cublasDsyrk_64(h, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, n, k, &one, y,
                                           n, &one, static_cast<double *>(g->s), n));
        } else {
            float *y = static_cast<float *>(a->scr);
            k_scale_rows_f<<<bk_grid(k * n), 256, 0, a->c->stream>>>(X + r0 * n, k, n,
                                                                     w ? w + r0 : NULL, y);
            if ((st = BK_LAUNCHED("k_scale_rows_f")) != BK_OK)
                return st;
            if ((st = bk_g_syrk(a->f, n, k, y, static_cast<float *>(g->s))) != BK_OK)
                return st;
        }
    }
    return BK_OK;
}

bk_status batch_rows(const bk_ghess *a, int64_t S, const char *what, int64_t *N)
{
    if (S <= 0 || S > a->f->dim.max_seqs)
        return bk_error(BK_ERR_INVALID_ARG,
                        "GPU hessian: %s: %lld sequences, the context holds 1..%lld", what,
                        (long long)S, (long long)a->f->dim.max_seqs);
    *N = S * a->dim.T;
    return BK_OK;
}

bk_status check_finite(bk_ghess *a, const float *x, int64_t rows, int64_t cols, int layer,
                       const char *what)
{
    if (a->inputs_checked)
        return BK_OK;
    int found = 0;
    int64_t r = 0, c = 0;
    float v = 0;
    bk_status st = bk_g_first_nonfinite(a->f, x, rows, cols, &found, &r, &c, &v);
    if (st != BK_OK || !found)
        return st;
    char lab[64] = "";
    if (layer >= 0)
        snprintf(lab, sizeof lab, "layer %d ", layer);
    return bk_error(BK_ERR_NONFINITE,
                    "hessian: %s%s: non-finite value %g at row %lld, column %lld (activations "
                    "must be finite)",
                    lab, what, (double)v, (long long)r, (long long)c);
}

bk_status check_layer(bk_ghess *a, const bk_glayer *lw, const char *what)
{
    return bk__hess_check_layer(a->broken, lw != NULL, lw ? lw->layer : -1, a->layer, what,
                                "bk_ghess_reset");
}

bk_status alloc_d(bk_ghess *a, double **p, int64_t n, const char *what)
{
    void *q = NULL;
    bk_status st = bk_dev_alloc(a->c, &q, (size_t)(n > 0 ? n : 1) * sizeof(double), what);
    *p = static_cast<double *>(q);
    return st;
}

bk_status alloc_f(bk_ghess *a, float **p, int64_t n, const char *what)
{
    void *q = NULL;
    bk_status st = bk_dev_alloc(a->c, &q, (size_t)(n > 0 ? n : 1) * sizeof(float), what);
    *p = static_cast<float *>(q);
    return st;
}

} // namespace

/* --------------------------------------------------------- create / free */

extern "C" void bk_ghess_free(bk_ghess *a)
{
    if (!a)
        return;
    bk_cuda_ctx *c = a->c;
    dgram *gs[] = {BK_HESS_GRAMS(a)};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
        bk_dev_free(c, gs[i]->s);
    void *ds[] = {a->bq, a->bk, a->dcol2, a->scr, a->w1, a->w2, a->w3, a->part, a->zq, a->zk,
                  a->qC, a->qM, a->qv, a->qsc, a->qtr, a->dev_out, a->devA, a->devB, a->devP};
    for (size_t i = 0; i < sizeof ds / sizeof ds[0]; i++)
        bk_dev_free(c, ds[i]);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        free(a->outA[m]);
        free(a->outB[m]);
        free(a->outP[m]);
        bk_dev_free(c, a->a_bp[m].s);
        bk_dev_free(c, a->dw[m]);
    }
    free(a);
}

extern "C" bk_status bk_ghess_create(bk_gfwd *f, bk_hessian_kind kind, int fp64, int keep_plain,
                                     bk_ghess **out)
{
    *out = NULL;
    if (!f)
        return bk_error(BK_ERR_INVALID_ARG, "GPU hessian: NULL forward context");
    if ((unsigned)kind >= BK_HESS_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown Hessian kind %d", (int)kind);
    /* the kinds implemented here: a kind added to the registry (src/hessian.c)
     * after them runs on the CPU stages until it has a GPU implementation and
     * a parity test (docs/DEVELOPING.md "Add a Hessian kind") */
    if (kind > BK_HESS_BACKPROP_SHAMPOO)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "hessian: %s is not implemented on the GPU yet (use --cpu-stages)",
                        bk_hessian_name(kind));
    /* the CPU accumulator's own checks of the configuration (one source of
     * truth; its accumulators are allocated and freed) */
    bk_hess_acc *probe = NULL;
    bk_model_config small = f->cfg;
    bk_status st = bk_hess_acc_create(&small, BK_HESS_RTN, 0, f->dim.T, &probe);
    if (st != BK_OK)
        return st;
    bk_hess_acc_free(probe);
    const bk_model_config *cfg = &f->cfg;
    const int mlp2 = kind == BK_HESS_MLPLOCAL_KFAC || kind == BK_HESS_MLPLOCAL_SHAMPOO ||
                     kind == BK_HESS_FULLYLOCAL_KFAC || kind == BK_HESS_FULLYLOCAL_SHAMPOO;
    if (mlp2 && cfg->hidden_act[0] && strcmp(cfg->hidden_act, "silu") != 0)
        return bk_error(BK_ERR_UNSUPPORTED,
                        "hessian: %s: hidden_act '%s' is not supported (only silu)",
                        bk_hessian_name(kind), cfg->hidden_act);
    bk_ghess *a = static_cast<bk_ghess *>(calloc(1, sizeof(bk_ghess)));
    if (!a)
        return bk_error(BK_ERR_NOMEM, "GPU hessian: out of memory");
    a->f = f;
    a->c = f->c;
    a->cfg = *cfg;
    a->kind = kind;
    a->fp64 = fp64 ? 1 : 0;
    a->mlp2 = mlp2;
    a->attn2 = kind == BK_HESS_FULLYLOCAL_KFAC || kind == BK_HESS_FULLYLOCAL_SHAMPOO;
    a->shampoo = kind == BK_HESS_MLPLOCAL_SHAMPOO || kind == BK_HESS_FULLYLOCAL_SHAMPOO;
    a->qknorm = cfg->qk_norm ? 1 : 0;
    a->keep_plain = keep_plain ? 1 : 0;
    a->bp = bk_hessian_is_backprop(kind);
    a->bp_shampoo = kind == BK_HESS_BACKPROP_SHAMPOO;
    a->dim = f->dim; /* the forward context's sizes */
    a->layer = -1;
    if (kind == BK_HESS_RTN) {
        *out = a;
        return BK_OK;
    }
    const int64_t R = a->dim.rows, hh = a->dim.hd * a->dim.hd, S = f->dim.max_seqs;
    if ((st = gram_init(a, &a->x_attn, a->dim.hidden)) || (st = gram_init(a, &a->x_o, a->dim.qdim)) ||
        (st = gram_init(a, &a->x_down, a->dim.inter)))
        goto fail;
    if ((!a->mlp2 || !a->shampoo || a->keep_plain) && (st = gram_init(a, &a->x_mlp, a->dim.hidden)))
        goto fail;
    for (int m = 0; a->bp_shampoo && m < BK_MOD_COUNT; m++) {
        int64_t o, in;
        bk_module_shape(cfg, (bk_module)m, &o, &in);
        if ((st = gram_init(a, &a->a_bp[m], in)) != BK_OK)
            goto fail;
    }
    if (a->mlp2) {
        if ((st = gram_init(a, &a->b_gate, a->dim.inter)) || (st = gram_init(a, &a->b_up, a->dim.inter)) ||
            (st = alloc_f(a, &a->dcol2, a->dim.inter, "diag(DᵀD)")))
            goto fail;
        if (a->shampoo &&
            ((st = gram_init(a, &a->a_gate, a->dim.hidden)) || (st = gram_init(a, &a->a_up, a->dim.hidden))))
            goto fail;
    }
    {
        int64_t wmax = a->dim.hidden > a->dim.inter ? a->dim.hidden : a->dim.inter;
        wmax = wmax > a->dim.qdim ? wmax : a->dim.qdim;
        a->scr_elems = R * wmax < SCRATCH_ELEMS ? R * wmax : SCRATCH_ELEMS;
    }
    if ((st = bk_dev_alloc(a->c, &a->scr, (size_t)a->scr_elems * (a->fp64 ? 8 : 4),
                           "Hessian scratch")) ||
        (st = alloc_d(a, &a->w1, R, "row weights")) || (st = alloc_d(a, &a->w2, R, "row weights")) ||
        (st = alloc_d(a, &a->w3, R, "row weights")))
        goto fail;
    if (a->attn2) {
        const int64_t nq = a->qknorm ? a->dim.nh : a->dim.nkv;
        if ((st = alloc_d(a, &a->bq, nq * hh, "q_proj output blocks")) ||
            (st = alloc_d(a, &a->bk, a->dim.nkv * hh, "k_proj output blocks")) ||
            (st = alloc_d(a, &a->part, S * (a->dim.nh > a->dim.nkv ? a->dim.nh : a->dim.nkv) * hh, "block partials")))
            goto fail;
        if (a->shampoo &&
            ((st = gram_init(a, &a->a_q, a->dim.hidden)) || (st = gram_init(a, &a->a_k, a->dim.hidden))))
            goto fail;
        if (a->shampoo && !a->qknorm &&
            (st = alloc_d(a, &a->qtr, S * a->dim.nkv * a->dim.T, "trace rows")))
            goto fail;
        if (a->qknorm) {
            /* positions a round: at most 64 and about QN_ROUND_BYTES of
             * per-position state (at least one position) */
            const int64_t per = S * (a->dim.nkv * hh + a->dim.nh * a->dim.hd + a->dim.nh * 4) * 8;
            int64_t nr = QN_ROUND_BYTES / per;
            nr = nr > 64 ? 64 : nr;
            nr = nr > a->dim.T ? a->dim.T : nr;
            a->qn_round = nr < 1 ? 1 : nr;
            if ((st = alloc_f(a, &a->zq, R * a->dim.qdim, "pre-norm queries")) ||
                (st = alloc_f(a, &a->zk, R * a->dim.kvdim, "pre-norm keys")) ||
                (st = alloc_d(a, &a->qC, S * a->dim.nkv * hh, "running Grams")) ||
                (st = alloc_d(a, &a->qM, a->qn_round * S * a->dim.nkv * hh, "sandwiched Grams")) ||
                (st = alloc_d(a, &a->qv, a->qn_round * S * a->dim.nh * a->dim.hd, "norm products")) ||
                (st = alloc_d(a, &a->qsc, a->qn_round * S * a->dim.nh * 4, "norm scalars")) ||
                (st = alloc_d(a, &a->qtr, S * a->dim.nh * a->dim.T, "traces")))
                goto fail;
        }
    }
    bk_ghess_reset(a);
    if ((st = bk_gpu_sync(f)) != BK_OK)
        goto fail;
    *out = a;
    return BK_OK;
fail:
    bk_ghess_free(a);
    return bk_error_prefix(st, "GPU hessian");
}

extern "C" void bk_ghess_reset(bk_ghess *a)
{
    if (!a)
        return;
    gen_bump(a);
    dgram *gs[] = {BK_HESS_GRAMS(a)};
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++)
        gram_zero(a, gs[i]);
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        gram_zero(a, &a->a_bp[m]);
        a->dw_n[m] = 0;
        a->wsrc[m] = NULL;
        a->Gdev[m] = NULL;
    }
    a->grads = NULL;
    a->Gdev_N = 0;
    const int64_t hh = a->dim.hd * a->dim.hd;
    if (a->bq)
        cudaMemsetAsync(a->bq, 0, (size_t)((a->qknorm ? a->dim.nh : a->dim.nkv) * hh) * 8, a->c->stream);
    if (a->bk)
        cudaMemsetAsync(a->bk, 0, (size_t)(a->dim.nkv * hh) * 8, a->c->stream);
    cudaGetLastError();
    a->have_dcol2 = 0;
    a->broken = 0;
    a->v_wb = 0;
    a->n_pairs = 0;
    for (int g = 0; g < G_COUNT; g++)
        a->count[g] = a->own[g] = 0;
    a->layer = -1;
}

/* ------------------------------------------------------------- the adds */

namespace {

/* Backprop kinds: N input rows X of group grp: the plain Gram (K-FAC's A,
 * or Shampoo's E[x xᵀ] kept for the GPTQ loss) and, Shampoo, Σ |g_t|² x xᵀ
 * per module of the group with the token weights of this process's rows
 * own[grp] .. own[grp] + N (as src/hessian.c's bp_add_input: with MPI ranks
 * count[grp] also holds the rows of the ranks before, whose weights are
 * theirs). */
bk_status bp_adds(bk_ghess *a, dgram *plain, int grp, const float *X, int64_t N)
{
    static const bk_module mods[G_COUNT][3] = {
        {BK_MOD_Q, BK_MOD_K, BK_MOD_V},
        {BK_MOD_O, BK_MOD_COUNT, BK_MOD_COUNT},
        {BK_MOD_GATE, BK_MOD_UP, BK_MOD_COUNT},
        {BK_MOD_DOWN, BK_MOD_COUNT, BK_MOD_COUNT},
    };
    bk_status st = BK_OK;
    for (int k = 0; a->bp_shampoo && k < 3 && mods[grp][k] != BK_MOD_COUNT && st == BK_OK; k++) {
        const bk_module mod = mods[grp][k];
        if (!a->wsrc[mod] || a->dw_n[mod] < a->own[grp] + N)
            return bk_error(BK_ERR_INVALID_ARG,
                            "hessian: layer %d %s: backprop-shampoo inputs of tokens %lld..%lld "
                            "come before their gradients (bk_ghess_set_grads first)",
                            a->layer, bk_module_name(mod), (long long)a->own[grp],
                            (long long)(a->own[grp] + N));
        st = gram_add(a, &a->a_bp[mod], X, N, a->wsrc[mod] + a->own[grp]);
    }
    if (st == BK_OK && (!a->bp_shampoo || a->keep_plain))
        st = gram_add(a, plain, X, N, NULL);
    if (st == BK_OK)
        a->own[grp] += N;
    return st;
}

/* The fully-local part of one micro-batch (q and k output blocks, Shampoo
 * weights of q/k and the v B-weight), after x_attn was accumulated. */
bk_status attn_local(bk_ghess *a, const bk_glayer *lw, const float *X, const float *Qr,
                     const float *Kr, int64_t S)
{
    const int64_t T = a->dim.T, N = S * T, h = a->dim.hd, hh = h * h;
    cudaStream_t sm = a->c->stream;
    bk_status st;
    double tp = bk_now(); /* BK_PROFILE marks ha.* (bk_ghess_add_attn) */
    /* B-side weights: |x_t|^2 (Shampoo, identity start) or 1 */
    const double *sw = NULL;
    if (a->shampoo) {
        k_row_sq<<<(unsigned)((N + 7) / 8), 256, 0, sm>>>(X, N, a->dim.hidden, NULL, a->w1);
        if ((st = BK_LAUNCHED("k_row_sq")) != BK_OK)
            return st;
        sw = a->w1;
        double *host = static_cast<double *>(bk_alloc((size_t)N, sizeof(double)));
        if (!host)
            return bk_error(BK_ERR_NOMEM, "GPU hessian: out of memory");
        st = bk_gpu_download(a->f, host, a->w1, (size_t)N * sizeof(double));
        for (int64_t i = 0; st == BK_OK && i < N; i++)
            a->v_wb += host[i];
        free(host);
        if (st != BK_OK)
            return st;
    } else {
        a->v_wb += (double)N;
    }
    if (a->shampoo)
        bk_cuda_pmark(sm, &tp, "ha.shampoo_wb");
    const int64_t nq = a->qknorm ? a->dim.nh : a->dim.nkv;
    if (!a->qknorm) {
        /* q_proj: prefix Grams of the keys; k_proj: suffix Grams of the group's queries */
        for (int part = 0; part < 2; part++) {
            quad_args q;
            q.vec = part == 0 ? Kr : Qr;
            q.vstride = part == 0 ? a->dim.kvdim : a->dim.qdim;
            q.nv = part == 0 ? 1 : (int)a->dim.rep;
            q.S = S;
            q.T = T;
            q.nb = a->dim.nkv;
            q.h = h;
            q.cs = a->f->cos;
            q.sn = a->f->sin;
            q.w = sw;
            q.backward = part;
            q.part = a->part;
            if ((st = bk_cuda_status(quads_launch(q, sm, 0), "k_attn_quads_staged", __FILE__,
                                     __LINE__)) != BK_OK)
                return st;
            k_sum_parts<<<bk_grid(a->dim.nkv * hh), 256, 0, sm>>>(a->part, S, a->dim.nkv, hh,
                                                            part == 0 ? a->bq : a->bk);
            if ((st = BK_LAUNCHED("k_sum_parts")) != BK_OK)
                return st;
            if (a->shampoo) {
                double *wo = part == 0 ? a->w2 : a->w3;
                k_trace_rows<<<bk_grid(S * a->dim.nkv * T), 256, 0, sm>>>(q.vec, q.vstride, q.nv, S, T,
                                                                     a->dim.nkv, h, a->qtr);
                k_trace_scan<<<bk_grid(S * a->dim.nkv), 256, 0, sm>>>(a->qtr, S * a->dim.nkv, T, part);
                k_trace_blocks<<<bk_grid(S * T), 256, 0, sm>>>(a->qtr, S, T, a->dim.nkv,
                                                               part == 0 ? (int)a->dim.rep : 1, wo);
                if ((st = BK_LAUNCHED("Shampoo trace kernels")) != BK_OK)
                    return st;
            }
            bk_cuda_pmark(sm, &tp, part == 0 ? "ha.quads_q" : "ha.quads_k");
        }
    } else {
        /* pre-norm projections z = x Wᵀ + b (as the CPU's project) */
        if ((st = bk_g_linear_mod(a->f, X, N, a->dim.hidden, lw, BK_MOD_Q, a->dim.qdim, 1, a->zq)) != BK_OK ||
            (st = bk_g_linear_mod_same(a->f, X, N, a->dim.hidden, lw, BK_MOD_K, a->dim.kvdim, 1, a->zk)) != BK_OK)
            return st;
        bk_cuda_pmark(sm, &tp, "ha.qn_preproj");
        for (int part = 0; part < 2; part++) {
            qn_args q;
            q.vec = part == 0 ? Kr : Qr;
            q.vstride = part == 0 ? a->dim.kvdim : a->dim.qdim;
            q.nv = part == 0 ? 1 : (int)a->dim.rep;
            q.z = part == 0 ? a->zq : a->zk;
            q.zstride = part == 0 ? a->dim.qdim : a->dim.kvdim;
            q.gamma = part == 0 ? lw->q_norm : lw->k_norm;
            q.S = S;
            q.T = T;
            q.nb = a->dim.nkv;
            q.nn = part == 0 ? a->dim.nh : a->dim.nkv;
            q.h = h;
            q.cs = a->f->cos;
            q.sn = a->f->sin;
            q.eps = a->cfg.rms_eps;
            q.w = sw;
            q.C = a->qC;
            q.M = a->qM;
            q.acc = a->part;
            q.v = a->qv;
            q.sc = a->qsc;
            q.tr = a->shampoo ? a->qtr : NULL;
            cudaMemsetAsync(q.C, 0, (size_t)(S * a->dim.nkv * hh) * 8, sm);
            cudaMemsetAsync(q.acc, 0, (size_t)(S * q.nn * hh) * 8, sm);
            if ((st = BK_LAUNCHED("memset")) != BK_OK)
                return st;
            /* rounds of qn_round positions (hess_attn.cuh: four launches a
             * round, the same operations per entry as one position at a time) */
            if ((st = bk_cuda_status(qn_rounds_launch(q, part, a->qn_round, sm),
                                     "q/k-norm round kernels", __FILE__, __LINE__)) != BK_OK)
                return st;
            k_sum_parts<<<bk_grid(q.nn * hh), 256, 0, sm>>>(a->part, S, q.nn, hh,
                                                            part == 0 ? a->bq : a->bk);
            if ((st = BK_LAUNCHED("k_sum_parts")) != BK_OK)
                return st;
            if (a->shampoo) {
                k_trace_sum<<<bk_grid(S * T), 256, 0, sm>>>(a->qtr, S, q.nn, T,
                                                             part == 0 ? a->w2 : a->w3);
                if ((st = BK_LAUNCHED("k_trace_sum")) != BK_OK)
                    return st;
            }
            bk_cuda_pmark(sm, &tp, part == 0 ? "ha.qn_q" : "ha.qn_k");
        }
    }
    (void)nq;
    if (a->shampoo) {
        k_clamp<<<bk_grid(N), 256, 0, sm>>>(a->w2, N);
        k_clamp<<<bk_grid(N), 256, 0, sm>>>(a->w3, N);
        if ((st = BK_LAUNCHED("k_clamp")) != BK_OK)
            return st;
        if ((st = gram_add(a, &a->a_q, X, N, a->w2)) != BK_OK ||
            (st = gram_add(a, &a->a_k, X, N, a->w3)) != BK_OK)
            return st;
        bk_cuda_pmark(sm, &tp, "ha.shampoo_grams");
    }
    return BK_OK;
}

} // namespace

extern "C" bk_status bk_ghess_add_attn(bk_ghess *a, const bk_glayer *lw, const float *d_attn_in,
                                       const float *d_qrot, const float *d_krot, int64_t S)
{
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    bk_status st;
    int64_t N = 0;
    gen_bump(a); /* (the counts, q/k blocks and Grams change below) */
    if ((st = check_layer(a, lw, "bk_ghess_add_attn")) != BK_OK)
        return st;
    if ((st = bk__hess_check_attn(a->kind, a->attn2, a->qknorm, lw->layer, d_attn_in,
                                  d_qrot && d_krot, lw->w[BK_MOD_O] != NULL,
                                  lw->q_norm && lw->k_norm && lw->w[BK_MOD_Q] && lw->w[BK_MOD_K])) !=
        BK_OK)
        return st;
    if ((st = batch_rows(a, S, "attn_in", &N)) != BK_OK)
        return st;
    /* BK_PROFILE, fully-local kinds: where hess.qkv goes (ha.*; each mark
     * synchronizes the stream, only when profiling) */
    double tp = bk_now();
    if ((st = check_finite(a, d_attn_in, N, a->dim.hidden, lw->layer, "attn_in")) != BK_OK)
        return st;
    if (a->attn2 && ((st = check_finite(a, d_qrot, N, a->dim.qdim, lw->layer, "q_rot")) != BK_OK ||
                     (st = check_finite(a, d_krot, N, a->dim.kvdim, lw->layer, "k_rot")) != BK_OK))
        return st;
    if (a->attn2)
        bk_cuda_pmark(a->c->stream, &tp, "ha.check_finite");
    a->layer = lw->layer;
    if (a->kind == BK_HESS_RTN) {
        a->count[G_ATTN] += N;
        return BK_OK;
    }
    st = a->bp ? bp_adds(a, &a->x_attn, G_ATTN, d_attn_in, N)
               : gram_add(a, &a->x_attn, d_attn_in, N, NULL);
    if (a->attn2)
        bk_cuda_pmark(a->c->stream, &tp, "ha.gram_attn_in");
    if (st == BK_OK && a->attn2)
        st = attn_local(a, lw, d_attn_in, d_qrot, d_krot, S);
    if (st != BK_OK) {
        a->broken = 1;
        return st;
    }
    a->count[G_ATTN] += N;
    if (a->attn2)
        a->n_pairs += S * (a->dim.T * (a->dim.T + 1) / 2);
    return BK_OK;
}

namespace {

bk_status add_plain(bk_ghess *a, dgram *g, int grp, const float *x, int64_t S, int64_t width,
                    const char *what)
{
    int64_t N = 0;
    bk_status st = bk__hess_check_input(a != NULL, a && a->broken, x, what, "bk_ghess_reset");
    if (st != BK_OK)
        return st;
    gen_bump(a); /* (the count and Gram change below) */
    if ((st = batch_rows(a, S, what, &N)) != BK_OK)
        return st;
    if ((st = check_finite(a, x, N, width, a->layer, what)) != BK_OK)
        return st;
    if (a->kind != BK_HESS_RTN &&
        (st = a->bp ? bp_adds(a, g, grp, x, N) : gram_add(a, g, x, N, NULL)) != BK_OK) {
        a->broken = 1;
        return st;
    }
    a->count[grp] += N;
    return BK_OK;
}

} // namespace

extern "C" void bk_ghess_inputs_checked(bk_ghess *a, int on)
{
    if (a)
        a->inputs_checked = on != 0;
}

extern "C" bk_status bk_ghess_add_o(bk_ghess *a, const float *d_o_in, int64_t S)
{
    return add_plain(a, a ? &a->x_o : NULL, G_O, d_o_in, S, a ? a->dim.qdim : 0, "o_in");
}

extern "C" bk_status bk_ghess_add_down(bk_ghess *a, const float *d_down_in, int64_t S)
{
    return add_plain(a, a ? &a->x_down : NULL, G_DOWN, d_down_in, S, a ? a->dim.inter : 0, "down_in");
}

extern "C" bk_status bk_ghess_add_mlp(bk_ghess *a, const bk_glayer *lw, const float *d_mlp_in,
                                      int64_t S)
{
    if (!a)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL accumulator");
    bk_status st;
    int64_t N = 0;
    gen_bump(a); /* (the counts and Grams change below) */
    if ((st = check_layer(a, lw, "bk_ghess_add_mlp")) != BK_OK)
        return st;
    if (!d_mlp_in)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: layer %d: mlp_in is NULL", lw->layer);
    if ((st = batch_rows(a, S, "mlp_in", &N)) != BK_OK)
        return st;
    if ((st = bk__hess_check_mlp(a->kind, a->mlp2, lw->layer,
                                 lw->w[BK_MOD_GATE] && lw->w[BK_MOD_UP] && lw->w[BK_MOD_DOWN])) !=
        BK_OK)
        return st;
    if ((st = check_finite(a, d_mlp_in, N, a->dim.hidden, lw->layer, "mlp_in")) != BK_OK)
        return st;
    a->layer = lw->layer;
    if (a->kind == BK_HESS_RTN) {
        a->count[G_MLP] += N;
        return BK_OK;
    }
    const int64_t d = a->dim.hidden, NI = a->dim.inter;
    cudaStream_t sm = a->c->stream;
    if (!a->mlp2) {
        st = a->bp ? bp_adds(a, &a->x_mlp, G_MLP, d_mlp_in, N)
                   : gram_add(a, &a->x_mlp, d_mlp_in, N, NULL);
        goto done;
    }
    if (!a->have_dcol2) {
        k_colsq<<<bk_grid(NI), 256, 0, sm>>>(lw->w[BK_MOD_DOWN], d, NI, a->dcol2);
        if ((st = BK_LAUNCHED("k_colsq")) != BK_OK)
            goto done;
        a->have_dcol2 = 1;
    }
    {
        /* the forward context's gate/up scratch holds z_g, z_u (free between stages) */
        float *zg = a->f->gate, *zu = a->f->up;
        if ((st = bk_g_linear_mod(a->f, d_mlp_in, N, d, lw, BK_MOD_GATE, NI, 1, zg)) != BK_OK ||
            (st = bk_g_linear_mod_same(a->f, d_mlp_in, N, d, lw, BK_MOD_UP, NI, 1, zu)) !=
                BK_OK)
            goto done;
        k_mlp_gf<<<bk_grid(N * NI), 256, 0, sm>>>(zg, zu, N * NI);
        if ((st = BK_LAUNCHED("k_mlp_gf")) != BK_OK)
            goto done;
        if (!a->shampoo) {
            if ((st = gram_add(a, &a->x_mlp, d_mlp_in, N, NULL)) != BK_OK ||
                (st = gram_add(a, &a->b_up, zg, N, NULL)) != BK_OK)
                goto done;
            st = gram_add(a, &a->b_gate, zu, N, NULL);
            goto done;
        }
        /* Shampoo: B-weights |x|^2; A-weights vᵀ diag(DᵀD) v (v = g for up, f for gate) */
        k_row_sq<<<(unsigned)((N + 7) / 8), 256, 0, sm>>>(d_mlp_in, N, d, NULL, a->w1);
        k_row_sq<<<(unsigned)((N + 7) / 8), 256, 0, sm>>>(zg, N, NI, a->dcol2, a->w2);
        k_row_sq<<<(unsigned)((N + 7) / 8), 256, 0, sm>>>(zu, N, NI, a->dcol2, a->w3);
        if ((st = BK_LAUNCHED("k_row_sq")) != BK_OK)
            goto done;
        if ((st = gram_add(a, &a->a_up, d_mlp_in, N, a->w2)) != BK_OK ||
            (st = gram_add(a, &a->b_up, zg, N, a->w1)) != BK_OK ||
            (st = gram_add(a, &a->a_gate, d_mlp_in, N, a->w3)) != BK_OK ||
            (st = gram_add(a, &a->b_gate, zu, N, a->w1)) != BK_OK)
            goto done;
        if (a->keep_plain)
            st = gram_add(a, &a->x_mlp, d_mlp_in, N, NULL);
    }
done:
    if (st != BK_OK) {
        a->broken = 1;
        return st;
    }
    a->count[G_MLP] += N;
    return BK_OK;
}

/* ------------------------------------------------------------- factors */

namespace {

float *host_buf(float **slot, int64_t n)
{
    if (!*slot)
        *slot = static_cast<float *>(bk_alloc((size_t)(n * n), sizeof(float)));
    return *slot;
}

/* A device [n, n] output slot, grown on demand. */
bk_status dev_buf(bk_ghess *a, float **slot, size_t *cap, int64_t n, float **out)
{
    const size_t need = (size_t)(n * n);
    if (!*slot || *cap < need) {
        bk_dev_free(a->c, *slot);
        *slot = NULL;
        *cap = 0;
        bk_status st = alloc_f(a, slot, (int64_t)need, "factor output (device)");
        if (st != BK_OK)
            return st;
        *cap = need;
    }
    *out = *slot;
    return BK_OK;
}

bk_status dev_out(bk_ghess *a, int64_t n)
{
    const size_t need = (size_t)(n * n);
    if (a->dev_out && a->dev_out_elems >= need)
        return BK_OK;
    bk_dev_free(a->c, a->dev_out);
    a->dev_out = NULL;
    a->dev_out_elems = 0;
    bk_status st = alloc_f(a, &a->dev_out, (int64_t)need, "factor output");
    if (st == BK_OK)
        a->dev_out_elems = need;
    return st;
}

/* dst [n, n] = scale · G: a device array (written directly) when dev, else
 * a host array (through the device staging). */
bk_status gram_to_host(bk_ghess *a, const dgram *g, double scale, float *dst, int dev = 0)
{
    if (dev) {
        k_gram_out<<<bk_grid(g->n * g->n), 256, 0, a->c->stream>>>(g->s, a->fp64, g->n, scale,
                                                                   dst);
        return BK_LAUNCHED("k_gram_out");
    }
    bk_status st = dev_out(a, g->n);
    if (st != BK_OK)
        return st;
    k_gram_out<<<bk_grid(g->n * g->n), 256, 0, a->c->stream>>>(g->s, a->fp64, g->n, scale,
                                                               a->dev_out);
    if ((st = BK_LAUNCHED("k_gram_out")) != BK_OK)
        return st;
    return bk_gpu_download(a->f, dst, a->dev_out, (size_t)(g->n * g->n) * sizeof(float));
}

/* gram_to_host into the input factor A, remembering what it was formed from
 * (bk_ghess_factor_key; recorded when the factors call succeeds) */
bk_status gram_to_a(bk_ghess *a, const dgram *g, double scale, float *dst, int dev)
{
    a->akey_try = g;
    a->akey_try_scale = scale;
    return gram_to_host(a, g, scale, dst, dev);
}

bk_status blocks_to_host(bk_ghess *a, const double *dblk, int64_t nb, double **out)
{
    const int64_t hh = a->dim.hd * a->dim.hd;
    double *h = static_cast<double *>(bk_alloc((size_t)(nb * hh), sizeof(double)));
    if (!h)
        return bk_error(BK_ERR_NOMEM, "GPU hessian: out of memory");
    bk_status st = bk_gpu_download(a->f, h, dblk, (size_t)(nb * hh) * sizeof(double));
    if (st != BK_OK) {
        free(h);
        return st;
    }
    *out = h;
    return BK_OK;
}

/* B_O blocks Σ_{j in κ} O_jᵀ O_j of W_o [hidden, H*h] as host doubles [G, h, h]. */
bk_status make_bv(bk_ghess *a, const float *wo, double **out)
{
    const int64_t h = a->dim.hd, hh = h * h;
    float *tmp = NULL;
    double *dbv = NULL;
    bk_status st = alloc_f(a, &tmp, a->dim.nh * hh, "v_proj blocks");
    if (st == BK_OK)
        st = alloc_d(a, &dbv, a->dim.nkv * hh, "v_proj blocks");
    const float one = 1.0f, zero = 0.0f;
    for (int64_t j = 0; j < a->dim.nh && st == BK_OK; j++)
        st = bk_cublas_status(cublasSsyrk_64(a->c->cublas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, h,
                                             a->dim.hidden, &one, wo + j * h, a->dim.qdim, &zero, tmp + j * hh, h),
                              "cublasSsyrk (v_proj blocks)", __FILE__, __LINE__);
    if (st == BK_OK) {
        k_bv_sum<<<bk_grid(a->dim.nkv * hh), 256, 0, a->c->stream>>>(tmp, a->dim.nh, a->dim.rep, h, dbv);
        st = BK_LAUNCHED("k_bv_sum");
    }
    if (st == BK_OK)
        st = blocks_to_host(a, dbv, a->dim.nkv, out);
    bk_dev_free(a->c, tmp);
    bk_dev_free(a->c, dbv);
    return st;
}

} // namespace

static bk_status factors_impl(bk_ghess *a, const bk_glayer *orig, bk_module mod, int dev,
                              const float **A, const float **B, const float **A_plain)
{
    if (!a || !A || !B)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL argument to bk_ghess_factors%s",
                        dev ? "_dev" : "");
    *A = NULL;
    *B = NULL;
    if (A_plain)
        *A_plain = NULL;
    a->akey_src = a->akey_try = NULL;
    if ((unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: unknown module %d", (int)mod);
    const char *mn = bk_module_name(mod);
    bk_status st0 = bk__hess_check_broken(a->broken, mn, "bk_ghess_reset");
    if (st0 != BK_OK)
        return st0;
    if (a->kind == BK_HESS_RTN)
        return BK_OK;
    const int grp = bk__hess_module_group(mod);
    static const char *const add_names[G_COUNT] = {"bk_ghess_add_attn", "bk_ghess_add_o",
                                                   "bk_ghess_add_mlp", "bk_ghess_add_down"};
    st0 = bk__hess_check_factors(mn, a->count[grp], add_names[grp], orig != NULL,
                                 orig ? orig->layer : -1, a->layer);
    if (st0 != BK_OK)
        return st0;
    int64_t m, n;
    bk_module_shape(&a->cfg, mod, &m, &n);
    float *fa = NULL;
    if (dev) {
        bk_status sd = dev_buf(a, &a->devA, &a->devA_n, n, &fa);
        if (sd != BK_OK)
            return bk_error_prefix(sd, mn);
    } else if (!(fa = host_buf(&a->outA[mod], n))) {
        return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for A [%lld, %lld]", mn,
                        (long long)n, (long long)n);
    }
    const int two = bk_hessian_is_two_sided(a->kind, mod);
    /* fb: host B (built there for q/k/v); fbd: the device B (dev) */
    float *fb = NULL, *fbd = NULL;
    int b_on_host = 0;
    if (two && !(fb = host_buf(&a->outB[mod], m)))
        return bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for B [%lld, %lld]", mn,
                        (long long)m, (long long)m);
    if (two && dev) {
        bk_status sd = dev_buf(a, &a->devB, &a->devB_n, m, &fbd);
        if (sd != BK_OK)
            return bk_error_prefix(sd, mn);
    }
    if (a->bp) { /* A here, B from the flow's host accumulator */
        if (!a->grads && !a->Gdev[mod])
            return bk_error(BK_ERR_INTERNAL,
                            "hessian: %s: the output side of %s is not set (bk_ghess_set_grads)",
                            mn, bk_hessian_name(a->kind));
        int64_t gc = 0;
        bk_status sb = BK_OK;
        if (a->grads) {
            sb = bk__hess_bp_output(a->grads, a->layer, mod, fb, &gc);
        } else if (a->Gdev_layer != a->layer) {
            sb = bk_error(BK_ERR_INVALID_ARG,
                          "hessian: %s: output gradients of layer %d asked for layer %d", mn,
                          a->Gdev_layer, a->layer);
        } else {
            /* B = (float)(G / N) on the device, as bk__hess_bp_output forms it */
            gc = a->Gdev_N;
            float *dst = fbd;
            if (!dev && (sb = dev_out(a, m)) == BK_OK)
                dst = a->dev_out;
            if (sb == BK_OK) {
                k_gram_div<<<bk_grid(m * m), 256, 0, a->c->stream>>>(a->Gdev[mod], m,
                                                                    (double)gc, dst);
                sb = BK_LAUNCHED("k_gram_div");
            }
            int found = 0;
            int64_t r = 0, cc = 0;
            float v = 0;
            if (sb == BK_OK)
                sb = bk_g_first_nonfinite(a->f, dst, m, m, &found, &r, &cc, &v);
            if (sb == BK_OK && found)
                sb = bk_error(BK_ERR_NONFINITE,
                              "hessian: layer %d %s: non-finite output factor entry (%lld, "
                              "%lld) from the output gradients",
                              a->layer, mn, (long long)r, (long long)cc);
            if (sb == BK_OK && !dev)
                sb = bk_gpu_download(a->f, fb, dst, (size_t)(m * m) * sizeof(float));
        }
        if (sb != BK_OK)
            return sb;
        if (gc != a->count[grp])
            return bk_error(BK_ERR_INVALID_ARG,
                            "hessian: layer %d %s: %lld gradient rows but %lld input rows were "
                            "added",
                            a->layer, mn, (long long)gc, (long long)a->count[grp]);
        const dgram *pg = grp == G_ATTN ? &a->x_attn
                          : grp == G_O  ? &a->x_o
                          : grp == G_MLP ? &a->x_mlp
                                         : &a->x_down;
        const double Nb = (double)a->count[grp];
        sb = gram_to_a(a, a->bp_shampoo ? &a->a_bp[mod] : pg, 1.0 / Nb, fa, dev);
        if (sb == BK_OK && dev && a->grads)
            sb = bk_gpu_upload(a->f, fbd, fb, (size_t)(m * m) * sizeof(float));
        if (sb == BK_OK && A_plain) {
            if (a->bp_shampoo && a->keep_plain) {
                float *fp = NULL;
                if (dev)
                    sb = dev_buf(a, &a->devP, &a->devP_n, n, &fp);
                else if (!(fp = host_buf(&a->outP[mod], n)))
                    sb = bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for E[x xᵀ]", mn);
                if (sb == BK_OK && (sb = gram_to_host(a, pg, 1.0 / Nb, fp, dev)) == BK_OK)
                    *A_plain = fp;
            } else {
                *A_plain = fa;
            }
        }
        if (sb == BK_OK && dev)
            sb = bk_gpu_sync(a->f);
        if (sb != BK_OK)
            return bk_error_prefix(sb, mn);
        *A = fa;
        *B = dev ? fbd : fb;
        a->akey_src = a->akey_try;
        a->akey_scale = a->akey_try_scale;
        a->akey_gen = a->gen;
        return BK_OK;
    }
    const double N = (double)a->count[grp], P = (double)a->n_pairs;
    const int64_t h = a->dim.hd, hh = h * h;
    const dgram *plain = NULL; /* E[x xᵀ] when it differs from A */
    double *blk = NULL;
    bk_status st = BK_OK;
    switch (mod) {
    case BK_MOD_Q:
    case BK_MOD_K:
        if (!two) {
            st = gram_to_a(a, &a->x_attn, 1.0 / N, fa, dev);
            break;
        }
        if (a->shampoo) {
            st = gram_to_a(a, mod == BK_MOD_Q ? &a->a_q : &a->a_k, 1.0 / P, fa, dev);
            plain = &a->x_attn;
        } else {
            st = gram_to_a(a, &a->x_attn, 1.0 / N, fa, dev);
        }
        if (st != BK_OK)
            break;
        if (mod == BK_MOD_K) {
            if ((st = blocks_to_host(a, a->bk, a->dim.nkv, &blk)) == BK_OK)
                bk_hess_head_blocks(fb, blk, hh, a->dim.nkv, 1, h, 1.0 / P, 1.0);
            b_on_host = 1;
        } else if (a->qknorm) {
            if ((st = blocks_to_host(a, a->bq, a->dim.nh, &blk)) == BK_OK)
                bk_hess_head_blocks(fb, blk, hh, a->dim.nh, 1, h, 1.0 / P, 1.0);
            b_on_host = 1;
        } else if ((st = blocks_to_host(a, a->bq, a->dim.nkv, &blk)) == BK_OK) {
            b_on_host = 1;
            /* every head of a group has its group's block */
            bk_hess_head_blocks(fb, blk, hh, a->dim.nh, a->dim.rep, h, 1.0, P);
        }
        break;
    case BK_MOD_V:
        if (!two) {
            st = gram_to_a(a, &a->x_attn, 1.0 / N, fa, dev);
            break;
        }
        if (!orig || !orig->w[BK_MOD_O]) {
            st = bk_error(BK_ERR_INVALID_ARG,
                          "hessian: %s: the layer weights are needed (output factor from "
                          "self_attn.o_proj)",
                          mn);
            break;
        }
        if ((st = make_bv(a, orig->w[BK_MOD_O], &blk)) != BK_OK)
            break;
        if (a->shampoo) {
            double wa = 0;
            for (int64_t b = 0; b < a->dim.nkv; b++)
                wa += trace_h(blk + b * hh, h);
            st = gram_to_a(a, &a->x_attn, wa / N, fa, dev);
            bk_hess_head_blocks(fb, blk, hh, a->dim.nkv, 1, h, a->v_wb / N, 1.0);
            b_on_host = 1;
            plain = &a->x_attn;
        } else {
            st = gram_to_a(a, &a->x_attn, 1.0 / N, fa, dev);
            bk_hess_head_blocks(fb, blk, hh, a->dim.nkv, 1, h, 1.0, 1.0);
            b_on_host = 1;
        }
        break;
    case BK_MOD_O:
        st = gram_to_a(a, &a->x_o, 1.0 / N, fa, dev);
        break;
    case BK_MOD_GATE:
    case BK_MOD_UP: {
        if (!two) {
            st = gram_to_a(a, &a->x_mlp, 1.0 / N, fa, dev);
            break;
        }
        if (!orig || !orig->w[BK_MOD_DOWN]) {
            st = bk_error(BK_ERR_INVALID_ARG,
                          "hessian: %s: the layer weights are needed (output factor from "
                          "mlp.down_proj)",
                          mn);
            break;
        }
        if (a->shampoo) {
            st = gram_to_a(a, mod == BK_MOD_UP ? &a->a_up : &a->a_gate, 1.0 / N, fa, dev);
            plain = a->x_mlp.s ? &a->x_mlp : NULL;
        } else {
            st = gram_to_a(a, &a->x_mlp, 1.0 / N, fa, dev);
        }
        if (st != BK_OK)
            break;
        /* B = (Σ w v vᵀ / N) ⊙ DᵀD; DᵀD by SYRK into the output staging, the
         * product into the scratch (or a second staging when it is small) */
        const int64_t NI = a->dim.inter;
        float *dtd = NULL;
        if ((st = alloc_f(a, &dtd, NI * NI, "DᵀD")) != BK_OK)
            break;
        /* dtd is zero-filled: C += DᵀD (the forward's GEMM arithmetic) */
        st = bk_g_syrk(a->f, NI, a->dim.hidden, orig->w[BK_MOD_DOWN], dtd);
        if (st == BK_OK && !dev)
            st = dev_out(a, NI);
        if (st == BK_OK) {
            const dgram *gb = mod == BK_MOD_UP ? &a->b_up : &a->b_gate;
            k_mlp_b<<<bk_grid(NI * NI), 256, 0, a->c->stream>>>(dtd, gb->s, a->fp64, NI, N,
                                                                dev ? fbd : a->dev_out);
            st = BK_LAUNCHED("k_mlp_b");
        }
        if (st == BK_OK && !dev)
            st = bk_gpu_download(a->f, fb, a->dev_out, (size_t)(NI * NI) * sizeof(float));
        if (st == BK_OK && dev)
            st = bk_gpu_sync(a->f); /* dtd is freed next */
        bk_dev_free(a->c, dtd);
        break;
    }
    case BK_MOD_DOWN:
        st = gram_to_a(a, &a->x_down, 1.0 / N, fa, dev);
        break;
    default:
        break;
    }
    free(blk);
    if (st == BK_OK && dev && b_on_host)
        st = bk_gpu_upload(a->f, fbd, fb, (size_t)(m * m) * sizeof(float));
    if (st == BK_OK && A_plain) {
        if (plain) {
            float *fp = NULL;
            if (dev)
                st = dev_buf(a, &a->devP, &a->devP_n, n, &fp);
            else if (!(fp = host_buf(&a->outP[mod], n)))
                st = bk_error(BK_ERR_NOMEM, "hessian: %s: out of memory for E[x xᵀ]", mn);
            if (st == BK_OK && (st = gram_to_host(a, plain, 1.0 / N, fp, dev)) == BK_OK)
                *A_plain = fp;
        } else {
            *A_plain = fa;
        }
    }
    if (st == BK_OK && dev)
        st = bk_gpu_sync(a->f);
    if (st != BK_OK)
        return bk_error_prefix(st, mn);
    *A = fa;
    *B = dev ? fbd : fb;
    a->akey_src = a->akey_try;
    a->akey_scale = a->akey_try_scale;
    a->akey_gen = a->gen;
    return BK_OK;
}

extern "C" bk_status bk_ghess_factors(bk_ghess *a, const bk_glayer *orig, bk_module mod,
                                      const float **A, const float **B, const float **A_plain)
{
    return factors_impl(a, orig, mod, 0, A, B, A_plain);
}

extern "C" void bk_ghess_factor_key(const bk_ghess *a, const void **src, double *scale,
                                    uint64_t *gen, int *shared)
{
    *src = a ? a->akey_src : NULL;
    *scale = a && a->akey_src ? a->akey_scale : 0.0;
    *gen = a && a->akey_src ? a->akey_gen : 0;
    *shared = a && a->akey_src && (a->akey_src == &a->x_attn || a->akey_src == &a->x_mlp);
}

extern "C" bk_status bk_ghess_factors_dev(bk_ghess *a, const bk_glayer *orig, bk_module mod,
                                          const float **A, const float **B,
                                          const float **A_plain)
{
    return factors_impl(a, orig, mod, 1, A, B, A_plain);
}

extern "C" bk_status bk_ghess_factors_dev_aside(bk_ghess *a, const bk_glayer *orig,
                                                bk_module mod, bk_ghess_aside *x,
                                                const float **B, uint64_t *gen)
{
    if (!a || !x || !B || !gen)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL argument to "
                                            "bk_ghess_factors_dev_aside");
    /* x's buffers in place of the accumulator's set, and its factor key
     * kept, for one factors call */
    float *sA = a->devA, *sB = a->devB, *sP = a->devP;
    const size_t nA = a->devA_n, nB = a->devB_n, nP = a->devP_n;
    const dgram *ks = a->akey_src, *kt = a->akey_try;
    const double kss = a->akey_scale, kts = a->akey_try_scale;
    const uint64_t kg = a->akey_gen;
    a->devA = x->A, a->devB = x->B, a->devP = x->P;
    a->devA_n = x->A_n, a->devB_n = x->B_n, a->devP_n = x->P_n;
    const float *fa = NULL, *fp = NULL;
    bk_status st = factors_impl(a, orig, mod, 1, &fa, B, &fp);
    x->A = a->devA, x->B = a->devB, x->P = a->devP;
    x->A_n = a->devA_n, x->B_n = a->devB_n, x->P_n = a->devP_n;
    a->devA = sA, a->devB = sB, a->devP = sP;
    a->devA_n = nA, a->devB_n = nB, a->devP_n = nP;
    a->akey_src = ks, a->akey_try = kt;
    a->akey_scale = kss, a->akey_try_scale = kts;
    a->akey_gen = kg;
    *gen = a->gen;
    if (st != BK_OK)
        *B = NULL;
    return st;
}

extern "C" void bk_ghess_aside_free(bk_ghess *a, bk_ghess_aside *x)
{
    if (!a || !x)
        return;
    bk_dev_free(a->c, x->A);
    bk_dev_free(a->c, x->B);
    bk_dev_free(a->c, x->P);
    memset(x, 0, sizeof *x);
}

/* ------------------------------------------------- sums (MPI ranks) */

extern "C" bk_status bk_ghess_sums(bk_ghess *a, unsigned modules, int dev, int rw,
                                   bk_stage_buf_fn fn, void *user)
{
    if (!a || !fn)
        return bk_error(BK_ERR_INVALID_ARG, "GPU hessian: NULL argument to bk_ghess_sums");
    gen_bump(a); /* (the Grams, blocks and counts may be overwritten by the sums) */
    int grp[G_COUNT];
    bk__hess_groups(modules, grp);
    bk_status st = BK_OK;
    auto gram = [&](dgram *g) {
        if (st != BK_OK || !g->s)
            return;
        st = bk_gpu_stage_buf(a->f, g->s, (size_t)(g->n * g->n), a->fp64, dev, rw, fn, user);
    };
    if (a->bp) {
        /* the input side (bk__hess_bp_sum_items: the order of the CPU's
         * bk_hess_acc_sums): K-FAC's Σ a aᵀ, or Shampoo's per-module
         * Σ |g_t|² a aᵀ (each rank's rows weighed by its own tokens' weights)
         * and the plain Grams kept for the GPTQ loss; then the row counts.
         * own[] is this rank's and is not exchanged. The output side is the
         * flow's (B from the host accumulator, bk_ghess_set_grads). */
        dgram *plain[G_COUNT] = {&a->x_attn, &a->x_o, &a->x_mlp, &a->x_down};
        int items[BK_HESS_BP_SUM_ITEMS];
        const int n =
            bk__hess_bp_sum_items(modules, a->bp_shampoo, !a->bp_shampoo || a->keep_plain, items);
        for (int i = 0; i < n; i++)
            gram(items[i] < 0 ? plain[-1 - items[i]] : &a->a_bp[items[i]]);
        if (st != BK_OK)
            return st;
        double sc[G_COUNT];
        const size_t k = bk__hess_bp_counts_pack(grp, a->count, sc);
        if (k && (st = fn(user, sc, k, 1, 0, NULL)) != BK_OK)
            return st;
        bk__hess_bp_counts_unpack(grp, sc, a->count);
        return BK_OK;
    }
    const int64_t hh = a->dim.hd * a->dim.hd;
    if (grp[G_ATTN]) {
        gram(&a->x_attn);
        gram(&a->a_q);
        gram(&a->a_k);
        if (st == BK_OK && a->bq)
            st = bk_gpu_stage_buf(a->f, a->bq, (size_t)((a->qknorm ? a->dim.nh : a->dim.nkv) * hh), 1, dev,
                                  rw, fn, user);
        if (st == BK_OK && a->bk)
            st = bk_gpu_stage_buf(a->f, a->bk, (size_t)(a->dim.nkv * hh), 1, dev, rw, fn, user);
    }
    if (grp[G_O])
        gram(&a->x_o);
    if (grp[G_MLP]) {
        gram(&a->x_mlp);
        gram(&a->a_gate);
        gram(&a->a_up);
        gram(&a->b_gate);
        gram(&a->b_up);
    }
    if (grp[G_DOWN])
        gram(&a->x_down);
    if (st != BK_OK)
        return st;
    /* counts and scalar sums of the groups (host doubles, as the CPU's) */
    double sc[G_COUNT + 2];
    const size_t k = bk__hess_scalars_pack(grp, a->count, a->n_pairs, a->v_wb, sc);
    if ((st = fn(user, sc, k, 1, 0, NULL)) != BK_OK)
        return st;
    bk__hess_scalars_unpack(grp, sc, a->count, &a->n_pairs, &a->v_wb);
    return BK_OK;
}

extern "C" bk_status bk_ghess_set_grads(bk_ghess *a, const bk_hess_acc *g)
{
    if (!a || !g)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: NULL argument to bk_ghess_set_grads");
    if (!a->bp)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: bk_ghess_set_grads: output gradients only enter the backprop "
                        "kinds (Hessian is %s)",
                        bk_hessian_name(a->kind));
    gen_bump(a); /* (the output side and the token weights change) */
    a->grads = g;
    for (int m = 0; m < BK_MOD_COUNT; m++)
        a->Gdev[m] = NULL;
    if (!a->bp_shampoo)
        return BK_OK;
    bk_status st = BK_OK;
    const double *w[BK_MOD_COUNT];
    int64_t n[BK_MOD_COUNT], most = 0;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++) {
        st = bk__hess_bp_token_weights(g, (bk_module)m, &w[m], &n[m]);
        if (st == BK_OK && n[m] > 0 && !w[m])
            st = bk_error(BK_ERR_INTERNAL, "hessian: token weights missing");
        most = n[m] > most ? n[m] : most;
    }
    if (st == BK_OK && most > a->dw_cap) {
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            bk_dev_free(a->c, a->dw[m]);
            a->dw[m] = NULL;
        }
        a->dw_cap = 0;
        for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
            st = alloc_d(a, &a->dw[m], most, "backprop-shampoo token weights");
        if (st == BK_OK)
            a->dw_cap = most;
    }
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++) {
        if (n[m] > 0)
            st = bk_gpu_upload(a->f, a->dw[m], w[m], (size_t)n[m] * sizeof(double));
        a->dw_n[m] = st == BK_OK ? n[m] : 0;
        a->wsrc[m] = a->dw[m];
    }
    if (st != BK_OK) {
        a->grads = NULL;
        return bk_error_prefix(st, "GPU hessian");
    }
    return BK_OK;
}

extern "C" bk_status bk_ghess_set_grads_dev(bk_ghess *a, int layer,
                                           const double *const G[BK_MOD_COUNT],
                                           const double *const gw[BK_MOD_COUNT], int64_t N)
{
    if (!a || !G || N < 1)
        return bk_error(BK_ERR_INVALID_ARG, "hessian: bad argument to bk_ghess_set_grads_dev");
    if (!a->bp)
        return bk_error(BK_ERR_INVALID_ARG,
                        "hessian: bk_ghess_set_grads_dev: output gradients only enter the "
                        "backprop kinds (Hessian is %s)",
                        bk_hessian_name(a->kind));
    for (int m = 0; m < BK_MOD_COUNT; m++)
        if (!G[m] || (a->bp_shampoo && (!gw || !gw[m])))
            return bk_error(BK_ERR_INTERNAL, "hessian: layer %d %s: no device Gram or token "
                            "weights", layer, bk_module_name((bk_module)m));
    gen_bump(a); /* (the output side and the token weights change) */
    a->grads = NULL;
    a->Gdev_layer = layer;
    a->Gdev_N = N;
    for (int m = 0; m < BK_MOD_COUNT; m++) {
        a->Gdev[m] = G[m];
        a->wsrc[m] = a->bp_shampoo ? gw[m] : NULL;
        a->dw_n[m] = a->bp_shampoo ? N : 0;
    }
    return BK_OK;
}
