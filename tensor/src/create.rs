//! Creation: zeros, ones, full, empty, arange, linspace, eye,
//! from_vec/from_slice, `*_like` (the random ones are in `random.rs`).
use crate::{DType, Device, Error, HostBuffer, HostElement, Layout, Op, Result, Scalar, Tensor};

/// dtype and device of a new tensor (PyTorch's `dtype=`, `device=` keywords).
/// Defaults: float32 on the default device (the CPU, unless
/// [`set_default_device`] says otherwise on this thread). Any of `DType`,
/// `Device`, `(DType, Device)` converts into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorOptions {
    pub dtype: DType,
    pub device: Device,
}

impl Default for TensorOptions {
    fn default() -> Self {
        TensorOptions { dtype: DType::F32, device: default_device() }
    }
}

thread_local! {
    static DEFAULT_DEVICE: std::cell::Cell<Device> = const { std::cell::Cell::new(Device::Cpu) };
}

/// The device a new tensor goes to when none is given (`Tensor::new`,
/// `from_vec`, factories given only a dtype): the CPU unless
/// [`set_default_device`] set another on this thread (PyTorch's
/// `torch.get_default_device`).
pub fn default_device() -> Device {
    DEFAULT_DEVICE.with(|d| d.get())
}

/// The scope returned by [`set_default_device`]: the previous default comes back when it drops.
#[must_use = "the default device lasts as long as the guard"]
pub struct DefaultDeviceGuard {
    previous: Device,
    // Thread-local state: the guard must drop on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for DefaultDeviceGuard {
    fn drop(&mut self) {
        DEFAULT_DEVICE.with(|d| d.set(self.previous));
    }
}

/// Makes `device` the default device of new tensors on this thread until the
/// guard drops (PyTorch's `with torch.device(...)`, `torch.set_default_device`,
/// which is thread-local too). Tensors given a device explicitly, and ops on
/// existing tensors, are unaffected.
///
/// ```
/// use kiln::prelude::*;
/// {
///     let _on = kiln::tensor::set_default_device(Device::Cpu);
///     assert_eq!(Tensor::new([1.0f32])?.device(), Device::Cpu);
/// }
/// assert_eq!(kiln::tensor::default_device(), Device::Cpu);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn set_default_device(device: Device) -> DefaultDeviceGuard {
    let previous = DEFAULT_DEVICE.with(|d| d.replace(device));
    DefaultDeviceGuard { previous, _not_send: std::marker::PhantomData }
}
impl From<DType> for TensorOptions {
    fn from(dtype: DType) -> Self {
        TensorOptions { dtype, ..Default::default() }
    }
}
impl From<Device> for TensorOptions {
    fn from(device: Device) -> Self {
        TensorOptions { device, ..Default::default() }
    }
}
impl From<(DType, Device)> for TensorOptions {
    fn from((dtype, device): (DType, Device)) -> Self {
        TensorOptions { dtype, device }
    }
}
impl From<&Tensor> for TensorOptions {
    fn from(t: &Tensor) -> Self {
        TensorOptions { dtype: t.dtype(), device: t.device() }
    }
}

fn check_len(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    let n = crate::numel(shape);
    if n != len {
        return Err(Error::shape(op, format!("shape {shape:?} is invalid for input of size {len}")));
    }
    Ok(())
}

impl Tensor {
    /// A tensor filled with `value`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let t = Tensor::full(&[2, 2], 7, DType::I64)?;
    /// assert_eq!(t.to_vec::<i64>()?, vec![7; 4]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn full(shape: &[usize], value: impl Into<Scalar>, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        Tensor::apply_on(Op::Full { shape: shape.into(), value: value.into(), dtype: o.dtype }, &[], o.device)
            .map(|mut v| v.swap_remove(0))
    }
    // zeros, ones and eye hold no host value but their shape: their fills are
    // declared constants for traced functions (Note [Host values]).
    pub fn zeros(shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        crate::trace::constant(|| Tensor::full(shape, 0, opts))
    }
    pub fn ones(shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        crate::trace::constant(|| Tensor::full(shape, 1, opts))
    }
    /// Like PyTorch's `empty`, but the memory is zeroed: kiln never exposes uninitialised memory.
    pub fn empty(shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        Tensor::zeros(shape, opts)
    }
    /// A 0-d tensor holding one value.
    pub fn scalar(value: impl Into<Scalar>, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        Tensor::full(&[], value, opts)
    }
    /// A 0-d tensor with the value's natural dtype (bool, int64 or float32) on `device`.
    pub fn from_scalar(value: impl Into<Scalar>, device: Device) -> Result<Tensor> {
        let s = value.into();
        Tensor::full(&[], s, (s.dtype(), device))
    }

    /// Values `start, start+step, ...` below `end` (PyTorch's `arange(start, end, step)`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let t = Tensor::arange(0.0, 5.0, 2.0, DType::I64)?;
    /// assert_eq!(t.to_vec::<i64>()?, vec![0, 2, 4]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn arange(start: f64, end: f64, step: f64, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("step must be finite and nonzero, and bounds finite (start {start}, end {end}, step {step})"),
            ));
        }
        if (end - start) * step < 0.0 {
            return Err(Error::invalid(
                "arange",
                format!(
                    "upper bound and larger bound inconsistent with step sign (start {start}, end {end}, step {step})"
                ),
            ));
        }
        let len = ((end - start) / step).ceil().max(0.0) as usize;
        Tensor::apply_on(Op::Arange { start, step, len, dtype: o.dtype }, &[], o.device).map(|mut v| v.swap_remove(0))
    }

    /// `steps` evenly spaced values from `start` to `end` inclusive (PyTorch's formula,
    /// symmetric from both ends).
    pub fn linspace(start: f64, end: f64, steps: usize, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        let step = if steps > 1 { (end - start) / (steps - 1) as f64 } else { 0.0 };
        let half = steps / 2;
        // One step gives `start`, like PyTorch.
        let v: Vec<f64> = if steps == 1 {
            vec![start]
        } else {
            (0..steps)
                .map(|i| if i < half { start + step * i as f64 } else { end - step * (steps - 1 - i) as f64 })
                .collect()
        };
        Tensor::from_vec(v, &[steps])?.to_dtype(o.dtype)?.to_device(o.device)
    }

    /// The `n x n` identity matrix.
    pub fn eye(n: usize, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        let mut v = vec![0u8; n * n];
        for i in 0..n {
            v[i * n + i] = 1;
        }
        crate::trace::constant(|| Tensor::from_vec(v, &[n, n])?.to_dtype(o.dtype)?.to_device(o.device))
    }

    /// A CPU tensor owning `data`, of the given shape.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// assert_eq!(t.shape(), &[2, 2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn from_vec<T: HostElement>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        check_len("from_vec", data.len(), shape)?;
        Tensor::from_host(T::into_buffer(data), shape, default_device())
    }
    /// Copies `data` into a new tensor on the default device.
    pub fn from_slice<T: HostElement>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }
    /// A tensor on `device` holding the (row-major) host buffer.
    pub fn from_host(buf: HostBuffer, shape: &[usize], device: Device) -> Result<Tensor> {
        check_len("from_host", buf.len(), shape)?;
        let storage = device.backend()?.from_host(buf, device)?;
        let t = Tensor::from_storage(storage, Layout::contiguous(shape))?;
        crate::capture::record::upload(&t);
        Ok(t)
    }

    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self)
    }
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape(), self)
    }
    pub fn empty_like(&self) -> Result<Tensor> {
        Tensor::empty(self.shape(), self)
    }
    pub fn full_like(&self, value: impl Into<Scalar>) -> Result<Tensor> {
        Tensor::full(self.shape(), value, self)
    }
    /// A tensor from nested arrays or a scalar: `Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])`.
    pub fn new<D: crate::TensorData>(data: D) -> Result<Tensor> {
        let (buf, shape) = data.into_host();
        Tensor::from_host(buf, &shape, default_device())
    }
}
