//! A short tour of kiln: tensors, views written in place, broadcasting with type
//! promotion, reductions, softmax, a timed matmul and an error message.
//!
//! Run with `cargo run --release --example tour`.
#[path = "support/logging.rs"]
mod logging;
use kiln::prelude::*;
use std::time::Instant;

fn section(title: &str) {
    println!("\n== {title}");
}

fn main() -> Result<()> {
    logging::init();
    kiln::manual_seed(0);

    section("creating tensors");
    let a = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
    println!("Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]]):\n{a}");
    println!("  shape {:?}, dtype {}, device {}", a.shape(), a.dtype(), a.device());
    println!("Tensor::zeros(&[2, 2], DType::I64):\n{}", Tensor::zeros(&[2, 2], DType::I64)?);
    let r = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
    println!("Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4]):\n{r}");
    println!("Tensor::randn(&[2, 3], DType::F32) after manual_seed(0):\n{}", Tensor::randn(&[2, 3], DType::F32)?);

    section("views alias their base; in-place ops write through them");
    let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
    let cols = x.i((.., 1..3))?; // x[:, 1:3], a view: no copy
    println!("x[:, 1:3] is a view of x: {} (strides {:?})", cols.shares_storage(&x), cols.strides());
    let v0 = x.version();
    cols.mul_(100.0)?; // x[:, 1:3] *= 100
    println!("after x[:, 1:3] *= 100, x =\n{x}");
    println!("  storage version {v0} -> {}", x.version());
    x.narrow(0, 2, 1)?.fill_(-1.0)?; // x[2:3] = -1
    x.t()?.select(0, 0)?.copy_(&Tensor::new([7.0f32, 8.0, 9.0])?)?; // x.t()[0] = [7, 8, 9]
    println!("after x[2] = -1 and x.t()[0] = [7, 8, 9], x =\n{x}");

    section("broadcasting and type promotion (PyTorch's rules)");
    let col = Tensor::new([[1i64], [2], [3]])?; // [3, 1] int64
    let row = Tensor::new([0.5f32, 1.5])?; // [2] float32
    let s = col.add(&row)?;
    println!("int64 [3, 1] + float32 [2] -> {} {:?}:\n{s}", s.dtype(), s.shape());
    let half = Tensor::new([1i32, 2, 3])?.mul(2.5)?;
    println!("int32 tensor * 2.5 -> {} {half}", half.dtype());
    let f16 = Tensor::ones(&[2], DType::F16)?.add(1.0)?;
    println!("float16 tensor + 1.0 stays {} (a Python scalar does not widen a tensor)", f16.dtype());

    section("reductions");
    let m = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
    println!("m =\n{m}");
    println!("m.sum() = {}, m.mean() = {}, m.max() = {}", m.sum()?, m.mean()?, m.max()?);
    println!("m.sum_dim(-1, false) = {}", m.sum_dim(-1, false)?);
    let (vals, idx) = m.max_dim(0, false)?;
    println!("m.max_dim(0) = values {vals}, indices {idx}");

    section("softmax");
    let logits = Tensor::new([[1.0f32, 2.0, 3.0], [1.0, 1.0, 1.0]])?;
    let p = logits.softmax(-1)?;
    println!("logits.softmax(-1) =\n{p}");
    println!("  rows sum to {}", p.sum_dim(-1, false)?);

    section("matmul");
    let n = 512;
    let ma = Tensor::randn(&[n, n], DType::F32)?;
    let mb = Tensor::randn(&[n, n], DType::F32)?;
    ma.matmul(&mb)?; // warm-up
    let mut times = vec![];
    for _ in 0..10 {
        let t0 = Instant::now();
        let c = ma.matmul(&mb)?;
        times.push(t0.elapsed().as_secs_f64());
        drop(c);
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let c = ma.matmul(&mb)?;
    println!(
        "[{n}, {n}] @ [{n}, {n}] -> {:?}: {:.2} ms, {:.1} GFLOP/s (median of 10)",
        c.shape(),
        med * 1e3,
        2.0 * (n as f64).powi(3) / med / 1e9
    );
    let small = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
    println!("[[1, 2], [3, 4]] @ its transpose =\n{}", small.matmul(&small.t()?)?);

    section("errors are values, with the op, shapes and dtypes in the message");
    let e = Tensor::zeros(&[2, 3], DType::F32)?;
    match e.add(&Tensor::zeros(&[4], DType::F32)?) {
        Ok(_) => println!("unexpected: [2, 3] + [4] succeeded"),
        Err(err) => println!("[2, 3] + [4]:     {err}"),
    }
    match e.matmul(&Tensor::zeros(&[2, 3], DType::F32)?) {
        Ok(_) => println!("unexpected: [2, 3] @ [2, 3] succeeded"),
        Err(err) => println!("[2, 3] @ [2, 3]:  {err}"),
    }
    match e.view(&[4, -1]) {
        Ok(_) => println!("unexpected: view(4, -1) of 6 elements succeeded"),
        Err(err) => println!("view([4, -1]):    {err}"),
    }
    println!("(the operators `&a + &b` panic with the same message; the methods return it)");
    Ok(())
}
