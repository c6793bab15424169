/* One module's solve in the quantization job: its factors from the stages,
 * the solve on the backend, the GPTQ proxy loss, then the working copy, the
 * report entry, the progress event and the writer. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quantize_job.h"
#include "util.h"

/* ------------------------------------------------------------------ solving */

/* The options of module mod's solve (two_sided: it has an output factor B). */
static void solve_opts(const job *j, bk_module mod, int two_sided, bk_solve_opts *so)
{
    *so = j->o->solve;
    if (j->o->damp_b_attn >= 0.0 && mod <= BK_MOD_V) {
        so->separate_damp_b = 1;
        so->damp_b = j->o->damp_b_attn;
    }
    if (j->o->hessian == BK_HESS_RTN)
        so->algorithm = BK_ALG_RTN;
    else if (!two_sided)
        so->algorithm = BK_ALG_GPTQ; /* B = I: GPTQ gives the same codes, faster */
}

bk_status bk__q_solve_compute(job *j, int layer, bk_module mod, int next,
                               const bk_layer_weights *orig, bk_q_solved *sv)
{
    const char *A = NULL, *B = NULL;
    const float *fa = NULL, *fb = NULL, *fa_gptq = NULL;
    bk_status st;
    int64_t m, n;
    bk_module_shape(j->cfg, mod, &m, &n);
    char label[256];
    snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));

    /* device factors and solve where the stages offer them (GPU stages) */
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    double t = bk_now();
    st = dev ? j->ops->factors_dev(j->ops_ctx, mod, &fa, &fb, &fa_gptq)
             : j->ops->factors(j->ops_ctx, mod, &fa, &fb, &fa_gptq);
    j->t_hessian += bk_now() - t;
    bk_prof_add("pipe.factors", bk_now() - t);
    if (st != BK_OK)
        return bk_error_prefix(st, label);
    (void)A;
    (void)B;

    bk_solve_opts so;
    solve_opts(j, mod, fb != NULL, &so);
    /* the next module of this stage's sums: the stages may start on its
     * factors while this one is solved (the options as its solve will get
     * them, with an output factor; rtn has none to start on) */
    if (next >= 0 && j->ops->prepare_next && j->o->hessian != BK_HESS_RTN) {
        bk_solve_opts on;
        solve_opts(j, (bk_module)next, 1, &on);
        t = bk_now();
        j->ops->prepare_next(j->ops_ctx, (bk_module)next, &on);
        bk_prof_add("pipe.prepare_next", bk_now() - t);
    }
    char la[300], lb[300];
    snprintf(la, sizeof la, "%s (input factor A)", label);
    snprintf(lb, sizeof lb, "%s (output factor B)", label);
    bk_solve_problem p = {
        .m = m, .n = n, .dtype = BK_DT_F32,
        .W = orig->w[mod], .A = fa, .B = fb, .LA = NULL, .LB = NULL,
        .label_w = label, .label_a = la, .label_b = lb,
    };
    if (!fa) {
        /* no calibration (rtn): stats are skipped */
        so.compute_stats = 0;
    }
    bk_solve_result r;
    memset(&r, 0, sizeof r);
    double loss_gptq = NAN;
    t = bk_now();
    st = dev ? j->ops->solve_dev(j->ops_ctx, mod, &p, fa_gptq, &so, &r, &loss_gptq)
             : bk_backend_solve(j->backend, &p, &so, &r);
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return bk_error_prefix(st, label);
    }
    bk_prof_add("pipe.solve", bk_now() - t);

    /* the GPTQ proxy loss tr(E A E^T) with A = E[xx^T] (undamped), for every
     * module (computed by solve_dev on the device) */
    if (fa_gptq && !dev) {
        float *E = bk_alloc((size_t)(m * n), sizeof(float));
        if (!E) {
            bk_solve_result_free(&r);
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        }
        for (int64_t i = 0; i < m * n; i++)
            E[i] = r.weight[i] - orig->w[mod][i];
        st = bk_proxy_loss_fast(m, n, E, fa_gptq, &loss_gptq);
        free(E);
        if (st != BK_OK) {
            bk_solve_result_free(&r);
            return st;
        }
    }
    sv->r = r;
    sv->loss_gptq = loss_gptq;
    sv->alg = (int)so.algorithm;
    sv->two_sided = fb != NULL;
    return BK_OK;
}

/* Apply a solve: the working copy, the report, the progress event, the
 * output (sv->r is handed over). */
bk_status bk__q_solve_apply(job *j, int layer, bk_module mod, bk_layer_weights *lw, bk_q_solved *sv)
{
    bk_status st = BK_OK;
    int64_t m, n;
    bk_module_shape(j->cfg, mod, &m, &n);
    char label[256];
    snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    bk_solve_result r = sv->r;
    memset(&sv->r, 0, sizeof sv->r);
    const double loss_gptq = sv->loss_gptq;
    j->t_factor += r.time_factor_s;
    j->t_solve += r.time_solve_s + r.time_stats_s;
    double t = bk_now();

    /* the quantized weight replaces the working copy for what follows */
    if (!dev) { /* (the device stages updated their working copy in solve_dev) */
        memcpy(lw->w[mod], r.weight, (size_t)(m * n) * sizeof(float));
        st = j->ops->weight_updated(j->ops_ctx, mod, r.weight);
    }
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return bk_error_prefix(st, label);
    }

    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "layer", layer);
    cJSON_AddStringToObject(e, "module", bk_module_name(mod));
    cJSON_AddNumberToObject(e, "rows", (double)m);
    cJSON_AddNumberToObject(e, "cols", (double)n);
    cJSON_AddStringToObject(e, "algorithm", bk_algorithm_name((bk_algorithm)sv->alg));
    cJSON_AddBoolToObject(e, "two_sided", sv->two_sided);
    if (isfinite(r.loss_two_sided))
        cJSON_AddNumberToObject(e, "loss", r.loss_two_sided);
    else
        cJSON_AddNullToObject(e, "loss");
    if (isfinite(loss_gptq))
        cJSON_AddNumberToObject(e, "loss_gptq", loss_gptq);
    else
        cJSON_AddNullToObject(e, "loss_gptq");
    cJSON_AddNumberToObject(e, "damp_a", r.damp_a);
    cJSON_AddNumberToObject(e, "damp_b", r.damp_b);
    cJSON_AddNumberToObject(e, "damp_retries", r.damp_retries);
    cJSON_AddNumberToObject(e, "dead_columns", (double)r.dead_columns);
    cJSON_AddNumberToObject(e, "clamped", (double)r.clamped);
    cJSON_AddNumberToObject(e, "time_factor_s", r.time_factor_s);
    cJSON_AddNumberToObject(e, "time_solve_s", r.time_solve_s);
    cJSON_AddItemToArray(j->report_modules, e);
    j->quantized_params += m * n;

    bk__q_emit_module(j, layer, mod, &r, loss_gptq);
    bk_prof_add("pipe.report", bk_now() - t);
    /* packing and writing overlap the next module (writer thread) */
    t = bk_now();
    st = bk__q_writer_put(j, layer, mod, &r, NULL);
    j->t_io += bk_now() - t;
    bk_prof_add("pipe.writer_put", bk_now() - t);
    if (st != BK_OK)
        return st;
    if (bk__stop_requested())
        return bk_error(BK_ERR_INTERRUPTED, "interrupted at layer %d (%d/%d) %s", layer,
                        layer - j->layer_begin + 1, j->layer_end - j->layer_begin,
                        bk_module_name(mod));
    return BK_OK;
}

bk_status bk__q_solve_module(job *j, int layer, bk_module mod, int next, bk_layer_weights *lw,
                              const bk_layer_weights *orig)
{
    bk_q_solved sv;
    memset(&sv, 0, sizeof sv);
    bk_status st = bk__q_solve_compute(j, layer, mod, next, orig, &sv);
    if (st == BK_OK)
        st = bk__q_solve_apply(j, layer, mod, lw, &sv);
    bk_solve_result_free(&sv.r);
    return st;
}
