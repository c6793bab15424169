/* The backward pass and its flows on the GPU (cuda/backward.cu) against the
 * CPU oracle (src/backward.c, src/backward_flow.c; itself tested against
 * finite differences and PyTorch goldens in test_backward.c). Suite cuda;
 * exit 77 = skipped without a GPU.
 *
 * Tolerances (max |gpu - cpu| / max |cpu| over a whole array):
 *   TOL_FACTOR_FP64 2.5e-7  fp64 factors: bk_hess_factors returns F32, so
 *                    values ~1e-15 apart can round one float ulp apart;
 *   TOL_FP64  1e-9   --bwd-precision fp64: the CPU's arithmetic but for the
 *                    order of the sums (expected ~1e-14; not yet run on a GPU);
 *   TOL_FP32  1e-3   fp32: F32 GEMMs and F32 storage through a few layers
 *                    (expected ~1e-5; generous so that it fails only on a
 *                    real error, which shows up as O(1));
 *   TOL_TF32 5e-2, TOL_BF16 1e-1  the factors from the device Grams with
 *                    the flow's GEMMs on tensor cores (see below);
 *   bit-identical    GPU recursive halving against GPU naive I, with any
 *                    leaf size, micro-batch or number of resident layers
 *                    (the same kernels on the same micro-batch).
 *
 *  - flows, per tiny model (Llama-3 GQA, Qwen2 biases + tied embeddings,
 *    Qwen3 q/k norm, the kerneldocs example with 4 layers): every layer's
 *    module inputs a and output gradients g delivered by the GPU (naive I
 *    and halving, fp64 and fp32, a micro-batch of 3 against the CPU's 2, one
 *    resident layer) against the CPU's naive I; the K-FAC and Shampoo factors
 *    (bk_hess_add_grad + the input adds + bk_hess_factors) from both, and
 *    from the output-gradient Grams formed on the device (the job's path,
 *    bk__hess_add_grad_gram; K-FAC and |a|²-weighted; also with the flow's
 *    GEMMs on TF32 / BF16 tensor cores, loosely), the device arrays handed
 *    to grams_dev (the GPU stages' path) equal to the downloaded Grams bit
 *    for bit (leaves of 1 and 2); passes, depth, layer counts as the CPU;
 *    the boundary bytes in R;
 *  - the flow's own bf16 taps (every model): halving == naive bit for bit,
 *    within TOL_BF16 of the CPU with the empirical Fisher's labels (since
 *    session 14 h and dh are rounded to BF16 at every layer boundary in
 *    bf16 mode, both flows, and the boundary matrices are BF16: 2 bytes an
 *    element);
 *  - synthetic two-layer models with head_dim 64 (Qwen2: biases, tied) and
 *    128 (Qwen3: q/k norm), written to a temporary folder: all of the above,
 *    where bf16 runs the fused attention forward and backward
 *    (attn_flash.cu, attn_flash_bwd.cu), plus the bf16 taps at T 150 / 70
 *    (several key and query blocks of the fused kernels);
 *  - leaf sizes 2..5 (kerneldocs, 4 layers): the same gradients, the CPU's
 *    pass counts; device Grams of whole leaves;
 *  - head: model-Fisher labels of 16640 rows (two vocabulary blocks, so the
 *    running log-sum-exp and the CDF scan cross a block boundary) equal to
 *    the CPU's (fp64; fp32: at most 2 of 16640 differ, each GPU label inside
 *    its CPU CDF interval within 1e-5), the loss and dL/dh against the CPU
 *    head given the GPU's labels; the empirical Fisher's labels;
 *  - bad input: tokens out of range, leaf 0, the empirical Fisher with one
 *    token per sequence give the CPU's statuses (a model without lm_head is
 *    refused by the loader already: test_model.c); a device memory limit
 *    gives BK_ERR_DEVICE_OOM with a message naming --batch.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bakron/backend.h"
#include "bakron/backward.h"
#include "bakron/bakron.h"
#include "bakron/forward.h"
#include "bakron/hessian.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"
#include "bk_config.h"
#include "bwd_mem.h"
#include "util.h"

#if !BK_HAVE_CUDA
int main(void)
{
    fprintf(stderr, "no CUDA backend in this build: skipped\n");
    return 77;
}
#else

#include "backward_gpu.h"
#include "backward_internal.h"
#include "test_cm_util.h"

#define TOL_FP64 1e-9
#define TOL_FACTOR_FP64 2.5e-7 /* the factors come out as F32: one rounding of ~1e-15 apart values */
#define TOL_FP32 1e-3
/* --bwd-precision tf32 / bf16: GEMMs on tensor cores (10 / 7 mantissa bits),
 * checked with the empirical Fisher's labels (fixed, so no label flips): a
 * sanity bound (a wrong operand or compute type is off by O(1)), the measured
 * value printed with -v */
#define TOL_TF32 5e-2
#define TOL_BF16 1e-1

static bk_backend *g_gpu;
/* the labels of run_flow / run_grams: the model's samples, or (for the tf32 /
 * bf16 checks) the calibration's next tokens, which no rounding can flip */
static bk_fisher_kind g_fisher = BK_FISHER_MODEL;
/* the flows' boundary budget (bk_bwd_flow_opts.units; 0: recursive halving) */
static int g_units = 0;

static int verbose(void)
{
    const char *v = getenv("BK_TEST_VERBOSE");
    return !v || v[0] != '0'; /* print the measured errors unless BK_TEST_VERBOSE=0 */
}

static int64_t mod_out(const bk_model_config *c, int mod)
{
    int64_t o, in;
    bk_module_shape(c, (bk_module)mod, &o, &in);
    return o;
}

static int64_t mod_in(const bk_model_config *c, int mod)
{
    int64_t o, in;
    bk_module_shape(c, (bk_module)mod, &o, &in);
    return in;
}

/* ------------------------------------------------------------ collecting taps */

#define MAXL 16

typedef struct collect {
    const bk_model_config *c;
    int64_t N, T;
    double *a[MAXL][BK_MOD_COUNT], *g[MAXL][BK_MOD_COUNT];
    int delivered[MAXL];
    int done_next;
} collect;

static bk_status cb_grads(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    collect *k = user;
    assert_true(layer >= 0 && layer < MAXL);
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t in = mod_in(k->c, i), out = mod_out(k->c, i);
        if (!k->a[layer][i]) {
            k->a[layer][i] = calloc((size_t)(k->N * in), sizeof(double));
            k->g[layer][i] = calloc((size_t)(k->N * out), sizeof(double));
            assert_true(k->a[layer][i] && k->g[layer][i]);
        }
        memcpy(k->a[layer][i] + s0 * k->T * in, t->a[i], (size_t)(S * k->T * in) * sizeof(double));
        memcpy(k->g[layer][i] + s0 * k->T * out, t->g[i],
               (size_t)(S * k->T * out) * sizeof(double));
    }
    k->delivered[layer]++;
    return BK_OK;
}

static bk_status cb_leaf(void *user, int lo, int hi)
{
    collect *k = user;
    assert_int_equal(lo, k->done_next);
    assert_true(hi > lo);
    k->done_next = hi;
    return BK_OK;
}

static void collect_free(collect *k)
{
    for (int l = 0; l < MAXL; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            free(k->a[l][i]);
            free(k->g[l][i]);
        }
}

/* gpu: NULL for the CPU flow */
static void run_flow(const bk_model *m, const int32_t *tok, int64_t S, int64_t T,
                     bk_bwd_flow_kind kind, int leaf, int64_t batch, const bk_gbwd_opts *gpu,
                     collect *k, bk_bwd_flow_stats *st)
{
    const bk_model_config *c = bk_model_get_config(m);
    memset(k, 0, sizeof *k);
    k->c = c;
    k->N = S * T;
    k->T = T;
    bk_bwd_flow_opts o = {kind, leaf, g_fisher, 7, batch, 0, g_units};
    bk_bwd_flow_cb cb = {k, NULL, cb_grads, cb_leaf, NULL, 0, NULL, NULL, NULL};
    bk_status s = gpu ? bk_cuda_bwd_flow_run(g_gpu, m, tok, S, T, &o, gpu, &cb, st)
                      : bk_bwd_flow_run(m, tok, S, T, &o, &cb, st);
    if (s != BK_OK)
        fail_msg("%s flow (%s, leaf %d, batch %lld): %s", gpu ? "GPU" : "CPU",
                 bk_bwd_flow_name(kind), leaf, (long long)batch, bk_last_error());
    assert_int_equal(k->done_next, (int)c->n_layers);
    for (int l = 0; l < c->n_layers; l++)
        assert_int_equal(k->delivered[l], (int)((S + batch - 1) / batch));
}

/* every a and g of got against ref within tol; returns the worst error */
static double cmp_taps(const char *what, const collect *got, const collect *ref, double tol)
{
    const bk_model_config *c = ref->c;
    double worst = 0;
    for (int l = 0; l < c->n_layers; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            double ea = tu_rel_err_d(got->a[l][i], ref->a[l][i], ref->N * mod_in(c, i));
            double eg = tu_rel_err_d(got->g[l][i], ref->g[l][i], ref->N * mod_out(c, i));
            if (!(ea <= tol) || !(eg <= tol))
                fail_msg("%s: layer %d %s: inputs rel %.3g, gradients rel %.3g (tolerance %g)",
                         what, l, bk_module_name((bk_module)i), ea, eg, tol);
            worst = fmax(worst, fmax(ea, eg));
        }
    return worst;
}

static void same_taps(const char *what, const collect *a, const collect *b)
{
    const bk_model_config *c = a->c;
    for (int l = 0; l < c->n_layers; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            if (memcmp(a->a[l][i], b->a[l][i], (size_t)(a->N * mod_in(c, i)) * sizeof(double)) ||
                memcmp(a->g[l][i], b->g[l][i], (size_t)(a->N * mod_out(c, i)) * sizeof(double)))
                fail_msg("%s: layer %d %s differs (expected the same bits)", what, l,
                         bk_module_name((bk_module)i));
        }
}

/* The K-FAC / Shampoo factors of every module of every layer from two sets
 * of taps: the gradients of each, the inputs (as F32) of ref for both (the
 * input side of the job comes from the CPU stages). */
static double cmp_factors(const char *what, const bk_model *m, const collect *got,
                          const collect *ref, int64_t batch, double tol)
{
    const bk_model_config *c = ref->c;
    const int64_t T = ref->T, S = ref->N / T;
    double worst = 0;
    for (int kind = 0; kind < 2; kind++) {
        bk_hessian_kind hk = kind ? BK_HESS_BACKPROP_SHAMPOO : BK_HESS_BACKPROP_KFAC;
        for (int l = 0; l < c->n_layers; l++) {
            bk_layer_weights lw;
            assert_int_equal(bk_layer_weights_load(m, l, &lw), BK_OK);
            bk_hess_acc *acc[2];
            const collect *src[2] = {got, ref};
            for (int s = 0; s < 2; s++) {
                assert_int_equal(bk_hess_acc_create(c, hk, 1, T, &acc[s]), BK_OK);
                for (int64_t s0 = 0; s0 < S; s0 += batch) {
                    const int64_t sb = S - s0 < batch ? S - s0 : batch, r0 = s0 * T, n = sb * T;
                    for (int i = 0; i < BK_MOD_COUNT; i++)
                        if (bk_hess_add_grad(acc[s], l, (bk_module)i,
                                             src[s]->g[l][i] + r0 * mod_out(c, i),
                                             src[s]->a[l][i] + r0 * mod_in(c, i), sb) != BK_OK)
                            fail_msg("%s", bk_last_error());
                    /* inputs of q/k/v, o, gate/up, down (the reference's, F32) */
                    float *x[4];
                    const int mods[4] = {BK_MOD_Q, BK_MOD_O, BK_MOD_GATE, BK_MOD_DOWN};
                    for (int q = 0; q < 4; q++) {
                        const int64_t w = mod_in(c, mods[q]);
                        x[q] = malloc((size_t)(n * w) * sizeof(float));
                        assert_non_null(x[q]);
                        for (int64_t e = 0; e < n * w; e++)
                            x[q][e] = (float)ref->a[l][mods[q]][r0 * w + e];
                    }
                    if (bk_hess_add_attn(acc[s], &lw, x[0], NULL, NULL, sb) != BK_OK ||
                        bk_hess_add_o(acc[s], x[1], sb) != BK_OK ||
                        bk_hess_add_mlp(acc[s], &lw, x[2], sb) != BK_OK ||
                        bk_hess_add_down(acc[s], x[3], sb) != BK_OK)
                        fail_msg("%s", bk_last_error());
                    for (int q = 0; q < 4; q++)
                        free(x[q]);
                }
            }
            for (int i = 0; i < BK_MOD_COUNT; i++) {
                const float *A[2], *B[2];
                for (int s = 0; s < 2; s++)
                    if (bk_hess_factors(acc[s], &lw, (bk_module)i, &A[s], &B[s]) != BK_OK)
                        fail_msg("%s", bk_last_error());
                assert_non_null(B[0]);
                assert_non_null(B[1]);
                const int64_t o = mod_out(c, i), in = mod_in(c, i);
                /* copies: the arrays of one accumulator are reused per call */
                double eb = tu_rel_err_f(B[0], B[1], o * o);
                double ea = tu_rel_err_f(A[0], A[1], in * in);
                if (!(eb <= tol) || !(ea <= tol))
                    fail_msg("%s %s: layer %d %s: output factor rel %.3g, input factor rel %.3g "
                             "(tolerance %g)",
                             what, bk_hessian_name(hk), l, bk_module_name((bk_module)i), eb, ea,
                             tol);
                worst = fmax(worst, fmax(ea, eb));
            }
            bk_hess_acc_free(acc[0]);
            bk_hess_acc_free(acc[1]);
            bk_layer_weights_free(&lw);
        }
    }
    return worst;
}

/* ------------------------------------------------------------ Grams on the device */

typedef struct gcollect {
    const bk_model_config *c;
    int64_t N, T;
    double *G[MAXL][BK_MOD_COUNT], *gw[MAXL][BK_MOD_COUNT];
    int next; /* layer * BK_MOD_COUNT + module expected next */
    int done_next;
} gcollect;

static bk_status cb_grams(void *user, int layer, bk_module mod, const double *G, const double *gw,
                          int64_t S)
{
    gcollect *k = user;
    const int64_t m = mod_out(k->c, mod);
    assert_int_equal(S * k->T, k->N);
    assert_int_equal(layer * BK_MOD_COUNT + (int)mod, k->next); /* layer, then module order */
    k->next++;
    assert_null(k->G[layer][mod]);
    k->G[layer][mod] = malloc((size_t)(m * m) * sizeof(double));
    k->gw[layer][mod] = malloc((size_t)k->N * sizeof(double));
    assert_true(k->G[layer][mod] && k->gw[layer][mod]);
    memcpy(k->G[layer][mod], G, (size_t)(m * m) * sizeof(double));
    memcpy(k->gw[layer][mod], gw, (size_t)k->N * sizeof(double));
    return BK_OK;
}

/* grams_dev: the device arrays downloaded, then as cb_grams (gw: zeros
 * when the flow hands none, K-FAC) */
static bk_status cb_grams_dev(void *user, int layer, bk_module mod, const double *G,
                              const double *gw, int64_t S)
{
    gcollect *k = user;
    const int64_t m = mod_out(k->c, mod);
    double *hG = malloc((size_t)(m * m) * sizeof(double));
    double *hw = calloc((size_t)k->N, sizeof(double));
    assert_true(hG && hw);
    assert_int_equal(bk__cuda_download(g_gpu, hG, G, (size_t)(m * m) * sizeof(double)), BK_OK);
    if (gw)
        assert_int_equal(bk__cuda_download(g_gpu, hw, gw, (size_t)k->N * sizeof(double)), BK_OK);
    bk_status st = cb_grams(user, layer, mod, hG, hw, S);
    free(hG);
    free(hw);
    return st;
}

static bk_status cb_gleaf(void *user, int lo, int hi)
{
    gcollect *k = user;
    assert_int_equal(lo, k->done_next);
    assert_int_equal(k->next, hi * BK_MOD_COUNT); /* every Gram of the leaf came first */
    k->done_next = hi;
    return BK_OK;
}

static void gcollect_free(gcollect *k)
{
    for (int l = 0; l < MAXL; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            free(k->G[l][i]);
            free(k->gw[l][i]);
        }
}

static void run_grams_cb(const bk_model *m, const int32_t *tok, int64_t S, int64_t T,
                         bk_bwd_flow_kind kind, int leaf, int64_t batch, const bk_gbwd_opts *gpu,
                         int weighted, int dev, gcollect *k)
{
    const bk_model_config *c = bk_model_get_config(m);
    memset(k, 0, sizeof *k);
    k->c = c;
    k->N = S * T;
    k->T = T;
    bk_bwd_flow_opts o = {kind, leaf, g_fisher, 7, batch, 0, 0};
    bk_bwd_flow_cb cb = {k,        NULL, NULL, cb_gleaf, dev ? NULL : cb_grams,
                         weighted, dev ? cb_grams_dev : NULL, NULL, NULL};
    bk_bwd_flow_stats st;
    if (bk_cuda_bwd_flow_run(g_gpu, m, tok, S, T, &o, gpu, &cb, &st) != BK_OK)
        fail_msg("GPU flow with Grams (%s, leaf %d): %s", bk_bwd_flow_name(kind), leaf,
                 bk_last_error());
    assert_int_equal(k->done_next, (int)c->n_layers);
    assert_int_equal(k->next, (int)c->n_layers * BK_MOD_COUNT);
}

static void run_grams(const bk_model *m, const int32_t *tok, int64_t S, int64_t T,
                      bk_bwd_flow_kind kind, int leaf, int64_t batch, const bk_gbwd_opts *gpu,
                      int weighted, gcollect *k)
{
    run_grams_cb(m, tok, S, T, kind, leaf, batch, gpu, weighted, 0, k);
}

/* The factors from the device Grams (bk__hess_add_grad_gram) against those
 * from the reference's taps (bk_hess_add_grad); the reference's inputs for both. */
static double cmp_gram_factors(const char *what, const bk_model *m, const gcollect *got,
                               const collect *ref, int weighted, double tol)
{
    const bk_model_config *c = ref->c;
    const int64_t T = ref->T, S = ref->N / T, N = ref->N;
    const bk_hessian_kind hk = weighted ? BK_HESS_BACKPROP_SHAMPOO : BK_HESS_BACKPROP_KFAC;
    double worst = 0;
    for (int l = 0; l < c->n_layers; l++) {
        bk_layer_weights lw;
        assert_int_equal(bk_layer_weights_load(m, l, &lw), BK_OK);
        bk_hess_acc *acc[2];
        for (int s = 0; s < 2; s++) {
            assert_int_equal(bk_hess_acc_create(c, hk, 1, T, &acc[s]), BK_OK);
            for (int i = 0; i < BK_MOD_COUNT; i++) {
                bk_status st = s ? bk_hess_add_grad(acc[s], l, (bk_module)i, ref->g[l][i],
                                                    ref->a[l][i], S)
                                 : bk__hess_add_grad_gram(acc[s], l, (bk_module)i, got->G[l][i],
                                                          got->gw[l][i], S);
                if (st != BK_OK)
                    fail_msg("%s", bk_last_error());
            }
            float *x[4];
            const int mods[4] = {BK_MOD_Q, BK_MOD_O, BK_MOD_GATE, BK_MOD_DOWN};
            for (int q = 0; q < 4; q++) {
                const int64_t w = mod_in(c, mods[q]);
                x[q] = malloc((size_t)(N * w) * sizeof(float));
                assert_non_null(x[q]);
                for (int64_t e = 0; e < N * w; e++)
                    x[q][e] = (float)ref->a[l][mods[q]][e];
            }
            if (bk_hess_add_attn(acc[s], &lw, x[0], NULL, NULL, S) != BK_OK ||
                bk_hess_add_o(acc[s], x[1], S) != BK_OK ||
                bk_hess_add_mlp(acc[s], &lw, x[2], S) != BK_OK ||
                bk_hess_add_down(acc[s], x[3], S) != BK_OK)
                fail_msg("%s", bk_last_error());
            for (int q = 0; q < 4; q++)
                free(x[q]);
        }
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const float *A[2], *B[2];
            for (int s = 0; s < 2; s++)
                if (bk_hess_factors(acc[s], &lw, (bk_module)i, &A[s], &B[s]) != BK_OK)
                    fail_msg("%s", bk_last_error());
            const int64_t o = mod_out(c, i), in = mod_in(c, i);
            double eb = tu_rel_err_f(B[0], B[1], o * o), ea = tu_rel_err_f(A[0], A[1], in * in);
            if (!(eb <= tol) || !(ea <= tol))
                fail_msg("%s %s (device Grams): layer %d %s: output factor rel %.3g, input "
                         "factor rel %.3g (tolerance %g)",
                         what, bk_hessian_name(hk), l, bk_module_name((bk_module)i), eb, ea, tol);
            worst = fmax(worst, fmax(ea, eb));
        }
        bk_hess_acc_free(acc[0]);
        bk_hess_acc_free(acc[1]);
        bk_layer_weights_free(&lw);
    }
    return worst;
}

/* the flow's device buffers (stats->micro_bytes) are what src/bwd_mem.c's
 * model counts: the model sizes the job's micro-batch and weight cache, and
 * must follow every change of the flow's allocations */
static void mem_model_check(const char *what, const bk_model_config *c, int64_t S, int64_t T,
                            int64_t B, int flow, int precision, const bk_bwd_flow_stats *st)
{
    const bk_bwd_mem_params p = {flow, 1, precision, 0, 0, 0, g_units, 0};
    const uint64_t model = bk_bwd_dev_bytes(c, B, T, S, &p, 1);
    if (st->micro_bytes != model)
        fail_msg("%s: the flow allocated %llu device bytes, src/bwd_mem.c's model says %llu "
                 "(difference %lld)",
                 what, (unsigned long long)st->micro_bytes, (unsigned long long)model,
                 (long long)st->micro_bytes - (long long)model);
}

/* --bwd-precision bf16 (the flow's own taps, not only its Grams): recursive
 * halving and naive I deliver the same bits (the fused attention backward
 * has no atomics either), and both are within TOL_BF16 of the CPU with the
 * empirical Fisher's labels (fixed: no label flips). At head_dim 64 / 128
 * this is the fused attention (cuda/attn_flash.cu, attn_flash_bwd.cu),
 * elsewhere the unfused BF16 path. Returns the worst error. */
static double bf16_taps(const char *name, const bk_model *m, const int32_t *tok, int64_t S,
                        int64_t T)
{
    collect refe, bn, bh;
    bk_bwd_flow_stats se, sn, sh;
    bk_gbwd_opts gbf = {0, 0, BK_GBWD_BF16, 0};
    g_fisher = BK_FISHER_EMPIRICAL;
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 2, NULL, &refe, &se);
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 3, &gbf, &bn, &sn);
    run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &gbf, &bh, &sh);
    g_fisher = BK_FISHER_MODEL;
    mem_model_check("GPU bf16 halving", bk_model_get_config(m), S, T, 3, BK_FLOW_HALVING,
                    BK_BWD_BF16, &sh);
    mem_model_check("GPU bf16 naive", bk_model_get_config(m), S, T, 3, BK_FLOW_NAIVE,
                    BK_BWD_BF16, &sn);
    same_taps("GPU bf16 halving vs GPU bf16 naive", &bh, &bn);
    /* session 14: wider splits (a budget of 64 boundary matrices: one child per
     * leaf at the root) deliver the same bits, with the device buffers the model
     * counts (the kept layer inputs of the root's longer backward) */
    {
        collect bw;
        bk_bwd_flow_stats sw;
        const bk_model_config *c = bk_model_get_config(m);
        g_fisher = BK_FISHER_EMPIRICAL;
        g_units = 64;
        run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &gbf, &bw, &sw);
        mem_model_check("GPU bf16 wide", c, S, T, 3, BK_FLOW_HALVING, BK_BWD_BF16, &sw);
        g_units = 0;
        g_fisher = BK_FISHER_MODEL;
        same_taps("GPU bf16 wide splits vs GPU bf16 naive", &bw, &bn);
        if (c->n_layers > 1)
            assert_int_equal(sw.passes, 1 + (int)c->n_layers);
        assert_true(sw.peak_boundary_bytes ==
                    bk_bwd_boundary_peak_bytes_b(c->n_layers, BK_FLOW_HALVING, 1, 64, S * T,
                                                 c->hidden, 2));
        collect_free(&bw);
    }
    /* session 14: BF16 boundary matrices (h and dh rounded to BF16 at every
     * layer boundary in both flows, so the store is exact): 2 bytes an element */
    {
        const bk_model_config *c = bk_model_get_config(m);
        assert_true(sh.peak_boundary_bytes ==
                    bk_bwd_boundary_peak_bytes(c->n_layers, BK_FLOW_HALVING, 1, S * T, c->hidden,
                                               2));
        assert_true(sn.peak_boundary_bytes == 0);
    }
    /* issue 16: the BF16 host weights (mapped checkpoint or host RNE copies)
     * give the device the bits the F32 upload rounded on the device gave
     * (bk_gbwd_opts.f32_weights: that path): the same taps, bit for bit */
    {
        collect bo;
        bk_bwd_flow_stats so;
        bk_gbwd_opts gold = gbf;
        gold.f32_weights = 1;
        g_fisher = BK_FISHER_EMPIRICAL;
        run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &gold, &bo, &so);
        g_fisher = BK_FISHER_MODEL;
        same_taps("GPU bf16 halving: BF16 host weights vs F32 uploads rounded on the device", &bh,
                  &bo);
        collect_free(&bo);
    }
    double e = cmp_taps("GPU bf16 halving vs CPU (empirical Fisher)", &bh, &refe, TOL_BF16);
    if (verbose())
        fprintf(stderr, "  %s (T %lld): bf16 taps %.3g (tol %g), %s attention; halving == naive "
                "bit for bit\n",
                name, (long long)T, e, TOL_BF16,
                bk__cuda_bwd_attn_fused(&gbf, bk_model_get_config(m)->head_dim) ? "fused"
                                                                                 : "unfused");
    collect_free(&refe);
    collect_free(&bn);
    collect_free(&bh);
    return e;
}

static void flow_model_m(const char *name, bk_model *m)
{
    const bk_model_config *c = bk_model_get_config(m);
    assert_true(c->n_layers <= MAXL);
    const int64_t S = 5, T = 24;
    int32_t *tok = tu_random_tokens(21, S * T, c->vocab);
    collect ref, nv, hv, hv1, f32n, f32h;
    bk_bwd_flow_stats sref, snv, shv, shv1, s32n, s32h, scpuh;
    /* the reference: CPU naive I, micro-batch 2; and CPU halving's counts */
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 2, NULL, &ref, &sref);
    {
        collect tmp;
        run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 2, NULL, &tmp, &scpuh);
        collect_free(&tmp);
    }
    bk_gbwd_opts g64 = {1, 0, 0, 0}, g64one = {1, 1, 0, 0}, g32 = {0, 0, 0, 0};
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 3, &g64, &nv, &snv);
    run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &g64, &hv, &shv);
    run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &g64one, &hv1, &shv1);
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 3, &g32, &f32n, &s32n);
    run_flow(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &g32, &f32h, &s32h);
    mem_model_check("GPU fp64 halving", c, S, T, 3, BK_FLOW_HALVING, BK_BWD_FP64, &shv);
    mem_model_check("GPU fp64 naive", c, S, T, 3, BK_FLOW_NAIVE, BK_BWD_FP64, &snv);
    mem_model_check("GPU fp32 halving", c, S, T, 3, BK_FLOW_HALVING, BK_BWD_FP32, &s32h);
    /* the weight cache: with every layer resident each is uploaded once; with
     * one slot fewer than layers (naive I: every sweep walks all layers from
     * the first) the layers uploaded in the first micro-batch but the last two
     * stay resident, so every later micro-batch hits at least L - 2 of them */
    assert_int_equal(shv.resident_layers, (int)c->n_layers);
    assert_int_equal(shv.weight_uploads, c->n_layers);
    assert_int_equal(shv1.resident_layers, 1);
    if (c->n_layers >= 3) {
        collect kv;
        bk_bwd_flow_stats skv;
        bk_gbwd_opts g64k = {1, (int)c->n_layers - 1, 0, 0};
        run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 3, &g64k, &kv, &skv);
        same_taps("GPU fp64 naive, L - 1 resident layers, vs all resident", &kv, &nv);
        const int64_t mbs = (int64_t)skv.passes * ((S + 2) / 3);
        assert_int_equal(skv.resident_layers, (int)c->n_layers - 1);
        if (!(skv.weight_uploads <= skv.weight_requests - (mbs - 1) * (c->n_layers - 2)))
            fail_msg("%s: %lld of %lld weight requests uploaded with %d of %d layers resident "
                     "over %lld micro-batches (at most %lld expected)",
                     name, (long long)skv.weight_uploads, (long long)skv.weight_requests,
                     skv.resident_layers, (int)c->n_layers, (long long)mbs,
                     (long long)(skv.weight_requests - (mbs - 1) * (c->n_layers - 2)));
        /* three layers, two slots, S = 5 in micro-batches of 3 (two per pass), naive I
         * with leaves 0, 1, 2: per micro-batch the forward asks for 0 1 2 and the
         * backward for 2 .. leaf. Slot A keeps layer 0 from the first upload on, slot B
         * rotates: uploads per micro-batch 4 + 2 (leaf 0), 2 + 2 (leaf 1), 1 + 2 (leaf 2:
         * the second micro-batch finds 2 in B and needs 1 first) = 13 of 30 requests.
         * LRU (before session 13) gives 4 + 2, 2 + 2, 2 + 2 = 14 here; the difference
         * grows with the layers: LRU misses on every forward request once a sweep
         * walks more layers than there are slots. */
        if (c->n_layers == 3)
            assert_int_equal(skv.weight_uploads, 13);
        if (verbose())
            fprintf(stderr, "  %s: weight cache %d of %d layers: %lld uploads of %lld requests "
                    "(all resident: %lld)\n",
                    name, skv.resident_layers, (int)c->n_layers, (long long)skv.weight_uploads,
                    (long long)skv.weight_requests, (long long)shv.weight_uploads);
        collect_free(&kv);
    }

    double e64 = cmp_taps("GPU fp64 naive vs CPU", &nv, &ref, TOL_FP64);
    cmp_taps("GPU fp64 halving vs CPU", &hv, &ref, TOL_FP64);
    same_taps("GPU fp64 halving vs GPU fp64 naive", &hv, &nv);
    same_taps("GPU fp64 halving, one resident layer, vs all resident", &hv1, &hv);
    same_taps("GPU fp32 halving vs GPU fp32 naive", &f32h, &f32n);
    double e32 = cmp_taps("GPU fp32 halving vs CPU", &f32h, &ref, TOL_FP32);
    double f64 = cmp_factors("GPU fp64", m, &hv, &ref, 2, TOL_FACTOR_FP64);
    double f32 = cmp_factors("GPU fp32", m, &f32h, &ref, 2, TOL_FP32);
    /* the Grams formed on the device (the job's path) */
    double gr64 = 0, gr32 = 0, grtf = 0, grbf = 0;
    bk_gbwd_opts gtf = {0, 0, BK_GBWD_TF32, 0}, gbf = {0, 0, BK_GBWD_BF16, 0};
    /* tf32 / bf16 against a CPU reference with the empirical Fisher's labels:
     * with sampled labels a label whose CDF step sits within the GEMMs' rounding
     * flips and moves a 120-token Gram by several per cent (seen on the H200 at
     * bc70eee: tf32 output factors 0.05-0.17 off on three of four models) */
    collect refe;
    {
        bk_bwd_flow_stats se;
        g_fisher = BK_FISHER_EMPIRICAL;
        run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 2, NULL, &refe, &se);
    }
    for (int weighted = 0; weighted < 2; weighted++) {
        gcollect gk;
        run_grams(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &gtf, weighted, &gk);
        grtf = fmax(grtf, cmp_gram_factors("GPU tf32", m, &gk, &refe, weighted, TOL_TF32));
        gcollect_free(&gk);
        run_grams(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &gbf, weighted, &gk);
        grbf = fmax(grbf, cmp_gram_factors("GPU bf16", m, &gk, &refe, weighted, TOL_BF16));
        gcollect_free(&gk);
    }
    g_fisher = BK_FISHER_MODEL;
    collect_free(&refe);
    bf16_taps(name, m, tok, S, T);
    for (int weighted = 0; weighted < 2; weighted++) {
        gcollect gk;
        run_grams(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &g64, weighted, &gk);
        gr64 = fmax(gr64, cmp_gram_factors("GPU fp64", m, &gk, &ref, weighted, TOL_FACTOR_FP64));
        gcollect_free(&gk);
        run_grams(m, tok, S, T, BK_FLOW_HALVING, 1, 3, &g32, weighted, &gk);
        gr32 = fmax(gr32, cmp_gram_factors("GPU fp32", m, &gk, &ref, weighted, TOL_FP32));
        gcollect_free(&gk);
    }

    /* grams_dev (the job's path with the GPU stages): the device arrays handed
     * over hold the same Grams and token weights as those downloaded for
     * grams, bit for bit, with leaves of 1 and 2 layers (valid until the
     * leaf is done, then cleared for the next leaf) */
    for (int weighted = 0; weighted < 2; weighted++)
        for (int leaf = 1; leaf <= 2; leaf++) {
            gcollect gh, gd;
            run_grams_cb(m, tok, S, T, BK_FLOW_HALVING, leaf, 3, &g32, weighted, 0, &gh);
            run_grams_cb(m, tok, S, T, BK_FLOW_HALVING, leaf, 3, &g32, weighted, 1, &gd);
            for (int l = 0; l < c->n_layers; l++)
                for (int i = 0; i < BK_MOD_COUNT; i++) {
                    const int64_t o = mod_out(c, i);
                    if (memcmp(gh.G[l][i], gd.G[l][i], (size_t)(o * o) * sizeof(double)) != 0 ||
                        (weighted && memcmp(gh.gw[l][i], gd.gw[l][i],
                                            (size_t)gh.N * sizeof(double)) != 0))
                        fail_msg("grams_dev vs grams (weighted %d, leaf %d): layer %d %s "
                                 "differs",
                                 weighted, leaf, l, bk_module_name((bk_module)i));
                }
            gcollect_free(&gh);
            gcollect_free(&gd);
        }

    /* the flow's bookkeeping is the CPU's */
    assert_int_equal(snv.passes, sref.passes);
    assert_int_equal(snv.layer_forwards, sref.layer_forwards);
    assert_int_equal(snv.layer_backwards, sref.layer_backwards);
    assert_int_equal(shv.passes, scpuh.passes);
    assert_int_equal(shv.max_depth, scpuh.max_depth);
    assert_int_equal(shv.layer_forwards, scpuh.layer_forwards);
    assert_int_equal(shv.layer_backwards, scpuh.layer_backwards);
    assert_true(shv.peak_boundary_bytes == scpuh.peak_boundary_bytes); /* double */
    assert_true(s32h.peak_boundary_bytes * 2 == scpuh.peak_boundary_bytes); /* float */
    assert_true(snv.peak_boundary_bytes == 0);
    assert_true(shv.micro_bytes > 0 && s32h.micro_bytes > 0);
    if (verbose())
        fprintf(stderr,
                "  %s: taps fp64 %.3g (tol %g), fp32 %.3g (tol %g); factors fp64 %.3g, fp32 "
                "%.3g; from device Grams fp64 %.3g, fp32 %.3g, tf32 %.3g, bf16 %.3g; halving == "
                "naive bit for bit; %d passes, depth %d\n",
                name, e64, TOL_FP64, e32, TOL_FP32, f64, f32, gr64, gr32, grtf, grbf, shv.passes,
                shv.max_depth);
    collect_free(&ref);
    collect_free(&nv);
    collect_free(&hv);
    collect_free(&hv1);
    collect_free(&f32n);
    collect_free(&f32h);
    free(tok);
}

static void flow_model(const char *name)
{
    bk_model *m = tu_open_model(name);
    flow_model_m(name, m);
    bk_model_close(m);
}

/* ------------------------------------------- synthetic head_dim 64 / 128 */

/* A two-layer checkpoint (F32, random: matrices N(0, 1/fan_in), embeddings
 * N(0, 1), norms 1 + N(0, 0.1)) of the given shape into dir: the test models
 * have head_dim 16 / 32, and only head_dim 64 / 128 take the fused attention
 * of bf16 mode. type "qwen2": q/k/v biases, tied embeddings; "qwen3": q/k
 * norm, lm_head. */
static void write_syn(const char *dir, const char *type, int64_t H, int64_t I, int64_t nh,
                      int64_t nkv, int64_t hd, int64_t V, uint64_t seed)
{
    const int L = 2, qwen3 = !strcmp(type, "qwen3");
    bk_rng r;
    bk_rng_seed(&r, seed);
    bk_st_writer *w = NULL;
    assert_int_equal(bk_st_writer_create(&w), BK_OK);
    const int64_t qd = nh * hd, kvd = nkv * hd;
    /* (name, rows, cols (0: a vector), scale, offset) */
    struct {
        char name[96];
        int64_t rows, cols;
        double scale, offset;
    } t[64];
    int n = 0;
#define SYN(r_, c_, sc_, of_, ...)                                                                 \
    do {                                                                                           \
        snprintf(t[n].name, sizeof t[n].name, __VA_ARGS__);                                        \
        t[n].rows = (r_), t[n].cols = (c_), t[n].scale = (sc_), t[n].offset = (of_);               \
        n++;                                                                                       \
    } while (0)
    SYN(V, H, 1.0, 0.0, "model.embed_tokens.weight");
    if (qwen3)
        SYN(V, H, 1.0 / sqrt((double)H), 0.0, "lm_head.weight");
    SYN(H, 0, 0.1, 1.0, "model.norm.weight");
    for (int l = 0; l < L; l++) {
        SYN(H, 0, 0.1, 1.0, "model.layers.%d.input_layernorm.weight", l);
        SYN(H, 0, 0.1, 1.0, "model.layers.%d.post_attention_layernorm.weight", l);
        const int64_t o[BK_MOD_COUNT] = {qd, kvd, kvd, H, I, I, H},
                      in[BK_MOD_COUNT] = {H, H, H, qd, H, H, I};
        for (int i = 0; i < BK_MOD_COUNT; i++)
            SYN(o[i], in[i], 1.0 / sqrt((double)in[i]), 0.0, "model.layers.%d.%s.weight", l,
                bk_module_name((bk_module)i));
        if (qwen3) {
            SYN(hd, 0, 0.1, 1.0, "model.layers.%d.self_attn.q_norm.weight", l);
            SYN(hd, 0, 0.1, 1.0, "model.layers.%d.self_attn.k_norm.weight", l);
        } else
            for (int i = 0; i < 3; i++)
                SYN(o[i], 0, 0.1, 0.0, "model.layers.%d.%s.bias", l, bk_module_name((bk_module)i));
    }
#undef SYN
    assert_true(n <= 64);
    for (int k = 0; k < n; k++) {
        const int64_t cnt = t[k].cols ? t[k].rows * t[k].cols : t[k].rows;
        float *v = malloc((size_t)cnt * sizeof(float));
        assert_non_null(v);
        for (int64_t i = 0; i < cnt; i++)
            v[i] = (float)(t[k].offset + t[k].scale * bk_rng_normal(&r));
        int64_t shape[2] = {t[k].rows, t[k].cols};
        assert_int_equal(bk_st_writer_add(w, t[k].name, BK_DT_F32, t[k].cols ? 2 : 1, shape, v, 1),
                         BK_OK);
        free(v);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(bk_st_writer_save(w, path), BK_OK);
    bk_st_writer_free(w);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "{\"model_type\": \"%s\", \"num_hidden_layers\": %d, \"hidden_size\": %lld, "
            "\"intermediate_size\": %lld, \"num_attention_heads\": %lld, "
            "\"num_key_value_heads\": %lld, \"head_dim\": %lld, \"vocab_size\": %lld, "
            "\"rms_norm_eps\": 1e-06, \"rope_theta\": 10000.0, \"tie_word_embeddings\": %s}\n",
            type, L, (long long)H, (long long)I, (long long)nh, (long long)nkv, (long long)hd,
            (long long)V, qwen3 ? "false" : "true");
    fclose(f);
}

/* The flows of flow_model on a synthetic model (the bf16 ones with the fused
 * attention), then bf16_taps at a longer T: several 128-key blocks of the
 * dK/dV kernel and 128-row blocks of the dQ kernel, partial ones at the end */
static void flow_syn(const char *type, int64_t H, int64_t I, int64_t nh, int64_t nkv, int64_t hd,
                     int64_t T_long)
{
    char dir[] = "/tmp/bk_test_cuda_backward_XXXXXX";
    assert_non_null(mkdtemp(dir));
    write_syn(dir, type, H, I, nh, nkv, hd, 256, 40 + (uint64_t)hd);
    bk_model *m = NULL;
    if (bk_model_open(dir, &m) != BK_OK)
        fail_msg("%s: %s", dir, bk_last_error());
    const bk_model_config *c = bk_model_get_config(m);
    assert_int_equal(c->head_dim, hd);
    bk_gbwd_opts gbf = {0, 0, BK_GBWD_BF16, 0}, g32 = {0, 0, 0, 0}, g64 = {1, 0, BK_GBWD_BF16, 0};
    assert_int_equal(bk__cuda_bwd_attn_fused(&gbf, hd), 1);
    assert_int_equal(bk__cuda_bwd_attn_fused(&g32, hd), 0);
    assert_int_equal(bk__cuda_bwd_attn_fused(&g64, hd), 0);
    char name[64];
    snprintf(name, sizeof name, "synthetic %s head_dim %lld", type, (long long)hd);
    flow_model_m(name, m);
    const int64_t S = 3;
    int32_t *tok = tu_random_tokens(23, S * T_long, c->vocab);
    bf16_taps(name, m, tok, S, T_long);
    free(tok);
    bk_model_close(m);
    tu_rm_model_dir(dir);
}

/* head_dim 64: Qwen2 (biases, tied embeddings), 4 / 2 heads, T 150 (two
 * 128-key blocks; 300 query rows: three 128-row blocks) */
static void test_flow_syn_hd64(void **state)
{
    (void)state;
    flow_syn("qwen2", 128, 256, 4, 2, 64, 150);
}

/* head_dim 128: Qwen3 (q/k norm, lm_head), 4 query heads on 1 kv head,
 * T 70 (280 query rows) */
static void test_flow_syn_hd128(void **state)
{
    (void)state;
    flow_syn("qwen3", 128, 256, 4, 1, 128, 70);
}

static void test_flow_llama3(void **state)
{
    (void)state;
    flow_model("tiny-llama3");
}

static void test_flow_qwen2(void **state)
{
    (void)state;
    flow_model("tiny-qwen2");
}

static void test_flow_qwen3(void **state)
{
    (void)state;
    flow_model("tiny-qwen3");
}

static void test_flow_kerneldocs(void **state)
{
    (void)state;
    flow_model("kerneldocs-1.6m");
}

/* Leaf sizes: the same gradients, the CPU's counts. */
static void test_flow_leaf(void **state)
{
    (void)state;
    bk_model *m = tu_open_model("kerneldocs-1.6m");
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t S = 4, T = 16;
    int32_t *tok = tu_random_tokens(5, S * T, c->vocab);
    collect ref;
    bk_bwd_flow_stats sref;
    run_flow(m, tok, S, T, BK_FLOW_NAIVE, 1, 2, NULL, &ref, &sref);
    bk_gbwd_opts g64 = {1, 0, 0, 0};
    for (int leaf = 2; leaf <= 5; leaf++) {
        for (int k = 0; k < 2; k++) {
            bk_bwd_flow_kind kind = k ? BK_FLOW_NAIVE : BK_FLOW_HALVING;
            collect gpu, cpu;
            bk_bwd_flow_stats sg, sc;
            run_flow(m, tok, S, T, kind, leaf, 2, NULL, &cpu, &sc);
            run_flow(m, tok, S, T, kind, leaf, 2, &g64, &gpu, &sg);
            char what[96];
            snprintf(what, sizeof what, "GPU fp64 %s leaf %d vs CPU naive leaf 1",
                     bk_bwd_flow_name(kind), leaf);
            cmp_taps(what, &gpu, &ref, TOL_FP64);
            assert_int_equal(sg.passes, sc.passes);
            assert_int_equal(sg.max_depth, sc.max_depth);
            assert_int_equal(sg.layer_forwards, sc.layer_forwards);
            assert_int_equal(sg.layer_backwards, sc.layer_backwards);
            assert_true(sg.peak_boundary_bytes == sc.peak_boundary_bytes);
            collect_free(&gpu);
            collect_free(&cpu);
        }
        /* device Grams with leaves of several layers */
        gcollect gk;
        run_grams(m, tok, S, T, BK_FLOW_HALVING, leaf, 2, &g64, 1, &gk);
        cmp_gram_factors("GPU fp64 leaf", m, &gk, &ref, 1, TOL_FACTOR_FP64);
        gcollect_free(&gk);
    }
    collect_free(&ref);
    free(tok);
    bk_model_close(m);
}

/* ------------------------------------------------------------ head */

/* label lies in [CDF(label - 1), CDF(label)] of row h's softmax at u (1e-5) */
static void check_cdf(const bk_model *m, const double *h, int32_t label, double u)
{
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t d = c->hidden, V = c->vocab;
    assert_true(label >= 0 && label < V);
    const bk_tensor_info *nt = bk_model_find(m, -1, "norm.weight");
    const bk_tensor_info *wt =
        bk_model_find(m, -1, c->tie_embeddings ? "embed_tokens.weight" : "lm_head.weight");
    assert_true(nt && wt);
    float *nw = malloc((size_t)d * sizeof(float)), *W = malloc((size_t)(V * d) * sizeof(float));
    double *l = malloc((size_t)V * sizeof(double));
    assert_true(nw && W && l);
    assert_int_equal(bk_tensor_to_f32(nt, nw), BK_OK);
    assert_int_equal(bk_tensor_to_f32(wt, W), BK_OK);
    double ss = 0;
    for (int64_t k = 0; k < d; k++)
        ss += h[k] * h[k];
    const double inv = 1.0 / sqrt(ss / (double)d + c->rms_eps);
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
        double acc = 0;
        for (int64_t k = 0; k < d; k++)
            acc += (double)nw[k] * (h[k] * inv) * (double)W[v * d + k];
        l[v] = acc;
        mx = fmax(mx, acc);
    }
    double z = 0, below = 0;
    for (int64_t v = 0; v < V; v++)
        z += exp(l[v] - mx);
    for (int64_t v = 0; v < label; v++)
        below += exp(l[v] - mx) / z;
    const double p = exp(l[label] - mx) / z;
    if (!(below <= u + 1e-5 && u <= below + p + 1e-5))
        fail_msg("GPU label %d has CDF [%.9g, %.9g], uniform %.9g", (int)label, below, below + p,
                 u);
    free(nw);
    free(W);
    free(l);
}

static void head_model(const char *name)
{
    bk_model *m = tu_open_model(name);
    const bk_model_config *c = bk_model_get_config(m);
    /* 16640 rows: the CPU's (and GPU's) logit blocks are 4M / 16640 = 252
     * vocabulary entries, so V = 256..320 takes two blocks */
    const int64_t S = 130, T = 128, N = S * T, d = c->hidden, V = c->vocab;
    int64_t vc = ((int64_t)1 << 22) / N;
    assert_true(vc < V);
    double *h = malloc((size_t)(N * d) * sizeof(double));
    double *dh_c = malloc((size_t)(N * d) * sizeof(double));
    double *dh_g = malloc((size_t)(N * d) * sizeof(double));
    int32_t *lab_c = malloc((size_t)N * sizeof(int32_t)), *lab_g = malloc((size_t)N * sizeof(int32_t));
    int32_t *tok = tu_random_tokens(9, N, V);
    assert_true(h && dh_c && dh_g && lab_c && lab_g);
    bk_rng rg;
    bk_rng_seed(&rg, 17);
    for (int64_t i = 0; i < N * d; i++)
        h[i] = 4.0 * ((double)(bk_rng_next(&rg) >> 11) * 0x1.0p-53 - 0.5);
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    const uint64_t seed = 7;
    const int64_t seq0 = 3;
    assert_int_equal(bk_bwd_labels(bw, m, h, tok, S, seq0, BK_FISHER_MODEL, seed, lab_c), BK_OK);
    for (int fp64 = 1; fp64 >= 0; fp64--) {
        bk_gbwd_opts go = {fp64, 0, 0, 0};
        double loss_g = 0, loss_c = 0;
        if (bk__cuda_bwd_head(g_gpu, m, &go, T, h, tok, S, seq0, BK_FISHER_MODEL, seed, lab_g,
                              dh_g, &loss_g) != BK_OK)
            fail_msg("%s", bk_last_error());
        int differ = 0;
        for (int64_t r = 0; r < N; r++)
            differ += lab_g[r] != lab_c[r];
        if (differ > (fp64 ? 0 : 2))
            fail_msg("%s %s: %d of %lld sampled labels differ from the CPU's", name,
                     fp64 ? "fp64" : "fp32", differ, (long long)N);
        /* the CPU head with the GPU's labels */
        assert_int_equal(bk_bwd_head(bw, m, h, lab_g, S, dh_c, &loss_c), BK_OK);
        double tol = fp64 ? TOL_FP64 : TOL_FP32;
        double el = fabs(loss_g - loss_c) / fabs(loss_c);
        double ed = tu_rel_err_d(dh_g, dh_c, N * d);
        if (!(el <= (fp64 ? 1e-12 : 1e-5)) || !(ed <= tol))
            fail_msg("%s %s head: loss %.12g vs CPU %.12g (rel %.3g), dL/dh rel %.3g (tol %g)",
                     name, fp64 ? "fp64" : "fp32", loss_g, loss_c, el, ed, tol);
        if (verbose())
            fprintf(stderr,
                    "  head %s %s: %d labels differ, loss rel %.3g, dL/dh rel %.3g (tol %g)\n",
                    name, fp64 ? "fp64" : "fp32", differ, el, ed, tol);
    }
    /* where an fp32 label differs from the CPU's, it lies in its own CDF
     * interval of the double softmax of the row's logits, within 1e-5 */
    for (int64_t r = 0; r < N; r++)
        if (lab_g[r] != lab_c[r])
            check_cdf(m, h + r * d, lab_g[r], bk__bwd_uniform(seed, seq0 + r / T, r % T));
    /* the empirical Fisher: the next tokens */
    {
        bk_gbwd_opts go = {0, 0, 0, 0};
        double loss = 0;
        assert_int_equal(bk__cuda_bwd_head(g_gpu, m, &go, T, h, tok, S, seq0,
                                           BK_FISHER_EMPIRICAL, seed, lab_g, NULL, &loss),
                         BK_OK);
        for (int64_t r = 0; r < N; r++)
            assert_int_equal(lab_g[r], r % T == T - 1 ? -1 : tok[r + 1]);
        double lc = 0;
        assert_int_equal(bk_bwd_head(bw, m, h, lab_g, S, NULL, &lc), BK_OK);
        assert_true(fabs(loss - lc) <= 1e-5 * fabs(lc));
    }
    bk_bwd_free(bw);
    free(h);
    free(dh_c);
    free(dh_g);
    free(lab_c);
    free(lab_g);
    free(tok);
    bk_model_close(m);
}

static void test_head_llama3(void **state)
{
    (void)state;
    head_model("tiny-llama3"); /* lm_head */
}

static void test_head_qwen2(void **state)
{
    (void)state;
    head_model("tiny-qwen2"); /* tied embeddings */
}

/* ------------------------------------------------------------ bad input */

static bk_status noop_grads(void *u, int l, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    (void)u;
    (void)l;
    (void)s0;
    (void)S;
    (void)t;
    return BK_OK;
}

static void test_bad_inputs(void **state)
{
    (void)state;
    bk_model *m = tu_open_model("kerneldocs-1.6m");
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t S = 2, T = 8;
    int32_t *tok = tu_random_tokens(1, S * T, c->vocab);
    bk_bwd_flow_cb cb = {NULL, NULL, noop_grads, NULL, NULL, 0, NULL, NULL, NULL};
    bk_bwd_flow_stats st;
    bk_gbwd_opts go = {0, 0, 0, 0};
    bk_bwd_flow_opts o = {BK_FLOW_HALVING, 1, BK_FISHER_MODEL, 0, 2, 0, 0};
    /* a token out of range: the CPU's status */
    tok[3] = (int32_t)c->vocab;
    bk_status sc = bk_bwd_flow_run(m, tok, S, T, &o, &cb, &st);
    bk_status sg = bk_cuda_bwd_flow_run(g_gpu, m, tok, S, T, &o, &go, &cb, &st);
    assert_int_not_equal(sc, BK_OK);
    assert_int_equal(sg, sc);
    tok[3] = 0;
    /* leaf 0 */
    o.leaf = 0;
    assert_int_equal(bk_cuda_bwd_flow_run(g_gpu, m, tok, S, T, &o, &go, &cb, &st),
                     BK_ERR_INVALID_ARG);
    o.leaf = 1;
    /* the empirical Fisher with one token per sequence */
    o.fisher = BK_FISHER_EMPIRICAL;
    sc = bk_bwd_flow_run(m, tok, S * T, 1, &o, &cb, &st);
    sg = bk_cuda_bwd_flow_run(g_gpu, m, tok, S * T, 1, &o, &go, &cb, &st);
    assert_int_equal(sg, sc);
    assert_int_equal(sg, BK_ERR_CALIB);
    o.fisher = BK_FISHER_MODEL;
    /* device memory too small: BK_ERR_DEVICE_OOM naming --batch */
    {
        bk_backend_params bp;
        bk_backend_params_default(&bp);
        bp.mem_limit = 100000;
        bk_backend *small = NULL;
        bk_status s = bk_backend_create_params(BK_BACKEND_CUDA, &bp, &small);
        assert_int_equal(s, BK_OK);
        sg = bk_cuda_bwd_flow_run(small, m, tok, S, T, &o, &go, &cb, &st);
        assert_int_equal(sg, BK_ERR_DEVICE_OOM);
        assert_non_null(strstr(bk_last_error(), "--batch"));
        assert_null(strchr(bk_last_error(), '\n'));
        bk_backend_destroy(small);
    }
    free(tok);
    bk_model_close(m);
}

int main(void)
{
    int rc0 = tu_gpu_begin(&g_gpu);
    if (rc0)
        return rc0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_head_llama3),     cmocka_unit_test(test_head_qwen2),
        cmocka_unit_test(test_flow_llama3),     cmocka_unit_test(test_flow_qwen2),
        cmocka_unit_test(test_flow_qwen3),      cmocka_unit_test(test_flow_kerneldocs),
        cmocka_unit_test(test_flow_leaf),       cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_flow_syn_hd64),   cmocka_unit_test(test_flow_syn_hd128),
    };
    int rc = cmocka_run_group_tests_name("cuda_backward", tests, NULL, NULL);
    bk_backend_destroy(g_gpu);
    return rc;
}
#endif
