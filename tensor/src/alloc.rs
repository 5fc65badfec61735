//! Sizes and large host allocations, in one place: the element count and
//! byte size of every op's outputs are checked (`bytes`, from `Op::infer`), and
//! host buffers that can be large are allocated fallibly (`reserve`,
//! `try_vec`), so a tensor too large for the machine is an `Error::Memory`
//! naming the op, the shape and the bytes (PyTorch's "can't allocate memory")
//! instead of an abort or a wrapped-around size.
use crate::error::fmt_shape;
use crate::{DType, Error, Result};

/// Allocations below this many bytes are not probed (they cannot fail in a way
/// worth a check on every op).
const PROBE_MIN: usize = 1 << 20;

fn too_large(op: &'static str, shape: &[usize], dtype: DType, what: &str) -> Error {
    Error::memory(op, format!("a {dtype} tensor of shape {} {what}", fmt_shape(shape)))
}

/// The byte size of a `dtype` tensor of `shape`: an error when its element
/// count or byte size does not fit the address space (`isize::MAX` bytes).
pub fn bytes(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| too_large(op, shape, dtype, "has more elements than a usize can count"))?;
    n.checked_mul(dtype.size_in_bytes()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        too_large(op, shape, dtype, &format!("has {n} elements, more bytes than the address space holds"))
    })
}

/// Checks that the host can allocate a `dtype` tensor of `shape` now: large
/// sizes are tried (and given back, for the kernel's allocation to reuse), so a
/// request the machine cannot satisfy is an error instead of an abort.
pub fn reserve(op: &'static str, shape: &[usize], dtype: DType) -> Result<()> {
    let b = bytes(op, shape, dtype)?;
    if b < PROBE_MIN {
        return Ok(());
    }
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(b).map_err(|_| out_of_memory(op, shape, dtype, b))
}

fn out_of_memory(op: &'static str, shape: &[usize], dtype: DType, b: usize) -> Error {
    let gib = b as f64 / (1u64 << 30) as f64;
    too_large(op, shape, dtype, &format!("needs {b} bytes ({gib:.1} GiB): can't allocate memory"))
}

/// `vec![value; n]` for an `n`-element host buffer of `shape`, failing with an
/// error instead of aborting when the memory is not there.
pub fn try_vec<T: Clone>(op: &'static str, shape: &[usize], dtype: DType, value: T) -> Result<Vec<T>> {
    let n = crate::numel(shape);
    bytes(op, shape, dtype)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| out_of_memory(op, shape, dtype, n.saturating_mul(std::mem::size_of::<T>())))?;
    v.resize(n, value);
    Ok(v)
}
