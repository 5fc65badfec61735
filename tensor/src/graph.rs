//! The recorded graph: `Node` (one primitive application), `Edge` (one input of
//! it, as seen when the op ran), `Origin` (which output of which node a tensor
//! is), grad mode, and gradient hooks. kiln-autograd walks this graph; this
//! crate only records it.
use crate::{Meta, Op, Result, Tensor};
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A gradient hook: receives the gradient flowing into a tensor and may replace it.
pub type Hook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

/// One input of a recorded op, captured when the op ran.
#[derive(Clone)]
pub struct Edge {
    /// The input's data: an alias sharing its storage (and so its version
    /// counter), cut from the graph so that nodes never form reference cycles.
    pub value: Tensor,
    /// The input's origin when the op ran (`None` for leaves and constants).
    pub origin: Option<Origin>,
    /// The input itself when it is a leaf that requires grad (gradients accumulate into its `.grad`).
    pub leaf: Option<Tensor>,
    /// Whether a gradient must flow to this input.
    pub requires_grad: bool,
    /// The storage version when the op ran; backward compares it to detect an
    /// input that was modified in place after being saved.
    pub version: u64,
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("value", &self.value)
            .field("origin", &self.origin.as_ref().map(|o| (o.node.id, o.output)))
            .field("leaf", &self.leaf.is_some())
            .field("requires_grad", &self.requires_grad)
            .field("version", &self.version)
            .finish()
    }
}

impl Edge {
    /// The edge of `t` as an input of an op being recorded now.
    pub fn of(t: &Tensor) -> Edge {
        let origin = t.origin();
        let requires_grad = t.requires_grad();
        Edge {
            value: t.detach(),
            leaf: if requires_grad && origin.is_none() { Some(t.clone()) } else { None },
            origin,
            requires_grad,
            version: t.version(),
        }
    }
}

impl Edge {
    /// The saved value, refusing one modified in place since the op ran (PyTorch's
    /// saved-tensor version check). `op` and `i` name the node and input in the error.
    pub fn saved(&self, op: &str, i: usize) -> Result<&Tensor> {
        let now = self.value.version();
        if now != self.version {
            return Err(crate::Error::inplace(
                "backward",
                format!(
                    "one of the variables needed for gradient computation has been modified by an inplace operation: [{} {:?}] is at version {now}; expected version {} instead (it is input {i} of {op})",
                    self.value.dtype(),
                    self.value.shape(),
                    self.version,
                ),
            ));
        }
        Ok(&self.value)
    }
}

/// A gradient rule given as a closure: gets the gradients of the node's outputs
/// (`None` where none flowed) and the input edges, returns one gradient per input.
pub type CustomBackward = Arc<dyn Fn(&[Option<Tensor>], &[Edge]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// What a node applies: a primitive, or a composite with its own gradient rule
/// (activation checkpointing, composites whose gradient through primitives is poor).
#[derive(Clone)]
pub enum NodeKind {
    Primitive(Op),
    Custom { name: &'static str, backward: CustomBackward },
}

impl std::fmt::Debug for NodeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeKind::Primitive(op) => write!(f, "{op:?}"),
            NodeKind::Custom { name, .. } => write!(f, "Custom({name})"),
        }
    }
}

/// The record of one op application: what autograd walks backwards.
/// Recorded only while grad mode is on and some input requires grad.
pub struct Node {
    /// What ran.
    pub kind: NodeKind,
    /// Its inputs (released by backward unless the graph is retained).
    inputs: Mutex<Option<SmallVec<[Edge; 3]>>>,
    /// Shapes and dtypes of all outputs (multi-output ops share one node).
    pub outputs: SmallVec<[Meta; 2]>,
    /// Creation order: a node's inputs always have smaller ids, so visiting
    /// nodes by decreasing id is a topological order.
    pub id: u64,
    /// Hooks on the gradients of this node's outputs (non-leaf tensors' hooks).
    hooks: Mutex<Vec<(usize, Hook)>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node(id={}, {:?})", self.id, self.kind)
    }
}

impl Node {
    pub fn new(op: Op, inputs: SmallVec<[Edge; 3]>, outputs: SmallVec<[Meta; 2]>) -> Arc<Node> {
        Node::with_kind(NodeKind::Primitive(op), inputs, outputs)
    }
    pub fn with_kind(kind: NodeKind, inputs: SmallVec<[Edge; 3]>, outputs: SmallVec<[Meta; 2]>) -> Arc<Node> {
        Arc::new(Node { kind, inputs: Mutex::new(Some(inputs)), outputs, id: next_id(), hooks: Mutex::new(vec![]) })
    }
    /// The primitive, for primitive nodes.
    pub fn op(&self) -> Option<&Op> {
        match &self.kind {
            NodeKind::Primitive(op) => Some(op),
            NodeKind::Custom { .. } => None,
        }
    }
    /// A short name for errors.
    pub fn name(&self) -> &'static str {
        match &self.kind {
            NodeKind::Primitive(op) => op.name(),
            NodeKind::Custom { name, .. } => name,
        }
    }
    /// The inputs, or `None` once backward released them.
    pub fn inputs(&self) -> MutexGuard<'_, Option<SmallVec<[Edge; 3]>>> {
        self.inputs.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Frees the saved inputs (after backward used them).
    pub fn release(&self) {
        let taken = self.inputs().take();
        drop_edges_iteratively(taken.into_iter().flatten());
    }
    /// Before an in-place write into `storage` replaces the values this node saved,
    /// keep a private copy of them (PyTorch saves `original_self` the same way), so
    /// `h.narrow(..).mul_(&w)` stays differentiable. Ops whose gradient never reads
    /// input values are skipped.
    pub fn snapshot_inputs_aliasing(&self, storage: &crate::Storage) -> Result<()> {
        if let NodeKind::Primitive(op) = &self.kind {
            use crate::BinaryOp::{Add, Sub};
            if matches!(op, Op::Binary(Add | Sub) | Op::Copy | Op::Cast(_) | Op::View(_) | Op::Assign { .. }) {
                return Ok(());
            }
        }
        let mut guard = self.inputs();
        for e in guard.iter_mut().flatten() {
            if std::ptr::eq(&**e.value.storage(), storage) && e.value.version() == e.version {
                let copy = {
                    let _off = GradModeGuard::set(false);
                    e.value.deep_clone()
                };
                e.value = copy?;
                e.version = e.value.version();
            }
        }
        Ok(())
    }

    pub fn add_hook(&self, output: usize, hook: Hook) {
        self.hooks.lock().unwrap_or_else(|e| e.into_inner()).push((output, hook));
    }
    pub fn hooks(&self, output: usize) -> Vec<Hook> {
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|h| h.0 == output)
            .map(|h| h.1.clone())
            .collect()
    }
}

/// Drops a chain of nodes without recursion, so that freeing a graph of
/// 100,000 chained ops cannot overflow the stack.
fn drop_edges_iteratively(edges: impl IntoIterator<Item = Edge>) {
    let mut stack: Vec<Arc<Node>> = edges.into_iter().filter_map(|e| e.origin.map(|o| o.node)).collect();
    while let Some(n) = stack.pop() {
        if let Ok(node) = Arc::try_unwrap(n) {
            let taken = node.inputs.lock().unwrap_or_else(|e| e.into_inner()).take();
            stack.extend(taken.into_iter().flatten().filter_map(|e| e.origin.map(|o| o.node)));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let taken = self.inputs.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        drop_edges_iteratively(taken.into_iter().flatten());
    }
}

/// Which output of a node a tensor is (PyTorch's `grad_fn` + output number).
#[derive(Debug, Clone)]
pub struct Origin {
    pub node: Arc<Node>,
    pub output: usize,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops record their origin for autograd on this thread (PyTorch's grad mode).
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Sets grad mode on this thread and returns the previous value.
pub fn set_grad_enabled(on: bool) -> bool {
    GRAD_ENABLED.with(|g| g.replace(on))
}

/// Sets grad mode on this thread until dropped, then restores the mode that was
/// current when it was made (also when unwinding). Guards nest.
#[must_use = "grad mode is restored when the guard is dropped"]
pub struct GradModeGuard {
    prev: bool,
}

impl GradModeGuard {
    /// Grad mode `on` until the guard is dropped.
    pub fn set(on: bool) -> GradModeGuard {
        GradModeGuard { prev: set_grad_enabled(on) }
    }
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        set_grad_enabled(self.prev);
    }
}
