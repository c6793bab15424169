#!/usr/bin/env bash
# Generate the man page bakron(1) from the tool's own help texts (`bakron
# --help` and `bakron COMMAND --help`), so that it never disagrees with them.
# Run by meson at build time (custom_target bakron.1, installed in man1).
#   scripts/make_man.sh BAKRON_BINARY OUTPUT
set -euo pipefail
bk=${1:?usage: make_man.sh BAKRON_BINARY OUTPUT}
out=${2:?usage: make_man.sh BAKRON_BINARY OUTPUT}

# troff-safe text: backslashes escaped, a leading '.' or "'" neutralized
esc() { sed -e 's/\\/\\e/g' -e "s/^\([.']\)/\\\\\&\1/"; }

version=$("$bk" --version | head -1 | awk '{print $2}')
help=$("$bk" --help)
commands=$(printf '%s\n' "$help" | awk '/^commands:/ {on=1; next} on && /^  [a-z]/ {print $1} on && /^$/ {on=0}')
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
{
    printf '.TH BAKRON 1 "" "bakron %s" "User Commands"\n' "$version"
    printf '.SH NAME\nbakron \\- quantize Llama/Qwen safetensors checkpoints with GPTQ-style adaptive rounding under Kronecker-factored Hessians\n'
    printf '.SH SYNOPSIS\n.nf\n'
    printf '%s\n' "$help" | awk '/^usage:/ {on=1} on && /^$/ {exit} on {print}' | esc
    printf '.fi\n.SH DESCRIPTION\n.nf\n'
    printf '%s\n' "$help" | esc
    printf '.fi\n.SH COMMANDS\n'
    for c in $commands; do
        printf '.SS "bakron %s"\n.nf\n' "$c"
        "$bk" "$c" --help | esc
        printf '.fi\n'
    done
    printf '.SH EXIT STATUS\n.TP\n0\nsuccess\n.TP\n1\nusage error (options, their conflicts, an unsafe or existing output folder)\n'
    printf '.TP\n2\nbad input (a malformed or inconsistent file)\n.TP\n3\nruntime or device error (memory, disk, GPU, interrupted, output locked)\n'
    printf '.PP\nEvery error is one line on standard error naming the file or tensor and the rule.\n'
    printf '.SH FILES\nPresets: \\fIPREFIX/share/bakron/configs/*.json\\fR (\\fB\\-\\-config NAME\\fR).\n'
    printf '.SH SEE ALSO\nREADME.md and docs/ in the bakron source tree.\n'
} >"$tmp"
chmod 644 "$tmp"
mv "$tmp" "$out"
trap - EXIT
