//! Helpers shared by the integration tests: reading values back, exact and
//! tolerant comparisons, and error-message assertions.
#![allow(dead_code)] // each test binary uses a different subset

use kiln::prelude::*;
use kiln::tensor::HostBuffer;
use kiln::DeviceKind;

mod child;
mod invariance;
mod pjrt_plugin;
mod venv;
#[allow(unused_imports)] // each test binary uses a different subset
pub use child::{run_ignored_test_in_child, run_ignored_test_in_child_with_stderr};
#[allow(unused_imports)]
pub use invariance::batch_invariance;
#[allow(unused_imports)]
pub use venv::python_from;

/// How one element of a float tensor compares to the expected one.
/// `atol == rtol == 0` means bit-exact: NaN matches NaN and the sign of zero counts.
pub fn float_matches(got: f64, want: f64, atol: f64, rtol: f64) -> bool {
    if want.is_nan() || got.is_nan() {
        return want.is_nan() && got.is_nan();
    }
    if atol == 0.0 && rtol == 0.0 {
        return got == want && got.is_sign_negative() == want.is_sign_negative();
    }
    if want.is_infinite() || got.is_infinite() {
        return got == want;
    }
    (got - want).abs() <= atol + rtol * want.abs()
}

/// Compares two host buffers element by element (as f64 for floats, as i64 for
/// ints and bools). Returns a description of the first mismatches, or `None`.
pub fn buffer_mismatch(got: &HostBuffer, want: &HostBuffer, atol: f64, rtol: f64) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, expected {}", got.len(), want.len()));
    }
    let float = want.dtype().is_float() || got.dtype().is_float();
    let mut bad = vec![];
    let mut count = 0;
    for i in 0..want.len() {
        let ok = if float {
            float_matches(got.get_f64(i), want.get_f64(i), atol, rtol)
        } else {
            got.get_i64(i) == want.get_i64(i)
        };
        if !ok {
            count += 1;
            if bad.len() < 6 {
                if float {
                    bad.push(format!("[{i}] got {:?} want {:?}", got.get_f64(i), want.get_f64(i)));
                } else {
                    bad.push(format!("[{i}] got {} want {}", got.get_i64(i), want.get_i64(i)));
                }
            }
        }
    }
    (count > 0)
        .then(|| format!("{count} of {} elements differ (atol {atol}, rtol {rtol}): {}", want.len(), bad.join(", ")))
}

/// The values of any tensor as f64 (row-major).
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap_or_else(|e| panic!("reading {t:?}: {e}"))
}

/// Asserts dtype, shape and exact values (NaN matches NaN, the sign of zero counts).
#[track_caller]
pub fn assert_exact(t: &Tensor, dtype: DType, shape: &[usize], want: &[f64]) {
    assert_eq!(t.dtype(), dtype, "dtype of {t}");
    assert_eq!(t.shape(), shape, "shape of {t}");
    let got = f64s(t);
    let w = HostBuffer::F64(want.to_vec());
    if let Some(m) = buffer_mismatch(&HostBuffer::F64(got), &w, 0.0, 0.0) {
        panic!("{m}\n got: {t}\nwant: {want:?}");
    }
}

/// Asserts dtype, shape and values within `|got - want| <= tol * (1 + |want|)`.
#[track_caller]
pub fn assert_close(t: &Tensor, dtype: DType, shape: &[usize], want: &[f64], tol: f64) {
    assert_eq!(t.dtype(), dtype, "dtype of {t}");
    assert_eq!(t.shape(), shape, "shape of {t}");
    let got = f64s(t);
    let w = HostBuffer::F64(want.to_vec());
    if let Some(m) = buffer_mismatch(&HostBuffer::F64(got), &w, tol, tol) {
        panic!("{m}\n got: {t}\nwant: {want:?}");
    }
}

/// Asserts that `r` failed with a message containing every one of `parts`.
#[track_caller]
pub fn assert_err<T: std::fmt::Debug>(r: kiln::Result<T>, parts: &[&str]) -> String {
    let msg = match r {
        Ok(v) => panic!("expected an error containing {parts:?}, got Ok({v:?})"),
        Err(e) => e.to_string(),
    };
    for p in parts {
        assert!(msg.contains(p), "error message {msg:?} does not contain {p:?}");
    }
    msg
}

/// The message of a caught panic.
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Runs `f`, expecting a panic whose message contains every one of `parts`.
#[track_caller]
pub fn assert_panics<R>(f: impl FnOnce() -> R, parts: &[&str]) {
    // The default hook's report goes to the test's captured output.
    let payload = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(_) => panic!("expected a panic containing {parts:?}"),
        Err(p) => p,
    };
    let msg = panic_text(&*payload);
    for p in parts {
        assert!(msg.contains(p), "panic message {msg:?} does not contain {p:?}");
    }
}

/// Registers the PJRT backend on the XLA:CPU plugin, fetching the plugin first
/// when neither `KILN_PJRT_PLUGIN` nor the cache directory provides one (so the
/// suite never skips the PJRT device), then returns every registered device.
pub fn devices() -> Vec<Device> {
    static READY: std::sync::Once = std::sync::Once::new();
    READY.call_once(|| {
        pjrt_plugin::fetch_pjrt_plugin_unless(kiln::tpu::pjrt::find_plugin().is_ok());
        kiln::tpu::register().unwrap_or_else(|e| panic!("registering the PJRT backend: {e}"));
    });
    let d = kiln::registered_devices();
    assert!(d.contains(&Device::Cpu), "the CPU backend must always be registered, got {d:?}");
    assert!(d.contains(&Device::Tpu(0)), "the PJRT backend must be registered, got {d:?}");
    d
}

/// Runs `f` on every device; PJRT devices run it once per mode (Strict, Debug,
/// DeferAndFuse; see [`devices_in_every_mode`]). `f` also gets the mode's name.
pub fn for_each_device_and_mode(mut f: impl FnMut(Device, &str)) {
    for dev in devices_in_every_mode() {
        f(dev, if dev.kind() == DeviceKind::Tpu { kiln::tpu::mode().name() } else { "eager" });
    }
}

/// Every device, PJRT devices once per mode: iterating yields `cpu`, then
/// `tpu:0` three times, setting the thread's PJRT mode (Strict, Debug,
/// DeferAndFuse) just before each is yielded, and restoring Strict when done;
/// so `for dev in devices_in_every_mode() { ... }` runs its body in every mode.
pub fn devices_in_every_mode() -> impl Iterator<Item = Device> {
    use kiln::tpu::Mode;
    struct Modes {
        items: std::vec::IntoIter<(Device, Option<Mode>)>,
    }
    impl Iterator for Modes {
        type Item = Device;
        fn next(&mut self) -> Option<Device> {
            // Work deferred in the previous mode runs before the next one starts.
            kiln::tpu::sync().expect("the previous mode's work");
            let (dev, mode) = self.items.next()?;
            if let Some(m) = mode {
                kiln::tpu::set_mode(m);
            }
            Some(dev)
        }
    }
    impl Drop for Modes {
        fn drop(&mut self) {
            kiln::tpu::set_mode(Mode::Strict);
        }
    }
    let mut items = vec![];
    for dev in devices() {
        if dev.kind() == DeviceKind::Tpu {
            for m in [Mode::Strict, Mode::Debug, Mode::Defer] {
                items.push((dev, Some(m)));
            }
        } else {
            items.push((dev, None));
        }
    }
    Modes { items: items.into_iter() }
}

/// Deterministic values in about [-2, 2] (no structure a kernel could
/// exploit), as `dtype` on `dev`.
pub fn ramp(shape: &[usize], seed: u64, dtype: DType, dev: Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let x = (i as u64).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) % 1000;
            (x as f64 / 1000.0 - 0.5) * 4.0
        })
        .collect();
    Tensor::from_vec(v, shape).unwrap().to_dtype(dtype).unwrap().to_device(dev).unwrap()
}

/// Runs `f` once per device and mode (the CPU, then each PJRT mode, as
/// [`devices_in_every_mode`]) with that device as the default device of new
/// tensors (`Tensor::new`, `from_vec`, factories given only a dtype), so a
/// test written against the CPU checks every backend; a failure names the
/// device and mode.
pub fn on_every_device(mut f: impl FnMut() -> kiln::Result<()>) -> kiln::Result<()> {
    for dev in devices_in_every_mode() {
        let mode = if dev.kind() == DeviceKind::Tpu { kiln::tpu::mode().name() } else { "eager" };
        let _on = kiln::tensor::set_default_device(dev);
        assert_eq!(Tensor::new([0f32])?.device(), dev, "new tensors go to the default device");
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut f)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("on {dev} ({mode}): {e}");
                return Err(e);
            }
            Err(p) => panic!("on {dev} ({mode}): {}", panic_text(&*p)),
        }
    }
    Ok(())
}
