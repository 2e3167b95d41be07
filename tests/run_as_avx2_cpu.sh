#!/usr/bin/env bash
# Runs pytest on an AVX-512 host as if on an AVX2-only AMD EPYC (Zen 3), for the
# every-CPU checks where no such machine is at hand: QEMU's user-mode emulator
# (TCG, which implements no AVX-512 at all) executes every instruction and answers
# CPUID as an EPYC-Milan, so torch, oneDNN and the decode kernels choose their AVX2
# code and any AVX-512 instruction left in it stops the run with SIGILL; and
# /proc/cpuinfo, which worker/model/kernels.py reads, is bind-mounted in a private
# mount namespace without the AVX-512, AMX and VNNI flags.
#
# Emulation is slow (torch's own products about 100x), and processes the tests
# start run natively, so with no arguments it runs the files that test in-process
# what depends on the instruction set (about 18 minutes on 2 cores); arguments go
# to pytest instead:
#   sudo tests/run_as_avx2_cpu.sh
#   sudo tests/run_as_avx2_cpu.sh tests/test_kernels.py -k int8
# Needs root (unshare, mount) and qemu-user (Debian: apt-get install qemu-user).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v qemu-x86_64 >/dev/null || { echo "needs qemu-x86_64: apt-get install qemu-user" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root, for unshare and mount --bind" >&2; exit 2; }

if [ $# = 0 ]; then
    set -- -q tests/test_kernels.py tests/test_torch_engine.py tests/test_precision.py \
        tests/test_decode_step.py tests/test_prefix_cache.py tests/test_exact_resume.py \
        tests/test_chunked_prefill.py tests/test_probe.py tests/test_config.py \
        tests/test_scoring.py tests/test_slot_engine.py tests/test_model_loader.py \
        tests/test_token_mask.py tests/test_structured_outputs.py
fi

cpuinfo=$(mktemp)
trap 'rm -f "$cpuinfo"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ne_convert)\b//g' \
    /proc/cpuinfo > "$cpuinfo"

unshare --mount sh -c '
    mount --bind "$0" /proc/cpuinfo &&
    exec qemu-x86_64 -cpu EPYC-Milan .venv/bin/python -m pytest -p no:cacheprovider -rs "$@"
' "$cpuinfo" "$@" 2> >(grep -v "TCG doesn.t support requested feature" >&2)
