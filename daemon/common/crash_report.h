// A report of a fatal signal on stderr before the process dies, for crashes that happen where
// no debugger runs (a GPU machine without gdb, a pod): the signal, the faulting address, the
// thread, the faulting instruction's address and the stack (glibc's backtrace). A frame in a
// function no shared object exports prints as `binary(+0xOFFSET)`, which
// `addr2line -f -C -e binary 0xOFFSET` resolves. A call through a null function pointer leaves
// nothing to unwind from (the faulting address is 0): the return address on the top of the
// stack then names the caller ("called from").
//
//   InstallCrashReport();  // early in main, before threads start
//
// The report covers SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT; after it the signal is raised
// again with its default action, so the process dies as it would have (core dump, exit status).
// Libraries that install their own handlers later replace it (UCX does unless
// UCX_HANDLE_ERRORS=none, which ranncd sets by default).
#ifndef RANNC_DAEMON_COMMON_CRASH_REPORT_H_
#define RANNC_DAEMON_COMMON_CRASH_REPORT_H_

namespace rannc {

void InstallCrashReport();

}  // namespace rannc

#endif  // RANNC_DAEMON_COMMON_CRASH_REPORT_H_
