/* The stages dispatcher (bk_backend_stages_create, src/backend.c) with a
 * fake backend table (suite cpu; no GPU needed): the CPU backend's table with
 * its stages_create replaced by one that
 *   - returns BK_ERR_UNSUPPORTED (after scribbling on *batch, *ops, *ctx):
 *     the CPU stages run the job, for the micro-batch asked for, their
 *     describe names the fake's reason, and they give the same factors as
 *     the CPU stages created directly (bitwise: the same code on the same
 *     inputs);
 *   - returns another error (BK_ERR_DEVICE_OOM): that error, nothing created;
 *   - succeeds: its own stages, no fallback;
 * and p->cpu = 1 or a NULL backend never reach the fake. The CPU stages
 * created directly describe themselves as "" (report.json unchanged).
 * The CPU stages' prepare_next (the next module's heads-up) does nothing:
 * the factors after it are those before it, bit for bit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"
#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "test_check.h"

/* ------------------------------------------------------- the fake backend */

static int g_calls;               /* fake stages_create calls */
static bk_status g_answer;        /* what it returns */
static const bk_stage_ops g_own = {.name = "fake"}; /* its "own" stages (never driven) */
static int g_own_ctx;

static bk_status fake_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                                    const bk_stage_ops **ops, void **ctx)
{
    (void)b;
    (void)p;
    g_calls++;
    if (g_answer == BK_OK) {
        *ops = &g_own;
        *ctx = &g_own_ctx;
        return BK_OK;
    }
    /* a backend that got halfway: the dispatcher must not trust these */
    *batch = 12345;
    *ops = &g_own;
    *ctx = &g_own_ctx;
    return g_answer == BK_ERR_UNSUPPORTED
               ? bk_error(BK_ERR_UNSUPPORTED, "fake has no stages for --hessian %s",
                          bk_hessian_name(p->kind))
               : bk_error(g_answer, "fake: out of device memory");
}

/* Drive stages through layer 0's stage QKV and return q_proj's A (a copy). */
static float *factor_q(const bk_stage_ops *ops, void *ctx, const bk_model *m,
                       const int32_t *tok, int64_t S, int64_t B, bk_layer_weights *lw)
{
    for (int64_t s0 = 0; s0 < S; s0 += B)
        OK(ops->embed(ctx, tok, s0, S - s0 < B ? S - s0 : B));
    OK(ops->layer_begin(ctx, lw, lw, 1));
    double tf = 0, th = 0;
    for (int64_t s0 = 0; s0 < S; s0 += B)
        OK(ops->run(ctx, BK_STAGE_QKV, s0, S - s0 < B ? S - s0 : B, &tf, &th));
    const float *A = NULL, *Bf = NULL, *P = NULL;
    OK(ops->factors(ctx, BK_MOD_Q, &A, &Bf, &P));
    const int64_t n = bk_model_get_config(m)->hidden;
    float *out = malloc(sizeof(float) * (size_t)(n * n));
    if (!out || !A)
        exit(1);
    memcpy(out, A, sizeof(float) * (size_t)(n * n));
    /* the CPU stages hear of the next module (bk_stage_ops.prepare_next, as
     * the driver calls it between q's factors and q's solve) and do nothing:
     * the factors stay as they were, bit for bit */
    CHECK(ops->prepare_next != NULL, "the %s stages have no prepare_next", ops->name);
    if (ops->prepare_next) {
        bk_solve_opts so;
        bk_solve_opts_default(&so);
        ops->prepare_next(ctx, BK_MOD_K, &so);
        const float *A2 = NULL, *B2 = NULL, *P2 = NULL;
        OK(ops->factors(ctx, BK_MOD_Q, &A2, &B2, &P2));
        CHECK(A2 && memcmp(A2, out, sizeof(float) * (size_t)(n * n)) == 0,
              "prepare_next: q_proj's A changed on the %s stages", ops->name);
        CHECK(bk_last_error()[0] == 0, "prepare_next: an error was set: %s", bk_last_error());
    }
    ops->layer_end(ctx);
    return out;
}

int main(void)
{
    const char *root = getenv("BK_SOURCE_ROOT");
    char dir[4096], calib[4200];
    snprintf(dir, sizeof dir, "%s/examples/kerneldocs-1.6m", root ? root : ".");
    snprintf(calib, sizeof calib, "%s/calib.safetensors", dir);
    bk_model *m = NULL;
    OK(bk_model_open(dir, &m));
    int32_t *tok = NULL;
    int64_t S = 0, T = 0;
    OK(bk_load_tokens(calib, bk_model_get_config(m)->vocab, 3, 16, &tok, &S, &T));
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    OK(bk_layer_weights_load(m, 0, &lw));

    bk_backend *b = NULL;
    OK(bk_backend_create(BK_BACKEND_CPU, &b));
    const bk_backend_ops *cpu_table = b->ops;
    bk_backend_ops fake = *cpu_table;
    fake.name = "fake";
    fake.stages_create = fake_stages_create;
    b->ops = &fake;
    CHECK(bk_backend_supports(b, BK_OP_STAGES), "the fake table's stages are not its own");

    const bk_stage_params p = {.model = m, .kind = BK_HESS_MLPLOCAL_KFAC, .S = S, .T = T,
                               .sequential = 1};
    const bk_stage_ops *ops = NULL;
    void *ctx = NULL;

    /* the reference: the CPU stages created directly (micro-batch 2) */
    int64_t batch = 2;
    OK(bk_cpu_stages_create(b, &p, &batch, &ops, &ctx));
    CHECK(bk_cpu_stages_are(ops), "bk_cpu_stages_are: not the CPU stages");
    CHECK(strcmp(ops->describe(ctx), "") == 0, "the CPU stages describe themselves as '%s'",
          ops->describe(ctx));
    const int64_t B = batch;
    float *ref = factor_q(ops, ctx, m, tok, S, B, &lw);
    ops->destroy(ctx);

    /* unsupported: the CPU stages, the micro-batch asked for, the reason */
    g_calls = 0;
    g_answer = BK_ERR_UNSUPPORTED;
    batch = 2;
    bk_status st = bk_backend_stages_create(b, &p, &batch, &ops, &ctx);
    CHECK(st == BK_OK, "fallback: status %d (%s)", (int)st, bk_last_error());
    CHECK(g_calls == 1, "fallback: the fake was called %d times", g_calls);
    if (st == BK_OK) {
        CHECK(bk_cpu_stages_are(ops), "fallback: not the CPU stages (%s)", ops->name);
        CHECK(batch == B, "fallback: micro-batch %lld (the CPU's for 2: %lld)", (long long)batch,
              (long long)B);
        const char *d = ops->describe(ctx);
        printf("fallback describe: %s\n", d);
        CHECK(strcmp(d, "stages on the CPU (fake has no stages for --hessian mlplocal-kfac)") == 0,
              "fallback: describe '%s'", d);
        CHECK(bk_last_error()[0] == 0, "fallback: the error was left set: %s", bk_last_error());
        if (bk_cpu_stages_are(ops)) {
            const int64_t n = bk_model_get_config(m)->hidden;
            float *got = factor_q(ops, ctx, m, tok, S, B, &lw);
            CHECK(memcmp(got, ref, sizeof(float) * (size_t)(n * n)) == 0,
                  "fallback: q_proj's A differs from the CPU stages' own");
            free(got);
            ops->destroy(ctx);
        }
    }

    /* another error: returned as it is, nothing created */
    g_calls = 0;
    g_answer = BK_ERR_DEVICE_OOM;
    batch = 2;
    st = bk_backend_stages_create(b, &p, &batch, &ops, &ctx);
    CHECK(st == BK_ERR_DEVICE_OOM, "device OOM: status %d, not BK_ERR_DEVICE_OOM", (int)st);
    CHECK(g_calls == 1, "device OOM: the fake was called %d times", g_calls);
    CHECK(strstr(bk_last_error(), "fake: out of device memory") != NULL,
          "device OOM: message '%s'", bk_last_error());
    bk_clear_error();

    /* success: the fake's own stages */
    g_calls = 0;
    g_answer = BK_OK;
    batch = 2;
    st = bk_backend_stages_create(b, &p, &batch, &ops, &ctx);
    CHECK(st == BK_OK && ops == &g_own && ctx == &g_own_ctx && g_calls == 1,
          "own stages: status %d, ops %s, %d calls", (int)st, ops ? ops->name : "NULL", g_calls);

    /* p->cpu and a NULL backend never reach the fake */
    g_calls = 0;
    bk_stage_params pc = p;
    pc.cpu = 1;
    batch = 2;
    OK(bk_backend_stages_create(b, &pc, &batch, &ops, &ctx));
    CHECK(g_calls == 0 && bk_cpu_stages_are(ops) && strcmp(ops->describe(ctx), "") == 0,
          "p->cpu: %d fake calls, stages %s, describe '%s'", g_calls, ops->name,
          ops->describe(ctx));
    ops->destroy(ctx);
    batch = 2;
    OK(bk_backend_stages_create(NULL, &p, &batch, &ops, &ctx));
    CHECK(bk_cpu_stages_are(ops) && strcmp(ops->describe(ctx), "") == 0,
          "NULL backend: stages %s, describe '%s'", ops->name, ops->describe(ctx));
    ops->destroy(ctx);

    b->ops = cpu_table;
    bk_backend_destroy(b);
    free(ref);
    bk_layer_weights_free(&lw);
    free(tok);
    bk_model_close(m);
    printf("%s\n", g_fail ? "FAILED" : "ok");
    return g_fail ? 1 : 0;
}
