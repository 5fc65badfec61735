#!/usr/bin/env python3
"""kiln vs PyTorch, measured in the same run on the same machine.

Matmul is timed call by call: `kiln-bench serve` (one timed kiln call per
request) and PyTorch take turns, one call each per pair, each call after a short
pause (--pause), for about --rounds x --target-secs per size; a side's value is
the median of its calls, and the "paired" ratio is the median of the pairs'
ratios. The speed of a shared machine changes within seconds, so the two calls
of a pair, a fraction of a second apart, see the same machine.

The ops run `cargo run --release -p kiln-bench -- ops ...`, parse its JSON lines
and run the same measurements in PyTorch with the same method (first call
discarded, warm-up of 0.2 s / at most 10 calls, run count from the warm-up
median, median of the timed runs; see benches/src/timing.rs). This repeats for
--rounds rounds (default 3), each running kiln's suite then PyTorch's; a
benchmark's value is that of its median round, every round's value is printed
and kept, and the "paired" ratio is the median over rounds of each round's own
kiln/PyTorch ratio.

The script prints a table with ratios and writes one JSON line per benchmark.

Ratios are always "> 1 means kiln is better": kiln / PyTorch for GFLOP/s and
GB/s, PyTorch / kiln for latency (µs per op).

Usage (PyTorch in its own virtual environment):
    scripts/setup-torch-venv
    $HOME/.cache/kiln/torch-venv/bin/python benches/compare_torch.py [options]

Options mirror kiln-bench's: --sizes, --dim, --only, --target-secs, --min-runs,
--max-runs; --rounds N; --pause S; --threads N (both sides); --skip-matmul /
--skip-ops; --out PATH for the JSON lines;
--kiln-bin PATH runs a built kiln-bench instead of `cargo run`.
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


def measure(f, target_s, min_runs, max_runs, inner=1):
    """Seconds per call (divided by `inner`), one per timed run, sorted.

    Line for line the method of `timing::measure` in kiln-bench."""

    def time_call():
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    first = time_call()
    warm, spent = [], 0.0
    while not warm or (spent < WARMUP_S and len(warm) < MAX_WARMUP and first < WARMUP_S):
        t = time_call()
        spent += t
        warm.append(t)
    est = max(statistics.median(warm), 1e-9)
    # Rust's f64::round rounds half away from zero; Python's round() to even. Match Rust.
    runs = int(target_s / est + 0.5)
    runs = min(max(runs, max(min_runs, 1)), max(max_runs, 1))
    return sorted(time_call() / max(inner, 1) for _ in range(runs))


def sig4(x):
    return float(f"{x:.4g}")


def matmul_call_by_call(torch, args, plan):
    """Matmul timed call by call, kiln (through `kiln-bench serve`) and PyTorch in turn.

    Per size: each side's first call is discarded, then each warms up (0.2 s, at
    most 10 calls; PyTorch first); pairs = clamp(rounds x target / slower warm-up median,
    min_runs, max_runs). A pair is one kiln call and one PyTorch call, in turn
    first, each after a pause of --pause seconds (so that neither side's threads,
    still spinning after its last call, take cores from the other's). Returns
    (kiln records, PyTorch records); kiln's carry the pair ratios."""
    cmd, env = kiln_cmd(args, "serve")
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    sync = _sync(torch, args.torch_device)
    kiln, ref = [], []

    def kiln_call(n):
        try:
            proc.stdin.write(f"matmul {n}\n")
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

    try:
        for n in args.sizes:
            a = torch.randn(n, n, dtype=torch.float32, device=args.torch_device)
            b = torch.randn(n, n, dtype=torch.float32, device=args.torch_device)

            def torch_call():
                t0 = time.perf_counter()
                torch.matmul(a, b)
                sync()
                return time.perf_counter() - t0

            def warm_up(call):
                time.sleep(args.pause)
                first, warm, spent = call(), [], 0.0
                while not warm or (spent < WARMUP_S and len(warm) < MAX_WARMUP and first < WARMUP_S):
                    time.sleep(args.pause)
                    warm.append(call())
                    spent += warm[-1]
                return statistics.median(warm)

            flops = 2.0 * n**3

            def record(times):
                med = statistics.median(times)
                return {
                    "bench": "matmul", "n": n, "shape": [n, n, n], "dtype": "float32",
                    "gflops": sig4(flops / med / 1e9), "median_ms": sig4(med * 1e3),
                    "min_ms": sig4(min(times) * 1e3), "runs": len(times),
                }

            torch_est = warm_up(torch_call)
            try:
                est = max(warm_up(lambda: kiln_call(n)), torch_est, 1e-9)
            except RuntimeError as e:
                # The row still shows, with PyTorch's warm-up median and kiln's error.
                kiln.append({"bench": "matmul", "n": n, "error": str(e)})
                ref.append(record([torch_est]))
                continue
            pairs = int(max(args.rounds, 1) * plan["target_matmul"] / est + 0.5)
            pairs = min(max(pairs, max(plan["min_runs"], 1)), max(plan["max_runs"], 1))
            print(f"matmul n={n}: {pairs} pairs of calls", file=sys.stderr, flush=True)
            kt, tt = [], []
            for i in range(pairs):
                for side in ("kiln", "torch") if i % 2 == 0 else ("torch", "kiln"):
                    time.sleep(args.pause)
                    if side == "kiln":
                        kt.append(kiln_call(n))
                    else:
                        tt.append(torch_call())
            kiln.append(record(kt))
            ref.append(record(tt))
            kiln[-1]["pair_ratio"] = statistics.median(t / k for k, t in zip(kt, tt))
            print(f"  kiln {kiln[-1]['gflops']}, torch {ref[-1]['gflops']} GFLOP/s", file=sys.stderr, flush=True)
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


def torch_ops(torch, d, only, plan, device):
    n = d * d
    a = torch.randn(n, dtype=torch.float32, device=device)
    b = torch.randn(n, dtype=torch.float32, device=device)
    a2, b2 = a.reshape(d, d), b.reshape(d, d)
    row = torch.randn(d, dtype=torch.float32, device=device)
    sync = _sync(torch, device)
    benches = [
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
    out = []
    for name, shape, nbytes, op in benches:
        if only and not any(w in name for w in only):
            continue

        def f(op=op):
            op()
            sync()

        s = measure(f, plan["target_ops"], plan["min_runs"], plan["max_runs"])
        med = statistics.median(s)
        out.append({
            "bench": name, "shape": shape, "bytes": nbytes, "dtype": "float32", "device": device,
            "gbps": sig4(nbytes / med / 1e9), "median_ms": sig4(med * 1e3), "min_ms": sig4(s[0] * 1e3),
            "runs": len(s),
        })
        print(f"  torch {name}: {out[-1]['gbps']} GB/s", file=sys.stderr, flush=True)
    if not only or any(w in "add_latency" for w in only):
        x = torch.randn(1, dtype=torch.float32, device=device)
        y = torch.randn(1, dtype=torch.float32, device=device)

        def f():
            for _ in range(LATENCY_INNER):
                torch.add(x, y)
            sync()

        s = measure(f, plan["target_ops"], plan["min_runs"], plan["max_runs"], inner=LATENCY_INNER)
        out.append({
            "bench": "add_latency", "shape": [1], "dtype": "float32", "device": device,
            "us_per_op": sig4(statistics.median(s) * 1e6), "min_us": sig4(s[0] * 1e6), "runs": len(s),
            "iters_per_run": LATENCY_INNER,
        })
        print(f"  torch add_latency: {out[-1]['us_per_op']} us/op", file=sys.stderr, flush=True)
    return out


def kiln_cmd(args, what):
    """The kiln-bench command line for `what`, and its environment."""
    base = [args.kiln_bin] if args.kiln_bin else ["cargo", "run", "--release", "-q", "-p", "kiln-bench", "--"]
    cmd = base + [what, "--device", args.kiln_device]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    # kiln's CPU kernels run on rayon's global pool: the same thread count as PyTorch's.
    return cmd, {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}


def run_kiln(args, what):
    """Runs `kiln-bench ops`; returns its parsed JSON lines."""
    cmd, env = kiln_cmd(args, what)
    cmd += ["--min-runs", str(args.min_runs), "--max-runs", str(args.max_runs), "--dim", str(args.dim)]
    if args.only:
        cmd += ["--only", ",".join(args.only)]
    if args.target_secs is not None:
        cmd += ["--target-secs", str(args.target_secs)]
    # stderr passes through (cargo's build output, kiln-bench's failure summary).
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            lines.append(rec)
            val = rec.get("gflops", rec.get("gbps", rec.get("us_per_op", rec.get("error"))))
            print(f"  kiln {rec['bench']}: {val}", file=sys.stderr, flush=True)
    if p.returncode != 0 and not lines:
        sys.exit(f"compare_torch: kiln-bench {what} failed with exit code {p.returncode} and printed no result")
    return lines


def key(rec):
    return (rec["bench"], rec.get("n"))


def metric_of(rec):
    return next((rec[m] for m, _, _ in METRICS if m in rec), None)


def median_round(rounds):
    """Per benchmark, the record of the median round (by its metric), with every
    round's value in `rounds`; a failed run's record wins, so errors show."""
    by_key = {}
    for recs in rounds:
        for rec in recs:
            by_key.setdefault(key(rec), []).append(rec)
    out = []
    for recs in by_key.values():
        failed = [r for r in recs if metric_of(r) is None]
        if failed:
            out.append(failed[0])
            continue
        ranked = sorted(recs, key=metric_of)
        out.append({**ranked[(len(ranked) - 1) // 2], "rounds": [metric_of(r) for r in recs]})
    return out


METRICS = [("gflops", "GFLOP/s", True), ("gbps", "GB/s", True), ("us_per_op", "us/op", False)]


def compare(kiln, torch_res):
    """Pairs results by benchmark; ratio > 1 means kiln is better."""
    by_key = {key(r): r for r in kiln}
    rows = []
    for t in torch_res:
        k = by_key.get(key(t), {})
        metric, unit, higher = next((m for m in METRICS if m[0] in t), (None, None, None))
        kv, tv = k.get(metric), t.get(metric)
        ratio = paired = None
        if kv and tv:
            ratio = kv / tv if higher else tv / kv
        kr, tr = k.get("rounds") or [], t.get("rounds") or []
        if "pair_ratio" in k:
            paired = k["pair_ratio"]
        elif kr and len(kr) == len(tr) and all(kr) and all(tr):
            paired = statistics.median(a / b if higher else b / a for a, b in zip(kr, tr))
        rows.append({
            "bench": t["bench"], "n": t.get("n"), "shape": t.get("shape"), "dtype": t["dtype"],
            "metric": metric, "unit": unit, "higher_is_better": higher,
            "kiln": kv, "torch": tv, "ratio": sig4(ratio) if ratio else None,
            "paired_ratio": sig4(paired) if paired else None,
            "ratio_meaning": "kiln/torch" if higher else "torch/kiln (time)",
            "kiln_median_ms": k.get("median_ms"), "torch_median_ms": t.get("median_ms"),
            "kiln_runs": k.get("runs"), "torch_runs": t.get("runs"),
            "kiln_rounds": k.get("rounds"), "torch_rounds": t.get("rounds"),
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
          "PyTorch/kiln for us/op (latency).\nratio: of the medians (matmul: over calls; "
          "ops: the median rounds).\npaired: the median of each pair's ratio "
          "(matmul: pairs of calls; ops: rounds).")
    if any(r.get("kiln_rounds") for r in rows):
        print("every round (kiln | PyTorch):")
        for r, row in zip(rows, table):
            if not r.get("kiln_rounds"):
                continue
            fmt = lambda v: " ".join(f"{x:g}" for x in v or [])
            print(f"  {row[0]} {row[1]}: {fmt(r.get('kiln_rounds'))} | {fmt(r.get('torch_rounds'))}")
    for r in rows:
        if "kiln_error" in r:
            print(f"kiln {r['bench']}: {r['kiln_error']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096", help="matmul sizes (default 1024,4096)")
    ap.add_argument("--dim", type=int, default=4096, help="side of the [D, D] tensors of the ops (default 4096)")
    ap.add_argument("--only", default="", help="ops whose names contain one of these comma-separated words")
    ap.add_argument("--target-secs", type=float, default=None,
                    help="seconds of timed runs per benchmark (default 3 for matmul, 2 for ops)")
    ap.add_argument("--min-runs", type=int, default=3)
    ap.add_argument("--max-runs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="ops: rounds of kiln-then-PyTorch runs, each result is the median round; "
                         "matmul: pairs of calls for rounds x --target-secs (default 3)")
    ap.add_argument("--pause", type=float, default=0.02,
                    help="seconds of pause before each matmul call (default 0.02)")
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
    plan = {
        "target_matmul": args.target_secs if args.target_secs is not None else 3.0,
        "target_ops": args.target_secs if args.target_secs is not None else 2.0,
        "min_runs": args.min_runs, "max_runs": args.max_runs,
    }

    # Rounds alternate kiln and PyTorch, so slow phases of a shared machine fall on both.
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    rounds = max(args.rounds, 1)
    kiln_rounds, ref_rounds = [[] for _ in range(rounds)], [[] for _ in range(rounds)]
    kiln_mm, ref_mm = matmul_call_by_call(torch, args, plan) if not args.skip_matmul else ([], [])
    if not args.skip_ops:
        for r in range(rounds):
            print(f"ops: round {r + 1} of {rounds}", file=sys.stderr, flush=True)
            kiln_rounds[r] += run_kiln(args, "ops")
            ref_rounds[r] += torch_ops(torch, args.dim, args.only, plan, args.torch_device)

    rows = compare(kiln_mm + median_round(kiln_rounds), ref_mm + median_round(ref_rounds))
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
