//! Conversions: `to_dtype`, `to_device`, `to_vec`, `item`, and `TensorData`
//! for `Tensor::new([[1.0, 2.0], [3.0, 4.0]])`.
use crate::{DType, Device, Error, HostBuffer, HostElement, Op, Result, Tensor};

/// Nested arrays, slices, vectors and scalars that can become a tensor.
pub trait TensorData {
    /// The row-major data and the shape.
    fn into_host(self) -> (HostBuffer, Vec<usize>);
}

macro_rules! tensor_data {
    ($($t:ty),*) => {$(
        impl TensorData for $t {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                (<$t>::into_buffer(vec![self]), vec![])
            }
        }
        impl<const N: usize> TensorData for [$t; N] {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                (<$t>::into_buffer(self.to_vec()), vec![N])
            }
        }
        impl<const N: usize, const M: usize> TensorData for [[$t; N]; M] {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                (<$t>::into_buffer(self.iter().flatten().copied().collect()), vec![M, N])
            }
        }
        impl<const N: usize, const M: usize, const K: usize> TensorData for [[[$t; N]; M]; K] {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                (<$t>::into_buffer(self.iter().flatten().flatten().copied().collect()), vec![K, M, N])
            }
        }
        impl TensorData for Vec<$t> {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                let n = self.len();
                (<$t>::into_buffer(self), vec![n])
            }
        }
        impl TensorData for &[$t] {
            fn into_host(self) -> (HostBuffer, Vec<usize>) {
                (<$t>::into_buffer(self.to_vec()), vec![self.len()])
            }
        }
    )*};
}
tensor_data!(bool, u8, i8, i16, i32, i64, f32, f64, half::f16, half::bf16, crate::f8e4m3fn, crate::f8e5m2);

impl Tensor {
    /// Casts to `dtype` (PyTorch's `.to(dtype)`); returns the same tensor when the dtype matches.
    /// Float to int truncates toward zero; into bf16/f16 rounds to nearest even.
    ///
    /// As PyTorch's `preserve_format`, a dense permuted tensor (a transposed
    /// weight) gives a result with the same strides: the cast reads and
    /// writes memory in order, then the same view is taken of the result.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if let Some(order) = self.layout().dense_order() {
            let mut back = vec![0isize; order.len()];
            for (i, &d) in order.iter().enumerate() {
                back[d] = i as isize;
            }
            let order: Vec<isize> = order.iter().map(|&d| d as isize).collect();
            return Tensor::apply1(Op::Cast(dtype), &[&self.permute(&order)?])?.permute(&back);
        }
        Tensor::apply1(Op::Cast(dtype), &[self])
    }

    /// Copies to `device` (PyTorch's `.to(device)`); returns the same tensor
    /// when already there. Between devices of one backend that can copy
    /// device to device (a PJRT client's), the copy skips the host.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if device.kind() == self.device().kind() {
            // A device that does not exist is named as every other path names it.
            device.backend()?;
            crate::capture::record::check_read(self, reading_via().unwrap_or("to_device"))?;
            if let Some(storage) = self.backend().copy_to_device(self, device) {
                let t = Tensor::from_storage(storage?, crate::Layout::contiguous(self.shape()))?;
                crate::capture::record::upload(&t);
                return Ok(t);
            }
        }
        let host = self.read_host("to_device")?;
        Tensor::from_host(host, self.shape(), device)
    }

    /// The elements in row-major order, copied to the host as a contiguous buffer.
    pub fn to_host(&self) -> Result<HostBuffer> {
        self.read_host("to_host")
    }

    /// `Backend::to_host`, with `via` (the public method the caller used) made
    /// known to the backend through [`reading_via`] for its error messages.
    pub(crate) fn read_host(&self, via: &'static str) -> Result<HostBuffer> {
        crate::capture::record::check_read(self, reading_via().unwrap_or(via))?;
        reading(via, || self.backend().to_host(self))
    }

    /// The elements in row-major order. `T` must be this tensor's element type
    /// (convert first with [`Tensor::to_dtype`]); see [`Tensor::to_vec_f64`] for any dtype.
    pub fn to_vec<T: HostElement>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(
                "to_vec",
                format!(
                    "asked for {} elements but the tensor has dtype {}; call to_dtype({:?}) first",
                    T::DTYPE,
                    self.dtype(),
                    T::DTYPE
                ),
            ));
        }
        Ok(T::vec(self.read_host("to_vec")?).expect("backend returned a buffer of the tensor's dtype"))
    }

    /// The elements converted to f64, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        let h = self.read_host("to_vec_f64")?;
        Ok((0..h.len()).map(|i| h.get_f64(i)).collect())
    }

    /// The single value of a one-element tensor (`.item()`), as `T` (must match the dtype).
    pub fn item<T: HostElement>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!("a Tensor with {} elements cannot be converted to Scalar", self.numel()),
            ));
        }
        reading("item", || Ok(self.to_vec::<T>()?[0]))
    }

    /// The single value of a one-element tensor as f64, whatever the dtype.
    pub fn item_f64(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!("a Tensor with {} elements cannot be converted to Scalar", self.numel()),
            ));
        }
        Ok(self.read_host("item_f64")?.get_f64(0))
    }
}

thread_local! {
    static READ_VIA: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with `via` as the [`reading_via`] context, unless an outer call set one.
pub(crate) fn reading<R>(via: &'static str, f: impl FnOnce() -> R) -> R {
    let prev = READ_VIA.with(|c| c.get());
    if prev.is_none() {
        READ_VIA.with(|c| c.set(Some(via)));
    }
    let r = f();
    READ_VIA.with(|c| c.set(prev));
    r
}

/// While a backend's `to_host` runs: the public `Tensor` method that asked for
/// the data (`item`, `to_vec`, `to_device`, `Display`, ...), for error messages
/// such as "item() inside a traced function". `None` outside such a call.
pub fn reading_via() -> Option<&'static str> {
    READ_VIA.with(|c| c.get())
}
