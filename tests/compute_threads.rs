//! A loop run through `on_compute_threads` pays no cross-thread wake-up per op
//! (Note [Teams of compute threads] in kiln-cpu): the pool's other thread
//! stays awake between the products of the loop instead of sleeping on a
//! futex and being woken by the next one. Alone in its binary, so no other
//! test's threads sleep and wake in the count.
use kiln::prelude::*;
use kiln::tensor::on_compute_threads;

/// Voluntary context switches (a thread blocking: a futex sleep, a read) of
/// every thread of this process so far.
fn sleeps() -> u64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .filter_map(|s| s.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?.trim().parse::<u64>().ok())
        .sum()
}

/// About 200 µs of arithmetic on the calling thread, as a decoding step's
/// small ops between two products (longer than rayon's idle threads spin).
fn serial_work() {
    let mut a = 1u64;
    for i in 0..400_000u64 {
        a = std::hint::black_box(a.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
}

#[test]
fn a_loop_on_the_compute_threads_does_not_sleep_between_ops() -> Result<()> {
    rayon::ThreadPoolBuilder::new().num_threads(2).build_global().expect("the global pool is built once, here");
    let w = Tensor::randn(&[2048, 1024], DType::F32)?.t()?;
    let x = Tensor::randn(&[1, 1024], DType::F32)?;
    let products = 100;
    let (slept, out) = on_compute_threads(Device::Cpu, || -> Result<(u64, Tensor)> {
        // One product of 8 MiB of weight (hundreds of µs) forks across both threads.
        let mut y = x.matmul(&w)?;
        let before = sleeps();
        for _ in 0..products {
            serial_work();
            y = x.matmul(&w)?;
        }
        Ok((sleeps() - before, y))
    })?;
    assert_eq!(out.shape(), &[1, 2048]);
    // With rayon's own sleeping, the other thread slept before each product
    // and the calling one while it waited for the other's part: 197-271
    // sleeps over these 100 products; with the team, 0-2.
    eprintln!("{slept} sleeps over {products} products");
    assert!(slept < products / 10, "{slept} sleeps over {products} products");
    Ok(())
}
