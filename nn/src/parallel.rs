//! Parallelism recipes with PyTorch's names, on distributed tensors: data
//! parallelism (`replicate`, DDP's composable form), FSDP2 (`fully_shard`),
//! tensor parallelism (`parallelize_module` with `ColwiseParallel` /
//! `RowwiseParallel` plans, one for Llama and Qwen3), expert parallelism for
//! mixture-of-experts models, their 2-D compositions (see Note
//! [Parallelism recipes]), and context parallelism (`ContextParallel`, ring
//! attention over a `cp` axis).
mod context;

pub use context::{ring_attention, ContextParallel};

use crate::layers::is_stacked_expert;
use crate::models::LlamaForCausalLM;
use crate::module::Module;
use kiln_tensor::{distribute_tensor, DeviceMesh, Error, Placement, Result, Tensor};

// Note [Parallelism recipes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// kiln drives every device of a mesh from one program (Note [Device meshes]),
// so a recipe is only a choice of placements for parameters and inputs; XLA's
// partitioner inserts the collectives each one implies:
// - `replicate` (data parallelism, PyTorch's composable `replicate` / DDP):
//   every parameter `Replicate`; the batch is split over the data axis
//   (`shard_batch`). A parameter's gradient comes out as a partial sum over
//   that axis, and the optimizer's read of it is the all-reduce.
// - `fully_shard` (FSDP2): every parameter `Shard(0)` over the axis (the
//   optimizer state follows its parameter, see `optim`), so each device holds
//   1/N of parameters, gradients and state; ops that read a parameter
//   whole make the partitioner all-gather it, and gradients are
//   reduce-scattered back to the shard. `reshard_after_forward` is what XLA
//   does anyway inside one program: a gathered parameter is not kept.
// - `parallelize_module` (tensor parallelism): `ColwiseParallel` splits a
//   Linear's output features (`weight` `Shard(0)`, `bias` `Shard(0)`),
//   `RowwiseParallel` its input features (`weight` `Shard(1)`, bias
//   replicated); the Llama/Qwen3 plan makes q/k/v and gate/up colwise and
//   o/down rowwise, splitting attention heads and the MLP over the axis.
// - expert parallelism (`LlamaForCausalLM::parallelize_experts`): the
//   experts' stacked weights `Shard(0)` over an `ep` axis, the rest of the
//   model data-parallel over it; unlike the recipes above it is not left to
//   the partitioner: each sparse block runs as per-device code exchanging
//   tokens with `all_to_all` (Note [Expert parallelism]).
// Recipes compose on sub-meshes of one mesh: placing a parameter on
// `mesh["dp"]` keeps what an earlier recipe put on `mesh["tp"]`, so
// `parallelize_module(.., &mesh["tp"], ..)` then `fully_shard(.., &mesh["dp"])`
// is 2-D FSDP x TP. Parameters keep their names and `requires_grad`, so
// optimizers and checkpoints see the same model.

/// How `parallelize_module` splits one Linear (PyTorch's `ParallelStyle`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelStyle {
    /// Output features split: `weight` `[out, in]` on dim 0, `bias` on dim 0.
    ColwiseParallel,
    /// Input features split: `weight` on dim 1, `bias` replicated.
    RowwiseParallel,
}

/// Places every parameter of `module` on `mesh` with the placements `plan`
/// gives for its name and tensor (one per axis of `mesh`). A parameter already
/// on a mesh with the same root keeps its placements on the other axes.
pub fn distribute_module<M: Module + ?Sized>(
    module: &mut M,
    mesh: &DeviceMesh,
    mut plan: impl FnMut(&str, &Tensor) -> Vec<Placement>,
) -> Result<()> {
    let _g = kiln_autograd::no_grad();
    module.visit_params_mut("", &mut |name, p| {
        let placements = plan(name, p);
        let rg = p.requires_grad();
        let placed = place(p, mesh, &placements)
            .map_err(|e| Error::invalid("distribute_module", format!("parameter {name}: {e}")))?;
        let placed = placed.detach();
        placed.requires_grad_(rg)?;
        *p = placed;
        Ok(())
    })
}

/// `t` with `placements` on the axes of `mesh`, keeping what it has on the
/// root's other axes when it is already distributed there.
fn place(t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
    if !t.is_distributed() {
        return distribute_tensor(t, mesh, placements);
    }
    let root = mesh.root();
    let current = t.device_mesh()?;
    if !current.same_root(mesh) {
        return Err(Error::device(
            "distribute_module",
            format!("the tensor is on {current}, which is not a view of {root}"),
        ));
    }
    let placed = t.placements()?;
    let mut on_root = vec![Placement::Replicate; root.ndim()];
    for (i, p) in placed.iter().enumerate() {
        on_root[current.root_axis_of(i)] = *p;
    }
    for (i, p) in placements.iter().enumerate() {
        on_root[mesh.root_axis_of(i)] = *p;
    }
    t.redistribute(&root, &on_root)
}

/// Data parallelism (PyTorch's `replicate`, DDP's composable form): every
/// parameter replicated on `mesh`; split the batch with [`shard_batch`].
pub fn replicate<M: Module + ?Sized>(module: &mut M, mesh: &DeviceMesh) -> Result<()> {
    let n = mesh.ndim();
    distribute_module(module, mesh, |_, _| vec![Placement::Replicate; n])
}

/// [`fully_shard`] with FSDP2's `mp_policy`: the parameters sharded and the
/// module's forward run under `policy` (parameters, gradients and optimizer
/// state stay in their dtype, float32; see [`crate::precision::MixedPrecisionPolicy`]).
pub fn fully_shard_with<M: Module + ?Sized>(
    module: &mut M,
    mesh: &DeviceMesh,
    policy: crate::precision::MixedPrecisionPolicy,
) -> Result<()> {
    policy.validate()?;
    fully_shard(module, mesh)?;
    module.set_mixed_precision_policy(Some(policy))
}

/// FSDP2's `fully_shard`: every parameter split along its first dimension
/// over every axis of `mesh` (usually the data axis, `mesh["dp"]`).
pub fn fully_shard<M: Module + ?Sized>(module: &mut M, mesh: &DeviceMesh) -> Result<()> {
    let n = mesh.ndim();
    distribute_module(module, mesh, |_, p| {
        if p.ndim() == 0 {
            vec![Placement::Replicate; n]
        } else {
            vec![Placement::Shard(0); n]
        }
    })
}

/// Tensor parallelism (PyTorch's `parallelize_module`): each Linear whose name
/// matches a plan entry is split over `mesh` (one axis) in that style; other
/// parameters are replicated. A pattern matches a module name exactly or
/// with `*` standing for one name component (`model.layers.*.mlp.up_proj`).
pub fn parallelize_module<M: Module + ?Sized>(
    module: &mut M,
    mesh: &DeviceMesh,
    plan: &[(&str, ParallelStyle)],
) -> Result<()> {
    if mesh.ndim() != 1 {
        return Err(Error::invalid(
            "parallelize_module",
            format!("tensor parallelism takes a one-axis mesh (e.g. mesh[\"tp\"]), got {mesh}"),
        ));
    }
    let mut used = vec![false; plan.len()];
    distribute_module(module, mesh, |name, p| {
        let (module_name, leaf) = name.rsplit_once('.').unwrap_or(("", name));
        // A LoRA adapter's matrices split with their layer (Note [LoRA adapters]):
        // B [out, r] along out under a colwise layer, A [r, in] along in under a
        // rowwise one; the other factor (rank r) is replicated.
        let (module_name, adapter) = match module_name.rsplit_once('.') {
            Some((base, a @ ("lora_A" | "lora_B"))) if leaf == "weight" => (base, Some(a)),
            _ => (module_name, None),
        };
        let style = plan.iter().position(|(pat, _)| matches(pat, module_name)).map(|i| {
            used[i] = true;
            plan[i].1
        });
        let placement = match (style, adapter, leaf, p.ndim()) {
            (Some(ParallelStyle::ColwiseParallel), None, "weight" | "bias", _) => Placement::Shard(0),
            (Some(ParallelStyle::RowwiseParallel), None, "weight", 2) => Placement::Shard(1),
            (Some(ParallelStyle::ColwiseParallel), Some("lora_B"), _, 2) => Placement::Shard(0),
            // DoRA's magnitude has one entry per output row.
            (Some(ParallelStyle::ColwiseParallel), None, crate::lora::MAGNITUDE, 1) => Placement::Shard(0),
            (Some(ParallelStyle::RowwiseParallel), Some("lora_A"), _, 2) => Placement::Shard(1),
            _ => Placement::Replicate,
        };
        vec![placement]
    })?;
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(Error::invalid(
            "parallelize_module",
            format!("the plan entry {:?} matches no module of the model", plan[i].0),
        ));
    }
    Ok(())
}

/// Whether `name` matches `pattern` component by component (`*` matches one).
fn matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), name.split('.').collect());
    p.len() == n.len() && p.iter().zip(&n).all(|(a, b)| *a == "*" || a == b)
}

/// The tensor-parallel plan of Llama and Qwen3 decoder layers (the Megatron
/// split, PyTorch's and TorchTitan's): attention heads and MLP features over the axis.
pub fn llama_tp_plan() -> Vec<(&'static str, ParallelStyle)> {
    use ParallelStyle::{ColwiseParallel, RowwiseParallel};
    vec![
        ("model.layers.*.self_attn.q_proj", ColwiseParallel),
        ("model.layers.*.self_attn.k_proj", ColwiseParallel),
        ("model.layers.*.self_attn.v_proj", ColwiseParallel),
        ("model.layers.*.self_attn.o_proj", RowwiseParallel),
        ("model.layers.*.mlp.gate_proj", ColwiseParallel),
        ("model.layers.*.mlp.up_proj", ColwiseParallel),
        ("model.layers.*.mlp.down_proj", RowwiseParallel),
    ]
}

/// A batch split along its first dimension over `mesh` (every axis of it),
/// for data parallelism.
pub fn shard_batch(t: &Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
    distribute_tensor(t, mesh, &vec![Placement::Shard(0); mesh.ndim()])
}

/// A recipe by name, as the tools take it (`--parallel ddp|fsdp|tp|fsdp+tp|ep|fsdp+ep`),
/// for Llama, Qwen3 and Qwen3-MoE models on a mesh with axes named `dp`,
/// `tp` and/or `ep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    /// [`replicate`] over `dp`, the batch split over `dp`.
    Ddp,
    /// [`fully_shard`] over `dp`, the batch split over `dp`.
    Fsdp,
    /// [`parallelize_module`] with [`llama_tp_plan`] over `tp`, the batch replicated.
    Tp,
    /// Tensor parallelism over `tp`, then FSDP over `dp`; the batch split over `dp`.
    FsdpTp,
    /// Expert parallelism over `ep` (the experts split, everything else
    /// replicated); the batch split over `ep`.
    Ep,
    /// Expert parallelism over `ep` and FSDP over `dp` (and over `ep` for
    /// what is not an expert; the experts' weights split along their second
    /// dimension over `dp`); the batch split over both.
    FsdpEp,
}

impl Recipe {
    /// `ddp`, `fsdp`, `tp`, `fsdp+tp`, `ep` or `fsdp+ep`.
    pub fn parse(s: &str) -> Result<Recipe> {
        match s {
            "ddp" => Ok(Recipe::Ddp),
            "fsdp" => Ok(Recipe::Fsdp),
            "tp" => Ok(Recipe::Tp),
            "fsdp+tp" | "tp+fsdp" => Ok(Recipe::FsdpTp),
            "ep" => Ok(Recipe::Ep),
            "fsdp+ep" | "ep+fsdp" => Ok(Recipe::FsdpEp),
            _ => Err(Error::invalid(
                "parallel",
                format!("unknown recipe {s:?}: expected ddp, fsdp, tp, fsdp+tp, ep or fsdp+ep"),
            )),
        }
    }

    /// The mesh axes the recipe uses.
    fn axes(self) -> &'static [&'static str] {
        match self {
            Recipe::Ddp | Recipe::Fsdp => &["dp"],
            Recipe::Tp => &["tp"],
            Recipe::FsdpTp => &["dp", "tp"],
            Recipe::Ep => &["ep"],
            Recipe::FsdpEp => &["dp", "ep"],
        }
    }

    /// Places `model`'s parameters on `mesh`.
    pub fn apply(self, model: &mut LlamaForCausalLM, mesh: &DeviceMesh) -> Result<()> {
        self.check_axes(mesh)?;
        match self {
            Recipe::Ddp | Recipe::Fsdp | Recipe::Tp | Recipe::FsdpTp => self.apply_dense(model, mesh),
            Recipe::Ep | Recipe::FsdpEp => self.apply_experts(model, mesh),
        }
    }

    /// Places the parameters of any module with Llama's names (a pipeline
    /// stage, say) on `mesh` by a recipe that needs no experts: DDP, FSDP,
    /// TP or FSDP x TP; the expert recipes are refused.
    pub fn apply_to_module<M: Module + ?Sized>(self, module: &mut M, mesh: &DeviceMesh) -> Result<()> {
        self.check_axes(mesh)?;
        self.apply_dense(module, mesh)
    }

    fn check_axes(self, mesh: &DeviceMesh) -> Result<()> {
        for a in self.axes() {
            mesh.axis_size(a).map_err(|_| {
                Error::invalid(
                    "parallel",
                    format!(
                        "{self:?} needs a mesh axis named {a:?}, the mesh is {mesh} (e.g. --mesh dp=4, dp=2,tp=2 or dp=2,ep=2)"
                    ),
                )
            })?;
        }
        Ok(())
    }

    /// The recipes without experts, on any module (the expert recipes are an error).
    fn apply_dense<M: Module + ?Sized>(self, model: &mut M, mesh: &DeviceMesh) -> Result<()> {
        let sub = |a: &str| mesh.sub(&[a]);
        match self {
            Recipe::Ddp => replicate(model, &sub("dp")?),
            Recipe::Fsdp => fully_shard(model, &sub("dp")?),
            Recipe::Tp => parallelize_module(model, &sub("tp")?, &llama_tp_plan()),
            Recipe::FsdpTp => {
                parallelize_module(model, &sub("tp")?, &llama_tp_plan())?;
                fully_shard(model, &sub("dp")?)
            }
            Recipe::Ep | Recipe::FsdpEp => Err(Error::invalid(
                "parallel",
                format!("{self:?} splits a whole model's experts; apply it to the model, not to a part of it"),
            )),
        }
    }

    /// The expert recipes, on a whole model.
    fn apply_experts(self, model: &mut LlamaForCausalLM, mesh: &DeviceMesh) -> Result<()> {
        let sub = |a: &str| mesh.sub(&[a]);
        match self {
            Recipe::Ddp | Recipe::Fsdp | Recipe::Tp | Recipe::FsdpTp => self.apply_dense(model, mesh),
            Recipe::Ep | Recipe::FsdpEp => {
                let ep = sub("ep")?;
                model.parallelize_experts(&ep, "ep")?;
                if self == Recipe::Ep {
                    // Everything but the experts replicated over `ep`.
                    return distribute_module(model, &ep, |name, _| {
                        vec![if is_stacked_expert(name) { Placement::Shard(0) } else { Placement::Replicate }]
                    });
                }
                // FSDP over both axes; the experts' second dimension over `dp`.
                let both = mesh.sub(&["dp", "ep"])?;
                distribute_module(model, &both, |name, p| {
                    if is_stacked_expert(name) {
                        vec![Placement::Shard(1), Placement::Shard(0)]
                    } else if p.ndim() == 0 {
                        vec![Placement::Replicate; 2]
                    } else {
                        vec![Placement::Shard(0); 2]
                    }
                })
            }
        }
    }

    /// A batch of token ids placed as the recipe reads it.
    pub fn place_batch(self, ids: &Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
        match self {
            Recipe::Tp => ids.to_device(mesh.device()),
            Recipe::Ep => shard_batch(ids, &mesh.sub(&["ep"])?),
            Recipe::FsdpEp => shard_batch(ids, &mesh.sub(&["dp", "ep"])?),
            _ => shard_batch(ids, &mesh.sub(&["dp"])?),
        }
    }
}

/// A mesh from a spec like `dp=4`, `dp=2,tp=2` or `dp=2,ep=2` (axis names and sizes, row-major).
pub fn parse_mesh(spec: &str, kind: kiln_tensor::DeviceKind) -> Result<DeviceMesh> {
    let mut names = vec![];
    let mut shape = vec![];
    for part in spec.split(',') {
        let (n, s) = part.split_once('=').ok_or_else(|| {
            Error::invalid("mesh", format!("{part:?} in {spec:?}: expected NAME=SIZE, e.g. dp=2,tp=2"))
        })?;
        let s: usize = s
            .trim()
            .parse()
            .map_err(|_| Error::invalid("mesh", format!("{part:?} in {spec:?}: {s:?} is not a size")))?;
        names.push(n.trim());
        shape.push(s);
    }
    kiln_tensor::init_device_mesh(kind, &shape, &names)
}
