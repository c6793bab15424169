/* bakron — command-line entry point. */
#include <stdio.h>
#include <stdlib.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <signal.h>
#include <string.h>

#include "cli.h"

typedef struct command {
    const char *name;
    bk_cmd_fn fn;
    const char *summary;
} command;

static const command commands[] = {
    {"quantize", bk_cmd_quantize, "quantize a checkpoint layer by layer (GPTQ / BaKron)"},
    {"eval", bk_cmd_eval, "perplexity of a model on token sequences (native forward)"},
    {"dump-activations", bk_cmd_dump, "write the calibration inputs of every linear module"},
    {"merge", bk_cmd_merge, "assemble layer-range outputs (--layers A:B) into one checkpoint"},
    {"inspect", bk_cmd_inspect, "describe a checkpoint: architecture, sizes, dtypes, tensors"},
    {"solve", bk_cmd_solve, "quantize one weight matrix under given Hessian factors"},
    {"bench", bk_cmd_bench, "time the solvers on random problems"},
};

static void print_help(FILE *f)
{
    fprintf(f,
            "bakron %s — GPTQ-style adaptive rounding under Kronecker-factored Hessians\n"
            "\n"
            "usage: bakron COMMAND [options]\n"
            "       bakron COMMAND --help\n"
            "       bakron --version\n"
            "\n"
            "commands:\n",
            bk_version());
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-18s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\n"
               "exit codes: 0 ok, 1 usage error, 2 bad input, 3 runtime or device error.\n"
               "Errors are printed to stderr as one line naming the file/tensor and the rule.\n");
}

/* The quantize job allocates and frees the same large host buffers for
 * every module and layer (codes, converted weights, packed output). glibc
 * serves each from a fresh mmap, and touching fresh pages costs about
 * 0.6 s per GiB on the machines measured (page faults), more than the work
 * on them. Serve large blocks from one heap and keep freed memory for reuse
 * instead (BK_MALLOC=default keeps glibc's policy). */
static void configure_malloc(void)
{
#if defined(__GLIBC__)
    const char *e = getenv("BK_MALLOC");
    if (e && !strcmp(e, "default"))
        return;
    mallopt(M_ARENA_MAX, 1);       /* threads share the heap: freed buffers are reused */
    mallopt(M_MMAP_MAX, 0);        /* large blocks from the heap, not fresh mappings */
    mallopt(M_TRIM_THRESHOLD, -1); /* never give freed pages back mid-run */
#endif
}

static void print_version(void)
{
    printf("bakron %s (CUDA backend: %s; MPI: %s%s%s; NCCL: %s%s%s)\n", bk_version(),
           bk_cuda_compiled() ? "compiled" : "not compiled",
           bk_dist_mpi_compiled() ? "compiled" : "not compiled",
           bk_dist_mpi_compiled() ? ", " : "", bk_dist_mpi_version(),
           bk_dist_nccl_compiled() ? "compiled" : "not compiled",
           bk_dist_nccl_compiled() ? ", " : "", bk_dist_nccl_version());
}

/* A write that fails is an error the command reports (one line, exit 3, the
 * output folder left as documented), not a signal death: a file-size limit
 * (ulimit -f) would end the process with SIGXFSZ at the first write past it,
 * and a reader of stdout or stderr that went away (`| head`, a dead log
 * pipe) with SIGPIPE, leaving a quantize run's lock and work folder behind
 * mid-run. Ignored, they become EFBIG and EPIPE from write(), which the
 * writers and the stdout checks already turn into errors. */
static void ignore_write_signals(void)
{
    signal(SIGXFSZ, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
}

/* One line per error: "bakron CMD: error: MESSAGE". Library messages that
 * start with the command's own name ("quantize: ...") lose it (one prefix). */
int main(int argc, char **argv)
{
    configure_malloc();
    ignore_write_signals();
    if (argc < 2) {
        print_help(stderr);
        return 1;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        print_help(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "-V") || !strcmp(cmd, "version")) {
        print_version();
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (!strcmp(cmd, commands[i].name)) {
            /* --version on every command (before a "--") */
            for (int a = 2; a < argc && strcmp(argv[a], "--") != 0; a++)
                if (!strcmp(argv[a], "--version")) {
                    print_version();
                    return 0;
                }
            bk_clear_error();
            cli_diag_clear();
            bk_status st = commands[i].fn(argc - 1, argv + 1);
            if (st != BK_OK && !cli_quiet_errors)
                cli_print_error(cmd, st);
            return bk_status_exit_code(st);
        }
    }
    fprintf(stderr, "bakron: error: unknown command '%s' (see 'bakron --help')\n", cmd);
    return 1;
}
