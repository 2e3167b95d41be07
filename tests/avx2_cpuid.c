// Preloaded (LD_PRELOAD) into every process of a test run, so that each sees
// through CPUID a CPU without AVX-512, AVX-VNNI, AVX-NE-CONVERT or AMX, as an
// AVX2-only AMD EPYC (Zen 3) reports itself, while running at native speed:
// torch's ATen, oneDNN and cpuinfo then choose what they choose on such a CPU.
// tests/run_as_avx2_cpu.sh --cpuid builds and loads it.
//
// How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, where the CPU has
// `cpuid_fault`) makes each CPUID instruction raise SIGSEGV. The handler runs the
// real CPUID with faulting lifted for that one instruction, clears the features'
// bits and steps over it. Faulting is per thread, kept by threads and forks and
// reset by execve, so the constructor sets it again in every program, which
// inherits LD_PRELOAD. A program's own SIGSEGV handler (Python's faulthandler)
// is kept aside and called for every other fault.
//
// What it cannot do: make an AVX-512 instruction fault. Code that runs one
// without asking CPUID first is caught by the QEMU mode of the same script.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

// CPUID leaf 7 sub-leaf 0: EBX avx512f, dq, ifma, pf, er, cd, bw, vl.
#define LEAF7_EBX ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | \
                   (1u << 28) | (1u << 30) | (1u << 31))
// ECX: avx512_vbmi, avx512_vbmi2, gfni, avx512_vnni, avx512_bitalg,
// avx512_vpopcntdq (a Zen 3 has VAES and VPCLMULQDQ, no GFNI).
#define LEAF7_ECX ((1u << 1) | (1u << 6) | (1u << 8) | (1u << 11) | (1u << 12) | (1u << 14))
// EDX: avx512_4vnniw, avx512_4fmaps, avx512_vp2intersect, amx_bf16,
// avx512_fp16, amx_tile, amx_int8.
#define LEAF7_EDX ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | \
                   (1u << 24) | (1u << 25))
// Sub-leaf 1: EAX avx_vnni, avx512_bf16, amx_fp16; EDX avx_vnni_int8,
// avx_ne_convert, amx_complex.
#define LEAF7_1_EAX ((1u << 4) | (1u << 5) | (1u << 21))
#define LEAF7_1_EDX ((1u << 4) | (1u << 5) | (1u << 8))
// Leaf 0xD sub-leaf 0, EAX: the XSAVE state an OS may enable: AVX-512's opmask,
// ZMM_Hi256 and Hi16_ZMM, AMX's tile config and data.
#define XSAVE_EAX ((1u << 5) | (1u << 6) | (1u << 7) | (1u << 17) | (1u << 18))

static struct sigaction program_handler;  // the program's own SIGSEGV handler
static int installed;

static int real_sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  static int (*real)(int, const struct sigaction*, struct sigaction*);
  if (!real) real = (int (*)(int, const struct sigaction*, struct sigaction*))dlsym(RTLD_NEXT, "sigaction");
  return real(sig, act, old);
}

static int set_cpuid_faulting(int on) {
  return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1);
}

static void mask(uint32_t leaf, uint32_t subleaf, uint32_t r[4]) {
  if (leaf == 7 && subleaf == 0) {
    r[1] &= ~LEAF7_EBX;
    r[2] &= ~LEAF7_ECX;
    r[3] &= ~LEAF7_EDX;
  } else if (leaf == 7 && subleaf == 1) {
    r[0] &= ~LEAF7_1_EAX;
    r[3] &= ~LEAF7_1_EDX;
  } else if (leaf == 0xd && subleaf == 0) {
    r[0] &= ~XSAVE_EAX;
  } else if (leaf == 0x1d || leaf == 0x1e) {  // AMX's palette and TMUL leaves
    r[0] = r[1] = r[2] = r[3] = 0;
  }
}

static void on_segv(int sig, siginfo_t* info, void* context) {
  ucontext_t* uc = (ucontext_t*)context;
  greg_t* regs = uc->uc_mcontext.gregs;
  const unsigned char* ip = (const unsigned char*)regs[REG_RIP];
  if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
    const uint32_t leaf = (uint32_t)regs[REG_RAX], subleaf = (uint32_t)regs[REG_RCX];
    uint32_t r[4];
    set_cpuid_faulting(0);
    __cpuid_count(leaf, subleaf, r[0], r[1], r[2], r[3]);
    set_cpuid_faulting(1);
    mask(leaf, subleaf, r);
    regs[REG_RAX] = r[0];  // CPUID writes 32 bits and zeroes the upper half
    regs[REG_RBX] = r[1];
    regs[REG_RCX] = r[2];
    regs[REG_RDX] = r[3];
    regs[REG_RIP] += 2;
    return;
  }
  if (program_handler.sa_flags & SA_SIGINFO) {
    program_handler.sa_sigaction(sig, info, context);
  } else if (program_handler.sa_handler != SIG_DFL && program_handler.sa_handler != SIG_IGN) {
    program_handler.sa_handler(sig);
  } else {
    // Returning re-runs the faulting instruction, which now ends the program
    // with SIGSEGV, as it would have without this library.
    struct sigaction fallback;
    memset(&fallback, 0, sizeof(fallback));
    fallback.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &fallback, NULL);
  }
}

// The program's sigaction for SIGSEGV is recorded, not installed, while this
// library's handler is in place.
int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  if (sig != SIGSEGV || !installed) return real_sigaction(sig, act, old);
  if (old) *old = program_handler;
  if (act) program_handler = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof(act));
  act.sa_handler = handler;
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

__attribute__((constructor)) static void hide_avx512(void) {
  struct sigaction act;
  memset(&act, 0, sizeof(act));
  act.sa_sigaction = on_segv;
  act.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&act.sa_mask);
  if (real_sigaction(SIGSEGV, &act, &program_handler) != 0 || set_cpuid_faulting(1) != 0) {
    fprintf(stderr, "avx2_cpuid: this CPU or kernel has no CPUID faulting (cpuid_fault)\n");
    _exit(2);
  }
  installed = 1;
}
