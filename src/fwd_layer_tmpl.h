/* What the CPU's (src/forward.c) and the GPU's (cuda/forward.cu) forward
 * passes share above their arithmetic, written once: the checks a stage
 * begins with, and the forward of one decoder layer from its stages. Each
 * includes it once, after its check_batch(f, S, what) and the declarations
 * of its stages, with
 *   FWD_CTX     the context type (bk_fwd, bk_gfwd),
 *   FWD_LW      the layer's weights (bk_layer_weights, bk_glayer: the same
 *               field names),
 *   FWD(op)     the name of stage op (bk_fwd_attn_in, ...; FWD(layer) is
 *               the function defined here),
 *   FWD_EXPORT  the linkage of FWD(layer) (empty, or extern "C"),
 *   FWD_WHO     the messages' subject ("forward", "GPU forward").
 * No include guard on purpose; it undefines its parameters. */

/* The stages, for check_op. */
enum { FWD_ATTN_IN, FWD_ATTENTION, FWD_ATTN_OUT, FWD_MLP_IN, FWD_MLP_HIDDEN, FWD_MLP_OUT };

/* The micro-batch, the layer's weights and those stage op reads. */
static bk_status check_op(const FWD_CTX *f, int64_t S, const FWD_LW *lw, int op)
{
    static const char *const name[] = {"attn_in", "attention", "attn_out",
                                       "mlp_in",  "mlp_hidden", "mlp_out"};
    static const char *const lacks[] = {"has no input_layernorm", "lacks q/k/v weights",
                                        "lacks o_proj", "has no post_attention_layernorm",
                                        "lacks gate/up_proj", "lacks down_proj"};
    bk_status st = check_batch(f, S, name[op]);
    if (st != BK_OK)
        return st;
    if (!lw)
        return bk_error(BK_ERR_INVALID_ARG, "%s %s: NULL layer weights", FWD_WHO, name[op]);
    int has;
    switch (op) {
    case FWD_ATTN_IN: has = lw->attn_norm != NULL; break;
    case FWD_ATTENTION: has = lw->w[BK_MOD_Q] && lw->w[BK_MOD_K] && lw->w[BK_MOD_V]; break;
    case FWD_ATTN_OUT: has = lw->w[BK_MOD_O] != NULL; break;
    case FWD_MLP_IN: has = lw->mlp_norm != NULL; break;
    case FWD_MLP_HIDDEN: has = lw->w[BK_MOD_GATE] && lw->w[BK_MOD_UP]; break;
    default: has = lw->w[BK_MOD_DOWN] != NULL; break;
    }
    if (!has)
        return bk_error(BK_ERR_INVALID_ARG, "%s %s: layer %d %s", FWD_WHO, name[op], lw->layer,
                        lacks[op]);
    return BK_OK;
}

/* taps (may be NULL): where the stages write the inputs of the linear
 * modules (bakron/forward.h), else the context's scratch. An error other
 * than a non-finite value (whose message names the layer and the operation)
 * is prefixed with the layer. */

FWD_EXPORT bk_status FWD(layer)(FWD_CTX *f, const FWD_LW *lw, int64_t S, float *h,
                                const bk_layer_taps *taps)
{
    static const bk_layer_taps none = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (!taps)
        taps = &none;
    bk_status st = check_batch(f, S, "layer");
    if (st != BK_OK)
        return st;
    float *x = taps->attn_in ? taps->attn_in : f->x;
    st = FWD(attn_in)(f, lw, h, S, x);
    float *o = taps->o_in ? taps->o_in : f->o;
    if (st == BK_OK)
        st = FWD(attention)(f, lw, x, S, o, taps->q_rot, taps->k_rot, NULL);
    if (st == BK_OK)
        st = FWD(attn_out)(f, lw, o, S, h);
    float *x2 = taps->mlp_in ? taps->mlp_in : f->x;
    if (st == BK_OK)
        st = FWD(mlp_in)(f, lw, h, S, x2);
    float *d = taps->down_in ? taps->down_in : f->down;
    if (st == BK_OK)
        st = FWD(mlp_hidden)(f, lw, x2, S, d, NULL, NULL);
    if (st == BK_OK)
        st = FWD(mlp_out)(f, lw, d, S, h);
    if (st == BK_OK || st == BK_ERR_NONFINITE)
        return st;
    char pre[64];
    snprintf(pre, sizeof pre, "layer %d", lw ? lw->layer : -1);
    return bk_error_prefix(st, pre);
}

#undef FWD_CTX
#undef FWD_LW
#undef FWD
#undef FWD_EXPORT
#undef FWD_WHO
