//! ndarray in and out: zero-copy views of CPU tensors (`view_ndarray`),
//! owned arrays taken without copying (`from_ndarray`), and copies both ways.
use crate::storage::StorageData;
use crate::{Device, Error, HostElement, Result, Tensor};
use ndarray::{Array, ArrayBase, ArrayD, ArrayViewD, Data, Dimension, IxDyn, ShapeBuilder};
use std::marker::PhantomData;
use std::sync::RwLockReadGuard;

/// A CPU tensor's elements seen in place by ndarray (from
/// [`Tensor::view_ndarray`]). It holds the storage's read lock: while it
/// lives, in-place writes to the tensor or to any view of its storage wait,
/// so nothing can change what [`NdarrayRef::view`] shows. Drop it before
/// writing to that storage on the same thread, which would otherwise wait
/// for itself.
pub struct NdarrayRef<'a, T> {
    _guard: RwLockReadGuard<'a, StorageData>,
    ptr: *const T,
    shape: Vec<usize>,
    strides: Vec<usize>,
    _elem: PhantomData<&'a T>,
}

impl<T> std::fmt::Debug for NdarrayRef<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NdarrayRef").field("shape", &self.shape).field("strides", &self.strides).finish()
    }
}

impl<T> NdarrayRef<'_, T> {
    /// The elements as an ndarray view with the tensor's shape and strides
    /// (a transposed or sliced tensor gives a transposed or sliced view).
    pub fn view(&self) -> ArrayViewD<'_, T> {
        // SAFETY: `ptr` points at the tensor's first element inside the storage's
        // host buffer, and `view_ndarray` checked that every index reachable
        // through `shape` and `strides` (all non-negative) stays inside that
        // buffer, so the pointer moves ndarray makes are in bounds of one
        // allocation (an empty tensor's pointer is the buffer's, non-null and
        // aligned). The buffer cannot move, shrink or be written while the read
        // guard we hold lives (writers take the lock exclusively), and the view
        // borrows `self`, so it cannot outlive the guard. Strides may repeat
        // elements (broadcast views): allowed for a shared view.
        unsafe { ArrayViewD::from_shape_ptr(IxDyn(&self.shape).strides(IxDyn(&self.strides)), self.ptr) }
    }
}

impl Tensor {
    /// A zero-copy ndarray view of this CPU tensor's elements, in its shape
    /// and strides (`T` must be its dtype's element type). Holds the
    /// storage's read lock until dropped (see [`NdarrayRef`]).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
    /// let tt = t.t()?; // a transposed view: no copy on either side
    /// let v = tt.view_ndarray::<f32>()?;
    /// assert_eq!(v.view()[[2, 1]], 5.0);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn view_ndarray<T: HostElement>(&self) -> Result<NdarrayRef<'_, T>> {
        if self.device() != Device::Cpu {
            return Err(Error::device(
                "view_ndarray",
                format!("needs a CPU tensor, this one is on {}; call to_device(Device::Cpu) first", self.device()),
            ));
        }
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(
                "view_ndarray",
                format!("asked for {} elements but the tensor has dtype {}", T::DTYPE, self.dtype()),
            ));
        }
        crate::capture::record::check_read(self, "view_ndarray")?;
        let guard = self.storage().read();
        let buf = guard
            .as_host()
            .and_then(|h| h.as_slice::<T>())
            .ok_or_else(|| Error::backend("cpu", "view_ndarray: the storage holds no host buffer of this dtype"))?;
        let layout = self.layout();
        let (shape, strides) = (layout.shape().to_vec(), layout.strides().to_vec());
        layout.check_bounds("view_ndarray", buf.len())?;
        let empty = shape.contains(&0);
        // ndarray counts elements and strides in isize.
        let count = shape.iter().filter(|&&n| n > 0).try_fold(1usize, |a, &n| a.checked_mul(n));
        if count.is_none_or(|c| c > isize::MAX as usize) || strides.iter().any(|&s| s > isize::MAX as usize) {
            return Err(Error::invalid(
                "view_ndarray",
                format!("shape {shape:?} with strides {strides:?} is too large for an ndarray view"),
            ));
        }
        let ptr = if empty { buf.as_ptr() } else { buf[layout.offset()..].as_ptr() };
        Ok(NdarrayRef { ptr, shape, strides, _elem: PhantomData, _guard: guard })
    }

    /// A CPU tensor that takes over an owned ndarray array. A standard-layout
    /// (row-major, contiguous) array whose data starts its buffer becomes the
    /// tensor's storage as it is, without copying; any other layout is copied
    /// in row-major order.
    pub fn from_ndarray<T: HostElement, D: Dimension>(a: Array<T, D>) -> Result<Tensor> {
        let shape = a.shape().to_vec();
        if !a.is_standard_layout() {
            return Tensor::try_from(&a);
        }
        let len = a.len();
        let (v, offset) = a.into_raw_vec_and_offset();
        let start = offset.unwrap_or(0);
        // Contiguous from `start`: the whole buffer, or a copy of the array's part.
        let v = if start == 0 && v.len() == len { v } else { v[start..start + len].to_vec() };
        Tensor::from_vec(v, &shape)
    }

    /// The data copied into an owned ndarray array (`T` must match the dtype).
    pub fn to_ndarray<T: HostElement>(&self) -> Result<ArrayD<T>> {
        let v = self.to_vec::<T>()?;
        ArrayD::from_shape_vec(IxDyn(self.shape()), v).map_err(|e| Error::shape("to_ndarray", e.to_string()))
    }
}

/// A CPU tensor copied from an ndarray array of any dimensionality and layout.
impl<T: HostElement, S: Data<Elem = T>, D: Dimension> TryFrom<&ArrayBase<S, D>> for Tensor {
    type Error = Error;
    fn try_from(a: &ArrayBase<S, D>) -> Result<Tensor> {
        Tensor::from_vec(a.iter().copied().collect(), a.shape())
    }
}
