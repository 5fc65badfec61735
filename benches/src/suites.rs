//! The benchmarks: `matmul` (square f32 GEMM, GFLOP/s) and `ops` (elementwise,
//! reductions and softmax in GB/s, and per-op dispatch latency in µs).
//!
//! Every timed call runs the whole out-of-place op, output allocation and
//! release included, as `torch.add(a, b)` does, then waits for the device.
use crate::report::{sig4, Line};
use crate::timing::{measure, time_call, Plan, Stats};
use kiln::prelude::*;

/// Options shared by the suites.
#[derive(Debug, Clone)]
pub struct Config {
    pub device: Device,
    pub plan: Plan,
    /// Only benchmarks whose name contains one of these (empty: all).
    pub filter: Vec<String>,
}

impl Config {
    fn wants(&self, name: &str) -> bool {
        self.filter.is_empty() || self.filter.iter().any(|f| name.contains(f.as_str()))
    }
    fn opts(&self) -> (DType, Device) {
        (DType::F32, self.device)
    }
}

/// Waits until the device has finished the work queued so far.
fn sync(t: &Tensor) -> Result<()> {
    t.backend().synchronize(t.device())
}

/// Times `f` (one op producing a tensor) with the config's plan.
fn time_op(cfg: &Config, mut f: impl FnMut() -> Result<Tensor>) -> Result<Stats> {
    measure(cfg.plan, 1, || {
        let out = f()?;
        sync(&out)
    })
}

fn error_line(bench: &str, cfg: &Config, e: &Error) {
    Line::new(bench, "float32", &cfg.device.to_string()).set("error", e.to_string()).emit();
}

/// Products `[m, k] @ [k, n]` of random matrices of one dtype, `b` stored as
/// `[n, k]` and transposed when `linear` (a Linear's `x @ W.T`). Returns the
/// number of failures.
pub fn matmul(cfg: &Config, sizes: &[[usize; 3]], dtype: DType, linear: bool) -> usize {
    let mut failed = 0;
    for &[m, k, n] in sizes {
        let run = || -> Result<Stats> {
            let a = Tensor::randn(&[m, k], cfg.opts())?.to_dtype(dtype)?;
            let b = match linear {
                true => Tensor::randn(&[n, k], cfg.opts())?.to_dtype(dtype)?.t()?,
                false => Tensor::randn(&[k, n], cfg.opts())?.to_dtype(dtype)?,
            };
            time_op(cfg, || a.matmul(&b))
        };
        let line = || {
            Line::new("matmul", dtype.name(), &cfg.device.to_string())
                .set("n", n)
                .set("shape", vec![m, k, n])
                .set("linear", linear)
        };
        match run() {
            Ok(s) => {
                let flops = 2.0 * (m * k * n) as f64;
                line()
                    .set("gflops", sig4(flops / s.median() / 1e9))
                    .set("median_ms", sig4(s.median() * 1e3))
                    .set("min_ms", sig4(s.min() * 1e3))
                    .set("runs", s.runs())
                    .emit();
            }
            Err(e) => {
                failed += 1;
                line().set("error", e.to_string()).emit();
            }
        }
    }
    failed
}

/// `kiln-bench serve`: timed calls on request, so that a driver can alternate
/// kiln's calls with another library's a few at a time (`compare_torch.py`).
///
/// A request is a line `matmul N [CALLS]` or `op NAME D [CALLS]`; the answer is
/// one line `{"bench": "matmul", "n": N, "secs": [S, ...]}` or
/// `{"bench": NAME, "d": D, "secs": [S, ...]}`: the seconds of each of CALLS
/// (default 1) back-to-back calls of an n x n x n f32 matmul or of the `ops`
/// benchmark NAME on D*D elements, each call whole (output allocation and
/// release included, then a device synchronize; `add_latency`: seconds per add,
/// of one call of `LATENCY_INNER` adds); or `{"bench": ..., "error": ...}`. The
/// random inputs of a size are made on its first request and kept.
pub struct Server {
    cfg: Config,
    inputs: Vec<(usize, Tensor, Tensor)>,
    ops: Vec<OpsInputs>,
}

/// Most calls one request may ask for.
const MAX_CALLS: usize = 10_000;

impl Server {
    pub fn new(cfg: Config) -> Server {
        Server { cfg, inputs: vec![], ops: vec![] }
    }

    /// The answer to one request line.
    pub fn answer(&mut self, request: &str) -> Line {
        let dev = self.cfg.device.to_string();
        let count = |bench: &str, what: &str, v: &str, max: usize| match v.parse::<usize>() {
            Ok(n) if n > 0 && n <= max => Ok(n),
            _ => {
                let e = format!("bad {what} {v:?} in {request:?} (expected 1 to {max})");
                Err(Line::new(bench, "float32", &dev).set("error", e))
            }
        };
        let words: Vec<&str> = request.split_whitespace().collect();
        let (bench, key, op, size, calls) = match words.as_slice() {
            ["matmul", n, rest @ ..] if rest.len() <= 1 => ("matmul", "n", None, *n, rest.first()),
            ["op", name, d, rest @ ..] if rest.len() <= 1 => (*name, "d", Some(*name), *d, rest.first()),
            _ => {
                let e = format!("unknown request {request:?} (expected `matmul N [CALLS]` or `op NAME D [CALLS]`)");
                return Line::new("serve", "float32", &dev).set("error", e);
            }
        };
        let size = match count(bench, "size", size, usize::MAX) {
            Ok(n) => n,
            Err(line) => return line,
        };
        let calls = match calls.map(|c| count(bench, "calls", c, MAX_CALLS)) {
            None => 1,
            Some(Ok(c)) => c,
            Some(Err(line)) => return line,
        };
        let timed = match op {
            None => self.time_matmul(size, calls),
            Some(name) => self.time_op(name, size, calls),
        };
        let line = Line::new(bench, "float32", &dev).set(key, size);
        match timed {
            Ok(secs) => line.set("secs", secs),
            Err(e) => line.set("error", e.to_string()),
        }
    }

    fn time_op(&mut self, name: &str, d: usize, calls: usize) -> Result<Vec<f64>> {
        if !self.ops.iter().any(|o| o.d == d) {
            self.ops.push(OpsInputs::new(&self.cfg, d)?);
        }
        let inputs = self.ops.iter().find(|o| o.d == d).expect("inputs made above");
        if name == "add_latency" {
            let per_op = |t: f64| t / LATENCY_INNER as f64;
            return time_calls(calls, || inputs.latency_call()).map(|v| v.into_iter().map(per_op).collect());
        }
        let Some(mut bw) = inputs.benches().into_iter().find(|b| b.name == name) else {
            return Err(Error::invalid("serve", format!("no ops benchmark named {name:?}")));
        };
        time_calls(calls, || sync(&(bw.op)()?))
    }

    fn time_matmul(&mut self, n: usize, calls: usize) -> Result<Vec<f64>> {
        if !self.inputs.iter().any(|(m, _, _)| *m == n) {
            let a = Tensor::randn(&[n, n], self.cfg.opts())?;
            let b = Tensor::randn(&[n, n], self.cfg.opts())?;
            self.inputs.push((n, a, b));
        }
        let (_, a, b) = self.inputs.iter().find(|(m, _, _)| *m == n).expect("inputs made above");
        time_calls(calls, || sync(&a.matmul(b)?))
    }
}

/// The seconds of each of `calls` back-to-back calls of `f`; what `f` makes is
/// released inside its timed call.
fn time_calls(calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    (0..calls).map(|_| time_call(&mut f)).collect()
}

/// Answers requests from stdin until it closes; returns the number of failed ones.
pub fn serve(cfg: &Config) -> usize {
    let mut server = Server::new(cfg.clone());
    let mut failed = 0;
    for line in std::io::stdin().lines() {
        let Ok(line) = line else { break };
        if line.trim().is_empty() {
            continue;
        }
        let answer = server.answer(&line);
        failed += usize::from(answer.has("error"));
        answer.emit();
    }
    failed
}

/// A bandwidth benchmark: its name, the shape it reports, the bytes one call
/// moves, and the op.
struct Bw<'a> {
    name: &'static str,
    shape: Vec<usize>,
    bytes: usize,
    op: Box<dyn FnMut() -> Result<Tensor> + 'a>,
}

/// Iterations of the 1-element op per timed call of the latency benchmark.
pub const LATENCY_INNER: usize = 1000;

/// The tensors of the `ops` suite on `d*d` f32 elements.
struct OpsInputs {
    d: usize,
    a: Tensor,
    b: Tensor,
    a2: Tensor,
    b2: Tensor,
    row: Tensor,
    /// `a` rounded to bf16 (the casts' input).
    a_bf16: Tensor,
    /// The two 1-element operands of `add_latency`.
    x: Tensor,
    y: Tensor,
}

impl OpsInputs {
    fn new(cfg: &Config, d: usize) -> Result<OpsInputs> {
        let n = d * d;
        let a = Tensor::randn(&[n], cfg.opts())?;
        let b = Tensor::randn(&[n], cfg.opts())?;
        let a2 = a.reshape(&[d as isize, d as isize])?;
        let b2 = b.reshape(&[d as isize, d as isize])?;
        let row = Tensor::randn(&[d], cfg.opts())?;
        let x = Tensor::randn(&[1], cfg.opts())?;
        let y = Tensor::randn(&[1], cfg.opts())?;
        let a_bf16 = a.to_dtype(DType::BF16)?;
        Ok(OpsInputs { d, a, b, a2, b2, row, a_bf16, x, y })
    }

    /// The bandwidth benchmarks, in the suite's order.
    fn benches(&self) -> Vec<Bw<'_>> {
        let (d, f32b) = (self.d, 4);
        let n = d * d;
        let OpsInputs { a, b, a2, b2, row, a_bf16, .. } = self;
        vec![
            Bw { name: "add", shape: vec![n], bytes: 3 * f32b * n, op: Box::new(move || a.add(b)) },
            Bw { name: "mul", shape: vec![n], bytes: 3 * f32b * n, op: Box::new(move || a.mul(b)) },
            Bw { name: "exp", shape: vec![n], bytes: 2 * f32b * n, op: Box::new(move || a.exp()) },
            // `a2.t()` is a non-contiguous view: the kernel reads one input across rows.
            Bw {
                name: "add_transposed",
                shape: vec![d, d],
                bytes: 3 * f32b * n,
                op: Box::new(move || a2.t()?.add(b2)),
            },
            // `[d, d] + [d]`: the row is broadcast (stride 0) over every row.
            Bw {
                name: "add_broadcast",
                shape: vec![d, d],
                bytes: f32b * (2 * n + d),
                op: Box::new(move || a2.add(row)),
            },
            // Casts, as autocast runs them around every product.
            Bw { name: "to_bf16", shape: vec![n], bytes: 6 * n, op: Box::new(move || a.to_dtype(DType::BF16)) },
            Bw { name: "to_f32", shape: vec![n], bytes: 6 * n, op: Box::new(move || a_bf16.to_dtype(DType::F32)) },
            Bw { name: "sum", shape: vec![n], bytes: f32b * n, op: Box::new(move || a.sum()) },
            Bw {
                name: "sum_dim",
                shape: vec![d, d],
                bytes: f32b * (n + d),
                op: Box::new(move || a2.sum_dim(-1, false)),
            },
            Bw { name: "max", shape: vec![n], bytes: f32b * n, op: Box::new(move || a.max()) },
            Bw { name: "softmax", shape: vec![d, d], bytes: 2 * f32b * n, op: Box::new(move || a2.softmax(-1)) },
        ]
    }

    /// One call of `add_latency`: `LATENCY_INNER` adds of the 1-element operands.
    fn latency_call(&self) -> Result<()> {
        let mut last = None;
        for _ in 0..LATENCY_INNER {
            last = Some(self.x.add(&self.y)?);
        }
        last.map_or(Ok(()), |t| sync(&t))
    }
}

/// Elementwise, reduction and softmax throughput on `d*d` f32 elements (flat for the
/// contiguous elementwise ops and full reductions, `d x d` for the rest), then the
/// dispatch latency of a 1-element `add`. Returns the number of failures.
pub fn ops(cfg: &Config, d: usize) -> usize {
    let mut failed = 0;
    let dev = cfg.device.to_string();
    let inputs = match OpsInputs::new(cfg, d) {
        Ok(t) => t,
        Err(e) => {
            error_line("ops", cfg, &e);
            return 1;
        }
    };
    let benches = inputs.benches();
    for mut bw in benches {
        if !cfg.wants(bw.name) {
            continue;
        }
        match time_op(cfg, &mut bw.op) {
            Ok(s) => Line::new(bw.name, "float32", &dev)
                .set("shape", bw.shape)
                .set("bytes", bw.bytes)
                .set("gbps", sig4(bw.bytes as f64 / s.median() / 1e9))
                .set("median_ms", sig4(s.median() * 1e3))
                .set("min_ms", sig4(s.min() * 1e3))
                .set("runs", s.runs())
                .emit(),
            Err(e) => {
                failed += 1;
                error_line(bw.name, cfg, &e);
            }
        }
    }
    if cfg.wants("add_latency") {
        match measure(cfg.plan, LATENCY_INNER, || inputs.latency_call()) {
            Ok(s) => Line::new("add_latency", "float32", &dev)
                .set("shape", vec![1])
                .set("us_per_op", sig4(s.median() * 1e6))
                .set("min_us", sig4(s.min() * 1e6))
                .set("runs", s.runs())
                .set("iters_per_run", LATENCY_INNER)
                .emit(),
            Err(e) => {
                failed += 1;
                error_line("add_latency", cfg, &e);
            }
        }
    }
    failed
}

/// `chain`: ten elementwise ops (`x * 0.5`, `+ 1`, `* x`, `exp`, `- 0.25`, `* 3`, `+ x`,
/// `tanh`, `abs`, `+ 2`) on `d*d` float32 elements, each run reading and writing the
/// whole tensor, timed once per PJRT mode in the same run: Strict (ten programs) and
/// DeferAndFuse (one fused program). Prints one line per mode and the defer/strict ratio.
pub fn chain(cfg: &Config, d: usize) -> usize {
    let dev = cfg.device.to_string();
    let n = d * d;
    let chain = |x: &Tensor| -> Result<Tensor> {
        let y = x.mul(0.5)?.add(1.0)?.mul(x)?.exp()?.sub(0.25)?;
        y.mul(3.0)?.add(x)?.tanh()?.abs()?.add(2.0)
    };
    let run = |mode: kiln::tpu::Mode| -> Result<Stats> {
        let x = Tensor::randn(&[n], cfg.opts())?;
        sync(&x)?;
        kiln::tpu::with_mode(mode, || {
            measure(cfg.plan, 1, || {
                let y = chain(&x)?;
                sync(&y)
            })
        })
    };
    if cfg.device.kind() != kiln::DeviceKind::Tpu {
        error_line("chain", cfg, &Error::invalid("chain", "the chain benchmark compares PJRT modes: use --device tpu"));
        return 1;
    }
    let mut times = vec![];
    for (mode, name) in [(kiln::tpu::Mode::Strict, "strict"), (kiln::tpu::Mode::Defer, "defer")] {
        match run(mode) {
            Ok(s) => {
                Line::new("chain", "float32", &dev)
                    .set("mode", name)
                    .set("shape", vec![n])
                    .set("ops", "x*0.5, +1, *x, exp, -0.25, *3, +x, tanh, abs, +2")
                    .set("median_ms", sig4(s.median() * 1e3))
                    .set("min_ms", sig4(s.min() * 1e3))
                    .set("runs", s.runs())
                    .emit();
                times.push(s.median());
            }
            Err(e) => {
                error_line("chain", cfg, &e);
                return 1;
            }
        }
    }
    Line::new("chain_ratio", "float32", &dev).set("defer_speedup_over_strict", sig4(times[0] / times[1])).emit();
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::Plan;

    fn server() -> Server {
        let plan = Plan { target_s: 0.1, min_runs: 1, max_runs: 1 };
        Server::new(Config { device: Device::Cpu, plan, filter: vec![] })
    }

    /// Checks an answer's bench, size (`key`) and `calls` positive timings.
    fn check(line: &Line, bench: &str, key: &str, size: u64, calls: usize) {
        assert!(!line.has("error"), "{bench} {size}");
        assert_eq!(line.get("bench").and_then(|v| v.as_str()), Some(bench));
        assert_eq!(line.get(key).and_then(|v| v.as_u64()), Some(size));
        let secs = line.get("secs").and_then(|v| v.as_array()).expect("secs");
        assert_eq!(secs.len(), calls);
        assert!(secs.iter().all(|s| s.as_f64().is_some_and(|s| s > 0.0 && s.is_finite())));
    }

    #[test]
    fn serve_answers_matmul_and_op_requests_and_refuses_others() {
        let mut s = server();
        for n in [16, 3, 16] {
            check(&s.answer(&format!("matmul {n}")), "matmul", "n", n, 1);
        }
        check(&s.answer("matmul 3 4"), "matmul", "n", 3, 4);
        // Inputs are made once per size.
        assert_eq!(s.inputs.len(), 2);
        for name in ["add", "sum_dim", "softmax", "add_latency"] {
            check(&s.answer(&format!("op {name} 8")), name, "d", 8, 1);
        }
        check(&s.answer("op sum 8 3"), "sum", "d", 8, 3);
        assert_eq!(s.ops.len(), 1);
        for bad in [
            "matmul",
            "matmul 0",
            "matmul -4",
            "matmul x",
            "ops 8",
            "matmul 8 9 9",
            "op add",
            "op add 0",
            "op nope 8",
            "matmul 8 0",
            "op sum 8 x",
            "op sum 8 2 2",
            "matmul 8 99999",
        ] {
            let line = s.answer(bad);
            let e = line.get("error").and_then(|v| v.as_str()).unwrap_or_else(|| panic!("{bad:?} not refused"));
            assert!(e.contains(bad) || e.contains("\"nope\""), "{e}");
        }
    }
}
