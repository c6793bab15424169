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
 *   stages            the quantize stages (stages_create), driven operation by
 *                     operation as src/quantize_layers.c drives them: CPU and
 *                     GPU stages of the same job get the same calibration
 *                     micro-batches and, after every solve, the same quantized
 *                     weight (weight_updated), so that every layer sees the
 *                     same weights on both; per Hessian kind (all eight, fp32
 *                     and fp64 accumulation) and per variant (keep_down=0:
 *                     recomputed down_proj inputs; residual=host; solver
 *                     overlap off; factor_fp64=1 with fp32 solves;
 *                     --no-sequential: stage TAPS):
 *     factors A, B, A_plain  TOL_FACTORS: max |gpu - cpu| / max |cpu| <= 1e-3
 *                     per module. Not the 1e-10 of an fp64 solve: the factors
 *                     are F32 arrays on both backends (7 digits at best), and
 *                     their inputs come from each backend's own forward pass
 *                     (F32 GEMMs in another summation order, TOL_TAPS 1e-4 per
 *                     tap) over up to four layers; a Gram doubles an input's
 *                     relative error, and the accumulators alone already differ
 *                     by up to 1e-4 on identical inputs (tests/test_cuda_hessian.c).
 *                     A wrong factor (a missing micro-batch, a wrong stage
 *                     input, another layer's weights) is off by 1e-2 or more.
 *     sums            TOL_SUMS (= TOL_FACTORS: the factors are the sums / N):
 *                     the running sums the MPI collectives exchange, buffer by
 *                     buffer in the order the stages hand them out (square
 *                     Grams: their upper triangle); where the two layouts
 *                     differ by design (the Shampoo kinds: the CPU keeps the
 *                     plain E[x xᵀ] in a second accumulator; a buffer of
 *                     another size: the GPU's q blocks per KV head) that is
 *                     printed, not compared
 *     solve_dev       TOL_CODES_FP64: the device solve from the GPU stages'
 *                     device factors (factors_dev) gives exactly the codes of
 *                     the CPU solve of the same factors (the GPU stages' host
 *                     copy, factors) in fp64; TOL_CODES_FP32: at most 1% of
 *                     a module's codes differ in fp32 (the fp32 parity of
 *                     tests/test_cuda_parity.c); its loss_gptq tr(E A_plain Eᵀ)
 *                     within TOL_LOSS_GPTQ 1e-6 of a host double computation
 *     bwd_flow_run    the backprop kinds: the CPU flow feeds the CPU stages'
 *                     layer accumulators and the GPU flow (fp64) the GPU
 *                     stages' (bp_grads), empirical Fisher (no sampled
 *                     labels); B compares the flows, A the input sides
 *     fallback        a job the GPU stages do not implement (dumped
 *                     activations): the dispatcher runs the CPU stages and
 *                     their describe says why
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_impl.h"
#include "bakron/bakron.h"
#include "bakron/backward.h"
#include "bakron/hessian.h"
#include "bakron/pipeline.h"
#include "hess_blocks.h"
#include "test_solver_util.h"
#include "test_check.h"
#include "test_util.h"

#define TOL_SOLVE_FP64 0.0
#define TOL_NLL 1e-5
#define TOL_LOGITS 1e-4
#define TOL_TAPS 1e-4
#define TOL_FACTORS 1e-3
#define TOL_SUMS TOL_FACTORS
#define TOL_CODES_FP64 0.0
#define TOL_CODES_FP32 0.01
#define TOL_LOSS_GPTQ 1e-6



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

/* ------------------------------------------------ the quantize stages */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { STAGE_BATCH = 3 }; /* sequences per micro-batch: 8 sequences in 3, 3, 2 */

typedef struct stage_case {
    const char *name;
    bk_hessian_kind kind;
    int fp64;            /* Hessians accumulated in double */
    int sequential;      /* 0: --no-sequential (stage TAPS) */
    const char *setting; /* a backend setting for both backends ("key=value") or NULL */
    int overlap_off;     /* the GPU solver without overlapped pushes */
    int solve_fp32;      /* fp32 solves (TOL_CODES_FP32) instead of fp64 */
} stage_case;

/* The largest errors of one case. */
typedef struct stage_worst {
    double A, B, P, sums, loss;
    int64_t code_diff, codes;
    int nB, nsums, sums_layout, loss_n;
    int ahead_n;            /* solves whose B the GPU stages factored ahead (prepare_next) */
    int64_t ahead_diff;     /* their codes that differ from the same solve without it */
} stage_worst;

/* The running sums handed out by a stages' sums (host copies). */
typedef struct sum_list {
    int k;
    size_t n[64];
    int f64[64];
    void *data[64];
} sum_list;

static bk_status sums_collect(void *user, void *buf, size_t n, int f64, int dev, void *stream)
{
    sum_list *l = user;
    (void)stream;
    if (dev)
        return bk_error(BK_ERR_INTERNAL, "test: a device buffer although dev 0 was asked");
    if (l->k >= 64)
        return bk_error(BK_ERR_INTERNAL, "test: more than 64 sums buffers");
    const size_t bytes = n * (f64 ? sizeof(double) : sizeof(float));
    void *c = malloc(bytes ? bytes : 1);
    if (!c)
        return bk_error(BK_ERR_NOMEM, "test: out of memory");
    memcpy(c, buf, bytes);
    l->n[l->k] = n;
    l->f64[l->k] = f64;
    l->data[l->k++] = c;
    return BK_OK;
}

static void sums_free(sum_list *l)
{
    for (int i = 0; i < l->k; i++)
        free(l->data[i]);
    l->k = 0;
}

static double buf_at(const void *p, int f64, size_t i)
{
    return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

/* max |a - b| / max |b| over n elements, or over the upper triangle of an
 * [d, d] row-major matrix when d > 0 (the Grams are accumulated there). */
static double buf_rel_err(const void *a, const void *b, size_t n, int f64, int64_t d)
{
    double md = 0.0, mb = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (d > 0 && (int64_t)(i % (size_t)d) < (int64_t)(i / (size_t)d))
            continue;
        const double x = buf_at(a, f64, i), y = buf_at(b, f64, i), e = fabs(x - y);
        if (!(e <= md))
            md = isnan(e) ? INFINITY : e;
        if (fabs(y) > mb)
            mb = fabs(y);
    }
    return mb > 0 ? md / mb : md;
}

/* The two stages' running sums of `modules` (bit m = bk_module m). */
static void compare_sums(const bk_stage_ops *oc, void *xc, const bk_stage_ops *og, void *xg,
                         unsigned modules, const bk_model_config *c, const stage_case *sc,
                         int layer, stage_worst *w)
{
    sum_list lc = {0}, lg = {0};
    OK(oc->sums(xc, modules, 0, BK_BUF_READ, sums_collect, &lc));
    OK(og->sums(xg, modules, 0, BK_BUF_READ, sums_collect, &lg));
    CHECK(lc.k == lg.k, "stages %s layer %d sums (modules 0x%x): %d buffers on the CPU, %d on "
          "the GPU", sc->name, layer, modules, lc.k, lg.k);
    const int64_t qd = c->n_heads * c->head_dim;
    for (int i = 0; i < lc.k && i < lg.k; i++) {
        if (lc.n[i] != lg.n[i] || lc.f64[i] != lg.f64[i]) {
            w->sums_layout++;
            continue;
        }
        int64_t d = 0;
        const int64_t sq[3] = {c->hidden, qd, c->intermediate};
        for (int k = 0; k < 3; k++)
            if ((size_t)(sq[k] * sq[k]) == lc.n[i])
                d = sq[k];
        const double e = buf_rel_err(lg.data[i], lc.data[i], lc.n[i], lc.f64[i], d);
        CHECK(e <= TOL_SUMS, "stages %s layer %d sums (modules 0x%x) buffer %d (%zu values): "
              "max rel %.3g (TOL_SUMS %g)", sc->name, layer, modules, i, lc.n[i], e, TOL_SUMS);
        if (!(e <= w->sums))
            w->sums = e;
        w->nsums++;
    }
    sums_free(&lc);
    sums_free(&lg);
}

static float *dup_f(const float *a, int64_t n)
{
    if (!a)
        return NULL;
    float *c = malloc(sizeof(float) * (size_t)n);
    if (!c)
        exit(1);
    memcpy(c, a, sizeof(float) * (size_t)n);
    return c;
}

static double max_of(double a, double b)
{
    return (a >= b || isnan(a)) ? a : b;
}

/* One module: the factors of both stages compared, the GPU's device solve
 * against the CPU solve of the GPU stages' factors, and the CPU's quantized
 * weight handed to both stages (the CPU stages read it from lw). */
/* next: the module solved after mod from the same sums (-1: none): the GPU
 * stages hear of it between mod's factors and its solve (prepare_next), as
 * the driver does; ahead: mod was the next of the previous call, so its
 * solve may take a B factored ahead: it is solved a second time without
 * (nothing prepared), and the two must agree bit for bit. */
static void stage_module(bk_backend *cpu, const bk_stage_ops *oc, void *xc,
                         const bk_stage_ops *og, void *xg, const bk_model_config *c,
                         const stage_case *sc, int layer, bk_module mod, int next, int ahead,
                         const bk_layer_weights *orig, bk_layer_weights *lw, stage_worst *w)
{
    int64_t mo, ni;
    bk_module_shape(c, mod, &mo, &ni);
    const char *mn = bk_module_name(mod);
    const float *Ac, *Bc, *Pc, *Ag0, *Bg0, *Pg0;
    OK(oc->factors(xc, mod, &Ac, &Bc, &Pc));
    OK(og->factors(xg, mod, &Ag0, &Bg0, &Pg0));
    float *Ag = dup_f(Ag0, ni * ni), *Bg = dup_f(Bg0, mo * mo), *Pg = dup_f(Pg0, ni * ni);
    CHECK(Ac && Ag && Pc && Pg, "stages %s layer %d %s: factors missing (cpu A %p P %p, gpu A "
          "%p P %p)", sc->name, layer, mn, (const void *)Ac, (const void *)Pc, (const void *)Ag,
          (const void *)Pg);
    CHECK(!Bc == !Bg, "stages %s layer %d %s: B on the CPU %s, on the GPU %s", sc->name, layer,
          mn, Bc ? "given" : "identity", Bg ? "given" : "identity");
    if (!Ac || !Ag || !Pc || !Pg || !Bc != !Bg)
        exit(1);
    const double eA = tu_rel_err_f(Ag, Ac, ni * ni), eP = tu_rel_err_f(Pg, Pc, ni * ni);
    CHECK(eA <= TOL_FACTORS, "stages %s layer %d %s factors A: max rel %.3g (TOL_FACTORS %g)",
          sc->name, layer, mn, eA, TOL_FACTORS);
    CHECK(eP <= TOL_FACTORS, "stages %s layer %d %s factors A_plain: max rel %.3g "
          "(TOL_FACTORS %g)", sc->name, layer, mn, eP, TOL_FACTORS);
    w->A = max_of(w->A, eA);
    w->P = max_of(w->P, eP);
    if (Bc) {
        const double eB = tu_rel_err_f(Bg, Bc, mo * mo);
        CHECK(eB <= TOL_FACTORS, "stages %s layer %d %s factors B: max rel %.3g (TOL_FACTORS "
              "%g)", sc->name, layer, mn, eB, TOL_FACTORS);
        w->B = max_of(w->B, eB);
        w->nB++;
    }

    /* the CPU solve of the GPU stages' factors, and the GPU's device solve */
    bk_solve_opts so;
    bk_solve_opts_default(&so);
    so.precision = sc->solve_fp32 ? BK_PREC_FP32 : BK_PREC_FP64;
    if (!Bg)
        so.algorithm = BK_ALG_GPTQ; /* as the driver does (src/quantize_solve.c) */
    char label[96];
    snprintf(label, sizeof label, "layer %d %s", layer, mn);
    bk_solve_problem p = {.m = mo, .n = ni, .dtype = BK_DT_F32, .W = orig->w[mod], .A = Ag,
                          .B = Bg, .label_w = label, .label_a = label, .label_b = label};
    bk_solve_result rc, rg;
    OK(bk_backend_solve(cpu, &p, &so, &rc));
    const float *dA, *dB, *dP;
    OK(og->factors_dev(xg, mod, &dA, &dB, &dP));
    if (next >= 0 && og->prepare_next) {
        bk_solve_opts on;
        bk_solve_opts_default(&on);
        on.precision = so.precision;
        og->prepare_next(xg, (bk_module)next, &on);
    }
    bk_solve_problem pd = p;
    pd.A = dA;
    pd.B = dB;
    double loss = NAN;
    OK(og->solve_dev(xg, mod, &pd, dP, &so, &rg, &loss));
    if (ahead && Bg && og->prepare_next) {
        /* the same solve with B factored in it (nothing prepared now) */
        bk_solve_result r2;
        double loss2 = NAN;
        OK(og->factors_dev(xg, mod, &dA, &dB, &dP));
        pd.A = dA;
        pd.B = dB;
        OK(og->solve_dev(xg, mod, &pd, dP, &so, &r2, &loss2));
        int64_t d2 = 0;
        for (int64_t t = 0; t < mo * ni; t++)
            d2 += rg.codes[t] != r2.codes[t];
        const int same_side = memcmp(&rg.damp_b, &r2.damp_b, sizeof rg.damp_b) == 0 &&
                              rg.damp_retries == r2.damp_retries &&
                              memcmp(&loss, &loss2, sizeof loss) == 0;
        CHECK(d2 == 0 && same_side, "stages %s layer %d %s: the solve with B factored ahead "
              "differs from the one without: %lld codes, damp_b %.17g / %.17g, retries %d / "
              "%d, loss_gptq %.17g / %.17g", sc->name, layer, mn, (long long)d2, rg.damp_b,
              r2.damp_b, rg.damp_retries, r2.damp_retries, loss, loss2);
        w->ahead_n++;
        w->ahead_diff += d2 + !same_side;
        bk_solve_result_free(&r2);
    }
    int64_t diff = 0;
    for (int64_t t = 0; t < mo * ni; t++)
        diff += rc.codes[t] != rg.codes[t];
    const double tol = sc->solve_fp32 ? TOL_CODES_FP32 : TOL_CODES_FP64;
    CHECK((double)diff <= tol * (double)(mo * ni), "stages %s layer %d %s solve_dev: %lld of "
          "%lld codes differ from the CPU solve (%s)", sc->name, layer, mn, (long long)diff,
          (long long)(mo * ni), sc->solve_fp32 ? "TOL_CODES_FP32" : "TOL_CODES_FP64");
    w->code_diff += diff;
    w->codes += mo * ni;
    /* loss_gptq = tr(E A_plain Eᵀ), E = the device solve's weight - W */
    CHECK(rg.weight != NULL, "stages %s layer %d %s solve_dev: no weight", sc->name, layer, mn);
    if (rg.weight) {
        float *E = malloc(sizeof(float) * (size_t)(mo * ni));
        if (!E)
            exit(1);
        for (int64_t t = 0; t < mo * ni; t++)
            E[t] = rg.weight[t] - orig->w[mod][t];
        double lh = NAN;
        OK(bk_proxy_loss(mo, ni, E, Pg, NULL, &lh));
        const double e = fabs(loss - lh) / fabs(lh);
        CHECK(e <= TOL_LOSS_GPTQ, "stages %s layer %d %s solve_dev loss_gptq %.12g, host %.12g "
              "(TOL_LOSS_GPTQ %g)", sc->name, layer, mn, loss, lh, TOL_LOSS_GPTQ);
        w->loss = max_of(w->loss, e);
        w->loss_n++;
        free(E);
    }
    /* the same quantized weight in both working copies */
    memcpy(lw->w[mod], rc.weight, sizeof(float) * (size_t)(mo * ni));
    OK(oc->weight_updated(xc, mod, rc.weight));
    OK(og->weight_updated(xg, mod, rc.weight));
    bk_solve_result_free(&rc);
    bk_solve_result_free(&rg);
    free(Ag);
    free(Bg);
    free(Pg);
}

static void stage_run_both(const bk_stage_ops *oc, void *xc, const bk_stage_ops *og, void *xg,
                           bk_stage stage, int64_t S, int64_t B)
{
    double tf = 0, th = 0;
    for (int64_t s0 = 0; s0 < S; s0 += B)
        OK(oc->run(xc, stage, s0, S - s0 < B ? S - s0 : B, &tf, &th));
    for (int64_t s0 = 0; s0 < S; s0 += B)
        OK(og->run(xg, stage, s0, S - s0 < B ? S - s0 : B, &tf, &th));
}

/* The backprop kinds: a flow's per-layer output gradients into the layers'
 * accumulators (as src/quantize_backprop.c's bp_grads). */
static bk_status flow_grads(void *user, int layer, int64_t s0, int64_t sb, const bk_grad_taps *t)
{
    bk_hess_acc **acc = user;
    (void)s0;
    bk_status st = BK_OK;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = bk_hess_add_grad(acc[layer], layer, (bk_module)m, t->g[m], t->a[m], sb);
    return st;
}

static void stage_case_run(const stage_case *sc, const bk_model *m, const int32_t *tok,
                           int64_t S, int64_t T)
{
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    bk_backend_params bp;
    bk_backend_params_default(&bp);
    if (sc->setting)
        OK(bk_backend_params_parse(&bp, sc->setting));
    bk_backend *cb = NULL, *gb = NULL;
    OK(bk_backend_create_params(BK_BACKEND_CPU, &bp, &cb));
    OK(bk_backend_create_params(BK_BACKEND_CUDA, &bp, &gb));
    bk_backend_set_gemm_math(gb, BK_GEMM_FP32); /* the CPU's arithmetic */
    if (sc->overlap_off) {
        bk_cuda_tuning t;
        bk_cuda_tuning_default(&t);
        t.overlap = 0;
        OK(bk_cuda_backend_tune(gb, &t));
    }
    const int bpk = bk_hessian_is_backprop(sc->kind);
    const bk_stage_params p = {.model = m, .kind = sc->kind, .fp64 = sc->fp64,
                               .keep_plain = bk__hessian_keeps_plain(sc->kind),
                               .fully = bk__hessian_needs_qk(sc->kind), .codes_only = 0,
                               .S = S, .T = T, .sequential = sc->sequential};
    const bk_stage_ops *oc = NULL, *og = NULL;
    void *xc = NULL, *xg = NULL;
    int64_t bc = STAGE_BATCH, bg = STAGE_BATCH;
    OK(bk_backend_stages_create(cb, &p, &bc, &oc, &xc));
    OK(bk_backend_stages_create(gb, &p, &bg, &og, &xg));
    CHECK(!bk_cpu_stages_are(og), "stages %s: the CUDA backend fell back to the CPU stages (%s)",
          sc->name, og->describe(xg));
    CHECK(og->factors_dev && og->solve_dev && og->sums && og->bp_grads,
          "stages %s: the GPU stages lack factors_dev, solve_dev, sums or bp_grads", sc->name);
    CHECK(bc == STAGE_BATCH && bg == STAGE_BATCH, "stages %s: micro-batch cpu %lld, gpu %lld "
          "(asked %d)", sc->name, (long long)bc, (long long)bg, STAGE_BATCH);
    if (bk_cpu_stages_are(og) || !og->factors_dev || !og->solve_dev || !og->sums ||
        bc != bg) {
        oc->destroy(xc);
        og->destroy(xg);
        bk_backend_destroy(gb);
        bk_backend_destroy(cb);
        return;
    }
    /* the variants took effect (the GPU stages' description) */
    const char *desc = og->describe(xg);
    if (sc->setting && !strcmp(sc->setting, "residual=host"))
        CHECK(strstr(desc, "in pinned host memory") != NULL, "stages %s: describe '%s'",
              sc->name, desc);
    if (sc->setting && !strcmp(sc->setting, "keep_down=0"))
        CHECK(strstr(desc, "down_proj inputs kept") == NULL, "stages %s: describe '%s'",
              sc->name, desc);
    if (!sc->setting && sc->sequential)
        CHECK(strstr(desc, "down_proj inputs kept") != NULL,
              "stages %s: describe '%s' (the default keeps them)", sc->name, desc);

    /* backprop kinds: each flow's output side into its stages' layer accumulators */
    bk_hess_acc **acc[2] = {NULL, NULL};
    int flow_gpu = 0;
    if (bpk) {
        for (int k = 0; k < 2; k++) {
            if (!(acc[k] = calloc((size_t)L, sizeof *acc[k])))
                exit(1);
            for (int l = 0; l < L; l++)
                OK(bk_hess_acc_create(c, sc->kind, sc->fp64, T, &acc[k][l]));
        }
        const bk_bwd_flow_opts fo = {.flow = BK_FLOW_HALVING, .leaf = L,
                                     .fisher = BK_FISHER_EMPIRICAL, .seed = 1, .batch = bc,
                                     .seq0 = 0};
        bk_bwd_flow_cb f0 = {.user = acc[0], .grads = flow_grads};
        bk_bwd_flow_cb f1 = {.user = acc[1], .grads = flow_grads};
        bk_bwd_flow_stats st0, st1;
        OK(bk_backend_bwd_flow_run(cb, m, tok, S, T, &fo, BK_BWD_FP64, &f0, &st0));
        flow_gpu = bk_backend_supports(gb, BK_OP_BACKWARD);
        OK(bk_backend_bwd_flow_run(gb, m, tok, S, T, &fo, BK_BWD_FP64, &f1, &st1));
        CHECK(st0.passes == st1.passes, "stages %s bwd_flow_run: %d passes on the CPU, %d on "
              "the GPU", sc->name, st0.passes, st1.passes);
    }

    stage_worst w;
    memset(&w, 0, sizeof w);
    for (int64_t s0 = 0; s0 < S; s0 += bc) {
        OK(oc->embed(xc, tok, s0, S - s0 < bc ? S - s0 : bc));
        OK(og->embed(xg, tok, s0, S - s0 < bc ? S - s0 : bc));
    }
    const int sums = !p.keep_plain;
    static const struct {
        bk_stage stage;
        bk_module lo, hi;
    } seq[] = {{BK_STAGE_QKV, BK_MOD_Q, BK_MOD_V},
               {BK_STAGE_O, BK_MOD_O, BK_MOD_O},
               {BK_STAGE_MLP, BK_MOD_GATE, BK_MOD_UP},
               {BK_STAGE_DOWN, BK_MOD_DOWN, BK_MOD_DOWN}};
    for (int l = 0; l < L; l++) {
        bk_layer_weights orig, lw;
        memset(&orig, 0, sizeof orig);
        memset(&lw, 0, sizeof lw);
        OK(bk_layer_weights_load(m, l, &orig));
        OK(bk_layer_weights_load(m, l, &lw)); /* the CPU stages' working copy */
        OK(oc->layer_begin(xc, &orig, &lw, 1));
        OK(og->layer_begin(xg, &orig, &orig, 1)); /* (the GPU keeps its own) */
        if (bpk) {
            bk_bp_side sd;
            memset(&sd, 0, sizeof sd);
            sd.layer = l;
            sd.acc = acc[0][l];
            OK(oc->bp_grads(xc, &sd));
            sd.acc = acc[1][l];
            OK(og->bp_grads(xg, &sd));
        }
        if (!sc->sequential) {
            stage_run_both(oc, xc, og, xg, BK_STAGE_TAPS, S, bc);
            if (sums)
                compare_sums(oc, xc, og, xg, (1u << BK_MOD_COUNT) - 1, c, sc, l, &w);
            for (int mod = 0; mod < BK_MOD_COUNT; mod++)
                stage_module(cb, oc, xc, og, xg, c, sc, l, (bk_module)mod,
                             mod + 1 < BK_MOD_COUNT ? mod + 1 : -1, mod > 0, &orig, &lw, &w);
        } else {
            for (size_t k = 0; k < sizeof seq / sizeof seq[0]; k++) {
                stage_run_both(oc, xc, og, xg, seq[k].stage, S, bc);
                unsigned mask = 0;
                for (int mod = (int)seq[k].lo; mod <= (int)seq[k].hi; mod++)
                    mask |= 1u << mod;
                if (sums)
                    compare_sums(oc, xc, og, xg, mask, c, sc, l, &w);
                for (int mod = (int)seq[k].lo; mod <= (int)seq[k].hi; mod++)
                    stage_module(cb, oc, xc, og, xg, c, sc, l, (bk_module)mod,
                                 mod < (int)seq[k].hi ? mod + 1 : -1, mod > (int)seq[k].lo,
                                 &orig, &lw, &w);
            }
            stage_run_both(oc, xc, og, xg, BK_STAGE_OUT, S, bc);
        }
        oc->layer_end(xc);
        og->layer_end(xg);
        bk_layer_weights_free(&orig);
        bk_layer_weights_free(&lw);
    }
    printf("stages %s factors A: max rel %.3g (TOL_FACTORS %g) %s\n", sc->name, w.A,
           TOL_FACTORS, w.A <= TOL_FACTORS ? "ok" : "FAILED");
    if (w.nB)
        printf("stages %s factors B: max rel %.3g over %d two-sided modules (TOL_FACTORS %g) "
               "%s%s\n", sc->name, w.B, w.nB, TOL_FACTORS, w.B <= TOL_FACTORS ? "ok" : "FAILED",
               bpk ? (flow_gpu ? " (GPU flow against CPU flow)" : " (CPU flow on both)") : "");
    else
        printf("stages %s factors B: identity for every module on both\n", sc->name);
    printf("stages %s factors A_plain: max rel %.3g (TOL_FACTORS %g) %s\n", sc->name, w.P,
           TOL_FACTORS, w.P <= TOL_FACTORS ? "ok" : "FAILED");
    if (sums)
        printf("stages %s sums: max rel %.3g over %d buffers (TOL_SUMS %g)%s %s\n", sc->name,
               w.sums, w.nsums, TOL_SUMS,
               w.sums_layout ? " (buffers of different sizes, layouts differ: not compared)" : "",
               w.sums <= TOL_SUMS ? "ok" : "FAILED");
    else
        printf("stages %s sums: not compared (the CPU keeps the plain E[x xT] in a second "
               "accumulator: another layout)\n", sc->name);
    printf("stages %s solve_dev (%s) codes: %lld of %lld differ (%s %g) %s\n", sc->name,
           sc->solve_fp32 ? "fp32" : "fp64", (long long)w.code_diff, (long long)w.codes,
           sc->solve_fp32 ? "TOL_CODES_FP32" : "TOL_CODES_FP64",
           sc->solve_fp32 ? TOL_CODES_FP32 : TOL_CODES_FP64,
           (double)w.code_diff <= (sc->solve_fp32 ? TOL_CODES_FP32 : TOL_CODES_FP64) *
                   (double)w.codes ? "ok" : "FAILED");
    printf("stages %s prepare_next: %d solves with B factored ahead, %lld differences from "
           "the solve without it (bit for bit) %s\n", sc->name, w.ahead_n,
           (long long)w.ahead_diff, w.ahead_diff == 0 ? "ok" : "FAILED");
    printf("stages %s solve_dev loss_gptq: max rel %.3g over %d modules (TOL_LOSS_GPTQ %g) %s\n",
           sc->name, w.loss, w.loss_n, TOL_LOSS_GPTQ, w.loss <= TOL_LOSS_GPTQ ? "ok" : "FAILED");
    for (int k = 0; k < 2 && bpk; k++) {
        for (int l = 0; l < L; l++)
            bk_hess_acc_free(acc[k][l]);
        free(acc[k]);
    }
    oc->destroy(xc);
    og->destroy(xg);
    bk_backend_destroy(gb);
    bk_backend_destroy(cb);
}

static void test_stages(bk_backend *dev, const bk_model *m, const int32_t *tok, int64_t S,
                        int64_t T)
{
    if (!bk_backend_supports(dev, BK_OP_STAGES)) {
        printf("stages: not supported by %s\n", bk_backend_name(dev));
        return;
    }
    static const stage_case cases[] = {
        {"gptq", BK_HESS_GPTQ, 0, 1, NULL, 0, 0},
        {"gptq fp64", BK_HESS_GPTQ, 1, 1, NULL, 0, 0},
        {"mlplocal-kfac", BK_HESS_MLPLOCAL_KFAC, 0, 1, NULL, 0, 0},
        {"mlplocal-kfac fp64", BK_HESS_MLPLOCAL_KFAC, 1, 1, NULL, 0, 0},
        {"mlplocal-shampoo", BK_HESS_MLPLOCAL_SHAMPOO, 0, 1, NULL, 0, 0},
        {"mlplocal-shampoo fp64", BK_HESS_MLPLOCAL_SHAMPOO, 1, 1, NULL, 0, 0},
        {"fullylocal-kfac", BK_HESS_FULLYLOCAL_KFAC, 0, 1, NULL, 0, 0},
        {"fullylocal-kfac fp64", BK_HESS_FULLYLOCAL_KFAC, 1, 1, NULL, 0, 0},
        {"fullylocal-shampoo", BK_HESS_FULLYLOCAL_SHAMPOO, 0, 1, NULL, 0, 0},
        {"fullylocal-shampoo fp64", BK_HESS_FULLYLOCAL_SHAMPOO, 1, 1, NULL, 0, 0},
        /* the variants the default job never runs */
        {"mlplocal-kfac keep_down=0", BK_HESS_MLPLOCAL_KFAC, 0, 1, "keep_down=0", 0, 0},
        {"gptq residual=host", BK_HESS_GPTQ, 0, 1, "residual=host", 0, 0},
        {"fullylocal-kfac overlap off", BK_HESS_FULLYLOCAL_KFAC, 0, 1, NULL, 1, 0},
        {"mlplocal-shampoo factor_fp64=1 fp32 solves", BK_HESS_MLPLOCAL_SHAMPOO, 0, 1,
         "factor_fp64=1", 0, 1},
        {"fullylocal-shampoo no-sequential", BK_HESS_FULLYLOCAL_SHAMPOO, 0, 0, NULL, 0, 0},
        /* the backprop kinds (their flows too) last */
        {"backprop-kfac", BK_HESS_BACKPROP_KFAC, 0, 1, NULL, 0, 0},
        {"backprop-shampoo fp64", BK_HESS_BACKPROP_SHAMPOO, 1, 1, NULL, 0, 0},
        {"backprop-shampoo residual=host", BK_HESS_BACKPROP_SHAMPOO, 0, 1, "residual=host", 0,
         0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const double t0 = now_s();
        stage_case_run(&cases[i], m, tok, S, T);
        printf("stages %s: %.1f s\n", cases[i].name, now_s() - t0);
        fflush(stdout);
    }

    /* fallback: a job the GPU stages do not implement (dumped activations)
     * runs on the CPU stages, and their describe says why */
    const bk_stage_params p = {.model = m, .kind = BK_HESS_GPTQ, .S = S, .T = T,
                               .sequential = 1, .inputs = 1};
    const bk_stage_ops *ops = NULL;
    void *ctx = NULL;
    int64_t b = STAGE_BATCH;
    OK(bk_backend_stages_create(dev, &p, &b, &ops, &ctx));
    const char *want = "stages on the CPU (cuda has no stages for dumped activations "
                       "(--activations))";
    CHECK(bk_cpu_stages_are(ops) && !strcmp(ops->describe(ctx), want),
          "fallback: stages %s, describe '%s'", ops->name, ops->describe(ctx));
    printf("stages fallback (dumped activations): %s, '%s'\n", ops->name, ops->describe(ctx));
    ops->destroy(ctx);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* every line out before a crash */
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
    free(tok);
    tok = NULL;
    OK(bk_load_tokens(calib, bk_model_get_config(m)->vocab, 8, 64, &tok, &S, &T));
    test_stages(dev, m, tok, S, T);
    free(tok);
    bk_model_close(m);
    bk_backend_destroy(dev);
    bk_backend_destroy(cpu);
    printf("%s\n", g_fail ? "FAILED" : "ok");
    return g_fail ? 1 : 0;
}
