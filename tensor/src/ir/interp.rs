//! Running a program instruction by instruction through `Backend::exec` and
//! `Backend::assign`: every backend's default `Backend::compile`, so a backend
//! with no compiler of its own still runs captured programs (Note \[Programs\]).
use super::fuse::{last_uses_in, schedule, FusedKernel, Fuser, Group, Step};
use super::program::{Def, Inst, Program, ResultKind, Value};
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

/// The interpreter: a verified program, the order it runs in (instructions
/// and fused groups, Note \[Fused groups\]) and the backend that runs its ops.
pub struct Interpreter {
    program: Program,
    device: Device,
    backend: &'static dyn Backend,
    steps: Vec<Step>,
    groups: Vec<(Group, Arc<dyn FusedKernel>)>,
    /// For each value, the last step reading it (`steps.len()` for results).
    last: Vec<Option<usize>>,
    /// Parameters whose storage the program may write (those it updates).
    writable: Vec<bool>,
}

impl Interpreter {
    /// Verifies `program` and readies it to run on `device`, an instruction at a time.
    pub fn new(program: Program, device: Device) -> Result<Interpreter> {
        program.verify()?;
        let steps = (0..program.insts.len()).map(Step::Inst).collect();
        Interpreter::with_steps(program, device, steps, vec![])
    }

    /// [`Interpreter::new`], running the groups of elementwise instructions
    /// that `fuser` can run as one pass each (Note \[Fused groups\]).
    pub fn with_fuser(program: Program, device: Device, fuser: &dyn Fuser) -> Result<Interpreter> {
        program.verify()?;
        let (steps, groups) = schedule(&program, fuser);
        let groups = groups
            .into_iter()
            .map(|g| {
                let k = fuser.compile(&program, &g)?;
                Ok((g, k))
            })
            .collect::<Result<Vec<_>>>()?;
        Interpreter::with_steps(program, device, steps, groups)
    }

    fn with_steps(
        program: Program,
        device: Device,
        steps: Vec<Step>,
        groups: Vec<(Group, Arc<dyn FusedKernel>)>,
    ) -> Result<Interpreter> {
        let backend = device.backend()?;
        let plain: Vec<Group> = groups.iter().map(|g| g.0.clone()).collect();
        let last = last_uses_in(&program, &steps, &plain);
        let mut writable = vec![false; program.params.len()];
        for r in &program.results {
            if let ResultKind::Update(p) = r.kind {
                writable[p] = true;
            }
        }
        Ok(Interpreter { program, device, backend, steps, groups, last, writable })
    }

    /// The fused groups this interpreter runs (Note \[Fused groups\]).
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter().map(|g| &g.0)
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

/// The value `v` holds now, or an error when it is not live.
fn live(vals: &[Option<Tensor>], v: Value) -> Result<&Tensor> {
    vals[v.index()].as_ref().ok_or_else(|| Error::invalid("program", format!("{v} is not live")))
}

impl Interpreter {
    /// Whether step `s` may write into the storage of `t`, the value `v`: this
    /// run may write the storage (it made it, or the program updates the
    /// parameter holding it), `t` is contiguous, and no value read after `s`
    /// (`v` included) aliases it.
    fn may_overwrite(&self, v: Value, t: &Tensor, s: usize, vals: &[Option<Tensor>], own: &[*const Storage]) -> bool {
        let st = Arc::as_ptr(t.storage());
        let writable = own.contains(&st)
            || self.program.params.iter().enumerate().any(|(k, q)| {
                self.writable[k] && vals[q.value.index()].as_ref().is_some_and(|t| Arc::as_ptr(t.storage()) == st)
            });
        let aliased_later = vals.iter().enumerate().any(|(w, x)| {
            w != v.index()
                && self.last[w].is_some_and(|l| l > s)
                && x.as_ref().is_some_and(|x| Arc::as_ptr(x.storage()) == st)
        });
        writable && !aliased_later && t.is_contiguous() && self.last[v.index()] == Some(s)
    }

    /// Runs one instruction at step `s`, returning its outputs.
    fn inst(
        &self,
        inst: &Inst,
        s: usize,
        vals: &[Option<Tensor>],
        own: &mut Vec<*const Storage>,
    ) -> Result<Vec<Tensor>> {
        let (b, dev) = (self.backend, self.device);
        let ins: Vec<&Tensor> = inst.args.iter().map(|&a| live(vals, a)).collect::<Result<_>>()?;
        Ok(match &inst.op {
            Op::View(v) => vec![view(b, v, ins[0], dev)?],
            Op::Assign { shape, strides, offset } => {
                let base = ins[0];
                let target = if self.may_overwrite(inst.args[0], base, s, vals, own) {
                    base.clone()
                } else {
                    let st = b.exec(&Op::Copy, &[base], &[base.meta()], dev)?.swap_remove(0);
                    own.push(Arc::as_ptr(&st));
                    Tensor::from_storage(st, Layout::contiguous(base.shape()))?
                };
                let l =
                    Layout::new(shape.clone(), strides.iter().copied().collect(), target.layout().offset() + offset);
                let window = Tensor::from_storage(target.storage().clone(), l)?;
                b.assign(&window, ins[1])?;
                target.storage().bump_version();
                vec![target]
            }
            op => {
                let shapes = || crate::profile::shapes_of(&ins);
                let storages = crate::profile::timed(
                    op.name(),
                    shapes,
                    || b.synchronize(dev),
                    || b.exec(op, &ins, &inst.outs, dev),
                )?;
                storages
                    .into_iter()
                    .zip(&inst.outs)
                    .map(|(st, m)| {
                        own.push(Arc::as_ptr(&st));
                        Tensor::from_storage(st, Layout::contiguous(&m.shape))
                    })
                    .collect::<Result<_>>()?
            }
        })
    }
}

impl Executable for Interpreter {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        self.program.check_args(args, self.device)?;
        let _ng = crate::graph::GradModeGuard::set(false);
        let (p, b) = (&self.program, self.backend);
        let mut vals: Vec<Option<Tensor>> = vec![None; p.num_values()];
        for (param, a) in p.params.iter().zip(args) {
            vals[param.value.index()] = Some(a.clone());
        }
        // Storages this run made: the program may write them in place.
        let mut own: Vec<*const Storage> = vec![];
        let mut made_vals: Vec<(Value, Tensor)> = vec![];
        for (s, step) in self.steps.iter().enumerate() {
            let (args, results): (Vec<Value>, Vec<Value>) = match *step {
                Step::Inst(i) => {
                    let inst = &p.insts[i];
                    let outs = self.inst(inst, s, &vals, &mut own)?;
                    for (v, t) in inst.results().zip(outs) {
                        vals[v.index()] = Some(t);
                    }
                    (inst.args.to_vec(), inst.results().collect())
                }
                Step::Group(g) => {
                    let (group, kernel) = &self.groups[g];
                    let ins: Vec<&Tensor> = group.inputs.iter().map(|&a| live(&vals, a)).collect::<Result<_>>()?;
                    // A storage's next value goes into the storage where nothing later reads
                    // the old one and the group's value covers it whole.
                    let dests: Vec<Option<&Tensor>> = group
                        .dests
                        .iter()
                        .map(|d| {
                            d.and_then(|k| {
                                let t = ins[k];
                                let whole = t.layout().offset() == 0 && t.numel() == t.storage().len();
                                (whole && self.may_overwrite(group.inputs[k], t, s, &vals, &own)).then_some(t)
                            })
                        })
                        .collect();
                    let shapes = || {
                        let ops: Vec<&str> = group.members.iter().map(|&i| p.insts[i].op.name()).collect();
                        let numel = ins.iter().map(|t| t.numel()).max().unwrap_or(0);
                        format!("{} over {numel} elements", ops.join("+"))
                    };
                    let storages = crate::profile::timed(
                        "fused",
                        shapes,
                        || b.synchronize(self.device),
                        || kernel.run(&ins, &dests),
                    )?;
                    let mut made = vec![];
                    for ((&v, st), d) in group.outputs.iter().zip(storages).zip(&dests) {
                        if d.is_some_and(|d| Arc::ptr_eq(d.storage(), &st)) {
                            st.bump_version();
                        } else {
                            made.push(Arc::as_ptr(&st));
                        }
                        made_vals.push((v, Tensor::from_storage(st, Layout::contiguous(&p.meta(v).shape))?));
                    }
                    drop(dests);
                    drop(ins);
                    own.extend(made);
                    for (v, t) in made_vals.drain(..) {
                        vals[v.index()] = Some(t);
                    }
                    (group.inputs.clone(), group.outputs.clone())
                }
            };
            // Values read for the last time free their memory now, as eager code
            // would, or hand it to the backend for later instructions and runs.
            for a in args.into_iter().chain(results) {
                if self.last[a.index()].is_none_or(|l| l <= s) && !matches!(p.def(a), Def::Param(_)) {
                    if let Some(t) = vals[a.index()].take() {
                        b.release(t);
                    }
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
        // What is left (an update's value copied into its state) goes back too;
        // the backend keeps no storage that a result or an argument still holds.
        for t in vals.into_iter().flatten() {
            b.release(t);
        }
        Ok(out)
    }
}
