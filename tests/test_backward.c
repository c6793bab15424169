/* Tests of the backward pass (src/backward.c) and of the flows that deliver
 * module inputs and output gradients (src/backward_flow.c).
 *
 * Expected values come from independent constructions:
 *  - central finite differences of the double-precision loss with respect
 *    to every module's output (a perturbation added to one output element),
 *    on the tiny checkpoints (Llama-3 rope scaling + GQA, Qwen2 biases + tied
 *    embeddings, Qwen3 q/k norm);
 *  - PyTorch autograd in float64 (scripts/backward_golden.py,
 *    tests/data/backward/<model>.safetensors): the loss, every module's
 *    output gradient and the module inputs;
 *  - the product's float32 forward (bk_model_nll, bk_model_logits) for the
 *    double forward and for the sampled labels (inverse CDF of the softmax);
 *  - naive I for recursive halving (the same gradients, to the last bit), and
 *    the paper's count of live boundary matrices.
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

#include "backward_internal.h"
#include "bwd_mem.h"
#include "hess_blocks.h"
#include "bakron/backward.h"
#include "bakron/forward.h"
#include "bakron/hessian.h"
#include "bakron/model.h"
#include "bakron/safetensors.h"
#include "test_cm_util.h"
#include "util.h"

static int verbose(void)
{
    const char *v = getenv("BK_TEST_VERBOSE");
    return v && v[0] == '1';
}

/* All layers' weights. */
static bk_layer_weights *load_all(const bk_model *m)
{
    const bk_model_config *c = bk_model_get_config(m);
    bk_layer_weights *lw = calloc((size_t)c->n_layers, sizeof *lw);
    assert_non_null(lw);
    for (int l = 0; l < c->n_layers; l++)
        if (bk_layer_weights_load(m, l, &lw[l]) != BK_OK)
            fail_msg("%s", bk_last_error());
    return lw;
}

static void free_all(const bk_model *m, bk_layer_weights *lw)
{
    for (int l = 0; l < bk_model_get_config(m)->n_layers; l++)
        bk_layer_weights_free(&lw[l]);
    free(lw);
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

/* Random taps of one layer, N rows: each module's input in F32 and the same
 * values in F64 (q, k, v share theirs, gate and up too) and an F64 output
 * gradient; the caller frees the 3 * BK_MOD_COUNT arrays. */
static void random_taps(const bk_model_config *c, int64_t N, bk_rng *rg, float **af, double **ad,
                        double **gd)
{
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        const int64_t n = mod_in(c, i), m = mod_out(c, i);
        af[i] = malloc((size_t)(N * n) * sizeof(float));
        ad[i] = malloc((size_t)(N * n) * sizeof(double));
        gd[i] = malloc((size_t)(N * m) * sizeof(double));
        assert_non_null(af[i]);
        assert_non_null(ad[i]);
        assert_non_null(gd[i]);
        for (int64_t k = 0; k < N * n; k++) {
            af[i][k] = (float)bk_rng_normal(rg);
            ad[i][k] = (double)af[i][k];
        }
        for (int64_t k = 0; k < N * m; k++)
            gd[i][k] = bk_rng_normal(rg);
    }
    for (int64_t k = 0; k < N * c->hidden; k++) {
        af[BK_MOD_K][k] = af[BK_MOD_V][k] = af[BK_MOD_Q][k];
        ad[BK_MOD_K][k] = ad[BK_MOD_V][k] = ad[BK_MOD_Q][k];
        af[BK_MOD_UP][k] = af[BK_MOD_GATE][k];
        ad[BK_MOD_UP][k] = ad[BK_MOD_GATE][k];
    }
}

/* Everything one full forward + backward gives: per layer and module the
 * inputs a and output gradients g [N, width] (copies), and the loss. */
typedef struct run {
    int L;
    int64_t N;
    double loss;
    double *a[64][BK_MOD_COUNT], *g[64][BK_MOD_COUNT];
} run;

static void run_free(run *r)
{
    for (int l = 0; l < r->L; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            free(r->a[l][i]);
            free(r->g[l][i]);
        }
}

static double *dup_d(const double *p, int64_t n)
{
    double *q = malloc((size_t)n * sizeof(double));
    assert_non_null(q);
    memcpy(q, p, (size_t)n * sizeof(double));
    return q;
}

/* Loss (and, with r, the taps) of the whole model on tokens [S, T] with
 * fixed labels, through the public pieces of bakron/backward.h. */
static double model_loss(bk_bwd *bw, const bk_model *m, const bk_layer_weights *lw,
                         const int32_t *tokens, const int32_t *labels, int64_t S, int64_t T,
                         run *r)
{
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    const int64_t N = S * T, d = c->hidden;
    double *h = malloc((size_t)(N * d) * sizeof(double));
    double *acts = malloc((size_t)(N * d * L) * sizeof(double));
    double *dh = malloc((size_t)(N * d) * sizeof(double));
    assert_true(h && acts && dh);
    assert_int_equal(bk_bwd_embed(bw, m, tokens, S, h), BK_OK);
    for (int l = 0; l < L; l++) {
        memcpy(acts + l * N * d, h, (size_t)(N * d) * sizeof(double));
        assert_int_equal(bk_bwd_layer_forward(bw, &lw[l], S, h), BK_OK);
    }
    double loss = 0;
    if (bk_bwd_head(bw, m, h, labels, S, r ? dh : NULL, &loss) != BK_OK)
        fail_msg("%s", bk_last_error());
    if (r) {
        r->L = L;
        r->N = N;
        r->loss = loss;
        for (int l = L - 1; l >= 0; l--) {
            bk_grad_taps t;
            if (bk_bwd_layer_backward(bw, &lw[l], S, acts + l * N * d, dh, &t) != BK_OK)
                fail_msg("%s", bk_last_error());
            for (int i = 0; i < BK_MOD_COUNT; i++) {
                r->a[l][i] = dup_d(t.a[i], N * mod_in(c, i));
                r->g[l][i] = dup_d(t.g[i], N * mod_out(c, i));
            }
        }
    }
    free(h);
    free(acts);
    free(dh);
    return loss;
}

/* ======================================================== finite differences */

static void fd_model(const char *name)
{
    bk_model *m = tu_open_model(name);
    const bk_model_config *c = bk_model_get_config(m);
    bk_layer_weights *lw = load_all(m);
    const int64_t S = 2, T = 6, N = S * T;
    int32_t *tok = tu_random_tokens(11, N, c->vocab);
    int32_t *lab = tu_random_tokens(12, N, c->vocab);
    lab[T - 1] = -1; /* one position without a label */
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    run r;
    memset(&r, 0, sizeof r);
    model_loss(bw, m, lw, tok, lab, S, T, &r);
    bk_rng rg;
    bk_rng_seed(&rg, 99);
    double worst = 0;
    for (int l = 0; l < c->n_layers; l++) {
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const int64_t out = mod_out(c, i);
            double gmax = 0;
            for (int64_t k = 0; k < N * out; k++)
                gmax = fmax(gmax, fabs(r.g[l][i][k]));
            assert_true(gmax > 0);
            for (int rep = 0; rep < 4; rep++) {
                /* rows with a label and without; both rows of a sequence's end */
                int64_t row = rep == 0 ? T - 1 : (int64_t)(bk_rng_next(&rg) % (uint64_t)N);
                int64_t col = (int64_t)(bk_rng_next(&rg) % (uint64_t)out);
                const double eps = 1e-4;
                bk_bwd_perturb p = {l, (bk_module)i, row, col, eps};
                bk__bwd_set_perturb(bw, &p);
                double lp = model_loss(bw, m, lw, tok, lab, S, T, NULL);
                p.delta = -eps;
                bk__bwd_set_perturb(bw, &p);
                double lm = model_loss(bw, m, lw, tok, lab, S, T, NULL);
                bk__bwd_set_perturb(bw, NULL);
                double fd = (lp - lm) / (2 * eps);
                double e = fabs(fd - r.g[l][i][row * out + col]) / gmax;
                if (e > worst)
                    worst = e;
                if (e > 1e-6)
                    fail_msg("%s layer %d %s [%lld, %lld]: finite difference %.12g, backward "
                             "%.12g (max |g| %.3g)",
                             name, l, bk_module_name((bk_module)i), (long long)row,
                             (long long)col, fd, r.g[l][i][row * out + col], gmax);
            }
        }
    }
    if (verbose())
        fprintf(stderr, "  fd %s: worst |fd - g| / max|g| = %.3g (tolerance 1e-6)\n", name, worst);
    run_free(&r);
    bk_bwd_free(bw);
    free(tok);
    free(lab);
    free_all(m, lw);
    bk_model_close(m);
}

static void test_fd_llama3(void **state)
{
    (void)state;
    fd_model("tiny-llama3");
}

static void test_fd_qwen2(void **state)
{
    (void)state;
    fd_model("tiny-qwen2");
}

static void test_fd_qwen3(void **state)
{
    (void)state;
    fd_model("tiny-qwen3");
}

/* ======================================================== PyTorch goldens */

static double cmp_golden(const bk_st_file *g, const char *name, const double *got, int64_t n)
{
    const bk_tensor_info *t = bk_st_find(g, name);
    if (!t)
        fail_msg("golden tensor %s missing", name);
    assert_int_equal((int64_t)t->numel, n);
    float *ref = malloc((size_t)n * sizeof(float));
    assert_int_equal(bk_tensor_to_f32(t, ref), BK_OK);
    double md = 0, mb = 0;
    for (int64_t i = 0; i < n; i++) {
        md = fmax(md, fabs(got[i] - (double)ref[i]));
        mb = fmax(mb, fabs((double)ref[i]));
    }
    free(ref);
    return mb > 0 ? md / mb : md;
}

static void golden_model(const char *name)
{
    char path[4096];
    const char *data = getenv("BK_TEST_DATA");
    snprintf(path, sizeof path, "%s/backward/%s.safetensors", data, name);
    bk_st_file *g = NULL;
    if (bk_st_open(path, &g) != BK_OK)
        fail_msg("%s: %s", path, bk_last_error());
    const bk_tensor_info *ti = bk_st_find(g, "input_ids"), *tl = bk_st_find(g, "labels"),
                         *tloss = bk_st_find(g, "loss");
    assert_true(ti && tl && tloss);
    assert_int_equal(ti->dtype, BK_DT_I32);
    assert_int_equal(tl->dtype, BK_DT_I32);
    assert_int_equal(tloss->dtype, BK_DT_F64);
    const int64_t S = ti->shape[0], T = ti->shape[1], N = S * T;
    bk_model *m = tu_open_model(name);
    const bk_model_config *c = bk_model_get_config(m);
    bk_layer_weights *lw = load_all(m);
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    run r;
    memset(&r, 0, sizeof r);
    model_loss(bw, m, lw, (const int32_t *)ti->data, (const int32_t *)tl->data, S, T, &r);
    double ref_loss;
    memcpy(&ref_loss, tloss->data, sizeof ref_loss);
    double el = fabs(r.loss - ref_loss) / fabs(ref_loss), eg = 0, ea = 0;
    char nm[256];
    for (int l = 0; l < c->n_layers; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            snprintf(nm, sizeof nm, "layers.%d.%s.grad", l, bk_module_name((bk_module)i));
            double e = cmp_golden(g, nm, r.g[l][i], N * mod_out(c, i));
            if (e > 1e-5)
                fail_msg("%s %s: relative error %.3g > 1e-5", name, nm, e);
            eg = fmax(eg, e);
            if (i == BK_MOD_Q || i == BK_MOD_O || i == BK_MOD_GATE || i == BK_MOD_DOWN) {
                snprintf(nm, sizeof nm, "layers.%d.%s.input", l, bk_module_name((bk_module)i));
                e = cmp_golden(g, nm, r.a[l][i], N * mod_in(c, i));
                if (e > 1e-5)
                    fail_msg("%s %s: relative error %.3g > 1e-5", name, nm, e);
                ea = fmax(ea, e);
            }
        }
    if (verbose())
        fprintf(stderr,
                "  golden %s: loss %.12g vs torch %.12g (rel %.3g, tol 1e-7); grads %.3g, "
                "inputs %.3g (tol 1e-5)\n",
                name, r.loss, ref_loss, el, eg, ea);
    assert_true(el < 1e-7);
    run_free(&r);
    bk_bwd_free(bw);
    free_all(m, lw);
    bk_model_close(m);
    bk_st_close(g);
}

static void test_golden_llama3(void **state)
{
    (void)state;
    golden_model("tiny-llama3");
}

static void test_golden_qwen2(void **state)
{
    (void)state;
    golden_model("tiny-qwen2");
}

static void test_golden_qwen3(void **state)
{
    (void)state;
    golden_model("tiny-qwen3");
}

static void test_golden_kerneldocs(void **state)
{
    (void)state;
    golden_model("kerneldocs-1.6m");
}

/* ======================================== the double forward and the labels */

/* The empirical-Fisher loss is the model's next-token NLL: the product's
 * float32 forward gives it too. */
static void test_loss_matches_fp32_forward(void **state)
{
    (void)state;
    const char *names[] = {"tiny-qwen3", "kerneldocs-1.6m"};
    for (int k = 0; k < 2; k++) {
        bk_model *m = tu_open_model(names[k]);
        const bk_model_config *c = bk_model_get_config(m);
        bk_layer_weights *lw = load_all(m);
        const int64_t S = 3, T = 9, N = S * T;
        int32_t *tok = tu_random_tokens(5 + (uint64_t)k, N, c->vocab);
        int32_t *lab = malloc((size_t)N * sizeof(int32_t));
        bk_bwd *bw = NULL;
        assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
        double *h = malloc((size_t)(N * c->hidden) * sizeof(double));
        assert_int_equal(bk_bwd_embed(bw, m, tok, S, h), BK_OK);
        for (int l = 0; l < c->n_layers; l++)
            assert_int_equal(bk_bwd_layer_forward(bw, &lw[l], S, h), BK_OK);
        assert_int_equal(bk_bwd_labels(bw, m, h, tok, S, 0, BK_FISHER_EMPIRICAL, 0, lab), BK_OK);
        for (int64_t r = 0; r < N; r++)
            assert_int_equal(lab[r], r % T == T - 1 ? -1 : tok[r + 1]);
        double loss = 0, nll = 0;
        int64_t cnt = 0;
        assert_int_equal(bk_bwd_head(bw, m, h, lab, S, NULL, &loss), BK_OK);
        assert_int_equal(bk_model_nll(m, tok, S, T, 0, &nll, &cnt), BK_OK);
        assert_int_equal(cnt, S * (T - 1));
        double e = fabs(loss - nll) / nll;
        if (verbose())
            fprintf(stderr, "  %s: double loss %.9g, float32 forward %.9g (rel %.3g, tol 1e-5)\n",
                    names[k], loss, nll, e);
        assert_true(e < 1e-5);
        free(h);
        free(tok);
        free(lab);
        bk_bwd_free(bw);
        free_all(m, lw);
        bk_model_close(m);
    }
}

/* Model-Fisher labels: the inverse CDF of the softmax of the float32
 * logits at the uniform of (seed, sequence, position); reproducible and
 * independent of the micro-batching; another seed gives other labels. */
static void test_sampled_labels(void **state)
{
    (void)state;
    bk_model *m = tu_open_model("tiny-llama3");
    const bk_model_config *c = bk_model_get_config(m);
    bk_layer_weights *lw = load_all(m);
    const int64_t S = 3, T = 40, N = S * T, V = c->vocab;
    int32_t *tok = tu_random_tokens(3, N, V);
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    double *h = malloc((size_t)(N * c->hidden) * sizeof(double));
    assert_int_equal(bk_bwd_embed(bw, m, tok, S, h), BK_OK);
    for (int l = 0; l < c->n_layers; l++)
        assert_int_equal(bk_bwd_layer_forward(bw, &lw[l], S, h), BK_OK);
    int32_t *lab = malloc((size_t)N * sizeof(int32_t)), *lab2 = malloc((size_t)N * sizeof(int32_t));
    assert_int_equal(bk_bwd_labels(bw, m, h, tok, S, 0, BK_FISHER_MODEL, 7, lab), BK_OK);
    /* one sequence at a time, with its index */
    for (int64_t s = 0; s < S; s++)
        assert_int_equal(bk_bwd_labels(bw, m, h + s * T * c->hidden, tok + s * T, 1, s,
                                       BK_FISHER_MODEL, 7, lab2 + s * T),
                         BK_OK);
    assert_memory_equal(lab, lab2, (size_t)N * sizeof(int32_t));
    assert_int_equal(bk_bwd_labels(bw, m, h, tok, S, 0, BK_FISHER_MODEL, 8, lab2), BK_OK);
    int differ = 0;
    for (int64_t r = 0; r < N; r++)
        differ += lab[r] != lab2[r];
    assert_true(differ > 0);
    /* inverse CDF against the float32 forward's logits */
    float *lg = malloc((size_t)(N * V) * sizeof(float));
    assert_int_equal(bk_model_logits(m, tok, S, T, lg), BK_OK);
    int unlikely = 0;
    for (int64_t r = 0; r < N; r++) {
        const float *row = lg + r * V;
        double mx = row[0], z = 0, below = 0;
        for (int64_t v = 1; v < V; v++)
            mx = fmax(mx, row[v]);
        for (int64_t v = 0; v < V; v++)
            z += exp(row[v] - mx);
        for (int64_t v = 0; v < lab[r]; v++)
            below += exp(row[v] - mx) / z;
        double p = exp(row[lab[r]] - mx) / z;
        double u = bk__bwd_uniform(7, r / T, r % T);
        assert_true(lab[r] >= 0 && lab[r] < V);
        if (!(below <= u + 1e-5 && u <= below + p + 1e-5))
            fail_msg("row %lld: label %d has CDF [%.9g, %.9g], uniform %.9g", (long long)r,
                     (int)lab[r], below, below + p, u);
        unlikely += p < 1e-3;
    }
    assert_true(unlikely < N / 4);
    /* uniforms look uniform: mean of many near 1/2 */
    double mean = 0;
    for (int k = 0; k < 10000; k++)
        mean += bk__bwd_uniform(1, k / 100, k % 100);
    mean /= 10000;
    assert_true(fabs(mean - 0.5) < 0.02);
    free(lg);
    free(h);
    free(tok);
    free(lab);
    free(lab2);
    bk_bwd_free(bw);
    free_all(m, lw);
    bk_model_close(m);
}

/* ======================================================== the flows */

typedef struct collect {
    const bk_model_config *c;
    int64_t N, T;
    double *a[64][BK_MOD_COUNT], *g[64][BK_MOD_COUNT];
    int delivered[64];   /* micro-batches per layer */
    int done_next;       /* next layer leaf_done must start at */
    int passes_seen, max_depth_seen;
    /* the schedule computed in advance (bk_bwd_flow_schedule): every pass as
     * announced, and the micro-batches within each (micro_done) */
    bk_bwd_pass_work sched[128];
    int nsched, cur_pass;
    int64_t S, B, micro_seen, last_done;
} collect;

static void cb_pass(void *user, const bk_bwd_pass_info *info)
{
    collect *k = user;
    /* the pass is the schedule's next, with its depth, layers and kind */
    assert_int_equal(info->index, k->passes_seen);
    assert_true(info->index < k->nsched);
    const bk_bwd_pass_work *w = &k->sched[info->index];
    assert_int_equal(info->depth, w->depth);
    assert_int_equal(info->lo, w->lo);
    assert_int_equal(info->hi, w->hi);
    assert_int_equal(info->leaf, w->leaf);
    /* the pass before delivered every micro-batch */
    if (info->index > 0)
        assert_int_equal(k->last_done, k->S);
    k->cur_pass = info->index;
    k->last_done = 0;
    k->passes_seen++;
    if (info->depth > k->max_depth_seen)
        k->max_depth_seen = info->depth;
}

static void cb_micro(void *user, int pass, int64_t done, int64_t S)
{
    collect *k = user;
    assert_int_equal(pass, k->cur_pass);
    assert_int_equal(S, k->S);
    /* one call per micro-batch, in order */
    int64_t want = k->last_done + k->B < S ? k->last_done + k->B : S;
    assert_int_equal(done, want);
    k->last_done = done;
    k->micro_seen++;
}

static bk_status cb_grads(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    collect *k = user;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t in = mod_in(k->c, i), out = mod_out(k->c, i);
        if (!k->a[layer][i]) {
            k->a[layer][i] = calloc((size_t)(k->N * in), sizeof(double));
            k->g[layer][i] = calloc((size_t)(k->N * out), sizeof(double));
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
    for (int l = 0; l < 64; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            free(k->a[l][i]);
            free(k->g[l][i]);
        }
}

static void run_flow_b(const bk_model *m, const int32_t *tok, int64_t S, int64_t T,
                       bk_bwd_flow_kind kind, int leaf, int units, int64_t batch, collect *k,
                       bk_bwd_flow_stats *st)
{
    memset(k, 0, sizeof *k);
    k->c = bk_model_get_config(m);
    k->N = S * T;
    k->T = T;
    k->S = S;
    k->B = batch;
    const int L = (int)k->c->n_layers;
    k->nsched = bk_bwd_flow_schedule(L, leaf, kind, units, k->sched, 128);
    assert_true(k->nsched >= 1 && k->nsched <= 128);
    bk_bwd_flow_opts o = {kind, leaf, BK_FISHER_MODEL, 42, batch, 0, units};
    bk_bwd_flow_cb cb = {k, cb_pass, cb_grads, cb_leaf, NULL, 0, NULL, NULL, cb_micro};
    if (bk_bwd_flow_run(m, tok, S, T, &o, &cb, st) != BK_OK)
        fail_msg("%s", bk_last_error());
    /* the work computed in advance is the work done: passes, layer forwards
     * (with the recomputed ones) and backwards, one micro_done per micro-batch
     * of every pass */
    int64_t fw = 0, bw = 0;
    for (int p = 0; p < k->nsched; p++) {
        assert_int_equal(k->sched[p].layer_forwards, k->sched[p].forwards + k->sched[p].backwards);
        fw += k->sched[p].layer_forwards;
        bw += k->sched[p].backwards;
    }
    assert_int_equal(k->nsched, st->passes);
    assert_int_equal(fw, st->layer_forwards);
    assert_int_equal(bw, st->layer_backwards);
    assert_int_equal(k->micro_seen, (int64_t)st->passes * ((S + batch - 1) / batch));
    assert_int_equal(k->last_done, S);
    assert_int_equal(k->done_next, (int)k->c->n_layers);
    int64_t nb = (S + batch - 1) / batch;
    for (int l = 0; l < k->c->n_layers; l++)
        assert_int_equal(k->delivered[l], (int)nb);
    assert_int_equal(k->passes_seen, st->passes);
}

static void run_flow(const bk_model *m, const int32_t *tok, int64_t S, int64_t T,
                     bk_bwd_flow_kind kind, int leaf, int64_t batch, collect *k,
                     bk_bwd_flow_stats *st)
{
    run_flow_b(m, tok, S, T, kind, leaf, 0, batch, k, st);
}

/* max |x - y| / max |y| over every a and g */
static double collect_diff(const collect *x, const collect *y)
{
    double worst = 0;
    for (int l = 0; l < x->c->n_layers; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const double *p[2] = {x->a[l][i], x->g[l][i]}, *q[2] = {y->a[l][i], y->g[l][i]};
            int64_t n[2] = {x->N * mod_in(x->c, i), x->N * mod_out(x->c, i)};
            for (int w = 0; w < 2; w++) {
                double md = 0, mb = 0;
                for (int64_t e = 0; e < n[w]; e++) {
                    md = fmax(md, fabs(p[w][e] - q[w][e]));
                    mb = fmax(mb, fabs(q[w][e]));
                }
                worst = fmax(worst, mb > 0 ? md / mb : md);
            }
        }
    return worst;
}

static void flows_model(const char *name)
{
    bk_model *m = tu_open_model(name);
    const bk_model_config *c = bk_model_get_config(m);
    const int L = (int)c->n_layers;
    const int64_t S = 3, T = 8;
    int32_t *tok = tu_random_tokens(21, S * T, c->vocab);
    /* the reference: one forward + backward of the whole model with the
     * flow's labels */
    bk_layer_weights *lw = load_all(m);
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    double *h = malloc((size_t)(S * T * c->hidden) * sizeof(double));
    int32_t *lab = malloc((size_t)(S * T) * sizeof(int32_t));
    assert_int_equal(bk_bwd_embed(bw, m, tok, S, h), BK_OK);
    for (int l = 0; l < L; l++)
        assert_int_equal(bk_bwd_layer_forward(bw, &lw[l], S, h), BK_OK);
    assert_int_equal(bk_bwd_labels(bw, m, h, tok, S, 0, BK_FISHER_MODEL, 42, lab), BK_OK);
    run ref;
    memset(&ref, 0, sizeof ref);
    model_loss(bw, m, lw, tok, lab, S, T, &ref);
    collect rc;
    memset(&rc, 0, sizeof rc);
    rc.c = c;
    rc.N = S * T;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            rc.a[l][i] = ref.a[l][i];
            rc.g[l][i] = ref.g[l][i];
        }

    for (int leaf = 1; leaf <= L; leaf++) {
        collect kn, kh, kb;
        bk_bwd_flow_stats sn, sh, sb;
        run_flow(m, tok, S, T, BK_FLOW_NAIVE, leaf, 2, &kn, &sn);
        run_flow(m, tok, S, T, BK_FLOW_HALVING, leaf, 2, &kh, &sh);
        run_flow(m, tok, S, T, BK_FLOW_HALVING, leaf, 1, &kb, &sb);
        double e_hn = collect_diff(&kh, &kn), e_ref = collect_diff(&kn, &rc),
               e_mb = collect_diff(&kb, &kh);
        if (verbose())
            fprintf(stderr,
                    "  %s leaf %d: halving vs naive %.3g (tol 1e-13), naive vs one full "
                    "backward %.3g (tol 1e-12), micro-batch 1 vs 2 %.3g (tol 1e-12); passes "
                    "%d / %d, depth %d, peak boundaries %.0f x [N, hidden]\n",
                    name, leaf, e_hn, e_ref, e_mb, sh.passes, sn.passes, sh.max_depth,
                    (double)sh.peak_boundary_bytes / (double)(S * T * c->hidden * 8));
        assert_true(e_hn <= 1e-13);
        assert_true(e_ref <= 1e-12);
        assert_true(e_mb <= 1e-12);
        /* naive: one sweep per leaf, nothing kept */
        assert_int_equal(sn.passes, (L + leaf - 1) / leaf);
        assert_int_equal(sn.peak_boundary_bytes, 0);
        /* halving: a split per inner node, a sweep per leaf; live boundaries
         * at most 2 per level plus the head's gradient (the paper's
         * 2(log2(l) + 1) bound) */
        int leaves = 0, inner = 0;
        {
            int stack_lo[64], stack_hi[64], sp = 0;
            stack_lo[sp] = 0;
            stack_hi[sp++] = L;
            while (sp) {
                sp--;
                int lo = stack_lo[sp], hi = stack_hi[sp];
                if (hi - lo <= leaf) {
                    leaves++;
                } else {
                    int mid = lo + (hi - lo) / 2;
                    inner++;
                    stack_lo[sp] = lo, stack_hi[sp++] = mid;
                    stack_lo[sp] = mid, stack_hi[sp++] = hi;
                }
            }
        }
        assert_int_equal(sh.passes, leaves + inner);
        /* the planned peak (src/bwd_mem.c, before a job's flow starts) is the
         * measured one, at either micro-batch */
        assert_true(sh.peak_boundary_bytes ==
                    bk_bwd_boundary_peak_bytes(L, BK_FLOW_HALVING, leaf, S * T, c->hidden, 8));
        assert_true(sb.peak_boundary_bytes == sh.peak_boundary_bytes);
        assert_true(sn.peak_boundary_bytes ==
                    bk_bwd_boundary_peak_bytes(L, BK_FLOW_NAIVE, leaf, S * T, c->hidden, 8));
        double nbound = (double)sh.peak_boundary_bytes / (double)(S * T * c->hidden * 8);
        assert_true(nbound <= 2 * (log2((double)L) + 1) + 1e-9);
        assert_true(inner == 0 ? nbound == 0 : nbound >= 3);
        /* wider splits (a boundary budget): the same a and g as naive, to the
         * last bit; the budget of the widest (one child per leaf at the root:
         * 2 (leaves - 1) + 1) and one below it; the peak as planned and within
         * the budget where halving's fewest fit in it */
        const int leaves_n = (L + leaf - 1) / leaf;
        const int budgets[2] = {2 * (leaves_n - 1) + 1, 2 * (leaves_n - 1)};
        for (int bi = 0; bi < 2 && leaves_n > 1; bi++) {
            collect kw;
            bk_bwd_flow_stats sw;
            run_flow_b(m, tok, S, T, BK_FLOW_HALVING, leaf, budgets[bi], 2, &kw, &sw);
            const double e_wn = collect_diff(&kw, &kn);
            const double nw = (double)sw.peak_boundary_bytes / (double)(S * T * c->hidden * 8);
            if (verbose())
                fprintf(stderr, "  %s leaf %d budget %d: vs naive %.3g, passes %d, depth %d, "
                        "peak %.0f\n", name, leaf, budgets[bi], e_wn, sw.passes, sw.max_depth, nw);
            assert_true(e_wn == 0);
            assert_true(sw.peak_boundary_bytes ==
                        bk_bwd_boundary_peak_bytes_b(L, BK_FLOW_HALVING, leaf, budgets[bi], S * T,
                                                     c->hidden, 8));
            assert_true(nw <= budgets[bi] || nw == nbound);
            assert_true(sw.layer_forwards + 2 * sw.layer_backwards <=
                        sh.layer_forwards + 2 * sh.layer_backwards);
            if (bi == 0) { /* the widest: the root and one pass per leaf */
                assert_int_equal(sw.passes, 1 + leaves_n);
                assert_int_equal(sw.max_depth, 1);
                assert_true(nw == budgets[0]);
            }
            collect_free(&kw);
        }
        collect_free(&kn);
        collect_free(&kh);
        collect_free(&kb);
    }
    run_free(&ref);
    free(h);
    free(lab);
    free(tok);
    bk_bwd_free(bw);
    free_all(m, lw);
    bk_model_close(m);
}

static void test_flows_kerneldocs(void **state)
{
    (void)state;
    flows_model("kerneldocs-1.6m");
}

static void test_flows_qwen3(void **state)
{
    (void)state;
    flows_model("tiny-qwen3");
}

/* The schedule alone, over many layer counts and leaf sizes: the leaves
 * cover the layers in order, every pass's work follows from its range, and
 * the Llama-3-8B shape (32 layers, leaf 4) is the 15 passes the H200 printed
 * (pass 9 the split at depth 1 of layers 17-32). */
static void test_flow_schedule(void **state)
{
    (void)state;
    static bk_bwd_pass_work w[256];
    for (int L = 1; L <= 40; L++)
        for (int s = 1; s <= L + 1; s++)
            for (int naive = 0; naive < 2; naive++) {
                bk_bwd_flow_kind kind = naive ? BK_FLOW_NAIVE : BK_FLOW_HALVING;
                int n = bk_bwd_flow_schedule(L, s, kind, 0, w, 256);
                assert_int_equal(bk_bwd_flow_schedule(L, s, kind, 0, NULL, 0), n);
                assert_true(n >= 1 && n <= 256);
                int next = 0, leaves = 0, heads = 0;
                int64_t bwd = 0;
                for (int p = 0; p < n; p++) {
                    assert_int_equal(w[p].layer_forwards, w[p].forwards + w[p].backwards);
                    /* back through the pass's layers (naive: from the head down to its leaf) */
                    assert_int_equal(w[p].backwards, (naive ? L : w[p].hi) - w[p].lo);
                    heads += w[p].head;
                    bwd += w[p].backwards;
                    if (w[p].leaf) {
                        assert_int_equal(w[p].lo, next);
                        assert_true(w[p].hi > w[p].lo && w[p].hi - w[p].lo <= s);
                        next = w[p].hi;
                        leaves++;
                    }
                    if (naive) {
                        /* the whole model forward (its last layer too: the head follows) */
                        assert_int_equal(w[p].forwards, L);
                        assert_int_equal(w[p].head, 1);
                        assert_int_equal(w[p].depth, 0);
                    }
                }
                assert_int_equal(next, L);
                if (naive) {
                    assert_int_equal(n, (L + s - 1) / s);
                    int64_t want = 0;
                    for (int lo = 0; lo < L; lo += s)
                        want += L - lo;
                    assert_int_equal(bwd, want);
                } else {
                    /* the root's sweep runs the head, or the one leaf's when L <= s */
                    assert_int_equal(heads, 1);
                    assert_int_equal(w[0].head, 1);
                    assert_int_equal(n, L <= s ? 1 : 2 * leaves - 1);
                }
            }
    int n = bk_bwd_flow_schedule(32, 4, BK_FLOW_HALVING, 0, w, 256);
    assert_int_equal(n, 15);
    /* pass 1: forward through the 32 layers, the head, back through layers 17-32 */
    assert_int_equal(w[0].forwards, 32);
    assert_int_equal(w[0].backwards, 16);
    assert_int_equal(w[0].lo, 16);
    assert_true(w[3].leaf && w[3].lo == 0 && w[3].hi == 4 && w[3].depth == 3);
    assert_true(!w[8].leaf && w[8].depth == 1 && w[8].lo == 24 && w[8].hi == 32);
    /* cap: counts every pass, fills only cap */
    w[2].depth = -7;
    assert_int_equal(bk_bwd_flow_schedule(32, 4, BK_FLOW_HALVING, 0, w, 2), 15);
    assert_int_equal(w[2].depth, -7);
    assert_int_equal(bk_bwd_flow_schedule(0, 4, BK_FLOW_HALVING, 0, w, 256), -1);
    assert_int_equal(bk_bwd_flow_schedule(4, 0, BK_FLOW_NAIVE, 0, w, 256), -1);
}

/* The flow driver (the one the GPU flow runs too) over operations that
 * compute nothing, so any depth of layers can be driven: its measured
 * peak_boundary_bytes is the planned one (bk_bwd_boundary_peak_bytes) for
 * L = 1..40, every leaf size, both flows, F32 elements like the GPU's. The
 * model only lends its config (n_layers changed for the drive, restored). */
static void *fk_alloc(void *x, size_t n)
{
    (void)x;
    return malloc(n);
}
static void fk_free(void *x, void *p)
{
    (void)x;
    free(p);
}
static bk_status fk_embed(void *x, const int32_t *t, int64_t sb)
{
    (void)x, (void)t, (void)sb;
    return BK_OK;
}
static bk_status fk_load(void *x, int b, const void *src, size_t n)
{
    (void)x, (void)b, (void)src, (void)n;
    return BK_OK;
}
static bk_status fk_store(void *x, int b, void *dst, size_t n)
{
    (void)x, (void)b;
    memset(dst, 0, n);
    return BK_OK;
}
static bk_status fk_keep(void *x, int k, int64_t sb)
{
    (void)x, (void)k, (void)sb;
    return BK_OK;
}
static bk_status fk_forward(void *x, int l, int64_t sb)
{
    (void)x, (void)l, (void)sb;
    return BK_OK;
}
static bk_status fk_head(void *x, const int32_t *t, int64_t sb, int64_t seq0)
{
    (void)x, (void)t, (void)sb, (void)seq0;
    return BK_OK;
}
static bk_status fk_backward(void *x, int l, int k, int64_t sb, int taps)
{
    (void)x, (void)l, (void)k, (void)sb, (void)taps;
    return BK_OK;
}
static bk_status fk_deliver(void *x, int l, int k, int64_t s0, int64_t sb)
{
    (void)x, (void)l, (void)k, (void)s0, (void)sb;
    return BK_OK;
}

static void test_boundary_plan_driven(void **state)
{
    (void)state;
    bk_model *m = tu_open_model("tiny-llama3");
    bk_model_config *c = (bk_model_config *)bk_model_get_config(m);
    const int64_t L0 = c->n_layers, S = 3, T = 2;
    const int32_t tok[6] = {1, 2, 3, 4, 5, 6};
    bk_bwd_flow_ops ops;
    memset(&ops, 0, sizeof ops);
    ops.elem_bytes = 4;
    ops.boundary_mem = "memory";
    ops.boundary_alloc = fk_alloc;
    ops.boundary_free = fk_free;
    ops.embed = fk_embed;
    ops.load = fk_load;
    ops.store = fk_store;
    ops.keep = fk_keep;
    ops.forward = fk_forward;
    ops.head = fk_head;
    ops.backward = fk_backward;
    ops.deliver = fk_deliver;
    bk_bwd_flow_cb cb;
    memset(&cb, 0, sizeof cb);
    int checked = 0;
    for (int64_t L = 1; L <= 40; L++) {
        c->n_layers = L;
        for (int leaf = 1; leaf <= L + 1; leaf++)
            for (int fl = 0; fl < 2; fl++) {
              for (int units = 0; units <= (fl ? 0 : 24); units += 1 + (units > 12) * 5) {
                bk_bwd_flow_opts o = {(bk_bwd_flow_kind)fl, leaf, BK_FISHER_MODEL, 1, 2, 0, units};
                bk_bwd_flow_stats st;
                memset(&st, 0, sizeof st);
                assert_int_equal(bk__bwd_flow_drive(&ops, NULL, m, tok, S, T, 2, &o, &cb, &st),
                                 BK_OK);
                const uint64_t want =
                    bk_bwd_boundary_peak_bytes_b(L, fl, leaf, units, S * T, c->hidden, 4);
                if (st.peak_boundary_bytes != want)
                    fail_msg("L %lld leaf %d flow %d units %d: measured %llu, planned %llu",
                             (long long)L, leaf, fl, units,
                             (unsigned long long)st.peak_boundary_bytes,
                             (unsigned long long)want);
                /* within the budget, unless halving's fewest do not fit in it; no more
                 * passes than halving; the schedule counts the passes run */
                const int u = bk_bwd_boundary_units_b(L, fl, leaf, units);
                const int u0 = bk_bwd_boundary_units(L, fl, leaf);
                if (u > units && u != u0)
                    fail_msg("L %lld leaf %d units %d: %d matrices", (long long)L, leaf, units, u);
                assert_true(u >= u0 || fl);
                static bk_bwd_pass_work sw[256];
                const int np = bk_bwd_flow_schedule((int)L, leaf, (bk_bwd_flow_kind)fl, units,
                                                    sw, 256);
                assert_int_equal(np, st.passes);
                int64_t work = 0, work0 = 0;
                for (int p = 0; p < np; p++)
                    work += sw[p].layer_forwards + 2 * sw[p].backwards;
                const int n0 = bk_bwd_flow_schedule((int)L, leaf, (bk_bwd_flow_kind)fl, 0, sw, 256);
                for (int p = 0; p < n0; p++)
                    work0 += sw[p].layer_forwards + 2 * sw[p].backwards;
                /* (a wider split may make more, smaller leaves: more passes, less work) */
                if (work > work0)
                    fail_msg("L %lld leaf %d units %d: work %lld > halving's %lld", (long long)L,
                             leaf, units, (long long)work, (long long)work0);
                checked++;
              }
            }
    }
    c->n_layers = L0;
    assert_true(checked > 5000);
    bk_model_close(m);
}

/* ======================================================== bad input */

static void test_bad_input(void **state)
{
    (void)state;
    bk_model *m = tu_open_model("tiny-llama3");
    const bk_model_config *c = bk_model_get_config(m);
    bk_layer_weights *lw = load_all(m);
    const int64_t S = 1, T = 5, N = S * T, d = c->hidden;
    bk_bwd *bw = NULL;
    assert_int_equal(bk_bwd_create(c, S, T, &bw), BK_OK);
    double *h = calloc((size_t)(N * d), sizeof(double));
    double *dh = calloc((size_t)(N * d), sizeof(double));
    for (int64_t i = 0; i < N * d; i++)
        h[i] = 0.01 * (double)(i % 7);
    /* a NaN in the incoming gradient: stops, naming the layer and module */
    dh[3 * d + 2] = NAN;
    assert_int_equal(bk_bwd_layer_backward(bw, &lw[1], S, h, dh, NULL), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "layer 1 mlp.down_proj"));
    assert_null(strchr(bk_last_error(), '\n'));
    /* an overflow inside the layer */
    for (int64_t i = 0; i < N * d; i++)
        dh[i] = 1e305;
    assert_int_equal(bk_bwd_layer_backward(bw, &lw[1], S, h, dh, NULL), BK_ERR_NONFINITE);
    assert_non_null(strstr(bk_last_error(), "layer 1 "));
    /* too many sequences for the context */
    assert_int_equal(bk_bwd_layer_forward(bw, &lw[0], 2, h), BK_ERR_INVALID_ARG);
    /* the empirical Fisher has no label in sequences of one token */
    int32_t tok[2] = {1, 2};
    bk_bwd_flow_opts o = {BK_FLOW_HALVING, 1, BK_FISHER_EMPIRICAL, 0, 1, 0, 0};
    bk_bwd_flow_cb cb = {NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL};
    bk_bwd_flow_stats st;
    assert_int_equal(bk_bwd_flow_run(m, tok, 2, 1, &o, &cb, &st), BK_ERR_CALIB);
    assert_non_null(strstr(bk_last_error(), "--fisher empirical"));
    o.leaf = 0;
    assert_int_equal(bk_bwd_flow_run(m, tok, 2, 1, &o, &cb, &st), BK_ERR_INVALID_ARG);
    /* token ids outside the vocabulary */
    tok[1] = (int32_t)c->vocab;
    o.leaf = 1;
    o.fisher = BK_FISHER_MODEL;
    assert_int_equal(bk_bwd_flow_run(m, tok, 1, 2, &o, &cb, &st), BK_ERR_CALIB);
    bk_fisher_kind fk;
    bk_bwd_flow_kind fl;
    assert_int_equal(bk_fisher_from_name("empirical", &fk), BK_OK);
    assert_int_equal(fk, BK_FISHER_EMPIRICAL);
    assert_int_equal(bk_fisher_from_name("fisher", &fk), BK_ERR_INVALID_ARG);
    assert_int_equal(bk_bwd_flow_from_name("naive", &fl), BK_OK);
    assert_int_equal(fl, BK_FLOW_NAIVE);
    assert_int_equal(bk_bwd_flow_from_name("yaqa", &fl), BK_ERR_INVALID_ARG);
    free(h);
    free(dh);
    bk_bwd_free(bw);
    free_all(m, lw);
    bk_model_close(m);
}


/* ======================================================== factors from a and g */

/* K-FAC: A = E[a aᵀ], B = E[g gᵀ]; Shampoo: A = R(H) vec(I), B = R(H)ᵀ vec(I)
 * with H = E[a aᵀ ⊗ g gᵀ] built explicitly as an mn x mn matrix. */
static void test_backprop_factors(void **state)
{
    (void)state;
    bk_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = BK_ARCH_LLAMA;
    c.n_layers = 1;
    c.hidden = 4;
    c.intermediate = 6;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 2;
    c.vocab = 10;
    c.max_positions = 16;
    c.rms_eps = 1e-6;
    c.rope_theta = 10000;
    strcpy(c.hidden_act, "silu");
    const int64_t S = 2, T = 3, N = S * T;
    bk_rng rg;
    bk_rng_seed(&rg, 5);
    float *af[BK_MOD_COUNT];
    double *ad[BK_MOD_COUNT], *gd[BK_MOD_COUNT];
    random_taps(&c, N, &rg, af, ad, gd);
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    for (int shampoo = 0; shampoo < 2; shampoo++) {
        bk_hess_acc *acc = NULL;
        assert_int_equal(bk_hess_acc_create(&c, shampoo ? BK_HESS_BACKPROP_SHAMPOO
                                                        : BK_HESS_BACKPROP_KFAC,
                                            shampoo, T, &acc),
                         BK_OK);
        /* every gradient of the layer first (two micro-batches), then the inputs */
        for (int64_t s = 0; s < S; s++)
            for (int i = 0; i < BK_MOD_COUNT; i++)
                assert_int_equal(bk_hess_add_grad(acc, 0, (bk_module)i,
                                                  gd[i] + s * T * mod_out(&c, i),
                                                  ad[i] + s * T * mod_in(&c, i), 1),
                                 BK_OK);
        for (int64_t s = 0; s < S; s++) {
            assert_int_equal(bk_hess_add_attn(acc, &lw, af[BK_MOD_Q] + s * T * c.hidden, NULL,
                                              NULL, 1),
                             BK_OK);
            assert_int_equal(bk_hess_add_o(acc, af[BK_MOD_O] + s * T * 4, 1), BK_OK);
            assert_int_equal(bk_hess_add_mlp(acc, &lw, af[BK_MOD_GATE] + s * T * c.hidden, 1),
                             BK_OK);
            assert_int_equal(bk_hess_add_down(acc, af[BK_MOD_DOWN] + s * T * 6, 1), BK_OK);
        }
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const int64_t n = mod_in(&c, i), m = mod_out(&c, i), mn = m * n;
            const float *A = NULL, *B = NULL;
            assert_int_equal(bk_hess_factors(acc, &lw, (bk_module)i, &A, &B), BK_OK);
            assert_true(A && B);
            double *H = calloc((size_t)(mn * mn), sizeof(double));
            for (int64_t t = 0; t < N; t++) {
                const double *a = ad[i] + t * n, *g = gd[i] + t * m;
                for (int64_t l = 0; l < n; l++)
                    for (int64_t i1 = 0; i1 < m; i1++)
                        for (int64_t l2 = 0; l2 < n; l2++)
                            for (int64_t i2 = 0; i2 < m; i2++)
                                H[(l * m + i1) * mn + l2 * m + i2] +=
                                    a[l] * a[l2] * g[i1] * g[i2] / (double)N;
            }
            double worst = 0, scale = 0;
            for (int64_t l = 0; l < n; l++)
                for (int64_t l2 = 0; l2 < n; l2++) {
                    double e = 0;
                    if (shampoo) {
                        for (int64_t k = 0; k < m; k++)
                            e += H[(l * m + k) * mn + l2 * m + k];
                    } else {
                        for (int64_t t = 0; t < N; t++)
                            e += ad[i][t * n + l] * ad[i][t * n + l2] / (double)N;
                    }
                    worst = fmax(worst, fabs((double)A[l * n + l2] - e));
                    scale = fmax(scale, fabs(e));
                }
            assert_true(worst <= 1e-5 * scale);
            worst = scale = 0;
            for (int64_t i1 = 0; i1 < m; i1++)
                for (int64_t i2 = 0; i2 < m; i2++) {
                    double e = 0;
                    if (shampoo) {
                        for (int64_t l = 0; l < n; l++)
                            e += H[(l * m + i1) * mn + l * m + i2];
                    } else {
                        for (int64_t t = 0; t < N; t++)
                            e += gd[i][t * m + i1] * gd[i][t * m + i2] / (double)N;
                    }
                    worst = fmax(worst, fabs((double)B[i1 * m + i2] - e));
                    scale = fmax(scale, fabs(e));
                }
            assert_true(worst <= 1e-5 * scale);
            free(H);
        }
        /* the same factors from the Grams the GPU flow forms
         * (bk__hess_add_grad_gram: Σ g gᵀ or Σ |a|² g gᵀ per micro-batch, |g|² per token) */
        {
            bk_hess_acc *acc2 = NULL;
            assert_int_equal(bk_hess_acc_create(&c, shampoo ? BK_HESS_BACKPROP_SHAMPOO
                                                             : BK_HESS_BACKPROP_KFAC,
                                                shampoo, T, &acc2),
                             BK_OK);
            for (int64_t s = 0; s < S; s++)
                for (int i = 0; i < BK_MOD_COUNT; i++) {
                    const int64_t n = mod_in(&c, i), m = mod_out(&c, i);
                    double *G = calloc((size_t)(m * m), sizeof(double));
                    double *gw = calloc((size_t)T, sizeof(double));
                    assert_true(G && gw);
                    for (int64_t t = s * T; t < (s + 1) * T; t++) {
                        double na = 0, ng = 0;
                        for (int64_t l = 0; l < n; l++)
                            na += ad[i][t * n + l] * ad[i][t * n + l];
                        for (int64_t l = 0; l < m; l++)
                            ng += gd[i][t * m + l] * gd[i][t * m + l];
                        gw[t - s * T] = ng;
                        for (int64_t i1 = 0; i1 < m; i1++)
                            for (int64_t i2 = i1; i2 < m; i2++) /* upper triangle only */
                                G[i1 * m + i2] += (shampoo ? na : 1.0) * gd[i][t * m + i1] *
                                                  gd[i][t * m + i2];
                    }
                    assert_int_equal(bk__hess_add_grad_gram(acc2, 0, (bk_module)i, G, gw, 1),
                                     BK_OK);
                    free(G);
                    free(gw);
                }
            for (int64_t s = 0; s < S; s++) {
                assert_int_equal(bk_hess_add_attn(acc2, &lw, af[BK_MOD_Q] + s * T * c.hidden,
                                                  NULL, NULL, 1),
                                 BK_OK);
                assert_int_equal(bk_hess_add_o(acc2, af[BK_MOD_O] + s * T * 4, 1), BK_OK);
                assert_int_equal(
                    bk_hess_add_mlp(acc2, &lw, af[BK_MOD_GATE] + s * T * c.hidden, 1), BK_OK);
                assert_int_equal(bk_hess_add_down(acc2, af[BK_MOD_DOWN] + s * T * 6, 1), BK_OK);
            }
            for (int i = 0; i < BK_MOD_COUNT; i++) {
                const int64_t n = mod_in(&c, i), m = mod_out(&c, i);
                const float *A1, *B1, *A2, *B2;
                assert_int_equal(bk_hess_factors(acc, &lw, (bk_module)i, &A1, &B1), BK_OK);
                assert_int_equal(bk_hess_factors(acc2, &lw, (bk_module)i, &A2, &B2), BK_OK);
                double wa = 0, sa = 0, wb = 0, sb = 0;
                for (int64_t k = 0; k < n * n; k++) {
                    wa = fmax(wa, fabs((double)A1[k] - (double)A2[k]));
                    sa = fmax(sa, fabs((double)A1[k]));
                }
                for (int64_t k = 0; k < m * m; k++) {
                    wb = fmax(wb, fabs((double)B1[k] - (double)B2[k]));
                    sb = fmax(sb, fabs((double)B1[k]));
                }
                assert_true(wa <= 1e-6 * sa && wb <= 1e-6 * sb);
            }
            /* errors: a non-finite Gram, Shampoo without token weights, another layer */
            bk_hess_acc_reset(acc2);
            double *G = calloc(64, sizeof(double)), gw[3] = {1, 1, 1};
            G[1] = NAN;
            assert_int_equal(bk__hess_add_grad_gram(acc2, 0, BK_MOD_K, G, gw, 1),
                             BK_ERR_NONFINITE);
            assert_non_null(strstr(bk_last_error(), "layer 0 self_attn.k_proj"));
            G[1] = 0;
            if (shampoo)
                assert_int_equal(bk__hess_add_grad_gram(acc2, 0, BK_MOD_K, G, NULL, 1),
                                 BK_ERR_INVALID_ARG);
            assert_int_equal(bk__hess_add_grad_gram(acc2, 0, BK_MOD_K, G, gw, 1), BK_OK);
            assert_int_equal(bk__hess_add_grad_gram(acc2, 1, BK_MOD_K, G, gw, 1),
                             BK_ERR_INVALID_ARG);
            free(G);
            bk_hess_acc_free(acc2);
        }
        /* errors: a gradient of another layer; factors after reset */
        assert_int_equal(bk_hess_add_grad(acc, 1, BK_MOD_Q, gd[0], ad[0], 1), BK_ERR_INVALID_ARG);
        bk_hess_acc_reset(acc);
        const float *A, *B;
        assert_int_equal(bk_hess_factors(acc, &lw, BK_MOD_O, &A, &B), BK_ERR_CALIB);
        if (shampoo) /* inputs before their gradients */
            assert_int_equal(bk_hess_add_o(acc, af[BK_MOD_O], 1), BK_ERR_INVALID_ARG);
        gd[BK_MOD_UP][5] = INFINITY;
        assert_int_equal(bk_hess_add_grad(acc, 0, BK_MOD_UP, gd[BK_MOD_UP], ad[BK_MOD_UP], 1),
                         BK_ERR_NONFINITE);
        assert_non_null(strstr(bk_last_error(), "layer 0 mlp.up_proj"));
        gd[BK_MOD_UP][5] = 0.5;
        bk_hess_acc_free(acc);
    }
    bk_hess_acc *gptq = NULL;
    assert_int_equal(bk_hess_acc_create(&c, BK_HESS_GPTQ, 0, T, &gptq), BK_OK);
    assert_int_equal(bk_hess_add_grad(gptq, 0, BK_MOD_Q, gd[0], ad[0], 1), BK_ERR_INVALID_ARG);
    {
        double G[64] = {0}, gw[3] = {1, 1, 1};
        assert_int_equal(bk__hess_add_grad_gram(gptq, 0, BK_MOD_Q, G, gw, 1), BK_ERR_INVALID_ARG);
    }
    bk_hess_acc_free(gptq);
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        free(af[i]);
        free(ad[i]);
        free(gd[i]);
    }
}

/* ---------------------------------------------- MPI ranks: the ordered pass
 * The sums the ranks exchange, as src/quantize_ranks.c passes them (one
 * "pipe" of buffers: a send appends copies, a receive takes them back in
 * order). The backprop kinds' pattern with the GPU flow (each rank's device
 * Grams start from the output-gradient sums of the ranks before, taken from
 * the host accumulator; the input side passed on stage by stage; each rank's
 * Shampoo weights its own) gives factors equal to one process's, byte for
 * byte. The GPU stages' accumulator follows the same steps (bk_ghess_sums,
 * bk__hess_bp_sum_items, own rows for the token weights). */
typedef struct pipe {
    void *buf[64];
    size_t bytes[64];
    int n, next, recv;
} pipe;

static bk_status pipe_fn(void *user, void *buf, size_t n, int f64)
{
    pipe *p = user;
    const size_t bytes = n * (f64 ? sizeof(double) : sizeof(float));
    if (p->recv) {
        assert_true(p->next < p->n);
        assert_int_equal(p->bytes[p->next], bytes);
        memcpy(buf, p->buf[p->next], bytes);
        free(p->buf[p->next++]);
        return BK_OK;
    }
    assert_true(p->n < 64);
    p->buf[p->n] = malloc(bytes ? bytes : 1);
    assert_non_null(p->buf[p->n]);
    memcpy(p->buf[p->n], buf, bytes);
    p->bytes[p->n++] = bytes;
    return BK_OK;
}

static void pipe_reset(pipe *p, int recv)
{
    if (!recv) {
        assert_int_equal(p->next, p->n); /* everything sent was received */
        memset(p, 0, sizeof *p);
    }
    p->recv = recv;
}

static void tiny_llama(bk_model_config *c)
{
    memset(c, 0, sizeof *c);
    c->arch = BK_ARCH_LLAMA;
    c->n_layers = 1;
    c->hidden = 4;
    c->intermediate = 6;
    c->n_heads = 2;
    c->n_kv_heads = 1;
    c->head_dim = 2;
    c->vocab = 10;
    c->max_positions = 16;
    c->rms_eps = 1e-6;
    c->rope_theta = 10000;
    strcpy(c->hidden_act, "silu");
}

static void test_bp_sum_items(void **state)
{
    (void)state;
    int it[BK_HESS_BP_SUM_ITEMS];
    const unsigned qkv = 1u << BK_MOD_Q | 1u << BK_MOD_K | 1u << BK_MOD_V;
    /* K-FAC: the group's Gram once */
    assert_int_equal(bk__hess_bp_sum_items(qkv, 0, 1, it), 1);
    assert_int_equal(it[0], -1 - G_ATTN);
    assert_int_equal(bk__hess_bp_sum_items(1u << BK_MOD_DOWN, 0, 1, it), 1);
    assert_int_equal(it[0], -1 - G_DOWN);
    /* Shampoo: one per module, the plain Gram first when kept */
    assert_int_equal(bk__hess_bp_sum_items(qkv, 1, 0, it), 3);
    assert_int_equal(it[0], BK_MOD_Q);
    assert_int_equal(it[2], BK_MOD_V);
    assert_int_equal(bk__hess_bp_sum_items(1u << BK_MOD_GATE | 1u << BK_MOD_UP, 1, 1, it), 3);
    assert_int_equal(it[0], -1 - G_MLP);
    assert_int_equal(it[1], BK_MOD_GATE);
    assert_int_equal(it[2], BK_MOD_UP);
    /* every module (--no-sequential): groups in order, at most the bound */
    assert_int_equal(bk__hess_bp_sum_items((1u << BK_MOD_COUNT) - 1, 1, 1, it),
                     G_COUNT + BK_MOD_COUNT);
    assert_int_equal(it[0], -1 - G_ATTN);
    assert_int_equal(it[4], -1 - G_O);
    assert_int_equal(it[5], BK_MOD_O);
    assert_int_equal(it[G_COUNT + BK_MOD_COUNT - 1], BK_MOD_DOWN);
    assert_int_equal(bk__hess_bp_sum_items((1u << BK_MOD_COUNT) - 1, 0, 1, it), G_COUNT);
    /* the counts of the groups only */
    int grp[G_COUNT] = {0, 1, 0, 1};
    int64_t cnt[G_COUNT] = {5, 6, 7, 8}, back[G_COUNT] = {0, 0, 0, 0};
    double sc[G_COUNT];
    assert_int_equal(bk__hess_bp_counts_pack(grp, cnt, sc), 2);
    assert_true(sc[0] == 6 && sc[1] == 8);
    bk__hess_bp_counts_unpack(grp, sc, back);
    assert_true(back[0] == 0 && back[1] == 6 && back[2] == 0 && back[3] == 8);
}

static void test_bp_rank_pass(void **state)
{
    (void)state;
    bk_model_config c;
    tiny_llama(&c);
    const int64_t S = 2, T = 3, N = S * T; /* rank 0: sequence 0, rank 1: sequence 1 */
    bk_rng rg;
    bk_rng_seed(&rg, 11);
    float *af[BK_MOD_COUNT];
    double *ad[BK_MOD_COUNT], *gd[BK_MOD_COUNT];
    random_taps(&c, N, &rg, af, ad, gd);
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    const unsigned stage[4] = {1u << BK_MOD_Q | 1u << BK_MOD_K | 1u << BK_MOD_V, 1u << BK_MOD_O,
                               1u << BK_MOD_GATE | 1u << BK_MOD_UP, 1u << BK_MOD_DOWN};
    for (int shampoo = 0; shampoo < 2; shampoo++) {
        const bk_hessian_kind kind = shampoo ? BK_HESS_BACKPROP_SHAMPOO : BK_HESS_BACKPROP_KFAC;
        bk_hess_acc *one = NULL, *r[2] = {NULL, NULL};
        assert_int_equal(bk_hess_acc_create(&c, kind, 1, T, &one), BK_OK);
        for (int k = 0; k < 2; k++)
            assert_int_equal(bk_hess_acc_create(&c, kind, 1, T, &r[k]), BK_OK);
        /* the flow's Gram of sequence s (the device SYRK of one micro-batch)
         * added onto G, and its token weights */
        double *G[2][BK_MOD_COUNT], *gw[2][BK_MOD_COUNT];
        for (int i = 0; i < BK_MOD_COUNT; i++)
            for (int k = 0; k < 2; k++) {
                const int64_t m = mod_out(&c, i);
                G[k][i] = calloc((size_t)(m * m), sizeof(double));
                gw[k][i] = calloc((size_t)T, sizeof(double));
            }
#define SEQ_GRAM(dst, gws, i, s)                                                              \
    do {                                                                                      \
        const int64_t n_ = mod_in(&c, i), m_ = mod_out(&c, i);                                \
        for (int64_t t = (s) * T; t < ((s) + 1) * T; t++) {                                   \
            double na = 0, ng = 0;                                                            \
            for (int64_t l = 0; l < n_; l++)                                                  \
                na += ad[i][t * n_ + l] * ad[i][t * n_ + l];                                  \
            for (int64_t l = 0; l < m_; l++)                                                  \
                ng += gd[i][t * m_ + l] * gd[i][t * m_ + l];                                  \
            (gws)[t - (s) * T] = ng;                                                          \
            for (int64_t i1 = 0; i1 < m_; i1++)                                               \
                for (int64_t i2 = i1; i2 < m_; i2++)                                          \
                    (dst)[i1 * m_ + i2] +=                                                    \
                        (shampoo ? na : 1.0) * gd[i][t * m_ + i1] * gd[i][t * m_ + i2];       \
        }                                                                                     \
    } while (0)
        /* one process: both micro-batches onto one Gram, delivered once */
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const int64_t m = mod_out(&c, i);
            double *Gs = calloc((size_t)(m * m), sizeof(double)), *w = calloc((size_t)N, 8);
            SEQ_GRAM(Gs, w, i, 0);
            SEQ_GRAM(Gs, w + T, i, 1);
            assert_int_equal(bk__hess_add_grad_gram(one, 0, (bk_module)i, Gs, w, S), BK_OK);
            free(Gs);
            free(w);
        }
        for (int64_t s = 0; s < S; s++) {
            assert_int_equal(
                bk_hess_add_attn(one, &lw, af[BK_MOD_Q] + s * T * c.hidden, NULL, NULL, 1), BK_OK);
            assert_int_equal(bk_hess_add_o(one, af[BK_MOD_O] + s * T * 4, 1), BK_OK);
            assert_int_equal(bk_hess_add_mlp(one, &lw, af[BK_MOD_GATE] + s * T * c.hidden, 1),
                             BK_OK);
            assert_int_equal(bk_hess_add_down(one, af[BK_MOD_DOWN] + s * T * 6, 1), BK_OK);
        }
        /* two ranks, ordered. Output side: rank 0 delivers its Grams; they go
         * to rank 1, whose flow starts from them (grams_start: taken from the
         * host accumulator) and adds its micro-batch; the last rank's sums go
         * back to rank 0 (the broadcast) */
        pipe p;
        memset(&p, 0, sizeof p);
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            SEQ_GRAM(G[0][i], gw[0][i], i, 0);
            assert_int_equal(bk__hess_add_grad_gram(r[0], 0, (bk_module)i, G[0][i], gw[0][i], 1),
                             BK_OK);
        }
        assert_int_equal(bk__hess_bp_grad_sums(r[0], 0, pipe_fn, &p), BK_OK);
        pipe_reset(&p, 1);
        assert_int_equal(bk__hess_bp_grad_sums(r[1], 0, pipe_fn, &p), BK_OK);
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            int set = 0;
            assert_int_equal(bk__hess_bp_grad_take(r[1], (bk_module)i, G[1][i], &set), BK_OK);
            assert_int_equal(set, 1);
            SEQ_GRAM(G[1][i], gw[1][i], i, 1);
            assert_int_equal(bk__hess_add_grad_gram(r[1], 0, (bk_module)i, G[1][i], gw[1][i], 1),
                             BK_OK);
        }
        pipe_reset(&p, 0);
        assert_int_equal(bk__hess_bp_grad_sums(r[1], 0, pipe_fn, &p), BK_OK);
        pipe_reset(&p, 1);
        assert_int_equal(bk__hess_bp_grad_sums(r[0], 0, pipe_fn, &p), BK_OK);
        pipe_reset(&p, 0);
        /* input side, stage by stage: rank 0 adds its sequence, passes the
         * sums on; rank 1 adds its own onto them (its token weights from its
         * first row: the rows received are rank 0's) and broadcasts */
        for (int g = 0; g < 4; g++) {
            for (int k = 0; k < 2; k++) {
                if (k == 1) {
                    pipe_reset(&p, 1);
                    assert_int_equal(bk_hess_acc_sums(r[1], stage[g], pipe_fn, &p), BK_OK);
                    pipe_reset(&p, 0);
                }
                bk_status st = BK_OK;
                switch (g) {
                case 0:
                    st = bk_hess_add_attn(r[k], &lw, af[BK_MOD_Q] + k * T * c.hidden, NULL, NULL,
                                          1);
                    break;
                case 1: st = bk_hess_add_o(r[k], af[BK_MOD_O] + k * T * 4, 1); break;
                case 2: st = bk_hess_add_mlp(r[k], &lw, af[BK_MOD_GATE] + k * T * c.hidden, 1); break;
                default: st = bk_hess_add_down(r[k], af[BK_MOD_DOWN] + k * T * 6, 1); break;
                }
                assert_int_equal(st, BK_OK);
                assert_int_equal(bk_hess_acc_sums(r[k], stage[g], pipe_fn, &p), BK_OK);
            }
            pipe_reset(&p, 1); /* rank 0 receives rank 1's (the broadcast) */
            assert_int_equal(bk_hess_acc_sums(r[0], stage[g], pipe_fn, &p), BK_OK);
            pipe_reset(&p, 0);
        }
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            const int64_t n = mod_in(&c, i), m = mod_out(&c, i);
            const float *A1, *B1;
            assert_int_equal(bk_hess_factors(one, &lw, (bk_module)i, &A1, &B1), BK_OK);
            for (int k = 0; k < 2; k++) {
                const float *A2, *B2;
                assert_int_equal(bk_hess_factors(r[k], &lw, (bk_module)i, &A2, &B2), BK_OK);
                assert_memory_equal(A1, A2, (size_t)(n * n) * sizeof(float));
                assert_memory_equal(B1, B2, (size_t)(m * m) * sizeof(float));
            }
        }
#undef SEQ_GRAM
        for (int i = 0; i < BK_MOD_COUNT; i++)
            for (int k = 0; k < 2; k++) {
                free(G[k][i]);
                free(gw[k][i]);
            }
        bk_hess_acc_free(one);
        bk_hess_acc_free(r[0]);
        bk_hess_acc_free(r[1]);
    }
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        free(af[i]);
        free(ad[i]);
        free(gd[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fd_llama3),
        cmocka_unit_test(test_fd_qwen2),
        cmocka_unit_test(test_fd_qwen3),
        cmocka_unit_test(test_golden_llama3),
        cmocka_unit_test(test_golden_qwen2),
        cmocka_unit_test(test_golden_qwen3),
        cmocka_unit_test(test_golden_kerneldocs),
        cmocka_unit_test(test_loss_matches_fp32_forward),
        cmocka_unit_test(test_sampled_labels),
        cmocka_unit_test(test_flows_kerneldocs),
        cmocka_unit_test(test_flows_qwen3),
        cmocka_unit_test(test_flow_schedule),
        cmocka_unit_test(test_boundary_plan_driven),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_backprop_factors),
        cmocka_unit_test(test_bp_sum_items),
        cmocka_unit_test(test_bp_rank_pass),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
