/* bakron quantize / bakron dump-activations */
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/pipeline.h"
#include "cli.h"
#include "util.h"

static const char *quantize_usage =
    "usage: bakron quantize MODEL_DIR (--calib TOKENS.safetensors | --activations DIR)\n"
    "         --hessian rtn|gptq|mlplocal-kfac|mlplocal-shampoo|fullylocal-kfac|fullylocal-shampoo|\n"
    "                   backprop-kfac|backprop-shampoo\n"
    "         --out OUT_DIR [options]\n"
    "\n"
    "Quantize every linear module of a Llama/Qwen checkpoint layer by layer.\n"
    "\n"
    "calibration:\n"
    "  --calib FILE          token ids: safetensors with I32/I64 input_ids [sequences, seqlen]\n"
    "  --activations DIR     pre-dumped activations (docs/activations.md)\n"
    "  --samples N           use the first N sequences (default: all)\n"
    "  --seqlen T            use the first T tokens of each sequence (default: all)\n"
    "  --no-sequential       full-precision inputs for every module (default: each module\n"
    "                        sees the already-quantized modules before it)\n"
    "  --batch B             sequences per micro-batch (default: automatic)\n"
    "quantizer:\n"
    "  --levels L            symmetric alphabet {-L..L}, one scale per row (default 3: 2.81 bits)\n"
    "  --bits B [--group G] [--asym]   uniform B-bit (2,3,4,8), per row or per G columns\n"
    "  --no-mse              scales from max|w| only (no MSE search)\n"
    "solver:\n"
    "  --hessian KIND        see above (default gptq)\n"
    "  --algorithm A         bakron|antidiag|naive|recursive for two-sided modules (default bakron);\n"
    "                        one-sided modules always use gptq (same codes, faster)\n"
    "  --damp D              relative damping of each factor (default 0.5)\n"
    "  --damp-b D            damp the output-side factors B with D instead (not the paper's setting)\n"
    "  --damp-b-attn D       damp the q/k/v output factors (fully-local kinds) with D instead\n"
    "  --precision P         fp32|fp64 (default fp32)\n"
    "  --hessian-fp64        accumulate Hessians in double\n"
    "backprop Hessians (--hessian backprop-*; docs/hessians.md):\n"
    "  --fisher F            model (default): labels sampled from the model's own predictive\n"
    "                        distribution at every position; empirical: the text's next token\n"
    "  --seed N              seed of the sampled labels (default 0; the output is reproducible)\n"
    "  --bwd-flow F          halving (default): recursive halving, O(l log l) layer passes;\n"
    "                        naive: a forward + backward pass per leaf, O(l^2), no boundaries\n"
    "  --leaf-size S         layers whose output gradients one pass delivers (default 1;\n"
    "                        larger: fewer passes, S layers' Hessians held at once)\n"
    "  --layers A:B          quantize layers A..B-1 only (others are copied)\n"
    "  --backend B           auto|cpu|cuda (default auto: cuda when a GPU is present). With\n"
    "                        cuda and --calib the whole job runs on the GPU (forward passes,\n"
    "                        Hessians, solves; docs/DEVICE.md)\n"
    "  --cpu-stages          with cuda: forward passes and Hessians on the CPU, solves on the\n"
    "                        GPU (the reference path)\n"
    "  --gpu-pipeline        insist on the GPU stages: an error when they cannot run\n"
    "  --gpu-math M          auto|tf32|bf16|fp32: arithmetic of the GPU stages' GEMMs (default\n"
    "                        auto: bf16 for a BF16 checkpoint, else tf32); fp32 matches the\n"
    "                        CPU to ~1e-6, tf32 and bf16 use tensor cores (bf16: projections\n"
    "                        and Hessians from BF16 inputs, the fastest)\n"
    "  --setting KEY=VALUE   backend setting (repeatable; README \"Settings\"): device=N,\n"
    "                        factor_fp64=0|1, mem_limit=BYTES, keep_down=0|1 (keep the\n"
    "                        down_proj inputs between stages when they fit, default 1),\n"
    "                        residual=auto|host (GPU stages: residual stream on the device\n"
    "                        when it fits, or always in pinned host memory)\n"
    "output:\n"
    "  --out DIR             output folder (built under DIR.tmp-PID, renamed when complete)\n"
    "  --export F            native (codes + scales, default) | dequantized | gptq\n"
    "  --max-shard-size B    bytes per safetensors shard (default 5e9)\n"
    "  --overwrite           replace a non-empty output folder\n"
    "  --config FILE         JSON preset (configs/); options given on the command line win\n"
    "  --json                one JSON object per event on stdout instead of progress on stderr\n";

enum {
    O_CALIB = 1000, O_ACTS, O_HESSIAN, O_ALG, O_LEVELS, O_BITS, O_GROUP, O_ASYM, O_NOMSE,
    O_DAMP, O_SAMPLES, O_SEQLEN, O_LAYERS, O_NOSEQ, O_CONFIG, O_OUT, O_EXPORT, O_JSON,
    O_PREC, O_HFP64, O_BATCH, O_BACKEND, O_SHARD, O_OVERWRITE, O_DAMPB, O_DAMPBA, O_HELP,
    O_GPUPIPE, O_CPUSTAGES, O_GPUMATH, O_FISHER, O_SEED, O_BWDFLOW, O_LEAF, O_SETTING
};

static const struct option quantize_opts[] = {
    {"calib", required_argument, NULL, O_CALIB},
    {"activations", required_argument, NULL, O_ACTS},
    {"hessian", required_argument, NULL, O_HESSIAN},
    {"algorithm", required_argument, NULL, O_ALG},
    {"levels", required_argument, NULL, O_LEVELS},
    {"bits", required_argument, NULL, O_BITS},
    {"group", required_argument, NULL, O_GROUP},
    {"asym", no_argument, NULL, O_ASYM},
    {"no-mse", no_argument, NULL, O_NOMSE},
    {"damp", required_argument, NULL, O_DAMP},
    {"damp-b", required_argument, NULL, O_DAMPB},
    {"damp-b-attn", required_argument, NULL, O_DAMPBA},
    {"samples", required_argument, NULL, O_SAMPLES},
    {"seqlen", required_argument, NULL, O_SEQLEN},
    {"layers", required_argument, NULL, O_LAYERS},
    {"no-sequential", no_argument, NULL, O_NOSEQ},
    {"config", required_argument, NULL, O_CONFIG},
    {"out", required_argument, NULL, O_OUT},
    {"export", required_argument, NULL, O_EXPORT},
    {"json", no_argument, NULL, O_JSON},
    {"precision", required_argument, NULL, O_PREC},
    {"hessian-fp64", no_argument, NULL, O_HFP64},
    {"batch", required_argument, NULL, O_BATCH},
    {"backend", required_argument, NULL, O_BACKEND},
    {"max-shard-size", required_argument, NULL, O_SHARD},
    {"overwrite", no_argument, NULL, O_OVERWRITE},
    {"gpu-pipeline", no_argument, NULL, O_GPUPIPE},
    {"cpu-stages", no_argument, NULL, O_CPUSTAGES},
    {"gpu-math", required_argument, NULL, O_GPUMATH},
    {"fisher", required_argument, NULL, O_FISHER},
    {"seed", required_argument, NULL, O_SEED},
    {"bwd-flow", required_argument, NULL, O_BWDFLOW},
    {"leaf-size", required_argument, NULL, O_LEAF},
    {"setting", required_argument, NULL, O_SETTING},
    {"help", no_argument, NULL, O_HELP},
    {NULL, 0, NULL, 0},
};

typedef struct qargs {
    bk_quantize_opts o;
    int json;
    int have_levels, have_bits;
    char *preset_strings[8];
    int n_preset_strings;
} qargs;

static bk_status set_layers(const char *s, bk_quantize_opts *o)
{
    const char *colon = strchr(s, ':');
    if (!colon)
        return cli_usage_error("--layers: expected A:B, got '%s'", s);
    char a[32] = "", b[32] = "";
    size_t la = (size_t)(colon - s);
    if (la >= sizeof a || strlen(colon + 1) >= sizeof b)
        return cli_usage_error("--layers: expected A:B, got '%s'", s);
    memcpy(a, s, la);
    strcpy(b, colon + 1);
    int va = 0, vb = 0;
    bk_status st;
    if (a[0] && (st = cli_parse_int("--layers", a, 0, 100000, &va)) != BK_OK)
        return st;
    if (b[0] && (st = cli_parse_int("--layers", b, 1, 100000, &vb)) != BK_OK)
        return st;
    if (b[0] && vb <= va)
        return cli_usage_error("--layers: empty range '%s'", s);
    o->layer_begin = va;
    o->layer_end = b[0] ? vb : 0;
    return BK_OK;
}

/* Apply one option (from the command line or a preset). */
static bk_status apply(qargs *q, int opt, const char *arg)
{
    bk_quantize_opts *o = &q->o;
    bk_status st = BK_OK;
    int iv;
    int64_t lv;
    double dv;
    switch (opt) {
    case O_CALIB: o->calib_path = arg; break;
    case O_ACTS: o->activations_dir = arg; break;
    case O_HESSIAN:
        if (bk_hessian_from_name(arg, &o->hessian) != BK_OK)
            return cli_usage_error("--hessian: unknown '%s' (rtn, gptq, mlplocal-kfac, mlplocal-shampoo, fullylocal-kfac, fullylocal-shampoo, backprop-kfac, backprop-shampoo)", arg);
        break;
    case O_ALG:
        if (bk_algorithm_from_name(arg, &o->solve.algorithm) != BK_OK)
            return cli_usage_error("--algorithm: unknown '%s' (bakron, recursive, antidiag, naive, gptq, rtn)", arg);
        break;
    case O_LEVELS:
        if ((st = cli_parse_int("--levels", arg, 1, 127, &iv)) != BK_OK)
            return st;
        o->solve.quant.kind = BK_Q_LEVELS;
        o->solve.quant.levels = iv;
        q->have_levels = 1;
        break;
    case O_BITS:
        if ((st = cli_parse_int("--bits", arg, 2, 8, &iv)) != BK_OK)
            return st;
        if (iv != 2 && iv != 3 && iv != 4 && iv != 8)
            return cli_usage_error("--bits: expected 2, 3, 4 or 8, got %d", iv);
        o->solve.quant.kind = BK_Q_UNIFORM;
        o->solve.quant.bits = iv;
        q->have_bits = 1;
        break;
    case O_GROUP:
        if ((st = cli_parse_i64("--group", arg, 0, 1 << 30, &lv)) != BK_OK)
            return st;
        o->solve.quant.group = lv;
        break;
    case O_ASYM: o->solve.quant.asym = 1; break;
    case O_NOMSE: o->solve.quant.mse = 0; break;
    case O_DAMP:
        if ((st = cli_parse_double("--damp", arg, 0.0, 1e6, &dv)) != BK_OK)
            return st;
        o->solve.damp = dv;
        break;
    case O_DAMPBA:
        if ((st = cli_parse_double("--damp-b-attn", arg, 0.0, 1e6, &dv)) != BK_OK)
            return st;
        o->damp_b_attn = dv;
        break;
    case O_DAMPB:
        if ((st = cli_parse_double("--damp-b", arg, 0.0, 1e6, &dv)) != BK_OK)
            return st;
        o->solve.separate_damp_b = 1;
        o->solve.damp_b = dv;
        break;
    case O_SAMPLES:
        if ((st = cli_parse_i64("--samples", arg, 1, (int64_t)1 << 40, &lv)) != BK_OK)
            return st;
        o->samples = lv;
        break;
    case O_SEQLEN:
        if ((st = cli_parse_i64("--seqlen", arg, 2, (int64_t)1 << 30, &lv)) != BK_OK)
            return st;
        o->seqlen = lv;
        break;
    case O_LAYERS: return set_layers(arg, o);
    case O_NOSEQ: o->sequential = 0; break;
    case O_OUT: o->out_dir = arg; break;
    case O_EXPORT:
        if (bk_export_from_name(arg, &o->export_format) != BK_OK)
            return cli_usage_error("--export: unknown '%s' (native, dequantized, gptq)", arg);
        break;
    case O_JSON: q->json = 1; break;
    case O_PREC:
        if (!strcmp(arg, "fp32"))
            o->solve.precision = BK_PREC_FP32;
        else if (!strcmp(arg, "fp64"))
            o->solve.precision = BK_PREC_FP64;
        else
            return cli_usage_error("--precision: expected fp32 or fp64, got '%s'", arg);
        break;
    case O_HFP64: o->hessian_fp64 = 1; break;
    case O_BATCH:
        if ((st = cli_parse_i64("--batch", arg, 1, 1 << 20, &lv)) != BK_OK)
            return st;
        o->batch = lv;
        break;
    case O_BACKEND:
        if (bk_backend_kind_from_name(arg, &o->backend) != BK_OK)
            return cli_usage_error("--backend: expected auto, cpu or cuda, got '%s'", arg);
        break;
    case O_SHARD:
        if ((st = cli_parse_double("--max-shard-size", arg, 1e3, 1e15, &dv)) != BK_OK)
            return st;
        o->max_shard_bytes = (uint64_t)dv;
        break;
    case O_OVERWRITE: o->overwrite = 1; break;
    case O_SETTING: return cli_setting(&o->backend_params, arg);
    case O_GPUPIPE: o->gpu_pipeline = 1; break;
    case O_CPUSTAGES: o->cpu_stages = 1; break;
    case O_GPUMATH:
        if (bk_gemm_math_from_name(arg, &o->gemm_math) != BK_OK)
            return cli_usage_error("--gpu-math: expected auto, tf32, bf16 or fp32, got '%s'", arg);
        break;
    case O_FISHER:
        if (bk_fisher_from_name(arg, &o->fisher) != BK_OK)
            return cli_usage_error("--fisher: expected model or empirical, got '%s'", arg);
        break;
    case O_SEED:
        if ((st = cli_parse_i64("--seed", arg, 0, INT64_MAX, &lv)) != BK_OK)
            return st;
        o->seed = (uint64_t)lv;
        break;
    case O_BWDFLOW:
        if (bk_bwd_flow_from_name(arg, &o->bwd_flow) != BK_OK)
            return cli_usage_error("--bwd-flow: expected halving or naive, got '%s'", arg);
        break;
    case O_LEAF:
        if ((st = cli_parse_int("--leaf-size", arg, 1, 100000, &iv)) != BK_OK)
            return st;
        o->leaf_size = iv;
        break;
    default: return cli_usage_error("unknown option");
    }
    return BK_OK;
}

/* A preset: {"hessian": "...", "levels": 3, "damp": 0.5, ...} with the long
 * option names as keys (without "--"); booleans for flags. */
static bk_status apply_preset(qargs *q, const char *path)
{
    char *text = NULL;
    bk_status st = bk_read_file(path, 1u << 20, &text, NULL);
    if (st != BK_OK)
        return st;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return bk_error(BK_ERR_CONFIG, "%s: not a JSON object", path);
    }
    cJSON *it;
    cJSON_ArrayForEach(it, j)
    {
        const char *key = it->string;
        if (!strcmp(key, "description") || key[0] == '_')
            continue;
        const struct option *opt = NULL;
        for (const struct option *p = quantize_opts; p->name; p++)
            if (!strcmp(p->name, key))
                opt = p;
        if (!opt || opt->val == O_CONFIG || opt->val == O_HELP || opt->val == O_OUT ||
            opt->val == O_JSON) {
            st = bk_error(BK_ERR_CONFIG, "%s: unknown or not allowed preset key '%s'", path, key);
            break;
        }
        if (opt->has_arg == no_argument) {
            if (!cJSON_IsBool(it)) {
                st = bk_error(BK_ERR_CONFIG, "%s: '%s' must be true or false", path, key);
                break;
            }
            if (cJSON_IsTrue(it))
                st = apply(q, opt->val, NULL);
            else if (opt->val == O_NOMSE || opt->val == O_NOSEQ || opt->val == O_ASYM ||
                     opt->val == O_HFP64 || opt->val == O_OVERWRITE || opt->val == O_GPUPIPE ||
                     opt->val == O_CPUSTAGES)
                st = BK_OK; /* false = the default */
        } else {
            char buf[64];
            const char *arg;
            if (cJSON_IsString(it)) {
                arg = it->valuestring;
            } else if (cJSON_IsNumber(it)) {
                snprintf(buf, sizeof buf, "%.17g", it->valuedouble);
                arg = buf;
            } else {
                st = bk_error(BK_ERR_CONFIG, "%s: '%s' must be a string or a number", path, key);
                break;
            }
            if (q->n_preset_strings >= 8) {
                st = bk_error(BK_ERR_CONFIG, "%s: too many string options", path);
                break;
            }
            char *dup = strdup(arg);
            if (!dup) {
                st = bk_error(BK_ERR_NOMEM, "out of memory");
                break;
            }
            q->preset_strings[q->n_preset_strings++] = dup;
            st = apply(q, opt->val, dup);
        }
        if (st != BK_OK) {
            if (st == BK_ERR_USAGE)
                st = bk_error_prefix(BK_ERR_CONFIG, path);
            break;
        }
    }
    cJSON_Delete(j);
    return st;
}

/* ------------------------------------------------------------ progress */

static const char *ev_name(bk_event_kind k)
{
    switch (k) {
    case BK_EV_START: return "start";
    case BK_EV_LAYER_BEGIN: return "layer_begin";
    case BK_EV_MODULE_DONE: return "module";
    case BK_EV_LAYER_DONE: return "layer_done";
    case BK_EV_WRITE: return "write";
    case BK_EV_DONE: return "done";
    case BK_EV_BACKWARD: return "backward";
    case BK_EV_NOTE: return "note";
    }
    return "?";
}

static void fmt_time(double s, char *buf, size_t cap)
{
    if (s < 60)
        snprintf(buf, cap, "%.1fs", s);
    else if (s < 3600)
        snprintf(buf, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
}

static void on_event(void *user, const bk_event *ev)
{
    int json = *(int *)user;
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "event", ev_name(ev->kind));
        cJSON_AddNumberToObject(j, "layer", ev->layer);
        cJSON_AddNumberToObject(j, "layers", ev->n_layers);
        if (ev->module)
            cJSON_AddStringToObject(j, "module", ev->module);
        if (ev->kind == BK_EV_MODULE_DONE) {
            cJSON_AddNumberToObject(j, "rows", (double)ev->rows);
            cJSON_AddNumberToObject(j, "cols", (double)ev->cols);
            if (isfinite(ev->loss))
                cJSON_AddNumberToObject(j, "loss", ev->loss);
            if (isfinite(ev->loss_gptq))
                cJSON_AddNumberToObject(j, "loss_gptq", ev->loss_gptq);
            cJSON_AddNumberToObject(j, "damp_a", ev->damp_a);
            cJSON_AddNumberToObject(j, "damp_b", ev->damp_b);
        }
        cJSON_AddNumberToObject(j, "elapsed_s", ev->elapsed_s);
        cJSON_AddNumberToObject(j, "eta_s", ev->eta_s);
        cJSON *t = cJSON_AddObjectToObject(j, "stage_s");
        cJSON_AddNumberToObject(t, "forward", ev->t_forward);
        cJSON_AddNumberToObject(t, "hessian", ev->t_hessian);
        cJSON_AddNumberToObject(t, "factor", ev->t_factor);
        cJSON_AddNumberToObject(t, "solve", ev->t_solve);
        cJSON_AddNumberToObject(t, "io", ev->t_io);
        if (ev->message)
            cJSON_AddStringToObject(j, "message", ev->message);
        char *s = cJSON_PrintUnformatted(j);
        if (s) {
            fputs(s, stdout);
            fputc('\n', stdout);
            fflush(stdout);
            free(s);
        }
        cJSON_Delete(j);
        return;
    }
    char el[32], eta[32];
    fmt_time(ev->elapsed_s, el, sizeof el);
    fmt_time(ev->eta_s, eta, sizeof eta);
    switch (ev->kind) {
    case BK_EV_START: fprintf(stderr, "bakron: %s\n", ev->message); break;
    case BK_EV_LAYER_BEGIN: break;
    case BK_EV_MODULE_DONE:
        fprintf(stderr, "  layer %d/%d %-18s [%lld x %lld]  loss %.4g  (gptq loss %.4g)  %s\n",
                ev->layer + 1, ev->n_layers, ev->module, (long long)ev->rows, (long long)ev->cols,
                ev->loss, ev->loss_gptq, el);
        break;
    case BK_EV_LAYER_DONE:
        if (ev->module == NULL && ev->message)
            fprintf(stderr, "  layer %d/%d %s  elapsed %s  ETA %s\n", ev->layer + 1, ev->n_layers,
                    ev->message, el, eta);
        else
            fprintf(stderr,
                    "layer %d/%d done  elapsed %s  ETA %s  (forward %.1fs, hessian %.1fs, "
                    "cholesky %.1fs, solve %.1fs, io %.1fs)\n",
                    ev->layer + 1, ev->n_layers, el, eta, ev->t_forward, ev->t_hessian,
                    ev->t_factor, ev->t_solve, ev->t_io);
        break;
    case BK_EV_WRITE:
    case BK_EV_NOTE: fprintf(stderr, "bakron: %s\n", ev->message); break;
    case BK_EV_BACKWARD: fprintf(stderr, "  %s  elapsed %s\n", ev->message, el); break;
    case BK_EV_DONE:
        fprintf(stderr, "bakron: wrote %s in %s\n", ev->message ? ev->message : "", el);
        break;
    }
}

static void on_signal(int sig)
{
    (void)sig;
    bk_request_stop();
}

static void install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

bk_status bk_cmd_quantize(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        fputs(quantize_usage, stdout);
        return BK_OK;
    }
    qargs q;
    memset(&q, 0, sizeof q);
    bk_quantize_opts_default(&q.o);
    bk_status st = BK_OK;
    const char *preset = NULL;
    int c;
    /* pass 1: the preset */
    optind = 0; /* GNU getopt: full re-initialization */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "-", quantize_opts, NULL)) != -1)
        if (c == O_CONFIG)
            preset = optarg;
    if (preset && (st = apply_preset(&q, preset)) != BK_OK)
        goto done;
    q.o.config_path = preset;
    q.have_levels = q.have_bits = 0; /* the command line may switch the preset's alphabet */
    /* pass 2: the command line */
    optind = 0;
    opterr = 0;
    const char *model = NULL;
    while ((c = getopt_long(argc, argv, "-", quantize_opts, NULL)) != -1) {
        if (c == 1) { /* a non-option argument, in order */
            if (model) {
                st = cli_usage_error("unexpected argument '%s'", optarg);
                goto done;
            }
            model = optarg;
            continue;
        }
        if (c == '?' || c == ':') {
            st = cli_usage_error("bad option '%s'", argv[optind - 1]);
            goto done;
        }
        if (c == O_CONFIG)
            continue;
        if ((st = apply(&q, c, optarg)) != BK_OK)
            goto done;
    }
    if (!model) {
        st = cli_usage_error("MODEL_DIR is required");
        goto done;
    }
    if (!q.o.out_dir) {
        st = cli_usage_error("--out OUT_DIR is required");
        goto done;
    }
    if (q.have_levels && q.have_bits) {
        st = cli_usage_error("--levels and --bits are exclusive");
        goto done;
    }
    if ((q.o.solve.quant.group || q.o.solve.quant.asym) && q.o.solve.quant.kind != BK_Q_UNIFORM) {
        st = cli_usage_error("--group and --asym need --bits");
        goto done;
    }
    q.o.model_dir = model;
    q.o.on_event = on_event;
    q.o.user = &q.json;
    install_signals();
    st = bk_quantize(&q.o);
done:
    for (int i = 0; i < q.n_preset_strings; i++)
        free(q.preset_strings[i]);
    return st;
}

/* ------------------------------------------------------------ dump-activations */

static const char *dump_usage =
    "usage: bakron dump-activations MODEL_DIR --calib TOKENS.safetensors --out DIR [options]\n"
    "\n"
    "Run the full-precision model over calibration tokens and write, per layer, the inputs of\n"
    "every linear module (docs/activations.md), for `bakron quantize --activations DIR`.\n"
    "\n"
    "  --samples N       use the first N sequences\n"
    "  --seqlen T        use the first T tokens of each sequence\n"
    "  --dtype D         F32 (default), BF16 or F16\n"
    "  --zstd            compress each layer file (layer.NNNN.safetensors.zst)\n"
    "  --zstd-level L    zstd level (default 3)\n"
    "  --batch B         sequences per micro-batch\n"
    "  --overwrite       replace a non-empty output folder\n"
    "  --backend B       auto (default: the GPU when present), cpu or cuda\n"
    "  --gpu-math M      fp32 (default: the CPU's values to ~1e-6), tf32, bf16 or auto\n"
    "  --setting K=V     backend setting (repeatable; README \"Settings\"): device=N,\n"
    "                    mem_limit=BYTES\n"
    "  --json            JSON events on stdout\n";

bk_status bk_cmd_dump(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        fputs(dump_usage, stdout);
        return BK_OK;
    }
    static const struct option opts[] = {
        {"calib", required_argument, NULL, 'c'},   {"out", required_argument, NULL, 'o'},
        {"samples", required_argument, NULL, 's'}, {"seqlen", required_argument, NULL, 't'},
        {"dtype", required_argument, NULL, 'd'},   {"zstd", no_argument, NULL, 'z'},
        {"zstd-level", required_argument, NULL, 'l'}, {"batch", required_argument, NULL, 'b'},
        {"overwrite", no_argument, NULL, 'w'},     {"json", no_argument, NULL, 'j'},
        {"backend", required_argument, NULL, 'B'}, {"gpu-math", required_argument, NULL, 'M'},
        {"setting", required_argument, NULL, 'S'},
        {NULL, 0, NULL, 0},
    };
    bk_dump_opts o;
    bk_dump_opts_default(&o);
    int json = 0, c;
    bk_status st;
    const char *model = NULL;
    optind = 0;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "-", opts, NULL)) != -1) {
        if (c == 1) {
            if (model)
                return cli_usage_error("unexpected argument '%s'", optarg);
            model = optarg;
            continue;
        }
        switch (c) {
        case 'c': o.calib_path = optarg; break;
        case 'o': o.out_dir = optarg; break;
        case 's':
            if ((st = cli_parse_i64("--samples", optarg, 1, (int64_t)1 << 40, &o.samples)) != BK_OK)
                return st;
            break;
        case 't':
            if ((st = cli_parse_i64("--seqlen", optarg, 2, (int64_t)1 << 30, &o.seqlen)) != BK_OK)
                return st;
            break;
        case 'd':
            if (bk_dtype_from_name(optarg, &o.dtype) != BK_OK ||
                (o.dtype != BK_DT_F32 && o.dtype != BK_DT_BF16 && o.dtype != BK_DT_F16))
                return cli_usage_error("--dtype: expected F32, BF16 or F16, got '%s'", optarg);
            break;
        case 'z': o.zstd = 1; break;
        case 'l':
            if ((st = cli_parse_int("--zstd-level", optarg, 1, 19, &o.zstd_level)) != BK_OK)
                return st;
            break;
        case 'b':
            if ((st = cli_parse_i64("--batch", optarg, 1, 1 << 20, &o.batch)) != BK_OK)
                return st;
            break;
        case 'w': o.overwrite = 1; break;
        case 'j': json = 1; break;
        case 'B':
            if (bk_backend_kind_from_name(optarg, &o.backend) != BK_OK)
                return cli_usage_error("--backend: expected auto, cpu or cuda, got '%s'", optarg);
            break;
        case 'M':
            if (bk_gemm_math_from_name(optarg, &o.gemm_math) != BK_OK)
                return cli_usage_error("--gpu-math: expected fp32, tf32, bf16 or auto, got '%s'", optarg);
            break;
        case 'S':
            if ((st = cli_setting(&o.backend_params, optarg)) != BK_OK)
                return st;
            break;
        default: return cli_usage_error("bad option '%s'", argv[optind - 1]);
        }
    }
    if (!model)
        return cli_usage_error("MODEL_DIR is required");
    if (!o.calib_path)
        return cli_usage_error("--calib TOKENS.safetensors is required");
    if (!o.out_dir)
        return cli_usage_error("--out DIR is required");
    o.model_dir = model;
    o.on_event = on_event;
    o.user = &json;
    install_signals();
    return bk_dump_activations(&o);
}
