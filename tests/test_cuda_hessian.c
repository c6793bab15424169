/* GPU Hessian accumulation (cuda/hessian.cu) against the CPU accumulators,
 * the oracle (src/hessian.c, tested against brute-force constructions in
 * test_hessian.c). Suite cuda; exit 77 = skipped without a GPU.
 *
 * The same micro-batches (real activations: the CPU forward pass of the
 * golden inputs through the models of tests/data/models and the kerneldocs
 * example, two micro-batches per layer) go to both accumulators; every
 * module's A and B (and, for the Shampoo kinds, the plain E[x xᵀ] that the
 * pipeline's GPTQ loss uses) must agree within 1e-4 relative
 * (max |gpu - cpu| / max |cpu|), for every --hessian kind, F32 and F64
 * accumulation, with and without q_norm/k_norm, biases, GQA. Bad inputs give
 * the CPU's statuses.
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
#include "bakron/hessian.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"
#include "bk_config.h"
#include "pipeline_gpu.h"
#include "test_cm_util.h"

#if !BK_HAVE_CUDA
int main(void)
{
    fprintf(stderr, "no CUDA backend in this build: skipped\n");
    return 77;
}
#else

#define TOL 1e-4

static bk_backend *g_gpu;

/* One layer's calibration activations of a model (CPU forward of the golden
 * input, layers before `layer` run in full). */
typedef struct acts {
    bk_model *m;
    const bk_model_config *c;
    int64_t B, T, N;
    bk_layer_weights lw;
    float *attn_in, *o_in, *mlp_in, *down_in, *q_rot, *k_rot;
} acts;

static void acts_make(const char *dir, const char *golden, int layer, acts *a)
{
    memset(a, 0, sizeof *a);
    if (bk_model_open(dir, &a->m) != BK_OK)
        fail_msg("%s: %s", dir, bk_last_error());
    a->c = bk_model_get_config(a->m);
    bk_st_file *g = NULL;
    if (bk_st_open(golden, &g) != BK_OK)
        fail_msg("%s: %s", golden, bk_last_error());
    const bk_tensor_info *t = bk_st_find(g, "input_ids");
    assert_non_null(t);
    a->B = t->shape[0];
    a->T = t->shape[1];
    a->N = a->B * a->T;
    const int64_t H = a->c->hidden, qd = a->c->n_heads * a->c->head_dim;
    const int64_t kd = a->c->n_kv_heads * a->c->head_dim, N = a->N;
    bk_fwd *f = NULL;
    OKS(bk_fwd_create(a->c, a->B, a->T, &f));
    float *h = tu_hbuf(N * H);
    OKS(bk_fwd_embed(f, a->m, (const int32_t *)t->data, a->B, h));
    bk_st_close(g);
    for (int L = 0; L < layer; L++) {
        bk_layer_weights lw;
        OKS(bk_layer_weights_load(a->m, L, &lw));
        OKS(bk_fwd_layer(f, &lw, a->B, h, NULL));
        bk_layer_weights_free(&lw);
    }
    OKS(bk_layer_weights_load(a->m, layer, &a->lw));
    a->attn_in = tu_hbuf(N * H);
    a->o_in = tu_hbuf(N * qd);
    a->mlp_in = tu_hbuf(N * H);
    a->down_in = tu_hbuf(N * a->c->intermediate);
    a->q_rot = tu_hbuf(N * qd);
    a->k_rot = tu_hbuf(N * kd);
    bk_layer_taps tp = {a->attn_in, a->o_in, a->mlp_in, a->down_in, a->q_rot, a->k_rot};
    OKS(bk_fwd_layer(f, &a->lw, a->B, h, &tp));
    free(h);
    bk_fwd_free(f);
}

static void acts_free(acts *a)
{
    bk_layer_weights_free(&a->lw);
    free(a->attn_in);
    free(a->o_in);
    free(a->mlp_in);
    free(a->down_in);
    free(a->q_rot);
    free(a->k_rot);
    bk_model_close(a->m);
}

/* Both accumulators fed the same two micro-batches; every factor compared. */
static double compare_kind(const acts *a, bk_hessian_kind kind, int fp64)
{
    const bk_model_config *c = a->c;
    const int64_t H = c->hidden, qd = c->n_heads * c->head_dim;
    const int64_t kd = c->n_kv_heads * c->head_dim, I = c->intermediate, T = a->T;
    const int shampoo = kind == BK_HESS_MLPLOCAL_SHAMPOO || kind == BK_HESS_FULLYLOCAL_SHAMPOO;
    const int fully = kind == BK_HESS_FULLYLOCAL_KFAC || kind == BK_HESS_FULLYLOCAL_SHAMPOO;
    const int64_t B1 = a->B > 1 ? a->B / 2 : 1, B2 = a->B - B1;
    bk_hess_acc *cpu = NULL, *plain = NULL;
    OKS(bk_hess_acc_create(c, kind, fp64, T, &cpu));
    if (shampoo)
        OKS(bk_hess_acc_create(c, BK_HESS_GPTQ, fp64, T, &plain));
    bk_gfwd *gf = NULL;
    bk_ghess *gpu = NULL;
    OKS(bk_gfwd_create(g_gpu, c, B1 > B2 ? B1 : B2, T, &gf));
    OKS(bk_ghess_create(gf, kind, fp64, shampoo, &gpu));
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &a->lw, &gl));
    const int64_t R = (B1 > B2 ? B1 : B2) * T;
    float *dx = tu_dbuf(gf, R * H), *dq = tu_dbuf(gf, R * qd), *dk = tu_dbuf(gf, R * kd);
    float *dob = tu_dbuf(gf, R * qd), *dm = tu_dbuf(gf, R * H), *dd = tu_dbuf(gf, R * I);
    for (int part = 0; part < 2; part++) {
        const int64_t s0 = part ? B1 : 0, sb = part ? B2 : B1, r0 = s0 * T, nr = sb * T;
        if (sb < 1)
            continue;
        const float *x = a->attn_in + r0 * H, *q = a->q_rot + r0 * qd, *k = a->k_rot + r0 * kd;
        const float *o = a->o_in + r0 * qd, *mi = a->mlp_in + r0 * H, *di = a->down_in + r0 * I;
        for (int p = 0; p < 2; p++) {
            bk_hess_acc *acc = p ? plain : cpu;
            if (!acc)
                continue;
            OKS(bk_hess_add_attn(acc, &a->lw, x, fully && !p ? q : NULL, fully && !p ? k : NULL,
                                 sb));
            OKS(bk_hess_add_o(acc, o, sb));
            OKS(bk_hess_add_mlp(acc, &a->lw, mi, sb));
            OKS(bk_hess_add_down(acc, di, sb));
        }
        tu_up(gf, dx, x, nr * H);
        tu_up(gf, dq, q, nr * qd);
        tu_up(gf, dk, k, nr * kd);
        tu_up(gf, dob, o, nr * qd);
        tu_up(gf, dm, mi, nr * H);
        tu_up(gf, dd, di, nr * I);
        OKS(bk_ghess_add_attn(gpu, gl, dx, fully ? dq : NULL, fully ? dk : NULL, sb));
        OKS(bk_ghess_add_o(gpu, dob, sb));
        OKS(bk_ghess_add_mlp(gpu, gl, dm, sb));
        OKS(bk_ghess_add_down(gpu, dd, sb));
    }
    double worst = 0;
    const char *wm = "";
    for (int mi = 0; mi < BK_MOD_COUNT; mi++) {
        bk_module mod = (bk_module)mi;
        int64_t m, n;
        bk_module_shape(c, mod, &m, &n);
        const float *A = NULL, *B = NULL, *gA = NULL, *gB = NULL, *gP = NULL, *P = NULL;
        OKS(bk_hess_factors(cpu, &a->lw, mod, &A, &B));
        OKS(bk_ghess_factors(gpu, gl, mod, &gA, &gB, &gP));
        if (kind == BK_HESS_RTN) {
            assert_null(gA);
            assert_null(gB);
            continue;
        }
        assert_non_null(gA);
        assert_int_equal(B == NULL, gB == NULL);
        double e = tu_rel_err_f(gA, A, (size_t)(n * n));
        if (B) {
            double eb = tu_rel_err_f(gB, B, (size_t)(m * m));
            e = eb > e ? eb : e;
        }
        const float *dummy = NULL;
        if (plain)
            OKS(bk_hess_factors(plain, &a->lw, mod, &P, &dummy));
        else
            P = A;
        assert_non_null(gP);
        double ep = tu_rel_err_f(gP, P, (size_t)(n * n));
        e = ep > e ? ep : e;
        if (!(e <= worst)) {
            worst = isnan(e) ? INFINITY : e;
            wm = bk_module_name(mod);
        }
    }
    printf("    %-20s %s: worst %.3e (%s)\n", bk_hessian_name(kind), fp64 ? "fp64" : "fp32",
           worst, wm);
    float *bufs[] = {dx, dq, dk, dob, dm, dd};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        bk_gpu_free(gf, bufs[i]);
    bk_glayer_free(gf, gl);
    bk_ghess_free(gpu);
    bk_gfwd_free(gf);
    bk_hess_acc_free(cpu);
    bk_hess_acc_free(plain);
    return worst;
}

static void every_kind(const char *label, const char *dir, const char *golden, int layer)
{
    acts a;
    acts_make(dir, golden, layer, &a);
    printf("  %s layer %d (%lld x %lld tokens)\n", label, layer, (long long)a.B, (long long)a.T);
    double worst = 0;
    for (int k = 0; k <= BK_HESS_FULLYLOCAL_SHAMPOO; k++) { /* backprop: CPU only so far */
        double e = compare_kind(&a, (bk_hessian_kind)k, 0);
        worst = e > worst ? e : worst;
    }
    double e = compare_kind(&a, BK_HESS_FULLYLOCAL_SHAMPOO, 1);
    worst = e > worst ? e : worst;
    e = compare_kind(&a, BK_HESS_MLPLOCAL_KFAC, 1);
    worst = e > worst ? e : worst;
    acts_free(&a);
    assert_true(worst <= TOL);
}

static void golden_model(const char *model, int layer)
{
    char dir[1024], gp[1100];
    snprintf(dir, sizeof dir, "%s/models/%s", tu_env_or("BK_TEST_DATA", "tests/data"), model);
    snprintf(gp, sizeof gp, "%s/golden.safetensors", dir);
    every_kind(model, dir, gp, layer);
}

static void test_tiny_llama3(void **state)
{
    (void)state;
    golden_model("tiny-llama3", 1);
}

static void test_tiny_qwen2(void **state)
{
    (void)state;
    golden_model("tiny-qwen2", 1);
}

static void test_tiny_qwen3(void **state)
{
    (void)state;
    golden_model("tiny-qwen3", 2);
}

static void test_kerneldocs(void **state)
{
    (void)state;
    char dir[1024], gp[1024];
    tu_kerneldocs_paths(dir, sizeof dir, gp, sizeof gp);
    every_kind("kerneldocs-1.6m", dir, gp, 3);
}

static void test_bad_inputs(void **state)
{
    (void)state;
    char dir[1024], gp[1100];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", tu_env_or("BK_TEST_DATA", "tests/data"));
    snprintf(gp, sizeof gp, "%s/golden.safetensors", dir);
    acts a;
    acts_make(dir, gp, 0, &a);
    const int64_t H = a.c->hidden, N = a.N;
    bk_gfwd *gf = NULL;
    bk_ghess *acc = NULL;
    OKS(bk_gfwd_create(g_gpu, a.c, a.B, a.T, &gf));
    OKS(bk_ghess_create(gf, BK_HESS_FULLYLOCAL_KFAC, 0, 0, &acc));
    bk_glayer *gl = NULL;
    OKS(bk_glayer_upload(gf, &a.lw, &gl));
    const float *A = NULL, *B = NULL;
    /* factors before any add */
    assert_int_equal(bk_ghess_factors(acc, gl, BK_MOD_Q, &A, &B, NULL), BK_ERR_CALIB);
    float *dx = tu_dbuf(gf, N * H);
    /* a NaN in the activations, named by row and column */
    float keep = a.attn_in[5 * H + 7];
    a.attn_in[5 * H + 7] = NAN;
    tu_up(gf, dx, a.attn_in, N * H);
    assert_int_equal(bk_ghess_add_mlp(acc, gl, dx, a.B), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "row 5, column 7"));
    a.attn_in[5 * H + 7] = keep;
    tu_up(gf, dx, a.attn_in, N * H);
    /* fully-local needs the rotated queries and keys */
    assert_int_equal(bk_ghess_add_attn(acc, gl, dx, NULL, NULL, a.B), BK_ERR_INVALID_ARG);
    /* too many sequences */
    assert_int_equal(bk_ghess_add_mlp(acc, gl, dx, a.B + 1), BK_ERR_INVALID_ARG);
    /* weights of another layer after an add */
    OKS(bk_ghess_add_mlp(acc, gl, dx, a.B));
    bk_layer_weights other = a.lw;
    other.layer = 1;
    bk_glayer *g2 = NULL;
    OKS(bk_glayer_upload(gf, &other, &g2));
    assert_int_equal(bk_ghess_add_mlp(acc, g2, dx, a.B), BK_ERR_INVALID_ARG);
    bk_ghess_reset(acc);
    OKS(bk_ghess_add_mlp(acc, g2, dx, a.B));
    bk_glayer_free(gf, g2);
    bk_gpu_free(gf, dx);
    bk_glayer_free(gf, gl);
    bk_ghess_free(acc);
    bk_gfwd_free(gf);
    acts_free(&a);
}

int main(void)
{
    int rc0 = tu_gpu_begin(&g_gpu);
    if (rc0)
        return rc0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_llama3), cmocka_unit_test(test_tiny_qwen2),
        cmocka_unit_test(test_tiny_qwen3),  cmocka_unit_test(test_kerneldocs),
        cmocka_unit_test(test_bad_inputs),
    };
    int rc = cmocka_run_group_tests_name("cuda_hessian", tests, NULL, NULL);
    bk_backend_destroy(g_gpu);
    return rc;
}
#endif
