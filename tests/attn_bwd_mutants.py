#!/usr/bin/env python3
"""Deliberate bugs in the fused attention backward (cuda/attn_flash_bwd_kernel.cuh),
each applied to a copy of the source; tests/test_attn_bwd_emu.cu must fail on
every one. Run from the repository root (needs nvcc; no GPU):

    python3 tests/attn_bwd_mutants.py [NVCC]

Prints one line per mutant (caught / NOT CAUGHT) and exits 1 if any is not
caught. Not part of the meson suites (about 30 s per mutant on one core)."""
import os, shutil, subprocess, sys, tempfile

K = 'cuda/attn_flash_bwd_kernel.cuh'
MUTANTS = [
    ('dK/dV: diagonal excluded', 'p0 = key_lo > pos ? 0.0f : p0;', 'p0 = key_lo >= pos ? 0.0f : p0;'),
    ('dQ: diagonal excluded', 'p = key > pos[h] ? 0.0f : p;', 'p = key >= pos[h] ? 0.0f : p;'),
    ('dQ: D not subtracted', 'x[e] = p * (d[j][e] - Dr[h]);', 'x[e] = p * d[j][e];'),
    ('dK without the scale', 'make_float2(adk[j][2 * h] * scale, adk[j][2 * h + 1] * scale)',
     'make_float2(adk[j][2 * h], adk[j][2 * h + 1])'),
    ('dV from Q instead of dO', 'ldsm_x4_t(ot + (k2', 'ldsm_x4_t(qt + (k2'),
    ('dK: Q B fragments without .trans', 'ldsm_x4_t(qt + (k2', 'ldsm_x4(qt + (k2'),
    ('dK/dV: wait_group 2 (prefetch not waited for)', 'cp_async_wait<1>();', 'cp_async_wait<2>();'),
    ('dK/dV: no trailing barrier', "        fa_sync(); /* buffer buf is refilled by the next iteration's prefetch */\n",
     ''),
    ('dK/dV: query walk starts a block late', 'const int qb0 = key0 * rep / BMQ,',
     'const int qb0 = key0 * rep / BMQ + 1,'),
    ('dK: D of the wrong column', 'const float D0 = Db[c], D1 = Db[c + 1];',
     'const float D0 = Db[c], D1 = Db[c];'),
    ('prep: shuffle tree one step short', 'for (int m = 16; m; m >>= 1)', 'for (int m = 16; m > 1; m >>= 1)'),
    ('dQ: L of the first row for both', 'float p = exp2f(s[j][e] * scale_log2 - Lr[h]);',
     'float p = exp2f(s[j][e] * scale_log2 - Lr[0]);'),
    ('dQ: one key block short', 'const int nkb = (last_row / rep) / BN + 1;',
     'const int nkb = (last_row / rep) / BN;'),
]


def main():
    nvcc = sys.argv[1] if len(sys.argv) > 1 else 'nvcc'
    src = open(K).read()
    missed = 0
    for name, old, new in MUTANTS:
        n = src.count(old)
        if n < 1:
            print(f'{name}: pattern not found  <-- FAIL')
            missed += 1
            continue
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(f'{d}/cuda')
            os.makedirs(f'{d}/tests')
            shutil.copy('cuda/attn_flash_kernel.cuh', f'{d}/cuda/')
            open(f'{d}/{K}', 'w').write(src.replace(old, new, 1))
            for f in ('tests/attn_emu.h', 'tests/test_attn_bwd_emu.cu'):
                shutil.copy(f, f'{d}/tests/')
            exe = f'{d}/emu'
            c = subprocess.run([nvcc, '-O2', '-std=c++17', '-Xcompiler', '-Wno-unknown-pragmas',
                                '-o', exe, f'{d}/tests/test_attn_bwd_emu.cu'],
                               capture_output=True, text=True)
            if c.returncode:
                print(f'{name}: does not compile  <-- FAIL\n{c.stderr[-2000:]}')
                missed += 1
                continue
            r = subprocess.run([exe], capture_output=True, text=True, timeout=900)
            out = r.stdout + r.stderr
            why = [l.strip() for l in out.splitlines() if 'FAIL' in l or 'emulation:' in l]
            if r.returncode:
                print(f'{name}: caught ({len(why)} lines; first: {why[0][:160] if why else "exit " + str(r.returncode)})')
            else:
                print(f'{name}: NOT CAUGHT  <-- FAIL')
                missed += 1
    print(f'attn_bwd_mutants: {len(MUTANTS) - missed} of {len(MUTANTS)} caught')
    return 1 if missed else 0


if __name__ == '__main__':
    sys.exit(main())
