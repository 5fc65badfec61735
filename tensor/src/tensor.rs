//! The `Tensor` handle: storage + layout + autograd metadata, and `apply`, the
//! single path through which every primitive op runs.
use crate::graph::{next_id, CustomBackward, Edge, Hook, Node, NodeKind, Origin};
use crate::{is_grad_enabled, Backend, DType, Device, Error, Layout, Meta, Op, Result, Storage, ViewOp};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

struct Inner {
    storage: Arc<Storage>,
    layout: Layout,
    backend: &'static dyn Backend,
    requires_grad: AtomicBool,
    /// Set when this tensor is a view: the tensor it views (its own base when chained).
    base: Option<Tensor>,
    origin: Mutex<Option<Origin>>,
    /// For views: the base's version when `origin` was derived (see Note [In-place on views]).
    view_version: AtomicU64,
    grad: Mutex<Option<Tensor>>,
    /// Gradient hooks of a leaf (a non-leaf's hooks live on its node).
    hooks: Mutex<Vec<Hook>>,
    id: u64,
}

/// An n-dimensional array with a runtime dtype and device, like `torch.Tensor`.
///
/// Cloning a `Tensor` is cheap (an `Arc`): the clone is the *same* tensor, as
/// when Python binds a second name to it. Use [`Tensor::deep_clone`] (PyTorch's
/// `clone()`) for a copy of the data.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
/// x.narrow(1, 0, 2)?.add_(10.0)?; // writes through the view into `x`
/// assert_eq!(x.to_vec::<f32>()?, vec![10.0, 11.0, 2.0, 13.0, 14.0, 5.0]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}, id={})",
            self.shape(),
            self.dtype(),
            self.device(),
            self.id()
        )
    }
}

impl Tensor {
    /// Wraps a storage and a layout into a tensor (a new base, not a view).
    /// The layout is checked against the storage size.
    pub fn from_storage(storage: Arc<Storage>, layout: Layout) -> Result<Tensor> {
        layout.check_bounds("from_storage", storage.len())?;
        let backend = storage.device().backend()?;
        Ok(Tensor::make(storage, layout, backend, None))
    }

    fn make(storage: Arc<Storage>, layout: Layout, backend: &'static dyn Backend, base: Option<Tensor>) -> Tensor {
        Tensor(Arc::new(Inner {
            storage,
            layout,
            backend,
            requires_grad: AtomicBool::new(false),
            base,
            origin: Mutex::new(None),
            view_version: AtomicU64::new(0),
            grad: Mutex::new(None),
            hooks: Mutex::new(vec![]),
            id: next_id(),
        }))
    }

    // ---- accessors ---------------------------------------------------------

    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }
    /// PyTorch's `size()`: same as [`Tensor::shape`].
    pub fn size(&self) -> &[usize] {
        self.shape()
    }
    /// Size of one dim (negative dims count from the end).
    pub fn dim_size(&self, dim: isize) -> Result<usize> {
        Ok(self.shape()[crate::wrap_dim("size", dim, self.ndim())?])
    }
    pub fn strides(&self) -> &[usize] {
        self.0.layout.strides()
    }
    /// Offset of the first element in the storage, in elements.
    pub fn storage_offset(&self) -> usize {
        self.0.layout.offset()
    }
    pub fn ndim(&self) -> usize {
        self.0.layout.ndim()
    }
    /// PyTorch's `dim()`.
    pub fn dim(&self) -> usize {
        self.ndim()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }
    pub fn backend(&self) -> &'static dyn Backend {
        self.0.backend
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// True when this tensor reads the whole of its storage, in order: contiguous,
    /// from offset 0, every element.
    pub fn is_whole_storage(&self) -> bool {
        let l = &self.0.layout;
        l.is_contiguous() && l.offset() == 0 && l.numel() == self.0.storage.len()
    }
    /// True when this tensor was made by a view op of another tensor.
    pub fn is_view(&self) -> bool {
        self.0.base.is_some()
    }
    /// The tensor this one is a view of (`._base` in PyTorch).
    pub fn base(&self) -> Option<&Tensor> {
        self.0.base.as_ref()
    }
    /// The version counter of the storage (bumped by every in-place write).
    pub fn version(&self) -> u64 {
        self.0.storage.version()
    }
    /// A process-unique id of this tensor handle.
    pub fn id(&self) -> u64 {
        self.0.id
    }
    /// True when both handles are the same tensor.
    pub fn same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
    /// True when both tensors view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    // ---- autograd metadata (the rules and the engine live in kiln-autograd) ----

    /// Whether gradients flow to this tensor (a leaf marked with `requires_grad_`,
    /// or a tensor computed from one while grad mode was on).
    pub fn requires_grad(&self) -> bool {
        if self.0.requires_grad.load(Ordering::Relaxed) {
            return true;
        }
        match &self.0.base {
            Some(b) if b.requires_grad() => self.origin().is_some(),
            _ => false,
        }
    }
    /// Marks a tensor as requiring grad (only floating tensors can).
    pub fn requires_grad_(&self, on: bool) -> Result<&Tensor> {
        if on && !self.dtype().is_float() {
            return Err(Error::dtype(
                "requires_grad_",
                format!("only tensors of floating point dtype can require gradients, got {}", self.dtype()),
            ));
        }
        if !on && !self.is_leaf() {
            return Err(Error::invalid(
                "requires_grad_",
                "you can only change requires_grad flags of leaf variables; use detach() to get a tensor that does not require grad",
            ));
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }
    /// A leaf has no recorded origin (user-created, or made while grad mode was off).
    pub fn is_leaf(&self) -> bool {
        self.origin().is_none()
    }
    /// The recorded origin (`grad_fn`). For a view whose base was modified in
    /// place since the view's origin was derived, the origin is re-derived from
    /// the base's current one (see Note [In-place on views]).
    pub fn origin(&self) -> Option<Origin> {
        if let Some(base) = &self.0.base {
            if base.requires_grad() && self.0.view_version.load(Ordering::Acquire) != base.version() {
                let replayed = self.replay_view_origin(base);
                *self.lock_origin() = replayed.clone();
                return replayed;
            }
        }
        self.lock_origin().clone()
    }

    /// This view's origin as an `as_strided` of its base's current origin.
    fn replay_view_origin(&self, base: &Tensor) -> Option<Origin> {
        self.0.view_version.store(base.version(), Ordering::Release);
        let base_origin = base.origin();
        if base_origin.is_none() && !base.requires_grad() {
            return None;
        }
        self.0.requires_grad.store(true, Ordering::Relaxed);
        let l = self.layout();
        let op =
            Op::View(ViewOp::AsStrided { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() });
        let node = Node::new(op, smallvec::smallvec![Edge::of(base)], smallvec::smallvec![self.meta()]);
        Some(Origin { node, output: 0 })
    }

    /// Records `outputs` as computed from `inputs` by a composite with its own
    /// gradient rule (when grad mode is on and an input requires grad). The
    /// outputs must have been computed without recording (e.g. under grad mode off).
    pub fn record_custom(name: &'static str, inputs: &[&Tensor], outputs: &[&Tensor], backward: CustomBackward) {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
            return;
        }
        let node = Node::with_kind(
            NodeKind::Custom { name, backward },
            inputs.iter().map(|t| Edge::of(t)).collect(),
            outputs.iter().map(|t| t.meta()).collect(),
        );
        for (i, t) in outputs.iter().enumerate() {
            if t.dtype().is_float() {
                t.set_origin(Some(Origin { node: node.clone(), output: i }));
            }
        }
    }

    /// Records that this view's origin is current with respect to its base.
    pub fn mark_view_current(&self) {
        if let Some(base) = &self.0.base {
            self.0.view_version.store(base.version(), Ordering::Release);
        }
    }

    /// Shape and dtype.
    pub fn meta(&self) -> Meta {
        Meta { shape: self.shape().into(), dtype: self.dtype() }
    }

    /// Registers a hook called with the gradient of this tensor during backward;
    /// it may return a replacement gradient. Errors on tensors that don't require grad.
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> Result<()> {
        if !self.requires_grad() {
            return Err(Error::invalid(
                "register_hook",
                "cannot register a hook on a tensor that doesn't require gradient",
            ));
        }
        let hook: Hook = Arc::new(hook);
        match self.origin() {
            Some(o) => o.node.add_hook(o.output, hook),
            None => self.0.hooks.lock().unwrap_or_else(|e| e.into_inner()).push(hook),
        }
        Ok(())
    }

    /// The hooks registered on this leaf.
    pub fn leaf_hooks(&self) -> Vec<Hook> {
        self.0.hooks.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Replaces the recorded origin (used by autograd for in-place ops on non-leaves).
    pub fn set_origin(&self, origin: Option<Origin>) {
        let rg = origin.is_some();
        *self.lock_origin() = origin;
        if rg {
            self.0.requires_grad.store(true, Ordering::Relaxed);
        }
    }
    fn lock_origin(&self) -> MutexGuard<'_, Option<Origin>> {
        self.0.origin.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// The accumulated gradient (`.grad` in PyTorch).
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    /// Replaces `.grad` by `f(current)` as one step: other threads' reads and
    /// updates of this tensor's `.grad` wait until `f` is done, so concurrent
    /// backward passes accumulating into a shared parameter lose nothing
    /// (PyTorch's `AccumulateGrad` lock). `f` must not touch this tensor's `.grad`.
    pub fn update_grad(&self, f: impl FnOnce(Option<Tensor>) -> Result<Tensor>) -> Result<()> {
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        *slot = Some(f(slot.clone())?);
        Ok(())
    }
    /// A tensor sharing the data but cut from the autograd graph.
    pub fn detach(&self) -> Tensor {
        Tensor::make(self.0.storage.clone(), self.0.layout.clone(), self.0.backend, None)
    }

    // ---- the op path ---------------------------------------------------------

    /// Runs a primitive op through the backend of the inputs' device, after
    /// checking devices and inferring output shapes and dtypes, and records the
    /// origin for autograd when needed. Every op in kiln ends up here.
    pub fn apply(op: Op, inputs: &[&Tensor]) -> Result<SmallVec<[Tensor; 2]>> {
        let device = match inputs.first() {
            Some(t) => t.device(),
            None => {
                return Err(Error::invalid(op.name(), "apply needs at least one input; use apply_on for creation ops"))
            }
        };
        Tensor::apply_on(op, inputs, device)
    }

    /// [`Tensor::apply`] for ops that may have no inputs (creation ops).
    pub fn apply_on(op: Op, inputs: &[&Tensor], device: Device) -> Result<SmallVec<[Tensor; 2]>> {
        for t in inputs {
            if t.device() != device {
                return Err(Error::device_mismatch(op.name(), device, t.device()));
            }
        }
        if let Op::View(v) = &op {
            return Ok(smallvec::smallvec![inputs[0].view_op(v.clone())?]);
        }
        let metas: SmallVec<[Meta; 3]> =
            inputs.iter().map(|t| Meta { shape: t.shape().into(), dtype: t.dtype() }).collect();
        let outs = op.infer(&metas)?;
        let backend = match inputs.first() {
            Some(t) => t.backend(),
            None => device.backend()?,
        };
        let shapes = || crate::profile::shapes_of(inputs);
        let recorded = crate::capture::record::op(&op, inputs, &outs, device)
            .or_else(|| crate::defer::op(&op, inputs, &metas, &outs, device, backend));
        let storages = match recorded {
            Some(recorded) => recorded?.into_iter().collect(),
            None => crate::profile::timed(
                op.name(),
                shapes,
                || backend.synchronize(device),
                || backend.exec(&op, inputs, &outs, device),
            )?,
        };
        debug_assert_eq!(storages.len(), outs.len());
        let record = is_grad_enabled() && inputs.iter().any(|t| t.requires_grad());
        let mut result: SmallVec<[Tensor; 2]> = storages
            .into_iter()
            .zip(outs.iter())
            .map(|(s, m)| Tensor::make(s, Layout::contiguous(&m.shape), backend, None))
            .collect();
        if record {
            let node = Node::new(op, inputs.iter().map(|t| Edge::of(t)).collect(), outs.into_iter().collect());
            for (i, t) in result.iter_mut().enumerate() {
                if t.dtype().is_float() {
                    t.set_origin(Some(Origin { node: node.clone(), output: i }));
                }
            }
        }
        Ok(result)
    }

    /// Runs a single-output primitive.
    pub fn apply1(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
        Ok(Tensor::apply(op, inputs)?.swap_remove(0))
    }

    /// Applies a view op: a new tensor over the same storage, recorded like any op.
    pub fn view_op(&self, v: ViewOp) -> Result<Tensor> {
        self.view_op_impl(v, true)
    }

    /// PyTorch's `_unsafe_view`: a view op whose result is a new base over the
    /// same storage rather than a view of `self`. Only for a fresh, internal
    /// `self` that no user can reach (an op's temporary), so the aliasing is not
    /// observable (see Note [Results are not views]).
    pub(crate) fn view_op_as_base(&self, v: ViewOp) -> Result<Tensor> {
        debug_assert!(!self.is_view(), "view_op_as_base of a view");
        self.view_op_impl(v, false)
    }

    fn view_op_impl(&self, v: ViewOp, as_view: bool) -> Result<Tensor> {
        let layout = v.apply(&self.0.layout)?;
        layout.check_bounds(v.name(), self.0.storage.len())?;
        let base = as_view.then(|| self.0.base.clone().unwrap_or_else(|| self.clone()));
        let t = Tensor::make(self.0.storage.clone(), layout, self.0.backend, base);
        if is_grad_enabled() && self.requires_grad() {
            let node = Node::new(Op::View(v), smallvec::smallvec![Edge::of(self)], smallvec::smallvec![t.meta()]);
            t.set_origin(Some(Origin { node, output: 0 }));
        }
        t.mark_view_current();
        Ok(t)
    }
}

// SAFETY-free assertion that the handle can cross threads (see Note [Storage mutability]).
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tensor>();
};
