//! `kiln::Error`: every fallible operation in kiln returns `Result<T, Error>`.
use crate::{DType, Device};

/// Shapes are printed like PyTorch prints them: `[2, 3]`.
pub(crate) fn fmt_shape(s: &[usize]) -> String {
    format!("{s:?}")
}

/// The error type of kiln. Each variant names the op that failed and the
/// shapes, dtypes or devices involved, so the message alone says what went wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit together (broadcasting, matmul, cat, view, ...).
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// A dtype an op does not accept.
    #[error("{op}: {msg}")]
    DType { op: &'static str, msg: String },
    /// Tensors on different devices, or a device without a backend.
    #[error("{op}: {msg}")]
    Device { op: &'static str, msg: String },
    /// A dimension or element index out of range.
    #[error("{op}: {msg}")]
    Index { op: &'static str, msg: String },
    /// A write that PyTorch refuses too (overlapping views, leaf tensors, ...).
    #[error("{op}: {msg}")]
    InPlace { op: &'static str, msg: String },
    /// An argument that is invalid for another reason.
    #[error("{op}: {msg}")]
    Invalid { op: &'static str, msg: String },
    /// A tensor too large to exist or to allocate (PyTorch's "can't allocate memory").
    #[error("{op}: {msg}")]
    Memory { op: &'static str, msg: String },
    /// A backend failed (for example a device runtime error).
    #[error("{backend} backend: {msg}")]
    Backend { backend: &'static str, msg: String },
}

impl Error {
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape { op, msg: msg.into() }
    }
    pub fn dtype(op: &'static str, msg: impl Into<String>) -> Self {
        Error::DType { op, msg: msg.into() }
    }
    pub fn device(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Device { op, msg: msg.into() }
    }
    pub fn index(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Index { op, msg: msg.into() }
    }
    pub fn inplace(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InPlace { op, msg: msg.into() }
    }
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid { op, msg: msg.into() }
    }
    pub fn memory(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Memory { op, msg: msg.into() }
    }
    pub fn backend(backend: &'static str, msg: impl Into<String>) -> Self {
        Error::Backend { backend, msg: msg.into() }
    }

    /// The standard error for a dimension argument out of range (PyTorch's wording).
    pub fn dim_out_of_range(op: &'static str, dim: isize, ndim: usize) -> Self {
        let (lo, hi) = if ndim == 0 { (-1, 0) } else { (-(ndim as isize), ndim as isize - 1) };
        Error::index(op, format!("dimension out of range (expected to be in range of [{lo}, {hi}], but got {dim})"))
    }

    /// The standard error for a dtype an op does not support.
    pub fn unsupported_dtype(op: &'static str, dtype: DType) -> Self {
        Error::dtype(op, format!("not implemented for dtype {dtype}"))
    }

    /// The standard error for tensors on different devices.
    pub fn device_mismatch(op: &'static str, a: Device, b: Device) -> Self {
        Error::device(
            op,
            format!("expected all tensors to be on the same device, but found at least two devices, {a} and {b}"),
        )
    }
}

/// `Result<T, kiln::Error>`.
pub type Result<T> = std::result::Result<T, Error>;
