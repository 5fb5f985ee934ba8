#include "daemon/common/crash_report.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace rannc {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

// Only async-signal-safe calls (snprintf into a stack buffer, write) but for backtrace and
// backtrace_symbols_fd, which glibc documents as usable here once backtrace has run once
// (InstallCrashReport primes it: its first call loads libgcc_s).
void Say(const char* text) {
  const ssize_t unused = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)unused;
}

void OnFatalSignal(int signal_number, siginfo_t* info, void* context) {
  char line[256];
  std::snprintf(line, sizeof line,
                "\n*** ranncd: fatal signal %d (SIG%s) at address %p in thread %ld ***\n",
                signal_number, sigabbrev_np(signal_number), info->si_addr,
                static_cast<long>(::syscall(SYS_gettid)));
  Say(line);
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* pc = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  void* const* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
  Say("faulting instruction: ");
  backtrace_symbols_fd(&pc, 1, STDERR_FILENO);
  if (reinterpret_cast<std::uintptr_t>(pc) < 4096 && sp != nullptr) {
    void* caller = *sp;  // a call through a null pointer pushed its return address
    Say("called from: ");
    backtrace_symbols_fd(&caller, 1, STDERR_FILENO);
  }
#else
  (void)context;
#endif
  Say("stack:\n");
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  Say("*** end of the report ***\n");
  // Die of the signal, as without the report.
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

}  // namespace

void InstallCrashReport() {
  void* prime[1];
  backtrace(prime, 1);
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_sigaction = OnFatalSignal;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (int s : kSignals) sigaction(s, &action, nullptr);
}

}  // namespace rannc
