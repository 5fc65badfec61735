//! Running a program instruction by instruction through `Backend::exec` and
//! `Backend::assign`: every backend's default `Backend::compile`, so a backend
//! with no compiler of its own still runs captured programs (Note \[Programs\]).
use super::program::{Def, Program, ResultKind};
use crate::{Backend, Device, Error, Layout, Op, Result, Storage, Tensor, ViewOp};
use std::sync::Arc;

/// A program made ready to run by a backend ([`Backend::compile`]).
pub trait Executable: Send + Sync {
    /// Runs the program on `args`, one tensor per parameter of its type (a
    /// flat storage value: the whole storage, contiguous). A result of kind
    /// `Update(p)` is written into `args[p]`'s memory, which is returned for
    /// it; every other result is returned as a tensor of the result's type.
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>>;

    /// [`Executable::run`], except that a failed device-side check of an op
    /// (an index out of range, ...) comes back beside the results, which
    /// are written as the program computed them: a caller that can name the
    /// failing value (by running the op again on its inputs) does so.
    fn run_then_check(&self, args: &[Tensor]) -> Result<(Vec<Tensor>, Result<()>)> {
        Ok((self.run(args)?, Ok(())))
    }
}

/// The interpreter: a verified program and the backend that runs its ops.
pub struct Interpreter {
    program: Program,
    device: Device,
    backend: &'static dyn Backend,
    /// For each value, the last instruction reading it (`insts.len()` for results).
    last: Vec<Option<usize>>,
    /// Parameters whose storage the program may write (those it updates).
    writable: Vec<bool>,
}

impl Interpreter {
    /// Verifies `program` and readies it to run on `device`.
    pub fn new(program: Program, device: Device) -> Result<Interpreter> {
        program.verify()?;
        let backend = device.backend()?;
        let last = program.last_uses();
        let mut writable = vec![false; program.params.len()];
        for r in &program.results {
            if let ResultKind::Update(p) = r.kind {
                writable[p] = true;
            }
        }
        Ok(Interpreter { program, device, backend, last, writable })
    }
}

/// `t` as a contiguous tensor (itself when it already is one).
fn contiguous(backend: &dyn Backend, t: &Tensor, device: Device) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    let st = backend.exec(&Op::Copy, &[t], &[t.meta()], device)?.swap_remove(0);
    Tensor::from_storage(st, Layout::contiguous(t.shape()))
}

/// A view of a value (Note \[Programs\]: `as_strided` indexes the value's
/// row-major elements), materialising the value first when its layout cannot express it.
fn view(backend: &dyn Backend, v: &ViewOp, t: &Tensor, device: Device) -> Result<Tensor> {
    if let ViewOp::AsStrided { shape, strides, offset } = v {
        let c = contiguous(backend, t, device)?;
        let l = Layout::new(shape.clone(), strides.iter().copied().collect(), c.layout().offset() + offset);
        return Tensor::from_storage(c.storage().clone(), l);
    }
    match v.apply(t.layout()) {
        Ok(l) => Tensor::from_storage(t.storage().clone(), l),
        Err(_) => {
            let c = contiguous(backend, t, device)?;
            Tensor::from_storage(c.storage().clone(), v.apply(c.layout())?)
        }
    }
}

impl Executable for Interpreter {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        self.program.check_args(args, self.device)?;
        let _ng = crate::graph::GradModeGuard::set(false);
        let (p, b, dev) = (&self.program, self.backend, self.device);
        let mut vals: Vec<Option<Tensor>> = vec![None; p.num_values()];
        for (param, a) in p.params.iter().zip(args) {
            vals[param.value.index()] = Some(a.clone());
        }
        // Storages this run made: the program may write them in place.
        let mut own: Vec<*const Storage> = vec![];
        for (i, inst) in p.insts.iter().enumerate() {
            let ins: Vec<&Tensor> = inst
                .args
                .iter()
                .map(|a| vals[a.index()].as_ref().ok_or_else(|| Error::invalid("program", format!("{a} is not live"))))
                .collect::<Result<_>>()?;
            let outs: Vec<Tensor> = match &inst.op {
                Op::View(v) => vec![view(b, v, ins[0], dev)?],
                Op::Assign { shape, strides, offset } => {
                    let base = ins[0];
                    let st = Arc::as_ptr(base.storage());
                    // In place when this run may write the storage and no value read later aliases it.
                    let writable = own.contains(&st)
                        || p.params.iter().enumerate().any(|(k, q)| {
                            self.writable[k]
                                && vals[q.value.index()].as_ref().is_some_and(|t| Arc::as_ptr(t.storage()) == st)
                        });
                    let aliased_later = vals.iter().enumerate().any(|(v, t)| {
                        v != inst.args[0].index()
                            && self.last[v].is_some_and(|l| l > i)
                            && t.as_ref().is_some_and(|t| Arc::as_ptr(t.storage()) == st)
                    });
                    let target = if writable
                        && !aliased_later
                        && base.is_contiguous()
                        && self.last[inst.args[0].index()] == Some(i)
                    {
                        base.clone()
                    } else {
                        let st = b.exec(&Op::Copy, &[base], &[base.meta()], dev)?.swap_remove(0);
                        own.push(Arc::as_ptr(&st));
                        Tensor::from_storage(st, Layout::contiguous(base.shape()))?
                    };
                    let l = Layout::new(
                        shape.clone(),
                        strides.iter().copied().collect(),
                        target.layout().offset() + offset,
                    );
                    let window = Tensor::from_storage(target.storage().clone(), l)?;
                    b.assign(&window, ins[1])?;
                    target.storage().bump_version();
                    vec![target]
                }
                op => {
                    let storages = b.exec(op, &ins, &inst.outs, dev)?;
                    storages
                        .into_iter()
                        .zip(&inst.outs)
                        .map(|(st, m)| {
                            own.push(Arc::as_ptr(&st));
                            Tensor::from_storage(st, Layout::contiguous(&m.shape))
                        })
                        .collect::<Result<_>>()?
                }
            };
            drop(ins);
            for (v, t) in inst.results().zip(outs) {
                vals[v.index()] = Some(t);
            }
            // Values read for the last time free their memory now, as eager code would.
            for a in inst.args.iter().copied().chain(inst.results()) {
                if self.last[a.index()].is_none_or(|l| l <= i) && !matches!(p.def(a), Def::Param(_)) {
                    vals[a.index()] = None;
                }
            }
        }
        let mut out = Vec::with_capacity(p.results.len());
        for r in &p.results {
            let t = vals[r.value.index()].clone().ok_or_else(|| Error::invalid("program", "a result is not live"))?;
            out.push(match r.kind {
                ResultKind::Update(k) => {
                    let dst = &args[k];
                    let same = Arc::ptr_eq(t.storage(), dst.storage()) && t.layout() == dst.layout();
                    if !same {
                        b.assign(dst, &t)?;
                        dst.storage().bump_version();
                    }
                    dst.clone()
                }
                ResultKind::Fresh | ResultKind::State | ResultKind::Check(_) => t,
            });
        }
        Ok(out)
    }
}
