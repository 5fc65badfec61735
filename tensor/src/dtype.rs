//! `DType`, the runtime element type, with PyTorch's type-promotion rules, and the
//! `Element` trait that ties each dtype to its Rust type.
use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor, a runtime value as in PyTorch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    /// `float8_e5m2` (Note [float8 conversions]); storage, casts and data
    /// movement only, as in PyTorch.
    F8E5M2,
    /// `float8_e4m3fn` (Note [float8 conversions]); storage, casts and data
    /// movement only, as in PyTorch.
    F8E4M3FN,
    F16,
    BF16,
    F32,
    F64,
}

/// PyTorch's type category, used by promotion: bool < integer < floating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    Bool,
    Int,
    Float,
}

impl DType {
    /// The MLIR element type (bool is `i1`, uint8 `ui8`, float8 `f8E4M3FN` / `f8E5M2`).
    pub fn mlir_name(self) -> &'static str {
        match self {
            DType::Bool => "i1",
            DType::U8 => "ui8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F8E5M2 => "f8E5M2",
            DType::F8E4M3FN => "f8E4M3FN",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// Every dtype, in promotion-lattice order.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F8E5M2,
        DType::F8E4M3FN,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E5M2 | DType::F8E4M3FN => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }
    /// Floating point (PyTorch's `is_floating_point`), float8 included.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F8E5M2 | DType::F8E4M3FN | DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
    /// The float8 types, which (as in PyTorch) support casts and data movement
    /// but no arithmetic: convert them first.
    pub fn is_float8(self) -> bool {
        matches!(self, DType::F8E5M2 | DType::F8E4M3FN)
    }
    pub fn is_int(self) -> bool {
        matches!(self, DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }
    pub fn is_bool(self) -> bool {
        self == DType::Bool
    }
    pub fn category(self) -> Category {
        if self.is_float() {
            Category::Float
        } else if self.is_int() {
            Category::Int
        } else {
            Category::Bool
        }
    }
    /// PyTorch's name, e.g. `float32`, `bfloat16`, `int64`.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F8E5M2 => "float8_e5m2",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }
    /// PyTorch's C++ scalar-type name (`Float`, `Long`, `BFloat16`, ...), which
    /// its casting errors use.
    pub fn scalar_type_name(self) -> &'static str {
        match self {
            DType::Bool => "Bool",
            DType::U8 => "Byte",
            DType::I8 => "Char",
            DType::I16 => "Short",
            DType::I32 => "Int",
            DType::I64 => "Long",
            DType::F8E5M2 => "Float8_e5m2",
            DType::F8E4M3FN => "Float8_e4m3fn",
            DType::F16 => "Half",
            DType::BF16 => "BFloat16",
            DType::F32 => "Float",
            DType::F64 => "Double",
        }
    }
    /// Parses PyTorch/safetensors-style names (`float32`, `F32`, `bf16`, `int64`, ...).
    pub fn from_name(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "bool" | "b" => DType::Bool,
            "uint8" | "u8" => DType::U8,
            "int8" | "i8" => DType::I8,
            "int16" | "i16" => DType::I16,
            "int32" | "i32" => DType::I32,
            "int64" | "i64" | "long" => DType::I64,
            "float8_e5m2" | "f8_e5m2" | "f8e5m2" => DType::F8E5M2,
            "float8_e4m3fn" | "f8_e4m3" | "f8_e4m3fn" | "f8e4m3fn" => DType::F8E4M3FN,
            "float16" | "f16" | "half" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float32" | "f32" | "float" => DType::F32,
            "float64" | "f64" | "double" => DType::F64,
            _ => return None,
        })
    }

    /// PyTorch's `torch.promote_types(a, b)`.
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        if a == b {
            return a;
        }
        match (a, b) {
            (Bool, x) | (x, Bool) => x,
            // f16 and bf16 have no common 16-bit type.
            (F16, BF16) | (BF16, F16) => F32,
            (x, y) if x.is_float() && y.is_float() => x.max(y),
            (x, _) if x.is_float() => x,
            (_, y) if y.is_float() => y,
            // u8 with a signed int: the smallest signed type holding both.
            (U8, I8) | (I8, U8) => I16,
            (U8, x) | (x, U8) => x,
            (x, y) => x.max(y),
        }
    }

    /// The dtype an integer/bool tensor takes when an op needs floating point
    /// (true division, `sqrt`, `mean`): PyTorch's default dtype, float32.
    pub fn to_float(self) -> DType {
        if self.is_float() {
            self
        } else {
            DType::F32
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be a tensor element.
///
/// Conversions go through `f64` (exact for every dtype except i64 beyond 2^53,
/// which uses `to_i64`/`from_i64` instead).
pub trait Element: Copy + Send + Sync + PartialEq + PartialOrd + fmt::Debug + Default + 'static {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
    fn zero() -> Self {
        Self::from_i64(0)
    }
    fn one() -> Self {
        Self::from_i64(1)
    }
}

macro_rules! int_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                // PyTorch casts float -> int by truncation; out-of-range values wrap
                // through i64 like C++ does for in-range i64 (saturating here, never UB).
                if <$t>::MIN as i64 == 0 && v < 0.0 {
                    (v as i64) as $t
                } else {
                    v as $t
                }
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
int_element!(u8, U8);
int_element!(i8, I8);
int_element!(i16, I16);
int_element!(i32, I32);
int_element!(i64, I64);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline(always)]
    fn from_i64(v: i64) -> Self {
        v != 0
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline(always)]
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
    #[inline(always)]
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self.to_f32() as i64
    }
    #[inline(always)]
    fn from_i64(v: i64) -> Self {
        bf16::from_f64(v as f64)
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self.to_f32() as i64
    }
    #[inline(always)]
    fn from_i64(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn promotion_matches_pytorch() {
        use DType::*;
        assert_eq!(DType::promote(U8, I8), I16);
        assert_eq!(DType::promote(Bool, Bool), Bool);
        assert_eq!(DType::promote(F16, BF16), F32);
        assert_eq!(DType::promote(I64, F16), F16);
        assert_eq!(DType::promote(I32, I64), I64);
        assert_eq!(DType::promote(Bool, U8), U8);
        assert_eq!(DType::promote(BF16, F64), F64);
        assert_eq!(DType::promote(I8, I32), I32);
    }
}
