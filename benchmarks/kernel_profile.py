"""Where a training step's GPU time goes, from a Chrome trace of a few profiled steps.

    python3 benchmarks/kernel_profile.py TRACE.json [TRACE.json ...] --steps N [--json]

The traces come from `benchmarks/job_bench --profile` (LibTorch's Kineto, the daemon's own step
in-process) and `gpt_peers.py --profile` (torch.profiler around the same number of steps of a
peer): `benchmarks/h200.sh` with PROFILE=1 makes both, runs this and writes kernels.md.

Per step it reports the GPU's busy time (the union of every kernel, memcpy and memset interval:
what the GPU did), the idle time within the profiled span (where it waited for the host), that
idle time by the length of its gaps (with the largest gaps and what ran on either side), and
the kernel time by category, the categories by kernel name (CATEGORIES, ignoring case; the first
that matches wins): the matrix products, attention, LayerNorm, GELU, softmax and loss, the optimizer,
embedding lookups, copies and casts, other elementwise kernels, reductions, then the rest. The
kernel names are cuBLAS's, PyTorch's and flash attention's as torch 2.11 on an H200 names them;
a kernel no pattern names counts as "other" and is listed among the largest.
"""

import argparse
import collections
import json
import re
import sys

# (category, pattern over the kernel's name), first match wins.
CATEGORIES = (
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*(mha|sdp)"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|matmul|splitK"),
    ("layer_norm", r"layer_?norm|GammaBeta"),
    ("gelu", r"gelu"),
    ("softmax_loss", r"softmax|nll_loss|cross_entropy"),
    ("optimizer", r"adam|multi_tensor|foreach|_fused_"),
    ("embedding", r"embedding|index_select|indexSelect|index_put|scatter_add"),
    ("copy_cast", r"copy|cast|memcpy|cat_|CatArray"),
    ("memset_fill", r"memset|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
    ("reduction", r"reduce|sum_|norm_kernel"),
)
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


def category(name: str) -> str:
    for cat, pattern in _COMPILED:
        if pattern.search(name):
            return cat
    return "other"


def gpu_events(path: str):
    """(name, start_us, duration_us) of every GPU activity in a Chrome trace."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e:
            out.append((e.get("name", "?"), float(e["ts"]), float(e["dur"])))
    return out


GAP_BINS_US = (20.0, 200.0, 2000.0)  # idle gaps: under 20 us, 20-200 us, 0.2-2 ms, over 2 ms


def gaps(events):
    """The GPU's idle gaps between activities, in start order: (length us, the activity before,
    the activity after). Their sum is the profiled span's idle time; the rest of it is busy."""
    found = []
    end, last = None, None
    for name, start, dur in sorted(events, key=lambda e: e[1]):
        if end is not None and start > end:
            found.append((start - end, last, name))
        if end is None or start + dur > end:
            end, last = start + dur, name
    return found


def gap_bins(found):
    """[count, total us] of the gaps in each GAP_BINS_US range."""
    bins = [[0, 0.0] for _ in range(len(GAP_BINS_US) + 1)]
    for g, _, _ in found:
        i = next((k for k, edge in enumerate(GAP_BINS_US) if g < edge), len(GAP_BINS_US))
        bins[i][0] += 1
        bins[i][1] += g
    return bins


def summarize(path: str, steps: int, top: int = 12) -> dict:
    """Milliseconds per step: busy, idle within the profiled span, per category, largest
    kernels. Raises ValueError when the trace holds no GPU activity."""
    events = gpu_events(path)
    if not events:
        raise ValueError(f"{path}: no GPU kernel, memcpy or memset in the trace")
    per_cat = collections.Counter()
    per_name = collections.Counter()
    count = collections.Counter()
    for name, _, dur in events:
        per_cat[category(name)] += dur
        per_name[name] += dur
        count[name] += 1
    span = max(t + d for _, t, d in events) - min(t for _, t, _ in events)
    idle = gaps(events)
    busy = span - sum(g for g, _, _ in idle)
    ms = 1e-3 / steps
    edges = ["0"] + [f"{e:g}" for e in GAP_BINS_US] + ["inf"]
    return {
        "trace": path,
        "steps": steps,
        "kernels_per_step": len(events) / steps,
        "span_ms_per_step": span * ms,
        "busy_ms_per_step": busy * ms,
        "idle_ms_per_step": (span - busy) * ms,
        "kernel_ms_per_step": sum(per_cat.values()) * ms,
        "category_ms_per_step": {c: per_cat[c] * ms for c, _ in per_cat.most_common()},
        "largest": [{"name": n[:160], "category": category(n), "ms_per_step": t * ms,
                     "calls_per_step": count[n] / steps} for n, t in per_name.most_common(top)],
        # Idle gaps by length in us ("20-200"): how many a step, and their ms a step.
        "idle_gaps": {f"{edges[i]}-{edges[i + 1]}": {"per_step": n / steps, "ms_per_step": t * ms}
                      for i, (n, t) in enumerate(gap_bins(idle))},
        "largest_gaps": [{"us": g, "after": a[:120], "before": b[:120]}
                         for g, a, b in sorted(idle, reverse=True)[:top]],
    }


def table(summaries, labels) -> str:
    """Markdown: one column per trace, a row per category (ms per step and share of busy)."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    head = "| ms per step | " + " | ".join(labels) + " |"
    lines = [head, "|---|" + "---|" * len(labels)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("GPU busy", [f"{s['busy_ms_per_step']:.1f}" for s in summaries])
    row("GPU idle in the span", [f"{s['idle_ms_per_step']:.1f}" for s in summaries])
    row("kernels per step", [f"{s['kernels_per_step']:.0f}" for s in summaries])
    for gap in summaries[0]["idle_gaps"]:
        row(f"idle in gaps of {gap} us", [
            f"{s['idle_gaps'][gap]['ms_per_step']:.1f} ({s['idle_gaps'][gap]['per_step']:.0f})"
            for s in summaries])
    for c in cats:
        vals = [s["category_ms_per_step"].get(c, 0.0) for s in summaries]
        if any(v >= 0.05 for v in vals):
            row(c, [f"{v:.1f} ({100 * v / s['busy_ms_per_step']:.0f}%)"
                    for v, s in zip(vals, summaries)])
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, required=True, help="how many steps each trace holds")
    p.add_argument("--labels", help="comma-separated column names (default: the file names)")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON lines")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else args.traces
    if len(labels) != len(args.traces):
        p.error("--labels needs one name per trace")
    summaries = []
    for path in args.traces:
        try:
            summaries.append(summarize(path, args.steps))
        except (OSError, ValueError, KeyError) as e:
            print(f"kernel_profile: {e}", file=sys.stderr)
            return 1
    if args.json:
        for s in summaries:
            print(json.dumps(s))
    else:
        print(table(summaries, labels))
        for label, s in zip(labels, summaries):
            print(f"Largest kernels, {label}:\n")
            for k in s["largest"]:
                print(f"- {k['ms_per_step']:.2f} ms, {k['calls_per_step']:.0f} calls "
                      f"({k['category']}): `{k['name']}`")
            print(f"\nLargest idle gaps, {label} (over all {s['steps']} steps):\n")
            for g in s["largest_gaps"]:
                print(f"- {g['us'] / 1000:.2f} ms after `{g['after']}`, before `{g['before']}`")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
