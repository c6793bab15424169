/* The CPU solvers, written once for a floating type REAL.
 *
 * Included by solver_ref.c once per precision with these macros defined:
 *   REAL, SUF (name suffix, _f / _d), Q_APPLY (quant.h per-entry rule),
 *   GEMM, GER, AXPY, TRMM (cblas), POTRF, TRTRI (LAPACKE).
 * No include guard on purpose.
 *
 * Conventions (docs/solver.md): W [m, n] row-major; entry (i, j) lies on
 * anti-diagonal k = i + j, k = 0 .. m+n-2. LA [n, n] and LB [m, m] are the
 * unit lower-triangular factors (zeros stored above the diagonal); LB NULL
 * means the identity. Every algorithm rounds each entry at the value
 * W~_ij = W_ij + sum over earlier entries (i', j') <= (i, j) of
 * LB[i, i'] E[i', j'] LA[j, j'] (paper eq. (2)), only the order and the
 * batching of these sums differ.
 */

#define F(name) BK_CAT(name, SUF)

/* Round entry (i, j) at value x; store code and dequantized value; return
 * the error v - x. */
static inline REAL F(round_at)(bk_core *c, int64_t i, int64_t j, REAL x)
{
    int32_t code;
    REAL v = Q_APPLY(c->alpha, x, i, j, &code, &c->counts);
    c->codes[i * c->n + j] = (int16_t)code;
    c->weight[i * c->n + j] = (float)v;
    return v - x;
}

/* ------------------------------------------------------------------ naive */

/* Algorithm 2: row-major order, one rank-1 update of the lower-right region
 * W[i:, j:] per entry. O(m^2 n^2). */
static bk_status F(alg_naive)(bk_core *c)
{
    const int64_t m = c->m, n = c->n;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            REAL d = F(round_at)(c, i, j, W[i * n + j]);
            if (LB)
                GER(CblasRowMajor, (int)(m - i), (int)(n - j), d, LB + i * m + i, (int)m,
                    LA + j * n + j, (int)n, W + i * n + j, (int)n);
            else
                AXPY((int)(n - j), d, LA + j * n + j, (int)n, W + i * n + j, 1);
        }
    }
    return BK_OK;
}

/* ------------------------------------------------------------------- rtn */

static bk_status F(alg_rtn)(bk_core *c)
{
    REAL *W = c->W;
    for (int64_t i = 0; i < c->m; i++)
        for (int64_t j = 0; j < c->n; j++)
            (void)F(round_at)(c, i, j, W[i * c->n + j]);
    return BK_OK;
}

/* --------------------------------------------------------------- antidiag */

/* Algorithm 3: per anti-diagonal k, round its d entries, then one GEMM
 * W[i0:, j0:] += X Y^T with X[:, t] = LB[i0:, i_t] * delta_t and
 * Y[:, t] = LA[j0:, j_t], restricted to the lower-right region spanned by the
 * anti-diagonal (rows >= its first row i0, columns >= its first column j0). */
static bk_status F(alg_antidiag)(bk_core *c)
{
    const int64_t m = c->m, n = c->n;
    const int64_t dmax = m < n ? m : n;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    REAL *X = bk_alloc((size_t)(m * dmax), sizeof(REAL));
    REAL *Y = bk_alloc((size_t)(n * dmax), sizeof(REAL));
    REAL *delta = bk_alloc((size_t)dmax, sizeof(REAL));
    if (!X || !Y || !delta) {
        free(X);
        free(Y);
        free(delta);
        return bk_error(BK_ERR_NOMEM, "%s: antidiag: out of memory", c->label);
    }
    for (int64_t k = 0; k <= m + n - 2; k++) {
        const int64_t ilo = k - (n - 1) > 0 ? k - (n - 1) : 0;
        const int64_t ihi = k < m - 1 ? k : m - 1;
        const int64_t d = ihi - ilo + 1;
        for (int64_t t = 0; t < d; t++) {
            const int64_t i = ilo + t;
            delta[t] = F(round_at)(c, i, k - i, W[i * n + k - i]);
        }
        if (k == m + n - 2)
            break;
        const int64_t i0 = ilo, j0 = k - ihi;
        const int64_t rows = m - i0, cols = n - j0;
        for (int64_t p = 0; p < rows; p++)
            for (int64_t t = 0; t < d; t++) {
                const int64_t i = ilo + t;
                REAL lb = LB ? LB[(i0 + p) * m + i] : (REAL)(i0 + p == i);
                X[p * d + t] = lb * delta[t];
            }
        for (int64_t q = 0; q < cols; q++)
            for (int64_t t = 0; t < d; t++)
                Y[q * d + t] = LA[(j0 + q) * n + (k - ilo - t)];
        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)cols, (int)d, (REAL)1, X,
             (int)d, Y, (int)d, (REAL)1, W + i0 * n + j0, (int)n);
    }
    free(X);
    free(Y);
    free(delta);
    return BK_OK;
}

/* -------------------------------------------------------------- recursive */

/* Blocks of at most this many entries are solved with the naive loop
 * restricted to the block (same sums, no BLAS call overhead). */
#define BK_REC_BASE 64

typedef struct F(rec_ctx) {
    bk_core *c;
    REAL *Err; /* [m, n] rounding errors v - w~ */
    REAL *tmp; /* scratch, m * n */
} F(rec_ctx);

static void F(rec_base)(F(rec_ctx) *x, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
    bk_core *c = x->c;
    const int64_t m = c->m, n = c->n;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    for (int64_t i = r0; i < r1; i++)
        for (int64_t j = c0; j < c1; j++) {
            REAL d = F(round_at)(c, i, j, W[i * n + j]);
            x->Err[i * n + j] = d;
            const int64_t plast = LB ? r1 : i + 1;
            for (int64_t p = i; p < plast; p++) {
                const REAL coef = (LB ? LB[p * m + i] : (REAL)1) * d;
                for (int64_t q = j; q < c1; q++)
                    W[p * n + q] += coef * LA[q * n + j];
            }
        }
}

/* Algorithm 5 on the block rows [r0, r1) x columns [c0, c1): split the
 * longer side (rows on a tie), solve the first half, push its errors to the
 * second half with one triangular product and one GEMM, solve the second. */
static void F(rec_solve)(F(rec_ctx) *x, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
    bk_core *c = x->c;
    const int64_t m = c->m, n = c->n;
    const int64_t rows = r1 - r0, cols = c1 - c0;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    if (rows * cols <= BK_REC_BASE) {
        F(rec_base)(x, r0, r1, c0, c1);
        return;
    }
    if (rows < cols) {
        const int64_t cm = c0 + cols / 2, w1 = cm - c0;
        F(rec_solve)(x, r0, r1, c0, cm);
        /* T = LB[r0:r1, r0:r1] E[r0:r1, c0:cm];  W[r0:r1, cm:c1] += T LA[cm:c1, c0:cm]^T */
        for (int64_t i = 0; i < rows; i++)
            memcpy(x->tmp + i * w1, x->Err + (r0 + i) * n + c0, (size_t)w1 * sizeof(REAL));
        if (LB)
            TRMM(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, (int)rows,
                 (int)w1, (REAL)1, LB + r0 * m + r0, (int)m, x->tmp, (int)w1);
        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)(c1 - cm), (int)w1,
             (REAL)1, x->tmp, (int)w1, LA + cm * n + c0, (int)n, (REAL)1, W + r0 * n + cm,
             (int)n);
        F(rec_solve)(x, r0, r1, cm, c1);
    } else {
        const int64_t rm = r0 + rows / 2, h1 = rm - r0;
        F(rec_solve)(x, r0, rm, c0, c1);
        if (LB) {
            /* T = E[r0:rm, c0:c1] LA[c0:c1, c0:c1]^T;  W[rm:r1, c0:c1] += LB[rm:r1, r0:rm] T */
            for (int64_t i = 0; i < h1; i++)
                memcpy(x->tmp + i * cols, x->Err + (r0 + i) * n + c0,
                       (size_t)cols * sizeof(REAL));
            TRMM(CblasRowMajor, CblasRight, CblasLower, CblasTrans, CblasUnit, (int)h1,
                 (int)cols, (REAL)1, LA + c0 * n + c0, (int)n, x->tmp, (int)cols);
            GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(r1 - rm), (int)cols, (int)h1,
                 (REAL)1, LB + rm * m + r0, (int)m, x->tmp, (int)cols, (REAL)1,
                 W + rm * n + c0, (int)n);
        } /* identity B: rows do not interact */
        F(rec_solve)(x, rm, r1, c0, c1);
    }
}

static bk_status F(alg_recursive)(bk_core *c)
{
    F(rec_ctx) x = {c, NULL, NULL};
    x.Err = bk_alloc((size_t)(c->m * c->n), sizeof(REAL));
    x.tmp = bk_alloc((size_t)(c->m * c->n), sizeof(REAL));
    if (!x.Err || !x.tmp) {
        free(x.Err);
        free(x.tmp);
        return bk_error(BK_ERR_NOMEM, "%s: recursive: out of memory", c->label);
    }
    F(rec_solve)(&x, 0, c->m, 0, c->n);
    free(x.Err);
    free(x.tmp);
    return BK_OK;
}

/* ----------------------------------------------------------------- bakron */

typedef struct F(bk_ctx) {
    bk_core *c;
    REAL *Err;   /* [m, n] rounding errors (zero where not yet rounded) */
    REAL *delta; /* [m] errors of one anti-diagonal, by row */
    REAL *Ebar;  /* scratch: band-masked error rectangle, up to m * n */
    REAL *M;     /* scratch: max_block * n */
    REAL *OUT;   /* scratch: max_block * n */
    int64_t bmax;
} F(bk_ctx);

/* A narrow band [k0, k1): anti-diagonal by anti-diagonal, round its entries,
 * then add their updates to the remaining anti-diagonals of the band only,
 * with exact scalar sums (no wasted work): target (p, q) on k' receives
 * sum_i LB[p, i] delta_i LA[q, k - i] over the sources (i, k - i) with
 * i <= p and k - i <= q. */
static void F(bk_leaf)(F(bk_ctx) *x, int64_t k0, int64_t k1)
{
    bk_core *c = x->c;
    const int64_t m = c->m, n = c->n;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    REAL *delta = x->delta;
    for (int64_t k = k0; k < k1; k++) {
        const int64_t ilo = k - (n - 1) > 0 ? k - (n - 1) : 0;
        const int64_t ihi = k < m - 1 ? k : m - 1;
        for (int64_t i = ilo; i <= ihi; i++) {
            REAL d = F(round_at)(c, i, k - i, W[i * n + k - i]);
            x->Err[i * n + k - i] = d;
            delta[i] = d;
        }
        for (int64_t kk = k + 1; kk < k1; kk++) {
            const int64_t plo = kk - (n - 1) > ilo ? kk - (n - 1) : ilo;
            const int64_t phi = kk < m - 1 ? kk : m - 1;
            for (int64_t p = plo; p <= phi; p++) {
                const int64_t q = kk - p;
                const int64_t a0 = k - q > ilo ? k - q : ilo;
                const int64_t a1 = p < ihi ? p : ihi;
                if (a0 > a1)
                    continue;
                REAL s = 0;
                if (LB) {
                    const REAL *lb = LB + p * m;
                    const REAL *la = LA + q * n + k; /* la[-i] = LA[q, k - i] */
                    for (int64_t i = a0; i <= a1; i++)
                        s += lb[i] * delta[i] * la[-i];
                } else if (p >= a0 && p <= a1) { /* identity: only the source in row p */
                    s = delta[p] * LA[q * n + k - p];
                }
                W[p * n + q] += s;
            }
        }
    }
}

/* Push the errors of the band [k0, kmid) to the band [kmid, k1) (appendix C:
 * M = LB E on the band, then M LA^T on the second band), by blocks P of b
 * target rows. For a row block only small intervals matter:
 *   J = columns of M needed:   [k0 - (p1-1), k1-1 - p0]
 *   I = rows of E that are nonzero there and <= p1-1: [k0 - Jhi, kmid-1 - Jlo]
 *   Q = target columns:        [kmid - (p1-1), k1-1 - p0]
 * so M[P, J] = LB[P, I] Ebar[I, J] and OUT[P, Q] = M[P, J] LA[Q, J]^T are
 * GEMMs on small rectangles (Ebar = E masked to the first band), and OUT is
 * added only onto the entries of anti-diagonals kmid .. k1-1. Every term
 * LB[p, i] E[i, j] LA[q, j] with i <= p, j <= q and (i, j) in the first
 * band is included exactly once; other products in the rectangles are zero
 * or land outside the target band and are dropped. */
static void F(bk_push)(F(bk_ctx) *x, int64_t k0, int64_t kmid, int64_t k1)
{
    bk_core *c = x->c;
    const int64_t m = c->m, n = c->n;
    REAL *W = c->W;
    const REAL *LA = c->LA, *LB = c->LB;
    const int64_t width = k1 - k0;
    int64_t b = width / bk_bakron_tune.block_div;
    if (b < bk_bakron_tune.min_block)
        b = bk_bakron_tune.min_block;
    if (b > x->bmax)
        b = x->bmax;
    const int64_t chunk = bk_bakron_tune.chunk > 0 ? bk_bakron_tune.chunk : n;
    const int64_t plo = kmid - (n - 1) > 0 ? kmid - (n - 1) : 0;
    const int64_t phi = k1 - 1 < m - 1 ? k1 - 1 : m - 1;
    for (int64_t p0 = plo; p0 <= phi; p0 += b) {
        const int64_t p1 = p0 + b <= phi + 1 ? p0 + b : phi + 1;
        const int64_t pb = p1 - p0;
        const int64_t Jlo = k0 - (p1 - 1) > 0 ? k0 - (p1 - 1) : 0;
        const int64_t Jhi = k1 - 1 - p0 < n - 1 ? k1 - 1 - p0 : n - 1;
        if (Jlo > Jhi)
            continue;
        int64_t Ilo = k0 - Jhi > 0 ? k0 - Jhi : 0;
        int64_t Ihi = kmid - 1 - Jlo;
        if (Ihi > p1 - 1)
            Ihi = p1 - 1;
        if (Ihi > m - 1)
            Ihi = m - 1;
        if (Ilo > Ihi)
            continue;
        const int64_t Qlo = kmid - (p1 - 1) > 0 ? kmid - (p1 - 1) : 0;
        const int64_t Qhi = Jhi;
        if (Qlo > Qhi)
            continue;
        const int64_t nj = Jhi - Jlo + 1, nq = Qhi - Qlo + 1;
        REAL *M = x->M, *OUT = x->OUT;
        if (LB) {
            /* Ebar[I, J] = E on anti-diagonals k0 .. kmid-1, zero elsewhere */
            REAL *Eb = x->Ebar;
            for (int64_t i = Ilo; i <= Ihi; i++) {
                REAL *row = Eb + (i - Ilo) * nj;
                int64_t a = k0 - i > Jlo ? k0 - i : Jlo;
                int64_t e = kmid - 1 - i < Jhi ? kmid - 1 - i : Jhi;
                memset(row, 0, (size_t)nj * sizeof(REAL));
                if (a <= e)
                    memcpy(row + (a - Jlo), x->Err + i * n + a, (size_t)(e - a + 1) * sizeof(REAL));
            }
            /* by column chunks of M: chunk [ja, jb] only needs the rows of E
             * with k0 - jb <= i <= kmid-1 - ja (the band is a parallelogram) */
            for (int64_t ja = Jlo; ja <= Jhi; ja += chunk) {
                const int64_t jb = ja + chunk - 1 < Jhi ? ja + chunk - 1 : Jhi;
                const int64_t ia = k0 - jb > Ilo ? k0 - jb : Ilo;
                const int64_t ib = kmid - 1 - ja < Ihi ? kmid - 1 - ja : Ihi;
                if (ia > ib) {
                    for (int64_t p = 0; p < pb; p++)
                        memset(M + p * nj + (ja - Jlo), 0, (size_t)(jb - ja + 1) * sizeof(REAL));
                    continue;
                }
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)pb, (int)(jb - ja + 1),
                     (int)(ib - ia + 1), (REAL)1, LB + p0 * m + ia, (int)m,
                     Eb + (ia - Ilo) * nj + (ja - Jlo), (int)nj, (REAL)0, M + (ja - Jlo),
                     (int)nj);
            }
        } else {
            /* identity: M[p, J] = Ebar[p, J] */
            for (int64_t p = p0; p < p1; p++) {
                REAL *row = M + (p - p0) * nj;
                memset(row, 0, (size_t)nj * sizeof(REAL));
                if (p < Ilo || p > Ihi)
                    continue;
                int64_t a = k0 - p > Jlo ? k0 - p : Jlo;
                int64_t e = kmid - 1 - p < Jhi ? kmid - 1 - p : Jhi;
                if (a <= e)
                    memcpy(row + (a - Jlo), x->Err + p * n + a, (size_t)(e - a + 1) * sizeof(REAL));
            }
        }
        /* by chunks of target columns: chunk [qa, qb] only needs j <= qb
         * (L_A is lower triangular) */
        for (int64_t qa = Qlo; qa <= Qhi; qa += chunk) {
            const int64_t qb = qa + chunk - 1 < Qhi ? qa + chunk - 1 : Qhi;
            const int64_t je = qb < Jhi ? qb : Jhi;
            GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)pb, (int)(qb - qa + 1),
                 (int)(je - Jlo + 1), (REAL)1, M, (int)nj, LA + qa * n + Jlo, (int)n, (REAL)0,
                 OUT + (qa - Qlo), (int)nq);
        }
        for (int64_t p = p0; p < p1; p++) {
            const int64_t a = kmid - p > Qlo ? kmid - p : Qlo;
            const int64_t e = k1 - 1 - p < Qhi ? k1 - 1 - p : Qhi;
            const REAL *o = OUT + (p - p0) * nq - Qlo;
            REAL *w = W + p * n;
            for (int64_t q = a; q <= e; q++)
                w[q] += o[q];
        }
    }
}

/* Algorithm 6 over the anti-diagonal range [k0, k1). */
static void F(bk_solve)(F(bk_ctx) *x, int64_t k0, int64_t k1)
{
    if (k1 - k0 <= bk_bakron_tune.leaf_width) {
        F(bk_leaf)(x, k0, k1);
        return;
    }
    const int64_t kmid = k0 + (k1 - k0) / 2;
    F(bk_solve)(x, k0, kmid);
    F(bk_push)(x, k0, kmid, k1);
    F(bk_solve)(x, kmid, k1);
}

static bk_status F(alg_bakron)(bk_core *c)
{
    const int64_t m = c->m, n = c->n;
    F(bk_ctx) x;
    memset(&x, 0, sizeof x);
    x.c = c;
    x.bmax = bk_bakron_tune.max_block < m ? bk_bakron_tune.max_block : m;
    if (x.bmax < 1)
        x.bmax = 1;
    x.Err = bk_calloc((size_t)(m * n), sizeof(REAL));
    x.delta = bk_alloc((size_t)m, sizeof(REAL));
    x.Ebar = c->LB ? bk_alloc((size_t)(m * n), sizeof(REAL)) : NULL;
    x.M = bk_alloc((size_t)(x.bmax * n), sizeof(REAL));
    x.OUT = bk_alloc((size_t)(x.bmax * n), sizeof(REAL));
    bk_status st = BK_OK;
    if (!x.Err || !x.delta || (c->LB && !x.Ebar) || !x.M || !x.OUT)
        st = bk_error(BK_ERR_NOMEM, "%s: bakron: out of memory", c->label);
    else
        F(bk_solve)(&x, 0, m + n - 1);
    free(x.Err);
    free(x.delta);
    free(x.Ebar);
    free(x.M);
    free(x.OUT);
    return st;
}

/* ------------------------------------------------------------------- gptq */

/* Algorithm 1 on every row (B ignored), with lazy batches: inside a batch of
 * columns [i1, i2) each row is updated eagerly (rows are independent), the
 * batch's errors reach the columns >= i2 in one GEMM. With refit_groups the
 * batches also end at group boundaries, so that at a group start every
 * column of the group is fully updated when the group is refitted. */
static bk_status F(alg_gptq)(bk_core *c)
{
    const int64_t m = c->m, n = c->n;
    REAL *W = c->W;
    const REAL *LA = c->LA;
    bk_alphabet *al = c->alpha;
    const int refit = al->spec.refit_groups;
    const int64_t B = c->gptq_block < n ? c->gptq_block : n;
    REAL *E = bk_alloc((size_t)(m * B), sizeof(REAL));
    REAL *T = bk_alloc((size_t)(B * B), sizeof(REAL));
    double *G = refit ? bk_alloc((size_t)(m * al->group), sizeof(double)) : NULL;
    bk_status st = BK_OK;
    if (!E || !T || (refit && !G)) {
        st = bk_error(BK_ERR_NOMEM, "%s: gptq: out of memory", c->label);
        goto done;
    }
    for (int64_t i1 = 0, i2; i1 < n; i1 = i2) {
        i2 = i1 + B < n ? i1 + B : n;
        if (refit) {
            const int64_t g = i1 / al->group, gend = (g + 1) * al->group;
            if (i2 > gend)
                i2 = gend;
            if (i1 % al->group == 0) {
                const int64_t len = n - i1 < al->group ? n - i1 : al->group;
                for (int64_t r = 0; r < m; r++)
                    for (int64_t t = 0; t < len; t++)
                        G[r * len + t] = (double)W[r * n + i1 + t];
                st = bk_alphabet_fit_group(al, g, G, len);
                if (st != BK_OK) {
                    bk_error_prefix(st, c->label);
                    goto done;
                }
            }
        }
        const int64_t bs = i2 - i1;
        /* T[t, u] = LA[i1 + u, i1 + t] (u > t): column t of the batch, contiguous */
        for (int64_t t = 0; t < bs; t++)
            for (int64_t u = 0; u < bs; u++)
                T[t * bs + u] = LA[(i1 + u) * n + (i1 + t)];
        for (int64_t r = 0; r < m; r++) {
            REAL *w = W + r * n + i1;
            REAL *e = E + r * bs;
            for (int64_t t = 0; t < bs; t++) {
                const REAL d = F(round_at)(c, r, i1 + t, w[t]);
                e[t] = d;
                const REAL *tt = T + t * bs;
                for (int64_t u = t + 1; u < bs; u++)
                    w[u] += d * tt[u];
            }
        }
        if (i2 < n)
            GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)(n - i2), (int)bs,
                 (REAL)1, E, (int)bs, LA + i2 * n + i1, (int)n, (REAL)1, W + i2, (int)n);
    }
done:
    free(E);
    free(T);
    free(G);
    return st;
}

/* --------------------------------------------------------------- dispatch */

bk_status F(bk_core_solve)(bk_core *c)
{
    switch (c->alg) {
    case BK_ALG_BAKRON: return F(alg_bakron)(c);
    case BK_ALG_RECURSIVE: return F(alg_recursive)(c);
    case BK_ALG_ANTIDIAG: return F(alg_antidiag)(c);
    case BK_ALG_NAIVE: return F(alg_naive)(c);
    case BK_ALG_GPTQ: return F(alg_gptq)(c);
    case BK_ALG_RTN: return F(alg_rtn)(c);
    default: break;
    }
    return bk_error(BK_ERR_INTERNAL, "solver: unknown algorithm %d", (int)c->alg);
}

/* ------------------------------------------------------------------ factor */

int F(bk_factor_inverse)(REAL *X, int64_t n, double *diag)
{
    /* Cholesky of the inverse without forming the inverse: with J the
     * reversal permutation and J X J = R Rᵀ (R lower), X⁻¹ = (J R⁻ᵀ J)(J R⁻ᵀ J)ᵀ
     * and J R⁻ᵀ J is lower triangular with a positive diagonal, i.e. the
     * Cholesky factor of X⁻¹ (docs/solver.md step 4). One potrf and one
     * trtri instead of potrf, potri and potrf.
     * Row-major J X J is X's array reversed. The row-major lower triangle is
     * the column-major upper triangle: column-major 'U' calls work in place. */
    const lapack_int ln = (lapack_int)n;
    const size_t nn = (size_t)n * (size_t)n;
    for (size_t t = 0; t < nn / 2; t++) {
        const REAL v = X[t];
        X[t] = X[nn - 1 - t];
        X[nn - 1 - t] = v;
    }
    if (POTRF(LAPACK_COL_MAJOR, 'U', ln, X, ln) != 0)
        return 1;
    /* column-major U⁻¹ = row-major R⁻¹ */
    if (TRTRI(LAPACK_COL_MAJOR, 'U', 'N', ln, X, ln) != 0)
        return 2;
    /* (J R⁻ᵀ J)[i, j] = R⁻¹[n-1-j, n-1-i]: swap each lower pair in place, zero
     * the upper triangle */
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j <= i; j++) {
            const size_t a = (size_t)(i * n + j), b = (size_t)((n - 1 - j) * n + (n - 1 - i));
            if (a < b) {
                const REAL v = X[a];
                X[a] = X[b];
                X[b] = v;
            }
        }
        for (int64_t j = i + 1; j < n; j++)
            X[i * n + j] = 0;
    }
    for (int64_t j = 0; j < n; j++) {
        const REAL d = X[j * n + j];
        diag[j] = (double)d;
        if (!(d > 0))
            return 3;
    }
    for (int64_t i = 0; i < n; i++) {
        REAL *row = X + i * n;
        for (int64_t j = 0; j < i; j++)
            row[j] /= X[j * n + j];
    }
    for (int64_t j = 0; j < n; j++)
        X[j * n + j] = 1;
    return 0;
}

#undef F

/* the template's parameters, for the next instantiation */
#undef REAL
#undef SUF
#undef Q_APPLY
#undef GEMM
#undef GER
#undef AXPY
#undef TRMM
#undef POTRF
#undef TRTRI
