//! The lowering of kiln's `Program` (Note \[Programs\] in kiln-tensor's
//! `ir/mod.rs`) to one StableHLO module: parameters and results as flat
//! buffers (the backend's storages), views read and writes made as the
//! eager ops make them (`read_view`, `write_view`), creation values as
//! constants or arguments (Note \[Shared constants\]), each primitive
//! through `lower_op`, updated parameters donated.
use super::{
    check_results, creation_args, creation_lower, lower_op, read_view, write_view, Builder, Check, Lit, Module, Ty, Val,
};
use kiln_tensor::ir::{Program, ResultKind};
use kiln_tensor::{DType, Error, Layout, Op, Result, Scalar, ViewOp};
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
// arguments to 66. The graphs of meshes (`graph.rs`) share their values the
// same way. A program written for elsewhere (an export) keeps its
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
    let Lowered { results, checks, constants } = lower_into(&mut b, p, constants)?;
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
    Ok(LoweredProgram { module, outputs, checks, constants })
}

/// A program lowered into a builder (see [`lower_into`]).
pub struct Lowered {
    /// Each result's value, of the result's type.
    pub results: Vec<Val>,
    /// The device-side checks of the ops: a bool scalar each, the check, the op's name.
    pub checks: Vec<(Val, Check, &'static str)>,
    /// With [`Constants::Arguments`], the value (bytes, dtype) of each argument after the parameters.
    pub constants: Vec<(Vec<u8>, DType)>,
}

/// Lowers `p` (verified first) into `b`, a builder with no arguments yet:
/// the parameters become its arguments, flat, in order (then, with
/// [`Constants::Arguments`], the creation values).
pub fn lower_into(b: &mut Builder, p: &Program, constants: Constants) -> Result<Lowered> {
    p.verify()?;
    let mut shared = Shared::default();
    let mut vals: Vec<Option<Val>> = vec![None; p.num_values()];
    for param in p.params() {
        let m = p.meta(param.value);
        let flat = b.add_arg(Ty::new(&[m.shape.iter().product()], m.dtype));
        vals[param.value.index()] = Some(b.reshape(&flat, &m.shape));
    }
    let mut checks = vec![];
    for inst in p.insts() {
        let x: Vec<Val> =
            inst.args.iter().map(|a| vals[a.index()].clone().ok_or_else(|| missing(a))).collect::<Result<_>>()?;
        let results = match &inst.op {
            Op::View(v) => {
                let n = x[0].ty.numel();
                let flat = b.reshape(&x[0], &[n]);
                let layout = match v {
                    ViewOp::AsStrided { shape, strides, offset } => {
                        Layout::new(shape.clone(), strides.iter().copied().collect(), *offset)
                    }
                    other => other.apply(&Layout::contiguous(x[0].shape()))?,
                };
                vec![read_view(b, &flat, &layout)?]
            }
            Op::Assign { shape, strides, offset } => {
                let n = x[0].ty.numel();
                let flat = b.reshape(&x[0], &[n]);
                let layout = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
                let written = write_view(b, &flat, &layout, &x[1])?;
                vec![b.reshape(&written, x[0].shape())]
            }
            Op::Full { .. } | Op::Arange { .. } if constants == Constants::Arguments => {
                let args = shared.args(b, &inst.op)?;
                vec![creation_lower(b, &inst.op, &args)?]
            }
            Op::Full { value, dtype, .. } => {
                let lit = match *value {
                    Scalar::Bool(v) => Lit::B(v),
                    Scalar::Int(v) => Lit::I(v),
                    Scalar::Float(v) => Lit::F(v),
                };
                let c = b.constant(lit, *dtype);
                vec![creation_lower(b, &inst.op, &[c])?]
            }
            Op::Arange { start, step, .. } => {
                let args = [b.constant(Lit::F(*start), DType::F64), b.constant(Lit::F(*step), DType::F64)];
                vec![creation_lower(b, &inst.op, &args)?]
            }
            op => {
                let (r, c) = lower_op(b, op, &x, &inst.outs)?;
                checks.extend(c.into_iter().map(|(v, c)| (v, c, op.name())));
                r
            }
        };
        check_results(&inst.op, &results, &inst.outs)?;
        for (v, r) in inst.results().zip(results) {
            vals[v.index()] = Some(r);
        }
    }
    let results = p
        .results()
        .iter()
        .map(|r| vals[r.value.index()].clone().ok_or_else(|| missing(r.value)))
        .collect::<Result<_>>()?;
    Ok(Lowered { results, checks, constants: shared.values })
}

/// The arguments holding creation values, one per distinct value.
#[derive(Default)]
struct Shared {
    args: HashMap<(DType, Vec<u8>), Val>,
    values: Vec<(Vec<u8>, DType)>,
}

impl Shared {
    /// The arguments of a creation op's values, made on first use.
    fn args(&mut self, b: &mut Builder, op: &Op) -> Result<Vec<Val>> {
        let values = creation_args(op).ok_or_else(|| Error::backend("pjrt", format!("{} has no values", op.name())))?;
        Ok(values
            .into_iter()
            .map(|(bytes, dt)| {
                self.args
                    .entry((dt, bytes.clone()))
                    .or_insert_with(|| {
                        self.values.push((bytes, dt));
                        b.add_arg(Ty::new(&[1], dt))
                    })
                    .clone()
            })
            .collect())
    }
}
