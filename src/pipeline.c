/* The quantization job: stream a checkpoint layer by layer, accumulate each
 * module's Kronecker-factored Hessian from calibration activations, solve,
 * propagate, and write the quantized checkpoint. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"
#include "bk_config.h"
#include "pipeline_internal.h"
#include "util.h"

static volatile sig_atomic_t g_stop;

void bk_request_stop(void)
{
    g_stop = 1;
}

int bk__stop_requested(void)
{
    return g_stop != 0;
}

const char *bk_export_name(bk_export_format f)
{
    switch (f) {
    case BK_EXPORT_NATIVE: return "native";
    case BK_EXPORT_DEQUANTIZED: return "dequantized";
    case BK_EXPORT_GPTQ: return "gptq";
    }
    return "?";
}

bk_status bk_export_from_name(const char *name, bk_export_format *out)
{
    for (int f = 0; f <= BK_EXPORT_GPTQ; f++) {
        if (!strcmp(name, bk_export_name((bk_export_format)f))) {
            *out = (bk_export_format)f;
            return BK_OK;
        }
    }
    return bk_error(BK_ERR_INVALID_ARG, "unknown export format '%s' (expected native, dequantized or gptq)",
                    name);
}

void bk_quantize_opts_default(bk_quantize_opts *o)
{
    memset(o, 0, sizeof *o);
    o->hessian = BK_HESS_GPTQ;
    bk_solve_opts_default(&o->solve);
    o->sequential = 1;
    o->export_format = BK_EXPORT_NATIVE;
    o->backend = BK_BACKEND_AUTO;
}

/* ------------------------------------------------------------------ job state */

typedef struct job {
    const bk_quantize_opts *o;
    bk_model *model;
    const bk_model_config *cfg;
    bk_backend *backend;
    bk_fwd *fwd;
    bk_hess_acc *acc;
    bk_hess_acc *acc_gptq; /* plain E[xx^T] for the GPTQ loss of two-sided modules (shampoo) */
    bk_st_stream *out;
    char tmpdir[4096];
    int layer_begin, layer_end;
    /* calibration */
    int32_t *tokens;
    int64_t S, T, N, batch;
    bk_act_reader *acts;
    /* buffers */
    float *h;      /* [N, hidden] residual stream */
    float *o_in;   /* [N, heads*head_dim] */
    float *x;      /* [B*T, max(hidden, ...)] micro-batch scratch */
    float *q_rot, *k_rot, *down;
    /* report */
    cJSON *report_modules;
    double t0, t_forward, t_hessian, t_factor, t_solve, t_io;
    int64_t quantized_params;
} job;

static void emit(job *j, bk_event_kind kind, int layer, const char *module, const char *msg)
{
    if (!j->o->on_event)
        return;
    bk_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = kind;
    ev.layer = layer;
    ev.n_layers = j->layer_end - j->layer_begin;
    ev.module = module;
    ev.elapsed_s = bk_now() - j->t0;
    int done = layer - j->layer_begin + (kind == BK_EV_LAYER_DONE ? 1 : 0);
    ev.eta_s = (done > 0 && ev.n_layers > done) ? ev.elapsed_s / done * (ev.n_layers - done) : 0;
    ev.t_forward = j->t_forward;
    ev.t_hessian = j->t_hessian;
    ev.t_factor = j->t_factor;
    ev.t_solve = j->t_solve;
    ev.t_io = j->t_io;
    ev.message = msg;
    j->o->on_event(j->o->user, &ev);
}

static void emit_module(job *j, int layer, bk_module mod, const bk_solve_result *r, double loss_gptq)
{
    if (!j->o->on_event)
        return;
    bk_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = BK_EV_MODULE_DONE;
    ev.layer = layer;
    ev.n_layers = j->layer_end - j->layer_begin;
    ev.module = bk_module_name(mod);
    ev.rows = r->m;
    ev.cols = r->n;
    ev.loss = r->loss_two_sided;
    ev.loss_gptq = loss_gptq;
    ev.damp_a = r->damp_a;
    ev.damp_b = r->damp_b;
    ev.elapsed_s = bk_now() - j->t0;
    ev.t_forward = j->t_forward;
    ev.t_hessian = j->t_hessian;
    ev.t_factor = j->t_factor;
    ev.t_solve = j->t_solve;
    ev.t_io = j->t_io;
    j->o->on_event(j->o->user, &ev);
}

static int layer_in_range(const job *j, int l)
{
    return l >= j->layer_begin && l < j->layer_end;
}

/* ------------------------------------------------------------- output plan */

static bk_status declare_outputs(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    char name[512];
    bk_status st;
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *t = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(t->name, &layer, &mod) && layer_in_range(j, layer) &&
            j->o->export_format != BK_EXPORT_DEQUANTIZED) {
            st = bk__declare_quantized(j->out, j->o, j->cfg, t->name, mod);
            if (st != BK_OK)
                return st;
            continue;
        }
        st = bk_st_stream_declare(j->out, t->name, t->dtype, t->ndim, t->shape);
        if (st != BK_OK)
            return st;
    }
    (void)name;
    return BK_OK;
}

/* Copy every tensor that is not a quantized linear weight straight through.
 * In dequantized mode the linear weights of quantized layers are written
 * later, when solved. */
static bk_status write_passthrough(job *j)
{
    const bk_st_set *in = bk_model_tensors(j->model);
    double t = bk_now();
    for (size_t i = 0; i < bk_st_set_count(in); i++) {
        const bk_tensor_info *ti = bk_st_set_tensor(in, i);
        int layer;
        bk_module mod;
        if (bk__parse_linear_name(ti->name, &layer, &mod) && layer_in_range(j, layer))
            continue;
        bk_status st = bk_st_stream_write(j->out, ti->name, ti->data);
        if (st != BK_OK)
            return st;
    }
    j->t_io += bk_now() - t;
    return BK_OK;
}

/* ------------------------------------------------------------------ solving */

static bk_status solve_module(job *j, int layer, bk_module mod, bk_layer_weights *lw,
                              const bk_layer_weights *orig)
{
    const char *A = NULL, *B = NULL;
    const float *fa = NULL, *fb = NULL, *fa_gptq = NULL;
    bk_status st;
    int64_t m, n;
    bk_module_shape(j->cfg, mod, &m, &n);
    char label[256];
    snprintf(label, sizeof label, "model.layers.%d.%s", layer, bk_module_name(mod));

    double t = bk_now();
    if (j->acc) {
        st = bk_hess_factors(j->acc, orig, mod, &fa, &fb);
        if (st != BK_OK)
            return bk_error_prefix(st, label);
    }
    if (j->acc_gptq) {
        const float *dummy = NULL;
        st = bk_hess_factors(j->acc_gptq, orig, mod, &fa_gptq, &dummy);
        if (st != BK_OK)
            return bk_error_prefix(st, label);
    } else {
        fa_gptq = fa;
    }
    j->t_hessian += bk_now() - t;
    (void)A;
    (void)B;

    bk_solve_opts so = j->o->solve;
    if (j->o->hessian == BK_HESS_RTN)
        so.algorithm = BK_ALG_RTN;
    else if (!fb)
        so.algorithm = BK_ALG_GPTQ; /* B = I: GPTQ gives the same codes, faster */
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
    st = bk_backend_solve(j->backend, &p, &so, &r);
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return bk_error_prefix(st, label);
    }
    j->t_factor += r.time_factor_s;
    j->t_solve += r.time_solve_s + r.time_stats_s;

    /* the GPTQ proxy loss tr(E A E^T) with A = E[xx^T] (undamped), for every module */
    double loss_gptq = NAN;
    if (fa_gptq) {
        float *E = bk_alloc((size_t)(m * n), sizeof(float));
        if (!E) {
            bk_solve_result_free(&r);
            return bk_error(BK_ERR_NOMEM, "%s: out of memory", label);
        }
        for (int64_t i = 0; i < m * n; i++)
            E[i] = r.weight[i] - orig->w[mod][i];
        st = bk_proxy_loss(m, n, E, fa_gptq, NULL, &loss_gptq);
        free(E);
        if (st != BK_OK) {
            bk_solve_result_free(&r);
            return st;
        }
    }

    /* the quantized weight replaces the working copy for what follows */
    memcpy(lw->w[mod], r.weight, (size_t)(m * n) * sizeof(float));

    t = bk_now();
    st = bk__write_module(j->out, j->o, j->cfg, j->model, layer, mod, &r);
    j->t_io += bk_now() - t;
    if (st != BK_OK) {
        bk_solve_result_free(&r);
        return st;
    }

    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "layer", layer);
    cJSON_AddStringToObject(e, "module", bk_module_name(mod));
    cJSON_AddNumberToObject(e, "rows", (double)m);
    cJSON_AddNumberToObject(e, "cols", (double)n);
    cJSON_AddStringToObject(e, "algorithm", bk_algorithm_name(so.algorithm));
    cJSON_AddBoolToObject(e, "two_sided", fb != NULL);
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

    emit_module(j, layer, mod, &r, loss_gptq);
    bk_solve_result_free(&r);
    if (bk__stop_requested())
        return bk_error(BK_ERR_INTERRUPTED, "interrupted at layer %d %s", layer,
                        bk_module_name(mod));
    return BK_OK;
}

/* Feed one micro-batch of every module's inputs to the accumulators (the
 * plain E[xx^T] one gets no queries/keys). */
static bk_status add_all_modules(job *j, const bk_layer_weights *orig, const float *attn_in,
                                 const float *o_in, const float *mlp_in, const float *down_in,
                                 int fully, int64_t sb)
{
    double t = bk_now();
    bk_status st = BK_OK;
    for (int k = 0; k < 2 && st == BK_OK; k++) {
        bk_hess_acc *a = k ? j->acc_gptq : j->acc;
        if (!a)
            continue;
        st = bk_hess_add_attn(a, orig, attn_in, (fully && !k) ? j->q_rot : NULL,
                              (fully && !k) ? j->k_rot : NULL, sb);
        if (st == BK_OK)
            st = bk_hess_add_o(a, o_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_mlp(a, orig, mlp_in, sb);
        if (st == BK_OK)
            st = bk_hess_add_down(a, down_in, sb);
    }
    j->t_hessian += bk_now() - t;
    return st;
}

/* ------------------------------------------------- one layer, token calibration */

#define MB_LOOP(j, s0, sb)                                                          \
    for (int64_t s0 = 0, sb = 0; s0 < (j)->S && ((sb = ((j)->S - s0 < (j)->batch ? (j)->S - s0 : (j)->batch)), 1); \
         s0 += sb)

static bk_status layer_tokens(job *j, int l)
{
    const bk_model_config *c = j->cfg;
    const int64_t T = j->T, hid = c->hidden, qd = c->n_heads * c->head_dim;
    bk_layer_weights orig, lw;
    memset(&orig, 0, sizeof orig);
    memset(&lw, 0, sizeof lw);
    double t = bk_now();
    bk_status st = bk_layer_weights_load(j->model, l, &orig);
    if (st == BK_OK)
        st = bk_layer_weights_load(j->model, l, &lw);
    j->t_io += bk_now() - t;
    if (st != BK_OK)
        goto done;

    if (!layer_in_range(j, l)) {
        t = bk_now();
        MB_LOOP(j, s0, sb) {
            st = bk_fwd_layer(j->fwd, &orig, sb, j->h + s0 * T * hid, NULL);
            if (st != BK_OK)
                goto done;
        }
        j->t_forward += bk_now() - t;
        goto done;
    }
    emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    if (j->acc)
        bk_hess_acc_reset(j->acc);
    if (j->acc_gptq)
        bk_hess_acc_reset(j->acc_gptq);
    int fully = j->o->hessian == BK_HESS_FULLYLOCAL_KFAC || j->o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO;

    if (!j->o->sequential) {
        /* full-precision inputs for every module: one pass with taps */
        float *mlp_in = bk_alloc((size_t)(j->batch * T * hid), sizeof(float));
        if (!mlp_in) {
            st = bk_error(BK_ERR_NOMEM, "out of memory for activations");
            goto done;
        }
        MB_LOOP(j, s0, sb) {
            float *hb = j->h + s0 * T * hid;
            bk_layer_taps taps = {.attn_in = j->x, .o_in = j->o_in, .mlp_in = mlp_in,
                                  .down_in = j->down, .q_rot = fully ? j->q_rot : NULL,
                                  .k_rot = fully ? j->k_rot : NULL};
            t = bk_now();
            st = bk_fwd_layer(j->fwd, &orig, sb, hb, &taps);
            j->t_forward += bk_now() - t;
            if (st != BK_OK)
                break;
            st = add_all_modules(j, &orig, j->x, j->o_in, mlp_in, j->down, fully, sb);
            if (st != BK_OK)
                break;
        }
        free(mlp_in);
        if (st != BK_OK)
            goto done;
        for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
            st = solve_module(j, l, (bk_module)m, &lw, &orig);
        goto done;
    }

    /* stage 1: q, k, v from attn_in (and, fully-local, the FP queries/keys) */
    MB_LOOP(j, s0, sb) {
        const float *hb = j->h + s0 * T * hid;
        t = bk_now();
        st = bk_fwd_attn_in(j->fwd, &orig, hb, sb, j->x);
        if (st == BK_OK && fully)
            st = bk_fwd_attention(j->fwd, &orig, j->x, sb, j->o_in + s0 * T * qd, j->q_rot,
                                  j->k_rot, NULL);
        j->t_forward += bk_now() - t;
        if (st != BK_OK)
            goto done;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_attn(j->acc, &orig, j->x, fully ? j->q_rot : NULL,
                                  fully ? j->k_rot : NULL, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_attn(j->acc_gptq, &orig, j->x, NULL, NULL, sb);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }
    for (int m = BK_MOD_Q; m <= BK_MOD_V; m++)
        if ((st = solve_module(j, l, (bk_module)m, &lw, &orig)) != BK_OK)
            goto done;

    /* stage 2: o_proj sees the quantized q/k/v */
    MB_LOOP(j, s0, sb) {
        const float *hb = j->h + s0 * T * hid;
        float *ob = j->o_in + s0 * T * qd;
        t = bk_now();
        st = bk_fwd_attn_in(j->fwd, &lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_attention(j->fwd, &lw, j->x, sb, ob, NULL, NULL, NULL);
        j->t_forward += bk_now() - t;
        if (st != BK_OK)
            goto done;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_o(j->acc, ob, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_o(j->acc_gptq, ob, sb);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }
    if ((st = solve_module(j, l, BK_MOD_O, &lw, &orig)) != BK_OK)
        goto done;

    /* stage 3: residual with the quantized o_proj; gate/up from mlp_in */
    MB_LOOP(j, s0, sb) {
        float *hb = j->h + s0 * T * hid;
        t = bk_now();
        st = bk_fwd_attn_out(j->fwd, &lw, j->o_in + s0 * T * qd, sb, hb);
        if (st == BK_OK)
            st = bk_fwd_mlp_in(j->fwd, &lw, hb, sb, j->x);
        j->t_forward += bk_now() - t;
        if (st != BK_OK)
            goto done;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_mlp(j->acc, &orig, j->x, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_mlp(j->acc_gptq, &orig, j->x, sb);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }
    if ((st = solve_module(j, l, BK_MOD_GATE, &lw, &orig)) != BK_OK)
        goto done;
    if ((st = solve_module(j, l, BK_MOD_UP, &lw, &orig)) != BK_OK)
        goto done;

    /* stage 4: down_proj sees the quantized gate/up */
    MB_LOOP(j, s0, sb) {
        const float *hb = j->h + s0 * T * hid;
        t = bk_now();
        st = bk_fwd_mlp_in(j->fwd, &lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_mlp_hidden(j->fwd, &lw, j->x, sb, j->down, NULL, NULL);
        j->t_forward += bk_now() - t;
        if (st != BK_OK)
            goto done;
        t = bk_now();
        if (j->acc)
            st = bk_hess_add_down(j->acc, j->down, sb);
        if (st == BK_OK && j->acc_gptq)
            st = bk_hess_add_down(j->acc_gptq, j->down, sb);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }
    if ((st = solve_module(j, l, BK_MOD_DOWN, &lw, &orig)) != BK_OK)
        goto done;

    /* stage 5: the layer's output with every module quantized */
    MB_LOOP(j, s0, sb) {
        float *hb = j->h + s0 * T * hid;
        t = bk_now();
        st = bk_fwd_mlp_in(j->fwd, &lw, hb, sb, j->x);
        if (st == BK_OK)
            st = bk_fwd_mlp_hidden(j->fwd, &lw, j->x, sb, j->down, NULL, NULL);
        if (st == BK_OK)
            st = bk_fwd_mlp_out(j->fwd, &lw, j->down, sb, hb);
        j->t_forward += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }

done:
    bk_layer_weights_free(&orig);
    bk_layer_weights_free(&lw);
    if (st == BK_OK && layer_in_range(j, l))
        emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* ------------------------------------------- one layer, dumped activations */

static bk_status layer_acts(job *j, int l)
{
    const bk_model_config *c = j->cfg;
    bk_layer_weights orig, lw;
    memset(&orig, 0, sizeof orig);
    memset(&lw, 0, sizeof lw);
    if (!layer_in_range(j, l))
        return BK_OK;
    emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    double t = bk_now();
    bk_status st = bk_layer_weights_load(j->model, l, &orig);
    if (st == BK_OK)
        st = bk_layer_weights_load(j->model, l, &lw);
    bk_act_layer al;
    memset(&al, 0, sizeof al);
    if (st == BK_OK)
        st = bk__act_layer_open(j->acts, l, &al);
    j->t_io += bk_now() - t;
    if (st != BK_OK)
        goto done;
    if (j->acc)
        bk_hess_acc_reset(j->acc);
    if (j->acc_gptq)
        bk_hess_acc_reset(j->acc_gptq);
    int fully = j->o->hessian == BK_HESS_FULLYLOCAL_KFAC || j->o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO;
    const int64_t T = j->T, hid = c->hidden, qd = c->n_heads * c->head_dim,
                  inter = c->intermediate;
    float *mlp_in = bk_alloc((size_t)(j->batch * T * hid), sizeof(float));
    if (!mlp_in) {
        st = bk_error(BK_ERR_NOMEM, "out of memory for activations");
        goto done;
    }
    MB_LOOP(j, s0, sb) {
        int64_t r0 = s0 * T, nr = sb * T;
        t = bk_now();
        st = bk__act_rows(&al, "attn_in", r0, nr, hid, j->x);
        if (st == BK_OK)
            st = bk__act_rows(&al, "o_in", r0, nr, qd, j->o_in);
        if (st == BK_OK)
            st = bk__act_rows(&al, "mlp_in", r0, nr, hid, mlp_in);
        if (st == BK_OK)
            st = bk__act_rows(&al, "down_in", r0, nr, inter, j->down);
        j->t_io += bk_now() - t;
        if (st != BK_OK)
            break;
        if (fully) {
            /* queries/keys after norm and RoPE, recomputed from attn_in */
            t = bk_now();
            float *scratch = bk_alloc((size_t)(nr * qd), sizeof(float));
            if (!scratch) {
                st = bk_error(BK_ERR_NOMEM, "out of memory for attention");
                break;
            }
            st = bk_fwd_attention(j->fwd, &orig, j->x, sb, scratch, j->q_rot, j->k_rot, NULL);
            free(scratch);
            j->t_forward += bk_now() - t;
            if (st != BK_OK)
                break;
        }
        st = add_all_modules(j, &orig, j->x, j->o_in, mlp_in, j->down, fully, sb);
        if (st != BK_OK)
            break;
    }
    free(mlp_in);
    if (st != BK_OK)
        goto done;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = solve_module(j, l, (bk_module)m, &lw, &orig);
done:
    bk__act_layer_close(&al);
    bk_layer_weights_free(&orig);
    bk_layer_weights_free(&lw);
    if (st == BK_OK)
        emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* ------------------------------------------------------------ metadata files */

static bk_status write_config_and_report(job *j)
{
    const bk_quantize_opts *o = j->o;
    char path[4096];
    char *text = NULL;
    bk_status st;
    st = bk_path_join(path, sizeof path, o->model_dir, "config.json");
    if (st != BK_OK)
        return st;
    st = bk_read_file(path, 16u << 20, &text, NULL);
    if (st != BK_OK)
        return st;
    cJSON *cfg = cJSON_Parse(text);
    free(text);
    if (!cfg)
        return bk_error(BK_ERR_CONFIG, "%s: cannot parse", path);

    cJSON *qc = bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end);
    if (!qc) {
        cJSON_Delete(cfg);
        return bk_error(BK_ERR_NOMEM, "out of memory building quantization_config");
    }
    if (o->export_format == BK_EXPORT_DEQUANTIZED) {
        /* an ordinary checkpoint: record provenance under another key */
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "bakron_dequantized_from", qc);
    } else {
        cJSON_DeleteItemFromObject(cfg, "quantization_config");
        cJSON_AddItemToObject(cfg, "quantization_config", qc);
        if (o->export_format == BK_EXPORT_GPTQ) {
            char *q = cJSON_Print(qc);
            if (q) {
                st = bk_path_join(path, sizeof path, j->tmpdir, "quantize_config.json");
                if (st == BK_OK)
                    st = bk_write_file_atomic(path, q, strlen(q));
                free(q);
                if (st != BK_OK) {
                    cJSON_Delete(cfg);
                    return st;
                }
            }
        }
    }
    char *out = cJSON_Print(cfg);
    cJSON_Delete(cfg);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing config.json");
    st = bk_path_join(path, sizeof path, j->tmpdir, "config.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    if (st != BK_OK)
        return st;

    /* report.json */
    cJSON *rep = cJSON_CreateObject();
    cJSON_AddStringToObject(rep, "bakron_version", BK_VERSION);
    cJSON_AddStringToObject(rep, "model", o->model_dir);
    cJSON_AddStringToObject(rep, "backend", bk_backend_name(j->backend));
    cJSON_AddStringToObject(rep, "device", bk_backend_device(j->backend));
    cJSON_AddItemToObject(rep, "quantization",
                          bk__quantization_config(o, j->cfg, j->S, j->T, j->layer_begin, j->layer_end));
    cJSON *times = cJSON_AddObjectToObject(rep, "times_s");
    cJSON_AddNumberToObject(times, "total", bk_now() - j->t0);
    cJSON_AddNumberToObject(times, "forward", j->t_forward);
    cJSON_AddNumberToObject(times, "hessian", j->t_hessian);
    cJSON_AddNumberToObject(times, "factor", j->t_factor);
    cJSON_AddNumberToObject(times, "solve", j->t_solve);
    cJSON_AddNumberToObject(times, "io", j->t_io);
    cJSON_AddNumberToObject(rep, "quantized_parameters", (double)j->quantized_params);
    cJSON_AddItemToObject(rep, "modules", j->report_modules);
    j->report_modules = NULL;
    out = cJSON_Print(rep);
    cJSON_Delete(rep);
    if (!out)
        return bk_error(BK_ERR_NOMEM, "out of memory writing report.json");
    st = bk_path_join(path, sizeof path, j->tmpdir, "report.json");
    if (st == BK_OK)
        st = bk_write_file_atomic(path, out, strlen(out));
    free(out);
    return st;
}

/* ------------------------------------------------------------------- driver */

static bk_status job_buffers(job *j)
{
    const bk_model_config *c = j->cfg;
    const int64_t T = j->T, B = j->batch;
    const int64_t qd = c->n_heads * c->head_dim, kd = c->n_kv_heads * c->head_dim;
    int64_t xw = c->hidden > qd ? c->hidden : qd;
    if (j->tokens) {
        j->h = bk_alloc((size_t)(j->N * c->hidden), sizeof(float));
        j->o_in = bk_alloc((size_t)(j->N * qd), sizeof(float));
    } else {
        j->o_in = bk_alloc((size_t)(B * T * qd), sizeof(float));
    }
    j->x = bk_alloc((size_t)(B * T * xw), sizeof(float));
    j->q_rot = bk_alloc((size_t)(B * T * qd), sizeof(float));
    j->k_rot = bk_alloc((size_t)(B * T * kd), sizeof(float));
    j->down = bk_alloc((size_t)(B * T * c->intermediate), sizeof(float));
    if ((j->tokens && !j->h) || !j->o_in || !j->x || !j->q_rot || !j->k_rot || !j->down)
        return bk_error(BK_ERR_NOMEM, "out of memory for calibration states (%lld tokens)",
                        (long long)j->N);
    return BK_OK;
}

static void job_free(job *j)
{
    free(j->tokens);
    free(j->h);
    free(j->o_in);
    free(j->x);
    free(j->q_rot);
    free(j->k_rot);
    free(j->down);
    bk__act_close(j->acts);
    if (j->acc)
        bk_hess_acc_free(j->acc);
    if (j->acc_gptq)
        bk_hess_acc_free(j->acc_gptq);
    if (j->fwd)
        bk_fwd_free(j->fwd);
    if (j->backend)
        bk_backend_destroy(j->backend);
    if (j->model)
        bk_model_close(j->model);
    cJSON_Delete(j->report_modules);
}

bk_status bk_quantize(const bk_quantize_opts *o)
{
    job jb, *j = &jb;
    memset(j, 0, sizeof *j);
    j->o = o;
    j->t0 = bk_now();
    g_stop = 0;
    bk_status st;

    if (!o->model_dir || !o->out_dir)
        return bk_error(BK_ERR_INVALID_ARG, "quantize: model folder and output folder are required");
    if (o->calib_path && o->activations_dir)
        return bk_error(BK_ERR_INVALID_ARG, "quantize: give either calibration tokens or activations, not both");
    if (!o->calib_path && !o->activations_dir && o->hessian != BK_HESS_RTN)
        return bk_error(BK_ERR_INVALID_ARG,
                        "quantize: --hessian %s needs calibration data (--calib or --activations)",
                        bk_hessian_name(o->hessian));

    st = bk_model_open(o->model_dir, &j->model);
    if (st != BK_OK)
        goto fail;
    j->cfg = bk_model_get_config(j->model);
    if (bk_model_is_quantized(j->model)) {
        st = bk_error(BK_ERR_UNSUPPORTED, "%s: the model is already quantized", o->model_dir);
        goto fail;
    }
    j->layer_begin = o->layer_begin < 0 ? 0 : o->layer_begin;
    j->layer_end = (o->layer_end <= 0 || o->layer_end > j->cfg->n_layers) ? (int)j->cfg->n_layers
                                                                          : o->layer_end;
    if (j->layer_begin >= j->layer_end) {
        st = bk_error(BK_ERR_INVALID_ARG, "quantize: empty layer range %d:%d (model has %lld layers)",
                      o->layer_begin, o->layer_end, (long long)j->cfg->n_layers);
        goto fail;
    }
    st = bk__check_export(o, j->cfg);
    if (st != BK_OK)
        goto fail;

    /* calibration */
    if (o->calib_path) {
        st = bk_load_tokens(o->calib_path, j->cfg->vocab, o->samples, o->seqlen, &j->tokens,
                            &j->S, &j->T);
        if (st != BK_OK)
            goto fail;
        if (j->T > j->cfg->max_positions) {
            st = bk_error(BK_ERR_CALIB, "%s: sequence length %lld exceeds the model's max_position_embeddings %lld",
                          o->calib_path, (long long)j->T, (long long)j->cfg->max_positions);
            goto fail;
        }
    } else if (o->activations_dir) {
        st = bk__act_open(o->activations_dir, j->cfg, o->samples, &j->acts, &j->S, &j->T);
        if (st != BK_OK)
            goto fail;
    } else {
        j->S = 0;
        j->T = 1;
    }
    j->N = j->S * j->T;
    j->batch = o->batch > 0 ? o->batch : bk__auto_batch(j->cfg, j->T);
    if (j->S > 0 && j->batch > j->S)
        j->batch = j->S;
    if (j->batch < 1)
        j->batch = 1;

    st = bk_backend_create(o->backend, &j->backend);
    if (st != BK_OK)
        goto fail;
    if (j->S > 0) {
        st = bk_fwd_create(j->cfg, j->batch, j->T, &j->fwd);
        if (st != BK_OK)
            goto fail;
        bk_hessian_kind hk = o->hessian == BK_HESS_RTN ? BK_HESS_GPTQ : o->hessian;
        st = bk_hess_acc_create(j->cfg, hk, o->hessian_fp64, j->T, &j->acc);
        if (st != BK_OK)
            goto fail;
        if (o->hessian == BK_HESS_MLPLOCAL_SHAMPOO || o->hessian == BK_HESS_FULLYLOCAL_SHAMPOO) {
            st = bk_hess_acc_create(j->cfg, BK_HESS_GPTQ, o->hessian_fp64, j->T, &j->acc_gptq);
            if (st != BK_OK)
                goto fail;
        }
        st = job_buffers(j);
        if (st != BK_OK)
            goto fail;
    }
    j->report_modules = cJSON_CreateArray();

    /* output */
    st = bk_outdir_begin(o->out_dir, j->tmpdir, sizeof j->tmpdir);
    if (st != BK_OK)
        goto fail;
    st = bk_st_stream_begin(j->tmpdir, "model", o->max_shard_bytes ? o->max_shard_bytes : 5000000000ull,
                            &j->out);
    if (st != BK_OK)
        goto fail;
    st = declare_outputs(j);
    if (st == BK_OK)
        st = write_passthrough(j);
    if (st != BK_OK)
        goto fail;

    {
        char msg[512];
        snprintf(msg, sizeof msg, "%s: %lld layers, hessian %s, %s, calibration %lld x %lld, backend %s",
                 o->model_dir, (long long)j->cfg->n_layers, bk_hessian_name(o->hessian),
                 bk_algorithm_name(o->solve.algorithm), (long long)j->S, (long long)j->T,
                 bk_backend_device(j->backend));
        emit(j, BK_EV_START, j->layer_begin, NULL, msg);
    }

    if (j->tokens) {
        double t = bk_now();
        MB_LOOP(j, s0, sb) {
            st = bk_fwd_embed(j->fwd, j->model, j->tokens + s0 * j->T, sb,
                              j->h + s0 * j->T * j->cfg->hidden);
            if (st != BK_OK)
                goto fail;
        }
        j->t_forward += bk_now() - t;
        for (int l = 0; l < j->layer_end; l++) {
            st = layer_tokens(j, l);
            if (st != BK_OK)
                goto fail;
        }
    } else {
        for (int l = j->layer_begin; l < j->layer_end; l++) {
            if (j->acts)
                st = layer_acts(j, l);
            else
                st = bk__layer_rtn(j->model, j->backend, j->out, o, j->cfg, l,
                                   j->report_modules, &j->quantized_params);
            if (st != BK_OK)
                goto fail;
            if (bk__stop_requested()) {
                st = bk_error(BK_ERR_INTERRUPTED, "interrupted after layer %d", l);
                goto fail;
            }
        }
    }

    emit(j, BK_EV_WRITE, j->layer_end - 1, NULL, "writing config.json, report.json, tokenizer files");
    {
        double t = bk_now();
        st = bk_st_stream_finish(j->out);
        j->out = NULL;
        if (st == BK_OK)
            st = write_config_and_report(j);
        if (st == BK_OK)
            st = bk__copy_aux_files(o->model_dir, j->tmpdir);
        if (st == BK_OK)
            st = bk_outdir_commit(j->tmpdir, o->out_dir, o->overwrite);
        j->t_io += bk_now() - t;
        if (st != BK_OK)
            goto fail;
    }
    emit(j, BK_EV_DONE, j->layer_end, NULL, o->out_dir);
    job_free(j);
    return BK_OK;

fail:
    if (j->out)
        bk_st_stream_abort(j->out);
    if (j->tmpdir[0])
        bk_remove_tree(j->tmpdir);
    job_free(j);
    return st;
}
