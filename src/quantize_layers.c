/* The layer driver's bodies in the quantization job: one layer's stages and
 * solves (token calibration), the resume rebuild of a finished layer, the
 * dumped-activations and rtn layers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward_internal.h"
#include "quantize_job.h"
#include "util.h"

/* dst = a deep copy of src (the working copy starts as the original). */
bk_status bk__q_weights_copy(const bk_model_config *c, const bk_layer_weights *src,
                                    bk_layer_weights *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->layer = src->layer;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t o, in;
        bk_module_shape(c, (bk_module)i, &o, &in);
        if (src->w[i]) {
            if (!(dst->w[i] = bk_alloc((size_t)(o * in), sizeof(float))))
                goto nomem;
            memcpy(dst->w[i], src->w[i], (size_t)(o * in) * sizeof(float));
        }
        if (src->b[i]) {
            if (!(dst->b[i] = bk_alloc((size_t)o, sizeof(float))))
                goto nomem;
            memcpy(dst->b[i], src->b[i], (size_t)o * sizeof(float));
        }
    }
    const float *sv[4] = {src->attn_norm, src->mlp_norm, src->q_norm, src->k_norm};
    float **dv[4] = {&dst->attn_norm, &dst->mlp_norm, &dst->q_norm, &dst->k_norm};
    const int64_t len[4] = {c->hidden, c->hidden, c->head_dim, c->head_dim};
    for (int i = 0; i < 4; i++) {
        if (!sv[i])
            continue;
        if (!(*dv[i] = bk_alloc((size_t)len[i], sizeof(float))))
            goto nomem;
        memcpy(*dv[i], sv[i], (size_t)len[i] * sizeof(float));
    }
    return BK_OK;
nomem:
    bk_layer_weights_free(dst);
    return bk_error(BK_ERR_NOMEM, "layer %d: out of memory for the working copy of the weights",
                    src->layer);
}

/* One stage over every micro-batch (of this rank). */
static bk_status run_stage(job *j, bk_stage stage)
{
    static const char *const fk[] = {"fwd.qkv", "fwd.o", "fwd.mlp", "fwd.down", "fwd.out",
                                     "fwd.full", "fwd.taps"};
    static const char *const hk[] = {"hess.qkv", "hess.o", "hess.mlp", "hess.down", "hess.out",
                                     "hess.full", "hess.taps"};
    const double f0 = j->t_forward, h0 = j->t_hessian;
    if (j->nranks > 1 && bk__q_stage_modules(stage)) {
        bk_status st = bk__q_stage_ranks(j, stage);
        if (st != BK_OK)
            return st;
    } else {
        MB_LOOP(j, s0, sb) {
            bk_status st = j->ops->run(j->ops_ctx, stage, s0, sb, &j->t_forward, &j->t_hessian);
            if (st != BK_OK)
                return st;
        }
    }

    if ((unsigned)stage < sizeof fk / sizeof fk[0]) {
        bk_prof_add(fk[stage], j->t_forward - f0);
        bk_prof_add(hk[stage], j->t_hessian - h0);
    }
    return BK_OK;
}

/* Layer l with its original weights (orig, from the layer driver): the
 * stages and solves of a quantized layer, or the layer as it is. */
static bk_status layer_tokens(job *j, int l, const bk_layer_weights *origp)
{
    const bk_layer_weights orig = *origp;
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    int begun = 0;
    bk_status st = BK_OK;
    double t = bk_now();
    /* the host working copy is only needed where the stages or the solves
     * use host weights (the device stages keep their own) */
    const int dev = j->ops->factors_dev && j->ops->solve_dev;
    if (!dev)
        st = bk__q_weights_copy(j->cfg, &orig, &lw);
    j->t_io += bk_now() - t;
    if (st != BK_OK)
        goto done;
    const int quantize = bk__q_in_range(j, l);
    if (quantize)
        bk__q_emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    t = bk_now();
    st = j->ops->layer_begin(j->ops_ctx, &orig, dev ? &orig : &lw, quantize);
    j->t_io += bk_now() - t;
    bk_prof_add("io.layer_begin", bk_now() - t);
    if (st != BK_OK)
        goto done;
    begun = 1;
    /* backprop kinds: the stages take the flow's output side (j->acc: this
     * layer's; or the GPU flow's device Grams) */
    if (quantize && j->bp) {
        bk_bp_side side;
        memset(&side, 0, sizeof side);
        side.layer = l;
        const int k = l - j->bp_leaf_lo;
        if (j->bp_dev && k >= 0 && k < j->bp_leaf && j->bp_dev[k].G[0] &&
            j->bp_dev[k].layer == l) {
            memcpy(side.G, j->bp_dev[k].G, sizeof side.G);
            memcpy(side.gw, j->bp_dev[k].gw, sizeof side.gw);
            side.N = j->bp_dev[k].N;
        } else {
            side.acc = j->acc;
        }
        t = bk_now();
        st = j->ops->bp_grads ? j->ops->bp_grads(j->ops_ctx, &side)
                              : bk_error(BK_ERR_UNSUPPORTED,
                                         "quantize: the %s stages take no backprop gradients",
                                         j->ops->name);
        j->t_hessian += bk_now() - t;
        if (st != BK_OK)
            goto done;
    }

    if (!quantize) {
        st = run_stage(j, BK_STAGE_FULL);
        goto done;
    }
    if (!j->o->sequential) {
        if ((st = run_stage(j, BK_STAGE_TAPS)) != BK_OK)
            goto done;
        st = bk__q_solve_group(j, l, 0, BK_MOD_COUNT - 1, &lw, &orig);
        goto done;
    }
    /* stage 1: q, k, v from attn_in */
    if ((st = run_stage(j, BK_STAGE_QKV)) != BK_OK)
        goto done;
    if ((st = bk__q_solve_group(j, l, BK_MOD_Q, BK_MOD_V, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 2: o_proj sees the quantized q/k/v */
    if ((st = run_stage(j, BK_STAGE_O)) != BK_OK ||
        (st = bk__q_solve_group(j, l, BK_MOD_O, BK_MOD_O, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 3: residual with the quantized o_proj; gate/up from mlp_in */
    if ((st = run_stage(j, BK_STAGE_MLP)) != BK_OK ||
        (st = bk__q_solve_group(j, l, BK_MOD_GATE, BK_MOD_UP, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 4: down_proj sees the quantized gate/up */
    if ((st = run_stage(j, BK_STAGE_DOWN)) != BK_OK ||
        (st = bk__q_solve_group(j, l, BK_MOD_DOWN, BK_MOD_DOWN, &lw, &orig)) != BK_OK)
        goto done;
    /* stage 5: the layer's output with every module quantized */
    st = run_stage(j, BK_STAGE_OUT);

done:
    t = bk_now();
    if (begun)
        j->ops->layer_end(j->ops_ctx);
    bk_layer_weights_free(&lw);
    bk_prof_add("io.layer_end", bk_now() - t);
    if (st == BK_OK && bk__q_in_range(j, l))
        bk__q_emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* Resume: the calibration state after finished layer l, rebuilt: the layer's
 * forward pass with the weights its modules were quantized to (codes and scales
 * from the shards or module files; the original weights with --no-sequential, whose modules all saw
 * full-precision inputs). The same forward functions on the same micro-batches
 * as the run that quantized it, so the same bits. */
static bk_status layer_rebuild(job *j, int l, bk_layer_weights *w)
{
    /* w: the original weights (from the layer driver); then the quantized
     * ones in place */
    bk_status st = BK_OK;
    double t = bk_now();
    if (j->o->sequential)
        st = bk_resume_load_weights(j->rs, &j->o->solve.quant, j->cfg, l, w);
    bk_prof_add("resume.dequantize", bk_now() - t);
    j->t_io += bk_now() - t;
    double t1 = bk_now();
    if (st == BK_OK)
        st = j->ops->layer_begin(j->ops_ctx, w, w, 0);
    bk_prof_add("resume.layer_begin", bk_now() - t1);
    if (st == BK_OK) {
        st = run_stage(j, BK_STAGE_FULL);
        j->ops->layer_end(j->ops_ctx);
    }
    if (st != BK_OK)
        return bk_error_prefix(st, "--resume: rebuilding the calibration state");
    return BK_OK;
}

/* ------------------------------------------- one layer, dumped activations */

static bk_status layer_acts(job *j, int l, const bk_layer_weights *origp)
{
    const bk_model_config *c = j->cfg;
    const bk_layer_weights orig = *origp;
    bk_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    if (!bk__q_in_range(j, l))
        return BK_OK;
    bk__q_emit(j, BK_EV_LAYER_BEGIN, l, NULL, NULL);
    double t = bk_now();
    bk_status st = bk__q_weights_copy(j->cfg, &orig, &lw);
    bk_act_layer al;
    memset(&al, 0, sizeof al);
    if (st == BK_OK)
        st = bk__act_layer_open(j->acts, l, &al);
    j->t_io += bk_now() - t;
    if (st == BK_OK)
        st = j->ops->layer_begin(j->ops_ctx, &orig, &lw, 1); /* resets the accumulators */
    if (st != BK_OK)
        goto done;
    if (!j->ops->add_inputs) {
        st = bk_error(BK_ERR_INTERNAL, "quantize: the %s stages take no dumped activations",
                      j->ops->name);
        goto done;
    }
    const int64_t T = j->T, nb = j->batch * T;
    const int64_t width[4] = {c->hidden, c->n_heads * c->head_dim, c->hidden, c->intermediate};
    static const char *const tap[4] = {"attn_in", "o_in", "mlp_in", "down_in"};
    float *in[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < 4 && st == BK_OK; k++)
        if (!(in[k] = bk_alloc((size_t)(nb * width[k]), sizeof(float))))
            st = bk_error(BK_ERR_NOMEM, "out of memory for activations");
    MB_LOOP(j, s0, sb) {
        if (st != BK_OK)
            break;
        int64_t r0 = s0 * T, nr = sb * T;
        t = bk_now();
        for (int k = 0; k < 4 && st == BK_OK; k++)
            st = bk__act_rows(&al, tap[k], r0, nr, width[k], in[k]);
        j->t_io += bk_now() - t;
        if (st != BK_OK)
            break;
        st = j->ops->add_inputs(j->ops_ctx, s0, sb, (const float *const *)in, &j->t_forward,
                                &j->t_hessian);
    }
    for (int k = 0; k < 4; k++)
        free(in[k]);
    if (st != BK_OK)
        goto done;
    for (int m = 0; m < BK_MOD_COUNT && st == BK_OK; m++)
        st = bk__q_solve_module(j, l, (bk_module)m, m + 1 < BK_MOD_COUNT ? m + 1 : -1, &lw,
                                &orig);
done:
    j->ops->layer_end(j->ops_ctx);
    bk__act_layer_close(&al);
    bk_layer_weights_free(&lw);
    if (st == BK_OK)
        bk__q_emit(j, BK_EV_LAYER_DONE, l, NULL, NULL);
    return st;
}

/* ------------------------------------------- the layer driver's bodies */

/* The layer driver's form of layer l (src/layer_driver.h): BF16 (the
 * matrices left in the mapped checkpoint) where nothing on the host reads
 * them as F32, i.e. token calibration of one process (no backward flow) whose
 * whole layer runs on the device stages (factors and solves: layer_tokens
 * uploads them, g_layer_begin; the device solve reads its original W from the
 * device copy) and which is not a kept layer of --resume (rebuilt from F32
 * weights, layer_rebuild); and only for a checkpoint whose matrices are all
 * BF16 in the mapping (j->mapped_bf16). */
int bk__q_layer_bf16(void *user, int l)
{
    const job *j = user;
    const int kept = bk__q_in_range(j, l) && l < j->first_layer;
    return j->mapped_bf16 && j->tokens && !j->bp && !j->acts && j->nranks <= 1 && j->ops &&
           j->ops->factors_dev && j->ops->solve_dev && !kept;
}

/* w as F32 where the body needs it so (the driver's read-ahead of the first
 * layer is started before the stages exist, in a guessed form) */
static bk_status weights_form(job *j, int l, bk_layer_weights *w)
{
    int any = 0;
    for (int i = 0; w && i < BK_MOD_COUNT; i++)
        any |= w->wb[i] != NULL;
    if (!any || bk__q_layer_bf16(j, l))
        return BK_OK;
    double t = bk_now();
    bk_status st = bk__layer_weights_widen(j->cfg, w);
    j->t_io += bk_now() - t;
    bk_prof_add("io.widen_bf16", bk_now() - t);
    return st;
}

/* Token calibration: kept layers (--resume) are rebuilt, the others
 * quantized and journaled, or (before the range) run as they are. */
bk_status bk__q_layer_body(void *user, int l, bk_layer_weights *w)
{
    job *j = user;
    j->t_io += j->drv.t_load_last;
    bk_status st0 = weights_form(j, l, w);
    if (st0 != BK_OK)
        return st0;
    /* (backprop kinds: the flow's leaves call this; a resumed run redoes the
     * flow, whose passes use the original model only, and rebuilds the kept
     * layers from their saved codes as every kind does) */
    const int kept = bk__q_in_range(j, l) && l < j->first_layer;
    bk_status st = kept ? layer_rebuild(j, l, w) : layer_tokens(j, l, w);
    if (st == BK_OK && !kept && bk__q_in_range(j, l))
        st = bk__q_journal_layer(j, l);
    return st;
}

/* Dumped activations (w: the layer's weights), or rtn without calibration
 * (w NULL: the modules are read one by one). */
bk_status bk__q_offline_body(void *user, int l, bk_layer_weights *w)
{
    job *j = user;
    bk_status st;
    j->t_io += j->drv.t_load_last;
    if ((st = weights_form(j, l, w)) != BK_OK)
        return st;
    if (j->acts) {
        st = layer_acts(j, l, w);
    } else {
        st = bk__layer_rtn(j->model, j->backend, j->out, j->o, j->cfg, l, j->report_modules,
                           &j->quantized_params);
        if (st == BK_OK) /* (written on this thread: the journal after them) */
            st = bk__q_writer_drain(j);
    }
    if (st == BK_OK)
        st = bk__q_journal_layer(j, l);
    if (st == BK_OK && !j->acts)
        st = bk__q_writer_drain(j);
    return st;
}
