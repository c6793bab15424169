/* model.c — config.json parsing and checkpoint cross-checks for decoder-only
 * Llama / Mistral / Qwen2 / Qwen3 models (include/bakron/model.h).
 *
 * The defaults, accepted keys and the rules are documented in
 * docs/formats.md, section "config.json". Integers are read from cJSON's
 * valuedouble and must be whole numbers (cJSON's valueint saturates).
 */
#include "bakron/model.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pipeline_internal.h"
#include "rope.h"
#include "util.h"

#define JSON_MAX_WHOLE 9007199254740992.0 /* 2^53 */

/* Sane upper bounds for sizes read from config.json. */
#define MAX_LAYERS ((int64_t)1 << 16)
#define MAX_HIDDEN ((int64_t)1 << 20)
#define MAX_INTERMEDIATE ((int64_t)1 << 22)
#define MAX_HEADS ((int64_t)1 << 16)
#define MAX_HEAD_DIM ((int64_t)1 << 16)
#define MAX_ATTN_WIDTH ((int64_t)1 << 22) /* heads * head_dim */
#define MAX_VOCAB ((int64_t)1 << 26)
#define MAX_POSITIONS ((int64_t)1 << 40)

/* ------------------------------------------------------------ per-arch facts */

/* What transformers does when a key is absent (configuration_{llama,mistral,
 * qwen2,qwen3}.py) and which structural keys each model class reads. */
typedef struct arch_info {
    const char *model_type;
    bk_arch arch;
    int64_t kv_heads;     /* default num_key_value_heads; -1: = num_attention_heads */
    int64_t head_dim;     /* default head_dim; -1: hidden_size / num_attention_heads */
    int64_t max_pos;      /* default max_position_embeddings */
    int64_t bos, eos;     /* default bos/eos token ids (-1: none) */
    int qkv_bias_fixed;   /* Qwen2: q/k/v always have biases, o never */
    int reads_attn_bias;  /* the model class honours attention_bias (q/k/v/o) */
    int reads_mlp_bias;   /* the model class honours mlp_bias */
    int qk_norm;          /* Qwen3: q_norm / k_norm */
} arch_info;

static const arch_info arch_table[] = {
    {"llama", BK_ARCH_LLAMA, -1, -1, 2048, 1, 2, 0, 1, 1, 0},
    {"mistral", BK_ARCH_MISTRAL, 8, -1, 4096 * 32, 1, 2, 0, 0, 0, 0},
    {"qwen2", BK_ARCH_QWEN2, 32, -1, 32768, -1, -1, 1, 0, 0, 0},
    {"qwen3", BK_ARCH_QWEN3, 32, 128, 32768, -1, -1, 0, 1, 0, 1},
};
#define N_ARCH (sizeof arch_table / sizeof arch_table[0])
#define SUPPORTED_TYPES "llama, mistral, qwen2, qwen3"

static const char *json_type_name(const cJSON *v)
{
    return bk_json_kind(v, "absent");
}

/* Present and not null. */
static const cJSON *get(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* JSON readers disagree on which of two equal keys wins: refuse them
 * (sorting keeps this O(n log n) on hostile input). */
static bk_status check_duplicate_keys(const char *label, const cJSON *obj, const char *where)
{
    size_t n = 0;
    for (const cJSON *a = obj->child; a; a = a->next)
        n++;
    if (n < 2)
        return BK_OK;
    const char **keys = malloc(n * sizeof *keys);
    if (!keys)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory checking %zu keys", label, n);
    size_t k = 0;
    for (const cJSON *a = obj->child; a; a = a->next)
        keys[k++] = a->string ? a->string : "";
    qsort(keys, n, sizeof *keys, cmp_str_ptr);
    bk_status st = BK_OK;
    for (size_t i = 1; i < n && st == BK_OK; i++)
        if (!strcmp(keys[i - 1], keys[i]))
            st = bk_error(BK_ERR_CONFIG, "%s: key '%s%.64s' appears more than once", label,
                          where, keys[i]);
    free(keys);
    return st;
}

/* A whole number in [lo, hi] from a JSON number. `key` names it in messages. */
static bk_status json_i64(const char *label, const char *key, const cJSON *v, int64_t lo,
                          int64_t hi, int64_t *out)
{
    if (!cJSON_IsNumber(v))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be an integer (got %s)", label, key,
                        json_type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be a whole number (got %.17g)", label, key,
                        d);
    if (d < (double)lo || d > (double)hi)
        return bk_error(BK_ERR_CONFIG, "%s: %s = %.17g is out of range (expected %lld..%lld)",
                        label, key, d, (long long)lo, (long long)hi);
    *out = (int64_t)d;
    return BK_OK;
}

/* A finite number; `positive` requires > 0. */
static bk_status json_num(const char *label, const char *key, const cJSON *v, int positive,
                          double *out)
{
    if (!cJSON_IsNumber(v))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be a number (got %s)", label, key,
                        json_type_name(v));
    double d = v->valuedouble;
    if (!isfinite(d) || (positive && !(d > 0)))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be a finite%s number (got %g)", label, key,
                        positive ? " positive" : "", d);
    *out = d;
    return BK_OK;
}

static bk_status json_bool(const char *label, const char *key, const cJSON *v, int *out)
{
    if (!cJSON_IsBool(v))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be true or false (got %s)", label, key,
                        json_type_name(v));
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return BK_OK;
}

/* Optional integer: absent or null keeps *out. */
static bk_status opt_i64(const char *label, const cJSON *root, const char *key, int64_t lo,
                         int64_t hi, int64_t *out)
{
    const cJSON *v = get(root, key);
    return v ? json_i64(label, key, v, lo, hi, out) : BK_OK;
}

static bk_status opt_bool(const char *label, const cJSON *root, const char *key, int *out)
{
    const cJSON *v = get(root, key);
    return v ? json_bool(label, key, v, out) : BK_OK;
}

/* An optional string field: *out its value, NULL when absent or null. */
static bk_status opt_string(const char *label, const cJSON *root, const char *key,
                            const char **out)
{
    const cJSON *v = get(root, key);
    *out = NULL;
    if (!v)
        return BK_OK;
    if (!cJSON_IsString(v))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be a string (got %s)", label, key,
                        json_type_name(v));
    *out = v->valuestring;
    return BK_OK;
}

/* bos_token_id / eos_token_id: an integer, a list of integers (the first is
 * kept) or null; every id inside the vocabulary [0, vocab). */
static bk_status token_id(const char *label, const cJSON *root, const char *key, int64_t vocab,
                          int64_t *out)
{
    const cJSON *v = get(root, key);
    if (!v)
        return BK_OK;
    char k[64];
    int i = 0;
    int64_t first = -1;
    int list = cJSON_IsArray(v);
    for (const cJSON *e = list ? v->child : v; e; e = list ? e->next : NULL, i++) {
        int64_t x = 0;
        if (list)
            snprintf(k, sizeof k, "%s[%d]", key, i);
        else
            snprintf(k, sizeof k, "%s", key);
        bk_status st = json_i64(label, k, e, 0, (int64_t)JSON_MAX_WHOLE, &x);
        if (st != BK_OK)
            return st;
        if (x >= vocab)
            return bk_error(BK_ERR_CONFIG,
                            "%s: %s = %lld is outside the vocabulary [0, %lld) (vocab_size)",
                            label, k, (long long)x, (long long)vocab);
        if (i == 0)
            first = x;
    }
    *out = first;
    return BK_OK;
}

static bk_status parse_dtype(const char *label, const cJSON *root, bk_dtype *out)
{
    static const struct {
        const char *name;
        bk_dtype dt;
    } names[] = {
        {"float32", BK_DT_F32}, {"float", BK_DT_F32},   {"float16", BK_DT_F16},
        {"half", BK_DT_F16},    {"bfloat16", BK_DT_BF16}, {"float64", BK_DT_F64},
        {"double", BK_DT_F64},
    };
    const char *key = "dtype";
    const cJSON *v = get(root, "dtype"); /* transformers 5.x */
    if (!v) {
        key = "torch_dtype"; /* transformers 4.x */
        v = get(root, "torch_dtype");
    }
    *out = BK_DT_F32; /* what transformers assumes when the key is absent */
    if (!v)
        return BK_OK;
    if (!cJSON_IsString(v))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be a string (got %s)", label, key,
                        json_type_name(v));
    const char *s = v->valuestring;
    if (!strncmp(s, "torch.", 6))
        s += 6;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].dt;
            return BK_OK;
        }
    return bk_error(BK_ERR_UNSUPPORTED,
                    "%s: %s '%.40s' is not supported (supported: float32, float16, bfloat16, "
                    "float64)",
                    label, key, v->valuestring);
}

/* RoPE: transformers 4.x (`rope_theta` + `rope_scaling` with `type` or
 * `rope_type`) and 5.x (`rope_parameters` holding everything). Like
 * transformers, a non-empty rope_scaling wins over rope_parameters. */
static bk_status parse_rope(const char *label, const cJSON *root, bk_model_config *c)
{
    bk_status st;
    const char *where = "rope_scaling";
    const cJSON *rp = get(root, "rope_scaling");
    if (!rp || (cJSON_IsObject(rp) && !rp->child)) {
        where = "rope_parameters";
        rp = get(root, "rope_parameters");
    }
    if (rp && !cJSON_IsObject(rp))
        return bk_error(BK_ERR_CONFIG, "%s: %s must be an object (got %s)", label, where,
                        json_type_name(rp));
    char key[96];
    snprintf(key, sizeof key, "%s.", where);
    if (rp && (st = check_duplicate_keys(label, rp, key)) != BK_OK)
        return st;

#define RKEY(k) (snprintf(key, sizeof key, "%s.%s", where, (k)), key)

    /* rope_theta: inside the dict, else top level, else 10000 */
    c->rope_theta = 10000.0;
    const cJSON *th = rp ? get(rp, "rope_theta") : NULL;
    if (th) {
        if ((st = json_num(label, RKEY("rope_theta"), th, 1, &c->rope_theta)) != BK_OK)
            return st;
    } else if ((th = get(root, "rope_theta")) != NULL) {
        if ((st = json_num(label, "rope_theta", th, 1, &c->rope_theta)) != BK_OK)
            return st;
    }

    /* partial rotary embeddings change the RoPE of every model class */
    const cJSON *prf = rp ? get(rp, "partial_rotary_factor") : NULL;
    const char *prf_key = prf ? RKEY("partial_rotary_factor") : "partial_rotary_factor";
    if (!prf)
        prf = get(root, "partial_rotary_factor");
    if (prf) {
        double f = 1.0;
        if ((st = json_num(label, prf_key, prf, 1, &f)) != BK_OK)
            return st;
        if (f != 1.0)
            return bk_error(BK_ERR_UNSUPPORTED,
                            "%s: %s = %g is not supported (only full rotary embeddings, 1.0)",
                            label, prf_key, f);
    }

    c->rope_type = BK_ROPE_DEFAULT;
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = 0.0;
    c->rope_high_freq_factor = 0.0;
    c->rope_original_max_positions = 0;
    if (!rp)
        return BK_OK;

    for (const cJSON *e = rp->child; e; e = e->next)
        if (cJSON_IsObject(e))
            return bk_error(BK_ERR_UNSUPPORTED,
                            "%s: %s.%s: per-layer-type RoPE parameters are not supported", label,
                            where, e->string ? e->string : "?");

    const cJSON *ty = get(rp, "rope_type");
    const char *tykey = "rope_type";
    if (!ty) {
        ty = get(rp, "type");
        tykey = "type";
    }
    const char *type = "default";
    if (ty) {
        if (!cJSON_IsString(ty))
            return bk_error(BK_ERR_CONFIG, "%s: %s must be a string (got %s)", label,
                            RKEY(tykey), json_type_name(ty));
        type = ty->valuestring;
    }

    if (!strcmp(type, "default"))
        return BK_OK;
    if (!strcmp(type, "linear")) {
        const cJSON *f = get(rp, "factor");
        if (!f)
            return bk_error(BK_ERR_CONFIG, "%s: %s is missing 'factor' (required for rope_type "
                            "linear)", label, where);
        if ((st = json_num(label, RKEY("factor"), f, 1, &c->rope_factor)) != BK_OK)
            return st;
        c->rope_type = BK_ROPE_LINEAR;
        return BK_OK;
    }
    if (!strcmp(type, "llama3")) {
        static const char *const req[] = {"factor", "low_freq_factor", "high_freq_factor"};
        char missing[128] = "";
        for (size_t i = 0; i < 3; i++)
            if (!get(rp, req[i])) {
                size_t l = strlen(missing);
                snprintf(missing + l, sizeof missing - l, "%s%s", l ? ", " : "", req[i]);
            }
        if (missing[0])
            return bk_error(BK_ERR_CONFIG, "%s: %s is missing %s (required for rope_type llama3)",
                            label, where, missing);
        if ((st = json_num(label, RKEY("factor"), get(rp, "factor"), 1, &c->rope_factor)) != BK_OK)
            return st;
        if ((st = json_num(label, RKEY("low_freq_factor"), get(rp, "low_freq_factor"), 1,
                           &c->rope_low_freq_factor)) != BK_OK)
            return st;
        if ((st = json_num(label, RKEY("high_freq_factor"), get(rp, "high_freq_factor"), 1,
                           &c->rope_high_freq_factor)) != BK_OK)
            return st;
        if (!(c->rope_high_freq_factor > c->rope_low_freq_factor))
            return bk_error(BK_ERR_CONFIG,
                            "%s: %s: high_freq_factor (%g) must be greater than low_freq_factor "
                            "(%g)",
                            label, where, c->rope_high_freq_factor, c->rope_low_freq_factor);
        /* original_max_position_embeddings: in the dict, else top level,
         * else max_position_embeddings (transformers 5.x standardization) */
        const cJSON *om = get(rp, "original_max_position_embeddings");
        const char *omkey = om ? RKEY("original_max_position_embeddings") :
                                 "original_max_position_embeddings";
        if (!om)
            om = get(root, "original_max_position_embeddings");
        c->rope_original_max_positions = c->max_positions;
        if (om && (st = json_i64(label, omkey, om, 1, MAX_POSITIONS,
                                 &c->rope_original_max_positions)) != BK_OK)
            return st;
        c->rope_type = BK_ROPE_LLAMA3;
        return BK_OK;
    }
    return bk_error(BK_ERR_UNSUPPORTED,
                    "%s: %s.%s '%.40s' is not supported (supported: default, linear, llama3)",
                    label, where, tykey, type);
#undef RKEY
}

static bk_status parse_config(const char *json, size_t len, const char *label,
                              bk_model_config *c, int *quantized)
{
    bk_status st = BK_OK;
    memset(c, 0, sizeof *c);
    if (quantized)
        *quantized = 0;
    if (!label)
        label = "config.json";
    if (!json)
        return bk_error(BK_ERR_INVALID_ARG, "%s: no text to parse", label);

    /* a NUL (raw or \u0000) would cut a key or value short: refused, as are raw
     * control characters */
    if ((st = bk_json_check_text(json, len, label, BK_ERR_CONFIG)) != BK_OK)
        return st;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t off = (end && end >= json && end <= json + len) ? (size_t)(end - json) : len;
        return bk_error(BK_ERR_CONFIG, "%s: not valid JSON (error near byte %zu of %zu)", label,
                        off, len);
    }
    /* cJSON stops after the first value: anything but whitespace after it is
     * an error */
    for (const char *p = end; p && p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return bk_error(BK_ERR_CONFIG,
                            "%s: not valid JSON (unexpected content after the top-level value at "
                            "byte %zu of %zu)",
                            label, (size_t)(p - json), len);
        }
    if (!cJSON_IsObject(root)) {
        st = bk_error(BK_ERR_CONFIG, "%s: the top level must be a JSON object (got %s)", label,
                      json_type_name(root));
        goto done;
    }
    if ((st = check_duplicate_keys(label, root, "")) != BK_OK)
        goto done;

    /* model_type first: an unsupported model is reported as such */
    const arch_info *ai = NULL;
    const char *mt;
    if ((st = opt_string(label, root, "model_type", &mt)) != BK_OK)
        goto done;
    if (mt) {
        for (size_t i = 0; i < N_ARCH; i++)
            if (!strcmp(mt, arch_table[i].model_type))
                ai = &arch_table[i];
        if (!ai) {
            st = bk_error(BK_ERR_UNSUPPORTED,
                          "%s: model_type '%.40s' is not supported (supported: " SUPPORTED_TYPES
                          ")",
                          label, mt);
            goto done;
        }
    }

    /* every missing required field at once */
    static const char *const required[] = {"model_type",          "num_hidden_layers",
                                           "hidden_size",         "intermediate_size",
                                           "num_attention_heads", "vocab_size"};
    char missing[256] = "";
    int n_missing = 0;
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!get(root, required[i])) {
            size_t l = strlen(missing);
            snprintf(missing + l, sizeof missing - l, "%s%s", l ? ", " : "", required[i]);
            n_missing++;
        }
    if (n_missing) {
        st = bk_error(BK_ERR_CONFIG, "%s: missing required field%s: %s", label,
                      n_missing > 1 ? "s" : "", missing);
        goto done;
    }

    c->arch = ai->arch;
    snprintf(c->model_type, sizeof c->model_type, "%s", ai->model_type);

    if ((st = json_i64(label, "num_hidden_layers", get(root, "num_hidden_layers"), 1, MAX_LAYERS,
                       &c->n_layers)) != BK_OK ||
        (st = json_i64(label, "hidden_size", get(root, "hidden_size"), 1, MAX_HIDDEN,
                       &c->hidden)) != BK_OK ||
        (st = json_i64(label, "intermediate_size", get(root, "intermediate_size"), 1,
                       MAX_INTERMEDIATE, &c->intermediate)) != BK_OK ||
        (st = json_i64(label, "num_attention_heads", get(root, "num_attention_heads"), 1,
                       MAX_HEADS, &c->n_heads)) != BK_OK ||
        (st = json_i64(label, "vocab_size", get(root, "vocab_size"), 1, MAX_VOCAB, &c->vocab)) !=
            BK_OK)
        goto done;

    /* num_key_value_heads */
    int kv_given = get(root, "num_key_value_heads") != NULL;
    c->n_kv_heads = ai->kv_heads > 0 ? ai->kv_heads : c->n_heads;
    if ((st = opt_i64(label, root, "num_key_value_heads", 1, MAX_HEADS, &c->n_kv_heads)) != BK_OK)
        goto done;
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0) {
        st = bk_error(BK_ERR_CONFIG,
                      "%s: num_attention_heads (%lld) must be a multiple of num_key_value_heads "
                      "(%lld%s)",
                      label, (long long)c->n_heads, (long long)c->n_kv_heads,
                      kv_given ? "" : ", the default for this model_type");
        goto done;
    }

    /* head_dim */
    if (get(root, "head_dim")) {
        if ((st = opt_i64(label, root, "head_dim", 1, MAX_HEAD_DIM, &c->head_dim)) != BK_OK)
            goto done;
    } else if (ai->head_dim > 0) {
        c->head_dim = ai->head_dim;
    } else {
        if (c->hidden % c->n_heads != 0) {
            st = bk_error(BK_ERR_CONFIG,
                          "%s: hidden_size (%lld) must be a multiple of num_attention_heads "
                          "(%lld) when head_dim is not given",
                          label, (long long)c->hidden, (long long)c->n_heads);
            goto done;
        }
        c->head_dim = c->hidden / c->n_heads;
    }
    if (c->head_dim % 2 != 0) {
        st = bk_error(BK_ERR_CONFIG, "%s: head_dim (%lld) must be even (rotary embeddings rotate "
                      "pairs)", label, (long long)c->head_dim);
        goto done;
    }
    if (c->n_heads * c->head_dim > MAX_ATTN_WIDTH) {
        st = bk_error(BK_ERR_CONFIG,
                      "%s: num_attention_heads x head_dim = %lld x %lld is out of range (at most "
                      "%lld)",
                      label, (long long)c->n_heads, (long long)c->head_dim,
                      (long long)MAX_ATTN_WIDTH);
        goto done;
    }

    c->max_positions = ai->max_pos;
    if ((st = opt_i64(label, root, "max_position_embeddings", 1, MAX_POSITIONS,
                      &c->max_positions)) != BK_OK)
        goto done;

    c->rms_eps = 1e-6;
    const cJSON *eps = get(root, "rms_norm_eps");
    if (eps) {
        if ((st = json_num(label, "rms_norm_eps", eps, 1, &c->rms_eps)) != BK_OK)
            goto done;
        if (c->rms_eps >= 1.0) {
            st = bk_error(BK_ERR_CONFIG, "%s: rms_norm_eps = %g is out of range (expected 0 < "
                          "eps < 1)", label, c->rms_eps);
            goto done;
        }
    }

    if ((st = parse_rope(label, root, c)) != BK_OK)
        goto done;
    /* every RoPE frequency and angle finite (a tiny rope_theta underflows) */
    if ((st = bk_rope_check_config(c, c->max_positions, label)) != BK_OK)
        goto done;

    /* structure */
    /* sliding-window attention: Mistral's sliding_window (int or null); Qwen2
     * applies it only with use_sliding_window=true, and then only to layers >=
     * max_window_layers, which we do not implement */
    c->sliding_window = 0;
    if (c->arch == BK_ARCH_MISTRAL) {
        const cJSON *sw = get(root, "sliding_window");
        if (sw && !cJSON_IsNull(sw) &&
            (st = json_i64(label, "sliding_window", sw, 1, INT64_C(1) << 40, &c->sliding_window)) !=
                BK_OK)
            goto done;
    } else if (c->arch == BK_ARCH_QWEN2) {
        int use_sw = 0;
        if ((st = opt_bool(label, root, "use_sliding_window", &use_sw)) != BK_OK)
            goto done;
        if (use_sw) {
            st = bk_error(BK_ERR_UNSUPPORTED,
                          "%s: use_sliding_window=true (per-layer sliding-window attention) is not "
                          "supported",
                          label);
            goto done;
        }
    }

    c->tie_embeddings = 0; /* all four configuration classes default to false */
    if ((st = opt_bool(label, root, "tie_word_embeddings", &c->tie_embeddings)) != BK_OK)
        goto done;
    if (ai->qkv_bias_fixed) {
        c->qkv_bias = 1;
        c->o_bias = 0;
    }
    if (ai->reads_attn_bias) {
        int ab = 0;
        if ((st = opt_bool(label, root, "attention_bias", &ab)) != BK_OK)
            goto done;
        c->qkv_bias = c->o_bias = ab;
    }
    if (ai->reads_mlp_bias && (st = opt_bool(label, root, "mlp_bias", &c->mlp_bias)) != BK_OK)
        goto done;
    c->qk_norm = ai->qk_norm;

    snprintf(c->hidden_act, sizeof c->hidden_act, "silu");
    const char *act;
    if ((st = opt_string(label, root, "hidden_act", &act)) != BK_OK)
        goto done;
    if (act && strcmp(act, "silu") != 0) {
        st = bk_error(BK_ERR_UNSUPPORTED, "%s: hidden_act '%.40s' is not supported (only silu)",
                      label, act);
        goto done;
    }

    if ((st = parse_dtype(label, root, &c->dtype)) != BK_OK)
        goto done;

    /* the architecture's default ids, where the vocabulary holds them (a config
     * with vocab_size 1 and no ids has none: found by the config fuzz target) */
    c->bos_token_id = ai->bos < c->vocab ? ai->bos : -1;
    c->eos_token_id = ai->eos < c->vocab ? ai->eos : -1;
    if ((st = token_id(label, root, "bos_token_id", c->vocab, &c->bos_token_id)) != BK_OK ||
        (st = token_id(label, root, "eos_token_id", c->vocab, &c->eos_token_id)) != BK_OK)
        goto done;

    /* already-quantized checkpoints */
    const cJSON *qc = get(root, "quantization_config");
    if (qc) {
        if (!cJSON_IsObject(qc)) {
            st = bk_error(BK_ERR_CONFIG, "%s: quantization_config must be an object (got %s)",
                          label, json_type_name(qc));
            goto done;
        }
        const cJSON *qm = get(qc, "quant_method");
        if (!qm) {
            st = bk_error(BK_ERR_CONFIG, "%s: quantization_config has no quant_method", label);
            goto done;
        }
        if (!cJSON_IsString(qm)) {
            st = bk_error(BK_ERR_CONFIG,
                          "%s: quantization_config.quant_method must be a string (got %s)",
                          label, json_type_name(qm));
            goto done;
        }
        const int gptq = !strcmp(qm->valuestring, "gptq");
        if (strcmp(qm->valuestring, "bakron") != 0 && !gptq) {
            st = bk_error(BK_ERR_UNSUPPORTED,
                          "%s: quantization_config.quant_method '%.40s': the checkpoint is "
                          "already quantized (only unquantized checkpoints, bakron native and "
                          "GPTQ v1 checkpoints are supported)",
                          label, qm->valuestring);
            goto done;
        }
        if (quantized)
            *quantized = gptq ? 2 : 1;
    }

done:
    cJSON_Delete(root);
    if (st != BK_OK)
        memset(c, 0, sizeof *c);
    return st;
}

bk_status bk_model_config_parse(const char *json, size_t len, const char *label,
                                bk_model_config *cfg)
{
    if (!cfg)
        return bk_error(BK_ERR_INVALID_ARG, "bk_model_config_parse: cfg is NULL");
    return parse_config(json, len, label, cfg, NULL);
}

static bk_status load_config(const char *path, bk_model_config *cfg, int *quantized)
{
    char *buf = NULL;
    size_t len = 0;
    bk_status st = bk_read_file(path, BK_CONFIG_MAX_BYTES, &buf, &len);
    if (st != BK_OK)
        return st;
    const char *nul = memchr(buf, '\0', len);
    if (nul) {
        st = bk_error(BK_ERR_CONFIG, "%s: a NUL byte at offset %zu (JSON text has none)", path,
                      (size_t)(nul - buf));
        free(buf);
        return st;
    }
    st = parse_config(buf, len, path, cfg, quantized);
    free(buf);
    return st;
}

bk_status bk_model_config_load(const char *path, bk_model_config *cfg)
{
    if (!path || !cfg)
        return bk_error(BK_ERR_INVALID_ARG, "bk_model_config_load: NULL argument");
    return load_config(path, cfg, NULL);
}

/* ---------------------------------------------------------------- modules */

static const char *const module_names[BK_MOD_COUNT] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj",
};

const char *bk_module_name(bk_module m)
{
    return ((unsigned)m < BK_MOD_COUNT) ? module_names[m] : "?";
}

void bk_module_shape(const bk_model_config *cfg, bk_module m, int64_t *out_features,
                     int64_t *in_features)
{
    int64_t o = 0, i = 0;
    int64_t qd = cfg->n_heads * cfg->head_dim, kvd = cfg->n_kv_heads * cfg->head_dim;
    switch (m) {
    case BK_MOD_Q: o = qd; i = cfg->hidden; break;
    case BK_MOD_K:
    case BK_MOD_V: o = kvd; i = cfg->hidden; break;
    case BK_MOD_O: o = cfg->hidden; i = qd; break;
    case BK_MOD_GATE:
    case BK_MOD_UP: o = cfg->intermediate; i = cfg->hidden; break;
    case BK_MOD_DOWN: o = cfg->hidden; i = cfg->intermediate; break;
    default: break;
    }
    if (out_features)
        *out_features = o;
    if (in_features)
        *in_features = i;
}

/* ------------------------------------------------- tensors a config implies */

enum slot {
    SL_IN_NORM = 0, SL_POST_NORM,
    SL_Q, SL_K, SL_V, SL_O,
    SL_Q_B, SL_K_B, SL_V_B, SL_O_B,
    SL_Q_NORM, SL_K_NORM,
    SL_GATE, SL_UP, SL_DOWN,
    SL_GATE_B, SL_UP_B, SL_DOWN_B,
    SL_COUNT
};

static const char *const slot_suffix[SL_COUNT] = {
    "input_layernorm.weight",  "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",   "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",   "self_attn.o_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",    "mlp.up_proj.weight",
    "mlp.down_proj.weight",    "mlp.gate_proj.bias",
    "mlp.up_proj.bias",        "mlp.down_proj.bias",
};

/* linear module of a weight slot, -1 otherwise */
static int slot_module(int s)
{
    switch (s) {
    case SL_Q: return BK_MOD_Q;
    case SL_K: return BK_MOD_K;
    case SL_V: return BK_MOD_V;
    case SL_O: return BK_MOD_O;
    case SL_GATE: return BK_MOD_GATE;
    case SL_UP: return BK_MOD_UP;
    case SL_DOWN: return BK_MOD_DOWN;
    default: return -1;
    }
}

static int slot_present(const bk_model_config *c, int s)
{
    switch (s) {
    case SL_Q_B: case SL_K_B: case SL_V_B: return c->qkv_bias;
    case SL_O_B: return c->o_bias;
    case SL_Q_NORM: case SL_K_NORM: return c->qk_norm;
    case SL_GATE_B: case SL_UP_B: case SL_DOWN_B: return c->mlp_bias;
    default: return 1;
    }
}

typedef struct tspec {
    char name[160];
    int ndim;
    int64_t shape[2];
    char why[200]; /* which config values imply the shape */
} tspec;

static void why_heads(char *b, size_t cap, const char *what, int64_t heads, int64_t hd)
{
    snprintf(b, cap, "%s=%lld x head_dim=%lld", what, (long long)heads, (long long)hd);
}

/* The shape explanation of a module's output / input width. */
static void dim_why(const bk_model_config *c, int which, char *b, size_t cap)
{
    switch (which) {
    case 0: snprintf(b, cap, "hidden_size=%lld", (long long)c->hidden); break;
    case 1: why_heads(b, cap, "num_attention_heads", c->n_heads, c->head_dim); break;
    case 2: why_heads(b, cap, "num_key_value_heads", c->n_kv_heads, c->head_dim); break;
    case 3: snprintf(b, cap, "intermediate_size=%lld", (long long)c->intermediate); break;
    default: b[0] = '\0';
    }
}

static void layer_spec(const bk_model_config *c, int64_t layer, int s, tspec *t)
{
    snprintf(t->name, sizeof t->name, "model.layers.%lld.%s", (long long)layer, slot_suffix[s]);
    /* dimension kinds: 0 hidden, 1 q width, 2 kv width, 3 intermediate */
    static const signed char out_kind[SL_COUNT] = {0, 0, 1, 2, 2, 0, 1, 2, 2, 0, -1, -1,
                                                   3, 3, 0, 3, 3, 0};
    static const signed char in_kind[SL_COUNT] = {-1, -1, 0, 0, 0, 1, -1, -1, -1, -1, -1, -1,
                                                  0,  0,  3, -1, -1, -1};
    int64_t dims[4] = {c->hidden, c->n_heads * c->head_dim, c->n_kv_heads * c->head_dim,
                       c->intermediate};
    char a[96], b[96];
    if (s == SL_Q_NORM || s == SL_K_NORM) {
        t->ndim = 1;
        t->shape[0] = c->head_dim;
        snprintf(t->why, sizeof t->why, "head_dim=%lld", (long long)c->head_dim);
        return;
    }
    dim_why(c, out_kind[s], a, sizeof a);
    t->shape[0] = dims[out_kind[s]];
    if (in_kind[s] < 0) {
        t->ndim = 1;
        snprintf(t->why, sizeof t->why, "%s", a);
    } else {
        t->ndim = 2;
        t->shape[1] = dims[in_kind[s]];
        dim_why(c, in_kind[s], b, sizeof b);
        snprintf(t->why, sizeof t->why, "%s, %s", a, b);
    }
}

enum { GL_EMBED = 0, GL_NORM, GL_LM_HEAD, GL_COUNT };

static int global_spec(const bk_model_config *c, int g, tspec *t)
{
    switch (g) {
    case GL_EMBED:
    case GL_LM_HEAD:
        if (g == GL_LM_HEAD && c->tie_embeddings)
            return 0;
        snprintf(t->name, sizeof t->name, "%s",
                 g == GL_EMBED ? "model.embed_tokens.weight" : "lm_head.weight");
        t->ndim = 2;
        t->shape[0] = c->vocab;
        t->shape[1] = c->hidden;
        snprintf(t->why, sizeof t->why, "vocab_size=%lld, hidden_size=%lld", (long long)c->vocab,
                 (long long)c->hidden);
        return 1;
    case GL_NORM:
        snprintf(t->name, sizeof t->name, "model.norm.weight");
        t->ndim = 1;
        t->shape[0] = c->hidden;
        snprintf(t->why, sizeof t->why, "hidden_size=%lld", (long long)c->hidden);
        return 1;
    default: return 0;
    }
}

static uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t r;
    return bk_add_u64(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t spec_numel(const tspec *t)
{
    uint64_t n = (uint64_t)t->shape[0];
    if (t->ndim == 2 && bk_mul_u64(n, (uint64_t)t->shape[1], &n))
        return UINT64_MAX;
    return n;
}

uint64_t bk_model_config_param_count(const bk_model_config *cfg)
{
    if (!cfg)
        return 0;
    tspec t;
    uint64_t per_layer = 0, total = 0;
    for (int s = 0; s < SL_COUNT; s++)
        if (slot_present(cfg, s)) {
            layer_spec(cfg, 0, s, &t);
            per_layer = sat_add(per_layer, spec_numel(&t));
        }
    if (bk_mul_u64(per_layer, (uint64_t)(cfg->n_layers > 0 ? cfg->n_layers : 0), &total))
        return UINT64_MAX;
    for (int g = 0; g < GL_COUNT; g++)
        if (global_spec(cfg, g, &t))
            total = sat_add(total, spec_numel(&t));
    return total;
}

/* ------------------------------------------------------------------ a model */

struct bk_model {
    char *dir;
    bk_model_config cfg;
    bk_st_set *set;
    int quantized;   /* 0 no, 1 bakron native, 2 GPTQ v1 */
    int64_t q_group; /* quantized: input columns per scale group, 0 = one per row */
    int q_bits;      /* GPTQ, and native "uniform": bits per code */
    int q_levels;    /* native "levels": L (codes -L..L); 0 for "uniform" */
    int q_asym;      /* native "uniform" with "sym": false (U8 codes + zero points) */
    int q_cmin, q_cmax; /* native: the stored codes' range (I8 centered, or U8) */
};

static int is_float_dtype(bk_dtype dt)
{
    return dt == BK_DT_F16 || dt == BK_DT_BF16 || dt == BK_DT_F32 || dt == BK_DT_F64;
}

/* ------------------------------------------- native quantized (bakron) layout */

static const cJSON *qc_item(const cJSON *qc, const char *key)
{
    return qc ? cJSON_GetObjectItemCaseSensitive(qc, key) : NULL;
}

/* quantization_config of a native export (quantized 1: format "native",
 * format_version 1) or of a GPTQ checkpoint (quantized 2: bits 2/3/4/8 into
 * *bits, checkpoint_format absent or "gptq" (v1: zero points stored minus
 * 1)); group_size -1 (per row: *group 0) or a positive integer. */
/* The alphabet of a native export: "alphabet": "levels" with "levels" L in
 * [1, 127] (I8 codes -L..L, one scale per row: group_size -1, sym), or
 * "uniform" with "bits" 2/3/4/8 and "sym" true (I8 codes -2^(b-1)..2^(b-1)-1)
 * or false (U8 codes 0..2^b-1 with zero points). What bakron quantize writes
 * (src/pipeline_export.c, bk__quantization_config). */
static bk_status read_native_alphabet(const char *path, const cJSON *qc, int64_t group,
                                      bk_model *m)
{
    const cJSON *a = qc_item(qc, "alphabet"), *lv = qc_item(qc, "levels");
    const cJSON *b = qc_item(qc, "bits"), *sym = qc_item(qc, "sym");
    if (!a)
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.alphabet is missing (a native "
                        "export names its alphabet: \"levels\" or \"uniform\")", path);
    if (!cJSON_IsString(a) || (strcmp(a->valuestring, "levels") && strcmp(a->valuestring, "uniform")))
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.alphabet must be \"levels\" or "
                        "\"uniform\"", path);
    if (sym && !cJSON_IsBool(sym))
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.sym must be true or false", path);
    if (!strcmp(a->valuestring, "levels")) {
        if (!lv)
            return bk_error(BK_ERR_CONFIG, "%s: quantization_config.levels is missing (alphabet "
                            "\"levels\")", path);
        char num[40] = "";
        if (cJSON_IsNumber(lv))
            snprintf(num, sizeof num, "%.17g", lv->valuedouble);
        if (!cJSON_IsNumber(lv) || floor(lv->valuedouble) != lv->valuedouble ||
            !(lv->valuedouble >= 1 && lv->valuedouble <= 127))
            return bk_error(BK_ERR_CONFIG, "%s: quantization_config.levels must be a whole number "
                            "in [1, 127] (I8 codes -L..L; got %s)", path,
                            cJSON_IsNumber(lv) ? num : "a non-number");
        if (b)
            return bk_error(BK_ERR_CONFIG, "%s: quantization_config: alphabet \"levels\" has no "
                            "\"bits\" (that is the uniform alphabet's)", path);
        if (group != 0)
            return bk_error(BK_ERR_CONFIG, "%s: quantization_config.group_size must be -1 with "
                            "alphabet \"levels\" (one scale per row; got %lld)", path,
                            (long long)group);
        if (sym && !cJSON_IsTrue(sym))
            return bk_error(BK_ERR_CONFIG, "%s: quantization_config.sym must be true with alphabet "
                            "\"levels\" (symmetric codes -L..L)", path);
        m->q_levels = (int)lv->valuedouble;
        m->q_cmin = -m->q_levels;
        m->q_cmax = m->q_levels;
        return BK_OK;
    }
    if (!b)
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.bits is missing (alphabet "
                        "\"uniform\")", path);
    if (!cJSON_IsNumber(b) || !(b->valuedouble == 2 || b->valuedouble == 3 ||
                                b->valuedouble == 4 || b->valuedouble == 8))
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.bits must be 2, 3, 4 or 8 "
                        "(alphabet \"uniform\")", path);
    if (lv)
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config: alphabet \"uniform\" has no "
                        "\"levels\" (that is the levels alphabet's)", path);
    if (!sym)
        return bk_error(BK_ERR_CONFIG, "%s: quantization_config.sym is missing (alphabet "
                        "\"uniform\": true for I8 centered codes, false for U8 codes with "
                        "zero points)", path);
    m->q_bits = (int)b->valuedouble;
    m->q_asym = cJSON_IsFalse(sym);
    m->q_cmin = m->q_asym ? 0 : -(1 << (m->q_bits - 1));
    m->q_cmax = m->q_asym ? (1 << m->q_bits) - 1 : (1 << (m->q_bits - 1)) - 1;
    return BK_OK;
}

static bk_status read_qconfig(const char *path, int quantized, bk_model *m)
{
    int64_t *group = &m->q_group;
    int *bits = &m->q_bits;
    cJSON *root;
    bk_status st = bk_read_json(path, BK_CONFIG_MAX_BYTES, &root);
    if (st != BK_OK)
        return st;
    const cJSON *qc = qc_item(root, "quantization_config");
    const cJSON *fmt = qc_item(qc, "format"), *ver = qc_item(qc, "format_version");
    const cJSON *b = qc_item(qc, "bits"), *cf = qc_item(qc, "checkpoint_format");
    const cJSON *gs = qc_item(qc, "group_size");
    if (quantized == 1 && (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "native") != 0 ||
                           !cJSON_IsNumber(ver) || ver->valuedouble != 1.0))
        st = bk_error(BK_ERR_UNSUPPORTED,
                      "%s: quantization_config: only bakron \"format\": \"native\" with "
                      "\"format_version\": 1 can be read",
                      path);
    else if (quantized == 2 && cf && (!cJSON_IsString(cf) || strcmp(cf->valuestring, "gptq") != 0))
        st = bk_error(BK_ERR_UNSUPPORTED,
                      "%s: quantization_config.checkpoint_format: only \"gptq\" (v1) is read",
                      path);
    else if (quantized == 2 &&
             (!cJSON_IsNumber(b) || !(b->valuedouble == 2 || b->valuedouble == 3 ||
                                      b->valuedouble == 4 || b->valuedouble == 8)))
        st = bk_error(BK_ERR_CONFIG, "%s: quantization_config.bits must be 2, 3, 4 or 8", path);
    else if (!cJSON_IsNumber(gs) || floor(gs->valuedouble) != gs->valuedouble ||
             !(gs->valuedouble == -1.0 || (gs->valuedouble >= 1 && gs->valuedouble <= 1e9)))
        st = bk_error(BK_ERR_CONFIG,
                      "%s: quantization_config.group_size must be -1 or a positive integer", path);
    else {
        *group = gs->valuedouble < 0 ? 0 : (int64_t)gs->valuedouble;
        if (quantized == 2)
            *bits = (int)b->valuedouble;
        else
            st = read_native_alphabet(path, qc, *group, m);
    }
    cJSON_Delete(root);
    return st;
}

static const bk_tensor_info *find_mod(const bk_model *m, int64_t l, int mod, const char *what)
{
    char name[256];
    snprintf(name, sizeof name, "model.layers.%lld.%s.%s", (long long)l, module_names[mod], what);
    return bk_st_set_find(m->set, name);
}

static int64_t q_groups(const bk_model *m, int64_t in)
{
    return m->q_group > 0 ? (in + m->q_group - 1) / m->q_group : 1;
}

/* The values of a module's scales or zero points, which are small (one per
 * row or group): native scales finite and > 0 (bakron quantize never writes
 * another: an all-zero row gets the scale of max |x| = 1), native zero points
 * finite in [0, 2^b - 1] (they are rint(-min / s) of a range holding 0),
 * GPTQ scales finite. */
enum { VAL_SCALES, VAL_ZEROS, VAL_FINITE };
static bk_status check_qvalues(const bk_tensor_info *t, int what, int qmax)
{
    size_t n = (size_t)t->numel;
    float *v = malloc((n ? n : 1) * sizeof(float));
    if (!v)
        return bk_error(BK_ERR_NOMEM, "%s: tensor %s: out of memory", t->file, t->name);
    bk_status st = bk_tensor_to_f32(t, v);
    const int64_t cols = t->ndim == 2 ? t->shape[1] : 1;
    for (size_t k = 0; st == BK_OK && k < n; k++) {
        const float x = v[k];
        const long long r = (long long)((int64_t)k / cols), c = (long long)((int64_t)k % cols);
        if (!isfinite(x))
            st = bk_error(BK_ERR_NONFINITE, "%s: tensor %s: %s %g at [%lld, %lld] (%s must be "
                          "finite)", t->file, t->name, what == VAL_ZEROS ? "zero point" : "scale",
                          (double)x, r, c, what == VAL_ZEROS ? "zero points" : "scales");
        else if (what == VAL_SCALES && !(x > 0.0f))
            st = bk_error(BK_ERR_INVALID_ARG, "%s: tensor %s: scale %g at [%lld, %lld] (native "
                          "scales must be > 0)", t->file, t->name, (double)x, r, c);
        else if (what == VAL_ZEROS && !(x >= 0.0f && x <= (float)qmax))
            st = bk_error(BK_ERR_INVALID_ARG, "%s: tensor %s: zero point %g at [%lld, %lld] is "
                          "outside the code range [0, %d]", t->file, t->name, (double)x, r, c,
                          qmax);
    }
    free(v);
    return st;
}

/* The alphabet of a native model, for messages: "levels 3 (codes -3..3)". */
static void native_alphabet_text(const bk_model *m, char *b, size_t cap)
{
    if (m->q_levels)
        snprintf(b, cap, "alphabet levels %d: codes %d..%d", m->q_levels, m->q_cmin, m->q_cmax);
    else
        snprintf(b, cap, "alphabet uniform %d-bit %s: codes %d..%d", m->q_bits,
                 m->q_asym ? "asymmetric" : "symmetric", m->q_cmin, m->q_cmax);
}

/* Codes of one native module against the alphabet: a min/max pass (no
 * branch in the loop), then the first offender for the message. */
static bk_status check_native_codes(const bk_model *m, const bk_tensor_info *q)
{
    const int64_t n = q->numel;
    int lo = 255, hi = -128;
    if (q->dtype == BK_DT_I8) {
        const int8_t *c = q->data;
        int8_t mn = 127, mx = -128;
        for (int64_t k = 0; k < n; k++) {
            mn = c[k] < mn ? c[k] : mn;
            mx = c[k] > mx ? c[k] : mx;
        }
        lo = mn, hi = mx;
    } else {
        const uint8_t *c = q->data;
        uint8_t mn = 255, mx = 0;
        for (int64_t k = 0; k < n; k++) {
            mn = c[k] < mn ? c[k] : mn;
            mx = c[k] > mx ? c[k] : mx;
        }
        lo = mn, hi = mx;
    }
    if (n == 0 || (lo >= m->q_cmin && hi <= m->q_cmax))
        return BK_OK;
    const int64_t cols = q->shape[1];
    for (int64_t k = 0; k < n; k++) {
        int v = q->dtype == BK_DT_I8 ? ((const int8_t *)q->data)[k] : ((const uint8_t *)q->data)[k];
        if (v < m->q_cmin || v > m->q_cmax) {
            char al[96];
            native_alphabet_text(m, al, sizeof al);
            return bk_error(BK_ERR_INVALID_ARG, "%s: tensor %s: code %d at [%lld, %lld] is outside "
                            "the alphabet (%s)", q->file, q->name, v, (long long)(k / cols),
                            (long long)(k % cols), al);
        }
    }
    return BK_OK;
}

bk_status bk__model_check_qweight(const bk_model *m, const bk_tensor_info *t)
{
    if (!m || m->quantized != 1 || !t || t->ndim != 2 ||
        (t->dtype != BK_DT_I8 && t->dtype != BK_DT_U8))
        return BK_OK; /* (shapes and dtypes: bk_model_open) */
    return check_native_codes(m, t);
}

/* A linear module of a native export: either an ordinary P.weight (layers
 * left unquantized) or P.qweight (I8 centered codes, or U8 codes with
 * P.qzeros) [out, in] + P.scales [out, groups]. */
static bk_status check_native_module(const bk_model *m, int64_t l, int mod, int *has_weight)
{
    int64_t o, in;
    bk_module_shape(&m->cfg, (bk_module)mod, &o, &in);
    *has_weight = find_mod(m, l, mod, "weight") != NULL;
    if (*has_weight)
        return BK_OK; /* checked as an ordinary weight */
    const bk_tensor_info *q = find_mod(m, l, mod, "qweight");
    const bk_tensor_info *sc = find_mod(m, l, mod, "scales");
    const bk_tensor_info *z = find_mod(m, l, mod, "qzeros");
    char pre[200];
    snprintf(pre, sizeof pre, "model.layers.%lld.%s", (long long)l, module_names[mod]);
    if (!q || !sc)
        return bk_error(BK_ERR_MISSING_TENSOR,
                        "%s: %s: neither %s.weight nor %s.qweight + %s.scales is present", m->dir,
                        pre, pre, pre, pre);
    int64_t g = q_groups(m, in);
    if (m->quantized == 2) {
        /* GPTQ v1: qweight I32 [in*b/32, out], qzeros I32 [g, out*b/32],
         * scales float [g, out], g_idx I32 [in] (optional) */
        const int b = m->q_bits;
        const bk_tensor_info *gi = find_mod(m, l, mod, "g_idx");
        if ((in * b) % 32 || (o * b) % 32)
            return bk_error(BK_ERR_SHAPE, "%s: %s is [%lld, %lld]: %d-bit GPTQ packing needs "
                            "dimensions whose bit count is a multiple of 32", m->dir, pre,
                            (long long)o, (long long)in, b);
        if (q->ndim != 2 || q->shape[0] != in * b / 32 || q->shape[1] != o || q->dtype != BK_DT_I32)
            return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected I32 [%lld, %lld] (GPTQ %d-bit "
                            "packed codes)", q->file, q->name, (long long)(in * b / 32),
                            (long long)o, b);
        if (!z)
            return bk_error(BK_ERR_MISSING_TENSOR, "%s: %s.qzeros is missing (GPTQ)", m->dir, pre);
        if (z->ndim != 2 || z->shape[0] != g || z->shape[1] != o * b / 32 || z->dtype != BK_DT_I32)
            return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected I32 [%lld, %lld] (GPTQ packed "
                            "zero points, group_size %lld)", z->file, z->name, (long long)g,
                            (long long)(o * b / 32), (long long)(m->q_group ? m->q_group : -1));
        if (sc->ndim != 2 || sc->shape[0] != g || sc->shape[1] != o || !is_float_dtype(sc->dtype))
            return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected float [%lld, %lld] scales "
                            "(GPTQ, group_size %lld)", sc->file, sc->name, (long long)g,
                            (long long)o, (long long)(m->q_group ? m->q_group : -1));
        if (gi && (gi->ndim != 1 || gi->shape[0] != in || gi->dtype != BK_DT_I32))
            return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected I32 [%lld] (GPTQ g_idx)",
                            gi->file, gi->name, (long long)in);
        return check_qvalues(sc, VAL_FINITE, 0);
    }
    char al[96];
    native_alphabet_text(m, al, sizeof al);
    const bk_dtype want = m->q_asym ? BK_DT_U8 : BK_DT_I8;
    if (q->ndim != 2 || q->shape[0] != o || q->shape[1] != in || q->dtype != want)
        return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected %s [%lld, %lld] codes (%s)", q->file,
                        q->name, bk_dtype_name(want), (long long)o, (long long)in, al);
    if (sc->ndim != 2 || sc->shape[0] != o || sc->shape[1] != g || !is_float_dtype(sc->dtype))
        return bk_error(BK_ERR_SHAPE,
                        "%s: tensor %s: expected float [%lld, %lld] scales (group_size %lld)",
                        sc->file, sc->name, (long long)o, (long long)g, (long long)(m->q_group ? m->q_group : -1));
    bk_status st;
    if ((st = check_qvalues(sc, VAL_SCALES, 0)) != BK_OK)
        return st;
    if (m->q_asym) {
        if (!z)
            return bk_error(BK_ERR_MISSING_TENSOR, "%s: %s.qzeros is missing (U8 codes are asymmetric)",
                            m->dir, pre);
        if (z->ndim != 2 || z->shape[0] != o || z->shape[1] != g || !is_float_dtype(z->dtype))
            return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected float [%lld, %lld] zeros",
                            z->file, z->name, (long long)o, (long long)g);
        return check_qvalues(z, VAL_ZEROS, m->q_cmax);
    } else if (z) {
        return bk_error(BK_ERR_UNEXPECTED_TENSOR,
                        "%s: unexpected tensor %s (I8 codes are symmetric: no zero points)", z->file,
                        z->name);
    }
    return BK_OK;
}

/* `bits` bits (LSB first) at bit position `bit` of a packed column whose
 * 32-bit words are `stride` apart (GPTQ packing). */
static uint32_t unpack_bits(const uint8_t *words, int64_t stride, int64_t bit, int bits)
{
    int64_t w = bit / 32;
    int off = (int)(bit % 32);
    uint32_t lo, hi = 0;
    memcpy(&lo, words + (size_t)(w * stride) * 4, 4);
    uint64_t v = lo >> off;
    if (off + bits > 32) {
        memcpy(&hi, words + (size_t)((w + 1) * stride) * 4, 4);
        v |= (uint64_t)hi << (32 - off);
    }
    return (uint32_t)(v & ((1u << bits) - 1));
}

/* GPTQ v1: w[i][j] = scales[g][i] * (q[j][i] - (qzeros[g][i] + 1)), g = g_idx[j]. */
static bk_status gptq_linear_f32(const bk_model *m, int layer, int mod, float *dst)
{
    int64_t o, in;
    bk_module_shape(&m->cfg, (bk_module)mod, &o, &in);
    const bk_tensor_info *q = find_mod(m, layer, mod, "qweight");
    const bk_tensor_info *sc = find_mod(m, layer, mod, "scales");
    const bk_tensor_info *z = find_mod(m, layer, mod, "qzeros");
    const bk_tensor_info *gi = find_mod(m, layer, mod, "g_idx");
    const int b = m->q_bits;
    int64_t g = q_groups(m, in), gs = m->q_group > 0 ? m->q_group : in;
    float *s = malloc((size_t)(o * g) * sizeof(float));
    int32_t *gidx = malloc((size_t)in * sizeof(int32_t));
    bk_status st = BK_OK;
    if (!s || !gidx) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", q->name);
        goto done;
    }
    if ((st = bk_tensor_to_f32(sc, s)) != BK_OK)
        goto done;
    for (int64_t j = 0; j < in; j++) {
        int32_t v = (int32_t)(j / gs);
        if (gi) {
            memcpy(&v, (const uint8_t *)gi->data + (size_t)j * 4, 4);
            if (v < 0 || v >= g) {
                st = bk_error(BK_ERR_SHAPE, "%s: tensor %s: value %d at %lld is not a group "
                              "index (%lld groups)", gi->file, gi->name, (int)v, (long long)j,
                              (long long)g);
                goto done;
            }
        }
        gidx[j] = v;
    }
    for (int64_t i = 0; i < o; i++) {
        for (int64_t j = 0; j < in; j++) {
            int64_t k = gidx[j];
            uint32_t c = unpack_bits((const uint8_t *)q->data + (size_t)i * 4, o, j * b, b);
            uint32_t zz = unpack_bits((const uint8_t *)z->data + (size_t)(k * (o * b / 32)) * 4,
                                      1, i * b, b);
            dst[i * in + j] = ((float)c - (float)(zz + 1)) * s[k * o + i];
        }
    }
done:
    free(s);
    free(gidx);
    return st;
}

static bk_status native_linear_f32(const bk_model *m, int layer, int mod, float *dst)
{
    if (m->quantized == 2)
        return gptq_linear_f32(m, layer, mod, dst);
    int64_t o, in;
    bk_module_shape(&m->cfg, (bk_module)mod, &o, &in);
    const bk_tensor_info *q = find_mod(m, layer, mod, "qweight");
    const bk_tensor_info *sc = find_mod(m, layer, mod, "scales");
    const bk_tensor_info *z = find_mod(m, layer, mod, "qzeros");
    int64_t g = q_groups(m, in), gs = m->q_group > 0 ? m->q_group : in;
    float *s = malloc((size_t)(o * g) * sizeof(float));
    float *zz = z ? malloc((size_t)(o * g) * sizeof(float)) : NULL;
    bk_status st = BK_OK;
    if (!s || (z && !zz)) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", q->name);
        goto done;
    }
    if ((st = bk_tensor_to_f32(sc, s)) != BK_OK || (z && (st = bk_tensor_to_f32(z, zz)) != BK_OK))
        goto done;
    const int8_t *ci = q->data;
    const uint8_t *cu = q->data;
    /* the codes are checked against the alphabet as they are read: the
     * row's min and max, compared once per row */
    for (int64_t i = 0; i < o; i++) {
        int lo = m->q_cmin, hi = m->q_cmax;
        if (q->dtype == BK_DT_I8) {
            int8_t mn = 127, mx = -128;
            for (int64_t j = 0; j < in; j++) {
                const int8_t c = ci[i * in + j];
                mn = c < mn ? c : mn;
                mx = c > mx ? c : mx;
                dst[i * in + j] = (float)c * s[i * g + j / gs];
            }
            lo = mn, hi = mx;
        } else {
            uint8_t mn = 255, mx = 0;
            for (int64_t j = 0; j < in; j++) {
                const uint8_t c = cu[i * in + j];
                const int64_t k = i * g + j / gs;
                mn = c < mn ? c : mn;
                mx = c > mx ? c : mx;
                dst[i * in + j] = ((float)c - zz[k]) * s[k];
            }
            lo = mn, hi = mx;
        }
        if (in > 0 && (lo < m->q_cmin || hi > m->q_cmax)) {
            st = check_native_codes(m, q); /* names the first offender */
            goto done;
        }
    }
done:
    free(s);
    free(zz);
    return st;
}


static void fmt_shape(char *b, size_t cap, int ndim, const int64_t *shape)
{
    size_t l = 0;
    l += (size_t)snprintf(b + l, cap - l, "[");
    for (int i = 0; i < ndim && l < cap; i++)
        l += (size_t)snprintf(b + l, cap - l, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (l < cap)
        snprintf(b + l, cap - l, "]");
}

/* Compare one present tensor with its spec. */
static bk_status check_tensor(const bk_tensor_info *ti, const tspec *t)
{
    int ok = ti->ndim == t->ndim;
    for (int i = 0; ok && i < t->ndim; i++)
        ok = ti->shape[i] == t->shape[i];
    if (!ok) {
        char got[128], want[64];
        fmt_shape(got, sizeof got, ti->ndim, ti->shape);
        fmt_shape(want, sizeof want, t->ndim, t->shape);
        return bk_error(BK_ERR_SHAPE, "%s: tensor %s: shape %s, config implies %s (from %s)",
                        ti->file, ti->name, got, want, t->why);
    }
    if (!is_float_dtype(ti->dtype))
        return bk_error(BK_ERR_DTYPE,
                        "%s: tensor %s: dtype %s, expected a floating-point dtype (F16, BF16, "
                        "F32, F64)",
                        ti->file, ti->name, bk_dtype_name(ti->dtype));
    return BK_OK;
}

typedef struct missing_list {
    size_t count;
    char text[640];
    int lm_head;
} missing_list;

static void missing_add(missing_list *ml, const char *name)
{
    if (ml->count < 5) {
        size_t l = strlen(ml->text);
        snprintf(ml->text + l, sizeof ml->text - l, "%s%s", l ? ", " : "", name);
    }
    if (!strcmp(name, "lm_head.weight"))
        ml->lm_head = 1;
    ml->count++;
}

/* Names of the form model.layers.N.REST with canonical decimal N. */
static int parse_layer_name(const char *name, int64_t *layer, const char **rest)
{
    static const char pre[] = "model.layers.";
    if (strncmp(name, pre, sizeof pre - 1) != 0)
        return 0;
    const char *p = name + sizeof pre - 1;
    int64_t n = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        if (digits >= 12)
            return 0;
        n = n * 10 + (*p - '0');
        p++;
        digits++;
    }
    if (digits == 0 || *p != '.' || (digits > 1 && p[-digits] == '0'))
        return 0;
    *layer = n;
    *rest = p + 1;
    return 1;
}

static int harmless_extra(const char *name)
{
    return bk_ends_with(name, "rotary_emb.inv_freq");
}

static const char *unexpected_reason(const bk_model_config *c, const char *rest)
{
    static _Thread_local char buf[160];
    if (strstr(rest, "_proj.bias")) {
        if (!strncmp(rest, "mlp.", 4))
            return "the config has mlp_bias=false";
        if (!strncmp(rest, "self_attn.o_proj", 16) && c->arch == BK_ARCH_QWEN2)
            return "qwen2 has no o_proj bias";
        return "the config implies no attention biases";
    }
    if (strstr(rest, "q_norm") || strstr(rest, "k_norm"))
        return "only qwen3 has q_norm/k_norm";
    snprintf(buf, sizeof buf, "not a tensor of a %s decoder layer", c->model_type);
    return buf;
}

static bk_status cross_check(const bk_model *m)
{
    const bk_model_config *c = &m->cfg;
    const bk_st_set *set = m->set;
    missing_list ml;
    memset(&ml, 0, sizeof ml);
    bk_status first = BK_OK;
    char first_msg[1024] = "";
    tspec t;

#define CHECK_ONE()                                                                        \
    do {                                                                                   \
        const bk_tensor_info *ti = bk_st_set_find(set, t.name);                            \
        if (!ti) {                                                                         \
            missing_add(&ml, t.name);                                                      \
        } else if (first == BK_OK) {                                                       \
            bk_status cs = check_tensor(ti, &t);                                           \
            if (cs != BK_OK) {                                                             \
                first = cs;                                                                \
                snprintf(first_msg, sizeof first_msg, "%s", bk_last_error());              \
            }                                                                              \
        }                                                                                  \
    } while (0)

    if (global_spec(c, GL_EMBED, &t))
        CHECK_ONE();
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int s = 0; s < SL_COUNT; s++) {
            if (!slot_present(c, s))
                continue;
            if (m->quantized && slot_module(s) >= 0) {
                int has_weight = 0;
                if (first == BK_OK) {
                    bk_status qs = check_native_module(m, l, slot_module(s), &has_weight);
                    if (qs != BK_OK) {
                        first = qs;
                        snprintf(first_msg, sizeof first_msg, "%s", bk_last_error());
                    }
                }
                if (!has_weight)
                    continue; /* codes + scales */
            }
            layer_spec(c, l, s, &t);
            CHECK_ONE();
        }
    for (int g = GL_NORM; g < GL_COUNT; g++)
        if (global_spec(c, g, &t))
            CHECK_ONE();
#undef CHECK_ONE

    if (ml.count) {
        char more[48] = "";
        if (ml.count > 5)
            snprintf(more, sizeof more, " and %zu more", ml.count - 5);
        return bk_error(BK_ERR_MISSING_TENSOR, "%s: %zu tensor%s the config implies %s missing: "
                        "%s%s%s",
                        m->dir, ml.count, ml.count > 1 ? "s" : "", ml.count > 1 ? "are" : "is",
                        ml.text, more,
                        ml.lm_head ? " (config.json has tie_word_embeddings=false)" : "");
    }
    if (first != BK_OK)
        return bk_error(first, "%s", first_msg);

    /* unexpected tensors */
    size_t n = bk_st_set_count(set);
    for (size_t i = 0; i < n; i++) {
        const bk_tensor_info *ti = bk_st_set_tensor(set, i);
        const char *name = ti->name, *rest = NULL;
        int64_t layer;
        if (harmless_extra(name))
            continue;
        if (parse_layer_name(name, &layer, &rest)) {
            if (layer >= c->n_layers)
                return bk_error(BK_ERR_UNEXPECTED_TENSOR,
                                "%s: tensor %s: layer %lld does not exist (config.json has "
                                "num_hidden_layers=%lld)",
                                ti->file, name, (long long)layer, (long long)c->n_layers);
            int known = 0;
            for (int s = 0; s < SL_COUNT && !known; s++) {
                if (!slot_present(c, s))
                    continue;
                if (m->quantized && slot_module(s) >= 0) {
                    const char *mn = module_names[slot_module(s)];
                    size_t lm = strlen(mn);
                    known = !strncmp(rest, mn, lm) && rest[lm] == '.' &&
                            (!strcmp(rest + lm, ".weight") || !strcmp(rest + lm, ".qweight") ||
                             !strcmp(rest + lm, ".scales") || !strcmp(rest + lm, ".qzeros") ||
                             (m->quantized == 2 && !strcmp(rest + lm, ".g_idx")));
                } else {
                    known = !strcmp(rest, slot_suffix[s]);
                }
            }
            if (!known)
                return bk_error(BK_ERR_UNEXPECTED_TENSOR, "%s: unexpected tensor %s (%s)",
                                ti->file, name, unexpected_reason(c, rest));
            continue;
        }
        if (!strcmp(name, "lm_head.weight") && c->tie_embeddings)
            return bk_error(BK_ERR_UNEXPECTED_TENSOR,
                            "%s: unexpected tensor lm_head.weight: config.json has "
                            "tie_word_embeddings=true (the LM head is the embedding matrix)",
                            ti->file);
        if (!strcmp(name, "model.embed_tokens.weight") || !strcmp(name, "model.norm.weight") ||
            !strcmp(name, "lm_head.weight"))
            continue;
        if (!strncmp(name, "model.layers.", 13) ||
            (ti->ndim == 2 && bk_ends_with(name, ".weight")))
            return bk_error(BK_ERR_UNEXPECTED_TENSOR,
                            "%s: unexpected tensor %s (looks like a weight that a %s model "
                            "does not have)",
                            ti->file, name, c->model_type);
    }
    return BK_OK;
}

bk_status bk_model_open(const char *dir, bk_model **out)
{
    if (!out)
        return bk_error(BK_ERR_INVALID_ARG, "bk_model_open: out is NULL");
    *out = NULL;
    if (!dir || !dir[0])
        return bk_error(BK_ERR_INVALID_ARG, "bk_model_open: no folder given");
    if (!bk_is_dir(dir))
        return bk_error(BK_ERR_IO, "%s: not a model folder (expected a directory holding "
                        "config.json and safetensors)", dir);

    bk_status st;
    char path[4096];
    bk_model *m = calloc(1, sizeof *m);
    if (!m)
        return bk_error(BK_ERR_NOMEM, "%s: out of memory", dir);
    size_t ld = strlen(dir);
    while (ld > 1 && dir[ld - 1] == '/')
        ld--;
    m->dir = malloc(ld + 1);
    if (!m->dir) {
        st = bk_error(BK_ERR_NOMEM, "%s: out of memory", dir);
        goto fail;
    }
    memcpy(m->dir, dir, ld);
    m->dir[ld] = '\0';

    if ((st = bk_path_join(path, sizeof path, m->dir, "config.json")) != BK_OK)
        goto fail;
    if (!bk_is_file(path)) {
        struct stat sb;
        if (stat(path, &sb) == 0) /* there, but a folder, FIFO or device */
            st = bk_error(BK_ERR_IO, "%s: is %s, not a regular file", path,
                          bk_file_kind(sb.st_mode));
        else
            st = bk_error(BK_ERR_IO, "%s: no config.json in the model folder", m->dir);
        goto fail;
    }
    if ((st = load_config(path, &m->cfg, &m->quantized)) != BK_OK)
        goto fail;
    if (m->quantized && (st = read_qconfig(path, m->quantized, m)) != BK_OK)
        goto fail;
    if ((st = bk_st_set_open(m->dir, &m->set)) != BK_OK)
        goto fail;
    if ((st = cross_check(m)) != BK_OK)
        goto fail;
    *out = m;
    return BK_OK;
fail:
    bk_model_close(m);
    return st;
}

void bk_model_close(bk_model *m)
{
    if (!m)
        return;
    if (m->set)
        bk_st_set_close(m->set);
    free(m->dir);
    free(m);
}

const bk_model_config *bk_model_get_config(const bk_model *m)
{
    return m ? &m->cfg : NULL;
}

const bk_st_set *bk_model_tensors(const bk_model *m)
{
    return m ? m->set : NULL;
}

const char *bk_model_dir(const bk_model *m)
{
    return m ? m->dir : NULL;
}

const char *bk_model_quant_format(const bk_model *m)
{
    if (!m || !m->quantized)
        return NULL;
    return m->quantized == 2 ? "GPTQ v1" : "bakron native";
}

int bk_model_is_quantized(const bk_model *m)
{
    return m ? m->quantized : 0;
}

const bk_tensor_info *bk_model_find(const bk_model *m, int layer, const char *suffix)
{
    if (!m || !suffix)
        return NULL;
    char name[512];
    int n;
    if (layer >= 0) {
        n = snprintf(name, sizeof name, "model.layers.%d.%s", layer, suffix);
        return (n > 0 && (size_t)n < sizeof name) ? bk_st_set_find(m->set, name) : NULL;
    }
    n = snprintf(name, sizeof name, "model.%s", suffix);
    const bk_tensor_info *t = (n > 0 && (size_t)n < sizeof name) ? bk_st_set_find(m->set, name)
                                                                  : NULL;
    return t ? t : bk_st_set_find(m->set, suffix);
}

bk_status bk_model_linear_f32(const bk_model *m, int layer, bk_module mod, float *dst)
{
    if (!m || !dst)
        return bk_error(BK_ERR_INVALID_ARG, "bk_model_linear_f32: NULL argument");
    if (layer < 0 || layer >= m->cfg.n_layers)
        return bk_error(BK_ERR_INVALID_ARG, "%s: layer %d out of range (num_hidden_layers=%lld)",
                        m->dir, layer, (long long)m->cfg.n_layers);
    if ((unsigned)mod >= BK_MOD_COUNT)
        return bk_error(BK_ERR_INVALID_ARG, "%s: invalid module %d", m->dir, (int)mod);
    if (m->quantized && !find_mod(m, layer, mod, "weight"))
        return native_linear_f32(m, layer, mod, dst);
    char suffix[64];
    snprintf(suffix, sizeof suffix, "%s.weight", module_names[mod]);
    const bk_tensor_info *t = bk_model_find(m, layer, suffix);
    if (!t)
        return bk_error(BK_ERR_MISSING_TENSOR, "%s: tensor model.layers.%d.%s is missing",
                        m->dir, layer, suffix);
    int64_t o, i;
    bk_module_shape(&m->cfg, mod, &o, &i);
    if (t->ndim != 2 || t->shape[0] != o || t->shape[1] != i)
        return bk_error(BK_ERR_SHAPE, "%s: tensor %s: expected shape [%lld, %lld]", t->file,
                        t->name, (long long)o, (long long)i);
    return bk_tensor_to_f32(t, dst);
}

const uint16_t *bk_model_linear_bf16_mapped(const bk_model *m, int layer, bk_module mod)
{
    if (!m || layer < 0 || layer >= m->cfg.n_layers || (unsigned)mod >= BK_MOD_COUNT)
        return NULL;
    if (m->quantized && !find_mod(m, layer, mod, "weight"))
        return NULL;
    char suffix[64];
    snprintf(suffix, sizeof suffix, "%s.weight", module_names[mod]);
    const bk_tensor_info *t = bk_model_find(m, layer, suffix);
    int64_t o, i;
    bk_module_shape(&m->cfg, mod, &o, &i);
    if (!t || !t->data || t->dtype != BK_DT_BF16 || t->ndim != 2 || t->shape[0] != o ||
        t->shape[1] != i || ((uintptr_t)t->data & 1u)) /* (odd offset: copied instead) */
        return NULL;
    return (const uint16_t *)t->data;
}
