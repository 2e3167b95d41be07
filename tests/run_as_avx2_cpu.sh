#!/usr/bin/env bash
# Runs pytest on an AVX-512 host as if on an AVX2-only AMD EPYC (Zen 3), for the
# every-CPU checks where no such machine is at hand. Two ways, each catching what
# the other cannot:
#
#   --cpuid  Native speed, the whole suite by default. Every process, the tests'
#            and those they start (workers, frontends, supervisors), runs with
#            tests/avx2_cpuid.c preloaded: CPUID reports no AVX-512, VNNI,
#            AVX-NE-CONVERT or AMX, so torch, oneDNN and cpuinfo choose what they
#            choose on a Zen 3 (a bfloat16 path that needs AVX-512 fails as it
#            would there). An AVX-512 instruction run without asking CPUID still
#            runs, here; the default mode catches that.
#   (default) QEMU's user-mode emulator (TCG, which implements no AVX-512 at all)
#            executes every instruction and answers CPUID as an EPYC-Milan, so any
#            AVX-512 instruction left on a path stops the run with SIGILL. It is
#            slow (torch's own products about 100x) and does not follow the
#            processes a test starts (they run natively), so by default it runs
#            the files that test in-process what depends on the instruction set
#            (about 11 minutes on 2 cores).
#
# In both, /proc/cpuinfo, which worker/model/cpu_isa.py reads, is bind-mounted in
# a private mount namespace without the AVX-512, AMX, VNNI and GFNI flags (as a
# Zen 3 reports them, and as the preloaded CPUID answers). Arguments
# after the mode go to pytest:
#   sudo tests/run_as_avx2_cpu.sh --cpuid
#   sudo tests/run_as_avx2_cpu.sh tests/test_kernels.py -k int8
# Needs root (unshare, mount); --cpuid a C compiler and a CPU with CPUID faulting
# (`cpuid_fault` in /proc/cpuinfo), the default qemu-user (apt-get install qemu-user).
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "needs root, for unshare and mount --bind" >&2; exit 2; }

mode=qemu
if [ "${1:-}" = --cpuid ]; then
    mode=cpuid
    shift
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ne_convert|gfni)\b//g' \
    /proc/cpuinfo > "$scratch/cpuinfo"

if [ $mode = cpuid ]; then
    grep -qw cpuid_fault /proc/cpuinfo \
        || { echo "this CPU or VM has no CPUID faulting (cpuid_fault): use the QEMU mode" >&2; exit 2; }
    "${CC:-cc}" -O2 -Wall -shared -fPIC -o "$scratch/avx2_cpuid.so" tests/avx2_cpuid.c -ldl
    if [ $# = 0 ]; then set -- -q; fi
    # glibc picks its string routines from CPUID before any preload runs: its
    # tunables make it pick the AVX2 ones, as on a Zen 3.
    hwcaps=glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD
    GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}$hwcaps" \
    LD_PRELOAD="$scratch/avx2_cpuid.so" unshare --mount sh -c '
        mount --bind "$0" /proc/cpuinfo &&
        exec .venv/bin/python -m pytest -p no:cacheprovider -rs "$@"
    ' "$scratch/cpuinfo" "$@"
    exit
fi

command -v qemu-x86_64 >/dev/null || { echo "needs qemu-x86_64: apt-get install qemu-user" >&2; exit 2; }
if [ $# = 0 ]; then
    set -- -q tests/test_kernels.py tests/test_torch_engine.py tests/test_precision.py \
        tests/test_decode_step.py tests/test_prefix_cache.py tests/test_exact_resume.py \
        tests/test_chunked_prefill.py tests/test_probe.py tests/test_config.py \
        tests/test_scoring.py tests/test_slot_engine.py tests/test_model_loader.py \
        tests/test_token_mask.py tests/test_structured_outputs.py
fi
unshare --mount sh -c '
    mount --bind "$0" /proc/cpuinfo &&
    exec qemu-x86_64 -cpu EPYC-Milan .venv/bin/python -m pytest -p no:cacheprovider -rs "$@"
' "$scratch/cpuinfo" "$@" 2> >(grep -v "TCG doesn.t support requested feature" >&2)
