/* One parity test over the backend table (suite cuda; exit 77 = skipped
 * without a GPU): every operation of src/backend_impl.h run on every
 * available backend against the CPU backend (the oracle), with a named
 * tolerance per operation. An operation a backend has no entry for is
 * printed as "not supported" (the driver runs the CPU's) and skipped.
 *
 *   op                tolerance (named below)
 *   solve             TOL_SOLVE_FP64: identical codes in fp64, also under the
 *                     solver variants the product never runs (overlap off,
 *                     push groups off) and with setting factor_fp64=1
 *   layer_fwd nll     TOL_NLL: |nll_gpu - nll_cpu| <= 1e-5 * nll_cpu (bk_backend_model_nll:
 *                     the layer driver over layer_run, then nll)
 *   layer_fwd logits  TOL_LOGITS: max |diff| <= 1e-4 * max |logit| (bk_backend_model_logits)
 *   layer_fwd taps    TOL_TAPS: per tap and layer, max |diff| <= 1e-4 * max |value|
 * The quantize stages (stages_create) are compared end to end by
 * tests/test_cuda_pipeline.sh (codes of every Hessian kind, the settings
 * residual=host and keep_down=0 included).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "test_solver_util.h"
#include "test_util.h"

#define TOL_SOLVE_FP64 0.0
#define TOL_NLL 1e-5
#define TOL_LOGITS 1e-4
#define TOL_TAPS 1e-4

static int g_fail;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                          \
            printf("\n");                                                                          \
            g_fail = 1;                                                                            \
        }                                                                                          \
    } while (0)

#define OK(call)                                                                                   \
    do {                                                                                           \
        bk_status s_ = (call);                                                                     \
        if (s_ != BK_OK) {                                                                         \
            printf("FAIL: %s: %s\n", #call, bk_last_error());                                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* ------------------------------------------------------------------ solve */

static void solve_case(bk_backend *cpu, bk_backend *dev, const char *what)
{
    static const int64_t shapes[][2] = {{7, 13}, {64, 64}, {130, 65}, {200, 256}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t m = shapes[s][0], n = shapes[s][1];
        double *W = test_weights(m, n, 1000 + s, 0.1), *A = test_spd(n, 1001 + s, 0.05),
               *B = test_spd(m, 1002 + s, 0.05);
        bk_solve_opts o;
        bk_solve_opts_default(&o);
        o.precision = BK_PREC_FP64;
        bk_solve_problem p = {.m = m, .n = n, .dtype = BK_DT_F64, .W = W, .A = A, .B = B,
                              .label_w = "W", .label_a = "A", .label_b = "B"};
        bk_solve_result rc, rg;
        OK(bk_backend_solve(cpu, &p, &o, &rc));
        OK(bk_backend_solve(dev, &p, &o, &rg));
        int64_t diff = 0;
        for (int64_t t = 0; t < m * n; t++)
            diff += rc.codes[t] != rg.codes[t];
        CHECK((double)diff <= TOL_SOLVE_FP64 * (double)(m * n),
              "solve %s %lldx%lld: %lld codes differ", what, (long long)m, (long long)n,
              (long long)diff);
        bk_solve_result_free(&rc);
        bk_solve_result_free(&rg);
        free(W);
        free(A);
        free(B);
    }
    printf("solve (%s): checked\n", what);
}

static void test_solve(bk_backend *cpu, bk_backend *dev)
{
    solve_case(cpu, dev, "defaults");
    /* the variants the product never runs: no overlapped pushes, eager pushes */
    bk_cuda_tuning t;
    bk_cuda_tuning_default(&t);
    t.overlap = 0;
    bk_backend *v = NULL;
    OK(bk_backend_create(BK_BACKEND_CUDA, &v));
    OK(bk_cuda_backend_tune(v, &t));
    solve_case(cpu, v, "no overlap");
    t.push_group = 0;
    OK(bk_cuda_backend_tune(v, &t));
    solve_case(cpu, v, "eager pushes");
    bk_backend_destroy(v);
    /* setting factor_fp64=1 (a no-op for fp64 problems: the same codes) */
    bk_backend_params bp;
    bk_backend_params_default(&bp);
    bp.factor_fp64 = 1;
    OK(bk_backend_create_params(BK_BACKEND_CUDA, &bp, &v));
    solve_case(cpu, v, "factor_fp64=1");
    bk_backend_destroy(v);
}

/* ------------------------------------------------ whole model (the head) */

static void test_model(bk_backend *cpu, bk_backend *dev, const bk_model *m, const int32_t *tok,
                       int64_t S, int64_t T)
{
    if (!bk_backend_supports(dev, BK_OP_LAYER_FWD)) {
        printf("layer_fwd nll, logits: not supported by %s\n", bk_backend_name(dev));
        return;
    }
    double nc = 0, ng = 0;
    int64_t cc = 0, cg = 0;
    OK(bk_backend_model_nll(cpu, m, tok, S, T, 0, &nc, &cc));
    OK(bk_backend_model_nll(dev, m, tok, S, T, 0, &ng, &cg));
    CHECK(cc == cg, "model_nll: counts %lld vs %lld", (long long)cc, (long long)cg);
    CHECK(fabs(ng - nc) <= TOL_NLL * fabs(nc), "model_nll: %.9g vs %.9g (TOL_NLL %g)", ng, nc,
          TOL_NLL);
    printf("model_nll: cpu %.9g %s %.9g\n", nc, bk_backend_name(dev), ng);
    const int64_t V = bk_model_get_config(m)->vocab;
    float *lc = malloc(sizeof(float) * (size_t)(S * T * V));
    float *lg = malloc(sizeof(float) * (size_t)(S * T * V));
    if (!lc || !lg)
        exit(1);
    OK(bk_backend_model_logits(cpu, m, tok, S, T, lc));
    OK(bk_backend_model_logits(dev, m, tok, S, T, lg));
    double e = tu_rel_err_f(lg, lc, (size_t)(S * T * V));
    CHECK(e <= TOL_LOGITS, "model_logits: relative error %.3g (TOL_LOGITS %g)", e, TOL_LOGITS);
    printf("model_logits: relative error %.3g\n", e);
    free(lc);
    free(lg);
}

/* ------------------------------------------- the layer forward with taps */

static void test_layer_fwd(bk_backend *cpu, bk_backend *dev, const bk_model *m,
                           const int32_t *tok, int64_t S, int64_t T)
{
    if (!bk_backend_supports(dev, BK_OP_LAYER_FWD)) {
        printf("layer_fwd: not supported by %s\n", bk_backend_name(dev));
        return;
    }
    const bk_model_config *c = bk_model_get_config(m);
    const int64_t N = S * T, B = 2 < S ? 2 : S;
    const int64_t widths[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    bk_backend *be[2] = {cpu, dev};
    const bk_layer_fwd_ops *ops[2];
    void *ctx[2];
    float *taps[2][4];
    for (int k = 0; k < 2; k++) {
        const bk_layer_fwd_params p = {.model = m, .S = S, .T = T, .batch = B, .taps = 1,
                                       .what = "test"};
        int64_t used = 0;
        OK(bk_backend_layer_fwd_create(be[k], &p, &used, &ops[k], &ctx[k]));
        CHECK(used == B, "layer_fwd: batch %lld used for %lld", (long long)used, (long long)B);
        for (int i = 0; i < 4; i++)
            if (!(taps[k][i] = malloc(sizeof(float) * (size_t)(N * widths[i]))))
                exit(1);
        for (int64_t s0 = 0; s0 < S; s0 += B)
            OK(ops[k]->embed(ctx[k], tok, s0, S - s0 < B ? S - s0 : B));
        ops[k]->embed_end(ctx[k]);
    }
    static const char *const names[4] = {"attn_in", "o_in", "mlp_in", "down_in"};
    const int layers = c->n_layers < 3 ? (int)c->n_layers : 3;
    for (int l = 0; l < layers; l++) {
        bk_layer_weights lw;
        memset(&lw, 0, sizeof lw);
        OK(bk_layer_weights_load(m, l, &lw));
        for (int k = 0; k < 2; k++) {
            OK(ops[k]->layer_begin(ctx[k], &lw));
            for (int64_t s0 = 0; s0 < S; s0 += B) {
                float *const t[4] = {taps[k][0] + s0 * T * widths[0],
                                     taps[k][1] + s0 * T * widths[1],
                                     taps[k][2] + s0 * T * widths[2],
                                     taps[k][3] + s0 * T * widths[3]};
                OK(ops[k]->layer_taps(ctx[k], s0, S - s0 < B ? S - s0 : B, t));
            }
            OK(ops[k]->layer_end(ctx[k]));
        }
        bk_layer_weights_free(&lw);
        for (int i = 0; i < 4; i++) {
            double e = tu_rel_err_f(taps[1][i], taps[0][i], (size_t)(N * widths[i]));
            CHECK(e <= TOL_TAPS, "layer_fwd layer %d %s: relative error %.3g (TOL_TAPS %g)", l,
                  names[i], e, TOL_TAPS);
            printf("layer_fwd layer %d %s: relative error %.3g\n", l, names[i], e);
        }
    }
    for (int k = 0; k < 2; k++) {
        ops[k]->destroy(ctx[k]);
        for (int i = 0; i < 4; i++)
            free(taps[k][i]);
    }
}

int main(void)
{
    if (bk_cuda_device_count() == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return 77;
    }
    const char *root = getenv("BK_SOURCE_ROOT");
    char dir[4096], calib[4200];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", root ? root : ".");
    snprintf(calib, sizeof calib, "%s/calib.safetensors", dir);
    bk_backend *cpu = NULL, *dev = NULL;
    OK(bk_backend_create(BK_BACKEND_CPU, &cpu));
    OK(bk_backend_create(BK_BACKEND_CUDA, &dev));
    bk_backend_set_gemm_math(dev, BK_GEMM_FP32); /* the CPU's arithmetic */
    test_solve(cpu, dev);
    bk_model *m = NULL;
    OK(bk_model_open(dir, &m));
    int32_t *tok = NULL;
    int64_t S = 0, T = 0;
    OK(bk_load_tokens(calib, bk_model_get_config(m)->vocab, 5, 64, &tok, &S, &T));
    test_model(cpu, dev, m, tok, S, T);
    test_layer_fwd(cpu, dev, m, tok, S, T);
    printf("stages: compared end to end by tests/test_cuda_pipeline.sh\n");
    free(tok);
    bk_model_close(m);
    bk_backend_destroy(dev);
    bk_backend_destroy(cpu);
    printf("%s\n", g_fail ? "FAILED" : "ok");
    return g_fail ? 1 : 0;
}
