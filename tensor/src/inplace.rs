//! In-place ops (names ending in `_`). Every one is "compute out of place, then
//! `copy_` into `self`": `copy_` is the single in-place primitive (a backend's
//! `assign`), it writes through views into the base's storage and bumps the
//! storage's version counter.
use crate::elementwise::{result_type, Operand};
use crate::error::fmt_shape;
use crate::graph::{Edge, Node, Origin};
use crate::{is_grad_enabled, DType, Error, Op, Result, Scalar, Tensor};

// Note [In-place on views]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A view aliases its base, so `base.narrow(0, 1, 2).add_(&y)` changes `base`,
// and autograd must see that change. kiln records every in-place write
// functionally, on the base: `copy_` (the one in-place primitive; `add_` and
// friends compute out of place, then `copy_`) gives the *base* a new origin,
// `Op::Assign { layout }` with inputs (old base, value written), whose gradient
// sends the base's gradient to the old base with the written region zeroed and
// the region itself to the value. Views then re-derive their origin from the
// base (PyTorch's view replay): each view remembers the base's version when its
// origin was derived, and when the version moved (someone wrote into the
// storage), `Tensor::origin` rebuilds the view's origin as an `as_strided` of
// the base's current origin. The written view itself is replayed the same way.
//
// Reads of data that a gradient rule saved are protected separately: each edge
// remembers the storage version when the op ran, and backward refuses to use a
// value whose version moved, naming the op (PyTorch's "modified by an inplace
// operation" error). In-place writes on a leaf that requires grad, or on a view
// of one, are refused outside `no_grad`.

/// PyTorch's `canCast`: no float -> int, no non-bool -> bool.
fn can_cast(from: DType, to: DType) -> bool {
    (!from.is_float() || to.is_float()) && (from.is_bool() || !to.is_bool())
}

impl Tensor {
    /// Checks shared by every in-place op on `self`.
    fn check_writable(&self, op: &'static str) -> Result<()> {
        if self.layout().has_internal_overlap() {
            return Err(Error::inplace(
                op,
                "unsupported operation: more than one element of the written-to tensor refers to a single memory location. Please clone() the tensor before performing the operation.",
            ));
        }
        if is_grad_enabled() && self.requires_grad() && self.is_leaf() {
            return Err(Error::inplace(
                op,
                "a leaf Variable that requires grad is being used in an in-place operation.",
            ));
        }
        if let Some(b) = self.base() {
            if is_grad_enabled() && b.requires_grad() && b.is_leaf() {
                return Err(Error::inplace(
                    op,
                    "a view of a leaf Variable that requires grad is being used in an in-place operation.",
                ));
            }
        }
        Ok(())
    }

    /// Copies `src` into `self` (broadcasting `src`, converting its dtype and
    /// device), writing through to the storage `self` views.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[2, 3], DType::F32)?;
    /// x.select(0, 1)?.copy_(&Tensor::new([1.0f32, 2.0, 3.0])?)?;
    /// assert_eq!(x.to_vec::<f32>()?, vec![0.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn copy_(&self, src: &Tensor) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable("copy_")?;
        let producer = src.origin();
        let src = src.to_device(self.device())?.to_dtype(self.dtype())?;
        let src = src.broadcast_to(self.shape()).map_err(|_| {
            Error::shape(
                "copy_",
                format!(
                    "the source of shape {} cannot be broadcast to the destination of shape {}",
                    fmt_shape(src.shape()),
                    fmt_shape(self.shape())
                ),
            )
        })?;
        let record = is_grad_enabled() && (src.requires_grad() || self.requires_grad());
        let node = if record { Some(self.assign_node(&src)?) } else { None };
        if record {
            if let Some(o) = producer {
                o.node.snapshot_inputs_aliasing(self.storage())?;
            }
        }
        if !crate::capture::record::assign(self, &src)? && !crate::defer::assign(self, &src)? {
            crate::profile::timed(
                "copy_",
                || format!("{} <- {}", fmt_shape(self.shape()), fmt_shape(src.shape())),
                || self.backend().synchronize(self.device()),
                || self.backend().assign(self, &src),
            )?;
        }
        self.storage().bump_version();
        if let Some(node) = node {
            // See Note [In-place on views]: the base gets the functional write as its
            // origin; views (this one included) replay theirs from it on next use.
            let base = self.base().unwrap_or(self);
            base.set_origin(Some(Origin { node, output: 0 }));
        }
        Ok(self)
    }

    /// The `Op::Assign` node recording a write of `src` into `self`, captured before the write.
    fn assign_node(&self, src: &Tensor) -> Result<std::sync::Arc<Node>> {
        let base = self.base().unwrap_or(self);
        if !base.is_contiguous() || base.storage_offset() != 0 {
            return Err(Error::inplace(
                "copy_",
                "an in-place write that autograd records needs a contiguous base tensor; call .contiguous() first",
            ));
        }
        let l = self.layout();
        let op = Op::Assign { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() };
        let outputs = op.infer(&[base.meta(), src.meta()])?;
        Ok(Node::new(op, smallvec::smallvec![Edge::of(base), Edge::of(src)], outputs))
    }

    /// Writes `result` (the out-of-place value of an op on `self`) back into `self`,
    /// refusing results of another shape or of a dtype `self` cannot hold.
    fn write_back(&self, op: &'static str, result: &Tensor) -> Result<&Tensor> {
        if result.shape() != self.shape() {
            return Err(Error::shape(
                op,
                format!(
                    "output with shape {} doesn't match the broadcast shape {}",
                    fmt_shape(self.shape()),
                    fmt_shape(result.shape())
                ),
            ));
        }
        if !can_cast(result.dtype(), self.dtype()) {
            return Err(Error::dtype(
                op,
                format!(
                    "result type {} can't be cast to the desired output type {}",
                    result.dtype().scalar_type_name(),
                    self.dtype().scalar_type_name()
                ),
            ));
        }
        self.copy_(result)
    }

    fn inplace_binary(
        &self,
        op: &'static str,
        other: Operand<'_>,
        f: impl Fn(&Tensor, Operand<'_>) -> Result<Tensor>,
    ) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable(op)?;
        let rt = result_type(&[Operand::Tensor(self), other]);
        if !can_cast(rt, self.dtype()) {
            return Err(Error::dtype(
                op,
                format!(
                    "result type {} can't be cast to the desired output type {}",
                    rt.scalar_type_name(),
                    self.dtype().scalar_type_name()
                ),
            ));
        }
        let r = f(self, other)?;
        self.write_back(op, &r)
    }

    /// `self += other`, in place.
    pub fn add_<'o>(&self, other: impl Into<Operand<'o>>) -> Result<&Tensor> {
        self.inplace_binary("add_", other.into(), |a, b| a.add(b))
    }
    pub fn sub_<'o>(&self, other: impl Into<Operand<'o>>) -> Result<&Tensor> {
        self.inplace_binary("sub_", other.into(), |a, b| a.sub(b))
    }
    pub fn mul_<'o>(&self, other: impl Into<Operand<'o>>) -> Result<&Tensor> {
        self.inplace_binary("mul_", other.into(), |a, b| a.mul(b))
    }
    /// True division in place (an integer `self` is refused, like PyTorch).
    pub fn div_<'o>(&self, other: impl Into<Operand<'o>>) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let o = other.into();
        self.check_writable("div_")?;
        let r = self.div(o)?;
        self.write_back("div_", &r)
    }
    pub fn pow_<'o>(&self, exponent: impl Into<Operand<'o>>) -> Result<&Tensor> {
        self.inplace_binary("pow_", exponent.into(), |a, b| a.pow(b))
    }
    /// Fills with one value.
    pub fn fill_(&self, value: impl Into<Scalar>) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable("fill_")?;
        let v = Tensor::full(&[], value.into(), (self.dtype(), self.device()))?;
        self.copy_(&v)
    }
    pub fn zero_(&self) -> Result<&Tensor> {
        self.fill_(0)
    }
    pub fn clamp_(&self, min: Option<f64>, max: Option<f64>) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable("clamp_")?;
        let r = self.clamp(min, max)?;
        self.write_back("clamp_", &r)
    }
    /// Writes `value` where `mask` (bool, broadcastable to `self`) is true.
    pub fn masked_fill_(&self, mask: &Tensor, value: impl Into<Scalar>) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable("masked_fill_")?;
        let r = self.masked_fill(mask, value)?;
        self.write_back("masked_fill_", &r)
    }
    /// Out-of-place `masked_fill`: `value` where `mask`, else `self`.
    pub fn masked_fill(&self, mask: &Tensor, value: impl Into<Scalar>) -> Result<Tensor> {
        if mask.dtype() != DType::Bool {
            return Err(Error::dtype(
                "masked_fill",
                format!("expected mask dtype to be bool but got {}", mask.dtype()),
            ));
        }
        let fits =
            crate::broadcast_shapes("masked_fill", mask.shape(), self.shape()).map(|s| s.as_slice() == self.shape());
        if !matches!(fits, Ok(true)) {
            return Err(Error::shape(
                "masked_fill",
                format!(
                    "the mask of shape {} must be broadcastable to the tensor of shape {}",
                    fmt_shape(mask.shape()),
                    fmt_shape(self.shape())
                ),
            ));
        }
        let v = Tensor::full(&[], value.into(), (self.dtype(), self.device()))?;
        Tensor::where_cond(mask, &v, self)
    }
    pub fn neg_(&self) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        self.check_writable("neg_")?;
        let r = self.neg()?;
        self.write_back("neg_", &r)
    }
}

#[cfg(test)]
mod tests {
    use super::can_cast;
    use crate::DType;
    #[test]
    fn casting_rules() {
        assert!(!can_cast(DType::F32, DType::I64));
        assert!(can_cast(DType::I64, DType::F32));
        assert!(!can_cast(DType::I64, DType::Bool));
        assert!(can_cast(DType::Bool, DType::U8));
    }
}
