/* bakron merge */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bakron/pipeline.h"
#include "cli.h"

static const char *merge_usage =
    "usage: bakron merge PART_DIR... --out OUT_DIR [options]\n"
    "\n"
    "Assemble the outputs of layer-range runs (bakron quantize --activations DIR --layers A:B)\n"
    "into the checkpoint one full run writes, byte for byte (report.json: the parts' modules\n"
    "and times merged). The parts must cover every layer exactly once and be made with the\n"
    "same settings, model and activations; otherwise nothing is written (exit 2).\n"
    "SIGINT, SIGTERM and SIGHUP stop it (exit 3; its work folder removed, an existing\n"
    "OUT_DIR left as it was); under nohup the hangup is ignored.\n"
    "docs/DISTRIBUTED.md.\n"
    "\n"
    "  --out DIR             output folder (built under DIR.tmp-PID, renamed when complete)\n"
    "  --max-shard-size B    bytes per safetensors shard (default 5e9; give the parts' value)\n"
    "  --overwrite           replace a non-empty output folder\n"
    "  --json                one JSON object per event on stdout (a failure: an `error` or\n"
    "                        `interrupted` event, as quantize's)\n";

static void on_event(void *user, const bk_event *ev)
{
    int json = *(int *)user;
    const char *msg = ev->message ? ev->message : "";
    if (json) { /* (cJSON escapes the strings) */
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "event", ev->kind == BK_EV_DONE ? "done" : "note");
        cJSON_AddStringToObject(j, ev->kind == BK_EV_DONE ? "out" : "message", msg);
        cJSON_AddNumberToObject(j, "elapsed_s", ev->elapsed_s);
        cli_json_line(j);
        return;
    }
    /* the output folder, notes naming paths: escaped (cli_esc) */
    static char esc[CLI_ESC_CAP];
    if (ev->kind == BK_EV_DONE)
        fprintf(stderr, "bakron: merged into %s in %.1fs\n", cli_esc(msg, esc, sizeof esc),
                ev->elapsed_s);
    else
        fprintf(stderr, "bakron: %s\n", cli_esc(msg, esc, sizeof esc));
}

bk_status bk_cmd_merge(int argc, char **argv)
{
    if (cli_wants_help(argc, argv)) {
        fputs(merge_usage, stdout);
        return BK_OK;
    }
    static const struct option opts[] = {
        {"out", required_argument, NULL, 'o'},
        {"max-shard-size", required_argument, NULL, 's'},
        {"overwrite", no_argument, NULL, 'w'},
        {"json", no_argument, NULL, 'j'},
        {NULL, 0, NULL, 0},
    };
    bk_merge_opts o;
    bk_merge_opts_default(&o);
    const char **parts = calloc((size_t)argc + 1, sizeof *parts);
    if (!parts)
        return bk_error(BK_ERR_NOMEM, "out of memory");
    int n = 0, json = 0, c;
    double dv;
    bk_status st = BK_OK;
    optind = 0;
    opterr = 0;
    cli_once once = {0};
    while ((c = getopt_long(argc, argv, "-", opts, NULL)) != -1) {
        const char *name = c == 1 ? NULL : cli_opt_name(opts, c); /* PART_DIRs repeat */
        if (name && (st = cli_once_add(&once, name, optarg)) != BK_OK)
            goto done;
        switch (c) {
        case 1: parts[n++] = optarg; break;
        case 'o': o.out_dir = optarg; break;
        case 's':
            if ((st = cli_parse_double("--max-shard-size", optarg, 1e3, 1e15, &dv)) != BK_OK)
                goto done;
            o.max_shard_bytes = (uint64_t)dv;
            break;
        case 'w': o.overwrite = 1; break;
        case 'j': json = 1; break;
        default: st = cli_usage_error("bad option '%s'", argv[optind - 1]); goto done;
        }
    }
    if (n < 1) {
        st = cli_usage_error("at least one PART_DIR is required");
        goto done;
    }
    if (!o.out_dir) {
        st = cli_usage_error("--out OUT_DIR is required");
        goto done;
    }
    o.parts = parts;
    o.n_parts = n;
    o.on_event = on_event;
    o.user = &json;
    cli_install_signals();
    st = bk_merge(&o);
done:
    if (st != BK_OK && json) /* (as quantize: the error line goes to stderr too) */
        cli_json_error_event(st, bk_last_error(), -1, NULL);
    free(parts);
    return st;
}
