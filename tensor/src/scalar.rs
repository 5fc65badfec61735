//! `Scalar`: a Python-number-like value (bool, int or float) used by ops such as
//! `x + 2.5`, `fill_`, `clamp`, with PyTorch's "wrapped number" promotion rules.
use crate::{DType, Element};

/// A number that is not a tensor. Like a Python scalar, it takes part in type
/// promotion only by category: `int_tensor * 2.5` is float32, `f16_tensor * 2.5` stays f16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl Scalar {
    /// The dtype this scalar has when it becomes a tensor on its own.
    pub fn dtype(self) -> DType {
        match self {
            Scalar::Bool(_) => DType::Bool,
            Scalar::Int(_) => DType::I64,
            Scalar::Float(_) => DType::F32,
        }
    }
    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as u8 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }
    pub fn to_i64(self) -> i64 {
        match self {
            Scalar::Bool(b) => b as i64,
            Scalar::Int(i) => i,
            Scalar::Float(f) => f as i64,
        }
    }
    /// Converts to an element type (integers are exact, floats are rounded).
    pub fn to_elem<T: Element>(self) -> T {
        match self {
            Scalar::Int(i) => T::from_i64(i),
            _ => T::from_f64(self.to_f64()),
        }
    }
    /// The result dtype of `tensor op scalar` (PyTorch's result_type with a wrapped number).
    pub fn promote_with(self, t: DType) -> DType {
        let sd = self.dtype();
        if sd.category() > t.category() {
            // int tensor with float scalar -> default float; bool tensor with int scalar -> int64
            sd
        } else {
            t
        }
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident as $c:ty),*) => {$(
        impl From<$t> for Scalar {
            fn from(x: $t) -> Self {
                Scalar::$v(x as $c)
            }
        }
    )*};
}
from_scalar!(f64 => Float as f64, f32 => Float as f64, i64 => Int as i64, i32 => Int as i64,
    i16 => Int as i64, i8 => Int as i64, u8 => Int as i64, usize => Int as i64, isize => Int as i64, u32 => Int as i64);
impl From<bool> for Scalar {
    fn from(b: bool) -> Self {
        Scalar::Bool(b)
    }
}
impl From<half::bf16> for Scalar {
    fn from(x: half::bf16) -> Self {
        Scalar::Float(x.to_f64())
    }
}
impl From<half::f16> for Scalar {
    fn from(x: half::f16) -> Self {
        Scalar::Float(x.to_f64())
    }
}
