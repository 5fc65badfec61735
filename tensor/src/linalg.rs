//! Linear algebra: `matmul` with `torch.matmul`'s rules (1-D operands, batch
//! broadcasting), the strict `mm` and `bmm`, `dot`, `outer` and `linear`.
//!
//! Everything lowers to the one primitive `Op::MatMul`: `[..., m, k] @ [..., k, n]`
//! with equal batch dims of any rank, strided inputs allowed. Broadcast batch
//! dims are stride-0 views, so no operand is copied; a batch times one matrix is
//! folded into one GEMM when a view allows it.
use crate::error::fmt_shape;
use crate::reduce::reshape_result;
use crate::{DType, Error, Op, Result, Shape, Tensor};

/// The error PyTorch gives for operands of different dtypes.
fn check_same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(
            op,
            format!("expected m1 and m2 to have the same dtype, but got: {} != {}", a.dtype(), b.dtype()),
        ));
    }
    if a.dtype() == DType::Bool {
        return Err(Error::unsupported_dtype(op, DType::Bool));
    }
    Ok(())
}

/// `2x3`, PyTorch's way of printing a matrix shape in matmul errors.
fn mat(s: &[usize]) -> String {
    s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

impl Tensor {
    /// Matrix product with `torch.matmul`'s rules:
    /// - 1-D @ 1-D: the dot product (0-d result);
    /// - 2-D @ 2-D: the matrix product;
    /// - a 1-D left operand is treated as `[1, k]` and a 1-D right operand as
    ///   `[k, 1]`; the added dim is removed from the result;
    /// - otherwise both are batches of matrices whose batch dims broadcast
    ///   (`[j, 1, n, m] @ [k, m, p]` gives `[j, k, n, p]`).
    ///
    /// Both operands must have the same dtype (no promotion, as in PyTorch).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
    /// let v = Tensor::new([1.0f32, 1.0])?;
    /// assert_eq!(a.matmul(&v)?.to_vec::<f32>()?, vec![3.0, 7.0]);   // [2, 2] @ [2] -> [2]
    /// assert_eq!(v.matmul(&a)?.to_vec::<f32>()?, vec![4.0, 6.0]);   // [2] @ [2, 2] -> [2]
    /// assert_eq!(v.matmul(&v)?.shape(), &[] as &[usize]);             // dot: 0-d
    /// let batch = Tensor::ones(&[5, 3, 2], DType::F32)?;
    /// assert_eq!(batch.matmul(&a)?.shape(), &[5, 3, 2]);              // [5, 3, 2] @ [2, 2]
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::lowered(self, other)? {
            return a.matmul(&b);
        }
        let (a, b) = (self, other);
        if a.ndim() == 0 || b.ndim() == 0 {
            return Err(Error::shape(
                "matmul",
                format!(
                    "both arguments to matmul need to be at least 1D, but they are {}D and {}D",
                    a.ndim(),
                    b.ndim()
                ),
            ));
        }
        check_same_dtype("matmul", a, b)?;
        let (a1, b1) = (a.ndim() == 1, b.ndim() == 1);
        let a2 = if a1 { a.unsqueeze(0)? } else { a.clone() };
        let b2 = if b1 { b.unsqueeze(1)? } else { b.clone() };
        let (ra, rb) = (a2.ndim(), b2.ndim());
        let (m, k) = (a2.shape()[ra - 2], a2.shape()[ra - 1]);
        let (k2, n) = (b2.shape()[rb - 2], b2.shape()[rb - 1]);
        if k != k2 {
            let msg = match (a.ndim(), b.ndim()) {
                (1, 1) => format!(
                    "inconsistent tensor size, expected tensor [{k}] and src [{k2}] to have the same number of elements, but got {k} and {k2} elements respectively"
                ),
                (2, 1) => format!("size mismatch, got input ({m}), mat ({m}x{k}), vec ({k2})"),
                (1, 2) | (2, 2) => {
                    format!("mat1 and mat2 shapes cannot be multiplied ({} and {})", mat(a2.shape()), mat(b2.shape()))
                }
                _ => format!(
                    "mat1 and mat2 shapes cannot be multiplied ({} and {}): the last dim of the first ({k}) must equal the second-to-last dim of the second ({k2})",
                    fmt_shape(a.shape()),
                    fmt_shape(b.shape())
                ),
            };
            return Err(Error::shape("matmul", msg));
        }
        let batch = crate::broadcast_shapes("matmul", &a2.shape()[..ra - 2], &b2.shape()[..rb - 2])?;
        let mut out_shape: Shape = batch.clone();
        if !a1 {
            out_shape.push(m);
        }
        if !b1 {
            out_shape.push(n);
        }
        let nb: usize = batch.iter().product();
        // A batch of matrices times one matrix: fold the batch into the rows, one
        // GEMM (and one GEMM in backward) instead of many, when the strides allow
        // it without a copy. The product is reshaped back as a new base (see
        // Note [Results are not views]).
        if rb == 2 && ra > 2 && a2.layout().reshape_view(&[nb * m, k]).is_some() {
            let folded = a2.reshape_to(&[nb * m, k])?;
            return reshape_result(Tensor::apply1(Op::MatMul, &[&folded, &b2])?, &out_shape);
        }
        // Otherwise broadcast batch dims are stride-0 views and the primitive reads
        // strided operands, so nothing is copied.
        let mut ashape = batch.clone();
        ashape.extend_from_slice(&[m, k]);
        let mut bshape = batch;
        bshape.extend_from_slice(&[k, n]);
        let out = Tensor::apply1(Op::MatMul, &[&a2.broadcast_to(&ashape)?, &b2.broadcast_to(&bshape)?])?;
        // Removing the dims added for 1-D operands reshapes the fresh product.
        reshape_result(out, &out_shape)
    }

    /// Strict 2-D matrix product (`torch.mm`): no broadcasting, no 1-D operands.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([[1.0f32, 2.0, 3.0]])?;
    /// let b = Tensor::new([[1.0f32], [1.0], [1.0]])?;
    /// assert_eq!(a.mm(&b)?.to_vec::<f32>()?, vec![6.0]);
    /// assert!(a.mm(&a).is_err()); // mm: mat1 and mat2 shapes cannot be multiplied (1x3 and 1x3)
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn mm(&self, other: &Tensor) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::lowered(self, other)? {
            return a.mm(&b);
        }
        if self.ndim() != 2 {
            return Err(Error::shape("mm", format!("self must be a matrix, got {}-D tensor", self.ndim())));
        }
        if other.ndim() != 2 {
            return Err(Error::shape("mm", format!("mat2 must be a matrix, got {}-D tensor", other.ndim())));
        }
        if self.shape()[1] != other.shape()[0] {
            return Err(Error::shape(
                "mm",
                format!("mat1 and mat2 shapes cannot be multiplied ({} and {})", mat(self.shape()), mat(other.shape())),
            ));
        }
        check_same_dtype("mm", self, other)?;
        Tensor::apply1(Op::MatMul, &[self, other])
    }

    /// Strict batched matrix product (`torch.bmm`): `[b, n, m] @ [b, m, p] -> [b, n, p]`.
    pub fn bmm(&self, other: &Tensor) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::lowered(self, other)? {
            return a.bmm(&b);
        }
        if self.ndim() != 3 {
            return Err(Error::shape("bmm", "batch1 must be a 3D tensor"));
        }
        if other.ndim() != 3 {
            return Err(Error::shape("bmm", "batch2 must be a 3D tensor"));
        }
        let (b, k) = (self.shape()[0], self.shape()[2]);
        if other.shape()[0] != b || other.shape()[1] != k {
            return Err(Error::shape(
                "bmm",
                format!(
                    "Expected size for first two dimensions of batch2 tensor to be: [{b}, {k}] but got: [{}, {}].",
                    other.shape()[0],
                    other.shape()[1]
                ),
            ));
        }
        check_same_dtype("bmm", self, other)?;
        Tensor::apply1(Op::MatMul, &[self, other])
    }

    /// Dot product of two 1-D tensors of equal length and dtype (0-d result).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([1i64, 2, 3])?;
    /// assert_eq!(a.dot(&a)?.item::<i64>()?, 14);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn dot(&self, other: &Tensor) -> Result<Tensor> {
        if self.ndim() != 1 || other.ndim() != 1 {
            return Err(Error::shape(
                "dot",
                format!("1D tensors expected, but got {}D and {}D tensors", self.ndim(), other.ndim()),
            ));
        }
        if self.dtype() != other.dtype() {
            return Err(Error::dtype(
                "dot",
                format!("expected both vectors to have same dtype, but found {} and {}", self.dtype(), other.dtype()),
            ));
        }
        let (n, m) = (self.shape()[0], other.shape()[0]);
        if n != m {
            return Err(Error::shape(
                "dot",
                format!(
                    "inconsistent tensor size, expected tensor [{n}] and src [{m}] to have the same number of elements, but got {n} and {m} elements respectively"
                ),
            ));
        }
        self.matmul(other)
    }

    /// Outer product of two 1-D tensors: `out[i][j] = self[i] * other[j]`
    /// (dtypes promote like `mul`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([1.0f32, 2.0])?;
    /// let b = Tensor::new([1.0f32, 10.0, 100.0])?;
    /// assert_eq!(a.outer(&b)?.to_vec::<f32>()?, vec![1.0, 10.0, 100.0, 2.0, 20.0, 200.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn outer(&self, other: &Tensor) -> Result<Tensor> {
        if self.ndim() != 1 {
            return Err(Error::shape("outer", format!("Expected 1-D argument self, but got {}-D", self.ndim())));
        }
        if other.ndim() != 1 {
            return Err(Error::shape("outer", format!("Expected 1-D argument vec2, but got {}-D", other.ndim())));
        }
        self.unsqueeze(1)?.mul(other)
    }

    /// A matrix product of float8 operands with float32 scales, the role of
    /// PyTorch's `torch._scaled_mm`: `(self @ other) * (scale_a * scale_b)`,
    /// with `self [m, k]` and `other [k, n]` float8 (`float8_e4m3fn` or
    /// `float8_e5m2`, not both e5m2), products accumulated in float32 and the
    /// result rounded once to `out_dtype` (float32, bfloat16 or float16).
    /// Scales are float32 and either both tensor-wise (one element each) or
    /// row-wise (`scale_a [m, 1]`, `scale_b [1, n]`). On PJRT the conversions
    /// fuse into the product.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([[1.0f32, 2.0]])?.to_dtype(DType::F8E4M3FN)?;
    /// let b = Tensor::new([[3.0f32], [0.5]])?.to_dtype(DType::F8E4M3FN)?;
    /// let s = Tensor::new([2.0f32])?;
    /// let y = a.scaled_mm(&b, &s, &s, DType::F32)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![16.0]); // (3 + 1) * 2 * 2
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scaled_mm(&self, other: &Tensor, scale_a: &Tensor, scale_b: &Tensor, out_dtype: DType) -> Result<Tensor> {
        const OP: &str = "scaled_mm";
        for (what, t) in [("self", self), ("mat2", other)] {
            if !t.dtype().is_float8() {
                return Err(Error::dtype(OP, format!("expected {what} to be a float8 tensor, got {}", t.dtype())));
            }
            if t.ndim() != 2 {
                return Err(Error::shape(OP, format!("expected {what} to be 2-D, got {}-D", t.ndim())));
            }
        }
        if self.dtype() == DType::F8E5M2 && other.dtype() == DType::F8E5M2 {
            return Err(Error::dtype(OP, "multiplication of two float8_e5m2 matrices is not supported"));
        }
        let (m, k, n) = (self.shape()[0], self.shape()[1], other.shape()[1]);
        if other.shape()[0] != k {
            return Err(Error::shape(
                OP,
                format!("mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {}x{n})", other.shape()[0]),
            ));
        }
        if !matches!(out_dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::dtype(OP, format!("out_dtype must be float32, bfloat16 or float16, got {out_dtype}")));
        }
        for (what, s) in [("scale_a", scale_a), ("scale_b", scale_b)] {
            if s.dtype() != DType::F32 {
                return Err(Error::dtype(OP, format!("expected {what} to be float32, got {}", s.dtype())));
            }
        }
        let tensorwise = scale_a.numel() == 1 && scale_b.numel() == 1;
        let rowwise = scale_a.shape() == [m, 1] && scale_b.shape() == [1, n];
        if !tensorwise && !rowwise {
            return Err(Error::shape(
                OP,
                format!(
                    "scales must be tensor-wise (one element each) or row-wise ([{m}, 1] and [1, {n}]), got {:?} and {:?}",
                    scale_a.shape(),
                    scale_b.shape()
                ),
            ));
        }
        let (sa, sb) = if tensorwise {
            (scale_a.reshape(&[1, 1])?, scale_b.reshape(&[1, 1])?)
        } else {
            (scale_a.clone(), scale_b.clone())
        };
        let acc = self.to_dtype(DType::F32)?.matmul(&other.to_dtype(DType::F32)?)?;
        acc.mul(&sa.mul(&sb)?)?.to_dtype(out_dtype)
    }

    /// `torch.nn.functional.linear`: `self @ weight.T + bias`, with `weight` of
    /// shape `[out_features, in_features]` (or 1-D) and `bias` broadcast over the
    /// last dim.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0]])?;                  // [1, 2]
    /// let w = Tensor::new([[1.0f32, 0.0], [1.0, 1.0], [0.0, 2.0]])?; // [3, 2]
    /// let b = Tensor::new([0.5f32, 0.5, 0.5])?;
    /// assert_eq!(x.linear(&w, Some(&b))?.to_vec::<f32>()?, vec![1.5, 3.5, 4.5]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.ndim() > 2 || weight.ndim() == 0 {
            return Err(Error::shape(
                "linear",
                format!("weight must be 1-D or 2-D, got shape {}", fmt_shape(weight.shape())),
            ));
        }
        let y = self.matmul(&weight.t()?)?;
        match bias {
            // Under autocast the bias joins the product's dtype (Note [Autocast]).
            Some(b) if crate::autocast::autocast_dtype().is_some() => y.add(&crate::autocast::lower(b)?),
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}
