#!/usr/bin/env python3
"""kiln vs PyTorch, measured in the same run on the same machine.

Every benchmark of `kiln-bench matmul` and `kiln-bench ops` is timed in short
turns: `kiln-bench serve` (timed kiln calls on request) and PyTorch take turns,
one burst of back-to-back calls each per pair, each burst after a short pause
(--pause, so that neither side's threads, still spinning after its last call,
take cores from the other's). The speed of a shared machine changes within
seconds; the two bursts of a pair, a fraction of a second apart, see the same
machine.

Method, per benchmark (that of benches/src/timing.rs, in turns): each side's
first call is discarded, then each warms up (0.2 s, at most 10 calls; PyTorch
first); a burst is as many calls as take about --burst-secs (at least 1, by
the slower warm-up median), and pairs = clamp(--target-secs / burst time,
--min-runs, --max-runs), in turn kiln first and PyTorch first. A call is the
whole out-of-place op, output allocation and release included, then a device
synchronize. A side's value comes from the median of all its calls; the
"paired" ratio is the median over pairs of the ratio of the two bursts'
medians. The script prints a table and writes one JSON line per benchmark.

Ratios are always "> 1 means kiln is better": kiln / PyTorch for GFLOP/s and
GB/s, PyTorch / kiln for latency (µs per op).

Usage (PyTorch in its own virtual environment):
    scripts/setup-torch-venv
    $HOME/.cache/kiln/torch-venv/bin/python benches/compare_torch.py [options]

Options mirror kiln-bench's: --sizes, --dim, --only, --target-secs, --min-runs,
--max-runs; --pause S; --burst-secs S; --threads N (both sides); --skip-matmul / --skip-ops;
--out PATH for the JSON lines; --kiln-bin PATH runs a built kiln-bench instead of
`cargo run`.
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent

# The same constants as benches/src/timing.rs and benches/src/suites.rs.
WARMUP_S = 0.2
MAX_WARMUP = 10
LATENCY_INNER = 1000
# Most calls in one burst (kiln-bench serve takes at most 10000 per request).
MAX_BURST = 1000


def sig4(x):
    return float(f"{x:.4g}")


class Bench:
    """One benchmark: the record it reports, kiln's request (without the call
    count), PyTorch's call.

    `metric` is "gflops" or "gbps" (`work` flops or bytes per call) or
    "us_per_op"; `torch_call` runs one call and returns its seconds (per op for
    the latency)."""

    def __init__(self, record, request, torch_call, metric, work, target, inner=1):
        self.record, self.request, self.torch_call = record, request, torch_call
        self.metric, self.work, self.target = metric, work, target
        # Ops per call: the seconds a call reports are divided by it.
        self.inner = inner

    def result(self, times):
        med = statistics.median(times)
        rec = dict(self.record, runs=len(times))
        if self.metric == "us_per_op":
            rec.update(us_per_op=sig4(med * 1e6), min_us=sig4(min(times) * 1e6))
        else:
            rec.update({self.metric: sig4(self.work / med / 1e9)},
                       median_ms=sig4(med * 1e3), min_ms=sig4(min(times) * 1e3))
        return rec


def timed(f, sync):
    def call():
        t0 = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - t0
    return call


def matmul_benches(torch, args):
    sync = _sync(torch, args.torch_device)
    out = []
    for n in args.sizes:
        a = torch.randn(n, n, dtype=torch.float32, device=args.torch_device)
        b = torch.randn(n, n, dtype=torch.float32, device=args.torch_device)
        rec = {"bench": "matmul", "n": n, "shape": [n, n, n], "dtype": "float32"}
        out.append(Bench(rec, f"matmul {n}", timed(lambda a=a, b=b: torch.matmul(a, b), sync),
                         "gflops", 2.0 * n**3, args.target_matmul))
    return out


def ops_benches(torch, args):
    d, device, only = args.dim, args.torch_device, args.only
    n = d * d
    a = torch.randn(n, dtype=torch.float32, device=device)
    b = torch.randn(n, dtype=torch.float32, device=device)
    a2, b2 = a.reshape(d, d), b.reshape(d, d)
    row = torch.randn(d, dtype=torch.float32, device=device)
    sync = _sync(torch, device)
    table = [
        ("add", [n], 3 * 4 * n, lambda: torch.add(a, b)),
        ("mul", [n], 3 * 4 * n, lambda: torch.mul(a, b)),
        ("exp", [n], 2 * 4 * n, lambda: torch.exp(a)),
        ("add_transposed", [d, d], 3 * 4 * n, lambda: torch.add(a2.t(), b2)),
        ("add_broadcast", [d, d], 4 * (2 * n + d), lambda: torch.add(a2, row)),
        ("sum", [n], 4 * n, lambda: a.sum()),
        ("sum_dim", [d, d], 4 * (n + d), lambda: a2.sum(-1)),
        ("max", [n], 4 * n, lambda: a.max()),
        ("softmax", [d, d], 2 * 4 * n, lambda: torch.softmax(a2, -1)),
    ]
    wanted = lambda name: not only or any(w in name for w in only)
    out = []
    for name, shape, nbytes, op in table:
        if wanted(name):
            rec = {"bench": name, "shape": shape, "bytes": nbytes, "dtype": "float32"}
            out.append(Bench(rec, f"op {name} {d}", timed(op, sync), "gbps", nbytes, args.target_ops))
    if wanted("add_latency"):
        x = torch.randn(1, dtype=torch.float32, device=device)
        y = torch.randn(1, dtype=torch.float32, device=device)

        def adds():
            for _ in range(LATENCY_INNER):
                torch.add(x, y)

        per_call = timed(adds, sync)
        rec = {"bench": "add_latency", "shape": [1], "dtype": "float32", "iters_per_run": LATENCY_INNER}
        out.append(Bench(rec, f"op add_latency {d}", lambda: per_call() / LATENCY_INNER,
                         "us_per_op", None, args.target_ops, inner=LATENCY_INNER))
    return out


def in_turns(args, benches):
    """Times `benches` in turns, bursts of kiln calls (through `kiln-bench serve`)
    and of PyTorch calls (see the module's docstring). Returns (kiln records,
    PyTorch records); kiln's carry the median pair ratio, or the error kiln answered."""
    cmd, env = kiln_cmd(args, "serve")
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    kiln, ref = [], []

    def kiln_calls(request, calls):
        try:
            proc.stdin.write(f"{request} {calls}\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            sys.exit(f"compare_torch: kiln-bench serve exited with code {proc.wait()} and no answer")
        rec = json.loads(line)
        if "error" in rec:
            raise RuntimeError(rec["error"])
        return rec["secs"]

    def kiln_call(request):
        return kiln_calls(request, 1)[0]

    def warm_up(call):
        time.sleep(args.pause)
        first, warm, spent = call(), [], 0.0
        while not warm or (spent < WARMUP_S and len(warm) < MAX_WARMUP and first < WARMUP_S):
            time.sleep(args.pause)
            warm.append(call())
            spent += warm[-1]
        return statistics.median(warm)

    try:
        for b in benches:
            label = b.record["bench"] + (f" n={b.record['n']}" if "n" in b.record else "")
            torch_est = warm_up(b.torch_call)
            kt, tt, ratios = [], [], []
            try:
                # Seconds of one whole call (the latency's calls are LATENCY_INNER ops).
                est = max(warm_up(lambda: kiln_call(b.request)), torch_est, 1e-12) * b.inner
                # Rust's f64::round rounds half away from zero; Python's round() to even. Match Rust.
                burst = min(max(int(args.burst_secs / est + 0.5), 1), MAX_BURST)
                pairs = min(max(int(b.target / (burst * est) + 0.5), max(args.min_runs, 1)), max(args.max_runs, 1))
                for i in range(pairs):
                    got = {}
                    for side in ("kiln", "torch") if i % 2 == 0 else ("torch", "kiln"):
                        time.sleep(args.pause)
                        if side == "kiln":
                            got[side] = kiln_calls(b.request, burst)
                        else:
                            got[side] = [b.torch_call() for _ in range(burst)]
                    kt += got["kiln"]
                    tt += got["torch"]
                    ratios.append(statistics.median(got["torch"]) / statistics.median(got["kiln"]))
            except RuntimeError as e:
                # The row still shows, with PyTorch's times so far and kiln's error.
                kiln.append(dict(b.record, error=str(e)))
                ref.append(b.result(tt or [torch_est]))
                continue
            kiln.append(dict(b.result(kt), pair_ratio=statistics.median(ratios)))
            ref.append(b.result(tt))
            print(f"{label}: {pairs} pairs of {burst} calls, kiln {kiln[-1][b.metric]}, torch {ref[-1][b.metric]}",
                  file=sys.stderr, flush=True)
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        proc.wait()
    return kiln, ref


def _sync(torch, device):
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def kiln_cmd(args, what):
    """The kiln-bench command line for `what`, and its environment."""
    base = [args.kiln_bin] if args.kiln_bin else ["cargo", "run", "--release", "-q", "-p", "kiln-bench", "--"]
    cmd = base + [what, "--device", args.kiln_device]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    # kiln's CPU kernels run on rayon's global pool: the same thread count as PyTorch's.
    return cmd, {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}


def key(rec):
    return (rec["bench"], rec.get("n"))


METRICS = [("gflops", "GFLOP/s", True), ("gbps", "GB/s", True), ("us_per_op", "us/op", False)]


def compare(kiln, torch_res):
    """Pairs results by benchmark; ratio > 1 means kiln is better."""
    by_key = {key(r): r for r in kiln}
    rows = []
    for t in torch_res:
        k = by_key.get(key(t), {})
        metric, unit, higher = next((m for m in METRICS if m[0] in t), (None, None, None))
        kv, tv = k.get(metric), t.get(metric)
        ratio = None
        if kv and tv:
            ratio = kv / tv if higher else tv / kv
        paired = k.get("pair_ratio")
        rows.append({
            "bench": t["bench"], "n": t.get("n"), "shape": t.get("shape"), "dtype": t["dtype"],
            "metric": metric, "unit": unit, "higher_is_better": higher,
            "kiln": kv, "torch": tv, "ratio": sig4(ratio) if ratio else None,
            "paired_ratio": sig4(paired) if paired else None,
            "ratio_meaning": "kiln/torch" if higher else "torch/kiln (time)",
            "kiln_median_ms": k.get("median_ms"), "torch_median_ms": t.get("median_ms"),
            "kiln_calls": k.get("runs"), "torch_calls": t.get("runs"),
            **({"kiln_error": k["error"]} if "error" in k else {}),
            **({"kiln_missing": True} if not k else {}),
        })
    return rows


def print_table(rows, header):
    print(header)
    cols = ["benchmark", "size", "unit", "kiln", "PyTorch", "ratio", "paired"]
    table = []
    for r in rows:
        size = f"n={r['n']}" if r["n"] else "x".join(map(str, r["shape"] or []))
        kv = "ERROR" if "kiln_error" in r else ("-" if r["kiln"] is None else f"{r['kiln']:g}")
        table.append([r["bench"], size, r["unit"], kv, f"{r['torch']:g}",
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
                      "-" if r["paired_ratio"] is None else f"{r['paired_ratio']:.2f}x"])
    w = [max(len(c), *(len(row[i]) for row in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(cols)))
    print("  ".join("-" * x for x in w))
    for row in table:
        print("  ".join(v.ljust(w[i]) if i < 3 else v.rjust(w[i]) for i, v in enumerate(row)))
    print("\nratio > 1 means kiln is faster: kiln/PyTorch for GFLOP/s and GB/s, "
          "PyTorch/kiln for us/op (latency).\nratio: of the two medians over all calls; "
          "paired: the median over pairs of the ratio of the two bursts' medians.")
    for r in rows:
        if "kiln_error" in r:
            print(f"kiln {r['bench']}: {r['kiln_error']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096", help="matmul sizes (default 1024,4096)")
    ap.add_argument("--dim", type=int, default=4096, help="side of the [D, D] tensors of the ops (default 4096)")
    ap.add_argument("--only", default="", help="ops whose names contain one of these comma-separated words")
    ap.add_argument("--target-secs", type=float, default=None,
                    help="seconds of timed calls per side and benchmark (default 9 for matmul, 4 for ops)")
    ap.add_argument("--min-runs", type=int, default=3, help="fewest pairs of bursts (default 3)")
    ap.add_argument("--max-runs", type=int, default=200, help="most pairs of bursts (default 200)")
    ap.add_argument("--pause", type=float, default=0.02,
                    help="seconds of pause before each burst (default 0.02)")
    ap.add_argument("--burst-secs", type=float, default=0.1,
                    help="about how long one side's burst of calls takes (default 0.1; at least one call)")
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for both: torch.set_num_threads and kiln's RAYON_NUM_THREADS "
                         "(default: the number of cores)")
    ap.add_argument("--kiln-device", default="cpu", help="kiln-bench --device (default cpu)")
    ap.add_argument("--torch-device", default="cpu", help="PyTorch device (default cpu)")
    ap.add_argument("--kiln-bin", default=None,
                    help="a built kiln-bench binary to run instead of `cargo run --release -p kiln-bench --`")
    ap.add_argument("--out", default=str(REPO / "target" / "kiln-bench" / "compare_torch.jsonl"),
                    help="where to write the JSON lines (default target/kiln-bench/compare_torch.jsonl)")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.only = [s for s in args.only.split(",") if s]

    try:
        import torch
    except ImportError:
        sys.exit("compare_torch: PyTorch is not importable by " + sys.executable +
                 "\nrun scripts/setup-torch-venv, then $HOME/.cache/kiln/torch-venv/bin/python benches/compare_torch.py")
    torch.set_num_threads(args.threads)
    args.target_matmul = args.target_secs if args.target_secs is not None else 9.0
    args.target_ops = args.target_secs if args.target_secs is not None else 4.0

    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    benches = (matmul_benches(torch, args) if not args.skip_matmul else []) + \
        (ops_benches(torch, args) if not args.skip_ops else [])
    rows = compare(*in_turns(args, benches))
    header = (f"kiln ({args.kiln_device}) vs PyTorch {torch.__version__} ({args.torch_device}, "
              f"{torch.get_num_threads()} threads) on {platform.machine()}, {os.cpu_count()} cores")
    print()
    print_table(rows, header)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "torch_version": torch.__version__, "threads": torch.get_num_threads()}) + "\n")
    print(f"\nJSON lines: {out}")
    return 1 if any("kiln_error" in r or r.get("kiln_missing") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
