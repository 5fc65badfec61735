//! Shape and dtype inference of the primitives (`Op::infer`): the single place
//! where their typing rules live. `infer_types` is the one exhaustive match
//! over `Op`; the rules of each op family are in `infer/`.
use super::*;

mod elementwise;
mod fused;
mod indexing;
mod linalg;
mod reduce;

/// One op's typing: its name, its operands' types, and the checks the rules share.
struct Typing<'a> {
    op: &'a Op,
    name: &'static str,
    inputs: &'a [Meta],
}

impl Typing<'_> {
    fn same_shape(&self, a: &Meta, b: &Meta) -> Result<()> {
        if a.shape != b.shape {
            return Err(Error::shape(
                self.name,
                format!("primitive needs equal shapes, got {} and {}", fmt_shape(&a.shape), fmt_shape(&b.shape)),
            ));
        }
        Ok(())
    }
    fn same_dtype(&self, a: &Meta, b: &Meta) -> Result<()> {
        if a.dtype != b.dtype {
            return Err(Error::dtype(
                self.name,
                format!("expected both inputs to have the same dtype, but got {} and {}", a.dtype, b.dtype),
            ));
        }
        Ok(())
    }
    fn check_dim(&self, dim: usize, ndim: usize) -> Result<()> {
        if dim >= ndim.max(1) {
            return Err(Error::dim_out_of_range(self.name, dim as isize, ndim));
        }
        Ok(())
    }
    fn index_dtype(&self, m: &Meta) -> Result<()> {
        if m.dtype != DType::I64 {
            return Err(Error::dtype(self.name, format!("expected index to be of dtype int64, got {}", m.dtype)));
        }
        Ok(())
    }
}

fn meta(shape: &[usize], dtype: DType) -> Meta {
    Meta { shape: shape.into(), dtype }
}

impl Op {
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
        let c = Typing { op: self, name, inputs };
        Ok(match self {
            Op::Full { shape, dtype, .. } => smallvec![meta(shape, *dtype)],
            Op::Arange { dtype, .. } if dtype.is_float8() => return Err(Error::unsupported_dtype(name, *dtype)),
            Op::Arange { len, dtype, .. } => smallvec![meta(&[*len], *dtype)],
            Op::RandomBits { shape } => elementwise::random_bits(&c, shape)?,
            Op::Unary(u) => elementwise::unary(&c, u)?,
            Op::Binary(b) => elementwise::binary(&c, b)?,
            Op::Compare(_) => elementwise::compare(&c)?,
            Op::Where => elementwise::where_(&c)?,
            Op::Cast(dt) => smallvec![meta(&inputs[0].shape, *dt)],
            Op::Copy => smallvec![inputs[0].clone()],
            Op::Reduce { op, dims, keepdim } => reduce::reduce(&c, op, dims, keepdim)?,
            Op::ArgReduce { dim, keepdim, .. } => reduce::arg_reduce(&c, dim, keepdim)?,
            Op::Softmax { dim, .. } => reduce::softmax(&c, dim)?,
            Op::RmsNorm { .. } | Op::RmsNormBackward { .. } => fused::rms_norm(&c)?,
            Op::CrossEntropyBackward { .. } => fused::cross_entropy_backward(&c)?,
            Op::Rotary => fused::rotary(&c)?,
            Op::Attention { causal, .. } => fused::attention(&c, causal)?,
            Op::AttentionBackward { causal, .. } => fused::attention_backward(&c, causal)?,
            Op::LogSumExp { dim } => reduce::logsumexp(&c, dim)?,
            Op::Cumsum { dim } => reduce::cumsum(&c, dim)?,
            Op::PagedAttention { .. } => super::paged::paged_attention_meta(inputs)?,
            Op::Custom(c) => c.infer(inputs)?.into_iter().collect(),
            Op::GroupedMatMul => super::grouped::grouped_mm_meta(inputs)?,
            Op::Dequantize(spec) => linalg::dequantize(&c, spec)?,
            Op::QuantMatMul(spec) => linalg::quant_matmul(&c, spec)?,
            Op::MatMul => linalg::matmul(&c)?,
            Op::View(v) => {
                let l = v.apply(&Layout::contiguous(&inputs[0].shape))?;
                smallvec![meta(l.shape(), inputs[0].dtype)]
            }
            Op::Cat { dim } => indexing::cat(&c, dim)?,
            Op::Gather { dim } => indexing::gather(&c, dim)?,
            Op::Scatter { dim, .. } => indexing::scatter(&c, dim)?,
            Op::IndexSelect { dim } => indexing::index_select(&c, dim)?,
            Op::IndexAdd { dim } => indexing::index_add(&c, dim)?,
            Op::Sort { dim, .. } => indexing::sort(&c, dim)?,
            Op::TopK { k, dim, .. } => indexing::topk(&c, k, dim)?,
            Op::Assign { shape, strides, offset } => indexing::assign(&c, shape, strides, offset)?,
            Op::Collective(c) => c.infer(&inputs[0])?,
            Op::Redistribute(r) => smallvec![r.infer(&inputs[0])?],
            Op::LocalMap(r) => r.infer(inputs)?.into_iter().collect(),
        })
    }
}
