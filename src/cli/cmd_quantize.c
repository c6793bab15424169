/* bakron quantize / bakron dump-activations */
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bakron/pipeline.h"
#include "bk_config.h"
#include "cli.h"
#include "util.h"

static const char *quantize_usage =
    "usage: bakron quantize MODEL (--calib-text TEXT | --calib TOKENS.safetensors |\n"
    "                              --activations DIR)\n"
    "         --hessian rtn|gptq|mlplocal-kfac|mlplocal-shampoo|fullylocal-kfac|fullylocal-shampoo|\n"
    "                   backprop-kfac|backprop-shampoo\n"
    "         --out OUT_DIR [options]\n"
    "\n"
    "Quantize every linear module of a Llama/Qwen checkpoint layer by layer. MODEL is the\n"
    "model folder, or its model.safetensors, model.safetensors.index.json or config.json.\n"
    "Every option, file and the output folder are checked before the work; each mistake is\n"
    "reported on its own line (exit 1 usage, 2 bad input, 3 runtime).\n"
    "\n"
    "calibration:\n"
    "  --calib-text TEXT     plain text, a file or a folder of files, tokenized with the model's\n"
    "                        tokenizer.json into windows of --seqlen tokens (default 2048 or the\n"
    "                        model's context), BOS first, documents separated by a blank line\n"
    "                        (docs/tokenizer.md)\n"
    "  --calib FILE          token ids: safetensors with I32/I64 input_ids [sequences, seqlen]\n"
    "  --activations DIR     pre-dumped activations (docs/activations.md)\n"
    "  --samples N           use the first N sequences / text windows (default: all)\n"
    "  --seqlen T            use the first T tokens of each sequence; with --calib-text the\n"
    "                        window length (default: all / 2048)\n"
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
    "  --leaf-size S         layers whose output gradients one pass delivers (default: on\n"
    "                        the GPU the largest of 8/4/2 whose Hessians fit beside the rest,\n"
    "                        else 1; larger: fewer passes, S layers' Hessians held at once)\n"
    "  --bwd-boundaries N    boundary matrices [tokens x hidden] the halving flow may hold\n"
    "                        at once, 0..4096 (default auto: as many as the host's available\n"
    "                        memory allows, a cgroup limit included; more: wider splits,\n"
    "                        fewer passes, the same result; 0: recursive halving's fewest;\n"
    "                        MPI ranks: 0; not with --bwd-flow naive)\n"
    "  --bwd-precision P     auto (default) | fp32 | fp64 | tf32 | bf16: arithmetic of the\n"
    "                        backward pass on the GPU (tf32/bf16: its GEMMs on tensor cores,\n"
    "                        several times faster; bf16 also halves the boundary matrices;\n"
    "                        auto: bf16 when the forward's GEMMs are bf16 (--gpu-math auto\n"
    "                        with a BF16 checkpoint, or bf16), else fp32; the CPU's is fp64)\n"
    "  --layers A:B          quantize layers A..B-1 only (others are copied); layers are\n"
    "                        numbered from 0 as in model.layers.N, in progress and errors too\n"
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
    "  --resume              continue a killed run of the same --out (same arguments, model\n"
    "                        and calibration) from its finished layers; without a killed\n"
    "                        run: start from the first layer\n"
    "  --config NAME|FILE    JSON preset: an installed one by name (paper-2.81bit-gptq, ...)\n"
    "                        or a file; the command line overrides it field by field\n"
    "                        (--levels replaces the preset's bits/group)\n"
    "  --dry-run             check everything, print the plan (modules, shapes, Hessians,\n"
    "                        estimated memory and output size) and exit without computing\n"
    "  --json                one JSON object per event on stdout instead of progress on stderr\n"
    "                        (errors and interrupts too: events error, interrupted)\n"
    "  --progress-interval S within a backward pass, a progress line (or JSON event) at most\n"
    "                        every S seconds (default 30; 0: after every micro-batch)\n"
    "  --version             print the version and exit\n"
    "MPI ranks (mpirun -np N bakron quantize ..., srun --mpi=pmix; docs/DISTRIBUTED.md):\n"
    "  --dist-reduce R       ordered (default): the Hessian sums pass from rank to rank in the\n"
    "                        single process's order (bit-identical output); sum: every rank sums\n"
    "                        its sequences at once, partial sums added in rank order (parallel,\n"
    "                        differs from one process by rounding; on GPUs NCCL's order)\n"
    "                        With --backend cuda each rank uses its own GPU (local rank mod GPUs;\n"
    "                        NCCL, or host copies over MPI without NCCL or on a shared GPU)\n"
    "  --dist-timeout S      longest wait for the other ranks, seconds (default 1800)\n";

enum {
    O_CALIB = 1000, O_ACTS, O_HESSIAN, O_ALG, O_LEVELS, O_BITS, O_GROUP, O_ASYM, O_NOMSE,
    O_DAMP, O_SAMPLES, O_SEQLEN, O_LAYERS, O_NOSEQ, O_CONFIG, O_OUT, O_EXPORT, O_JSON,
    O_PREC, O_HFP64, O_BATCH, O_BACKEND, O_SHARD, O_OVERWRITE, O_DAMPB, O_DAMPBA, O_HELP,
    O_GPUPIPE, O_CPUSTAGES, O_GPUMATH, O_FISHER, O_SEED, O_BWDFLOW, O_LEAF, O_BOUNDS, O_DRYRUN, O_RESUME,
    O_BWDPREC, O_CALIBTEXT, O_DREDUCE, O_DTIMEOUT, O_SETTING, O_PROGIV
};

static const struct option quantize_opts[] = {
    {"calib", required_argument, NULL, O_CALIB},
    {"calib-text", required_argument, NULL, O_CALIBTEXT},
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
    {"resume", no_argument, NULL, O_RESUME},
    {"gpu-pipeline", no_argument, NULL, O_GPUPIPE},
    {"cpu-stages", no_argument, NULL, O_CPUSTAGES},
    {"gpu-math", required_argument, NULL, O_GPUMATH},
    {"fisher", required_argument, NULL, O_FISHER},
    {"seed", required_argument, NULL, O_SEED},
    {"bwd-flow", required_argument, NULL, O_BWDFLOW},
    {"leaf-size", required_argument, NULL, O_LEAF},
    {"bwd-boundaries", required_argument, NULL, O_BOUNDS},
    {"bwd-precision", required_argument, NULL, O_BWDPREC},
    {"dry-run", no_argument, NULL, O_DRYRUN},
    {"dist-reduce", required_argument, NULL, O_DREDUCE},
    {"dist-timeout", required_argument, NULL, O_DTIMEOUT},
    {"setting", required_argument, NULL, O_SETTING},
    {"progress-interval", required_argument, NULL, O_PROGIV},
    {"help", no_argument, NULL, O_HELP},
    {NULL, 0, NULL, 0},
};

/* The quantizer fields as one source gave them (a preset, the command line):
 * combined field by field by resolve_quant. */
typedef struct qsrc {
    int levels, bits, asym;
    int64_t group;
    int have_levels, have_bits, have_group, have_asym;
} qsrc;

#define MAX_PRESET_STRINGS 64

typedef struct qargs {
    bk_quantize_opts o;
    int json, dry_run;
    double dist_timeout;
    double progress_interval; /* seconds between lines within a backward pass */
    qsrc src[2];     /* 0: the preset, 1: the command line */
    int from;        /* the source apply() is reading */
    char *preset_strings[MAX_PRESET_STRINGS];
    int n_preset_strings;
    char preset_path[4096];
    char model_buf[4096];
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
    case O_CALIBTEXT: o->calib_text = arg; break;
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
        q->src[q->from].levels = iv;
        q->src[q->from].have_levels = 1;
        break;
    case O_BITS:
        if ((st = cli_parse_int("--bits", arg, 2, 8, &iv)) != BK_OK)
            return st;
        if (iv != 2 && iv != 3 && iv != 4 && iv != 8)
            return cli_usage_error("--bits: expected 2, 3, 4 or 8, got %d", iv);
        q->src[q->from].bits = iv;
        q->src[q->from].have_bits = 1;
        break;
    case O_GROUP:
        if ((st = cli_parse_i64("--group", arg, 0, 1 << 30, &lv)) != BK_OK)
            return st;
        q->src[q->from].group = lv;
        q->src[q->from].have_group = 1;
        break;
    case O_ASYM:
        q->src[q->from].asym = arg ? 0 : 1; /* arg: "false" from a preset */
        q->src[q->from].have_asym = 1;
        break;
    case O_DRYRUN: q->dry_run = 1; break;
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
    case O_PROGIV:
        if ((st = cli_parse_double("--progress-interval", arg, 0.0, 1e7, &dv)) != BK_OK)
            return st;
        q->progress_interval = dv;
        break;
    case O_PREC:
        if ((st = cli_parse_choice("--precision", arg, cli_precision_names, 2, &iv)) != BK_OK)
            return st;
        o->solve.precision = (bk_precision)iv;
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
    case O_RESUME: o->resume = 1; break;
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
    case O_BOUNDS:
        if (!strcmp(arg, "auto")) {
            o->bwd_boundaries = -1;
            break;
        }
        if (cli_parse_int("--bwd-boundaries", arg, 0, 4096, &iv) != BK_OK) {
            bk_clear_error();
            return cli_usage_error("--bwd-boundaries: expected auto or an integer in [0, 4096], "
                                   "got '%s'", arg);
        }
        o->bwd_boundaries = iv;
        break;
    case O_DREDUCE: { /* (bk_dist_reduce's order) */
        static const char *const reduce[] = {"ordered", "sum"};
        if ((st = cli_parse_choice("--dist-reduce", arg, reduce, 2, &iv)) != BK_OK)
            return st;
        o->dist_reduce = (bk_dist_reduce)iv;
        break;
    }
    case O_DTIMEOUT:
        if ((st = cli_parse_double("--dist-timeout", arg, 0.1, 1e7, &dv)) != BK_OK)
            return st;
        q->dist_timeout = dv;
        break;
    case O_BWDPREC: { /* (bk_bwd_precision's order) */
        static const char *const bwd[] = {"fp32", "fp64", "tf32", "bf16", "auto"};
        if ((st = cli_parse_choice("--bwd-precision", arg, bwd, 5, &iv)) != BK_OK)
            return st;
        o->bwd_precision = (bk_bwd_precision)iv;
        break;
    }
    default: return cli_usage_error("unknown option");
    }
    return BK_OK;
}

/* line:column (1-based) of byte offset `off` in text */
static void line_col(const char *text, size_t off, int *line, int *col)
{
    int l = 1, c = 1;
    for (size_t i = 0; i < off && text[i]; i++) {
        if (text[i] == '\n') {
            l++;
            c = 1;
        } else if (((unsigned char)text[i] & 0xC0) != 0x80) {
            c++;
        }
    }
    *line = l;
    *col = c;
}

/* Where key "name" is written in the preset (its first occurrence as a key). */
static size_t key_offset(const char *text, const char *name)
{
    size_t ln = strlen(name);
    for (const char *p = text; (p = strchr(p, '"')) != NULL; p++) {
        if (!strncmp(p + 1, name, ln) && p[1 + ln] == '"') {
            const char *r = p + 2 + ln;
            while (*r == ' ' || *r == '\t' || *r == '\n' || *r == '\r')
                r++;
            if (*r == ':')
                return (size_t)(p - text);
        }
    }
    return 0;
}

/* A preset: {"hessian": "...", "levels": 3, "damp": 0.5, ...} with the long
 * option names as keys (without "--"); booleans for flags. Errors name the
 * file and the line:column of the offending key. */
static bk_status apply_preset(qargs *q, const char *path)
{
    char *text = NULL;
    size_t len = 0;
    bk_status st = bk_read_file(path, 1u << 20, &text, &len);
    if (st != BK_OK)
        return st;
    int line, col;
    const char *nul = memchr(text, '\0', len);
    if (nul) {
        line_col(text, (size_t)(nul - text), &line, &col);
        st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: a NUL byte (not JSON text)", path, line, col);
        free(text);
        return st;
    }
    /* a \u0000 escape would cut a key short; raw control characters are not JSON */
    if ((st = bk_json_check_text(text, len, path, BK_ERR_CONFIG)) != BK_OK) {
        free(text);
        return st;
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithOpts(text, &end, 1);
    if (!j) {
        const char *at = cJSON_GetErrorPtr();
        size_t off = (at && at >= text && at <= text + len) ? (size_t)(at - text) : len;
        line_col(text, off, &line, &col);
        st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: invalid JSON%s", path, line, col,
                      off >= len ? " (the file ends early)" : "");
        free(text);
        return st;
    }
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        free(text);
        return bk_error(BK_ERR_CONFIG, "%s:1:1: a preset is one JSON object {\"option\": value}",
                        path);
    }
    q->from = 0;
    cJSON *it;
    cJSON_ArrayForEach(it, j)
    {
        const char *key = it->string;
        if (!strcmp(key, "description") || key[0] == '_')
            continue;
        line_col(text, key_offset(text, key), &line, &col);
        const struct option *opt = NULL;
        for (const struct option *p = quantize_opts; p->name; p++)
            if (!strcmp(p->name, key))
                opt = p;
        if (!opt || opt->val == O_CONFIG || opt->val == O_HELP || opt->val == O_OUT ||
            opt->val == O_JSON || opt->val == O_DRYRUN || opt->val == O_RESUME ||
            opt->val == O_PROGIV) {
            st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: unknown or not allowed preset key '%s'", path,
                          line, col, key);
            break;
        }
        if (opt->has_arg == no_argument) {
            if (!cJSON_IsBool(it)) {
                st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: '%s' must be true or false", path, line,
                              col, key);
                break;
            }
            if (cJSON_IsTrue(it))
                st = apply(q, opt->val, NULL);
            else if (opt->val == O_ASYM)
                st = apply(q, opt->val, "false");
            else if (opt->val == O_NOMSE || opt->val == O_NOSEQ || opt->val == O_HFP64 ||
                     opt->val == O_OVERWRITE || opt->val == O_GPUPIPE || opt->val == O_CPUSTAGES)
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
                st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: '%s' must be a string or a number", path,
                              line, col, key);
                break;
            }
            if (q->n_preset_strings >= MAX_PRESET_STRINGS) {
                st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: too many options", path, line, col);
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
            if (st == BK_ERR_USAGE) {
                char pre[4200];
                snprintf(pre, sizeof pre, "%s:%d:%d", path, line, col);
                st = bk_error_prefix(BK_ERR_CONFIG, pre);
            }
            break;
        }
    }
    if (st == BK_OK && q->src[0].have_levels && q->src[0].have_bits) {
        line_col(text, key_offset(text, "bits"), &line, &col);
        st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: 'levels' and 'bits' are exclusive", path, line,
                      col);
    }
    if (st == BK_OK && q->src[0].have_levels && (q->src[0].have_group || q->src[0].asym)) {
        line_col(text, key_offset(text, q->src[0].have_group ? "group" : "asym"), &line, &col);
        st = bk_error(BK_ERR_CONFIG, "%s:%d:%d: 'group' and 'asym' need 'bits', not 'levels'",
                      path, line, col);
    }
    cJSON_Delete(j);
    free(text);
    q->from = 1;
    return st;
}

/* The quantizer, field by field: the command line wins over the preset.
 * --levels on the command line replaces the preset's bits/group/asym; --bits
 * replaces its levels and keeps its group/asym unless given too. */
static bk_status resolve_quant(qargs *q, const char *preset)
{
    const qsrc *pre = &q->src[0], *cmd = &q->src[1];
    bk_quant_spec *qs = &q->o.solve.quant;
    if (cmd->have_levels && cmd->have_bits)
        return cli_usage_error("--levels and --bits are exclusive");
    int uniform;
    if (cmd->have_levels)
        uniform = 0;
    else if (cmd->have_bits)
        uniform = 1;
    else
        uniform = pre->have_bits;
    if (!uniform) {
        if (cmd->have_group || (cmd->have_asym && cmd->asym)) {
            if (!cmd->have_levels && pre->have_levels && preset)
                return cli_usage_error("--group and --asym need --bits (the preset %s uses "
                                       "levels %d; add --bits B)",
                                       preset, pre->levels);
            return cli_usage_error("--group and --asym need --bits (--levels chooses the "
                                   "symmetric alphabet {-L..L}, one scale per row)");
        }
        qs->kind = BK_Q_LEVELS;
        qs->levels = cmd->have_levels ? cmd->levels : pre->have_levels ? pre->levels : qs->levels;
        qs->group = 0;
        qs->asym = 0;
        return BK_OK;
    }
    qs->kind = BK_Q_UNIFORM;
    qs->bits = cmd->have_bits ? cmd->bits : pre->bits;
    qs->group = cmd->have_group ? cmd->group : pre->have_bits ? pre->group : 0;
    qs->asym = cmd->have_asym ? cmd->asym : pre->have_bits ? pre->asym : 0;
    return BK_OK;
}

bk_status cli_preset_check(const char *path, bk_quantize_opts *out)
{
    qargs q;
    memset(&q, 0, sizeof q);
    bk_quantize_opts_default(&q.o);
    bk_status st = apply_preset(&q, path);
    if (st == BK_OK)
        st = resolve_quant(&q, path);
    if (out)
        *out = q.o; /* its strings are freed below: only the scalar settings stay valid */
    for (int i = 0; i < q.n_preset_strings; i++)
        free(q.preset_strings[i]);
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
    case BK_EV_BACKWARD_PROGRESS: return "backward_progress";
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

/* Progress of a quantize run as the CLI reports it: layers numbered from 0
 * as in the checkpoint's tensor names (model.layers.N) and in --layers A:B,
 * with "(k/n)" counting the selected layers; the ETA from the share of the
 * selected modules' weights done so far, or, for the backprop kinds, the
 * job's own (eta_s: the flow's passes and the leaf layers' stages at their
 * measured unit times). Within a backward pass a line at most every
 * --progress-interval seconds (default 30) since the last line: plain lines,
 * also on a terminal (no carriage returns in batch logs). */
typedef struct progress {
    int json;
    int have_plan;
    bk_quantize_plan plan;
    int cur_layer;       /* the layer being processed (-1: none yet) */
    int cur_module;      /* index of the next module of that layer (-1: none) */
    double layer_work, total_work, done_work;
    double last_eta;
    double interval;     /* seconds between lines within a backward pass */
    double last_line_s;  /* elapsed_s of the last line or JSON event printed */
} progress;

static int module_index(const char *name)
{
    for (int m = 0; name && m < BK_MOD_COUNT; m++)
        if (!strcmp(bk_module_name((bk_module)m), name))
            return m;
    return -1;
}

static void progress_init(progress *p, int json, double interval, const bk_quantize_plan *plan)
{
    memset(p, 0, sizeof *p);
    p->json = json;
    p->cur_layer = -1;
    p->cur_module = -1;
    p->interval = interval;
    if (plan && plan->model_ok) {
        p->have_plan = 1;
        p->plan = *plan;
        for (int m = 0; m < BK_MOD_COUNT; m++)
            p->layer_work += (double)plan->modules[m].rows * (double)plan->modules[m].cols;
        p->total_work = p->layer_work * (plan->layer_end - plan->layer_begin);
    }
}

static double progress_eta(progress *p, const bk_event *ev)
{
    if (ev->passes > 0) /* the backprop kinds: from the flow's work (< 0: not known yet) */
        return ev->eta_s;
    if (p->total_work <= 0 || p->done_work <= 0)
        return ev->eta_s;
    /* (--resume: the kept layers' work is not part of this run) */
    double left = p->total_work - p->layer_work * ev->layers_kept - p->done_work;
    return left <= 0 ? 0 : ev->elapsed_s * left / p->done_work;
}

static void json_error_event(const progress *p, bk_status st, const char *msg)
{
    const int at = p && p->cur_layer >= 0;
    cli_json_error_event(st, msg, at ? p->cur_layer : -1,
                         at && p->cur_module >= 0 && p->cur_module < BK_MOD_COUNT
                             ? bk_module_name((bk_module)p->cur_module)
                             : NULL);
}

static void on_event(void *user, const bk_event *ev)
{
    progress *p = user;
    /* where the run is (for the error event) and how much is done (ETA) */
    if (ev->kind == BK_EV_LAYER_BEGIN) {
        p->cur_layer = ev->layer;
        p->cur_module = 0;
    } else if (ev->kind == BK_EV_MODULE_DONE) {
        int mi = module_index(ev->module);
        p->cur_layer = ev->layer;
        p->cur_module = mi + 1;
        p->done_work += (double)ev->rows * (double)ev->cols;
    } else if (ev->kind == BK_EV_LAYER_DONE && !(ev->module == NULL && ev->message)) {
        p->cur_module = -1;
    } else if (ev->kind == BK_EV_WRITE || ev->kind == BK_EV_DONE) {
        p->cur_layer = -1;
        p->cur_module = -1;
    }
    const int total = p->have_plan ? p->plan.layers_total : ev->n_layers;
    const int begin = p->have_plan ? p->plan.layer_begin : 0;
    const int selected = p->have_plan ? p->plan.layer_end - p->plan.layer_begin : ev->n_layers;
    double eta = progress_eta(p, ev);
    if (ev->kind == BK_EV_DONE)
        eta = 0;
    if (ev->kind == BK_EV_BACKWARD_PROGRESS) {
        /* within a pass: a line now and then, not at its last micro-batch
         * (the next pass's or layer's line follows) */
        if (ev->pass_seqs_done >= ev->pass_seqs || ev->elapsed_s - p->last_line_s < p->interval)
            return;
    }
    p->last_line_s = ev->elapsed_s;
    if (p->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "event", ev_name(ev->kind));
        cJSON_AddNumberToObject(j, "layer", ev->layer);
        cJSON_AddNumberToObject(j, "layers_total", total);
        cJSON_AddNumberToObject(j, "layers_selected", selected);
        cJSON_AddNumberToObject(j, "layer_begin", begin);
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
        if (eta >= 0)
            cJSON_AddNumberToObject(j, "eta_s", eta);
        else
            cJSON_AddNullToObject(j, "eta_s");
        if (ev->passes > 0) {
            cJSON_AddNumberToObject(j, "pass", ev->pass);
            cJSON_AddNumberToObject(j, "passes", ev->passes);
            cJSON_AddNumberToObject(j, "pass_seqs_done", (double)ev->pass_seqs_done);
            cJSON_AddNumberToObject(j, "pass_seqs", (double)ev->pass_seqs);
            cJSON_AddNumberToObject(j, "work_done", ev->work_done);
        }
        cJSON *t = cJSON_AddObjectToObject(j, "stage_s");
        cJSON_AddNumberToObject(t, "forward", ev->t_forward);
        cJSON_AddNumberToObject(t, "hessian", ev->t_hessian);
        cJSON_AddNumberToObject(t, "factor", ev->t_factor);
        cJSON_AddNumberToObject(t, "solve", ev->t_solve);
        cJSON_AddNumberToObject(t, "io", ev->t_io);
        if (ev->message)
            cJSON_AddStringToObject(j, "message", ev->message);
        cli_json_line(j);
        return;
    }
    char el[32], et[32];
    fmt_time(ev->elapsed_s, el, sizeof el);
    if (eta >= 0)
        fmt_time(eta, et, sizeof et);
    else
        snprintf(et, sizeof et, "?");
    const int k = ev->layer - begin + 1; /* among the selected layers */
    /* (the messages name the model, the output, the work folder: escaped) */
    static char msg[CLI_ESC_CAP];
    cli_esc(ev->message, msg, sizeof msg);
    switch (ev->kind) {
    case BK_EV_START: fprintf(stderr, "bakron: %s\n", msg); break;
    case BK_EV_LAYER_BEGIN: break;
    case BK_EV_MODULE_DONE:
        fprintf(stderr, "  layer %d (%d/%d) %-18s [%lld x %lld]  loss %.4g  (gptq loss %.4g)  %s\n",
                ev->layer, k, selected, ev->module, (long long)ev->rows, (long long)ev->cols,
                ev->loss, ev->loss_gptq, el);
        break;
    case BK_EV_LAYER_DONE:
        if (ev->module == NULL && ev->message)
            fprintf(stderr, "  layer %d %s  elapsed %s\n", ev->layer, msg, el);
        else
            fprintf(stderr,
                    "layer %d done (%d/%d)  elapsed %s  ETA %s  (forward %.1fs, hessian %.1fs, "
                    "cholesky %.1fs, solve %.1fs, io %.1fs)\n",
                    ev->layer, k, selected, el, et, ev->t_forward, ev->t_hessian, ev->t_factor,
                    ev->t_solve, ev->t_io);
        break;
    case BK_EV_WRITE:
    case BK_EV_NOTE: fprintf(stderr, "bakron: %s\n", msg); break;
    case BK_EV_BACKWARD: fprintf(stderr, "  %s  elapsed %s  ETA %s\n", msg, el, et); break;
    case BK_EV_BACKWARD_PROGRESS:
        fprintf(stderr, "  backward pass %d of %d: %lld/%lld sequences  elapsed %s  ETA %s\n",
                ev->pass, ev->passes, (long long)ev->pass_seqs_done, (long long)ev->pass_seqs, el,
                et);
        break;
    case BK_EV_DONE:
        fprintf(stderr, "bakron: wrote %s in %s\n", msg, el);
        break;
    }
}

/* --config NAME: a path to a JSON file, or the name of an installed preset
 * (NAME or NAME.json in the installed presets folder, next to the executable
 * as DIR/../share/bakron/configs, or the source tree's configs/ when bakron
 * runs from its build folder). */
static bk_status find_preset(const char *name, char *out, size_t cap)
{
    if (strchr(name, '/') || bk_is_file(name)) {
        if (!bk_is_file(name))
            return bk_error(BK_ERR_IO, "--config %s: no such file", name);
        snprintf(out, cap, "%s", name);
        return BK_OK;
    }
    char dirs[3][4096];
    int nd = 0;
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash)
            *slash = '\0';
        if (!strcmp(exe, BK_BUILD_ROOT))
            snprintf(dirs[nd++], sizeof dirs[0], "%.4000s/configs", BK_SOURCE_ROOT);
        snprintf(dirs[nd++], sizeof dirs[0], "%.4000s/../share/bakron/configs", exe);
    }
    snprintf(dirs[nd++], sizeof dirs[0], "%s", BK_PRESET_DIR);
    const char *ext = bk_ends_with(name, ".json") ? "" : ".json";
    for (int i = 0; i < nd; i++) {
        int w = snprintf(out, cap, "%s/%s%s", dirs[i], name, ext);
        if (w > 0 && (size_t)w < cap && bk_is_file(out))
            return BK_OK;
    }
    /* list what there is */
    char names[1024] = "";
    for (int i = 0; i < nd && !names[0]; i++) {
        DIR *d = opendir(dirs[i]);
        if (!d)
            continue;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            size_t l = strlen(e->d_name);
            if (l > 5 && !strcmp(e->d_name + l - 5, ".json") &&
                strlen(names) + l + 3 < sizeof names) {
                if (names[0])
                    strcat(names, ", ");
                strncat(names, e->d_name, l - 5);
            }
        }
        closedir(d);
    }
    return bk_error(BK_ERR_USAGE, "--config %s: no such file or installed preset (presets: %s)",
                    name, names[0] ? names : "none found");
}

static void diag_cb(void *user, bk_status st)
{
    (void)user;
    cli_diag_add(st);
}

static void fmt_bytes(uint64_t b, char *buf, size_t cap)
{
    if (b >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", (double)b / (1 << 30));
    else if (b >= (1ull << 20))
        snprintf(buf, cap, "%.1f MiB", (double)b / (1 << 20));
    else
        snprintf(buf, cap, "%.1f KiB", (double)b / 1024);
}

static void print_plan(const qargs *q, const bk_quantize_plan *p)
{
    const bk_quantize_opts *o = &q->o;
    char qd[128], mem[32], outb[32], inb[32], fr[32];
    cli_quant_describe(&o->solve.quant, qd, sizeof qd);
    fmt_bytes(p->host_bytes, mem, sizeof mem);
    fmt_bytes(p->output_bytes, outb, sizeof outb);
    fmt_bytes(p->input_bytes, inb, sizeof inb);
    fmt_bytes(p->free_bytes, fr, sizeof fr);
    if (q->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "event", "plan");
        cJSON_AddStringToObject(j, "model", o->model_dir);
        cJSON_AddStringToObject(j, "dtype", p->model_dtype ? p->model_dtype : "?");
        cJSON_AddNumberToObject(j, "layers_total", p->layers_total);
        cJSON_AddNumberToObject(j, "layers_selected", p->layer_end - p->layer_begin);
        cJSON_AddNumberToObject(j, "layer_begin", p->layer_begin);
        cJSON_AddNumberToObject(j, "layer_end", p->layer_end);
        cJSON_AddNumberToObject(j, "sequences", (double)p->S);
        cJSON_AddNumberToObject(j, "seqlen", (double)p->T);
        cJSON_AddStringToObject(j, "hessian", bk_hessian_name(o->hessian));
        cJSON_AddStringToObject(j, "quantizer", qd);
        cJSON_AddStringToObject(j, "export", bk_export_name(o->export_format));
        if (bk_hessian_is_backprop(o->hessian) && p->model_ok) {
            cJSON_AddStringToObject(j, "bwd_device", p->bwd_gpu ? "gpu" : "cpu");
            cJSON_AddStringToObject(j, "bwd_precision", bk_bwd_precision_name(p->bwd_precision));
            cJSON_AddBoolToObject(j, "bwd_precision_auto", p->bwd_precision_auto);
        }
        cJSON *ms = cJSON_AddArrayToObject(j, "modules");
        for (int m = 0; m < BK_MOD_COUNT; m++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "module", bk_module_name((bk_module)m));
            cJSON_AddNumberToObject(e, "rows", (double)p->modules[m].rows);
            cJSON_AddNumberToObject(e, "cols", (double)p->modules[m].cols);
            cJSON_AddStringToObject(e, "hessian_factors",
                                    o->hessian == BK_HESS_RTN ? "none"
                                    : p->modules[m].two_sided ? "two-sided"
                                                              : "one-sided");
            cJSON_AddItemToArray(ms, e);
        }
        cJSON_AddNumberToObject(j, "estimated_host_bytes", (double)p->host_bytes);
        cJSON_AddNumberToObject(j, "estimated_output_bytes", (double)p->output_bytes);
        cJSON_AddNumberToObject(j, "free_bytes", (double)p->free_bytes);
        char *s = cJSON_PrintUnformatted(j);
        if (s)
            printf("%s\n", s);
        free(s);
        cJSON_Delete(j);
        return;
    }
    static char e1[CLI_ESC_CAP];
    printf("bakron quantize: dry run (checks passed; nothing computed or written)\n");
    printf("  model         %s: %s %s, %d layers, %s of tensors\n",
           cli_esc(o->model_dir, e1, sizeof e1),
           p->cfg.model_type, p->model_dtype ? p->model_dtype : "?", p->layers_total, inb);
    printf("  layers        %d..%d (%d of %d; numbered from 0 as in model.layers.N)\n",
           p->layer_begin, p->layer_end - 1, p->layer_end - p->layer_begin, p->layers_total);
    if (o->calib_path)
        printf("  calibration   %s: %lld sequences x %lld tokens\n",
               cli_esc(o->calib_path, e1, sizeof e1),
               (long long)p->S, (long long)p->T);
    else if (o->calib_text)
        printf("  calibration   text %s (tokenizer.json of the model): %lld windows x %lld "
               "tokens\n",
               cli_esc(o->calib_text, e1, sizeof e1), (long long)p->S, (long long)p->T);
    else if (o->activations_dir)
        printf("  calibration   activations %s: %lld sequences x %lld tokens\n",
               cli_esc(o->activations_dir, e1, sizeof e1), (long long)p->S, (long long)p->T);
    else
        printf("  calibration   none (rtn)\n");
    printf("  hessian       %s, algorithm %s\n", bk_hessian_name(o->hessian),
           bk_algorithm_name(o->solve.algorithm));
    if (bk_hessian_is_backprop(o->hessian) && p->model_ok)
        printf("  backward      on the %s, --bwd-precision %s%s%s\n", p->bwd_gpu ? "GPU" : "CPU",
               bk_bwd_precision_name(p->bwd_precision), p->bwd_precision_auto ? " (auto)" : "",
               p->bwd_gpu ? "" : " (the CPU's flow: fp64)");
    printf("  quantizer     %s\n", qd);
    printf("  export        %s -> %s\n", bk_export_name(o->export_format),
           cli_esc(o->out_dir, e1, sizeof e1));
    printf("  modules of each layer:\n");
    for (int m = 0; m < BK_MOD_COUNT; m++)
        printf("    %-18s [%lld x %lld]  %s\n", bk_module_name((bk_module)m),
               (long long)p->modules[m].rows, (long long)p->modules[m].cols,
               o->hessian == BK_HESS_RTN ? "no Hessian (round to nearest)"
               : p->modules[m].two_sided ? "two-sided Hessian A (x) B"
                                         : "one-sided Hessian A (x) I");
    printf("  estimated host memory  %s\n", mem);
    printf("  estimated output size  %s (%s free there)\n", outb, p->free_bytes ? fr : "?");
}

bk_status bk_cmd_quantize(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        fputs(quantize_usage, stdout);
        return BK_OK;
    }
    static qargs q;
    memset(&q, 0, sizeof q);
    bk_quantize_opts_default(&q.o);
    q.progress_interval = 30;
    bk_status st = BK_OK;
    const char *preset = NULL;
    int c, ran = 0, json_early = 0;
    /* MPI ranks: started by mpirun / srun (environment), else one process and
     * no MPI call at all. Every rank must get the same command line. */
    bk_dist *dist = NULL;
    int launched = bk_dist_launched();
    if (launched < 0)
        return BK_ERR_USAGE;
    if (launched) {
        if ((st = bk_dist_init(0, &dist)) != BK_OK)
            return st;
        if (bk_dist_rank(dist) != 0)
            cli_quiet_errors = 1; /* rank 0 prints the job's one line */
        size_t len = 0;
        for (int i = 0; i < argc; i++)
            len += strlen(argv[i]) + 1;
        char *all = malloc(len + 1), *p = all;
        if (!all) {
            st = bk_error(BK_ERR_NOMEM, "out of memory");
        } else {
            for (int i = 0; i < argc; i++) {
                size_t l = strlen(argv[i]) + 1;
                memcpy(p, argv[i], l);
                p += l;
            }
            st = bk_dist_same(dist, all, len, "arguments");
            free(all);
        }
        if (st != BK_OK) {
            ran = 1; /* known to every rank */
            goto done;
        }
    }
    /* pass 1: the preset (and --json, so that errors become events) */
    optind = 0; /* GNU getopt: full re-initialization */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "-", quantize_opts, NULL)) != -1) {
        if (c == O_CONFIG) {
            if (preset)
                cli_diag_add(cli_usage_error("--config given twice ('%s', '%s')", preset, optarg));
            preset = optarg;
        }
        if (c == O_JSON)
            json_early = 1;
    }
    if (preset) {
        if ((st = find_preset(preset, q.preset_path, sizeof q.preset_path)) != BK_OK)
            cli_diag_add(st);
        else if ((st = apply_preset(&q, q.preset_path)) != BK_OK)
            cli_diag_add(st);
        q.o.config_path = q.preset_path[0] ? q.preset_path : NULL;
    }
    /* pass 2: the command line (every mistake is collected) */
    q.from = 1;
    optind = 0;
    opterr = 0;
    const char *model = NULL;
    cli_once once = {0};
    while ((c = getopt_long(argc, argv, "-", quantize_opts, NULL)) != -1) {
        if (c == 1) { /* a non-option argument, in order */
            if (model)
                cli_diag_add(cli_usage_error("unexpected argument '%s' (one MODEL_DIR only)",
                                             optarg));
            else
                model = optarg;
            continue;
        }
        if (c == '?' || c == ':') {
            const char *bad = argv[optind - 1];
            if (optopt && strncmp(bad, "--", 2) == 0 && c == '?' && strchr(bad, '=') == NULL) {
                /* a known option without its value */
                int known = 0;
                for (const struct option *p = quantize_opts; p->name; p++)
                    if (!strcmp(p->name, bad + 2))
                        known = 1;
                if (known) {
                    cli_diag_add(cli_usage_error("%s needs a value", bad));
                    continue;
                }
            }
            cli_diag_add(cli_usage_error("unknown option '%s'", bad));
            continue;
        }
        if (c == O_CONFIG)
            continue; /* given twice: said by pass 1 */
        if ((st = cli_once_add(&once, cli_opt_name(quantize_opts, c), optarg)) != BK_OK) {
            cli_diag_add(st);
            continue;
        }
        if ((st = apply(&q, c, optarg)) != BK_OK)
            cli_diag_add(st);
    }
    if ((st = resolve_quant(&q, q.o.config_path)) != BK_OK)
        cli_diag_add(st);
    q.o.model_dir = model ? cli_model_dir(model, q.model_buf, sizeof q.model_buf) : NULL;

    /* every other check before the work, each failure on its own line */
    bk_quantize_plan plan;
    bk_quantize_check(&q.o, &plan, diag_cb, NULL);
    if (cli_diag_count() > 0) {
        if ((json_early || q.json) && !cli_quiet_errors) {
            for (int k = 0; k < cli_diag_count(); k++) {
                const char *msg;
                bk_status sk = cli_diag_get(k, &msg);
                json_error_event(NULL, sk, msg);
            }
        }
        st = cli_diag_status();
        goto done;
    }
    if (q.dry_run) {
        print_plan(&q, &plan);
        st = BK_OK;
        goto done;
    }
    static progress prog;
    progress_init(&prog, q.json, q.progress_interval, &plan);
    q.o.on_event = on_event;
    q.o.user = &prog;
    q.o.dist = dist;
    if (dist && q.dist_timeout > 0)
        bk_dist_set_timeout(dist, q.dist_timeout);
    cli_install_signals();
    ran = 1;
    st = bk_quantize(&q.o);
    if (st != BK_OK && q.json && !cli_quiet_errors)
        json_error_event(&prog, st, bk_last_error());
done:
    if (dist && !ran) /* a command-line error: the other ranks learn it at their next exchange */
        st = bk_dist_sync(dist, st);
    if (dist) {
        /* rank 0's line before the ranks part: once one exits, the launcher may
         * stop the others */
        if (st != BK_OK && bk_dist_rank(dist) == 0)
            cli_print_error("quantize", st);
        cli_quiet_errors = 1;
        bk_dist_finalize(dist);
    }
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
    "  --dtype D         bf16, f16 or f32 (default: the checkpoint's dtype when BF16 or F16,\n"
    "                    else f32; docs/activations.md says what it changes)\n"
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
    int json = 0, c, have_dtype = 0;
    bk_status st;
    const char *model = NULL;
    static char model_buf[4096];
    double t0 = bk_now();
    optind = 0;
    opterr = 0;
    cli_once once = {0};
    while ((c = getopt_long(argc, argv, "-", opts, NULL)) != -1) {
        if (c == 1) {
            if (model)
                return cli_usage_error("unexpected argument '%s'", optarg);
            model = optarg;
            continue;
        }
        const char *name = cli_opt_name(opts, c);
        if (name && (st = cli_once_add(&once, name, optarg)) != BK_OK)
            return st;
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
        case 'd': {
            char up[16];
            size_t k = 0;
            for (; optarg[k] && k + 1 < sizeof up; k++)
                up[k] = (char)((optarg[k] >= 'a' && optarg[k] <= 'z') ? optarg[k] - 32 : optarg[k]);
            up[k] = '\0';
            if (bk_dtype_from_name(up, &o.dtype) != BK_OK ||
                (o.dtype != BK_DT_F32 && o.dtype != BK_DT_BF16 && o.dtype != BK_DT_F16))
                return cli_usage_error("--dtype: expected bf16, f16 or f32, got '%s'", optarg);
            have_dtype = 1;
            break;
        }
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
    o.model_dir = cli_model_dir(model, model_buf, sizeof model_buf);
    if (!have_dtype) {
        /* the checkpoint's own precision when it is BF16 or F16 */
        bk_model *m = NULL;
        if ((st = bk_model_open(o.model_dir, &m)) != BK_OK)
            return st;
        const bk_tensor_info *t = bk_model_find(m, 0, "self_attn.q_proj.weight");
        o.dtype = t && (t->dtype == BK_DT_BF16 || t->dtype == BK_DT_F16) ? t->dtype : BK_DT_F32;
        bk_model_close(m);
    }
    static progress prog;
    progress_init(&prog, json, 30, NULL);
    o.on_event = on_event;
    o.user = &prog;
    cli_install_signals();
    st = bk_dump_activations(&o);
    if (st != BK_OK) {
        if (json)
            json_error_event(&prog, st, bk_last_error());
        return st;
    }
    /* closing summary: files, bytes, time */
    long files = 0;
    unsigned long long bytes = 0;
    DIR *d = opendir(o.out_dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        char p[4096];
        struct stat sb;
        if (e->d_name[0] == '.' || bk_path_join(p, sizeof p, o.out_dir, e->d_name) != BK_OK ||
            stat(p, &sb) != 0 || !S_ISREG(sb.st_mode))
            continue;
        files++;
        bytes += (unsigned long long)sb.st_size;
    }
    if (d)
        closedir(d);
    double secs = bk_now() - t0;
    if (json) {
        printf("{\"event\":\"summary\",\"files\":%ld,\"bytes\":%llu,\"dtype\":\"%s\","
               "\"zstd\":%s,\"seconds\":%.3f}\n",
               files, bytes, bk_dtype_name(o.dtype), o.zstd ? "true" : "false", secs);
        fflush(stdout);
    } else {
        char bb[32];
        fmt_bytes(bytes, bb, sizeof bb);
        static char eo[CLI_ESC_CAP];
        fprintf(stderr, "bakron: dumped %s: %ld files, %s (%s%s) in %.1fs\n",
                cli_esc(o.out_dir, eo, sizeof eo), files,
                bb, bk_dtype_name(o.dtype), o.zstd ? ", zstd" : "", secs);
    }
    return BK_OK;
}
