#!/usr/bin/python3
"""What page-locking the host buffers of a first checkpoint costs on a GPU machine, and whether
it holds the GPU's work up (issue 21: the first checkpoint of workload A spends 6.6-8.6 s pinning
~16 GB in the call).

    NCCL_NVLS_ENABLE=0 python3 benchmarks/pin_bench.py [--gb 16] [--chunk-gb 1]

Reported, each for --gb GB in --chunk-gb pieces:
1. cudaHostAlloc: LibTorch's pinned allocation (torch.empty(..., pin_memory=True)), as the
   checkpoint's copies allocate today.
2. prefault: an anonymous mmap with madvise(MADV_HUGEPAGE) (then MADV_NOHUGEPAGE) whose pages are
   touched by 8 threads (no CUDA call), then cudaHostRegister of the touched memory, then
   cudaHostUnregister: how long registering memory made ready beforehand takes.
3. stalls: a thread runs 4096x4096 bf16 matmuls, synchronizing after each (~0.2 ms), while the
   main thread does (a) cudaHostAlloc of the same bytes, (b) the prefault alone, (c)
   cudaHostRegister of prefaulted memory; the slowest matmul iteration and the median during
   each, against the median alone: does the operation hold the GPU's stream up; (d) the same
   registration a GiB at a time.
4. A non-blocking device-to-host copy into registered memory within one registration, and
   across two adjacent ones (CUDA refuses the latter: "invalid argument").
ctypes calls release the GIL, so the matmul thread runs while the main thread waits in CUDA.
"""

import argparse
import ctypes
import mmap
import statistics
import sys
import threading
import time

import torch

GB = 1 << 30


def cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    # The one LibTorch loaded.
    import glob
    import os
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*",
                                       "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    raise OSError("no libcudart")


CUDA = None


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: cuda error {rc}")


def prefault(size, huge):
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    view = (ctypes.c_char * size).from_buffer(buf)
    addr = ctypes.addressof(view)
    threads = []
    step = size // 8

    def touch(lo, hi):
        # memset per 64 MiB: faults every page in (ctypes.memset releases the GIL).
        off = lo
        while off < hi:
            n = min(64 << 20, hi - off)
            ctypes.memset(addr + off, 0, n)
            off += n

    for i in range(8):
        lo = i * step
        hi = size if i == 7 else (i + 1) * step
        threads.append(threading.Thread(target=touch, args=(lo, hi)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return buf, view, addr


def register(addr, size):
    check(CUDA.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(size), 0),
          "cudaHostRegister")


def unregister(addr):
    check(CUDA.cudaHostUnregister(ctypes.c_void_p(addr)), "cudaHostUnregister")


class Matmuls:
    def __init__(self):
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.times = []
        self.stop = threading.Event()

    def run(self):
        torch.cuda.set_device(0)
        while not self.stop.is_set():
            t = time.perf_counter()
            torch.mm(self.a, self.b)
            torch.cuda.synchronize()
            self.times.append((time.perf_counter(), time.perf_counter() - t))

    def during(self, fn):
        self.times = []
        self.stop.clear()
        thread = threading.Thread(target=self.run)
        thread.start()
        time.sleep(0.3)
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        time.sleep(0.3)
        self.stop.set()
        thread.join()
        inside = [d for t, d in self.times if start <= t <= end + 0.01]
        outside = [d for t, d in self.times if t < start]
        return end - start, inside, outside


def main():
    global CUDA
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=16)
    parser.add_argument("--chunk-gb", type=float, default=1)
    args = parser.parse_args()
    CUDA = cudart()
    torch.cuda.init()
    size = int(args.gb * GB)
    chunk = int(args.chunk_gb * GB)
    chunks = max(1, size // chunk)
    print(f"{torch.cuda.get_device_name(0)}; {args.gb} GB in {chunks} chunks", flush=True)

    t = time.perf_counter()
    pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(chunks)]
    print(f"1. cudaHostAlloc (torch pin_memory): {time.perf_counter() - t:.2f} s "
          f"({args.gb / (time.perf_counter() - t):.1f} GB/s)", flush=True)
    del pinned
    torch.cuda.empty_cache()
    torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None

    for huge in (True, False):
        t = time.perf_counter()
        bufs = [prefault(chunk, huge) for _ in range(chunks)]
        touched = time.perf_counter() - t
        t = time.perf_counter()
        for _, _, addr in bufs:
            register(addr, chunk)
        registered = time.perf_counter() - t
        t = time.perf_counter()
        for _, _, addr in bufs:
            unregister(addr)
        unregistered = time.perf_counter() - t
        print(f"2. {'huge pages' if huge else '4 KiB pages'}: prefault {touched:.2f} s, "
              f"cudaHostRegister {registered:.2f} s ({args.gb / registered:.1f} GB/s), "
              f"unregister {unregistered:.2f} s", flush=True)
        del bufs  # the mappings go with their last reference

    mm = Matmuls()
    base = mm.during(lambda: time.sleep(1.0))
    print(f"3. matmul alone: median {statistics.median(base[1]) * 1e3:.3f} ms, "
          f"max {max(base[1]) * 1e3:.3f} ms", flush=True)

    def host_alloc():
        ptrs = []
        for _ in range(chunks):
            p = ctypes.c_void_p()
            check(CUDA.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(chunk), 0), "cudaHostAlloc")
            ptrs.append(p)
        host_alloc.ptrs = ptrs

    took, inside, _ = mm.during(host_alloc)
    print(f"3a. during cudaHostAlloc ({took:.2f} s): {len(inside)} matmuls, median "
          f"{statistics.median(inside) * 1e3:.3f} ms, max {max(inside) * 1e3:.1f} ms", flush=True)
    for p in host_alloc.ptrs:
        CUDA.cudaFreeHost(p)

    holder = {}

    def fault():
        holder["bufs"] = [prefault(chunk, True) for _ in range(chunks)]

    took, inside, _ = mm.during(fault)
    print(f"3b. during the prefault ({took:.2f} s): {len(inside)} matmuls, median "
          f"{statistics.median(inside) * 1e3:.3f} ms, max {max(inside) * 1e3:.1f} ms", flush=True)

    def reg():
        for _, _, addr in holder["bufs"]:
            register(addr, chunk)

    took, inside, _ = mm.during(reg)
    print(f"3c. during cudaHostRegister ({took:.2f} s): {len(inside)} matmuls, median "
          f"{statistics.median(inside) * 1e3:.3f} ms, max {max(inside) * 1e3:.1f} ms", flush=True)

    # Chunked: one 1 GiB registration at a time with matmuls between (a registration per step).
    for _, _, addr in holder["bufs"]:
        unregister(addr)
    worst = []
    for _, _, addr in holder["bufs"]:
        took, inside, _ = mm.during(lambda a=addr: register(a, chunk))
        worst.append(max(inside) if inside else took)
    print(f"3d. one chunk's cudaHostRegister at a time: slowest matmul per chunk "
          f"{statistics.median(worst) * 1e3:.1f} ms median, {max(worst) * 1e3:.1f} ms max",
          flush=True)

    # 4. One mapping of two chunks, registered as two: a copy within one, and across both.
    span, view, addr = prefault(2 * chunk, True)
    register(addr, chunk)
    register(addr + chunk, chunk)
    device = torch.ones(64 << 20, device="cuda")  # 256 MiB
    for off, what in ((0, "within one registration"),
                      (chunk - (128 << 20), "across two registrations")):
        host = torch.frombuffer(span, dtype=torch.float32, count=64 << 20, offset=off)
        try:
            host.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            print(f"4. D2H copy {what}: ok", flush=True)
        except RuntimeError as err:
            print(f"4. D2H copy {what}: {str(err).splitlines()[0]}", flush=True)
    unregister(addr)
    unregister(addr + chunk)

if __name__ == "__main__":
    sys.exit(main())
