/* CUDA backend — the quantization job's stages on the GPU (the bk_stage_ops
 * table that the quantization job drives (src/quantize_layers.c); src/pipeline_gpu.h).
 *
 * Resident on the device: the residual stream h and the o_proj inputs of all
 * calibration sequences (or, when they do not fit next to everything else,
 * in pinned host memory with one micro-batch window on the device, chosen
 * from cudaMemGetInfo), one layer's weights twice (original + working copy
 * with the quantized modules), one layer's Hessian accumulators, and the
 * micro-batch scratch. Each stage runs on one micro-batch; the stream is
 * synchronized at the end of its forward part and of its Hessian part so
 * that the stage times are real. The solves go through the backend's
 * host-array entry (bk_backend_solve): the factors are downloaded.
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend_impl.h"
#include "bwd_mem.h"
#include "fwd_internal.cuh"

extern "C" {
#include "util.h"
}

namespace {

struct gstages {
    bk_backend *b;
    const bk_model *m;
    bk_model_config cfg;
    bk_hessian_kind kind;
    int fp64, keep_plain, fully;
    int codes_only;   /* the export needs codes and scales only (no host weights) */
    int64_t S, T, B, hid, qd, kvd;
    int64_t s_lo, s_hi; /* the sequences held: all, or an MPI rank's share */
    bk_gfwd *f;
    bk_ghess *acc;
    /* residual stream and o_proj inputs of the sequences held (N = (s_hi - s_lo) * T
     * rows; sequence s at row (s - s_lo) * T) */
    int resident;
    float *H, *O;     /* device [N, hid], [N, qd] (resident) */
    float *Hh, *Oh;   /* pinned host (not resident) */
    float *hwin, *owin; /* device windows [B*T, ...] (not resident) */
    float *D;         /* device [N, intermediate]: down_proj inputs of the sequences held,
                         kept from stage DOWN for stage OUT when they fit (else recomputed) */
    /* micro-batch buffers (oscr: the o_proj input tap of stage TAPS; qrot,
     * krot: fully-local only) */
    float *x, *qrot, *krot, *down, *mlp_in, *oscr;
    bk_glayer *orig, *lw;
    /* the input side of q (k) kept for k and v, gate's for up: their A is the
     * same E[x x^T] (bk_dshare); what the last factors formed A from, for
     * module kmod (-1: none) */
    bk_dshare share;
    const void *ksrc;
    const void *kA; /* the device A it returned */
    double kscale;
    uint64_t kgen;
    int kshared, kmod;
    /* the output factor B of module pre_mod (the next one to be solved,
     * prepare_next) factored ahead from factors formed into aside at
     * accumulator generation pre_gen; NULL: none */
    bk_dprefetch *pre;
    int pre_mod;
    uint64_t pre_gen;
    bk_ghess_aside aside;
    char desc[256];
};

/* The ahead factorization and its factors released (after its thread). */
void pre_drop(gstages *g)
{
    if (g->pre)
        bk_dprefetch_drop(static_cast<bk_cuda_ctx *>(g->b->ctx), g->pre);
    g->pre = NULL;
    g->pre_mod = -1;
    if (g->acc)
        bk_ghess_aside_free(g->acc, &g->aside);
}

/* The kept input side goes wherever the Grams it was factored from may change
 * (a stage adds to them, a layer begins or ends, ranks exchange sums, output
 * gradients arrive) and at the end. */
void share_drop(gstages *g)
{
    if (g->share.valid)
        bk_dshare_drop(static_cast<bk_cuda_ctx *>(g->b->ctx), &g->share);
    g->kmod = -1;
    pre_drop(g); /* (its generation would not match either) */
}

double now_synced(gstages *g, bk_status *st)
{
    bk_status s = bk_gpu_sync(g->f);
    if (*st == BK_OK)
        *st = s;
    return bk_now();
}

/* The end of a stage's forward part: the per-operation non-finite flags are
 * copied to the host ahead of the synchronization that times the part (no
 * synchronization of their own), then the first operation of layer lw whose
 * output was not finite is named as the CPU stages name it
 * (src/forward_internal.h). */
void forward_end(gstages *g, const bk_glayer *lw, double t, double *t_forward, bk_status *st)
{
    if (*st == BK_OK)
        *st = bk_gfwd_nf_fetch(g->f);
    *t_forward += now_synced(g, st) - t;
    if (*st == BK_OK)
        *st = bk_gfwd_nf_report(g->f, lw);
}

bk_status falloc(gstages *g, float **p, int64_t rows, int64_t cols, const char *what)
{
    void *q = NULL;
    bk_status st = bk_gpu_alloc(g->f, &q, (size_t)(rows * cols) * sizeof(float), what);
    *p = static_cast<float *>(q);
    return st;
}

/* Micro-batch pointers into the residual stream / o_proj inputs. */
bk_status get_h(gstages *g, int64_t s0, int64_t sb, float **out)
{
    const size_t off = (size_t)((s0 - g->s_lo) * g->T * g->hid);
    if (g->resident) {
        *out = g->H + off;
        return BK_OK;
    }
    *out = g->hwin;
    return bk_gpu_upload(g->f, g->hwin, g->Hh + off, (size_t)(sb * g->T * g->hid) * sizeof(float));
}

bk_status put_h(gstages *g, int64_t s0, int64_t sb)
{
    if (g->resident)
        return BK_OK;
    const size_t off = (size_t)((s0 - g->s_lo) * g->T * g->hid);
    return bk_gpu_download(g->f, g->Hh + off, g->hwin, (size_t)(sb * g->T * g->hid) * sizeof(float));
}

bk_status get_o(gstages *g, int64_t s0, int64_t sb, int load, float **out)
{
    const size_t off = (size_t)((s0 - g->s_lo) * g->T * g->qd);
    if (g->resident) {
        *out = g->O + off;
        return BK_OK;
    }
    *out = g->owin;
    if (!load)
        return BK_OK;
    return bk_gpu_upload(g->f, g->owin, g->Oh + off, (size_t)(sb * g->T * g->qd) * sizeof(float));
}

bk_status put_o(gstages *g, int64_t s0, int64_t sb)
{
    if (g->resident)
        return BK_OK;
    const size_t off = (size_t)((s0 - g->s_lo) * g->T * g->qd);
    return bk_gpu_download(g->f, g->Oh + off, g->owin, (size_t)(sb * g->T * g->qd) * sizeof(float));
}

/* ------------------------------------------------------------ the ops */

bk_status g_embed(void *ctx, const int32_t *tokens, int64_t s0, int64_t sb)
{
    gstages *g = static_cast<gstages *>(ctx);
    float *h = NULL;
    bk_status st = get_h(g, s0, sb, &h);
    if (st == BK_OK)
        st = bk_gfwd_embed(g->f, g->m, tokens + s0 * g->T, sb, h);
    if (st == BK_OK)
        st = put_h(g, s0, sb);
    if (st == BK_OK && s0 + sb >= g->s_hi)
        bk_gfwd_embed_release(g->f); /* the last micro-batch */
    if (st == BK_OK)
        st = bk_gpu_sync(g->f);
    return st;
}

void g_layer_end(void *ctx)
{
    gstages *g = static_cast<gstages *>(ctx);
    share_drop(g);
    bk_glayer_free(g->f, g->orig);
    bk_glayer_free(g->f, g->lw);
    g->orig = g->lw = NULL;
}

bk_status g_layer_begin(void *ctx, const bk_layer_weights *orig, const bk_layer_weights *lw,
                        int hessians)
{
    gstages *g = static_cast<gstages *>(ctx);
    (void)lw; /* equal to orig now: copied on the device */
    /* BK_PROFILE: where io.layer_begin goes (nothing when profiling is off) */
    cudaStream_t ps = g->f ? g->f->c->stream : 0;
    double tp = bk_now();
    g_layer_end(ctx);
    /* the embedding is done (an MPI rank's share may end before the last
     * sequence, where g_embed releases the table) */
    bk_gfwd_embed_release(g->f);
    bk_cuda_pmark(ps, &tp, "lb.free_previous");
    bk_status st = bk_glayer_upload(g->f, orig, &g->orig);
    bk_cuda_pmark(ps, &tp, "lb.upload");
    if (st == BK_OK && hessians) /* the working copy only where modules are quantized */
        st = bk_glayer_clone(g->f, g->orig, &g->lw);
    bk_cuda_pmark(ps, &tp, "lb.clone");
    if (st == BK_OK && hessians)
        bk_ghess_reset(g->acc);
    if (st == BK_OK)
        st = bk_gpu_sync(g->f);
    bk_cuda_pmark(ps, &tp, "lb.reset");
    if (st != BK_OK) {
        g_layer_end(ctx);
        if (st == BK_ERR_DEVICE_OOM)
            bk_error_prefix(st, "GPU pipeline: the layer's weights do not fit (use a smaller "
                                "--batch or --cpu-stages)");
    }
    return st;
}

/* The adds of g_run, after its forward part passed forward_end: every
 * activation they read (attn_in, the rotated q/k, o_in, mlp_in, down_in) is
 * the output of a forward operation of this micro-batch whose non-finite flag
 * was fetched and reported there, so the accumulator skips its own scans (one
 * full read of each input and a synchronization per add; the messages are
 * unchanged: a non-finite input never reached the adds). */
struct checked_adds {
    bk_ghess *a;
    explicit checked_adds(bk_ghess *x) : a(x) { bk_ghess_inputs_checked(a, 1); }
    ~checked_adds() { bk_ghess_inputs_checked(a, 0); }
    checked_adds(const checked_adds &) = delete;
    checked_adds &operator=(const checked_adds &) = delete;
};

bk_status g_adds(gstages *g, int64_t sb, const float *x, const float *o, const float *mlp_in,
                 const float *down)
{
    bk_status st = bk_ghess_add_attn(g->acc, g->orig, x, g->fully ? g->qrot : NULL,
                                     g->fully ? g->krot : NULL, sb);
    if (st == BK_OK)
        st = bk_ghess_add_o(g->acc, o, sb);
    if (st == BK_OK)
        st = bk_ghess_add_mlp(g->acc, g->orig, mlp_in, sb);
    if (st == BK_OK)
        st = bk_ghess_add_down(g->acc, down, sb);
    return st;
}

bk_status g_run(void *ctx, bk_stage stage, int64_t s0, int64_t sb, double *t_forward,
                double *t_hessian)
{
    gstages *g = static_cast<gstages *>(ctx);
    bk_gfwd *f = g->f;
    if (!g->orig || (!g->lw && stage != BK_STAGE_FULL && stage != BK_STAGE_TAPS))
        return bk_error(BK_ERR_INTERNAL, "GPU pipeline: stage without a layer");
    share_drop(g);
    float *h = NULL, *o = NULL;
    double t = bk_now();
    bk_status st = bk_gfwd_nf_clear(f);
    if (st == BK_OK)
        st = get_h(g, s0, sb, &h);
    if (st != BK_OK)
        return st;
    switch (stage) {
    case BK_STAGE_QKV:
        st = bk_gfwd_attn_in(f, g->orig, h, sb, g->x);
        /* fully-local: the FP rotated queries and keys only (the attention's
         * output is not used here: stage O recomputes it with the quantized
         * q/k/v; v_proj and the attention output are checked for non-finite
         * values there, as for the other kinds) */
        if (st == BK_OK && g->fully)
            st = bk_gfwd_qk_rot(f, g->orig, g->x, sb, g->qrot, g->krot);
        forward_end(g, g->orig, t, t_forward, &st);
        if (st != BK_OK)
            return st;
        t = bk_now();
        {
            checked_adds ca(g->acc);
            st = bk_ghess_add_attn(g->acc, g->orig, g->x, g->fully ? g->qrot : NULL,
                                   g->fully ? g->krot : NULL, sb);
        }
        *t_hessian += now_synced(g, &st) - t;
        return st;
    case BK_STAGE_O:
        st = bk_gfwd_attn_in(f, g->lw, h, sb, g->x);
        if (st == BK_OK)
            st = get_o(g, s0, sb, 0, &o);
        if (st == BK_OK)
            st = bk_gfwd_attention(f, g->lw, g->x, sb, o, NULL, NULL, NULL);
        if (st == BK_OK)
            st = put_o(g, s0, sb);
        forward_end(g, g->lw, t, t_forward, &st);
        if (st != BK_OK)
            return st;
        t = bk_now();
        {
            checked_adds ca(g->acc);
            st = bk_ghess_add_o(g->acc, o, sb);
        }
        *t_hessian += now_synced(g, &st) - t;
        return st;
    case BK_STAGE_MLP:
        st = get_o(g, s0, sb, 1, &o);
        if (st == BK_OK)
            st = bk_gfwd_attn_out(f, g->lw, o, sb, h);
        if (st == BK_OK)
            st = bk_gfwd_mlp_in(f, g->lw, h, sb, g->x);
        if (st == BK_OK)
            st = put_h(g, s0, sb);
        forward_end(g, g->lw, t, t_forward, &st);
        if (st != BK_OK)
            return st;
        t = bk_now();
        {
            checked_adds ca(g->acc);
            st = bk_ghess_add_mlp(g->acc, g->orig, g->x, sb);
        }
        *t_hessian += now_synced(g, &st) - t;
        return st;
    case BK_STAGE_DOWN: {
        float *d = g->D ? g->D + (s0 - g->s_lo) * g->T * g->cfg.intermediate : g->down;
        st = bk_gfwd_mlp_in(f, g->lw, h, sb, g->x);
        if (st == BK_OK)
            st = bk_gfwd_mlp_hidden(f, g->lw, g->x, sb, d, NULL, NULL);
        forward_end(g, g->lw, t, t_forward, &st);
        if (st != BK_OK)
            return st;
        t = bk_now();
        {
            checked_adds ca(g->acc);
            st = bk_ghess_add_down(g->acc, d, sb);
        }
        *t_hessian += now_synced(g, &st) - t;
        return st;
    }
    case BK_STAGE_OUT:
        if (g->D) { /* h is unchanged since stage DOWN: its down_proj inputs are kept */
            st = bk_gfwd_mlp_out(f, g->lw, g->D + (s0 - g->s_lo) * g->T * g->cfg.intermediate,
                                 sb, h);
        } else {
            st = bk_gfwd_mlp_in(f, g->lw, h, sb, g->x);
            if (st == BK_OK)
                st = bk_gfwd_mlp_hidden(f, g->lw, g->x, sb, g->down, NULL, NULL);
            if (st == BK_OK)
                st = bk_gfwd_mlp_out(f, g->lw, g->down, sb, h);
        }
        if (st == BK_OK)
            st = put_h(g, s0, sb);
        forward_end(g, g->lw, t, t_forward, &st);
        return st;
    case BK_STAGE_FULL:
        st = bk_gfwd_layer(f, g->orig, sb, h, NULL);
        if (st == BK_OK)
            st = put_h(g, s0, sb);
        forward_end(g, g->orig, t, t_forward, &st);
        return st;
    case BK_STAGE_TAPS: {
        bk_layer_taps taps = {g->x, g->oscr, g->mlp_in, g->down, g->fully ? g->qrot : NULL,
                              g->fully ? g->krot : NULL};
        st = bk_gfwd_layer(f, g->orig, sb, h, &taps);
        if (st == BK_OK)
            st = put_h(g, s0, sb);
        forward_end(g, g->orig, t, t_forward, &st);
        if (st != BK_OK)
            return st;
        t = bk_now();
        {
            checked_adds ca(g->acc);
            st = g_adds(g, sb, g->x, g->oscr, g->mlp_in, g->down);
        }
        *t_hessian += now_synced(g, &st) - t;
        return st;
    }
    }
    return bk_error(BK_ERR_INTERNAL, "GPU pipeline: unknown stage %d", (int)stage);
}

bk_status g_factors(void *ctx, bk_module mod, const float **A, const float **B,
                    const float **A_plain)
{
    gstages *g = static_cast<gstages *>(ctx);
    bk_status st = bk_ghess_factors(g->acc, g->orig, mod, A, B, A_plain);
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "GPU pipeline: forming the factors (use a smaller --batch or "
                            "--cpu-stages)");
    return st;
}

bk_status g_factors_dev(void *ctx, bk_module mod, const float **A, const float **B,
                        const float **A_plain)
{
    gstages *g = static_cast<gstages *>(ctx);
    bk_status st = bk_ghess_factors_dev(g->acc, g->orig, mod, A, B, A_plain);
    g->kmod = -1;
    if (st == BK_OK) {
        bk_ghess_factor_key(g->acc, &g->ksrc, &g->kscale, &g->kgen, &g->kshared);
        g->kA = *A;
        g->kmod = (int)mod;
    }
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "GPU pipeline: forming the factors (use a smaller --batch or "
                            "--cpu-stages)");
    return st;
}

/* The solve with the device factors; the quantized weight goes straight into
 * the device working copy. */
bk_status g_solve_dev(void *ctx, bk_module mod, const bk_solve_problem *p, const float *A_plain,
                      const bk_solve_opts *o, bk_solve_result *r, double *loss_gptq)
{
    gstages *g = static_cast<gstages *>(ctx);
    if (!g->lw)
        return bk_error(BK_ERR_INTERNAL, "GPU pipeline: solve without a layer");
    if (p->dtype != BK_DT_F32 || p->LA || p->LB)
        return bk_error(BK_ERR_INTERNAL, "GPU pipeline: device solves take F32 factors");
    bk_dsolve_problem dp;
    memset(&dp, 0, sizeof dp);
    dp.m = p->m;
    dp.n = p->n;
    dp.W = static_cast<const float *>(p->W);
    dp.A = static_cast<const float *>(p->A);
    dp.B = static_cast<const float *>(p->B);
    dp.A_plain = A_plain;
    dp.label_w = p->label_w;
    dp.label_a = p->label_a;
    dp.label_b = p->label_b;
    dp.dW = g->orig->w[mod];
    dp.no_host_weight = g->codes_only;
    /* A formed by the factors call just before (the job's order: factors,
     * then the solve, per module); kept after q and k for k and v, after gate
     * for up, when their Gram is the one they share */
    const int named = g->kmod == (int)mod && p->A == g->kA;
    g->share.src = named ? g->ksrc : NULL;
    g->share.scale = named ? g->kscale : 0.0;
    g->share.gen = named ? g->kgen : 0; /* (a kept side of another generation is not used) */
    g->share.keep = named && g->kshared &&
                    (mod == BK_MOD_Q || mod == BK_MOD_K || mod == BK_MOD_GATE);
    dp.share = &g->share;
    bk_cuda_ctx *cc = static_cast<bk_cuda_ctx *>(g->b->ctx);
    /* B factored ahead for this module (prepare_next) from the state its
     * factors were just formed from: the solve takes it over */
    const int ahead = g->pre && g->pre_mod == (int)mod;
    if (ahead && g->kmod == (int)mod && g->kgen == g->pre_gen && dp.B)
        dp.pre = g->pre;
    else if (ahead)
        bk_dprefetch_drop(cc, g->pre);
    if (ahead)
        g->pre = NULL; /* (the solve releases it; its factors buffers below) */
    double tp = bk_now();
    bk_status st = bk_cuda_solve_dev(cc, &dp, o, r, g->lw->w[mod], loss_gptq);
    if (ahead)
        pre_drop(g);
    if (st == BK_OK) /* the BF16 copy of the working weight follows (bf16 GEMMs) */
        st = bk_glayer_sync_bf16(g->f, g->lw, mod);
    bk_cuda_pmark(cc->stream, &tp, "g.solve_dev_total");
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "GPU pipeline: the solve (use a smaller --batch or --cpu-stages)");
    return st;
}

/* Module next is solved after the current one (the driver's order): its
 * factors formed into the aside buffers now (the main stream, before the
 * current solve), and its output factor B factored on the pf stream by a
 * thread of its own while the current module is solved (bk_dprefetch).
 * Advisory: whatever fails here is dropped silently; next's own factors and
 * solve then do the work, and report it, as without the call. */
void g_prepare_next(void *ctx, bk_module next, const bk_solve_opts *o)
{
    gstages *g = static_cast<gstages *>(ctx);
    /* The driver calls this between the current module's factors and its
     * solve: a prefetch started for the current module (kmod, whose factors
     * were just formed: q -> k -> v, and every module with --no-sequential)
     * is about to be taken by that solve. It is kept, and nothing is started
     * for `next` (one prefetch per context at a time: one pf stream, one set
     * of handles, one aside set); dropping it here would join its thread and
     * throw its factor away just before the solve it was made for. */
    if (g->pre && g->kmod >= 0 && g->pre_mod == g->kmod)
        return;
    pre_drop(g);
    if (!g->lw || !g->acc || !o || (unsigned)next >= BK_MOD_COUNT ||
        !bk_hessian_is_two_sided(g->kind, next) || o->algorithm == BK_ALG_RTN)
        return;
    int64_t m, n;
    bk_module_shape(&g->cfg, next, &m, &n);
    bk_cuda_ctx *cc = static_cast<bk_cuda_ctx *>(g->b->ctx);
    /* only with room for it and for what the current solve (module kmod)
     * still allocates after this call, which must not run short because of
     * work ahead. The prefetch (upper bound): the aside A, A_plain and B, B's
     * double mirror, a factor of 12 bytes per padded entry (fp64 + fp32 with
     * factor_fp64), the workspaces. The current solve (upper bound, as if
     * nothing were shared): its input side (double mirror, factor), its
     * output side when it has one (as the prefetch's), 16 bytes per weight
     * entry, the workspaces. (Not "twice the prefetch": q's solve needs
     * about twice what k's prefetch holds.) */
    const double mp = (double)bk_round_up(m, BK_CUDA_PAD), ws = (double)(64 << 20);
    const double need = 8.0 * (double)n * (double)n + 12.0 * (double)m * (double)m +
                        12.0 * mp * mp + ws;
    double cur = need;
    if (g->kmod >= 0 && g->kmod < BK_MOD_COUNT) {
        int64_t cm, cn;
        bk_module_shape(&g->cfg, (bk_module)g->kmod, &cm, &cn);
        const double cmp = (double)bk_round_up(cm, BK_CUDA_PAD),
                     cnp = (double)bk_round_up(cn, BK_CUDA_PAD);
        cur = 8.0 * (double)cn * (double)cn + 12.0 * cnp * cnp + 16.0 * (double)cm * (double)cn +
              ws;
        if (bk_hessian_is_two_sided(g->kind, (bk_module)g->kmod))
            cur += 12.0 * (double)cm * (double)cm + 12.0 * cmp * cmp;
        if (cur < need)
            cur = need;
    }
    size_t fr = 0, tot = 0;
    if (bk_dev_mem_free(cc, &fr, &tot) != BK_OK || (double)fr < need + cur) {
        bk_clear_error();
        return;
    }
    const float *B = NULL;
    uint64_t gen = 0;
    double tp = bk_now();
    bk_status st = bk_ghess_factors_dev_aside(g->acc, g->orig, next, &g->aside, &B, &gen);
    if (st == BK_OK && B)
        st = bk_dprefetch_start(cc, B, m, o, &g->pre);
    if (st != BK_OK || !g->pre) {
        pre_drop(g);
        bk_clear_error(); /* (nothing was reported: the solve redoes it) */
        return;
    }
    g->pre_mod = (int)next;
    g->pre_gen = gen;
    bk_cuda_pmark(cc->stream, &tp, "g.prepare_next");
}

bk_status g_weight_updated(void *ctx, bk_module mod, const float *w)
{
    gstages *g = static_cast<gstages *>(ctx);
    if (!g->lw)
        return bk_error(BK_ERR_INTERNAL, "GPU pipeline: weight update without a layer");
    return bk_glayer_set(g->f, g->lw, mod, w);
}

/* MPI ranks: the accumulators' sums and a solved module's working weight to a
 * collective of the driver. */
bk_status g_sums(void *ctx, unsigned modules, int dev, int rw, bk_stage_buf_fn fn, void *user)
{
    gstages *g = static_cast<gstages *>(ctx);
    share_drop(g);
    return bk_ghess_sums(g->acc, modules, dev, rw, fn, user);
}

bk_status g_share_weight(void *ctx, bk_module mod, int dev, int rw, bk_stage_buf_fn fn,
                         void *user)
{
    gstages *g = static_cast<gstages *>(ctx);
    if (!g->lw || !g->lw->w[mod])
        return bk_error(BK_ERR_INTERNAL, "GPU pipeline: weight exchange without a layer");
    int64_t o, in;
    bk_module_shape(&g->cfg, mod, &o, &in);
    bk_status st = bk_gpu_stage_buf(g->f, g->lw->w[mod], (size_t)(o * in), 0, dev, rw, fn, user);
    if (st == BK_OK && (rw & BK_BUF_WRITE)) /* received: its BF16 copy follows */
        st = bk_glayer_sync_bf16(g->f, g->lw, mod);
    if (st == BK_OK)
        st = bk_gpu_sync(g->f);
    return st;
}

/* Everything but the context itself. */
void g_release(gstages *g)
{
    g_layer_end(g);
    if (g->f) {
        float *bufs[] = {g->H, g->O, g->hwin, g->owin, g->x, g->qrot, g->krot, g->down,
                         g->mlp_in, g->oscr, g->D};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            bk_gpu_free(g->f, bufs[i]);
    }
    g->H = g->O = g->hwin = g->owin = g->x = g->qrot = g->krot = g->down = g->mlp_in = g->oscr =
        g->D = NULL;
    if (g->Hh)
        cudaFreeHost(g->Hh);
    if (g->Oh)
        cudaFreeHost(g->Oh);
    g->Hh = g->Oh = NULL;
    bk_ghess_free(g->acc);
    g->acc = NULL;
    bk_gfwd_free(g->f);
    g->f = NULL;
    cudaGetLastError();
}

void g_destroy(void *ctx)
{
    gstages *g = static_cast<gstages *>(ctx);
    if (!g)
        return;
    g_release(g);
    free(g);
}

const char *g_describe(void *ctx)
{
    return static_cast<gstages *>(ctx)->desc;
}

bk_status g_bp_grads(void *ctx, const bk_bp_side *side)
{
    gstages *g = static_cast<gstages *>(ctx);
    share_drop(g);
    bk_status st = side->acc ? bk_ghess_set_grads(g->acc, side->acc)
                             : bk_ghess_set_grads_dev(g->acc, side->layer, side->G, side->gw,
                                                      side->N);
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "GPU pipeline: the backprop-shampoo token weights (use fewer "
                            "--samples or --cpu-stages)");
    return st;
}

const bk_stage_ops gpu_stage_ops = {
    "cuda", g_embed, g_layer_begin, g_run, g_factors, g_weight_updated, g_factors_dev,
    g_solve_dev, g_layer_end, g_destroy, g_describe, g_bp_grads, g_sums, g_share_weight,
    NULL /* add_inputs: the CPU's (--activations) */, 0 /* bp_host_grads */,
    g_prepare_next,
};

} // namespace

extern "C" bk_status bk_gpu_stage_buf(bk_gfwd *f, void *d, size_t n, int f64, int dev, int rw,
                                      bk_stage_buf_fn fn, void *user)
{
    if (n == 0)
        return BK_OK;
    if (dev)
        return fn(user, d, n, f64, 1, f->c->stream);
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    const size_t step = ((size_t)256 << 20) / es;
    void *h = bk_alloc(n < step ? n : step, es);
    if (!h)
        return bk_error(BK_ERR_NOMEM, "out of host memory for a copy of a device buffer");
    bk_status st = BK_OK;
    for (size_t i = 0; i < n && st == BK_OK; i += step) {
        const size_t k = n - i < step ? n - i : step;
        char *dp = static_cast<char *>(d) + i * es;
        if (rw & BK_BUF_READ)
            st = bk_gpu_download(f, h, dp, k * es);
        if (st == BK_OK)
            st = fn(user, h, k, f64, 0, NULL);
        if (st == BK_OK && (rw & BK_BUF_WRITE))
            st = bk_gpu_upload(f, dp, h, k * es);
    }
    free(h);
    return st;
}

namespace {

/* Device bytes per token of the forward scratch and stage buffers of one
 * micro-batch (the budget of auto_batch). */
double stage_row_bytes(const bk_model_config *c)
{
    return 4.0 * (double)(6 * c->n_heads * c->head_dim + 6 * c->n_kv_heads * c->head_dim +
                          5 * c->hidden + 4 * c->intermediate);
}

/* Sequences per micro-batch: the forward scratch and stage buffers of one
 * micro-batch around 2 GiB. */
int64_t auto_batch(const bk_model_config *c, int64_t S, int64_t T)
{
    return bk_batch_within(2048.0 * 1024 * 1024, stage_row_bytes(c) * (double)T, S);
}

/* Device memory to keep free next to the calibration states: one layer's
 * weights twice (original + working copy), `squares` F32 matrices of the
 * largest factor size (accumulators, factor staging, the solve's copies) and
 * `gib` GiB of margin (bk_gpu_stage_reserve). */
uint64_t device_reserve(const bk_model_config *c, int squares, int gib)
{
    return bk_gpu_stage_reserve(c, squares, gib);
}

/* The micro-batch's device state for batch B (the context's state is freed
 * first). */
bk_status g_setup(gstages *g, int64_t B)
{
    g_release(g);
    g->B = B;
    bk_status st = bk_gfwd_create(g->b, &g->cfg, B, g->T, &g->f);
    if (st == BK_OK)
        st = bk_ghess_create(g->f, g->kind, g->fp64, g->keep_plain, &g->acc);
    const int64_t R = B * g->T;
    const int64_t xw = g->hid > g->qd ? g->hid : g->qd;
    if (st == BK_OK)
        st = falloc(g, &g->x, R, xw, "stage input");
    if (st == BK_OK)
        st = falloc(g, &g->down, R, g->cfg.intermediate, "down_proj input");
    if (st == BK_OK)
        st = falloc(g, &g->mlp_in, R, g->hid, "mlp input");
    if (st == BK_OK)
        st = falloc(g, &g->oscr, R, g->qd, "attention output scratch");
    if (st == BK_OK && g->fully)
        st = falloc(g, &g->qrot, R, g->qd, "rotated queries");
    if (st == BK_OK && g->fully)
        st = falloc(g, &g->krot, R, g->kvd, "rotated keys");
    return st;
}

} // namespace

extern "C" bk_status bk_gpu_stages_create(bk_backend *b, const bk_model *m, bk_hessian_kind kind,
                                          int fp64, int keep_plain, int fully,
                                          int codes_only, int64_t S, int64_t T, int rank,
                                          int nranks, bk_bwd_mem_params *bwd,
                                          int64_t *batch, const bk_stage_ops **ops, void **ctx)
{
    *ops = NULL;
    *ctx = NULL;
    if (!b || !m || !batch || S < 1 || T < 1)
        return bk_error(BK_ERR_INVALID_ARG, "GPU pipeline: bad arguments");
    gstages *g = static_cast<gstages *>(calloc(1, sizeof(gstages)));
    if (!g)
        return bk_error(BK_ERR_NOMEM, "GPU pipeline: out of memory");
    g->b = b;
    g->kmod = -1;
    g->pre_mod = -1;
    g->m = m;
    g->cfg = *bk_model_get_config(m);
    g->kind = kind;
    g->fp64 = fp64;
    g->keep_plain = keep_plain;
    g->fully = fully;
    g->codes_only = codes_only;
    g->S = S;
    g->T = T;
    g->hid = g->cfg.hidden;
    g->qd = g->cfg.n_heads * g->cfg.head_dim;
    g->kvd = g->cfg.n_kv_heads * g->cfg.head_dim;
    const int asked = *batch > 0;
    int64_t B = asked ? (*batch < S ? *batch : S) : auto_batch(&g->cfg, S, T);
    bk_status st;
    /* the backprop flow runs on this device beside the stages (bwd): its
     * buffers grow by ~3.4 GB per sequence at 8B against the stages' 0.89,
     * so the micro-batch is the largest (up to auto_batch's) with which the
     * stages' micro-batch, the flow at one logit block, one cached layer and
     * the stages' reserve fit in the free memory (within mem_limit) beside
     * the residual stream, else beside nothing; a --batch that does not fit
     * even without the stream is refused here, before any work */
    const char *reduced_why = "out of device memory";
    if (bwd) {
        const int auto_leaf = bwd->leaf <= 0;
        if (auto_leaf) /* (the micro-batch is fitted with the smallest leaf) */
            bwd->leaf = 1;
        size_t fr = 0, tot = 0;
        st = bk_dev_mem_free(static_cast<const bk_cuda_ctx *>(b->ctx), &fr, &tot);
        if (st != BK_OK) {
            g_destroy(g);
            return st;
        }
        const int64_t share = (S + (nranks > 1 ? nranks : 1) - 1) / (nranks > 1 ? nranks : 1);
        const uint64_t stream = (uint64_t)share * (uint64_t)T * (uint64_t)(g->hid + g->qd) * 4u;
        const uint64_t per_seq = (uint64_t)(stage_row_bytes(&g->cfg) * (double)T);
        const uint64_t reserve = device_reserve(&g->cfg, 4, 2);
        int64_t fit = fr > stream ? bk_bwd_fit_batch(&g->cfg, T, S, bwd, B, (uint64_t)fr - stream,
                                                     per_seq, reserve, 1)
                                  : 0;
        if (fit < 1)
            fit = bk_bwd_fit_batch(&g->cfg, T, S, bwd, B, (uint64_t)fr, per_seq, reserve, 1);
        if (asked && bk_bwd_fit_batch(&g->cfg, T, S, bwd, B, (uint64_t)fr, per_seq, reserve, 1) < B) {
            const double need = (double)(per_seq * (uint64_t)B + reserve +
                                         bk_bwd_dev_bytes(&g->cfg, B, T, S, bwd, 0) +
                                         bk_bwd_dev_layer_bytes(&g->cfg, bwd->precision));
            g_destroy(g);
            return bk_error(BK_ERR_DEVICE_OOM,
                            "GPU pipeline: a micro-batch of %lld sequences needs about %.1f GiB "
                            "on the device for the stages and the backward flow, %.1f GiB "
                            "free: use a smaller --batch",
                            (long long)B, need / 1073741824.0, (double)fr / 1073741824.0);
        }
        if (!asked && fit >= 1 && fit < B) {
            B = fit;
            reduced_why = "the backward flow's device memory";
        }
        /* no --leaf-size: the largest leaf whose Grams fit beside the rest,
         * the residual stream and the whole weight cache (fewer passes) */
        if (auto_leaf)
            bwd->leaf = bk_bwd_auto_leaf(&g->cfg, T, S, bwd, B, fr > stream ? fr - stream : fr,
                                         per_seq * (uint64_t)B, reserve);
        /* the largest leaf the device holds (beside nothing else): the bound
         * of the host check's --leaf-size suggestion (src/pipeline.c) */
        bwd->leaf_max = bk_bwd_max_leaf(&g->cfg, T, S, bwd, B, fr, per_seq * (uint64_t)B, reserve);
    }
    /* out of device memory: halve the micro-batch and try again */
    for (;;) {
        st = g_setup(g, B);
        if (st != BK_ERR_DEVICE_OOM || B == 1)
            break;
        B /= 2; /* reported in the description */
    }
    if (st == BK_ERR_DEVICE_OOM)
        bk_error_prefix(st, "GPU pipeline: out of device memory even with a micro-batch of one "
                            "sequence (use fewer --samples, a shorter --seqlen, or "
                            "--cpu-stages)");
    /* the sequences held: all, or this MPI rank's share for micro-batch B
     * (the driver re-creates the stages when the ranks agree on another) */
    bk_rank_share(S, B, rank, nranks, &g->s_lo, &g->s_hi);
    /* the residual stream: on the device when it fits next to one layer's
     * weights (twice), the factor staging and a margin */
    const uint64_t N = (uint64_t)(g->s_hi - g->s_lo) * (uint64_t)T;
    const uint64_t need = N * (uint64_t)(g->hid + g->qd) * 4u;
    if (st == BK_OK) {
        size_t fr = 0, tot = 0;
        st = bk_gpu_mem_info(g->f, &fr, &tot);
        /* (with the backprop flow: also its buffers at this micro-batch and
         * one cached layer, and the stages' reserve for the leaf layers) */
        const uint64_t reserve =
            bwd ? device_reserve(&g->cfg, 4, 2) + bk_bwd_dev_bytes(&g->cfg, B, T, S, bwd, 0) +
                      bk_bwd_dev_layer_bytes(&g->cfg, bwd->precision)
                : device_reserve(&g->cfg, 2, 1);
        g->resident = st == BK_OK && (uint64_t)fr > reserve && (uint64_t)fr - reserve >= need;
        /* setting residual=host forces the pinned-host stream (tests, measurements) */
        if (bk_backend_get_params(b)->residual_host)
            g->resident = 0;
    }
    uint64_t dneed = 0;
    if (st == BK_OK && g->resident) {
        st = falloc(g, &g->H, (int64_t)N, g->hid, "residual stream");
        if (st == BK_OK)
            st = falloc(g, &g->O, (int64_t)N, g->qd, "o_proj inputs");
        /* the down_proj inputs of all sequences too when they fit with the same
         * reserve (saves recomputing gate/up in stage OUT: a third of the
         * forward work); setting keep_down=0 turns it off. Not with the
         * backprop flow (bwd): 30 GB at 8B that the flow, its weight cache
         * and the leaf layers' stages need (stage OUT recomputes gate/up) */
        size_t fr = 0, tot = 0;
        dneed = N * (uint64_t)g->cfg.intermediate * 4u;
        const uint64_t reserve = device_reserve(&g->cfg, 4, 2);
        if (st == BK_OK && !bwd && bk_backend_get_params(b)->keep_down && bk_gpu_mem_info(g->f, &fr, &tot) == BK_OK &&
            (uint64_t)fr > reserve && (uint64_t)fr - reserve >= dneed) {
            bk_status sd = falloc(g, &g->D, (int64_t)N, g->cfg.intermediate,
                                  "down_proj inputs");
            if (sd != BK_OK) { /* optional: recompute instead */
                g->D = NULL;
                bk_clear_error();
            }
        }
    } else if (st == BK_OK) {
        const int64_t R = g->B * T;
        st = falloc(g, &g->hwin, R, g->hid, "residual window");
        if (st == BK_OK)
            st = falloc(g, &g->owin, R, g->qd, "o_proj input window");
        void *p = NULL;
        if (st == BK_OK) {
            st = bk_cuda_status(cudaHostAlloc(&p, (size_t)(N * (uint64_t)g->hid * 4u),
                                              cudaHostAllocDefault),
                                "pinned host memory for the residual stream", __FILE__, __LINE__);
            g->Hh = static_cast<float *>(p);
        }
        if (st == BK_OK) {
            st = bk_cuda_status(cudaHostAlloc(&p, (size_t)(N * (uint64_t)g->qd * 4u),
                                              cudaHostAllocDefault),
                                "pinned host memory for the o_proj inputs", __FILE__, __LINE__);
            g->Oh = static_cast<float *>(p);
        }
        if (st != BK_OK)
            bk_error_prefix(st, "GPU pipeline");
    }
    if (st != BK_OK) {
        g_destroy(g);
        return st;
    }
    const int64_t wanted = asked ? (*batch < S ? *batch : S) : auto_batch(&g->cfg, S, T);
    char red[96] = "";
    if (B != wanted)
        snprintf(red, sizeof red, " (reduced from %lld: %s)", (long long)wanted, reduced_why);
    snprintf(g->desc, sizeof g->desc,
             "forward + Hessians on the GPU (%s GEMMs): micro-batch %lld sequences%s, residual "
             "stream %s (%.2f GiB%s)%s",
             bk_gemm_math_name(bk_backend_gemm_math(b)), (long long)B, red,
             g->resident ? "on the device" : "in pinned host memory",
             (double)need / (1024.0 * 1024.0 * 1024.0),
             g->s_hi - g->s_lo < S ? ", this rank's sequences" : "",
             g->D ? "; down_proj inputs kept on the device"
                  : bwd && g->resident ? "; down_proj inputs recomputed (backward flow)" : "");
    *batch = B;
    *ops = &gpu_stage_ops;
    *ctx = g;
    return BK_OK;
}
