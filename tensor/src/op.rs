//! The primitive-op IR: the one list of operations every backend implements,
//! with shape/dtype inference in one place (`Op::infer`). Composites (softmax,
//! gelu, var, ...) are written in terms of these in the tensor API.
use crate::error::fmt_shape;
use crate::{DType, Error, Layout, Result, Scalar, Shape};
use smallvec::{smallvec, SmallVec};

pub mod collective;
pub(crate) mod grouped;
mod infer;
pub(crate) mod paged;
pub mod placement;
pub mod quant;
pub mod region;

/// Shape and dtype of an op's output, as computed by [`Op::infer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub shape: Shape,
    pub dtype: DType,
}

impl Meta {
    /// The meta of a tensor of `shape` and `dtype`.
    pub fn new(shape: &[usize], dtype: DType) -> Meta {
        Meta { shape: shape.into(), dtype }
    }
}

/// Elementwise ops of one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Sign,
    /// Floating-point only (integers are promoted to float32 by the tensor API).
    Exp,
    Log,
    Log1p,
    Expm1,
    Sqrt,
    Rsqrt,
    Recip,
    Tanh,
    /// `1 / (1 + exp(-x))` (lax's `logistic`).
    Sigmoid,
    /// `x * sigmoid(x)`, one pass (SwiGLU's activation).
    Silu,
    /// The derivative of silu, `s (1 + x (1 - s))` with `s = sigmoid(x)`: silu's
    /// gradient rule in one pass instead of six.
    SiluGrad,
    Sin,
    Cos,
    Erf,
    Floor,
    Ceil,
    /// Round half to even, like `torch.round`.
    Round,
    Trunc,
    /// Logical not: output bool.
    Not,
    /// Outputs bool.
    IsNan,
    IsInf,
}

impl UnaryOp {
    /// Ops that need a floating input.
    pub fn is_float_only(self) -> bool {
        use UnaryOp::*;
        matches!(
            self,
            Exp | Log | Log1p | Expm1 | Sqrt | Rsqrt | Recip | Tanh | Sigmoid | Silu | SiluGrad | Sin | Cos | Erf
        )
    }
    pub fn name(self) -> &'static str {
        use UnaryOp::*;
        match self {
            Neg => "neg",
            Abs => "abs",
            Sign => "sign",
            Exp => "exp",
            Log => "log",
            Log1p => "log1p",
            Expm1 => "expm1",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Recip => "reciprocal",
            Tanh => "tanh",
            Sigmoid => "sigmoid",
            Silu => "silu",
            SiluGrad => "silu_backward",
            Sin => "sin",
            Cos => "cos",
            Erf => "erf",
            Floor => "floor",
            Ceil => "ceil",
            Round => "round",
            Trunc => "trunc",
            Not => "logical_not",
            IsNan => "isnan",
            IsInf => "isinf",
        }
    }
}

/// Elementwise ops of two inputs of equal shape and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division on floats; on integers truncating division (the tensor API
    /// promotes integers to float for `/`, and uses it for `rounding_mode="trunc"`).
    Div,
    /// Floor division (Python's `//`).
    FloorDiv,
    /// Remainder with the sign of the divisor (Python's `%`, `torch.remainder`).
    Remainder,
    /// Remainder with the sign of the dividend (C's `fmod`, `torch.fmod`).
    Fmod,
    Pow,
    /// NaN-propagating maximum (`torch.maximum`).
    Maximum,
    Minimum,
    /// NaN-ignoring maximum (`torch.fmax`).
    Fmax,
    Fmin,
    /// Logical ops: output bool, any input dtype (non-zero is true).
    And,
    Or,
    Xor,
    Atan2,
    /// `silu(a) * b`, the SwiGLU gate in one pass (float only).
    SiluMul,
    /// `silu'(a) * b`, the SwiGLU gate's gradient in one pass (float only).
    SiluGradMul,
    /// Bitwise ops on integers (and bool, where PyTorch allows them).
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
    /// `a << b` on integers; a shift by a negative amount or by the bit width or
    /// more gives 0 (PyTorch's rule).
    LeftShift,
    /// `a >> b` on integers, arithmetic for signed types and logical for uint8; a
    /// shift by a negative amount or by the bit width or more gives what a shift
    /// by `width - 1` gives (PyTorch's rule).
    RightShift,
}

impl BinaryOp {
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }
    /// The bitwise ops and shifts (integer inputs; and/or/xor also bool).
    pub fn is_bitwise(self) -> bool {
        use BinaryOp::*;
        matches!(self, BitwiseAnd | BitwiseOr | BitwiseXor | LeftShift | RightShift)
    }
    pub fn name(self) -> &'static str {
        use BinaryOp::*;
        match self {
            Add => "add",
            Sub => "sub",
            Mul => "mul",
            Div => "div",
            FloorDiv => "floor_divide",
            Remainder => "remainder",
            Fmod => "fmod",
            Pow => "pow",
            Maximum => "maximum",
            Minimum => "minimum",
            Fmax => "fmax",
            Fmin => "fmin",
            And => "logical_and",
            Or => "logical_or",
            Xor => "logical_xor",
            Atan2 => "atan2",
            SiluMul => "silu_mul",
            SiluGradMul => "silu_grad_mul",
            BitwiseAnd => "bitwise_and",
            BitwiseOr => "bitwise_or",
            BitwiseXor => "bitwise_xor",
            LeftShift => "bitwise_left_shift",
            RightShift => "bitwise_right_shift",
        }
    }
}

/// Comparisons: two inputs of equal shape and dtype, output bool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

/// Reductions over a set of dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Integers and bool accumulate in int64; bf16/f16 in f32.
    Sum,
    /// Floating only; accumulates like Sum, rounds once.
    Mean,
    Prod,
    /// NaN-propagating.
    Max,
    Min,
    /// Output bool.
    Any,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArgReduceOp {
    ArgMax,
    ArgMin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScatterReduce {
    /// Later writes win (`scatter`).
    Replace,
    /// Duplicates accumulate (`scatter_add`).
    Add,
}

/// View ops: `Layout` transforms that alias their input's storage. They are part
/// of the IR so autograd and the compiled backend see them; the tensor layer
/// applies them itself and backends never execute them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ViewOp {
    /// A reshape the strides allow without copying.
    Reshape(Shape),
    Permute(SmallVec<[usize; 6]>),
    /// Broadcast to a shape (stride 0 on new or size-1 dims).
    Expand(Shape),
    /// `dim`, `start`, `end` (exclusive, clamped), `step >= 1`.
    Slice {
        dim: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    Select {
        dim: usize,
        index: usize,
    },
    Unsqueeze(usize),
    Squeeze(SmallVec<[usize; 6]>),
    Diagonal {
        offset: isize,
        dim1: usize,
        dim2: usize,
    },
    AsStrided {
        shape: Shape,
        strides: Shape,
        offset: usize,
    },
}

impl ViewOp {
    pub fn name(&self) -> &'static str {
        match self {
            ViewOp::Reshape(_) => "view",
            ViewOp::Permute(_) => "permute",
            ViewOp::Expand(_) => "expand",
            ViewOp::Slice { .. } => "slice",
            ViewOp::Select { .. } => "select",
            ViewOp::Unsqueeze(_) => "unsqueeze",
            ViewOp::Squeeze(_) => "squeeze",
            ViewOp::Diagonal { .. } => "diagonal",
            ViewOp::AsStrided { .. } => "as_strided",
        }
    }

    /// Applies the view to a layout. Arguments were validated by the tensor API;
    /// this re-checks what could make the result unsafe to read.
    pub fn apply(&self, l: &Layout) -> Result<Layout> {
        Ok(match self {
            ViewOp::Reshape(s) => l.reshape_view(s).ok_or_else(|| {
                Error::shape(
                    "view",
                    format!(
                        "view size is not compatible with input tensor's size and stride (at least one dimension spans across two contiguous subspaces); shape {} strides {} to {}; use .reshape(...) instead",
                        fmt_shape(l.shape()),
                        fmt_shape(l.strides()),
                        fmt_shape(s)
                    ),
                )
            })?,
            ViewOp::Permute(p) => l.permute("permute", p)?,
            ViewOp::Expand(s) => l.expand("expand", s)?,
            ViewOp::Slice { dim, start, end, step } => l.slice(*dim, *start, *end, *step),
            ViewOp::Select { dim, index } => l.select(*dim, *index),
            ViewOp::Unsqueeze(d) => l.unsqueeze(*d),
            ViewOp::Squeeze(d) => l.squeeze_dims(d),
            ViewOp::Diagonal { offset, dim1, dim2 } => l.diagonal(*offset, *dim1, *dim2),
            ViewOp::AsStrided { shape, strides, offset } => {
                Layout::new(shape.clone(), strides.iter().copied().collect(), *offset)
            }
        })
    }
}

/// A primitive op. Each has four homes, each an exhaustive `match`: shape/dtype
/// inference (here), its gradient rule, its CPU kernel and its StableHLO lowering.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// A tensor filled with one value (no inputs).
    Full {
        shape: Shape,
        value: Scalar,
        dtype: DType,
    },
    /// `start + i * step` for `i in 0..len` (no inputs).
    Arange {
        start: f64,
        step: f64,
        len: usize,
        dtype: DType,
    },
    /// Counter-based random bits (Philox4x32-10, the generator PyTorch uses on
    /// its accelerators): input a generator state, int64 `[2]` = `[key,
    /// offset]`; outputs `bits` (int64 of `shape`, each element a uniformly
    /// random 32-bit unsigned value in `[0, 2^32)`) and the advanced state
    /// `[key, offset + ceil(n / 4)]`. Element `i` of `bits` is word `i % 4` of
    /// Philox4x32-10 applied to the 128-bit counter `offset + i / 4` (low 64
    /// bits; the high 64 are zero) under the 64-bit key. A pure function of the
    /// state, so the CPU kernel and the StableHLO lowering give the same bits,
    /// and a captured program that reads and writes the state draws fresh
    /// numbers on every replay (see Note \[Generators\] in `generator.rs`).
    RandomBits {
        shape: Shape,
    },
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(CmpOp),
    /// `where(cond, a, b)`: cond bool; a, b of equal dtype; all of equal shape.
    Where,
    /// Cast to a dtype (round-to-nearest-even into bf16/f16, truncation into ints).
    Cast(DType),
    /// A contiguous copy (materialises any view).
    Copy,
    /// Reduce `dims` (sorted, unique); `keepdim` keeps them as size 1.
    Reduce {
        op: ReduceOp,
        dims: SmallVec<[usize; 6]>,
        keepdim: bool,
    },
    /// Index (int64) of the max/min along `dim` (or of the flattened tensor when `None`);
    /// ties give the first index, NaN counts as the extreme.
    ArgReduce {
        op: ArgReduceOp,
        dim: Option<usize>,
        keepdim: bool,
    },
    /// `softmax` (or, with `log`, `log_softmax`) along `dim` of a floating tensor,
    /// computed stably (the max is subtracted first); half-precision inputs
    /// compute in float32 and round once. A primitive rather than a composite:
    /// one pass over the data instead of five, and a gradient rule that uses the
    /// output directly (see the autograd rules).
    Softmax {
        dim: usize,
        log: bool,
    },
    /// Rotary position embedding as transformers applies it: inputs `x [..., T,
    /// d]` (`d` even), `cos [T, d]`, `sin [T, d]` of one floating dtype; the
    /// output `x * cos + rotate_half(x) * sin` with `rotate_half(x) =
    /// cat(-x[..., d/2:], x[..., :d/2])`, each product and the sum rounded in
    /// the element type as the unfused ops round them. One pass instead of six.
    Rotary,
    /// Fused scaled dot-product attention (PyTorch's
    /// `F.scaled_dot_product_attention`, flash-attention style): inputs `q [B, H,
    /// T, D]`, `k [B, Hk, S, D]`, `v [B, Hk, S, Dv]` of one floating dtype, with
    /// `H` a multiple of `Hk` (query head `h` reads key/value head `h / (H /
    /// Hk)`, grouped-query attention). Outputs `out [B, H, T, Dv] =
    /// softmax(scale q k^T) v` and the row log-sum-exp `lse [B, H, T]` of the scaled scores
    /// (float32, float64 for float64 inputs), which the backward needs. With
    /// `causal`, query `i` sees keys `j <= i + S - T` (the causal mask aligned to
    /// the bottom right, as with a KV cache of `S - T` earlier positions), which
    /// needs `S >= T`. A primitive rather than a composite: scores and
    /// probabilities never exist as `[B, H, T, S]` tensors, and causal blocks
    /// above the diagonal are skipped.
    Attention {
        scale: f64,
        causal: bool,
    },
    /// The gradients of [`Op::Attention`]: inputs `q, k, v, out, lse, g` (`g` the
    /// gradient of `out`), outputs `dq, dk, dv`. Probabilities are recomputed from
    /// `q`, `k` and `lse`.
    AttentionBackward {
        scale: f64,
        causal: bool,
    },
    /// The gradient of cross entropy with respect to the logits, fused: inputs
    /// logits `x [N, C, ...]` (floating), targets `t [N, ...]` (int64, valid
    /// class indices) and per-target weights `w [N, ...]` (float32 for half `x`,
    /// else `x`'s dtype); the output, `x`'s shape and dtype, is `(softmax(x) -
    /// (1 - smoothing) onehot(t) - smoothing / C) * w` along dim 1. One pass
    /// where the composite needs four (softmax, scatter, subtraction, product).
    CrossEntropyBackward {
        smoothing: f64,
    },
    /// RMS normalisation over the last dim, fused: inputs `x [..., D]` and
    /// `w [D]` of one floating dtype; outputs `y = x * rstd * w` (`x`'s shape and
    /// dtype) and `rstd = 1 / sqrt(mean(x², -1) + eps)` (`[...]`, float32, or
    /// float64 for float64 `x`), which the backward reuses. Half precision
    /// computes in float32 and rounds `y` once.
    RmsNorm {
        eps: f64,
    },
    /// The gradients of [`Op::RmsNorm`]: inputs `x, w, rstd, g` (`g` the gradient
    /// of `y`), outputs `dx` and `dw`.
    RmsNormBackward {
        eps: f64,
    },
    /// `log(sum(exp(x)))` along `dim` of a floating tensor (the dim removed),
    /// computed stably in two passes over each slice (max, then the shifted
    /// exponentials); an infinite max stands in as 0, so a slice of all `-inf`
    /// gives `-inf` and one holding `+inf` gives `+inf`, like PyTorch. Half
    /// precision computes in float32 and rounds once.
    LogSumExp {
        dim: usize,
    },
    /// Inclusive prefix sum along `dim` (integers and bool accumulate in int64).
    Cumsum {
        dim: usize,
    },
    /// `[..., m, k] @ [..., k, n]`, batch dims equal, same dtype.
    MatMul,
    /// One product per group of consecutive rows (Note [Grouped products] in
    /// `grouped.rs`): inputs `a`, `b` (one dtype) and `group_sizes` (int64
    /// `[G]`); `a [M, K]` with `b [G, K, N]` gives `[M, N]`, `a [K, M]` with
    /// `b [M, N]` gives `[G, K, N]` (the ragged dimension contracted).
    GroupedMatMul,
    View(ViewOp),
    /// Concatenation along `dim` of inputs of one dtype.
    Cat {
        dim: usize,
    },
    /// `out[i][j] = x[i][index[i][j]]` (for dim 1); inputs `x`, `index` (int64).
    Gather {
        dim: usize,
    },
    /// Inputs `base`, `index` (int64), `src`: a copy of base with src's elements written
    /// (or added) at the indexed positions along `dim`.
    Scatter {
        dim: usize,
        reduce: ScatterReduce,
    },
    /// Inputs `x`, `index` (1-D int64): picks slices along `dim`.
    IndexSelect {
        dim: usize,
    },
    /// Inputs `base`, `index` (1-D int64), `src`: a copy of base with `src` slices added
    /// at `index` along `dim`.
    IndexAdd {
        dim: usize,
    },
    /// Outputs (values, indices int64) sorted along `dim`.
    Sort {
        dim: usize,
        descending: bool,
        stable: bool,
    },
    /// Outputs the `k` largest (or smallest) along `dim`, sorted, and their indices.
    TopK {
        k: usize,
        dim: usize,
        largest: bool,
    },
    /// The functional form of an in-place write, as autograd and compiled programs
    /// see `copy_`: inputs `base` (contiguous), `src`; the output is `base` with `src`
    /// written at the positions of the layout `(shape, strides, offset)`, given in
    /// `base`'s flat element indices. Eager backends perform writes through
    /// `Backend::assign`; executing it out of place must also be supported.
    Assign {
        shape: Shape,
        strides: Shape,
        offset: usize,
    },
    /// A collective between the devices of a mesh axis, inside a local region
    /// (see Note [Local regions] in `collective.rs`).
    Collective(collective::CollectiveOp),
    /// The same values laid over a mesh with other placements (DTensor's
    /// `redistribute`): input a tensor on a mesh device, output of its type
    /// placed as the payload says; the backend moves the data between
    /// devices (all-gather, all-reduce of partial sums, all-to-all, slicing).
    Redistribute(std::sync::Arc<placement::Redistribution>),
    /// A local region (`kiln::local_map`) inside a program over a mesh: its
    /// body, a program of its own, runs on every device's blocks of the
    /// inputs (Note [Local regions] in `collective.rs`). Recorded only where a
    /// function traced on a mesh calls `local_map`.
    LocalMap(std::sync::Arc<region::LocalRegion>),
    /// The float32 weight `[out, in]` of a block-quantized one: inputs
    /// `codes`, `scales` (Note [Quantized weights] in `quant.rs`), each
    /// element `code * scale` exactly as the note orders it.
    Dequantize(quant::QuantSpec),
    /// `x @ W.T` for a block-quantized `W [out, in]` (weight-only
    /// quantization): inputs `x [..., in]` (float32, bfloat16 or float16),
    /// `codes`, `scales`; output `[..., out]` in `x`'s dtype, accumulated in
    /// float32 and rounded once. A primitive so that `W` is never
    /// materialised: the CPU kernel dequantizes a few rows at a time inside
    /// the product, the lowering dequantizes inside the program, where XLA
    /// fuses it into the dot.
    QuantMatMul(quant::QuantSpec),
    /// Attention of packed queries over a paged KV cache (Note [Paged
    /// attention] in `paged.rs`): inputs `q [N, H, D]`, `k_cache [blocks,
    /// block_size, Hk, D]`, `v_cache [blocks, block_size, Hk, Dv]` (one
    /// floating dtype, or a narrower one: Note [KV cache dtypes]),
    /// `block_tables [S, max_blocks]`, `context_lens [S]`, `query_start [S +
    /// 1]` (int64), and with `kv_scales` the float32 scales of float8 caches,
    /// `k_scales [blocks, block_size, Hk]` and `v_scales` alike; output `[N,
    /// H, Dv]`. Each query row is computed as `Attention` computes it over its
    /// sequence's keys, read through the block table. Inference only.
    PagedAttention {
        scale: f64,
        kv_scales: bool,
    },
    /// An op defined outside kiln through [`crate::CustomOp`] (Note [Custom
    /// ops] in `custom.rs`): its inputs, outputs and homes are its own.
    Custom(crate::custom::CustomOpRef),
}

impl Op {
    /// A short name for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Full { .. } => "full",
            Op::Arange { .. } => "arange",
            Op::RandomBits { .. } => "random_bits",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Compare(c) => c.name(),
            Op::Where => "where",
            Op::Cast(_) => "to",
            Op::Copy => "contiguous",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "sum",
                ReduceOp::Mean => "mean",
                ReduceOp::Prod => "prod",
                ReduceOp::Max => "amax",
                ReduceOp::Min => "amin",
                ReduceOp::Any => "any",
                ReduceOp::All => "all",
            },
            Op::ArgReduce { op: ArgReduceOp::ArgMax, .. } => "argmax",
            Op::ArgReduce { op: ArgReduceOp::ArgMin, .. } => "argmin",
            Op::Cumsum { .. } => "cumsum",
            Op::Rotary => "rotary_embedding",
            Op::LogSumExp { .. } => "logsumexp",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Op::Attention { .. } => "scaled_dot_product_attention",
            Op::AttentionBackward { .. } => "scaled_dot_product_attention_backward",
            Op::Softmax { log: false, .. } => "softmax",
            Op::Softmax { log: true, .. } => "log_softmax",
            Op::MatMul => "matmul",
            Op::GroupedMatMul => "grouped_mm",
            Op::View(v) => v.name(),
            Op::Cat { .. } => "cat",
            Op::Gather { .. } => "gather",
            Op::Scatter { reduce: ScatterReduce::Replace, .. } => "scatter",
            Op::Scatter { reduce: ScatterReduce::Add, .. } => "scatter_add",
            Op::IndexSelect { .. } => "index_select",
            Op::IndexAdd { .. } => "index_add",
            Op::Sort { .. } => "sort",
            Op::TopK { .. } => "topk",
            Op::Assign { .. } => "copy_",
            Op::Collective(c) => c.name(),
            Op::Redistribute(_) => "redistribute",
            Op::LocalMap(_) => "local_map",
            Op::Dequantize(_) => "dequantize",
            Op::QuantMatMul(_) => "quant_matmul",
            Op::PagedAttention { .. } => "paged_attention",
            Op::Custom(c) => c.name(),
        }
    }

    /// Number of inputs the op takes (`None`: any number, for `Cat` and custom ops).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Full { .. } | Op::Arange { .. } => 0,
            Op::Unary(_) | Op::Cast(_) | Op::Copy | Op::Reduce { .. } | Op::ArgReduce { .. } | Op::Cumsum { .. } => 1,
            Op::RandomBits { .. } | Op::Collective(_) | Op::Redistribute(_) => 1,
            Op::Dequantize(_) => 2,
            Op::QuantMatMul(_) => 3,
            Op::View(_) | Op::Sort { .. } | Op::TopK { .. } | Op::Softmax { .. } | Op::LogSumExp { .. } => 1,
            Op::Binary(_) | Op::Compare(_) | Op::MatMul | Op::Gather { .. } | Op::IndexSelect { .. } => 2,
            Op::Where | Op::Scatter { .. } | Op::IndexAdd { .. } | Op::GroupedMatMul => 3,
            Op::Assign { .. } | Op::RmsNorm { .. } => 2,
            Op::RmsNormBackward { .. } => 4,
            Op::Attention { .. } | Op::Rotary | Op::CrossEntropyBackward { .. } => 3,
            Op::AttentionBackward { .. } | Op::PagedAttention { kv_scales: false, .. } => 6,
            Op::PagedAttention { kv_scales: true, .. } => 8,
            Op::Cat { .. } | Op::Custom(_) | Op::LocalMap(_) => return None,
        })
    }

    /// Whether some input values make the op fail (an index out of range, an
    /// integer division by zero or to a negative power, inconsistent group
    /// sizes or paged metadata), given its inputs' types. Every backend raises
    /// these errors at the call, so deferred execution (Note \[Deferred
    /// programs\]) runs its program right after such an op.
    pub fn fails_on_data(&self, inputs: &[Meta]) -> bool {
        let first = inputs.first().map(|m| m.dtype);
        match self {
            Op::Binary(BinaryOp::Div | BinaryOp::FloorDiv | BinaryOp::Remainder | BinaryOp::Fmod) => {
                first.is_some_and(|d| !d.is_float())
            }
            Op::Binary(BinaryOp::Pow) => first.is_some_and(|d| d.is_int() && d != DType::U8),
            Op::Gather { .. }
            | Op::Scatter { .. }
            | Op::IndexSelect { .. }
            | Op::IndexAdd { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::GroupedMatMul
            | Op::PagedAttention { .. } => true,
            Op::LocalMap(r) => r.checks,
            Op::Binary(
                BinaryOp::Add
                | BinaryOp::Sub
                | BinaryOp::Mul
                | BinaryOp::Maximum
                | BinaryOp::Minimum
                | BinaryOp::Fmax
                | BinaryOp::Fmin
                | BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::Atan2
                | BinaryOp::SiluMul
                | BinaryOp::SiluGradMul
                | BinaryOp::BitwiseAnd
                | BinaryOp::BitwiseOr
                | BinaryOp::BitwiseXor
                | BinaryOp::LeftShift
                | BinaryOp::RightShift,
            )
            | Op::Full { .. }
            | Op::Arange { .. }
            | Op::RandomBits { .. }
            | Op::Unary(_)
            | Op::Compare(_)
            | Op::Where
            | Op::Cast(_)
            | Op::Copy
            | Op::Reduce { .. }
            | Op::ArgReduce { .. }
            | Op::Cumsum { .. }
            | Op::Rotary
            | Op::LogSumExp { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::Attention { .. }
            | Op::AttentionBackward { .. }
            | Op::Softmax { .. }
            | Op::MatMul
            | Op::View(_)
            | Op::Cat { .. }
            | Op::Sort { .. }
            | Op::TopK { .. }
            | Op::Assign { .. }
            | Op::Collective(_)
            | Op::Redistribute(_)
            | Op::Dequantize(_)
            | Op::QuantMatMul(_)
            | Op::Custom(_) => false,
        }
    }

    /// Whether the op accepts float8 inputs: casts, pure data movement
    /// (copies, views, concatenation, selection, writes, scatters that
    /// replace), the quantized weight ops, which decode float8 codes and
    /// scales, paged attention, which reads float8 caches with their scales
    /// (its typing rule says when), and custom ops, whose own `infer` decides. Anything else that computes with the values
    /// refuses them, as PyTorch's float8 does.
    pub fn moves_float8(&self) -> bool {
        match self {
            Op::Cast(_)
            | Op::Copy
            | Op::View(_)
            | Op::Cat { .. }
            | Op::Assign { .. }
            | Op::Redistribute(_)
            | Op::LocalMap(_)
            | Op::IndexSelect { .. }
            | Op::Gather { .. }
            | Op::Dequantize(_)
            | Op::QuantMatMul(_)
            | Op::Scatter { reduce: ScatterReduce::Replace, .. }
            | Op::PagedAttention { .. }
            | Op::Custom(_) => true,
            Op::Full { .. }
            | Op::Arange { .. }
            | Op::RandomBits { .. }
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Where
            | Op::Reduce { .. }
            | Op::ArgReduce { .. }
            | Op::Softmax { .. }
            | Op::Rotary
            | Op::Attention { .. }
            | Op::AttentionBackward { .. }
            | Op::CrossEntropyBackward { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBackward { .. }
            | Op::LogSumExp { .. }
            | Op::Cumsum { .. }
            | Op::MatMul
            | Op::GroupedMatMul
            | Op::Scatter { reduce: ScatterReduce::Add, .. }
            | Op::IndexAdd { .. }
            | Op::Sort { .. }
            | Op::TopK { .. }
            | Op::Collective(_) => false,
        }
    }
}
