//! Quick release-mode timings of the CPU kernels: elementwise, reductions,
//! softmax-style ops and matmul, in GB/s (bytes moved / median time) and GFLOP/s.
//!
//! `cargo run --release -p kiln-cpu --example kernel_timings [-- filter]`
use kiln_tensor::{BinaryOp, DType, Op, ReduceOp, Result, Tensor, UnaryOp};
use std::time::Instant;

/// CPU time of the whole process (all threads), in seconds.
fn cpu_time() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

thread_local! {
    static LAST_CPU: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// Median wall seconds of `runs` calls after one warm-up; the median CPU seconds
/// (all threads) go to `LAST_CPU`, a measure that a busy machine distorts less.
fn time(runs: usize, mut f: impl FnMut() -> Result<Tensor>) -> f64 {
    f().unwrap();
    let mut t: Vec<(f64, f64)> = (0..runs)
        .map(|_| {
            let (s, c) = (Instant::now(), cpu_time());
            std::hint::black_box(f().unwrap());
            (s.elapsed().as_secs_f64(), cpu_time() - c)
        })
        .collect();
    let mut cpu: Vec<f64> = t.iter().map(|p| p.1).collect();
    cpu.sort_by(|a, b| a.partial_cmp(b).unwrap());
    LAST_CPU.with(|l| l.set(cpu[runs / 2]));
    t.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    t[runs / 2].0
}

fn last_cpu() -> f64 {
    LAST_CPU.with(|l| l.get())
}

fn main() -> Result<()> {
    kiln_cpu::register();
    let filter = std::env::args().nth(1).unwrap_or_default();
    let want = |name: &str| filter.is_empty() || name.contains(&filter);
    if want("latency") {
        let x = Tensor::from_vec(vec![1.0f32], &[1])?;
        let y = Tensor::from_vec(vec![2.0f32], &[1])?;
        let iters = 200_000;
        for _ in 0..1000 {
            Tensor::apply1(Op::Binary(BinaryOp::Add), &[&x, &y])?;
        }
        let (s, c) = (Instant::now(), cpu_time());
        for _ in 0..iters {
            std::hint::black_box(Tensor::apply1(Op::Binary(BinaryOp::Add), &[&x, &y])?);
        }
        let us = s.elapsed().as_secs_f64() / iters as f64 * 1e6;
        let cus = (cpu_time() - c) / iters as f64 * 1e6;
        let (s2, c2) = (Instant::now(), cpu_time());
        for _ in 0..iters {
            std::hint::black_box(x.add(&y)?);
        }
        let us2 = s2.elapsed().as_secs_f64() / iters as f64 * 1e6;
        let cus2 = (cpu_time() - c2) / iters as f64 * 1e6;
        println!(
            "{:<16} {us:>8.3} us/op (cpu {cus:.3}) Tensor::apply1; {us2:.3} us/op (cpu {cus2:.3}) x.add(&y)",
            "add_latency"
        );
    }
    if filter == "latency" {
        return Ok(());
    }
    if want("incache") {
        // Cache-resident sizes measure the kernels' compute rate rather than memory bandwidth.
        let m = 16 * 1024;
        let x = Tensor::rand(&[m], DType::F32)?;
        let y = Tensor::rand(&[m], DType::F32)?;
        let reps = 2000;
        let per = |name: &str, f: &dyn Fn() -> Result<Tensor>| -> Result<()> {
            f()?;
            let c = cpu_time();
            for _ in 0..reps {
                std::hint::black_box(f()?);
            }
            let ns = (cpu_time() - c) / (reps * m) as f64 * 1e9;
            println!("{name:<16} {ns:>8.3} ns/elem (cpu, 16K f32 in cache)");
            Ok(())
        };
        per("add", &|| Tensor::apply1(Op::Binary(BinaryOp::Add), &[&x, &y]))?;
        per("exp", &|| Tensor::apply1(Op::Unary(UnaryOp::Exp), &[&x]))?;
        per("tanh", &|| Tensor::apply1(Op::Unary(UnaryOp::Tanh), &[&x]))?;
        per("sum", &|| {
            Tensor::apply1(Op::Reduce { op: ReduceOp::Sum, dims: [0usize][..].into(), keepdim: false }, &[&x])
        })?;
        per("max", &|| {
            Tensor::apply1(Op::Reduce { op: ReduceOp::Max, dims: [0usize][..].into(), keepdim: false }, &[&x])
        })?;
        if filter == "incache" {
            return Ok(());
        }
    }
    let d = 4096;
    let n = d * d;
    let a = Tensor::rand(&[n], DType::F32)?;
    let b = Tensor::rand(&[n], DType::F32)?;
    let a2 = a.reshape(&[d as isize, d as isize])?;
    let b2 = b.reshape(&[d as isize, d as isize])?;
    let row = Tensor::rand(&[d], DType::F32)?;
    let gb = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
    let bw = |name: &str, bytes: usize, f: &mut dyn FnMut() -> Result<Tensor>| {
        if want(name) {
            let s = time(21, f);
            println!("{name:<16} {:>8.2} ms {:>8.1} GB/s   cpu {:>8.2} ms", s * 1e3, gb(bytes, s), last_cpu() * 1e3);
        }
    };
    let f4 = 4;
    bw("add", 3 * f4 * n, &mut || Tensor::apply1(Op::Binary(BinaryOp::Add), &[&a, &b]));
    bw("mul", 3 * f4 * n, &mut || Tensor::apply1(Op::Binary(BinaryOp::Mul), &[&a, &b]));
    bw("exp", 2 * f4 * n, &mut || Tensor::apply1(Op::Unary(UnaryOp::Exp), &[&a]));
    bw("tanh", 2 * f4 * n, &mut || Tensor::apply1(Op::Unary(UnaryOp::Tanh), &[&a]));
    bw("sigmoid", 2 * f4 * n, &mut || Tensor::apply1(Op::Unary(UnaryOp::Sigmoid), &[&a]));
    bw("add_transposed", 3 * f4 * n, &mut || Tensor::apply1(Op::Binary(BinaryOp::Add), &[&a2.t()?, &b2]));
    let rowx = row.expand(&[d as isize, d as isize])?;
    bw("add_broadcast", f4 * (2 * n + d), &mut || Tensor::apply1(Op::Binary(BinaryOp::Add), &[&a2, &rowx]));
    let sum = |x: &Tensor, dims: &[usize]| {
        Tensor::apply1(Op::Reduce { op: ReduceOp::Sum, dims: dims.into(), keepdim: false }, &[x])
    };
    bw("sum", f4 * n, &mut || sum(&a, &[0]));
    bw("sum_dim", f4 * (n + d), &mut || sum(&a2, &[1]));
    bw("sum_dim0", f4 * (n + d), &mut || sum(&a2, &[0]));
    bw("max", f4 * n, &mut || {
        Tensor::apply1(Op::Reduce { op: ReduceOp::Max, dims: [0usize][..].into(), keepdim: false }, &[&a])
    });
    bw("copy", 2 * f4 * n, &mut || Tensor::apply1(Op::Copy, &[&a]));
    bw("copy_transposed", 2 * f4 * n, &mut || Tensor::apply1(Op::Copy, &[&a2.t()?]));
    bw("cast_bf16", 6 * n, &mut || Tensor::apply1(Op::Cast(DType::BF16), &[&a]));
    // softmax over the last dim from primitives: exp(x - max) / sum.
    let softmax = || -> Result<Tensor> {
        let m = Tensor::apply1(Op::Reduce { op: ReduceOp::Max, dims: [1usize][..].into(), keepdim: true }, &[&a2])?;
        let z = Tensor::apply1(Op::Binary(BinaryOp::Sub), &[&a2, &m.expand(&[d as isize, d as isize])?])?;
        let e = Tensor::apply1(Op::Unary(UnaryOp::Exp), &[&z])?;
        let s = Tensor::apply1(Op::Reduce { op: ReduceOp::Sum, dims: [1usize][..].into(), keepdim: true }, &[&e])?;
        Tensor::apply1(Op::Binary(BinaryOp::Div), &[&e, &s.expand(&[d as isize, d as isize])?])
    };
    if want("softmax") {
        let s = time(11, softmax);
        println!(
            "{:<16} {:>8.2} ms {:>8.1} GB/s   cpu {:>8.2} ms",
            "softmax(prims)",
            s * 1e3,
            gb(2 * f4 * n, s),
            last_cpu() * 1e3
        );
    }
    for &m in &[256usize, 1024, 4096] {
        let name = format!("matmul{m}");
        if !want(&name) {
            continue;
        }
        let x = Tensor::rand(&[m, m], DType::F32)?;
        let y = Tensor::rand(&[m, m], DType::F32)?;
        let runs = if m >= 4096 { 3 } else { 11 };
        let s = time(runs, || Tensor::apply1(Op::MatMul, &[&x, &y]));
        let c = last_cpu();
        let st = time(runs, || Tensor::apply1(Op::MatMul, &[&x.t()?, &y]));
        let fl = 2.0 * (m * m * m) as f64;
        println!(
            "{name:<16} {:>8.2} ms {:>8.1} GFLOP/s   cpu {:>8.2} ms   (a.t() @ b: {:.1} GFLOP/s)",
            s * 1e3,
            fl / s / 1e9,
            c * 1e3,
            fl / st / 1e9
        );
    }
    if want("batched") {
        let x = Tensor::rand(&[64, 128, 64], DType::F32)?;
        let y = Tensor::rand(&[64, 64, 128], DType::F32)?;
        let s = time(21, || Tensor::apply1(Op::MatMul, &[&x, &y]));
        let fl = 2.0 * (64 * 128 * 64 * 128) as f64;
        println!("{:<16} {:>8.3} ms {:>8.1} GFLOP/s", "bmm64x128x64", s * 1e3, fl / s / 1e9);
    }
    Ok(())
}
