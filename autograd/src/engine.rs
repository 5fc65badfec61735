//! The backward engine: walks the recorded graph from the outputs in reverse
//! creation order, applies each node's rule, accumulates gradients, runs hooks,
//! and frees what it used.
use crate::rules::{self, Ctx};
use kiln_tensor::{Edge, Error, GradModeGuard, Node, NodeKind, Origin, Result, Tensor};
use smallvec::SmallVec;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

/// Sums two gradients (either may be absent).
fn accumulate(acc: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *acc = Some(match acc.take() {
        None => g,
        Some(a) => a.add(&g)?,
    });
    Ok(())
}

fn run_hooks(hooks: Vec<kiln_tensor::Hook>, mut g: Tensor) -> Result<Tensor> {
    for h in hooks {
        if let Some(new) = h(&g)? {
            g = new;
        }
    }
    Ok(g)
}

/// Where gradients go: into leaves' `.grad` (backward) or returned for chosen inputs (`grad`).
pub(crate) enum Sink<'a> {
    Accumulate,
    Capture { inputs: &'a [Tensor], found: Vec<Option<Tensor>> },
}

/// Whether `t` is the only tensor holding its storage and covers all of it,
/// contiguously: then it can become a leaf's `.grad` without a copy, as no
/// other tensor (a view, a saved value of the graph) can see later writes.
fn owns_whole_storage(t: &Tensor) -> bool {
    Arc::strong_count(t.storage()) == 1 && t.is_whole_storage()
}

impl Sink<'_> {
    /// Offers the gradient of a leaf; returns true when it was consumed.
    fn leaf(&mut self, leaf: &Tensor, g: Tensor) -> Result<()> {
        let g = run_hooks(leaf.leaf_hooks(), g)?;
        match self {
            Sink::Accumulate => {
                let g = {
                    let d = g.detach();
                    drop(g);
                    d
                };
                // A distributed parameter's gradient takes the parameter's placements
                // (FSDP's reduce-scatter, DDP's all-reduce: Note [Parallelism recipes] in kiln-nn).
                let g = if leaf.is_distributed() && g.is_distributed() {
                    let (mesh, placements) = (leaf.device_mesh()?, leaf.placements()?);
                    if g.device_mesh()? != mesh || g.placements()? != placements {
                        g.redistribute(&mesh, &placements)?
                    } else {
                        g
                    }
                } else {
                    g
                };
                // Read, add and store under the leaf's gradient lock (concurrent backward passes).
                leaf.update_grad(|old| {
                    Ok(match old {
                        None => {
                            // A fresh buffer, so later in-place updates of .grad never alias the graph:
                            // the gradient itself when nothing else holds its storage (the usual case,
                            // a kernel's output), else a copy.
                            if g.shape() == leaf.shape() && g.dtype() == leaf.dtype() {
                                if owns_whole_storage(&g) {
                                    g
                                } else {
                                    g.deep_clone()?.detach()
                                }
                            } else {
                                g.to_dtype(leaf.dtype())?.broadcast_to(leaf.shape())?.contiguous()?.detach()
                            }
                        }
                        Some(old) => old.add(&g)?.detach(),
                    })
                })?;
            }
            Sink::Capture { inputs, found } => {
                for (i, t) in inputs.iter().enumerate() {
                    if t.same(leaf) {
                        accumulate(&mut found[i], g.clone())?;
                    }
                }
            }
        }
        Ok(())
    }
    /// Captures the gradient of a non-leaf output `(node, output)` if it is a requested input.
    fn non_leaf(&mut self, node: &Arc<Node>, output: usize, g: &Tensor) -> Result<()> {
        if let Sink::Capture { inputs, found } = self {
            for (i, t) in inputs.iter().enumerate() {
                if let Some(o) = t.origin() {
                    if Arc::ptr_eq(&o.node, node) && o.output == output {
                        accumulate(&mut found[i], g.clone())?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Heap entry ordered by node id (creation order): the largest id is processed
/// first, which is a topological order because inputs are always older.
struct Pending(Arc<Node>);
impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        self.0.id == o.0.id
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.id.cmp(&o.0.id)
    }
}

/// Runs backward from `roots` (tensor, gradient) pairs.
pub(crate) fn run(
    roots: &[(Tensor, Tensor)],
    retain_graph: bool,
    create_graph: bool,
    sink: &mut Sink<'_>,
) -> Result<()> {
    let _mode = GradModeGuard::set(create_graph);
    // The gradient rules' scalars follow from the recorded forward, whose own host
    // values were classified when it ran (Note [Host values]).
    let _constants = kiln_tensor::trace::ConstantScope::enter();
    // Gradient ops take the dtypes the forward recorded (Note [Autocast]).
    let _no_autocast = kiln_tensor::autocast::suspend_autocast();
    let mut grads: HashMap<u64, SmallVec<[Option<Tensor>; 2]>> = HashMap::new();
    let mut heap: BinaryHeap<Pending> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<Pending>,
                grads: &mut HashMap<u64, SmallVec<[Option<Tensor>; 2]>>,
                o: &Origin,
                g: Tensor|
     -> Result<()> {
        let slot = grads.entry(o.node.id).or_insert_with(|| {
            heap.push(Pending(o.node.clone()));
            SmallVec::from_elem(None, o.node.outputs.len())
        });
        accumulate(&mut slot[o.output], g)
    };
    for (t, g) in roots {
        if g.shape() != t.shape() {
            return Err(Error::shape(
                "backward",
                format!(
                    "mismatch in shape: grad_output has shape {:?} and output has shape {:?}",
                    g.shape(),
                    t.shape()
                ),
            ));
        }
        match t.origin() {
            Some(o) => push(&mut heap, &mut grads, &o, g.clone())?,
            None if t.requires_grad() => sink.leaf(t, g.clone())?,
            None => {
                return Err(Error::invalid(
                    "backward",
                    "element 0 of tensors does not require grad and does not have a grad_fn",
                ))
            }
        }
    }
    while let Some(Pending(node)) = heap.pop() {
        let mut out_grads = grads.remove(&node.id).unwrap_or_default();
        for (i, g) in out_grads.iter_mut().enumerate() {
            if let Some(gi) = g.take() {
                let gi = run_hooks(node.hooks(i), gi)?;
                sink.non_leaf(&node, i, &gi)?;
                *g = Some(gi);
            }
        }
        let edges: SmallVec<[Edge; 3]> = match node.inputs().as_ref() {
            Some(e) => e.clone(),
            None => {
                return Err(Error::invalid(
                    "backward",
                    format!(
                        "trying to backward through the graph a second time (or directly access saved tensors after they have already been freed): the saved inputs of {} were freed; specify retain_graph=true if you need to backward through the graph a second time",
                        node.name()
                    ),
                ))
            }
        };
        let edges = if create_graph { edges.into_iter().map(reattach).collect() } else { edges };
        let in_grads = match &node.kind {
            NodeKind::Primitive(op) => rules::backward(&Ctx { op, edges: &edges }, &out_grads)?,
            NodeKind::Custom { backward, .. } => backward(&out_grads, &edges)?,
        };
        if !retain_graph {
            node.release();
        }
        // The outputs' gradients are spent: dropping them here lets a leaf adopt a
        // gradient buffer they shared (a view's gradient) instead of copying it.
        drop(out_grads);
        for (e, g) in edges.iter().zip(in_grads) {
            let Some(g) = g else { continue };
            if !e.requires_grad {
                continue;
            }
            let g = if g.shape() != e.value.shape() {
                return Err(Error::shape(
                    "backward",
                    format!(
                        "the gradient rule of {} returned shape {:?} for an input of shape {:?}",
                        node.name(),
                        g.shape(),
                        e.value.shape()
                    ),
                ));
            } else {
                g
            };
            match (&e.origin, &e.leaf) {
                (Some(o), _) => push(&mut heap, &mut grads, o, g)?,
                (None, Some(leaf)) => sink.leaf(leaf, g)?,
                (None, None) => {}
            }
        }
    }
    Ok(())
}

/// With `create_graph`, the rules must compute the gradients as differentiable
/// functions of the saved inputs: an edge's value is a detached alias (nodes hold
/// no graph, so they form no cycles), so it is given back its place in the graph
/// for the duration of this rule: the leaf itself, or an alias carrying the
/// input's origin.
fn reattach(e: Edge) -> Edge {
    if !e.requires_grad {
        return e;
    }
    let value = match (&e.origin, &e.leaf) {
        (_, Some(leaf)) => leaf.clone(),
        (Some(o), None) => {
            let v = e.value.detach();
            v.set_origin(Some(o.clone()));
            v
        }
        (None, None) => return e,
    };
    Edge { value, ..e }
}
