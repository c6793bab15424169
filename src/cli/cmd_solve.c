/* bakron solve — quantize one weight matrix under given Hessian factors
 * (docs/solver.md "Command line"). Also the solver options shared with
 * `bakron bench`. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "util.h"

/* ------------------------------------------------- shared solver options */

const char cli_solver_options_help[] =
    "  --levels L            symmetric alphabet {-L..L} * s_i, one scale per row\n"
    "                        (default 3: log2(7) = 2.81 bits; L <= 127)\n"
    "  --bits B              uniform B-bit alphabet (2, 3, 4 or 8), GPTQ conventions\n"
    "  --group G             with --bits: one scale per G input columns (default: per row)\n"
    "  --asym                with --bits: asymmetric (scale + zero point)\n"
    "  --no-mse              scales from the range only (no MSE grid search)\n"
    "  --damp D              relative damping delta: A + D*mean(diag A)*I (default 0.5)\n"
    "  --damp-b D            damp the output-side factor B with D instead (default: as A)\n"
    "  --precision P         fp32 (default) or fp64\n"
    "  --gptq-block N        GPTQ lazy batch width (default 128)\n"
    "  --backend K           auto (default: CUDA when a GPU is usable), cpu or cuda\n"
    "  --setting KEY=VALUE   backend setting (repeatable; README \"Settings\"): device=N,\n"
    "                        factor_fp64=0|1, mem_limit=BYTES\n";

void cli_solver_args_init(cli_solver_args *a)
{
    memset(a, 0, sizeof *a);
    bk_solve_opts_default(&a->opts);
    a->backend = BK_BACKEND_AUTO;
    bk_backend_params_default(&a->params);
}

bk_status cli_solver_option(cli_solver_args *a, const char *name, const char *arg, int *handled)
{
    bk_solve_opts *o = &a->opts;
    bk_status st = BK_OK;
    int iv;
    int64_t lv;
    double dv;
    *handled = 1;
    if (!strcmp(name, "levels")) {
        if ((st = cli_parse_int("--levels", arg, 1, 127, &iv)) != BK_OK)
            return st;
        o->quant.kind = BK_Q_LEVELS;
        o->quant.levels = iv;
        a->have_levels = 1;
    } else if (!strcmp(name, "bits")) {
        if ((st = cli_parse_int("--bits", arg, 2, 8, &iv)) != BK_OK)
            return st;
        if (iv != 2 && iv != 3 && iv != 4 && iv != 8)
            return cli_usage_error("--bits: expected 2, 3, 4 or 8, got %d", iv);
        o->quant.kind = BK_Q_UNIFORM;
        o->quant.bits = iv;
        a->have_bits = 1;
    } else if (!strcmp(name, "group")) {
        if ((st = cli_parse_i64("--group", arg, 1, (int64_t)1 << 31, &lv)) != BK_OK)
            return st;
        o->quant.group = lv;
        a->have_group = 1;
    } else if (!strcmp(name, "asym")) {
        o->quant.asym = 1;
        a->have_asym = 1;
    } else if (!strcmp(name, "refit-groups")) {
        o->quant.refit_groups = 1;
    } else if (!strcmp(name, "no-mse")) {
        o->quant.mse = 0;
    } else if (!strcmp(name, "damp")) {
        if ((st = cli_parse_double("--damp", arg, 0.0, 1e6, &dv)) != BK_OK)
            return st;
        o->damp = dv;
    } else if (!strcmp(name, "damp-b")) {
        if ((st = cli_parse_double("--damp-b", arg, 0.0, 1e6, &dv)) != BK_OK)
            return st;
        o->separate_damp_b = 1;
        o->damp_b = dv;
    } else if (!strcmp(name, "precision")) {
        if ((st = cli_parse_choice("--precision", arg, cli_precision_names, 2, &iv)) != BK_OK)
            return st;
        o->precision = (bk_precision)iv;
    } else if (!strcmp(name, "gptq-block")) {
        if ((st = cli_parse_int("--gptq-block", arg, 1, 1 << 20, &iv)) != BK_OK)
            return st;
        o->gptq_block = iv;
    } else if (!strcmp(name, "backend")) {
        if (bk_backend_kind_from_name(arg, &a->backend) != BK_OK)
            return cli_usage_error("--backend: expected auto, cpu or cuda, got '%s'", arg);
    } else if (!strcmp(name, "setting")) {
        if ((st = cli_setting(&a->params, arg)) != BK_OK)
            return st;
    } else {
        *handled = 0;
    }
    return BK_OK;
}

bk_status cli_solver_args_check(const cli_solver_args *a)
{
    if (a->have_levels && a->have_bits)
        return cli_usage_error("--levels and --bits are exclusive");
    if ((a->have_group || a->have_asym) && !a->have_bits)
        return cli_usage_error("--group and --asym need --bits");
    if (a->opts.quant.refit_groups && (!a->have_group || a->opts.algorithm != BK_ALG_GPTQ))
        return cli_usage_error("--refit-groups needs --algorithm gptq, --bits and --group");
    return BK_OK;
}

void cli_quant_describe(const bk_quant_spec *q, char *buf, size_t cap)
{
    switch (q->kind) {
    case BK_Q_LEVELS:
        snprintf(buf, cap, "levels=%d%s", q->levels, q->mse ? " mse" : "");
        break;
    case BK_Q_UNIFORM:
        snprintf(buf, cap, "uniform bits=%d group=%lld %s%s%s", q->bits, (long long)q->group,
                 q->asym ? "asym" : "sym", q->mse ? " mse" : "",
                 q->refit_groups ? " refit-groups" : "");
        break;
    case BK_Q_INTEGER:
        snprintf(buf, cap, "integer");
        break;
    }
}

/* ------------------------------------------------------------------ solve */

static const char solve_usage[] =
    "usage: bakron solve --weight FILE.safetensors:TENSOR --hessian-a FILE:TENSOR\n"
    "                    [--hessian-b FILE:TENSOR] [--algorithm A]\n"
    "                    [--levels L | --bits B [--group G] [--asym]] [--no-mse]\n"
    "                    [--damp D] [--precision fp32|fp64] [--backend auto|cpu|cuda]\n"
    "                    --out OUT.safetensors [--json]\n"
    "\n"
    "Quantize one weight matrix W [out, in] under the Hessian A (x) B: A [in, in]\n"
    "(input side), B [out, out] (output side; the identity when --hessian-b is\n"
    "absent). Tensors may be F16, BF16, F32 or F64 (each is converted exactly to F64).\n"
    "\n"
    "options:\n"
    "  --weight FILE:TENSOR  the weight matrix, 2-D [out, in]\n"
    "  --hessian-a FILE:TENSOR   input-side factor A [in, in], symmetric PSD\n"
    "  --hessian-b FILE:TENSOR   output-side factor B [out, out] (default: identity)\n"
    "  --algorithm A         bakron (default), recursive, antidiag, naive, gptq (B is\n"
    "                        ignored), rtn (plain rounding)\n"
    "%s"
    "  --refit-groups        with --algorithm gptq --bits B --group G: refit each group\n"
    "                        from the updated weights at its start (GPTQ reference)\n"
    "  --out PATH            output .safetensors (written atomically)\n"
    "  --json                print the summary as JSON\n"
    "  -h, --help            print this help\n"
    "\n"
    "OUT holds codes [out, in] (I8 for --levels: -L..L; U8 for --bits: 0..2^B-1),\n"
    "scales F32 [out, groups], zeros F32 [out, groups] (--asym only), weight F32\n"
    "[out, in] = (codes - zero) * scale, and metadata: algorithm, damping used, both\n"
    "proxy losses, the Corollary 3.4 bound and the times.\n"
    "\n"
    "exit codes: 0 ok, 1 usage error, 2 bad input (one line on stderr naming the\n"
    "tensor and the rule), 3 runtime or device error.\n";

enum { S_WEIGHT = 1000, S_HA, S_HB, S_ALG, S_OUT, S_JSON, S_HELP, S_SHARED };

static const struct option solve_opts[] = {
    {"weight", required_argument, NULL, S_WEIGHT},
    {"hessian-a", required_argument, NULL, S_HA},
    {"hessian-b", required_argument, NULL, S_HB},
    {"algorithm", required_argument, NULL, S_ALG},
    {"out", required_argument, NULL, S_OUT},
    {"json", no_argument, NULL, S_JSON},
    {"help", no_argument, NULL, S_HELP},
    {"levels", required_argument, NULL, S_SHARED},
    {"bits", required_argument, NULL, S_SHARED},
    {"group", required_argument, NULL, S_SHARED},
    {"asym", no_argument, NULL, S_SHARED},
    {"refit-groups", no_argument, NULL, S_SHARED},
    {"no-mse", no_argument, NULL, S_SHARED},
    {"damp", required_argument, NULL, S_SHARED},
    {"damp-b", required_argument, NULL, S_SHARED},
    {"precision", required_argument, NULL, S_SHARED},
    {"gptq-block", required_argument, NULL, S_SHARED},
    {"backend", required_argument, NULL, S_SHARED},
    {"setting", required_argument, NULL, S_SHARED},
    {NULL, 0, NULL, 0},
};

/* One input tensor: FILE:TENSOR opened, checked, converted to F64. */
typedef struct input {
    char file[4096], name[1024], label[5200];
    bk_st_file *f;
    const bk_tensor_info *t;
    double *data;
} input;

static void input_close(input *in)
{
    free(in->data);
    bk_st_close(in->f);
    in->data = NULL;
    in->f = NULL;
}

static bk_status input_open(input *in, const char *opt, const char *ref, const char *role)
{
    bk_status st = cli_split_tensor_ref(opt, ref, in->file, sizeof in->file, in->name,
                                        sizeof in->name);
    if (st != BK_OK)
        return st;
    snprintf(in->label, sizeof in->label, "%s:%s", in->file, in->name);
    if ((st = bk_st_open_any(in->file, &in->f)) != BK_OK)
        return st;
    in->t = bk_st_find(in->f, in->name);
    if (!in->t)
        return bk_error(BK_ERR_MISSING_TENSOR, "%s: no tensor '%s' (the %s)", in->file, in->name,
                        role);
    const bk_dtype dt = in->t->dtype;
    if (dt != BK_DT_F16 && dt != BK_DT_BF16 && dt != BK_DT_F32 && dt != BK_DT_F64)
        return bk_error(BK_ERR_DTYPE, "%s: dtype %s is not a floating-point dtype (the %s must "
                        "be F16, BF16, F32 or F64)", in->label, bk_dtype_name(dt), role);
    if (in->t->ndim != 2)
        return bk_error(BK_ERR_SHAPE, "%s: the %s must be a matrix (2 dimensions), got %d", in->label,
                        role, in->t->ndim);
    return BK_OK;
}

/* --out and the files the refs name (cli_check_out_file). */
static bk_status check_out(const char *out, const char *const opts[], const char *const refs[],
                           int n)
{
    char files[3][4096], name[1024];
    cli_input_path in[3];
    for (int i = 0; i < n && i < 3; i++) {
        in[i].what = opts[i];
        in[i].path = NULL;
        if (!refs[i])
            continue;
        bk_status st =
            cli_split_tensor_ref(opts[i], refs[i], files[i], sizeof files[i], name, sizeof name);
        if (st != BK_OK)
            return st;
        in[i].path = files[i];
    }
    return cli_check_out_file("--out", out, in, n < 3 ? n : 3);
}

static bk_status input_load(input *in)
{
    in->data = bk_alloc((size_t)in->t->numel, sizeof(double));
    if (!in->data)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory (%llu values)", in->label,
                        (unsigned long long)in->t->numel);
    bk_status st = bk_tensor_to_f64(in->t, in->data);
    if (st != BK_OK)
        return bk_error_prefix(st, in->label);
    return BK_OK;
}

static bk_status check_square(const input *in, int64_t want, const char *role, const char *side)
{
    if (in->t->shape[0] != want || in->t->shape[1] != want)
        return bk_error(BK_ERR_SHAPE, "%s: the %s must be [%lld, %lld] (%s of the weight), got "
                        "[%lld, %lld]",
                        in->label, role, (long long)want, (long long)want, side,
                        (long long)in->t->shape[0], (long long)in->t->shape[1]);
    return BK_OK;
}

static bk_status meta_num(bk_st_writer *w, const char *k, double v)
{
    char buf[64];
    snprintf(buf, sizeof buf, "%.17g", v);
    return bk_st_writer_set_meta(w, k, buf);
}

typedef struct summary {
    const char *algorithm, *precision, *backend, *device, *out;
    char quant[128];
    const bk_solve_result *r;
    const char *weight, *ha, *hb;
} summary;

static bk_status write_output(const char *path, const summary *s, int levels_codes)
{
    const bk_solve_result *r = s->r;
    const size_t mn = (size_t)r->m * (size_t)r->n;
    void *codes = malloc(mn ? mn : 1);
    bk_st_writer *w = NULL;
    bk_status st = BK_OK;
    if (!codes)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory for the codes", path);
    for (size_t t = 0; t < mn; t++) {
        if (levels_codes)
            ((int8_t *)codes)[t] = (int8_t)r->codes[t];
        else
            ((uint8_t *)codes)[t] = (uint8_t)r->codes[t];
    }
    const int64_t shp[2] = {r->m, r->n}, gshp[2] = {r->m, r->groups};
    if ((st = bk_st_writer_create(&w)) != BK_OK)
        goto done;
    if ((st = bk_st_writer_add(w, "codes", levels_codes ? BK_DT_I8 : BK_DT_U8, 2, shp, codes,
                               0)) != BK_OK ||
        (st = bk_st_writer_add(w, "scales", BK_DT_F32, 2, gshp, r->scales, 0)) != BK_OK ||
        (r->zeros && (st = bk_st_writer_add(w, "zeros", BK_DT_F32, 2, gshp, r->zeros, 0)) != BK_OK) ||
        (st = bk_st_writer_add(w, "weight", BK_DT_F32, 2, shp, r->weight, 0)) != BK_OK)
        goto done;
    if ((st = bk_st_writer_set_meta(w, "algorithm", s->algorithm)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "precision", s->precision)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "quantizer", s->quant)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "backend", s->backend)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "source_weight", s->weight)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "source_hessian_a", s->ha)) != BK_OK ||
        (st = bk_st_writer_set_meta(w, "source_hessian_b", s->hb ? s->hb : "identity")) != BK_OK ||
        (st = meta_num(w, "damp_a", r->damp_a)) != BK_OK ||
        (st = meta_num(w, "damp_b", r->damp_b)) != BK_OK ||
        (st = meta_num(w, "damp_retries", r->damp_retries)) != BK_OK ||
        (st = meta_num(w, "dead_columns", (double)r->dead_columns)) != BK_OK ||
        (st = meta_num(w, "clamped", (double)r->clamped)) != BK_OK ||
        (st = meta_num(w, "loss_two_sided", r->loss_two_sided)) != BK_OK ||
        (st = meta_num(w, "loss_one_sided", r->loss_one_sided)) != BK_OK ||
        (st = meta_num(w, "bound", r->bound)) != BK_OK ||
        (st = meta_num(w, "time_factor_s", r->time_factor_s)) != BK_OK ||
        (st = meta_num(w, "time_solve_s", r->time_solve_s)) != BK_OK ||
        (st = meta_num(w, "time_stats_s", r->time_stats_s)) != BK_OK)
        goto done;
    st = bk_st_writer_save(w, path);
done:
    bk_st_writer_free(w);
    free(codes);
    return st;
}

static void json_num(cJSON *o, const char *k, double v, int *oom)
{
    if (!(isfinite(v) ? cJSON_AddNumberToObject(o, k, v) : cJSON_AddNullToObject(o, k)))
        *oom = 1;
}

static bk_status print_summary(const summary *s, int json)
{
    const bk_solve_result *r = s->r;
    if (!json) {
        static char ew[CLI_ESC_CAP], eo[CLI_ESC_CAP];
        printf("solved %s [%lld x %lld] -> %s\n", cli_esc(s->weight, ew, sizeof ew),
               (long long)r->m, (long long)r->n, cli_esc(s->out, eo, sizeof eo));
        printf("  algorithm       %s (%s, backend %s: %s)\n", s->algorithm, s->precision,
               s->backend, s->device);
        printf("  quantizer       %s, %lld group%s per row\n", s->quant, (long long)r->groups,
               r->groups == 1 ? "" : "s");
        printf("  damping         A %g, B %g (%d escalation%s)\n", r->damp_a, r->damp_b,
               r->damp_retries, r->damp_retries == 1 ? "" : "s");
        printf("  dead columns    %lld\n  clamped         %lld\n", (long long)r->dead_columns,
               (long long)r->clamped);
        printf("  loss two-sided  %.9g   tr(E^T B~ E A~)\n", r->loss_two_sided);
        printf("  loss one-sided  %.9g   tr(E A~ E^T)\n", r->loss_one_sided);
        printf("  bound           %.9g\n", r->bound);
        printf("  time            factor %.3f s, solve %.3f s, stats %.3f s\n", r->time_factor_s,
               r->time_solve_s, r->time_stats_s);
    } else {
        int oom = 0;
        cJSON *o = cJSON_CreateObject();
        if (!o)
            return bk_error(BK_ERR_NOMEM, "solve: out of memory for JSON");
        oom |= !cJSON_AddStringToObject(o, "weight", s->weight);
        oom |= !cJSON_AddStringToObject(o, "hessian_a", s->ha);
        oom |= !(s->hb ? cJSON_AddStringToObject(o, "hessian_b", s->hb)
                       : cJSON_AddNullToObject(o, "hessian_b"));
        oom |= !cJSON_AddStringToObject(o, "out", s->out);
        json_num(o, "m", (double)r->m, &oom);
        json_num(o, "n", (double)r->n, &oom);
        json_num(o, "groups", (double)r->groups, &oom);
        oom |= !cJSON_AddStringToObject(o, "algorithm", s->algorithm);
        oom |= !cJSON_AddStringToObject(o, "precision", s->precision);
        oom |= !cJSON_AddStringToObject(o, "quantizer", s->quant);
        oom |= !cJSON_AddStringToObject(o, "backend", s->backend);
        oom |= !cJSON_AddStringToObject(o, "device", s->device);
        json_num(o, "damp_a", r->damp_a, &oom);
        json_num(o, "damp_b", r->damp_b, &oom);
        json_num(o, "damp_retries", r->damp_retries, &oom);
        json_num(o, "dead_columns", (double)r->dead_columns, &oom);
        json_num(o, "clamped", (double)r->clamped, &oom);
        json_num(o, "loss_two_sided", r->loss_two_sided, &oom);
        json_num(o, "loss_one_sided", r->loss_one_sided, &oom);
        json_num(o, "bound", r->bound, &oom);
        json_num(o, "time_factor_s", r->time_factor_s, &oom);
        json_num(o, "time_solve_s", r->time_solve_s, &oom);
        json_num(o, "time_stats_s", r->time_stats_s, &oom);
        char *txt = oom ? NULL : cJSON_Print(o);
        cJSON_Delete(o);
        if (!txt)
            return bk_error(BK_ERR_NOMEM, "solve: out of memory for JSON");
        printf("%s\n", txt);
        free(txt);
    }
    if (fflush(stdout) != 0)
        return bk_error(BK_ERR_WRITE, "solve: cannot write to standard output");
    return BK_OK;
}

bk_status bk_cmd_solve(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        printf(solve_usage, cli_solver_options_help);
        return BK_OK;
    }
    cli_solver_args a;
    cli_solver_args_init(&a);
    const char *wref = NULL, *aref = NULL, *bref = NULL, *out = NULL;
    int json = 0, c, idx = 0;
    bk_status st = BK_OK;
    optind = 1;
    opterr = 0;
    cli_once once = {0};
    while ((c = getopt_long(argc, argv, "", solve_opts, &idx)) != -1) {
        /* (the solver options share one val: the name is the row's) */
        const char *name = c == '?' || c == ':' ? NULL : solve_opts[idx].name;
        if (name && (st = cli_once_add(&once, name, optarg)) != BK_OK)
            return st;
        switch (c) {
        case S_WEIGHT: wref = optarg; break;
        case S_HA: aref = optarg; break;
        case S_HB: bref = optarg; break;
        case S_OUT: out = optarg; break;
        case S_JSON: json = 1; break;
        case S_ALG:
            if (bk_algorithm_from_name(optarg, &a.opts.algorithm) != BK_OK)
                return cli_usage_error("--algorithm: unknown '%s' (bakron, recursive, antidiag, "
                                       "naive, gptq, rtn)", optarg);
            break;
        case S_SHARED: {
            int handled;
            if ((st = cli_solver_option(&a, solve_opts[idx].name, optarg, &handled)) != BK_OK)
                return st;
            break;
        }
        default:
            return cli_usage_error("bad option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!wref || !aref || !out)
        return cli_usage_error("--weight, --hessian-a and --out are required");
    if ((st = cli_solver_args_check(&a)) != BK_OK)
        return st;
    const char *const in_opts[] = {"--weight", "--hessian-a", "--hessian-b"};
    const char *const in_refs[] = {wref, aref, bref};
    if ((st = check_out(out, in_opts, in_refs, 3)) != BK_OK)
        return st;

    input in_w, in_a, in_b;
    memset(&in_w, 0, sizeof in_w);
    memset(&in_a, 0, sizeof in_a);
    memset(&in_b, 0, sizeof in_b);
    bk_backend *be = NULL;
    bk_solve_result r;
    memset(&r, 0, sizeof r);
    if ((st = input_open(&in_w, "--weight", wref, "weight")) != BK_OK ||
        (st = input_open(&in_a, "--hessian-a", aref, "input-side factor A")) != BK_OK ||
        (bref && (st = input_open(&in_b, "--hessian-b", bref, "output-side factor B")) != BK_OK))
        goto done;
    const int64_t m = in_w.t->shape[0], n = in_w.t->shape[1];
    if (m == 0 || n == 0) {
        st = bk_error(BK_ERR_SHAPE, "%s: the weight is empty [%lld, %lld]", in_w.label,
                      (long long)m, (long long)n);
        goto done;
    }
    if ((st = check_square(&in_a, n, "input-side factor A", "in x in")) != BK_OK ||
        (bref && (st = check_square(&in_b, m, "output-side factor B", "out x out")) != BK_OK))
        goto done;
    if ((st = input_load(&in_w)) != BK_OK || (st = input_load(&in_a)) != BK_OK ||
        (bref && (st = input_load(&in_b)) != BK_OK))
        goto done;
    if ((st = bk_backend_create_params(a.backend, &a.params, &be)) != BK_OK)
        goto done;
    bk_solve_problem p;
    memset(&p, 0, sizeof p);
    p.m = m;
    p.n = n;
    p.dtype = BK_DT_F64;
    p.W = in_w.data;
    p.A = in_a.data;
    p.B = bref ? in_b.data : NULL;
    p.label_w = in_w.label;
    p.label_a = in_a.label;
    p.label_b = bref ? in_b.label : NULL;
    if ((st = bk_backend_solve(be, &p, &a.opts, &r)) != BK_OK)
        goto done;
    summary s;
    memset(&s, 0, sizeof s);
    s.algorithm = bk_algorithm_name(a.opts.algorithm);
    s.precision = a.opts.precision == BK_PREC_FP64 ? "fp64" : "fp32";
    s.backend = bk_backend_name(be);
    s.device = bk_backend_device(be);
    s.out = out;
    s.r = &r;
    s.weight = in_w.label;
    s.ha = in_a.label;
    s.hb = bref ? in_b.label : NULL;
    cli_quant_describe(&a.opts.quant, s.quant, sizeof s.quant);
    if ((st = write_output(out, &s, a.opts.quant.kind != BK_Q_UNIFORM)) != BK_OK)
        goto done;
    st = print_summary(&s, json);
done:
    bk_solve_result_free(&r);
    bk_backend_destroy(be);
    input_close(&in_w);
    input_close(&in_a);
    input_close(&in_b);
    return st;
}
