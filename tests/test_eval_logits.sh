#!/bin/sh
# bakron eval --logits-out: the written logits equal transformers' golden
# logits of tests/data/models/tiny-llama3; a bad output path and a missing
# value fail with one clear line.
set -eu
python3 -c "import numpy, safetensors" 2>/dev/null || { echo "numpy/safetensors not installed: skipped"; exit 77; }
B=${BK_BAKRON:-build/bakron}
D=${BK_TEST_DATA:-tests/data}/models/tiny-llama3
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 - "$D/golden.safetensors" "$T/tok.safetensors" <<'EOF'
import sys
from safetensors.numpy import load_file, save_file
g = load_file(sys.argv[1])
save_file({"input_ids": g["input_ids"]}, sys.argv[2], metadata={"format": "pt"})
EOF
"$B" eval "$D" --tokens "$T/tok.safetensors" --logits-out "$T/lg.safetensors" --json >"$T/out.json"
python3 - "$D/golden.safetensors" "$T/lg.safetensors" <<'EOF'
import sys
import numpy as np
from safetensors.numpy import load_file
ref = load_file(sys.argv[1])["logits"]
got = load_file(sys.argv[2])["logits"]
S, T, V = ref.shape
assert got.shape == (S * T, V), f"shape {got.shape}, expected {(S * T, V)}"
err = float(np.abs(got - ref.reshape(S * T, V)).max() / np.abs(ref).max())
assert err < 1e-4, f"max relative difference {err:.3g} >= 1e-4"
print(f"logits [{S * T}, {V}] match transformers' golden logits (max rel diff {err:.2e})")
EOF
set +e
"$B" eval "$D" --tokens "$T/tok.safetensors" --logits-out /nonexistent-dir/x.safetensors >/dev/null 2>"$T/err"
rc=$?
set -e
cat "$T/err"
[ "$rc" -eq 3 ] || { echo "unwritable path: exit $rc, expected 3"; exit 1; }
[ "$(wc -l <"$T/err")" -eq 1 ] && grep -q -- "--logits-out /nonexistent-dir/x.safetensors" "$T/err" ||
    { echo "unwritable path: message does not name the option and file"; exit 1; }
set +e
"$B" eval "$D" --tokens "$T/tok.safetensors" --logits-out >/dev/null 2>"$T/err"
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "missing value: exit $rc, expected 1"; exit 1; }
echo "1 passed, 0 failed"
