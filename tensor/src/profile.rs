//! A per-primitive profiler: when enabled, every primitive that runs through
//! [`Tensor::apply`](crate::Tensor::apply) adds its wall time (backend `exec`,
//! which on the CPU is the kernel) to a table keyed by op name and input shapes,
//! and so does each instruction an interpreted program runs (`ir::Interpreter`:
//! `kiln::compile` on the CPU), a fused group under `fused` with its members' names.
//!
//! Off by default and then costs one relaxed atomic load per op. Enable it with
//! [`enable`] or by setting `KILN_PROFILE=1` in the environment; read it with
//! [`take`] (which resets it) or print it with [`report`].
//!
//! ```
//! use kiln::prelude::*;
//! kiln::tensor::profile::enable(true);
//! let x = Tensor::ones(&[64, 64], DType::F32)?;
//! x.matmul(&x)?;
//! let rows = kiln::tensor::profile::take();
//! kiln::tensor::profile::enable(false);
//! assert!(rows.iter().any(|r| r.op == "matmul" && r.calls >= 1));
//! # Ok::<(), kiln::Error>(())
//! ```
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// 0: not yet read from the environment, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
/// (op, input shapes) -> (calls, total time).
type Table = HashMap<(&'static str, String), (u64, Duration)>;
static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// One row of the profile: an op on inputs of given shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub op: &'static str,
    /// Input shapes, e.g. `[2048, 384] [384, 1024]`.
    pub shapes: String,
    pub calls: u64,
    pub total: Duration,
}

/// Turns the profiler on or off (for all threads).
pub fn enable(on: bool) {
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether the profiler is on (the first call reads `KILN_PROFILE`).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("KILN_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
            enable(on);
            on
        }
        s => s == 2,
    }
}

/// Runs `run` (a backend call), and when the profiler is on waits for the device
/// with `sync` and records the time under `op` and the `shapes` description.
pub(crate) fn timed<T>(
    op: &'static str,
    shapes: impl FnOnce() -> String,
    sync: impl FnOnce() -> crate::Result<()>,
    run: impl FnOnce() -> crate::Result<T>,
) -> crate::Result<T> {
    if !enabled() {
        return run();
    }
    let t0 = std::time::Instant::now();
    let out = run()?;
    sync()?;
    record(op, shapes, t0.elapsed());
    Ok(out)
}

/// The profile's description of an op's inputs: their shapes, space-separated.
pub(crate) fn shapes_of(inputs: &[&crate::Tensor]) -> String {
    inputs.iter().map(|t| crate::error::fmt_shape(t.shape())).collect::<Vec<_>>().join(" ")
}

fn record(op: &'static str, shapes: impl FnOnce() -> String, dt: Duration) {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let e = t.get_or_insert_with(HashMap::new).entry((op, shapes())).or_insert((0, Duration::ZERO));
    e.0 += 1;
    e.1 += dt;
}

/// The rows recorded since the last `take`, most expensive first; resets the table.
pub fn take() -> Vec<Row> {
    let t = TABLE.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
    let mut rows: Vec<Row> =
        t.into_iter().map(|((op, shapes), (calls, total))| Row { op, shapes, calls, total }).collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.total));
    rows
}

/// [`take`], formatted as a table: the `top` most expensive rows, then totals per op.
pub fn report(top: usize) -> String {
    let rows = take();
    let all: Duration = rows.iter().map(|r| r.total).sum();
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / all.as_secs_f64().max(1e-12);
    let mut out = format!("{:>10} {:>6} {:>7}  op (input shapes)\n", "ms", "calls", "%");
    for r in rows.iter().take(top) {
        out += &format!(
            "{:>10.2} {:>6} {:>6.1}%  {} {}\n",
            r.total.as_secs_f64() * 1e3,
            r.calls,
            pct(r.total),
            r.op,
            r.shapes
        );
    }
    let mut by_op: HashMap<&str, (u64, Duration)> = HashMap::new();
    for r in &rows {
        let e = by_op.entry(r.op).or_default();
        e.0 += r.calls;
        e.1 += r.total;
    }
    let mut by_op: Vec<_> = by_op.into_iter().collect();
    by_op.sort_by_key(|(_, (_, total))| std::cmp::Reverse(*total));
    out += "-- per op --\n";
    for (op, (calls, total)) in by_op {
        out += &format!("{:>10.2} {:>6} {:>6.1}%  {op}\n", total.as_secs_f64() * 1e3, calls, pct(total));
    }
    out += &format!("{:>10.2} ms in all\n", all.as_secs_f64() * 1e3);
    out
}
