/* What the per-token weights of the backprop-shampoo factors do to them
 * (issue 16; docs/hessians.md "Backprop" — Shampoo weights). One naive-I pass
 * of the CPU oracle over all layers (bk_bwd_flow_run, model-Fisher labels)
 * delivers every module's full-precision inputs a_t and output gradients g_t;
 * per layer and module it prints
 *   ess_g      effective sample size (Σw)²/Σw² of the A-side weights w = |g_t|²,
 *              as a fraction of the token count (1 = uniform, as K-FAC);
 *   ess_a      the same for the B-side weights |a_t|²;
 *   ess_gs     ess_g of the per-sequence normalised weights |g_t|² / (its sequence's
 *              mean), a remedy tested and not adopted (docs/hessians.md "Shampoo's
 *              token weights");
 *   seq1       the heaviest sequence's share of Σ|g|² (paper's weights; 1/S normalised);
 *   top1       the heaviest token's share of Σ|g|² (and its sequence:position):
 *              one token dominating A's weights;
 *   pos0_A     share of tr(A) from position 0 (BOS): Shampoo Σ_{t@0} |g|²|a|² / Σ |g|²|a|²
 *              against K-FAC's Σ_{t@0} |a|² / Σ |a|²;
 *   pos0_B     the same for tr(B): Shampoo Σ_{t@0} |a|²|g|² / ... against Σ_{t@0} |g|² / Σ |g|²;
 *   above_A    eigen-directions of A whose eigenvalue exceeds the solver's damping
 *              0.5 mean(diag A) (how many directions still carry data after damping),
 *              Shampoo with the paper's weights / with the per-sequence normalised
 *              weights / K-FAC, of n.
 *
 *   ninja -C build-cpu shampoo_stats        (not built by default)
 *   build-cpu/shampoo_stats MODEL_DIR TOKENS.safetensors SAMPLES [SEQLEN]
 */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bakron/backward.h"
#include "bakron/model.h"
#include "bakron/pipeline.h"
#include "bakron/status.h"

typedef struct stat1 {
    double sw, sw2, n;           /* Σ|g|², Σ|g|⁴, tokens */
    double sa, sa2;              /* Σ|a|², Σ|a|⁴ */
    double wmax;                 /* the largest |g|² and its token */
    int64_t wmax_seq, wmax_pos;
    double sA_sh, sA_sh0, sA_k, sA_k0; /* tr(A) parts */
    double sB_sh, sB_sh0, sB_k, sB_k0; /* tr(B) parts */
    double swn, swn2;            /* Σ, Σ² of the per-sequence normalised |g|² */
    double seqmax;               /* the largest per-sequence Σ|g|² */
    double *Ash, *Asn, *Ak;      /* [n, n] */
} stat1;

typedef struct ctx {
    const bk_model_config *c;
    int64_t T;
    stat1 *st; /* [L][BK_MOD_COUNT] */
} ctx;

static bk_status on_grads(void *user, int layer, int64_t s0, int64_t S, const bk_grad_taps *t)
{
    ctx *x = user;
    for (int i = 0; i < BK_MOD_COUNT; i++) {
        int64_t m, n;
        bk_module_shape(x->c, (bk_module)i, &m, &n);
        stat1 *s = &x->st[layer * BK_MOD_COUNT + i];
        if (!s->Ash) {
            s->Ash = calloc((size_t)(n * n), sizeof(double));
            s->Ak = calloc((size_t)(n * n), sizeof(double));
            s->Asn = calloc((size_t)(n * n), sizeof(double));
        }
        const int64_t N = S * x->T;
        double *sc = malloc((size_t)(N * n) * sizeof(double));
        double *sn = malloc((size_t)(N * n) * sizeof(double));
        for (int64_t q = 0; q < S; q++) { /* the per-sequence normalised weights */
            double sg = 0;
            for (int64_t r = q * x->T; r < (q + 1) * x->T; r++)
                for (int64_t k = 0; k < m; k++)
                    sg += t->g[i][r * m + k] * t->g[i][r * m + k];
            s->seqmax = sg > s->seqmax ? sg : s->seqmax;
            for (int64_t r = q * x->T; r < (q + 1) * x->T; r++) {
                double ng = 0;
                for (int64_t k = 0; k < m; k++)
                    ng += t->g[i][r * m + k] * t->g[i][r * m + k];
                const double w = sg > 0 ? ng * (double)x->T / sg : 0.0;
                s->swn += w;
                s->swn2 += w * w;
                for (int64_t k = 0; k < n; k++)
                    sn[r * n + k] = sqrt(w) * t->a[i][r * n + k];
            }
        }
        for (int64_t r = 0; r < N; r++) {
            const double *a = t->a[i] + r * n, *g = t->g[i] + r * m;
            double na = 0, ng = 0;
            for (int64_t k = 0; k < n; k++)
                na += a[k] * a[k];
            for (int64_t k = 0; k < m; k++)
                ng += g[k] * g[k];
            const int p0 = r % x->T == 0;
            if (ng > s->wmax) {
                s->wmax = ng;
                s->wmax_seq = s0 + r / x->T;
                s->wmax_pos = r % x->T;
            }
            s->sw += ng;
            s->sw2 += ng * ng;
            s->sa += na;
            s->sa2 += na * na;
            s->n += 1;
            s->sA_sh += ng * na;
            s->sA_k += na;
            s->sB_sh += na * ng;
            s->sB_k += ng;
            if (p0) {
                s->sA_sh0 += ng * na;
                s->sA_k0 += na;
                s->sB_sh0 += na * ng;
                s->sB_k0 += ng;
            }
            for (int64_t k = 0; k < n; k++)
                sc[r * n + k] = sqrt(ng) * a[k];
        }
        /* the lower triangles (row-major) of Σ a aᵀ and Σ |g|² a aᵀ, as dsyev reads them */
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)n, (int)N, 1.0, t->a[i], (int)n,
                    1.0, s->Ak, (int)n);
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)n, (int)N, 1.0, sc, (int)n, 1.0,
                    s->Ash, (int)n);
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, (int)n, (int)N, 1.0, sn, (int)n, 1.0,
                    s->Asn, (int)n);
        free(sc);
        free(sn);
    }
    return BK_OK;
}

/* eigenvalues above damp * mean(diag) of the lower triangle in M [n, n] */
static int above(double *M, int64_t n, double damp)
{
    double tr = 0;
    for (int64_t k = 0; k < n; k++)
        tr += M[k * n + k];
    double *w = malloc((size_t)n * sizeof(double));
    int cnt = -1;
    if (LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'L', (lapack_int)n, M, (lapack_int)n, w) == 0) {
        cnt = 0;
        for (int64_t k = 0; k < n; k++)
            cnt += w[k] > damp * tr / (double)n;
    }
    free(w);
    return cnt;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL_DIR TOKENS SAMPLES [SEQLEN]\n", argv[0]);
        return 1;
    }
    bk_model *m = NULL;
    if (bk_model_open(argv[1], &m) != BK_OK) {
        fprintf(stderr, "%s\n", bk_last_error());
        return 2;
    }
    const bk_model_config *c = bk_model_get_config(m);
    int32_t *tok = NULL;
    int64_t S = 0, T = 0;
    if (bk_load_tokens(argv[2], c->vocab, atoll(argv[3]), argc > 4 ? atoll(argv[4]) : 0, &tok, &S,
                       &T) != BK_OK) {
        fprintf(stderr, "%s\n", bk_last_error());
        return 2;
    }
    const int L = (int)c->n_layers;
    ctx x = {c, T, calloc((size_t)L * BK_MOD_COUNT, sizeof(stat1))};
    bk_bwd_flow_opts o = {BK_FLOW_NAIVE, L, BK_FISHER_MODEL, 0, 4, 0};
    bk_bwd_flow_cb cb;
    memset(&cb, 0, sizeof cb);
    cb.user = &x;
    cb.grads = on_grads;
    bk_bwd_flow_stats fs;
    if (bk_bwd_flow_run(m, tok, S, T, &o, &cb, &fs) != BK_OK) {
        fprintf(stderr, "%s\n", bk_last_error());
        return 3;
    }
    printf("%lld x %lld tokens; damping 0.5 mean(diag)\n", (long long)S, (long long)T);
    printf("layer module            ess_g  ess_a ess_gs  seq1  top1 (seq:pos)    pos0_A sh/kfac  "
           "pos0_B sh/kfac  above_A sh/norm/kfac (of n)\n");
    for (int l = 0; l < L; l++)
        for (int i = 0; i < BK_MOD_COUNT; i++) {
            stat1 *s = &x.st[l * BK_MOD_COUNT + i];
            int64_t mm, n;
            bk_module_shape(c, (bk_module)i, &mm, &n);
            const int ash = above(s->Ash, n, 0.5), ak = above(s->Ak, n, 0.5),
                      asn = above(s->Asn, n, 0.5);
            printf("%5d %-17s %6.3f %6.3f %6.3f %5.3f  %6.3f (%4lld:%-4lld)  %6.3f/%6.3f  "
                   "%6.3f/%6.3f  %5d/%5d/%5d (%lld)\n",
                   l, bk_module_name((bk_module)i), s->sw * s->sw / (s->sw2 * s->n),
                   s->sa * s->sa / (s->sa2 * s->n), s->swn * s->swn / (s->swn2 * s->n),
                   s->seqmax / s->sw, s->wmax / s->sw, (long long)s->wmax_seq,
                   (long long)s->wmax_pos,
                   s->sA_sh0 / s->sA_sh, s->sA_k0 / s->sA_k, s->sB_sh0 / s->sB_sh,
                   s->sB_k0 / s->sB_k, ash, asn, ak, (long long)n);
            free(s->Ash);
            free(s->Asn);
            free(s->Ak);
        }
    free(x.st);
    free(tok);
    bk_model_close(m);
    return 0;
}
