//! Deferred programs are shared by the threads that defer ops on a device
//! (Note [Deferred programs]): an op that checks its data must still fail at
//! its own call, and never hand its error to another thread's read.
mod support;

use kiln_tensor::{DType, Device, Tensor};
use kiln_tpu::{with_mode, Mode};
use std::sync::atomic::{AtomicBool, Ordering};
use support::setup;

const TPU: Device = Device::Tpu(0);

#[test]
fn a_failed_check_fails_its_own_call_while_other_threads_read() {
    setup();
    let rounds = 300;
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            with_mode(Mode::Defer, || {
                let mut reads = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let x = Tensor::arange(0.0, 4.0, 1.0, (DType::F32, TPU)).unwrap();
                    let got = x.mul(2.0).and_then(|y| y.to_vec::<f32>());
                    assert_eq!(got.unwrap(), vec![0.0, 2.0, 4.0, 6.0], "a read on another thread");
                    reads += 1;
                }
                reads
            })
        });
        let writer = s.spawn(|| {
            with_mode(Mode::Defer, || {
                let z = Tensor::zeros(&[2, 3], (DType::F32, TPU)).unwrap();
                let idx = Tensor::from_vec(vec![3i64], &[1, 1]).unwrap().to_device(TPU).unwrap();
                let src = Tensor::ones(&[1, 1], (DType::F32, TPU)).unwrap();
                for round in 0..rounds {
                    let r = z.scatter(1, &idx, &src);
                    let e = r.expect_err(&format!("round {round}: an index out of bounds is an error at its call"));
                    assert!(e.to_string().contains("index 3 is out of bounds"), "{e}");
                }
            })
        });
        let w = writer.join();
        done.store(true, Ordering::Relaxed);
        let reads = reader.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        w.unwrap_or_else(|p| std::panic::resume_unwind(p));
        assert!(reads > 0);
    });
}
