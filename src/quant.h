/* Quantization alphabets (internal; docs/solver.md "Alphabets").
 *
 * An alphabet is fitted once per problem from the original weight matrix
 * (scales and zero points, per row or per group of input columns) and then
 * quantizes single entries: quantize(value, row, col) -> code, dequantized.
 * Scales and zeros are stored as float (the F32 the result reports), so the
 * same alphabet serves the fp32 and the fp64 solvers, and what is reported is
 * exactly what was used. Fitting is done in double.
 *
 * Rounding is half to even everywhere (rint/rintf in the default rounding
 * mode), as torch.round does in the GPTQ reference.
 */
#ifndef BK_QUANT_H
#define BK_QUANT_H

#include <math.h>
#include <stdint.h>

#include "bakron/solver.h"
#include "bakron/status.h"

/* GPTQ reference constants for the uniform MSE search: p = 1 - i/100,
 * i = 0..79, objective sum |q(x) - x|^2.4. */
#define BK_Q_UNIFORM_GRID 100
#define BK_Q_UNIFORM_MAXSHRINK_STEPS 80 /* int(maxshrink 0.8 * grid 100) */
#define BK_Q_UNIFORM_NORM 2.4
/* Levels MSE search: p = 1 - i/100, i = 0..50 (shrink by up to a factor 2),
 * objective: the plain squared error sum (q(x) - x)^2 (docs/solver.md). */
#define BK_Q_LEVELS_GRID 100
#define BK_Q_LEVELS_STEPS 51
/* Largest |code| the int16 result can hold (integer alphabet). */
#define BK_Q_INT16_MAX 32767

typedef struct bk_alphabet {
    bk_quant_spec spec;
    int64_t m, n;
    int64_t group;   /* input columns per group (n when one group per row) */
    int64_t groups;  /* groups per row = ceil(n / group) */
    int32_t qmin, qmax; /* code range: levels -l..l, uniform 0..2^b-1 */
    float *scale;    /* [m * groups]; all 1 for the integer alphabet */
    float *zero;     /* [m * groups]; uniform only (symmetric: (maxq+1)/2) */
} bk_alphabet;

/* Counters the per-entry rule updates. */
typedef struct bk_q_counts {
    int64_t clamped;  /* rounding fell outside the code range and was clamped */
    int64_t overflow; /* integer alphabet: |code| > 32767 (cannot be stored) */
    int64_t nonfinite; /* the value to round was NaN or infinite */
} bk_q_counts;

/* Check the spec and allocate scale/zero arrays (BK_ERR_INVALID_ARG naming
 * the rule, BK_ERR_NOMEM). */
bk_status bk_alphabet_init(bk_alphabet *a, const bk_quant_spec *spec, int64_t m, int64_t n);
void bk_alphabet_free(bk_alphabet *a);

/* Fit every group of every row from W [m, n] (row stride ldw). */
bk_status bk_alphabet_fit(bk_alphabet *a, const double *W, int64_t ldw);
/* Fit group g of every row from the columns X[:, 0:len] (row stride ldx),
 * len = the width of group g. Used by GPTQ's refit at group starts. */
bk_status bk_alphabet_fit_group(bk_alphabet *a, int64_t g, const double *X, int64_t ldx);

/* Single-row fits (exposed for tests and other backends). `x` holds len
 * values. Levels: scale only. Uniform: GPTQ find_params for one row. */
bk_status bk_q_fit_levels(const double *x, int64_t len, int levels, int mse, float *scale);
bk_status bk_q_fit_uniform(const double *x, int64_t len, int bits, int asym, int mse,
                           float *scale, float *zero);

/* The MSE-search objectives for a given scale (and zero), in double:
 * levels sum_j (q(x_j) - x_j)^2, uniform sum_j |q(x_j) - x_j|^2.4. */
double bk_q_levels_objective(const double *x, int64_t len, int levels, double scale);
double bk_q_uniform_objective(const double *x, int64_t len, int maxq, double scale,
                              double zero);

/* The per-entry rule, written once for any floating type T (float, double):
 *   levels:  c = clamp(rint(x/s), -l, l),            value c*s
 *   uniform: c = clamp(rint(x/s) + z, 0, 2^b - 1),   value s*(c - z)
 *   integer: c = rint(x),                            value c
 * All arithmetic in T (fp32 solves round in fp32, as the GPTQ reference). A
 * NaN input counts as non-finite and clamps to the lower end; an integer
 * code beyond int16 counts as overflow and is stored as 0. */
#define BK_Q_DEFINE_APPLY(NAME, T, RINT)                                                      \
    static inline T NAME(const bk_alphabet *a, T x, int64_t i, int64_t j, int32_t *code,      \
                         bk_q_counts *cnt)                                                    \
    {                                                                                         \
        if (!(x - x == (T)0))                                                                 \
            cnt->nonfinite++;                                                                 \
        if (a->spec.kind == BK_Q_INTEGER) {                                                   \
            T c = RINT(x);                                                                    \
            if (!(c >= (T)-BK_Q_INT16_MAX && c <= (T)BK_Q_INT16_MAX)) {                       \
                cnt->overflow++;                                                              \
                *code = 0;                                                                    \
                return c;                                                                     \
            }                                                                                 \
            *code = (int32_t)c;                                                               \
            return c;                                                                         \
        }                                                                                     \
        const int64_t gi_ = i * a->groups + j / a->group;                                     \
        const T s = (T)a->scale[gi_];                                                         \
        T c = RINT(x / s);                                                                    \
        if (a->spec.kind == BK_Q_UNIFORM) {                                                   \
            const T z = (T)a->zero[gi_];                                                      \
            c += z;                                                                           \
            if (!(c >= (T)0)) {                                                               \
                c = (T)0;                                                                     \
                cnt->clamped++;                                                               \
            } else if (c > (T)a->qmax) {                                                      \
                c = (T)a->qmax;                                                               \
                cnt->clamped++;                                                               \
            }                                                                                 \
            *code = (int32_t)c;                                                               \
            return s * (c - z);                                                               \
        }                                                                                     \
        if (!(c >= (T)a->qmin)) {                                                             \
            c = (T)a->qmin;                                                                   \
            cnt->clamped++;                                                                   \
        } else if (c > (T)a->qmax) {                                                          \
            c = (T)a->qmax;                                                                   \
            cnt->clamped++;                                                                   \
        }                                                                                     \
        *code = (int32_t)c;                                                                   \
        return c * s;                                                                         \
    }

BK_Q_DEFINE_APPLY(bk_q_apply_f, float, rintf)
BK_Q_DEFINE_APPLY(bk_q_apply_d, double, rint)

/* Scale of entry (i, j) (1 for the integer alphabet). */
static inline double bk_q_scale_at(const bk_alphabet *a, int64_t i, int64_t j)
{
    if (a->spec.kind == BK_Q_INTEGER)
        return 1.0;
    return (double)a->scale[i * a->groups + j / a->group];
}

#endif /* BK_QUANT_H */
