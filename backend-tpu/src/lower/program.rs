//! The lowering of kiln's `Program` (Note \[Programs\] in kiln-tensor's
//! `ir/mod.rs`) to one StableHLO module: parameters and results as flat
//! buffers (the backend's storages), views read and writes made as the
//! eager ops make them (`read_view`, `write_view`), creation values as
//! constants, each primitive through `lower_op`, updated parameters donated.
use super::{check_results, creation_lower, lower_op, read_view, write_view, Builder, Check, Lit, Module, Ty, Val};
use kiln_tensor::ir::{Program, ResultKind};
use kiln_tensor::{DType, Error, Layout, Op, Result, Scalar, ViewOp};

/// A lowered program: its module text and what its trailing outputs check.
pub struct LoweredProgram {
    pub module: Module,
    /// The flat type of each output: one per program result, then one bool per check.
    pub outputs: Vec<(DType, Vec<usize>)>,
    /// The device-side checks of the ops (after the program's results), with the op's name.
    pub checks: Vec<(Check, &'static str)>,
}

fn missing(v: impl std::fmt::Display) -> Error {
    Error::invalid("program", format!("{v} is not defined before its use"))
}

/// Lowers `p` (verified first) to a module whose arguments are the
/// parameters, flat, and whose outputs are the results, flat, then the
/// ops' check flags. A parameter that a result updates is donated to it.
pub fn lower_program(p: &Program) -> Result<LoweredProgram> {
    p.verify()?;
    let mut b = Builder::new(&[]).0;
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
                vec![read_view(&mut b, &flat, &layout)?]
            }
            Op::Assign { shape, strides, offset } => {
                let n = x[0].ty.numel();
                let flat = b.reshape(&x[0], &[n]);
                let layout = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
                let written = write_view(&mut b, &flat, &layout, &x[1])?;
                vec![b.reshape(&written, x[0].shape())]
            }
            Op::Full { value, dtype, .. } => {
                let lit = match *value {
                    Scalar::Bool(v) => Lit::B(v),
                    Scalar::Int(v) => Lit::I(v),
                    Scalar::Float(v) => Lit::F(v),
                };
                let c = b.constant(lit, *dtype);
                vec![creation_lower(&mut b, &inst.op, &[c])?]
            }
            Op::Arange { start, step, .. } => {
                let args = [b.constant(Lit::F(*start), DType::F64), b.constant(Lit::F(*step), DType::F64)];
                vec![creation_lower(&mut b, &inst.op, &args)?]
            }
            op => {
                let (r, c) = lower_op(&mut b, op, &x, &inst.outs)?;
                checks.extend(c.into_iter().map(|(v, c)| (v, c, op.name())));
                r
            }
        };
        check_results(&inst.op, &results, &inst.outs)?;
        for (v, r) in inst.results().zip(results) {
            vals[v.index()] = Some(r);
        }
    }
    let mut outs = vec![];
    let mut outputs = vec![];
    for (j, r) in p.results().iter().enumerate() {
        let v = vals[r.value.index()].clone().ok_or_else(|| missing(r.value))?;
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
    Ok(LoweredProgram { module, outputs, checks: checks.into_iter().map(|(_, c, n)| (c, n)).collect() })
}
