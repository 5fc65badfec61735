//! Reductions: sum, mean, prod, max, min (with indices), argmax, argmin, var,
//! std, logsumexp, all, any, over dims with keepdim.
use crate::{wrap_dim, Result};
use smallvec::SmallVec;

/// Dims argument of reductions: one dim (`-1`), a list (`[0, 2]`), negative dims allowed.
pub trait Dims {
    fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>>;
}
macro_rules! dims_int {
    ($($t:ty),*) => {$(
        impl Dims for $t {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                Ok(smallvec::smallvec![wrap_dim(op, *self as isize, ndim)?])
            }
        }
        impl Dims for [$t] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                let mut v: SmallVec<[usize; 6]> = self.iter().map(|&d| wrap_dim(op, d as isize, ndim)).collect::<Result<_>>()?;
                v.sort_unstable();
                for w in v.windows(2) {
                    if w[0] == w[1] {
                        return Err(crate::Error::invalid(op, format!("dim {} appears multiple times in the list of dims", w[0])));
                    }
                }
                Ok(v)
            }
        }
        impl<const N: usize> Dims for [$t; N] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                self.as_slice().to_dims(op, ndim)
            }
        }
        impl Dims for Vec<$t> {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                self.as_slice().to_dims(op, ndim)
            }
        }
        impl Dims for &[$t] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                (*self).to_dims(op, ndim)
            }
        }
    )*};
}
dims_int!(i32, i64, isize, usize);
