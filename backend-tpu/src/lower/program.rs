//! The lowering of kiln's `Program` (Note \[Programs\] in kiln-tensor's
//! `ir/mod.rs`) to one StableHLO module: parameters and results as flat
//! buffers (the backend's storages), views read and writes made as the
//! eager ops make them (`read_view`, `write_view`), creation values as
//! constants or arguments (Note \[Shared constants\]), each primitive
//! through `lower_op`, updated parameters donated.
use super::mesh::{Output, Placing, ShardedShape};
use super::region::{Body, Operand};
use super::{
    check_results, creation_args, creation_lower, lower_op, read_view, write_view, Builder, Check, Lit, Module,
    Sharding, Ty, Val,
};
use kiln_tensor::ir::{Inst, Program, ResultKind, Value};
use kiln_tensor::op::region::LocalRegion;
use kiln_tensor::{DType, DeviceMesh, Error, Layout, Op, Result, Scalar, ViewOp};
use std::collections::HashMap;

// Note [Shared constants]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A program the backend runs takes its creation ops' values (`full`'s fill,
// `arange`'s start and step) as arguments after its parameters, not as
// literals in its text, so that one executable serves every value: a
// deferred program whose scalar operand changes every step (a learning rate,
// a decoding position) never recompiles. Equal values (same dtype, same
// bytes) share one argument: a training step makes `beta1`, `1 - beta2` or
// `eps` once per parameter, and a scalar operand (`x * 0.5`) is a `full` too;
// sharing took the captured llama-16m training step from 689 scalar
// arguments to 66. Over a mesh the arguments are replicated. A program written for elsewhere (an export) keeps its
// values as literals, since nothing supplies its arguments there.

/// Where a lowered program's creation values live (Note \[Shared constants\]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Constants {
    /// Literals in the module.
    Inline,
    /// Trailing arguments, one per distinct value.
    Arguments,
}

/// A lowered program: its module text and what its trailing outputs check.
pub struct LoweredProgram {
    pub module: Module,
    /// The flat type of each output: one per program result, then one bool per check.
    pub outputs: Vec<(DType, Vec<usize>)>,
    /// The device-side checks of the ops (after the program's results), with the op's name.
    pub checks: Vec<(Check, &'static str)>,
    /// With [`Constants::Arguments`], the value of each argument after the
    /// parameters: its bytes (one element) and dtype.
    pub constants: Vec<(Vec<u8>, DType)>,
    /// Over a mesh, where each result lies (the storage it fills).
    pub placements: Vec<Output>,
    /// The bytes the `all_to_all`s of its local regions send between devices per run.
    pub all_to_all_bytes: u64,
}

fn missing(v: impl std::fmt::Display) -> Error {
    Error::invalid("program", format!("{v} is not defined before its use"))
}

/// Lowers `p` (verified first) to a module whose arguments are the
/// parameters, flat (then, with [`Constants::Arguments`], the creation
/// values), and whose outputs are the results, flat, then the ops' check
/// flags. A parameter that a result updates is donated to it.
pub fn lower_program(p: &Program, constants: Constants) -> Result<LoweredProgram> {
    let mut b = Builder::new(&[]).0;
    let Lowered { results, checks, constants, .. } = lower_into(&mut b, p, constants, None)?;
    let mut outs = vec![];
    let mut outputs = vec![];
    for (j, (r, v)) in p.results().iter().zip(results).enumerate() {
        let n = v.ty.numel();
        outputs.push((v.dtype(), vec![n]));
        outs.push(b.reshape(&v, &[n]));
        if let ResultKind::Update(k) = r.kind {
            b.alias(k, j);
        }
    }
    for (v, _, _) in &checks {
        outputs.push((DType::Bool, vec![]));
        outs.push(v.clone());
    }
    let module = b.finish(&outs);
    let checks = checks.into_iter().map(|(_, c, n)| (c, n)).collect();
    Ok(LoweredProgram { module, outputs, checks, constants, placements: vec![], all_to_all_bytes: 0 })
}

/// Lowers `p` (verified first) to one SPMD program over `mesh` whose
/// arguments are the parameters' shards (`params`: each storage's sharding
/// and n-d shape; then the creation values, replicated) and whose outputs
/// are the results padded to the shardings kiln's rules give them, then the
/// ops' check flags. A result updating a parameter of the same sharding is
/// donated to it.
pub fn lower_mesh_program(p: &Program, mesh: &DeviceMesh, params: Vec<ShardedShape>) -> Result<LoweredProgram> {
    let mut b = Builder::new(&[]).0;
    let mut placing = Placing::new(mesh.clone(), params);
    let Lowered { results, checks, constants, all_to_all_bytes } =
        lower_into(&mut b, p, Constants::Arguments, Some(&mut placing))?;
    let (mut outs, mut outputs, mut shardings, mut placements) = (vec![], vec![], vec![], vec![]);
    for (j, (r, v)) in p.results().iter().zip(results).enumerate() {
        let (out, placed) = placing.output(&mut b, r.value, &v)?;
        let (s, shape) = (placed.sharding.clone(), placed.shape.clone());
        if let ResultKind::Update(k) = r.kind {
            if placing.params.get(k).is_some_and(|(ps, pshape)| *ps == s && s.unreduced.is_empty() && *pshape == shape)
            {
                b.alias(k, j);
            }
        }
        outputs.push((out.dtype(), s.shard_shape(&shape)));
        outs.push(out);
        shardings.push(s);
        placements.push(placed);
    }
    for (v, _, _) in &checks {
        outputs.push((DType::Bool, vec![]));
        outs.push(v.clone());
        shardings.push(Sharding::replicated(mesh, 0));
    }
    let module = b.finish_sharded(&outs, &shardings)?;
    let checks = checks.into_iter().map(|(_, c, n)| (c, n)).collect();
    Ok(LoweredProgram { module, outputs, checks, constants, placements, all_to_all_bytes })
}

/// A program lowered into a builder (see `lower_into`).
pub struct Lowered {
    /// Each result's value, of the result's type.
    pub results: Vec<Val>,
    /// The device-side checks of the ops: a bool scalar each, the check, the op's name.
    pub checks: Vec<(Val, Check, &'static str)>,
    /// With [`Constants::Arguments`], the value (bytes, dtype) of each argument after the parameters.
    pub constants: Vec<(Vec<u8>, DType)>,
    /// The bytes the `all_to_all`s of its local regions send between devices per run.
    pub all_to_all_bytes: u64,
}

/// Lowers `p` (verified first) into `b`, a builder with no arguments yet:
/// the parameters become its arguments, flat, in order (then, with
/// [`Constants::Arguments`], the creation values). Over a mesh, `placing`
/// holds the parameters' shardings and follows every value's placement.
pub(crate) fn lower_into(
    b: &mut Builder,
    p: &Program,
    constants: Constants,
    placing: Option<&mut Placing>,
) -> Result<Lowered> {
    p.verify()?;
    let mut l = ProgramLowering::new(constants);
    l.advance(b, p, placing)?;
    l.finish(p)
}

/// A program's lowering that can resume: a program only grows while it is
/// recorded (parameters and instructions are appended), so a lowering that
/// follows a recording lowers only what was added since it last looked.
pub(crate) struct ProgramLowering {
    constants: Constants,
    vals: Vec<Option<Val>>,
    shared: Shared,
    checks: Vec<(Val, Check, &'static str)>,
    all_to_all_bytes: u64,
    params_done: usize,
    insts_done: usize,
}

impl ProgramLowering {
    pub(crate) fn new(constants: Constants) -> ProgramLowering {
        ProgramLowering {
            constants,
            vals: vec![],
            shared: Shared::default(),
            checks: vec![],
            all_to_all_bytes: 0,
            params_done: 0,
            insts_done: 0,
        }
    }

    /// Lowers what `p` holds beyond what this lowering has seen: its new
    /// parameters, then its new instructions (each reads only values defined
    /// before it, so this order defines every operand first).
    pub(crate) fn advance(&mut self, b: &mut Builder, p: &Program, mut placing: Option<&mut Placing>) -> Result<()> {
        self.vals.resize(p.num_values(), None);
        for (i, param) in p.params().iter().enumerate().skip(self.params_done) {
            let m = p.meta(param.value);
            let flat = match placing.as_deref_mut() {
                Some(pl) => pl.param(b, i, param.value, m.dtype)?,
                None => b.add_arg(Ty::new(&[m.shape.iter().product()], m.dtype)),
            };
            self.vals[param.value.index()] = Some(b.reshape(&flat, &m.shape));
        }
        self.params_done = p.params().len();
        for inst in &p.insts()[self.insts_done..] {
            let x: Vec<Val> = inst
                .args
                .iter()
                .map(|a| self.vals[a.index()].clone().ok_or_else(|| missing(a)))
                .collect::<Result<_>>()?;
            // The op's results, and, over a mesh, the input shardings that place
            // them (views and writes place their results themselves).
            let (results, place) = match &inst.op {
                Op::View(v) => {
                    if let Some(pl) = placing.as_deref_mut() {
                        pl.view(inst.first, inst.args[0], x[0].shape(), v)?;
                    }
                    let n = x[0].ty.numel();
                    let flat = b.reshape(&x[0], &[n]);
                    (vec![read_view(b, &flat, &view_layout(v, x[0].shape())?)?], None)
                }
                Op::Assign { shape, strides, offset } => {
                    let n = x[0].ty.numel();
                    let flat = b.reshape(&x[0], &[n]);
                    let layout = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
                    let written = match placing.as_deref_mut() {
                        Some(pl) => pl.assign(b, inst.first, inst.args[0], &flat, &layout, &x[1])?,
                        None => write_view(b, &flat, &layout, &x[1])?,
                    };
                    (vec![b.reshape(&written, x[0].shape())], None)
                }
                Op::Full { .. } | Op::Arange { .. } => {
                    let r = vec![creation(b, &inst.op, self.constants, &mut self.shared, placing.as_deref())?];
                    (r, Some(vec![]))
                }
                Op::LocalMap(r) => {
                    let pl = placing.as_deref_mut().ok_or_else(|| {
                        Error::backend("pjrt", "a local region is lowered only inside a program over a mesh")
                    })?;
                    let (results, ins, region_checks, bytes) = lower_region(b, inst, r, x, &mut self.shared, pl)?;
                    self.checks.extend(region_checks);
                    self.all_to_all_bytes += bytes;
                    (results, Some(ins))
                }
                op => {
                    let (x, ins) = match placing.as_deref_mut() {
                        Some(pl) => {
                            let (x, ins) = pl.inputs(b, op, &inst.args, x, &inst.outs)?;
                            (x, Some(ins))
                        }
                        None => (x, None),
                    };
                    let (r, c) = lower_op(b, op, &x, &inst.outs)?;
                    self.checks.extend(c.into_iter().map(|(v, c)| (v, c, op.name())));
                    (r, ins)
                }
            };
            check_results(&inst.op, &results, &inst.outs)?;
            let results = match (placing.as_deref_mut(), place) {
                (Some(pl), Some(ins)) => pl.results(b, &inst.op, &ins, inst.results(), results)?,
                _ => results,
            };
            for (v, r) in inst.results().zip(results) {
                self.vals[v.index()] = Some(r);
            }
        }
        self.insts_done = p.insts().len();
        Ok(())
    }

    /// The lowering of all of `p`, with its results.
    pub(crate) fn finish(self, p: &Program) -> Result<Lowered> {
        let results = p
            .results()
            .iter()
            .map(|r| self.vals[r.value.index()].clone().ok_or_else(|| missing(r.value)))
            .collect::<Result<_>>()?;
        let ProgramLowering { checks, shared, all_to_all_bytes, .. } = self;
        Ok(Lowered { results, checks, constants: shared.values, all_to_all_bytes })
    }
}

/// The region `r` (instruction `inst`, on the values `x`) lowered over the
/// mesh `pl` places values on (`lower/region.rs`): its results (not placed
/// yet), the shardings its inputs entered with, its checks, and the bytes its
/// `all_to_all`s send per run.
#[allow(clippy::type_complexity)]
fn lower_region(
    b: &mut Builder,
    inst: &Inst,
    r: &LocalRegion,
    x: Vec<Val>,
    shared: &mut Shared,
    pl: &mut Placing,
) -> Result<(Vec<Val>, Vec<(Vec<usize>, Sharding)>, Vec<(Val, Check, &'static str)>, u64)> {
    let program = r
        .body
        .as_any()
        .downcast_ref::<Program>()
        .ok_or_else(|| Error::backend("pjrt", "a local region's body is not a program"))?;
    let body = Body::new(program, &pl.mesh, &r.out_placements)?;
    let bytes = body.all_to_all_bytes * pl.mesh.devices().len() as u64;
    let op = &inst.op;
    // Each input resharded to the region's placements (a region's inputs are spelled out).
    let (x, ins) = pl.inputs(b, op, &inst.args, x, &inst.outs)?;
    let mut operands = vec![];
    let mut shardings = vec![];
    for operand in body.operands()? {
        match operand {
            Operand::Block(i) => {
                operands.push(x[i].clone());
                shardings.push(ins[i].1.clone());
            }
            Operand::Constant(bytes, dt) => {
                let v = shared.arg(b, bytes, dt, Some(pl))?;
                let s = Sharding::replicated(&pl.mesh, 1);
                operands.push(b.reshard(&v, &s));
                shardings.push(s);
            }
        }
    }
    let (outs, _, checks) = body.emit(b, &pl.mesh, &operands, &shardings)?;
    Ok((outs, ins, checks, bytes))
}

/// The layout a view op reads from a value of `shape`, flat.
fn view_layout(v: &ViewOp, shape: &[usize]) -> Result<Layout> {
    Ok(match v {
        ViewOp::AsStrided { shape, strides, offset } => {
            Layout::new(shape.clone(), strides.iter().copied().collect(), *offset)
        }
        other => other.apply(&Layout::contiguous(shape))?,
    })
}

/// A creation op's value: from literals, or from arguments shared by equal
/// values (over a mesh, replicated ones).
fn creation(
    b: &mut Builder,
    op: &Op,
    constants: Constants,
    shared: &mut Shared,
    placing: Option<&Placing>,
) -> Result<Val> {
    if constants == Constants::Arguments {
        let args = shared.args(b, op, placing)?;
        return creation_lower(b, op, &args);
    }
    let args = match *op {
        Op::Full { value, dtype, .. } => {
            let lit = match value {
                Scalar::Bool(v) => Lit::B(v),
                Scalar::Int(v) => Lit::I(v),
                Scalar::Float(v) => Lit::F(v),
            };
            vec![b.constant(lit, dtype)]
        }
        Op::Arange { start, step, .. } => {
            vec![b.constant(Lit::F(start), DType::F64), b.constant(Lit::F(step), DType::F64)]
        }
        _ => return Err(Error::backend("pjrt", format!("{} is not a creation op", op.name()))),
    };
    creation_lower(b, op, &args)
}

/// The arguments holding creation values, one per distinct value.
#[derive(Default)]
struct Shared {
    args: HashMap<(DType, Vec<u8>), Val>,
    values: Vec<(Vec<u8>, DType)>,
}

impl Shared {
    /// The arguments of a creation op's values, made on first use.
    fn args(&mut self, b: &mut Builder, op: &Op, placing: Option<&Placing>) -> Result<Vec<Val>> {
        let values = creation_args(op).ok_or_else(|| Error::backend("pjrt", format!("{} has no values", op.name())))?;
        values.into_iter().map(|(bytes, dt)| self.arg(b, bytes, dt, placing)).collect()
    }

    /// The argument holding one value (`bytes` of `dtype`), made on first use
    /// (over a mesh, replicated).
    fn arg(&mut self, b: &mut Builder, bytes: Vec<u8>, dt: DType, placing: Option<&Placing>) -> Result<Val> {
        let key = (dt, bytes);
        if let Some(v) = self.args.get(&key) {
            return Ok(v.clone());
        }
        let v = match placing {
            Some(pl) => pl.constant_arg(b, dt)?,
            None => b.add_arg(Ty::new(&[1], dt)),
        };
        self.values.push((key.1.clone(), dt));
        self.args.insert(key, v.clone());
        Ok(v)
    }
}

/// A lowering over a mesh that follows a recording in progress, to tell
/// where its values lie while the function is still being traced (a value's
/// placements, the current placement a `redistribute` checks). It lowers only
/// what the recording added since it last looked, into a builder of its own
/// that is never compiled, so a trace asking after every op stays linear.
pub(crate) struct Follower {
    /// The recording followed (`RecordingView::id`).
    pub recording: u64,
    builder: Builder,
    lowering: ProgramLowering,
    placing: Placing,
}

impl Follower {
    pub(crate) fn new(recording: u64, mesh: DeviceMesh) -> Follower {
        Follower {
            recording,
            builder: Builder::new(&[]).0,
            lowering: ProgramLowering::new(Constants::Arguments),
            placing: Placing::new(mesh, vec![]),
        }
    }

    /// Follows `p` to its end; `param` gives where the storage of each new
    /// parameter (by index) lies.
    pub(crate) fn advance(&mut self, p: &Program, mut param: impl FnMut(usize) -> Result<ShardedShape>) -> Result<()> {
        for i in self.placing.params.len()..p.params().len() {
            self.placing.params.push(param(i)?);
        }
        self.lowering.advance(&mut self.builder, p, Some(&mut self.placing))
    }

    /// Where the value `v` (the content of a storage) lies.
    pub(crate) fn placed(&self, v: Value) -> Result<Output> {
        self.placing.placed(v)
    }
}
