//! Custom ops: primitives defined outside kiln, through the [`CustomOp`]
//! trait, applied with [`Tensor::apply_custom`] (Note [Custom ops]).
use crate::graph::{is_grad_enabled, CustomBackward, GradModeGuard};
use crate::{DType, Error, HostBuffer, HostElement, Layout, Meta, Op, Result, Tensor};
use std::borrow::Cow;
use std::fmt::Write;
use std::sync::Arc;

// Note [Custom ops]
// ~~~~~~~~~~~~~~~~~
// kiln's primitives are a closed enum, so an op kiln lacks (a fused norm, an
// attention variant, a quantized product of one's own) is written as a value
// implementing `CustomOp`, which holds the four homes of a primitive in one
// place: `infer` (output shapes and dtypes from the inputs'), `cpu` (the CPU
// kernel, on the inputs' storages and layouts), `stablehlo` (the PJRT
// lowering: the body of a StableHLO function, or a `stablehlo.custom_call` to
// a kernel the plugin provides) and `backward` (the gradient, made of tensor
// ops, custom ops included; the default is a clear error).
//
// `Op::Custom` carries the op through the IR like any primitive: `Op::infer`
// asks it (and checks that it gives at least one output), the CPU backend
// runs its kernel and checks each returned buffer against the inferred
// dtype and length, and the lowering emits a `Lowering::Function` as a
// private function of the module, named after the op and a hash of its text
// (so equal programs keep equal text, which the compile cache and
// `kiln::compile`'s replay rest on), called with `func.call`. The op so fuses
// into DeferAndFuse's graphs, is traced by `kiln::compile`, runs inside local
// regions, and shows under its name in profiles and errors. On a distributed
// tensor the inputs are gathered whole and the outputs are replicated: the
// function always sees whole tensors, as on one device.
//
// `Tensor::apply_custom` runs the op with grad mode off and records one
// autograd node that keeps the outputs (detached, with their versions), so the
// gradient reads them instead of recomputing the forward; an output written
// in place before backward is an error, as for PyTorch's saved tensors. The
// gradient is checked: one entry per input, each of its input's shape and
// dtype. Under
// `create_graph` the gradient's own ops are recorded, so it differentiates
// again when it is made of differentiable ops. Applied through
// `Tensor::apply` instead, the op's rule recomputes the outputs first.

/// An op defined outside kiln: its typing, CPU kernel, StableHLO lowering and
/// gradient, in one place (Note [Custom ops]). Apply it with
/// [`Tensor::apply_custom`].
pub trait CustomOp: Send + Sync {
    /// The op's name in errors, profiles and the lowered program.
    fn name(&self) -> &'static str;

    /// The outputs' shapes and dtypes for inputs of the given shapes and
    /// dtypes, or an error saying what is wrong with them (it is the error
    /// the user sees, raised before anything runs).
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>>;

    /// The CPU kernel: one buffer per output, of the inferred dtype and
    /// length, row-major. Inputs come as their storages and layouts (strided);
    /// [`HostInput::contiguous`] gives row-major values.
    fn cpu(&self, inputs: &[HostInput<'_>], outputs: &[Meta]) -> Result<Vec<HostBuffer>>;

    /// The op on PJRT devices. The default has none: the op then runs on the
    /// CPU only, and a PJRT device refuses it with an error naming it.
    fn stablehlo(&self, inputs: &[Meta], outputs: &[Meta]) -> Result<Lowering> {
        let _ = (inputs, outputs);
        Err(Error::device(self.name(), "this custom op defines no StableHLO lowering (CustomOp::stablehlo)"))
    }

    /// The gradients of the inputs (one entry per input, `None` for no
    /// gradient) given the inputs, the forward's outputs and the gradients of
    /// the outputs (`None` where an output got none), built from tensor ops.
    /// The default refuses: backward through the op is an error naming it.
    fn backward(&self, inputs: &[Tensor], outputs: &[Tensor], grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let _ = (inputs, outputs, grads);
        Err(Error::invalid(self.name(), "this custom op defines no gradient (CustomOp::backward)"))
    }
}

/// How a custom op runs on a PJRT device.
#[derive(Debug, Clone, PartialEq)]
pub enum Lowering {
    /// The body of a StableHLO function (MLIR text, generic or pretty form).
    /// Its arguments are `%arg0`, `%arg1`, ..., of the inputs' types as
    /// [`mlir_type`] writes them; it ends by returning the outputs
    /// (`return %y, %z : tensor<..>, tensor<..>` or `"func.return"(..)`).
    Function(String),
    /// A `stablehlo.custom_call` to `target`, a kernel the PJRT plugin
    /// provides (a hand-written device kernel registered with XLA), on the
    /// inputs, returning the outputs.
    CustomCall {
        /// The call target's registered name.
        target: String,
        /// The `api_version` of the call (4 for XLA's typed FFI).
        api_version: u32,
        /// The `backend_config` attribute as MLIR text (a string literal
        /// `"..."` for the older APIs, a dictionary `{...}` for the typed
        /// FFI), or empty for none.
        backend_config: String,
    },
}

/// A read-only input of a custom op's CPU kernel: the storage's buffer and
/// the layout through which the op reads it.
#[derive(Clone, Copy)]
pub struct HostInput<'a> {
    /// The whole storage.
    pub buf: &'a HostBuffer,
    /// Shape, strides (in elements) and offset of the input in `buf`.
    pub layout: &'a Layout,
}

impl<'a> HostInput<'a> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }
    /// The input's shape.
    pub fn shape(&self) -> &'a [usize] {
        self.layout.shape()
    }
    /// The typed storage (the whole buffer; index it through `layout`).
    pub fn slice<T: HostElement>(&self) -> Result<&'a [T]> {
        T::slice(self.buf)
            .ok_or_else(|| Error::backend("cpu", format!("expected a {} buffer, got {}", T::DTYPE, self.buf.dtype())))
    }
    /// The input's values in row-major order: borrowed when its layout is
    /// contiguous, gathered through its strides otherwise.
    pub fn contiguous<T: HostElement>(&self) -> Result<Cow<'a, [T]>> {
        let data = self.slice::<T>()?;
        let l = self.layout;
        self.layout.check_bounds("custom op input", data.len())?;
        let n = l.numel();
        if l.is_contiguous() {
            return Ok(Cow::Borrowed(&data[l.offset()..l.offset() + n]));
        }
        let mut out = Vec::with_capacity(n);
        let mut idx = vec![0usize; l.ndim()];
        for _ in 0..n {
            out.push(data[l.index_of(&idx)]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < l.shape()[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(Cow::Owned(out))
    }
}

/// `tensor<2x3xf32>`: the MLIR type of a tensor, as kiln's lowering writes it.
pub fn mlir_type(shape: &[usize], dtype: DType) -> String {
    let mut s = String::from("tensor<");
    for d in shape {
        let _ = write!(s, "{d}x");
    }
    s.push_str(dtype.mlir_name());
    s.push('>');
    s
}

/// A custom op in the IR (`Op::Custom`): compared by identity.
#[derive(Clone)]
pub struct CustomOpRef(pub Arc<dyn CustomOp>);

impl std::ops::Deref for CustomOpRef {
    type Target = dyn CustomOp;
    fn deref(&self) -> &(dyn CustomOp + 'static) {
        &*self.0
    }
}

impl std::fmt::Debug for CustomOpRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Custom({})", self.0.name())
    }
}

impl PartialEq for CustomOpRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl CustomOpRef {
    /// What identifies the op's computation on inputs `ins` giving `outs`
    /// beyond its name: its StableHLO lowering, when it has one (two
    /// instances made with the same attributes lower alike, as the lowered
    /// program's function names rely on). `None` for a CPU-only op, which is
    /// then known by its instance alone.
    pub fn identity(&self, ins: &[Meta], outs: &[Meta]) -> Option<String> {
        self.0.stablehlo(ins, outs).ok().map(|l| format!("{l:?}"))
    }

    /// The op's outputs for `inputs`, checked: at least one.
    pub(crate) fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        let outs = self.0.infer(inputs)?;
        if outs.is_empty() {
            return Err(Error::invalid(self.name(), "a custom op must infer at least one output"));
        }
        Ok(outs)
    }

    /// `backward`, checked: one gradient per input, each of its input's shape
    /// and dtype, kept only for inputs that need one.
    pub fn gradients(
        &self,
        inputs: &[Tensor],
        outputs: &[Tensor],
        grads: &[Option<Tensor>],
        needed: &[bool],
    ) -> Result<Vec<Option<Tensor>>> {
        let name = self.name();
        let got = self.0.backward(inputs, outputs, grads)?;
        if got.len() != inputs.len() {
            return Err(Error::invalid(
                name,
                format!("backward returned {} gradients for {} inputs", got.len(), inputs.len()),
            ));
        }
        got.into_iter()
            .zip(inputs)
            .zip(needed)
            .enumerate()
            .map(|(i, ((g, x), &need))| match g {
                Some(g) if g.shape() != x.shape() => Err(Error::shape(
                    name,
                    format!(
                        "backward gave input {i} a gradient of shape {:?}, its shape is {:?}",
                        g.shape(),
                        x.shape()
                    ),
                )),
                Some(g) if g.dtype() != x.dtype() => Err(Error::dtype(
                    name,
                    format!("backward gave input {i} a gradient of dtype {}, its dtype is {}", g.dtype(), x.dtype()),
                )),
                g => Ok(g.filter(|_| need)),
            })
            .collect()
    }
}

impl Tensor {
    /// Applies a custom op to `inputs` (all on one device), returning its
    /// outputs; records one autograd node when grad mode is on and an input
    /// requires grad (Note [Custom ops]).
    pub fn apply_custom(op: &Arc<dyn CustomOp>, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let op = CustomOpRef(op.clone());
        let name = op.name();
        let outs: Vec<Tensor> = {
            let _off = GradModeGuard::set(false);
            Tensor::apply(Op::Custom(op.clone()), inputs)?.into_vec()
        };
        if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
            return Ok(outs);
        }
        let saved: Vec<(Tensor, u64)> = outs.iter().map(|t| (t.detach(), t.version())).collect();
        let backward: CustomBackward = Arc::new(move |grads, edges| {
            let inputs =
                edges.iter().enumerate().map(|(i, e)| e.saved(name, i).cloned()).collect::<Result<Vec<_>>>()?;
            let mut outputs = Vec::with_capacity(saved.len());
            for (i, (t, version)) in saved.iter().enumerate() {
                if t.version() != *version {
                    return Err(Error::invalid(
                        name,
                        format!("output {i} of this custom op, needed for its gradient, was modified by an in-place operation"),
                    ));
                }
                outputs.push(t.clone());
            }
            let needed: Vec<bool> = edges.iter().map(|e| e.requires_grad).collect();
            op.gradients(&inputs, &outputs, grads, &needed)
        });
        Tensor::record_custom(name, inputs, &outs.iter().collect::<Vec<_>>(), backward);
        Ok(outs)
    }
}
