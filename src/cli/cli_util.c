#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "outdir.h"
#include "util.h"

int cli_quiet_errors;

static void print_error_line(const char *cmd, bk_status st, const char *msg, int hint)
{
    size_t lc = strlen(cmd);
    if (!strncmp(msg, cmd, lc) && msg[lc] == ':' && msg[lc + 1] == ' ')
        msg += lc + 2;
    if (st == BK_ERR_USAGE && hint)
        fprintf(stderr, "bakron %s: error: %s (see 'bakron %s --help')\n", cmd, msg, cmd);
    else
        fprintf(stderr, "bakron %s: error: %s\n", cmd, msg);
}

void cli_print_error(const char *cmd, bk_status st)
{
    if (cli_diag_count() > 0) {
        /* the --help hint once, on the last usage line */
        int last_usage = -1;
        for (int k = 0; k < cli_diag_count(); k++) {
            const char *msg;
            if (cli_diag_get(k, &msg) == BK_ERR_USAGE)
                last_usage = k;
        }
        for (int k = 0; k < cli_diag_count(); k++) {
            const char *msg;
            bk_status sk = cli_diag_get(k, &msg);
            print_error_line(cmd, sk, msg, k == last_usage);
        }
    } else {
        const char *msg = bk_last_error();
        print_error_line(cmd, st, msg[0] ? msg : bk_status_name(st), 1);
    }
    fflush(stderr);
}


const char *cli_esc(const char *s, char *buf, size_t cap)
{
    bk_escape_message(s ? s : "", buf, cap);
    return buf;
}

static void on_signal(int sig)
{
    (void)sig;
    bk_request_stop();
}

void cli_install_signals(void)
{
    struct sigaction sa, cur;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (sigaction(SIGHUP, NULL, &cur) != 0 || cur.sa_handler != SIG_IGN)
        sigaction(SIGHUP, &sa, NULL);
}

bk_status cli_usage_error(const char *fmt, ...)
{
    char buf[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return bk_error(BK_ERR_USAGE, "%s", buf);
}

const char *const cli_precision_names[2] = {"fp32", "fp64"};

bk_status cli_parse_choice(const char *opt, const char *s, const char *const *names, int n,
                           int *out)
{
    char list[256] = "";
    size_t l = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(s, names[i])) {
            *out = i;
            return BK_OK;
        }
        l += (size_t)snprintf(list + l, l < sizeof list ? sizeof list - l : 0, "%s%s",
                              i == 0 ? "" : i == n - 1 ? " or " : ", ", names[i]);
        if (l >= sizeof list)
            l = sizeof list - 1;
    }
    return cli_usage_error("%s: expected %s, got '%s'", opt, list, s);
}

bk_status cli_parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        return cli_usage_error("%s: expected an integer in [%lld, %lld], got '%s'", opt,
                               (long long)lo, (long long)hi, s);
    *out = (int64_t)v;
    return BK_OK;
}

bk_status cli_parse_int(const char *opt, const char *s, int lo, int hi, int *out)
{
    int64_t v = 0;
    bk_status st = cli_parse_i64(opt, s, lo, hi, &v);
    if (st == BK_OK)
        *out = (int)v;
    return st;
}

bk_status cli_parse_double(const char *opt, const char *s, double lo, double hi, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !isfinite(v) || v < lo || v > hi)
        return cli_usage_error("%s: expected a number in [%g, %g], got '%s'", opt, lo, hi, s);
    *out = v;
    return BK_OK;
}

bk_status cli_split_tensor_ref(const char *opt, const char *arg, char *file, size_t file_cap,
                               char *tensor, size_t tensor_cap)
{
    const char *sep = NULL;
    static const char *exts[] = {".safetensors.zst:", ".safetensors:"};
    for (size_t i = 0; i < sizeof exts / sizeof exts[0] && !sep; i++) {
        const char *p = strstr(arg, exts[i]);
        if (p)
            sep = p + strlen(exts[i]) - 1;
    }
    if (!sep)
        sep = strrchr(arg, ':');
    if (!sep || sep == arg || sep[1] == '\0')
        return cli_usage_error("%s: expected FILE.safetensors:TENSOR, got '%s'", opt, arg);
    size_t lf = (size_t)(sep - arg);
    if (lf + 1 > file_cap || strlen(sep + 1) + 1 > tensor_cap)
        return cli_usage_error("%s: argument too long", opt);
    memcpy(file, arg, lf);
    file[lf] = '\0';
    strcpy(tensor, sep + 1);
    return BK_OK;
}

int cli_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--"))
            break;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return 1;
    }
    return 0;
}

bk_status cli_setting(bk_backend_params *p, const char *arg)
{
    if (bk_backend_params_parse(p, arg) != BK_OK)
        return cli_usage_error("--setting: %s", bk_last_error());
    return BK_OK;
}

const char *cli_model_dir(const char *path, char *buf, size_t cap)
{
    if (!path || !path[0] || !bk_is_file(path))
        return path;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (!bk_ends_with(base, ".safetensors") && !bk_ends_with(base, ".safetensors.index.json") &&
        strcmp(base, "config.json") != 0)
        return path;
    size_t l = (size_t)(base - path);
    if (l == 0)
        return ".";
    while (l > 1 && path[l - 1] == '/')
        l--;
    if (l + 1 > cap)
        return path;
    memcpy(buf, path, l);
    buf[l] = '\0';
    return buf;
}

/* ------------------------------------------------------------- diagnostics */

#define CLI_DIAG_MAX 32
static struct {
    bk_status st;
    char msg[1024];
} diag[CLI_DIAG_MAX];
static int n_diag, n_diag_dropped;

void cli_diag_add(bk_status st)
{
    if (st == BK_OK)
        return;
    if (n_diag >= CLI_DIAG_MAX) {
        n_diag_dropped++;
        return;
    }
    const char *m = bk_last_error();
    diag[n_diag].st = st;
    snprintf(diag[n_diag].msg, sizeof diag[n_diag].msg, "%s", m[0] ? m : bk_status_name(st));
    n_diag++;
}

int cli_diag_count(void)
{
    return n_diag;
}

bk_status cli_diag_status(void)
{
    bk_status best = BK_OK;
    for (int i = 0; i < n_diag; i++) {
        if (best == BK_OK ||
            bk_status_exit_code(diag[i].st) < bk_status_exit_code(best))
            best = diag[i].st;
    }
    return best;
}

bk_status cli_diag_get(int i, const char **msg)
{
    *msg = diag[i].msg;
    return diag[i].st;
}

void cli_diag_clear(void)
{
    n_diag = n_diag_dropped = 0;
}

/* ------------------------------------------------------------ model card */

int cli_card_record_eval(const char *dir, const char *tokens, int64_t S, int64_t T, double ppl,
                         double nll)
{
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    if (bk_path_join(path, sizeof path, dir, "README.md") != BK_OK || !bk_is_file(path) ||
        bk_read_file(path, 1u << 20, &text, &len) != BK_OK)
        return 0;
    const char *head = "## Measured perplexity\n";
    char *sec = strstr(text, head);
    if (!strstr(text, "<!-- bakron model card -->") || !sec) {
        free(text);
        return 0;
    }
    const char *base = strrchr(tokens, '/');
    base = base && base[1] ? base + 1 : tokens;
    char key[600], row[800];
    snprintf(key, sizeof key, "| %s | %lld x %lld |", base, (long long)S, (long long)T);
    snprintf(row, sizeof row, "%s %.4f | %.6f |\n", key, ppl, nll);
    /* the new text: everything, the row of the same key replaced or appended */
    size_t cap = len + strlen(row) + 2;
    char *out = malloc(cap);
    if (!out) {
        free(text);
        bk_error(BK_ERR_NOMEM, "out of memory");
        return -1;
    }
    size_t n = 0;
    int done = 0;
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        size_t ll = nl ? (size_t)(nl - line) + 1 : strlen(line);
        if (line > sec && !strncmp(line, key, strlen(key))) {
            if (!done) {
                memcpy(out + n, row, strlen(row));
                n += strlen(row);
                done = 1;
            }
        } else {
            memcpy(out + n, line, ll);
            n += ll;
            if (!nl) {
                out[n++] = '\n';
            }
        }
        line += ll;
    }
    if (!done) {
        memcpy(out + n, row, strlen(row));
        n += strlen(row);
    }
    bk_status st = bk_write_file_atomic(path, out, n);
    free(out);
    free(text);
    return st == BK_OK ? 1 : -1;
}

bk_status cli_check_out_file(const char *opt, const char *out, const cli_input_path *in, int n)
{
    struct stat so, si;
    const int exists = lstat(out, &so) == 0;
    if (exists && !S_ISLNK(so.st_mode) && !S_ISREG(so.st_mode))
        return cli_usage_error("%s %s: is %s, not a regular file (give the path of the "
                               ".safetensors file to write)",
                               opt, out, bk_file_kind(so.st_mode));
    char co[BK_PATH_MAX], ci[BK_PATH_MAX];
    bk_status st = bk_path_canonical(out, co, sizeof co);
    if (st != BK_OK)
        return st;
    for (int i = 0; i < n; i++) {
        if (!in[i].path || stat(in[i].path, &si) != 0)
            continue; /* not there: its own check says so */
        if (S_ISDIR(si.st_mode)) {
            size_t l;
            if (bk_path_canonical(in[i].path, ci, sizeof ci) != BK_OK)
                continue;
            l = strlen(ci);
            if (!strcmp(ci, "/") || (!strncmp(co, ci, l) && (co[l] == '/' || co[l] == '\0')))
                return cli_usage_error("%s %s: is inside %s (%s); give a path outside it", opt,
                                       out, in[i].what, in[i].path);
        } else if (exists && !S_ISLNK(so.st_mode) && si.st_dev == so.st_dev &&
                   si.st_ino == so.st_ino) {
            return cli_usage_error("%s %s: is the input %s (%s); give another output path (the "
                                   "result would replace it)",
                                   opt, out, in[i].what, in[i].path);
        }
    }
    return BK_OK;
}

/* ------------------------------------------------------ options given twice */

/* The options meant to be given several times (README "Settings"). */
static const char *const repeatable_options[] = {"setting", NULL};

bk_status cli_once_add(cli_once *o, const char *name, const char *value)
{
    for (const char *const *r = repeatable_options; *r; r++)
        if (!strcmp(*r, name))
            return BK_OK;
    for (int k = 0; k < o->n; k++) {
        if (strcmp(o->name[k], name) != 0)
            continue;
        if (o->value[k] && value)
            return cli_usage_error("--%s given twice ('%s', then '%s'): give it once", name,
                                   o->value[k], value);
        return cli_usage_error("--%s given twice: give it once", name);
    }
    if (o->n < CLI_ONCE_MAX) {
        o->name[o->n] = name;
        o->value[o->n] = value;
        o->n++;
    }
    return BK_OK;
}

const char *cli_opt_name(const struct option *opts, int val)
{
    for (const struct option *p = opts; p->name; p++)
        if (!p->flag && p->val == val)
            return p->name;
    return NULL;
}

void cli_json_error_event(bk_status st, const char *msg, int layer, const char *module)
{
    cJSON *j = cJSON_CreateObject();
    if (!j)
        return;
    cJSON_AddStringToObject(j, "event", st == BK_ERR_INTERRUPTED ? "interrupted" : "error");
    cJSON_AddStringToObject(j, "code", bk_status_name(st));
    cJSON_AddNumberToObject(j, "exit_code", bk_status_exit_code(st));
    cJSON_AddStringToObject(j, "message", msg ? msg : "");
    if (layer >= 0)
        cJSON_AddNumberToObject(j, "layer", layer);
    else
        cJSON_AddNullToObject(j, "layer");
    if (module)
        cJSON_AddStringToObject(j, "module", module);
    else
        cJSON_AddNullToObject(j, "module");
    cli_json_line(j);
}

void cli_json_line(cJSON *j)
{
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        fflush(stdout);
        free(s);
    }
    cJSON_Delete(j);
}
