/* bakron bench — time the solvers on seeded random problems
 * (docs/solver.md "Benchmark"; results in docs/BENCHMARKS.md). */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "cli.h"
#include "util.h"

static const char bench_usage[] =
    "usage: bakron bench [--backend auto|cpu|cuda] [--algorithms LIST] [--shapes LIST]\n"
    "                    [--precision fp32|fp64] [--repeat N] [--seed S] [--json]\n"
    "\n"
    "Time the solvers on random problems: W ~ N(0, 0.02^2) [m, n], A = X X^T / k and\n"
    "B likewise from correlated Gaussian X (k = 256 samples, so both are rank\n"
    "deficient and rely on the damping, as real Hessians often do). For each shape\n"
    "and algorithm: the median and minimum of the solve time over --repeat runs\n"
    "(the core algorithm only, excluding damping/Cholesky, as the paper's Table 3),\n"
    "the factorization time, the effective GFLOP/s of the flop model below, and the\n"
    "fraction of codes that differ from bakron's on the same problem.\n"
    "\n"
    "Flop model (nominal work, the same for every algorithm of a family, so that\n"
    "GFLOP/s compare times): two-sided algorithms m*n*(m+n) flops (applying both\n"
    "unit-triangular factors to a dense error matrix, L_B E L_A^T: m^2 n/2 + m n^2/2\n"
    "multiply-adds); gptq m*n^2; rtn m*n.\n"
    "\n"
    "options:\n"
    "  --algorithms LIST     comma-separated (default bakron,recursive,antidiag,gptq,naive)\n"
    "  --shapes LIST         MxN,... (default 256x256,512x512,1024x1024,1024x2816)\n"
    "  --repeat N            runs per algorithm and shape (default 3)\n"
    "  --seed S              problem seed (default 1)\n"
    "  --naive-max CELLS     skip naive above this m*n (default 262144 = 512x512;\n"
    "                        0 = never skip)\n"
    "  --json                print the results as JSON\n"
    "%s"
    "  -h, --help            print this help\n";

enum { B_ALGS = 2000, B_SHAPES, B_REPEAT, B_SEED, B_NAIVEMAX, B_JSON, B_HELP, B_SHARED };

static const struct option bench_opts[] = {
    {"algorithms", required_argument, NULL, B_ALGS},
    {"shapes", required_argument, NULL, B_SHAPES},
    {"repeat", required_argument, NULL, B_REPEAT},
    {"seed", required_argument, NULL, B_SEED},
    {"naive-max", required_argument, NULL, B_NAIVEMAX},
    {"json", no_argument, NULL, B_JSON},
    {"help", no_argument, NULL, B_HELP},
    {"levels", required_argument, NULL, B_SHARED},
    {"bits", required_argument, NULL, B_SHARED},
    {"group", required_argument, NULL, B_SHARED},
    {"asym", no_argument, NULL, B_SHARED},
    {"no-mse", no_argument, NULL, B_SHARED},
    {"damp", required_argument, NULL, B_SHARED},
    {"damp-b", required_argument, NULL, B_SHARED},
    {"precision", required_argument, NULL, B_SHARED},
    {"gptq-block", required_argument, NULL, B_SHARED},
    {"backend", required_argument, NULL, B_SHARED},
    {"setting", required_argument, NULL, B_SHARED},
    {NULL, 0, NULL, 0},
};

#define MAX_ITEMS 32

typedef struct row {
    int64_t m, n;
    bk_algorithm alg;
    int skipped;
    double median, min, factor, gflops, loss2, loss1, diff, peak_bytes;
    int have_diff;
} row;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static bk_status parse_algorithms(const char *s, bk_algorithm *out, int *count)
{
    char buf[512];
    if (strlen(s) >= sizeof buf)
        return cli_usage_error("--algorithms: list too long");
    strcpy(buf, s);
    *count = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*count == MAX_ITEMS)
            return cli_usage_error("--algorithms: at most %d entries", MAX_ITEMS);
        if (bk_algorithm_from_name(tok, &out[*count]) != BK_OK)
            return cli_usage_error("--algorithms: unknown '%s' (bakron, recursive, antidiag, "
                                   "naive, gptq, rtn)", tok);
        (*count)++;
    }
    if (*count == 0)
        return cli_usage_error("--algorithms: empty list");
    return BK_OK;
}

static bk_status parse_shapes(const char *s, int64_t (*out)[2], int *count)
{
    char buf[1024];
    if (strlen(s) >= sizeof buf)
        return cli_usage_error("--shapes: list too long");
    strcpy(buf, s);
    *count = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*count == MAX_ITEMS)
            return cli_usage_error("--shapes: at most %d entries", MAX_ITEMS);
        char *x = strchr(tok, 'x');
        if (!x)
            return cli_usage_error("--shapes: expected MxN, got '%s'", tok);
        *x = '\0';
        bk_status st;
        if ((st = cli_parse_i64("--shapes", tok, 1, 1 << 20, &out[*count][0])) != BK_OK ||
            (st = cli_parse_i64("--shapes", x + 1, 1, 1 << 20, &out[*count][1])) != BK_OK)
            return st;
        (*count)++;
    }
    if (*count == 0)
        return cli_usage_error("--shapes: empty list");
    return BK_OK;
}

/* A seeded SPD factor [d, d]: X X^T / k with X [d, k] Gaussian, neighbouring
 * rows correlated and row scales varying over two orders of magnitude. */
static float *random_factor(int64_t d, bk_rng *rng)
{
    const int64_t k = 256;
    float *X = bk_alloc((size_t)(d * k), sizeof(float));
    float *A = bk_alloc((size_t)(d * d), sizeof(float));
    if (!X || !A) {
        free(X);
        free(A);
        return NULL;
    }
    double prev = 0;
    for (int64_t i = 0; i < d; i++) {
        const double sc = pow(10.0, bk_rng_uniform(rng) * 2.0 - 1.0);
        for (int64_t t = 0; t < k; t++) {
            const double g = bk_rng_normal(rng);
            X[i * k + t] = (float)(sc * (g + (i > 0 ? 0.5 * X[(i - 1) * k + t] / (prev ? prev : 1) : 0)));
        }
        prev = sc;
    }
    cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, (int)d, (int)k, 1.0f / (float)k, X,
                (int)k, 0.0f, A, (int)d);
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = i + 1; j < d; j++)
            A[i * d + j] = A[j * d + i];
    free(X);
    return A;
}

static double model_flops(bk_algorithm a, int64_t m, int64_t n)
{
    const double M = (double)m, N = (double)n;
    if (a == BK_ALG_GPTQ)
        return M * N * N;
    if (a == BK_ALG_RTN)
        return M * N;
    return M * N * (M + N);
}

static bk_status run_shape(bk_backend *be, const cli_solver_args *a, const bk_algorithm *algs,
                           int nalg, int64_t m, int64_t n, int repeat, uint64_t seed,
                           int64_t naive_max, int json, row *rows)
{
    bk_status st = BK_OK;
    bk_rng rng;
    bk_rng_seed(&rng, seed ^ ((uint64_t)m << 32) ^ (uint64_t)n);
    float *W = bk_alloc((size_t)(m * n), sizeof(float));
    float *A = random_factor(n, &rng);
    float *B = random_factor(m, &rng);
    int16_t *ref = NULL;
    double *times = bk_alloc((size_t)repeat, sizeof(double));
    if (!W || !A || !B || !times) {
        st = bk_error(BK_ERR_NOMEM, "bench: out of memory for a [%lld x %lld] problem",
                      (long long)m, (long long)n);
        goto done;
    }
    for (int64_t t = 0; t < m * n; t++)
        W[t] = (float)(0.02 * bk_rng_normal(&rng));
    bk_solve_problem p = {.m = m, .n = n, .dtype = BK_DT_F32, .W = W, .A = A, .B = B,
                          .label_w = "bench.W", .label_a = "bench.A", .label_b = "bench.B"};
    /* bakron first, so every other algorithm can be compared with it */
    int order[MAX_ITEMS], no = 0;
    for (int i = 0; i < nalg; i++)
        if (algs[i] == BK_ALG_BAKRON)
            order[no++] = i;
    for (int i = 0; i < nalg; i++)
        if (algs[i] != BK_ALG_BAKRON)
            order[no++] = i;
    for (int oi = 0; oi < nalg; oi++) {
        const int i = order[oi];
        row *rw = &rows[i];
        memset(rw, 0, sizeof *rw);
        rw->m = m;
        rw->n = n;
        rw->alg = algs[i];
        rw->loss1 = rw->loss2 = NAN;
        if (algs[i] == BK_ALG_NAIVE && naive_max > 0 && m * n > naive_max) {
            rw->skipped = 1;
            continue;
        }
        bk_solve_opts o = a->opts;
        o.algorithm = algs[i];
        if (algs[i] != BK_ALG_GPTQ)
            o.quant.refit_groups = 0;
        double factor = INFINITY;
        bk_backend_reset_peak_memory(be);
        for (int rep = 0; rep < repeat; rep++) {
            o.compute_stats = rep == 0;
            bk_solve_result r;
            if ((st = bk_backend_solve(be, &p, &o, &r)) != BK_OK) {
                char ctx[96];
                snprintf(ctx, sizeof ctx, "bench %s [%lld x %lld]", bk_algorithm_name(algs[i]),
                         (long long)m, (long long)n);
                bk_error_prefix(st, ctx);
                goto done;
            }
            times[rep] = r.time_solve_s;
            factor = fmin(factor, r.time_factor_s);
            if (rep == 0) {
                rw->loss2 = r.loss_two_sided;
                rw->loss1 = r.loss_one_sided;
                if (algs[i] == BK_ALG_BAKRON && !ref) {
                    ref = r.codes;
                    r.codes = NULL;
                } else if (ref) {
                    int64_t d = 0;
                    for (int64_t t = 0; t < m * n; t++)
                        d += r.codes[t] != ref[t];
                    rw->diff = (double)d / (double)(m * n);
                    rw->have_diff = 1;
                }
            }
            bk_solve_result_free(&r);
        }
        if (algs[i] == BK_ALG_BAKRON && ref) {
            rw->diff = 0;
            rw->have_diff = 1;
        }
        qsort(times, (size_t)repeat, sizeof(double), cmp_double);
        rw->median = repeat % 2 ? times[repeat / 2]
                                : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
        rw->min = times[0];
        rw->factor = factor;
        rw->peak_bytes = (double)bk_backend_peak_memory(be);
        rw->gflops = model_flops(algs[i], m, n) / rw->median * 1e-9;
        if (!json) {
            fprintf(stderr, "  %lldx%lld %s: %.4f s\n", (long long)m, (long long)n,
                    bk_algorithm_name(algs[i]), rw->median);
        }
    }
done:
    free(W);
    free(A);
    free(B);
    free(ref);
    free(times);
    return st;
}

static void print_table(const row *rows, int count, const char *head)
{
    printf("%s", head);
    printf("%-11s %-10s %10s %10s %10s %9s %10s %14s %9s\n", "shape", "algorithm", "median_s",
           "min_s", "factor_s", "GFLOP/s", "diff_vs_bk", "loss_two_sided", "peak_MiB");
    for (int i = 0; i < count; i++) {
        const row *r = &rows[i];
        char shape[48];
        snprintf(shape, sizeof shape, "%lldx%lld", (long long)r->m, (long long)r->n);
        if (r->skipped) {
            printf("%-11s %-10s %10s (skipped: above --naive-max)\n", shape,
                   bk_algorithm_name(r->alg), "-");
            continue;
        }
        char diff[32] = "-";
        if (r->have_diff)
            snprintf(diff, sizeof diff, "%.4f%%", 100.0 * r->diff);
        printf("%-11s %-10s %10.4f %10.4f %10.4f %9.2f %10s %14.6g %9.1f\n", shape,
               bk_algorithm_name(r->alg), r->median, r->min, r->factor, r->gflops, diff, r->loss2,
               r->peak_bytes / 1048576.0);
    }
}

static bk_status print_json(const row *rows, int count, const cli_solver_args *a,
                            const bk_backend *be, int repeat, uint64_t seed)
{
    int oom = 0;
    char quant[128];
    cli_quant_describe(&a->opts.quant, quant, sizeof quant);
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "results") : NULL;
    if (!o || !arr) {
        cJSON_Delete(o);
        return bk_error(BK_ERR_NOMEM, "bench: out of memory for JSON");
    }
    oom |= !cJSON_AddStringToObject(o, "backend", bk_backend_name(be));
    oom |= !cJSON_AddStringToObject(o, "device", bk_backend_device(be));
    oom |= !cJSON_AddStringToObject(o, "precision",
                                    a->opts.precision == BK_PREC_FP64 ? "fp64" : "fp32");
    oom |= !cJSON_AddStringToObject(o, "quantizer", quant);
    oom |= !cJSON_AddNumberToObject(o, "damp", a->opts.damp);
    oom |= !cJSON_AddNumberToObject(o, "repeat", repeat);
    oom |= !cJSON_AddNumberToObject(o, "seed", (double)seed);
    for (int i = 0; i < count && !oom; i++) {
        const row *r = &rows[i];
        cJSON *e = cJSON_CreateObject();
        if (!e || !cJSON_AddItemToArray(arr, e)) {
            cJSON_Delete(e);
            oom = 1;
            break;
        }
        oom |= !cJSON_AddNumberToObject(e, "m", (double)r->m);
        oom |= !cJSON_AddNumberToObject(e, "n", (double)r->n);
        oom |= !cJSON_AddStringToObject(e, "algorithm", bk_algorithm_name(r->alg));
        oom |= !cJSON_AddBoolToObject(e, "skipped", r->skipped);
        if (r->skipped)
            continue;
        oom |= !cJSON_AddNumberToObject(e, "median_s", r->median);
        oom |= !cJSON_AddNumberToObject(e, "min_s", r->min);
        oom |= !cJSON_AddNumberToObject(e, "factor_s", r->factor);
        oom |= !cJSON_AddNumberToObject(e, "peak_device_bytes", r->peak_bytes);
        oom |= !cJSON_AddNumberToObject(e, "gflops", r->gflops);
        oom |= !(r->have_diff ? cJSON_AddNumberToObject(e, "code_diff_vs_bakron", r->diff)
                              : cJSON_AddNullToObject(e, "code_diff_vs_bakron"));
        oom |= !(isfinite(r->loss2) ? cJSON_AddNumberToObject(e, "loss_two_sided", r->loss2)
                                    : cJSON_AddNullToObject(e, "loss_two_sided"));
        oom |= !(isfinite(r->loss1) ? cJSON_AddNumberToObject(e, "loss_one_sided", r->loss1)
                                    : cJSON_AddNullToObject(e, "loss_one_sided"));
    }
    char *txt = oom ? NULL : cJSON_Print(o);
    cJSON_Delete(o);
    if (!txt)
        return bk_error(BK_ERR_NOMEM, "bench: out of memory for JSON");
    printf("%s\n", txt);
    free(txt);
    return BK_OK;
}

bk_status bk_cmd_bench(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        printf(bench_usage, cli_solver_options_help);
        return BK_OK;
    }
    cli_solver_args a;
    cli_solver_args_init(&a);
    bk_algorithm algs[MAX_ITEMS];
    int64_t shapes[MAX_ITEMS][2];
    int nalg = 0, nshape = 0, repeat = 3, json = 0, c, idx = 0;
    int64_t seed = 1, naive_max = 512 * 512;
    bk_status st;
    if ((st = parse_algorithms("bakron,recursive,antidiag,gptq,naive", algs, &nalg)) != BK_OK ||
        (st = parse_shapes("256x256,512x512,1024x1024,1024x2816", shapes, &nshape)) != BK_OK)
        return st;
    optind = 1;
    opterr = 0;
    cli_once once = {0};
    while ((c = getopt_long(argc, argv, "", bench_opts, &idx)) != -1) {
        /* (the solver options share one val: the name is the row's) */
        const char *name = c == '?' || c == ':' ? NULL : bench_opts[idx].name;
        if (name && (st = cli_once_add(&once, name, optarg)) != BK_OK)
            return st;
        switch (c) {
        case B_ALGS:
            if ((st = parse_algorithms(optarg, algs, &nalg)) != BK_OK)
                return st;
            break;
        case B_SHAPES:
            if ((st = parse_shapes(optarg, shapes, &nshape)) != BK_OK)
                return st;
            break;
        case B_REPEAT:
            if ((st = cli_parse_int("--repeat", optarg, 1, 1000, &repeat)) != BK_OK)
                return st;
            break;
        case B_SEED:
            if ((st = cli_parse_i64("--seed", optarg, 0, INT64_MAX, &seed)) != BK_OK)
                return st;
            break;
        case B_NAIVEMAX:
            if ((st = cli_parse_i64("--naive-max", optarg, 0, INT64_MAX, &naive_max)) != BK_OK)
                return st;
            break;
        case B_JSON: json = 1; break;
        case B_SHARED: {
            int handled;
            if ((st = cli_solver_option(&a, bench_opts[idx].name, optarg, &handled)) != BK_OK)
                return st;
            break;
        }
        default:
            return cli_usage_error("bad option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if ((st = cli_solver_args_check(&a)) != BK_OK)
        return st;

    bk_backend *be = NULL;
    if ((st = bk_backend_create_params(a.backend, &a.params, &be)) != BK_OK)
        return st;
    row *rows = calloc((size_t)(nalg * nshape), sizeof(row));
    if (!rows) {
        bk_backend_destroy(be);
        return bk_error(BK_ERR_NOMEM, "bench: out of memory");
    }
    char quant[128], head[512];
    cli_quant_describe(&a.opts.quant, quant, sizeof quant);
    snprintf(head, sizeof head,
             "backend %s: %s\nprecision %s, quantizer %s, damp %g, repeat %d, seed %lld\n",
             bk_backend_name(be), bk_backend_device(be),
             a.opts.precision == BK_PREC_FP64 ? "fp64" : "fp32", quant, a.opts.damp, repeat,
             (long long)seed);
    if (!json)
        fputs(head, stderr);
    for (int s = 0; s < nshape && st == BK_OK; s++)
        st = run_shape(be, &a, algs, nalg, shapes[s][0], shapes[s][1], repeat, (uint64_t)seed,
                       naive_max, json, rows + s * nalg);
    if (st == BK_OK) {
        if (json)
            st = print_json(rows, nalg * nshape, &a, be, repeat, (uint64_t)seed);
        else
            print_table(rows, nalg * nshape, head);
        if (st == BK_OK && fflush(stdout) != 0)
            st = bk_error(BK_ERR_WRITE, "bench: cannot write to standard output");
    }
    free(rows);
    bk_backend_destroy(be);
    return st;
}
