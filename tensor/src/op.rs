//! The primitive-op IR: the one list of operations every backend implements,
//! with shape/dtype inference in one place (`Op::infer`). Composites (softmax,
//! gelu, var, ...) are written in terms of these in the tensor API.
use crate::error::fmt_shape;
use crate::{DType, Error, Layout, Meta, Result, Scalar, Shape};
use smallvec::{smallvec, SmallVec};

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
    Collective(crate::collective::CollectiveOp),
    /// The float32 weight `[out, in]` of a block-quantized one: inputs
    /// `codes`, `scales` (Note [Quantized weights] in `quant.rs`), each
    /// element `code * scale` exactly as the note orders it.
    Dequantize(crate::quant::QuantSpec),
    /// `x @ W.T` for a block-quantized `W [out, in]` (weight-only
    /// quantization): inputs `x [..., in]` (float32, bfloat16 or float16),
    /// `codes`, `scales`; output `[..., out]` in `x`'s dtype, accumulated in
    /// float32 and rounded once. A primitive so that `W` is never
    /// materialised: the CPU kernel dequantizes a few rows at a time inside
    /// the product, the lowering dequantizes inside the program, where XLA
    /// fuses it into the dot.
    QuantMatMul(crate::quant::QuantSpec),
    /// Attention of packed queries over a paged KV cache (Note [Paged
    /// attention] in `paged.rs`): inputs `q [N, H, D]`, `k_cache [blocks,
    /// block_size, Hk, D]`, `v_cache [blocks, block_size, Hk, Dv]` (one
    /// floating dtype), `block_tables [S, max_blocks]`, `context_lens [S]`,
    /// `query_start [S + 1]` (int64); output `[N, H, Dv]`. Each query row is
    /// computed as `Attention` computes it over its sequence's keys, read
    /// through the block table. Inference only.
    PagedAttention {
        scale: f64,
    },
}

/// Checks the `q, k, v` inputs of the attention primitives (see [`Op::Attention`]).
fn attention_shapes<'a>(
    name: &'static str,
    q: &'a Meta,
    k: &'a Meta,
    v: &'a Meta,
    causal: bool,
) -> Result<(&'a Meta, &'a Meta, &'a Meta)> {
    for (what, m) in [("query", q), ("key", k), ("value", v)] {
        if !m.dtype.is_float() {
            return Err(Error::dtype(name, format!("expected a floating point {what}, got {}", m.dtype)));
        }
        if m.dtype != q.dtype {
            return Err(Error::dtype(
                name,
                format!(
                    "expected query, key and value to have the same dtype, but got {}, {} and {}",
                    q.dtype, k.dtype, v.dtype
                ),
            ));
        }
    }
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    let ok = qs.len() == 4
        && ks.len() == 4
        && vs.len() == 4
        && ks[0] == qs[0]
        && vs[0] == qs[0]
        && vs[1] == ks[1]
        && ks[1] > 0
        && qs[1] % ks[1] == 0
        && ks[3] == qs[3]
        && vs[2] == ks[2];
    if !ok {
        return Err(Error::shape(
            name,
            format!(
                "expected query [B, H, T, D], key [B, Hk, S, D] and value [B, Hk, S, Dv] with H a multiple of Hk, got {}, {} and {}",
                fmt_shape(qs),
                fmt_shape(ks),
                fmt_shape(vs)
            ),
        ));
    }
    if causal && ks[2] < qs[2] {
        return Err(Error::shape(
            name,
            format!(
                "a causal mask needs at least as many keys as queries (query i sees keys j <= i + S - T), got T = {} and S = {}",
                qs[2], ks[2]
            ),
        ));
    }
    Ok((q, k, v))
}

/// `[B, H, T, D, Hk, S, Dv]` of checked attention inputs.
fn attention_dims(q: &Meta, k: &Meta, v: &Meta) -> [usize; 7] {
    [q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[2], v.shape[3]]
}

fn meta(shape: &[usize], dtype: DType) -> Meta {
    Meta { shape: shape.into(), dtype }
}

fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Shape {
    let mut out = Shape::new();
    for (i, &d) in shape.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    out
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
            Op::Dequantize(_) => "dequantize",
            Op::QuantMatMul(_) => "quant_matmul",
            Op::PagedAttention { .. } => "paged_attention",
        }
    }

    /// Number of inputs the op takes (`None`: any number, for `Cat`).
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Full { .. } | Op::Arange { .. } => 0,
            Op::Unary(_) | Op::Cast(_) | Op::Copy | Op::Reduce { .. } | Op::ArgReduce { .. } | Op::Cumsum { .. } => 1,
            Op::RandomBits { .. } | Op::Collective(_) => 1,
            Op::Dequantize(_) => 2,
            Op::QuantMatMul(_) => 3,
            Op::View(_) | Op::Sort { .. } | Op::TopK { .. } | Op::Softmax { .. } | Op::LogSumExp { .. } => 1,
            Op::Binary(_) | Op::Compare(_) | Op::MatMul | Op::Gather { .. } | Op::IndexSelect { .. } => 2,
            Op::Where | Op::Scatter { .. } | Op::IndexAdd { .. } | Op::GroupedMatMul => 3,
            Op::Assign { .. } | Op::RmsNorm { .. } => 2,
            Op::RmsNormBackward { .. } => 4,
            Op::Attention { .. } | Op::Rotary | Op::CrossEntropyBackward { .. } => 3,
            Op::AttentionBackward { .. } | Op::PagedAttention { .. } => 6,
            Op::Cat { .. } => return None,
        })
    }

    /// Whether the op accepts float8 inputs: casts, pure data movement
    /// (copies, views, concatenation, selection, writes) and the quantized
    /// weight ops, which decode float8 codes and scales. Anything else that
    /// computes with the values refuses them, as PyTorch's float8 does.
    pub fn moves_float8(&self) -> bool {
        matches!(
            self,
            Op::Cast(_)
                | Op::Copy
                | Op::View(_)
                | Op::Cat { .. }
                | Op::Assign { .. }
                | Op::IndexSelect { .. }
                | Op::Gather { .. }
                | Op::Dequantize(_)
                | Op::QuantMatMul(_)
        )
    }

    /// Shapes and dtypes of the outputs for inputs of the given shapes and dtypes.
    /// This is the single place where primitives' typing rules live. Every
    /// output's size is checked to fit the address space (`alloc::bytes`).
    pub fn infer(&self, inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
        let outs = self.infer_types(inputs)?;
        for m in &outs {
            crate::alloc::bytes(self.name(), &m.shape, m.dtype)?;
        }
        Ok(outs)
    }

    fn infer_types(&self, inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
        let name = self.name();
        if let Some(n) = self.arity() {
            if inputs.len() != n {
                return Err(Error::invalid(name, format!("expects {n} inputs, got {}", inputs.len())));
            }
        }
        let same_shape = |a: &Meta, b: &Meta| -> Result<()> {
            if a.shape != b.shape {
                return Err(Error::shape(
                    name,
                    format!("primitive needs equal shapes, got {} and {}", fmt_shape(&a.shape), fmt_shape(&b.shape)),
                ));
            }
            Ok(())
        };
        let same_dtype = |a: &Meta, b: &Meta| -> Result<()> {
            if a.dtype != b.dtype {
                return Err(Error::dtype(
                    name,
                    format!("expected both inputs to have the same dtype, but got {} and {}", a.dtype, b.dtype),
                ));
            }
            Ok(())
        };
        let check_dim = |dim: usize, ndim: usize| -> Result<()> {
            if dim >= ndim.max(1) {
                return Err(Error::dim_out_of_range(name, dim as isize, ndim));
            }
            Ok(())
        };
        let index_dtype = |m: &Meta| -> Result<()> {
            if m.dtype != DType::I64 {
                return Err(Error::dtype(name, format!("expected index to be of dtype int64, got {}", m.dtype)));
            }
            Ok(())
        };
        if let Some(m) = inputs.iter().find(|m| m.dtype.is_float8()) {
            if !self.moves_float8() {
                return Err(Error::dtype(
                    name,
                    format!(
                        "not implemented for dtype {}: float8 tensors support casts and data movement only, \
                         as in PyTorch; convert with to_dtype first",
                        m.dtype
                    ),
                ));
            }
        }
        Ok(match self {
            Op::Full { shape, dtype, .. } => smallvec![meta(shape, *dtype)],
            Op::Arange { dtype, .. } if dtype.is_float8() => return Err(Error::unsupported_dtype(name, *dtype)),
            Op::Arange { len, dtype, .. } => smallvec![meta(&[*len], *dtype)],
            Op::RandomBits { shape } => {
                let st = &inputs[0];
                if st.dtype != DType::I64 || st.shape.as_slice() != [2] {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "expected a generator state of shape [2] and dtype int64, got {} {}",
                            fmt_shape(&st.shape),
                            st.dtype
                        ),
                    ));
                }
                smallvec![meta(shape, DType::I64), meta(&[2], DType::I64)]
            }
            Op::Unary(u) => {
                let x = &inputs[0];
                if u.is_float_only() && !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let dt = match u {
                    UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf => DType::Bool,
                    UnaryOp::Neg if x.dtype == DType::Bool => {
                        return Err(Error::dtype(
                            name,
                            "negation, the `-` operator, on a bool tensor is not supported; use the `!` operator or logical_not() instead",
                        ))
                    }
                    _ => x.dtype,
                };
                smallvec![meta(&x.shape, dt)]
            }
            Op::Binary(b) => {
                let (x, y) = (&inputs[0], &inputs[1]);
                same_shape(x, y)?;
                same_dtype(x, y)?;
                if *b == BinaryOp::Sub && x.dtype == DType::Bool {
                    return Err(Error::dtype(
                        name,
                        "subtraction, the `-` operator, with two bool tensors is not supported; use the `^` operator or logical_xor() instead",
                    ));
                }
                if matches!(b, BinaryOp::Atan2 | BinaryOp::SiluMul | BinaryOp::SiluGradMul) && !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let shift = matches!(b, BinaryOp::LeftShift | BinaryOp::RightShift);
                if b.is_bitwise() && (x.dtype.is_float() || (shift && x.dtype == DType::Bool)) {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let dt = if b.is_logical() { DType::Bool } else { x.dtype };
                smallvec![meta(&x.shape, dt)]
            }
            Op::Compare(_) => {
                same_shape(&inputs[0], &inputs[1])?;
                same_dtype(&inputs[0], &inputs[1])?;
                smallvec![meta(&inputs[0].shape, DType::Bool)]
            }
            Op::Where => {
                let (c, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
                if c.dtype != DType::Bool {
                    return Err(Error::dtype(
                        name,
                        format!(
                            "where expected condition to be a boolean tensor, but got a tensor with dtype {}",
                            c.dtype
                        ),
                    ));
                }
                same_shape(c, a)?;
                same_shape(a, b)?;
                same_dtype(a, b)?;
                smallvec![meta(&a.shape, a.dtype)]
            }
            Op::Cast(dt) => smallvec![meta(&inputs[0].shape, *dt)],
            Op::Copy => smallvec![inputs[0].clone()],
            Op::Reduce { op, dims, keepdim } => {
                let x = &inputs[0];
                for &d in dims {
                    check_dim(d, x.shape.len())?;
                }
                let dt = match op {
                    ReduceOp::Sum | ReduceOp::Prod if !x.dtype.is_float() => DType::I64,
                    ReduceOp::Mean if !x.dtype.is_float() => {
                        return Err(Error::dtype(
                            name,
                            format!("could not infer output dtype. Input dtype must be either a floating point or complex dtype. Got: {}", x.dtype),
                        ))
                    }
                    ReduceOp::Any | ReduceOp::All => DType::Bool,
                    _ => x.dtype,
                };
                if matches!(op, ReduceOp::Max | ReduceOp::Min) {
                    for &d in dims {
                        if x.shape.get(d) == Some(&0) {
                            return Err(Error::shape(
                                name,
                                format!(
                                    "expected reduction dim {d} to have non-zero size; input shape {}",
                                    fmt_shape(&x.shape)
                                ),
                            ));
                        }
                    }
                }
                smallvec![Meta { shape: reduced_shape(&x.shape, dims, *keepdim), dtype: dt }]
            }
            Op::ArgReduce { dim, keepdim, .. } => {
                let x = &inputs[0];
                let shape = match dim {
                    Some(d) => {
                        check_dim(*d, x.shape.len())?;
                        if x.shape.get(*d) == Some(&0) {
                            return Err(Error::shape(
                                name,
                                format!("expected reduction dim {d} to have non-zero size"),
                            ));
                        }
                        if x.shape.is_empty() {
                            Shape::new()
                        } else {
                            reduced_shape(&x.shape, &[*d], *keepdim)
                        }
                    }
                    None => {
                        if x.shape.iter().product::<usize>() == 0 {
                            return Err(Error::shape(
                                name,
                                "expected a non-empty tensor: cannot take the arg of an empty sequence",
                            ));
                        }
                        if *keepdim {
                            smallvec![1; x.shape.len()]
                        } else {
                            Shape::new()
                        }
                    }
                };
                smallvec![Meta { shape, dtype: DType::I64 }]
            }
            Op::Softmax { dim, .. } => {
                let x = &inputs[0];
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                check_dim(*dim, x.shape.len().max(1))?;
                smallvec![meta(&x.shape, x.dtype)]
            }
            Op::RmsNorm { .. } | Op::RmsNormBackward { .. } => {
                let (x, w) = (&inputs[0], &inputs[1]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                same_dtype(x, w)?;
                let n = x.shape.len();
                if n == 0 || w.shape.as_slice() != [x.shape[n - 1]] {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected x [..., D] and weight [D], got {} and {}",
                            fmt_shape(&x.shape),
                            fmt_shape(&w.shape)
                        ),
                    ));
                }
                let rdt = if x.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                let rows = meta(&x.shape[..n - 1], rdt);
                if matches!(self, Op::RmsNorm { .. }) {
                    smallvec![x.clone(), rows]
                } else {
                    let (r, g) = (&inputs[2], &inputs[3]);
                    if *r != rows || g != x {
                        return Err(Error::shape(
                            name,
                            format!(
                                "expected rstd {} ({rdt}) and a gradient like x {} ({}), got {} ({}) and {} ({})",
                                fmt_shape(&rows.shape),
                                fmt_shape(&x.shape),
                                x.dtype,
                                fmt_shape(&r.shape),
                                r.dtype,
                                fmt_shape(&g.shape),
                                g.dtype
                            ),
                        ));
                    }
                    smallvec![x.clone(), w.clone()]
                }
            }
            Op::CrossEntropyBackward { .. } => {
                let (x, t, w) = (&inputs[0], &inputs[1], &inputs[2]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                index_dtype(t)?;
                let wdt = match x.dtype {
                    DType::BF16 | DType::F16 => DType::F32,
                    d => d,
                };
                let mut want = x.shape.clone();
                let ok = want.len() >= 2 && {
                    want.remove(1);
                    t.shape == want && w.shape == want
                };
                if !ok || w.dtype != wdt {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected logits [N, C, ...], targets and weights [N, ...] ({wdt} weights), got {}, {} and {} ({})",
                            fmt_shape(&x.shape),
                            fmt_shape(&t.shape),
                            fmt_shape(&w.shape),
                            w.dtype
                        ),
                    ));
                }
                smallvec![x.clone()]
            }
            Op::Rotary => {
                let (x, cos, sin) = (&inputs[0], &inputs[1], &inputs[2]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                same_dtype(x, cos)?;
                same_dtype(x, sin)?;
                let n = x.shape.len();
                let ok = n >= 2
                    && x.shape[n - 1] % 2 == 0
                    && cos.shape.as_slice() == &x.shape[n - 2..]
                    && sin.shape == cos.shape;
                if !ok {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected x [..., T, d] with d even and cos, sin [T, d], got {}, {} and {}",
                            fmt_shape(&x.shape),
                            fmt_shape(&cos.shape),
                            fmt_shape(&sin.shape)
                        ),
                    ));
                }
                smallvec![x.clone()]
            }
            Op::Attention { causal, .. } => {
                let (q, k, v) = attention_shapes(name, &inputs[0], &inputs[1], &inputs[2], *causal)?;
                let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
                let lse = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                smallvec![meta(&[b, h, t, dv], q.dtype), meta(&[b, h, t], lse)]
            }
            Op::AttentionBackward { causal, .. } => {
                let (q, k, v) = attention_shapes(name, &inputs[0], &inputs[1], &inputs[2], *causal)?;
                let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
                let lse_dt = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                let (out, lse, g) = (&inputs[3], &inputs[4], &inputs[5]);
                if out.shape.as_slice() != [b, h, t, dv]
                    || g.shape != out.shape
                    || lse.shape.as_slice() != [b, h, t]
                    || out.dtype != q.dtype
                    || g.dtype != q.dtype
                    || lse.dtype != lse_dt
                {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected out and grad [{b}, {h}, {t}, {dv}] ({}) and lse [{b}, {h}, {t}] ({lse_dt}), got {} ({}), {} ({}) and {} ({})",
                            q.dtype,
                            fmt_shape(&out.shape),
                            out.dtype,
                            fmt_shape(&g.shape),
                            g.dtype,
                            fmt_shape(&lse.shape),
                            lse.dtype
                        ),
                    ));
                }
                smallvec![q.clone(), k.clone(), v.clone()]
            }
            Op::LogSumExp { dim } => {
                let x = &inputs[0];
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                check_dim(*dim, x.shape.len())?;
                smallvec![Meta { shape: reduced_shape(&x.shape, &[*dim], false), dtype: x.dtype }]
            }
            Op::Cumsum { dim } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                let dt = if x.dtype.is_float() { x.dtype } else { DType::I64 };
                smallvec![meta(&x.shape, dt)]
            }
            Op::PagedAttention { .. } => crate::paged::paged_attention_meta(inputs)?,
            Op::GroupedMatMul => crate::grouped::grouped_mm_meta(inputs)?,
            Op::Dequantize(spec) => {
                let [out, inp] =
                    spec.check(name, (inputs[0].dtype, &inputs[0].shape), (inputs[1].dtype, &inputs[1].shape))?;
                smallvec![meta(&[out, inp], DType::F32)]
            }
            Op::QuantMatMul(spec) => {
                let x = &inputs[0];
                let [out, inp] =
                    spec.check(name, (inputs[1].dtype, &inputs[1].shape), (inputs[2].dtype, &inputs[2].shape))?;
                if !matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) {
                    return Err(Error::dtype(
                        name,
                        format!("expected a float32, bfloat16 or float16 input, got {}", x.dtype),
                    ));
                }
                if x.shape.last() != Some(&inp) {
                    return Err(Error::shape(
                        name,
                        format!(
                            "mat1 and mat2 shapes cannot be multiplied ({} and [{inp}, {out}])",
                            fmt_shape(&x.shape)
                        ),
                    ));
                }
                let mut s: Shape = x.shape.clone();
                *s.last_mut().expect("checked above") = out;
                smallvec![Meta { shape: s, dtype: x.dtype }]
            }
            Op::MatMul => {
                let (a, b) = (&inputs[0], &inputs[1]);
                same_dtype(a, b)?;
                let (ra, rb) = (a.shape.len(), b.shape.len());
                if ra < 2 || ra != rb || a.shape[..ra - 2] != b.shape[..rb - 2] || a.shape[ra - 1] != b.shape[rb - 2] {
                    return Err(Error::shape(
                        name,
                        format!(
                            "mat1 and mat2 shapes cannot be multiplied ({} and {})",
                            fmt_shape(&a.shape),
                            fmt_shape(&b.shape)
                        ),
                    ));
                }
                let mut s: Shape = a.shape[..ra - 1].into();
                s.push(b.shape[rb - 1]);
                smallvec![Meta { shape: s, dtype: a.dtype }]
            }
            Op::View(v) => {
                let l = v.apply(&Layout::contiguous(&inputs[0].shape))?;
                smallvec![meta(l.shape(), inputs[0].dtype)]
            }
            Op::Cat { dim } => {
                let first =
                    inputs.first().ok_or_else(|| Error::invalid(name, "expected a non-empty list of tensors"))?;
                check_dim(*dim, first.shape.len())?;
                let mut shape = first.shape.clone();
                shape[*dim] = 0;
                for m in inputs {
                    same_dtype(first, m)?;
                    let ok = m.shape.len() == first.shape.len()
                        && m.shape.iter().zip(&first.shape).enumerate().all(|(i, (a, b))| i == *dim || a == b);
                    if !ok {
                        return Err(Error::shape(
                            name,
                            format!(
                                "sizes of tensors must match except in dimension {dim}; got {} and {}",
                                fmt_shape(&first.shape),
                                fmt_shape(&m.shape)
                            ),
                        ));
                    }
                    shape[*dim] += m.shape[*dim];
                }
                smallvec![Meta { shape, dtype: first.dtype }]
            }
            Op::Gather { dim } => {
                let (x, idx) = (&inputs[0], &inputs[1]);
                index_dtype(idx)?;
                check_dim(*dim, x.shape.len())?;
                if idx.shape.len() != x.shape.len() {
                    return Err(Error::shape(
                        name,
                        "index tensor must have the same number of dimensions as input tensor",
                    ));
                }
                for i in 0..x.shape.len() {
                    if i != *dim && idx.shape[i] > x.shape[i] {
                        return Err(Error::shape(
                            name,
                            format!(
                                "size of index {} does not fit input {} at dimension {i}",
                                fmt_shape(&idx.shape),
                                fmt_shape(&x.shape)
                            ),
                        ));
                    }
                }
                smallvec![meta(&idx.shape, x.dtype)]
            }
            Op::Scatter { dim, .. } => {
                let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
                index_dtype(idx)?;
                same_dtype(base, src)?;
                check_dim(*dim, base.shape.len())?;
                if idx.shape.len() != base.shape.len() || src.shape.len() != base.shape.len() {
                    return Err(Error::shape(
                        name,
                        "index tensor must have the same number of dimensions as self tensor",
                    ));
                }
                for i in 0..base.shape.len() {
                    if idx.shape[i] > src.shape[i] || (i != *dim && idx.shape[i] > base.shape[i]) {
                        return Err(Error::shape(
                            name,
                            format!(
                                "expected index {} to be smaller than self {} apart from dimension {dim} and to be smaller than src {}",
                                fmt_shape(&idx.shape),
                                fmt_shape(&base.shape),
                                fmt_shape(&src.shape)
                            ),
                        ));
                    }
                }
                smallvec![base.clone()]
            }
            Op::IndexSelect { dim } => {
                let (x, idx) = (&inputs[0], &inputs[1]);
                index_dtype(idx)?;
                check_dim(*dim, x.shape.len())?;
                if idx.shape.len() > 1 {
                    return Err(Error::shape(name, "index_select(): index should be a vector (0-d or 1-d)"));
                }
                let mut s = x.shape.clone();
                if !s.is_empty() {
                    s[*dim] = idx.shape.iter().product();
                }
                smallvec![meta(&s, x.dtype)]
            }
            Op::IndexAdd { dim } => {
                let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
                index_dtype(idx)?;
                same_dtype(base, src)?;
                check_dim(*dim, base.shape.len())?;
                let n: usize = idx.shape.iter().product();
                let mut want = base.shape.clone();
                if !want.is_empty() {
                    want[*dim] = n;
                }
                if idx.shape.len() > 1 || src.shape != want {
                    return Err(Error::shape(
                        name,
                        format!(
                            "source {} must have shape {} (self with dim {dim} of the index's length)",
                            fmt_shape(&src.shape),
                            fmt_shape(&want)
                        ),
                    ));
                }
                smallvec![base.clone()]
            }
            Op::Sort { dim, .. } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                smallvec![x.clone(), meta(&x.shape, DType::I64)]
            }
            Op::TopK { k, dim, .. } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                let n = x.shape.get(*dim).copied().unwrap_or(1);
                if *k > n {
                    return Err(Error::index(
                        name,
                        format!("selected index k = {k} out of range for a dimension of size {n}"),
                    ));
                }
                let mut s = x.shape.clone();
                if !s.is_empty() {
                    s[*dim] = *k;
                }
                smallvec![meta(&s, x.dtype), meta(&s, DType::I64)]
            }
            Op::Assign { shape, strides, offset } => {
                let (base, src) = (&inputs[0], &inputs[1]);
                same_dtype(base, src)?;
                if src.shape != *shape {
                    return Err(Error::shape(
                        name,
                        format!(
                            "source shape {} does not match the destination {}",
                            fmt_shape(&src.shape),
                            fmt_shape(shape)
                        ),
                    ));
                }
                let l = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
                l.check_bounds(name, base.shape.iter().product())?;
                smallvec![base.clone()]
            }
            Op::Collective(c) => c.infer(&inputs[0])?,
        })
    }
}
