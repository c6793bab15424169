/* bakron eval: perplexity with the native forward pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/forward.h"
#include "bakron/model.h"
#include "bakron/pipeline.h"
#include "cli.h"
#include "util.h"

static const char *eval_usage =
    "usage: bakron eval MODEL_OR_OUT_DIR (--tokens FILE | --text TEXT [--seqlen T])\n"
    "                   [--samples N] [--batch B] [--json]\n"
    "                   [--logits-out FILE.safetensors] [--backend auto|cpu|cuda]\n"
    "                   [--gpu-math fp32|tf32|bf16|auto] [--setting KEY=VALUE]\n"
    "\n"
    "Perplexity of a model (a Hugging Face checkpoint folder, or an output folder of\n"
    "`bakron quantize`) computed with the native forward pass (F32):\n"
    "  ppl = exp(mean next-token negative log-likelihood over positions 1..T-1\n"
    "            of every sequence)\n"
    "\n"
    "options:\n"
    "  --tokens FILE   safetensors with an I32 or I64 tensor input_ids [sequences, seqlen]\n"
    "  --text TEXT     plain text (a file or a folder), tokenized with the model's tokenizer.json\n"
    "                  into windows of --seqlen tokens (default 2048 or the model's context),\n"
    "                  BOS first, as `quantize --calib-text` does (docs/tokenizer.md)\n"
    "  --seqlen T      window length for --text\n"
    "  --samples N     use the first N sequences (default: all)\n"
    "  --batch B       sequences per micro-batch (default: automatic)\n"
    "  --backend B     cpu, cuda (the forward pass on the GPU; docs/DEVICE.md) or auto\n"
    "                  (default: cuda when a GPU is present, else cpu)\n"
    "  --gpu-math M    fp32 (default: matches the CPU to ~1e-6), tf32 or bf16 (tensor cores),\n"
    "                  auto (bf16 for a BF16 checkpoint, else tf32)\n"
    "  --setting K=V   backend setting (repeatable; README \"Settings\"): device=N,\n"
    "                  mem_limit=BYTES\n"
    "  --json          print one JSON object on stdout instead of text\n"
    "  --logits-out F  also write the F32 logits [sequences*seqlen, vocab] of the\n"
    "                  evaluated sequences to the safetensors file F (tensor \"logits\",\n"
    "                  row s*seqlen+t); holds them all in memory: small inputs only\n";

/* "--name value" or "--name=value"; returns 1 when argv[*i] is that option
 * (advancing *i over its value), 0 otherwise, -1 on a missing value. */
/* argv[*i] is option NAME ("--name VALUE" or "--name=VALUE"): 1 with *val
 * set and the option recorded in once (a second one sets *dup to the usage
 * error), 0 for another argument, -1 for a missing value. */
static int opt_value(int argc, char **argv, int *i, const char *name, const char **val,
                     cli_once *once, bk_status *dup)
{
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0)
        return 0;
    if (a[n] == '=') {
        *val = a + n + 1;
    } else {
        if (a[n] != '\0')
            return 0;
        if (*i + 1 >= argc)
            return -1;
        *val = argv[++*i];
    }
    if (*dup == BK_OK)
        *dup = cli_once_add(once, name + 2, *val);
    return 1;
}

/* --logits-out: logits of all evaluated sequences, one micro-batch. */
static bk_status write_logits(const bk_model *m, bk_backend *be, const int32_t *ids, int64_t S,
                              int64_t T, const char *path)
{
    const bk_model_config *cfg = bk_model_get_config(m);
    uint64_t rows = 0, n = 0;
    if (bk_mul_u64((uint64_t)S, (uint64_t)T, &rows) ||
        bk_mul_u64(rows, (uint64_t)cfg->vocab, &n) || n > SIZE_MAX / sizeof(float))
        return bk_error(BK_ERR_NOMEM, "--logits-out %s: %lld x %lld tokens x %lld vocabulary "
                        "logits do not fit in memory (use --samples)", path, (long long)S,
                        (long long)T, (long long)cfg->vocab);
    float *logits = bk_alloc((size_t)n, sizeof(float));
    if (!logits)
        return bk_error(BK_ERR_NOMEM, "--logits-out %s: cannot allocate %.2f GiB of logits "
                        "for %lld sequences (use --samples)", path,
                        (double)n * sizeof(float) / (1024.0 * 1024.0 * 1024.0), (long long)S);
    bk_st_writer *w = NULL;
    int64_t shape[2] = {(int64_t)rows, cfg->vocab};
    bk_status st;
    st = bk_backend_model_logits(be, m, ids, S, T, logits);
    if (st == BK_OK)
        st = bk_st_writer_create(&w);
    if (st == BK_OK)
        st = bk_st_writer_add(w, "logits", BK_DT_F32, 2, shape, logits, 0);
    if (st == BK_OK)
        st = bk_st_writer_save(w, path);
    if (st != BK_OK) {
        char pre[1100];
        snprintf(pre, sizeof pre, "--logits-out %s", path);
        bk_error_prefix(st, pre);
    }
    bk_st_writer_free(w);
    free(logits);
    return st;
}

bk_status bk_cmd_eval(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        fputs(eval_usage, stdout);
        return BK_OK;
    }
    const char *model_dir = NULL, *tokens_path = NULL, *logits_out = NULL, *text_path = NULL;
    int64_t samples = 0, batch = 0, seqlen = 0;
    int json = 0;
    bk_backend_kind bkind = BK_BACKEND_AUTO;
    bk_gemm_math gmath = BK_GEMM_FP32;
    bk_backend_params bparams;
    bk_backend_params_default(&bparams);
    bk_status st = BK_OK;
    cli_once once = {0};
    bk_status dup = BK_OK; /* an option given twice (opt_value) */
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int r;
        if (!strcmp(argv[i], "--json")) {
            json = 1;
            if (dup == BK_OK)
                dup = cli_once_add(&once, "json", NULL);
        } else if ((r = opt_value(argc, argv, &i, "--tokens", &v, &once, &dup)) != 0) {
            if (r < 0)
                return cli_usage_error("--tokens needs a FILE");
            tokens_path = v;
        } else if ((r = opt_value(argc, argv, &i, "--text", &v, &once, &dup)) != 0) {
            if (r < 0 || !v[0])
                return cli_usage_error("--text needs a FILE or folder");
            text_path = v;
        } else if ((r = opt_value(argc, argv, &i, "--seqlen", &v, &once, &dup)) != 0) {
            if (r < 0)
                return cli_usage_error("--seqlen needs a number");
            if ((st = cli_parse_i64("--seqlen", v, 2, (int64_t)1 << 30, &seqlen)) != BK_OK)
                return st;
        } else if ((r = opt_value(argc, argv, &i, "--logits-out", &v, &once, &dup)) != 0) {
            if (r < 0 || !v[0])
                return cli_usage_error("--logits-out needs a FILE");
            logits_out = v;
        } else if ((r = opt_value(argc, argv, &i, "--samples", &v, &once, &dup)) != 0) {
            if (r < 0)
                return cli_usage_error("--samples needs a number");
            if ((st = cli_parse_i64("--samples", v, 1, INT64_MAX, &samples)) != BK_OK)
                return st;
        } else if ((r = opt_value(argc, argv, &i, "--backend", &v, &once, &dup)) != 0) {
            if (r < 0 || bk_backend_kind_from_name(v, &bkind) != BK_OK)
                return cli_usage_error("--backend: expected auto, cpu or cuda");
        } else if ((r = opt_value(argc, argv, &i, "--gpu-math", &v, &once, &dup)) != 0) {
            if (r < 0 || bk_gemm_math_from_name(v, &gmath) != BK_OK)
                return cli_usage_error("--gpu-math: expected fp32, tf32, bf16 or auto");
        } else if ((r = opt_value(argc, argv, &i, "--setting", &v, &once, &dup)) != 0) {
            if (r < 0)
                return cli_usage_error("--setting needs KEY=VALUE");
            if ((st = cli_setting(&bparams, v)) != BK_OK)
                return st;
        } else if ((r = opt_value(argc, argv, &i, "--batch", &v, &once, &dup)) != 0) {
            if (r < 0)
                return cli_usage_error("--batch needs a number");
            if ((st = cli_parse_i64("--batch", v, 1, INT64_MAX, &batch)) != BK_OK)
                return st;
        } else if (!strcmp(argv[i], "--")) {
            if (i + 1 < argc && !model_dir)
                model_dir = argv[++i];
            if (i + 1 < argc)
                return cli_usage_error("unexpected argument '%s'", argv[i + 1]);
            break;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            return cli_usage_error("unknown option '%s'", argv[i]);
        } else if (!model_dir) {
            model_dir = argv[i];
        } else {
            return cli_usage_error("unexpected argument '%s' (one model folder only)", argv[i]);
        }
        if (dup != BK_OK)
            return dup;
    }
    if (!model_dir)
        return cli_usage_error("MODEL_OR_OUT_DIR is required");
    static char model_buf[4096];
    model_dir = cli_model_dir(model_dir, model_buf, sizeof model_buf);
    if (!tokens_path && !text_path)
        return cli_usage_error("--text TEXT or --tokens FILE is required");
    if (tokens_path && text_path)
        return cli_usage_error("--text and --tokens are exclusive");
    if (seqlen && !text_path)
        return cli_usage_error("--seqlen goes with --text (a token file has its own length)");
    const char *input = text_path ? text_path : tokens_path;
    if (logits_out) {
        const cli_input_path in[] = {{"the model folder", model_dir},
                                     {text_path ? "--text" : "--tokens", input}};
        if ((st = cli_check_out_file("--logits-out", logits_out, in, 2)) != BK_OK)
            return st;
    }

    bk_model *m = NULL;
    bk_backend *be = NULL;
    int32_t *ids = NULL;
    int64_t S = 0, T = 0;
    double nll_sum = 0.0;
    int64_t count = 0;
    cJSON *j = NULL;
    static char esc[CLI_ESC_CAP]; /* paths on the status lines (cli_esc) */
    st = bk_model_open(model_dir, &m);
    if (st != BK_OK)
        goto done;
    const bk_model_config *cfg = bk_model_get_config(m);
    if (text_path) {
        int64_t tt = seqlen > 0 ? seqlen : bk_text_default_seqlen(cfg->max_positions);
        if (cfg->max_positions > 0 && tt > cfg->max_positions) {
            st = bk_error(BK_ERR_CALIB, "--seqlen %lld exceeds max_position_embeddings %lld of %s",
                          (long long)tt, (long long)cfg->max_positions, model_dir);
            goto done;
        }
        st = bk_load_text_tokens(model_dir, text_path, cfg->vocab, cfg->bos_token_id, samples, tt,
                                 &ids, &S, &T);
    } else {
        st = bk_load_tokens(tokens_path, cfg->vocab, samples, 0, &ids, &S, &T);
    }
    if (st != BK_OK)
        goto done;
    if (cfg->max_positions > 0 && T > cfg->max_positions) {
        st = bk_error(BK_ERR_CALIB,
                      "%s: sequence length %lld exceeds max_position_embeddings %lld of %s",
                      input, (long long)T, (long long)cfg->max_positions, model_dir);
        goto done;
    }
    /* the forward pass on the backend: --backend cuda, or auto with a GPU, runs
     * on the GPU */
    if ((st = bk_backend_create_params(bkind, &bparams, &be)) != BK_OK)
        goto done;
    bk_backend_set_gemm_math(be, bk_gemm_math_resolve(m, gmath));
    double t0 = bk_now();
    st = bk_backend_model_nll(be, m, ids, S, T, batch, &nll_sum, &count);
    double secs = bk_now() - t0;
    if (st != BK_OK) {
        char pre[1200];
        snprintf(pre, sizeof pre, "%s on %s", model_dir, input);
        bk_error_prefix(st, pre);
        goto done;
    }
    if (logits_out && (st = write_logits(m, be, ids, S, T, logits_out)) != BK_OK)
        goto done;
    double nll = nll_sum / (double)count;
    double ppl = exp(nll);
    if (json) {
        j = cJSON_CreateObject();
        if (!j || !cJSON_AddStringToObject(j, "model", model_dir) ||
            !cJSON_AddBoolToObject(j, "quantized", bk_model_is_quantized(m) ? 1 : 0) ||
            !cJSON_AddStringToObject(j, text_path ? "text" : "tokens_file", input) ||
            !cJSON_AddNumberToObject(j, "sequences", (double)S) ||
            !cJSON_AddNumberToObject(j, "seqlen", (double)T) ||
            !cJSON_AddNumberToObject(j, "tokens", (double)count) ||
            !cJSON_AddNumberToObject(j, "nll", nll) ||
            !cJSON_AddNumberToObject(j, "nll_sum", nll_sum) ||
            !cJSON_AddNumberToObject(j, "perplexity", ppl) ||
            !cJSON_AddStringToObject(j, "backend", bk_backend_name(be)) ||
            !cJSON_AddNumberToObject(j, "seconds", secs)) {
            st = bk_error(BK_ERR_NOMEM, "eval: out of memory building the JSON output");
            goto done;
        }
        char *txt = cJSON_PrintUnformatted(j);
        if (!txt) {
            st = bk_error(BK_ERR_NOMEM, "eval: out of memory printing the JSON output");
            goto done;
        }
        printf("%s\n", txt);
        free(txt);
    } else {
        printf("model       %s%s\n", cli_esc(model_dir, esc, sizeof esc),
               bk_model_is_quantized(m) ? " (quantized)" : "");
        printf("tokens      %s: %lld sequences x %lld tokens\n", cli_esc(input, esc, sizeof esc),
               (long long)S, (long long)T);
        printf("perplexity  %.4f\n", ppl);
        printf("mean NLL    %.6f nats/token over %lld predicted tokens\n", nll,
               (long long)count);
        printf("time        %.2f s (%.0f tokens/s)\n", secs,
               secs > 0 ? (double)(S * T) / secs : 0.0);
    }
    if (fflush(stdout) != 0)
        st = bk_error(BK_ERR_WRITE, "eval: cannot write to stdout");
    /* a bakron output folder: the perplexity goes into its model card */
    int rec = st == BK_OK ? cli_card_record_eval(model_dir, input, S, T, ppl, nll) : 0;
    if (rec > 0 && !json)
        printf("recorded    in %s/README.md\n", cli_esc(model_dir, esc, sizeof esc));
    else if (rec < 0)
        fprintf(stderr, "bakron eval: note: the perplexity was not recorded in %s/README.md: %s\n",
                cli_esc(model_dir, esc, sizeof esc), bk_last_error());
done:
    cJSON_Delete(j);
    bk_backend_destroy(be);
    free(ids);
    bk_model_close(m);
    return st;
}
