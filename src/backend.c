#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "backend_impl.h"
#include "bk_config.h"

bk_status bk_backend_kind_from_name(const char *name, bk_backend_kind *out)
{
    if (!strcmp(name, "auto"))
        *out = BK_BACKEND_AUTO;
    else if (!strcmp(name, "cpu"))
        *out = BK_BACKEND_CPU;
    else if (!strcmp(name, "cuda"))
        *out = BK_BACKEND_CUDA;
    else
        return bk_error(BK_ERR_INVALID_ARG, "unknown backend '%s' (expected auto, cpu or cuda)",
                        name);
    return BK_OK;
}

bk_status bk_gemm_math_from_name(const char *name, bk_gemm_math *out)
{
    if (!strcmp(name, "fp32"))
        *out = BK_GEMM_FP32;
    else if (!strcmp(name, "tf32"))
        *out = BK_GEMM_TF32;
    else if (!strcmp(name, "bf16"))
        *out = BK_GEMM_BF16;
    else if (!strcmp(name, "auto"))
        *out = BK_GEMM_AUTO;
    else
        return bk_error(BK_ERR_INVALID_ARG,
                        "unknown GEMM arithmetic '%s' (expected auto, fp32, tf32 or bf16)", name);
    return BK_OK;
}

const char *bk_gemm_math_name(bk_gemm_math m)
{
    return m == BK_GEMM_TF32   ? "tf32"
           : m == BK_GEMM_BF16 ? "bf16"
           : m == BK_GEMM_AUTO ? "auto"
                               : "fp32";
}

void bk_backend_set_gemm_math(bk_backend *b, bk_gemm_math m)
{
    if (b)
        b->gemm_math = (m == BK_GEMM_TF32 || m == BK_GEMM_BF16) ? m : BK_GEMM_FP32;
}

bk_gemm_math bk_backend_gemm_math(const bk_backend *b)
{
    return b ? b->gemm_math : BK_GEMM_FP32;
}

bk_gemm_math bk_gemm_math_resolve(const bk_model *m, bk_gemm_math want)
{
    if (want != BK_GEMM_AUTO)
        return want;
    const bk_tensor_info *t = m ? bk_model_find(m, 0, "self_attn.q_proj.weight") : NULL;
    return t && t->dtype == BK_DT_BF16 ? BK_GEMM_BF16 : BK_GEMM_TF32;
}

int bk_cuda_compiled(void)
{
    return BK_HAVE_CUDA;
}

int bk_cuda_device_count(void)
{
#if BK_HAVE_CUDA
    return bk_cuda_count_devices();
#else
    return 0;
#endif
}

int bk_backend_device_uuid(const bk_backend *b, unsigned char uuid[16])
{
#if BK_HAVE_CUDA
    if (b && b->kind == BK_BACKEND_CUDA)
        return bk_cuda_device_uuid(b->params.device, uuid);
#endif
    (void)b, (void)uuid;
    return 0;
}

void bk_backend_params_default(bk_backend_params *p)
{
    memset(p, 0, sizeof *p);
    p->device = 0;
    p->factor_fp64 = 0;
    p->mem_limit = 0;
    p->keep_down = 1;
    p->residual_host = 0;
    /* the GPU input-side stages of the backprop kinds (device Grams, 884140f;
     * fixed in 8a30b7d, cuda suite passed on the H200 at bbc5eac) */
    p->bwd_input_cpu = 0;
}

/* A two-valued setting: v0 (*out 0) or v1 (*out 1). */
static bk_status parse_pair(const char *key, const char *v, const char *v0, const char *v1,
                            int *out)
{
    if (!strcmp(v, v0) || !strcmp(v, v1)) {
        *out = !strcmp(v, v1);
        return BK_OK;
    }
    return bk_error(BK_ERR_INVALID_ARG, "setting %s: expected %s or %s (got '%s')", key, v0, v1,
                    v);
}

bk_status bk_backend_params_set(bk_backend_params *p, const char *key, const char *value)
{
    if (!strcmp(key, "device")) {
        char *end = NULL;
        long v = strtol(value, &end, 10);
        if (end == value || *end || v < 0 || v > 1023)
            return bk_error(BK_ERR_INVALID_ARG,
                            "setting device: expected a device number in [0, 1023] (got '%s')",
                            value);
        p->device = (int)v;
        return BK_OK;
    }
    if (!strcmp(key, "mem_limit")) {
        char *end = NULL;
        unsigned long long v = 0;
        if (value[0] >= '0' && value[0] <= '9') /* strtoull would take "-1" */
            v = strtoull(value, &end, 10);
        if (!end || *end)
            return bk_error(BK_ERR_INVALID_ARG,
                            "setting mem_limit: expected a number of bytes (got '%s')", value);
        p->mem_limit = (size_t)v;
        return BK_OK;
    }
    /* the two-valued settings: value v0 -> field 0, v1 -> 1 */
    static const struct {
        const char *key, *v0, *v1;
        size_t field;
    } pairs[] = {{"factor_fp64", "0", "1", offsetof(bk_backend_params, factor_fp64)},
                 {"keep_down", "0", "1", offsetof(bk_backend_params, keep_down)},
                 {"bwd_input", "gpu", "cpu", offsetof(bk_backend_params, bwd_input_cpu)},
                 {"residual", "auto", "host", offsetof(bk_backend_params, residual_host)}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        if (!strcmp(key, pairs[i].key))
            return parse_pair(key, value, pairs[i].v0, pairs[i].v1,
                              (int *)((char *)p + pairs[i].field));
    return bk_error(BK_ERR_INVALID_ARG,
                    "unknown setting '%s' (expected device, factor_fp64, mem_limit, keep_down, "
                    "residual or bwd_input)",
                    key);
}

bk_status bk_backend_params_parse(bk_backend_params *p, const char *key_value)
{
    const char *eq = strchr(key_value, '=');
    char key[64];
    if (!eq || eq == key_value || (size_t)(eq - key_value) >= sizeof key)
        return bk_error(BK_ERR_INVALID_ARG, "setting '%s': expected KEY=VALUE", key_value);
    memcpy(key, key_value, (size_t)(eq - key_value));
    key[eq - key_value] = 0;
    return bk_backend_params_set(p, key, eq + 1);
}

void bk_cuda_tuning_default(bk_cuda_tuning *t)
{
    t->tile = 64;
    t->solve_wc = 16;
    t->overlap = 1;
    t->side_band = -1;
    t->far_async = 1;
    t->push_split = 2;
    t->push_group = 4;
    t->partition = -1;
    t->push_mma = 1;    /* session 15: measured in the 8B pipeline (docs/BENCHMARKS.md) */
    t->solve_chain = 1; /* sessions 15 and 19: same codes bit for bit, faster solves */
}

bk_status bk_cuda_tuning_check(const bk_cuda_tuning *t)
{
    const char *bad = NULL, *want = NULL;
    int v = 0;
    if (t->tile != 32 && t->tile != 64)
        bad = "tile", want = "32 or 64", v = t->tile;
    else if (t->solve_wc != 8 && t->solve_wc != 16)
        bad = "solve_wc", want = "8 or 16", v = t->solve_wc;
    else if (t->overlap != 0 && t->overlap != 1)
        bad = "overlap", want = "0 or 1", v = t->overlap;
    else if (t->side_band < -1 || t->side_band > 1)
        bad = "side_band", want = "-1 (auto), 0 or 1", v = t->side_band;
    else if (t->far_async != 0 && t->far_async != 1)
        bad = "far_async", want = "0 or 1", v = t->far_async;
    else if (t->push_split != 1 && t->push_split != 2)
        bad = "push_split", want = "1 or 2", v = t->push_split;
    else if (t->push_group < 0 || t->push_group > 64)
        bad = "push_group", want = "an integer in [0, 64]", v = t->push_group;
    else if (t->partition < -1 || t->partition > 4096)
        bad = "partition", want = "-1 (auto), 0 or a number of SMs up to 4096", v = t->partition;
    else if (t->push_mma < 0 || t->push_mma > 2)
        bad = "push_mma", want = "0, 1 or 2", v = t->push_mma;
    else if (t->solve_chain != 0 && t->solve_chain != 1)
        bad = "solve_chain", want = "0 or 1", v = t->solve_chain;
    if (bad)
        return bk_error(BK_ERR_INVALID_ARG, "CUDA tuning %s: expected %s (got %d)", bad, want, v);
    return BK_OK;
}

#if !BK_HAVE_CUDA
bk_status bk_cuda_backend_tune(bk_backend *b, const bk_cuda_tuning *t)
{
    (void)b;
    (void)t;
    return bk_error(BK_ERR_INVALID_ARG, "CUDA tuning: not a CUDA backend (no CUDA in this build)");
}
#endif

bk_status bk_backend_create_params(bk_backend_kind kind, const bk_backend_params *params,
                                   bk_backend **out)
{
    *out = NULL;
    bk_backend *b = calloc(1, sizeof *b);
    if (!b)
        return bk_error(BK_ERR_NOMEM, "out of memory creating a backend");
    if (params)
        b->params = *params;
    else
        bk_backend_params_default(&b->params);
    bk_status st;
    if (kind == BK_BACKEND_AUTO)
        kind = bk_cuda_device_count() > 0 ? BK_BACKEND_CUDA : BK_BACKEND_CPU;
    if (kind == BK_BACKEND_CUDA) {
#if BK_HAVE_CUDA
        const int nd = bk_cuda_count_devices();
        if (nd <= 0) {
            free(b);
            return bk_error(BK_ERR_NO_DEVICE,
                            "backend cuda: no usable CUDA device (no GPU or no driver); "
                            "use --backend cpu");
        }
        if (b->params.device >= nd) {
            const int d = b->params.device;
            free(b);
            return bk_error(BK_ERR_NO_DEVICE,
                            "backend cuda: setting device=%d, but there %s %d CUDA device%s", d,
                            nd == 1 ? "is" : "are", nd, nd == 1 ? "" : "s");
        }
        st = bk_cuda_backend_init(b);
#else
        free(b);
        return bk_error(BK_ERR_NO_DEVICE,
                        "backend cuda: this build has no CUDA backend (rebuild with "
                        "-Dcuda=enabled); use --backend cpu");
#endif
    } else {
        st = bk_cpu_backend_init(b);
    }
    if (st != BK_OK) {
        free(b);
        return st;
    }
    b->kind = kind;
    *out = b;
    return BK_OK;
}

bk_status bk_backend_create(bk_backend_kind kind, bk_backend **out)
{
    return bk_backend_create_params(kind, NULL, out);
}

const bk_backend_params *bk_backend_get_params(const bk_backend *b)
{
    return &b->params;
}

void bk_backend_destroy(bk_backend *b)
{
    if (!b)
        return;
    if (b->ops && b->ops->destroy)
        b->ops->destroy(b->ctx);
    free(b);
}

const char *bk_backend_name(const bk_backend *b)
{
    return b->ops->name;
}

const char *bk_backend_device(const bk_backend *b)
{
    return b->device;
}

bk_status bk_backend_solve(bk_backend *b, const bk_solve_problem *p, const bk_solve_opts *o,
                           bk_solve_result *r)
{
    if (!b->ops->solve)
        return bk_error(BK_ERR_UNSUPPORTED, "backend %s: solve is not supported", b->ops->name);
    return b->ops->solve(b->ctx, p, o, r);
}

size_t bk_backend_peak_memory(const bk_backend *b)
{
    return b->ops->peak_memory ? b->ops->peak_memory(b->ctx) : 0;
}

void bk_backend_reset_peak_memory(bk_backend *b)
{
    if (b->ops->reset_peak_memory)
        b->ops->reset_peak_memory(b->ctx);
}

int bk_backend_supports(const bk_backend *b, bk_backend_op op)
{
    const bk_backend_ops *o = b->ops;
    switch (op) {
    case BK_OP_SOLVE: return o->solve != NULL;
    case BK_OP_LAYER_FWD:
        return o->layer_fwd_create != NULL && o->layer_fwd_create != bk_cpu_layer_fwd_create;
    case BK_OP_STAGES:
        return o->stages_create != NULL && o->stages_create != bk_cpu_stages_create;
    case BK_OP_BACKWARD: return o->bwd_flow_run != NULL;
    }
    return 0;
}

int64_t bk_batch_within(double budget, double per_seq, int64_t S)
{
    int64_t b = (int64_t)(budget / per_seq);
    if (b < 1)
        b = 1;
    if (b > S)
        b = S;
    return b;
}

int bk_rank_share(int64_t S, int64_t batch, int rank, int nranks, int64_t *lo, int64_t *hi)
{
    *lo = 0;
    *hi = S;
    if (nranks <= 1 || S <= 0 || batch < 1)
        return 1;
    const int64_t nmb = (S + batch - 1) / batch;
    if (nmb < nranks)
        return 0;
    *lo = nmb * rank / nranks * batch;
    *hi = nmb * (rank + 1) / nranks * batch;
    if (*hi > S)
        *hi = S;
    return 1;
}

int64_t bk_layer_fwd_batch(const bk_layer_fwd_params *p, int64_t automatic)
{
    int64_t B = p->batch > 0 ? (p->batch < p->S ? p->batch : p->S) : automatic;
    return B < 1 ? 1 : B;
}

bk_status bk_backend_layer_fwd_create(bk_backend *b, const bk_layer_fwd_params *p,
                                      int64_t *batch, const bk_layer_fwd_ops **ops, void **ctx)
{
    if (b && b->ops->layer_fwd_create)
        return b->ops->layer_fwd_create(b, p, batch, ops, ctx);
    return bk_cpu_layer_fwd_create(b, p, batch, ops, ctx);
}

bk_status bk_backend_stages_create(bk_backend *b, const bk_stage_params *p, int64_t *batch,
                                   const bk_stage_ops **ops, void **ctx)
{
    *ops = NULL;
    *ctx = NULL;
    char why[512] = "";
    if (b && b->ops->stages_create && !p->cpu) {
        const int64_t asked = *batch;
        bk_status st = b->ops->stages_create(b, p, batch, ops, ctx);
        if (st != BK_ERR_UNSUPPORTED)
            return st;
        /* the backend has no stages for this job (a Hessian kind or setting
         * it does not implement): the CPU's run it, and say so */
        snprintf(why, sizeof why, "stages on the CPU (%s)", bk_last_error());
        bk_clear_error();
        *batch = asked;
        *ops = NULL;
        *ctx = NULL;
    }
    bk_status st = bk_cpu_stages_create(b, p, batch, ops, ctx);
    if (st == BK_OK && why[0])
        bk_cpu_stages_note(*ctx, why);
    return st;
}

bk_status bk_backend_bwd_flow_run(bk_backend *b, const bk_model *m, const int32_t *tokens,
                                  int64_t S, int64_t T, const bk_bwd_flow_opts *o, int precision,
                                  const bk_bwd_flow_cb *cb, bk_bwd_flow_stats *stats)
{
    if (b && b->ops->bwd_flow_run)
        return b->ops->bwd_flow_run(b, m, tokens, S, T, o, precision, cb, stats);
    return bk_bwd_flow_run(m, tokens, S, T, o, cb, stats);
}
