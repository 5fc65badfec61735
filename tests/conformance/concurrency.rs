//! Threads: `Tensor` is `Send + Sync`; readers running ops while another thread
//! writes in place through a view see, for each op, either the old or the new
//! values, never a mix; concurrent read-only ops agree with a single thread.
use crate::common::f64s;
use crate::{iota, on_devices};
use kiln::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

#[test]
fn tensor_is_send_and_sync() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Tensor>();
    send_sync::<Error>();
    // A clone moved into another thread is the same tensor.
    let x = Tensor::zeros(&[3], DType::F32).unwrap();
    let y = x.clone();
    thread::spawn(move || y.add_(1.0).map(|_| ())).join().unwrap().unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0; 3]);
}

/// Joins a scoped thread, re-raising its panic (with its message) or error.
fn join<T>(h: thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    match h.join() {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    }
}

#[test]
fn readers_never_see_torn_in_place_writes() {
    const N: usize = 384;
    const WRITES: usize = 60;
    on_devices(|dev| {
        let base = Tensor::zeros(&[2, N], (DType::F32, dev))?;
        let row = base.i(1)?;
        let done = AtomicBool::new(false);
        thread::scope(|s| -> Result<()> {
            let writer = s.spawn(|| -> Result<()> {
                for k in 0..WRITES {
                    // Alternate two kinds of write through the view: a read-modify-write and a fill.
                    if k % 2 == 0 {
                        row.add_(1.0)?;
                    } else {
                        row.fill_((k + 1) as f64)?;
                    }
                }
                done.store(true, Ordering::Release);
                Ok(())
            });
            let readers: Vec<_> = (0..3)
                .map(|r| {
                    let (base, done) = (&base, &done);
                    s.spawn(move || -> Result<usize> {
                        let mut last = 0.0;
                        let mut reads = 0;
                        loop {
                            let finished = done.load(Ordering::Acquire);
                            // Each op reads one consistent state of row 1.
                            let v = match r {
                                0 => f64s(&base.i(1)?),
                                1 => f64s(&base.i(1)?.add(0.5)?.sub(0.5)?),
                                _ => f64s(&base.sum_dim(1, false)?).into_iter().map(|x| x / N as f64).collect(),
                            };
                            let first = if r == 2 { v[1] } else { v[0] };
                            let whole = if r == 2 { v[1].fract() == 0.0 } else { v.iter().all(|&x| x == first) };
                            assert!(whole, "reader {r} saw a torn write: {:?}", &v[..v.len().min(8)]);
                            assert!((0.0..=WRITES as f64).contains(&first), "reader {r} saw {first}");
                            assert!(first >= last, "reader {r} saw values go back: {last} then {first}");
                            if r == 2 {
                                assert_eq!(v[0], 0.0, "row 0 is never written");
                            }
                            last = first;
                            reads += 1;
                            if finished {
                                assert_eq!(first, WRITES as f64, "after the writer finished, the last value");
                                return Ok(reads);
                            }
                        }
                    })
                })
                .collect();
            join(writer)?;
            for r in readers {
                assert!(join(r)? >= 1);
            }
            Ok(())
        })?;
        assert_eq!(f64s(&base.i(0)?), vec![0.0; N]);
        assert_eq!(f64s(&row), vec![WRITES as f64; N]);
        assert_eq!(base.version(), WRITES as u64);
        Ok(())
    });
}

#[test]
fn concurrent_read_only_ops_agree() {
    on_devices(|dev| {
        let x = iota(&[8, 16], dev).mul(0.125)?;
        let run = |x: &Tensor| -> Result<Vec<f64>> {
            let y = x.matmul(&x.t()?)?.softmax(-1)?.sum_dim(0, false)?;
            let z = x.i((.., s(None, None, 3)))?.cumsum(1)?.max()?;
            let mut v = f64s(&y);
            v.extend(f64s(&z));
            Ok(v)
        };
        let want = run(&x)?;
        thread::scope(|s| -> Result<()> {
            let hs: Vec<_> = (0..4).map(|_| s.spawn(|| run(&x))).collect();
            for h in hs {
                assert_eq!(join(h)?, want, "the same op on the same input gives the same bits on every thread");
            }
            Ok(())
        })
    });
}

#[test]
fn concurrent_in_place_updates_lose_nothing() {
    on_devices(|dev| {
        let n = if dev == Device::Cpu { 2000 } else { 300 };
        let x = Tensor::zeros(&[4], (DType::F32, dev))?;
        let view = x.narrow(0, 1, 2)?; // writes through a view share the base's lock
        thread::scope(|s| -> Result<()> {
            let a = s.spawn(|| -> Result<()> {
                for _ in 0..n {
                    x.add_(1.0)?;
                }
                Ok(())
            });
            let b = s.spawn(|| -> Result<()> {
                for _ in 0..n {
                    view.add_(1.0)?;
                }
                Ok(())
            });
            join(a)?;
            join(b)
        })?;
        let m = n as f64;
        assert_eq!(f64s(&x), vec![m, 2.0 * m, 2.0 * m, m], "no update lost on {dev}");
        Ok(())
    });
}

#[test]
fn concurrent_backward_passes_sum_their_gradients_exactly() {
    on_devices(|dev| {
        let (threads, rounds) = (4, if dev == Device::Cpu { 50 } else { 10 });
        let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?.to_device(dev)?;
        w.requires_grad_(true)?;
        thread::scope(|s| -> Result<()> {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let w = &w;
                    s.spawn(move || -> Result<()> {
                        // d/dw sum(w * c) = c, with c = t + 1: exact in float32.
                        let c = Tensor::full(&[3], (t + 1) as f64, (DType::F32, dev))?;
                        for _ in 0..rounds {
                            w.mul(&c)?.sum()?.backward()?;
                        }
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter().try_for_each(join)
        })?;
        let want = (rounds * (1..=threads).sum::<usize>()) as f64;
        assert_eq!(f64s(&w.grad().expect("a gradient")), vec![want; 3], "every gradient counted on {dev}");
        Ok(())
    });
}
