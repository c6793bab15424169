/* bakron CLI — shared declarations. Each command lives in its own file and
 * returns a bk_status; only main() turns it into an exit code. */
#ifndef BK_CLI_H
#define BK_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "bakron/bakron.h"
#include "bakron/pipeline.h"

typedef bk_status (*bk_cmd_fn)(int argc, char **argv);

/* Commands (argv[0] is the command name). */
bk_status bk_cmd_inspect(int argc, char **argv);
bk_status bk_cmd_solve(int argc, char **argv);
bk_status bk_cmd_bench(int argc, char **argv);
bk_status bk_cmd_quantize(int argc, char **argv);
bk_status bk_cmd_dump(int argc, char **argv);
bk_status bk_cmd_eval(int argc, char **argv);
bk_status bk_cmd_merge(int argc, char **argv);

/* Read and apply a `--config` preset (a configs/ file) to default options, as
 * `quantize --config` does (used by the preset fuzz target). */
bk_status cli_preset_check(const char *path, bk_quantize_opts *out);

/* --- helpers (cli_util.c) --- */

/* Set by ranks other than 0 of an MPI job: main() prints no error line (rank
 * 0 prints the job's one line). */
extern int cli_quiet_errors;
/* The one error line: "bakron CMD: error: MESSAGE". */
void cli_print_error(const char *cmd, bk_status st);

/* SIGINT, SIGTERM and SIGHUP stop a job (quantize, dump-activations, merge)
 * at its next check (bk_request_stop): it ends with BK_ERR_INTERRUPTED (exit
 * 3), an existing output left as it was, its work folder removed (quantize
 * keeps one with finished layers for --resume).
 * SIGINT and SIGTERM are caught even when the parent ignored them (a
 * script's `bakron ... &` starts with SIGINT ignored, and `kill -INT` is how
 * the scripts and tests here stop one); a SIGHUP the parent ignored stays
 * ignored: that is what `nohup bakron ...` asks for, and the run must
 * survive the hangup. */
void cli_install_signals(void);

/* Text for a progress, banner or status line (a path, or a library message
 * made of paths): its control characters and invalid UTF-8 escaped as in the
 * error lines (bk_escape_message: \x1b, \n, \xff), so an odd path cannot
 * move the cursor or split the line. Written into buf (CLI_ESC_CAP bytes hold
 * any path: 4 bytes per input byte at most); returns buf. Not for JSON: cJSON
 * escapes the strings it prints itself. */
#define CLI_ESC_CAP (4 * 4096 + 16)
/* --json: the one `error` (or, for BK_ERR_INTERRUPTED, `interrupted`) event
 * of a failed command on stdout: code, exit_code, message, layer and module
 * (where the run was; layer < 0 / module NULL: null) */
void cli_json_error_event(bk_status st, const char *msg, int layer, const char *module);
/* --json: one event object as one line on stdout (flushed); deletes it */
struct cJSON;
void cli_json_line(struct cJSON *j);
const char *cli_esc(const char *s, char *buf, size_t cap);

/* Usage error with a message (exit 1). */
#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
bk_status cli_usage_error(const char *fmt, ...);

/* Parse numbers; on failure return BK_ERR_USAGE naming the option. */
bk_status cli_parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out);
bk_status cli_parse_int(const char *opt, const char *s, int lo, int hi, int *out);
bk_status cli_parse_double(const char *opt, const char *s, double lo, double hi, double *out);
/* s as one of the n names (*out its index); else BK_ERR_USAGE
 * "OPT: expected a, b or c, got 'S'". */
bk_status cli_parse_choice(const char *opt, const char *s, const char *const *names, int n,
                           int *out);
/* --precision's names in bk_precision's order: "fp32", "fp64". */
extern const char *const cli_precision_names[2];

/* Split "FILE:TENSOR" (split at the last ':' that follows the file name's
 * extension, else the last ':'). */
bk_status cli_split_tensor_ref(const char *opt, const char *arg, char *file, size_t file_cap,
                               char *tensor, size_t tensor_cap);

/* An output file written by a rename over OUT (solve --out, eval
 * --logits-out), checked before the work: an existing OUT must be a regular
 * file (or a symbolic link, which the rename replaces) and not one of the
 * inputs; OUT may not be inside an input folder. Each input is a file or a
 * folder, with what it is for the message ("--weight", "the model folder").
 * A violation is a usage error (exit 1). */
typedef struct cli_input_path {
    const char *what;
    const char *path; /* NULL: none */
} cli_input_path;
bk_status cli_check_out_file(const char *opt, const char *out, const cli_input_path *in, int n);

/* Options given twice. Every option of every command is given once, except
 * the repeatable ones (--setting); a second one is a usage error naming it
 * ("--out given twice ('a', then 'b'): give it once"), never silently the last
 * one. A parser records each option it reads with cli_once_add (NAME without
 * the dashes, VALUE NULL for a flag); cli_opt_name finds a getopt_long table's
 * name for a returned val (NULL for none, e.g. a non-option argument). */
#define CLI_ONCE_MAX 64
typedef struct cli_once {
    const char *name[CLI_ONCE_MAX];
    const char *value[CLI_ONCE_MAX];
    int n;
} cli_once;
bk_status cli_once_add(cli_once *o, const char *name, const char *value);
struct option;
const char *cli_opt_name(const struct option *opts, int val);

/* --setting KEY=VALUE onto p (bk_backend_params_parse; a bad one is a usage
 * error). */
bk_status cli_setting(bk_backend_params *p, const char *arg);

/* 1 if argv contains -h / --help (before any "--"). */
int cli_wants_help(int argc, char **argv);

/* A model given as users give it: the folder, or a file inside it (its
 * model.safetensors or any *.safetensors shard, model.safetensors.index.json,
 * config.json) all mean the folder. Returns `path` itself, or the folder
 * written into buf. */
const char *cli_model_dir(const char *path, char *buf, size_t cap);

/* `bakron eval` of a bakron output folder: record the measured perplexity in
 * its model card (README.md written by quantize; one row per tokens file and
 * size, replaced when measured again). Returns 1 when recorded, 0 when the
 * folder has no bakron card, -1 when it could not be written (message in
 * bk_last_error()). */
int cli_card_record_eval(const char *dir, const char *tokens, int64_t S, int64_t T, double ppl,
                         double nll);

/* --- every mistake of a run, each on its own line (main prints them) ---
 * A command that checks everything before the work adds each failure with
 * cli_diag_add(status) (the message is bk_last_error()) and returns
 * cli_diag_status(). main() prints one line per entry; the exit code is the
 * lowest category present (usage 1 before bad input 2 before runtime 3). */
void cli_diag_add(bk_status st);
int cli_diag_count(void);
bk_status cli_diag_status(void);
/* entry i: status and message */
bk_status cli_diag_get(int i, const char **msg);
void cli_diag_clear(void);

/* --- solver options shared by `solve` and `bench` (cmd_solve.c) --- */
typedef struct cli_solver_args {
    bk_solve_opts opts;
    bk_backend_kind backend;
    bk_backend_params params; /* --setting */
    int have_levels, have_bits, have_group, have_asym;
} cli_solver_args;
void cli_solver_args_init(cli_solver_args *a);
/* If `name` (a long option without "--") is a solver option, apply its
 * value `arg` and set *handled = 1; usage errors name the option. */
bk_status cli_solver_option(cli_solver_args *a, const char *name, const char *arg, int *handled);
/* Cross-option checks after parsing (--levels vs --bits, --group needs --bits). */
bk_status cli_solver_args_check(const cli_solver_args *a);
/* "levels=3 mse", "uniform bits=4 group=128 asym" ... */
void cli_quant_describe(const bk_quant_spec *q, char *buf, size_t cap);
extern const char cli_solver_options_help[];

#endif /* BK_CLI_H */
