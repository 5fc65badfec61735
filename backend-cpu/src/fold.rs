//! Folded casts (Note \[Folded casts\]): before the CPU interprets a program,
//! the casts that autocast puts around the ops it computes in float32 become
//! part of those ops, so the float32 copies they make are never written.
use crate::kernels;
use kiln_tensor::custom::CustomOpRef;
use kiln_tensor::ir::{Def, Inst, Program, Value};
use kiln_tensor::{CustomOp, DType, HostBuffer, HostInput, Meta, Op, Result, ViewOp};
use std::sync::Arc;

// Note [Folded casts]
// ~~~~~~~~~~~~~~~~~~~
// Autocast runs rotary embeddings, normalisation and the loss in float32: a
// bfloat16 query is cast to float32, rotated, and cast back to bfloat16 for
// attention; a float32 RMS norm's output is cast to bfloat16 for the
// products; the bfloat16 logits are cast to float32 for the log-sum-exp and
// the loss gradient, whose float32 result is cast to bfloat16 for the
// products that follow. Eager ops must write each of those float32 arrays (the next op
// could be anything); a program names every reader. So the CPU rewrites a
// program it compiles, before scheduling it:
//
// - a value cast to float32 from bfloat16 or float16 and read (through
//   views) by `rotary_embedding`, `logsumexp`, `cross_entropy_backward` or
//   `gather` is read narrow by that op, which widens each element in its own
//   loop (`gather` picks the narrow elements, then casts the few it picked);
// - the float32 (first) result of `rotary_embedding`, `rms_norm` or
//   `cross_entropy_backward` whose only reader is (through views) a cast to
//   bfloat16 or float16 is rounded by the op as it stores it.
//
// The folded op is a CPU op of this file (`Widened`), computed in float32
// with the float32 op's own kernel arithmetic: widening is exact, so it
// reads the float32 values the cast would have made, and it rounds each
// result as the cast does (to nearest even), so the folded program gives the
// bits of the program as written. A cast that still has other readers stays;
// the rest is removed with the dead code. `KILN_CPU_FUSE=0` runs programs as
// written, without folding or fusion.

/// `program` with its casts folded into the ops beside them (Note [Folded casts]).
pub(crate) fn fold_casts(program: &Program) -> Result<Program> {
    let insts = program.insts();
    let mut readers: Vec<Vec<usize>> = vec![vec![]; program.num_values()];
    for (i, inst) in insts.iter().enumerate() {
        for a in &inst.args {
            readers[a.index()].push(i);
        }
    }
    let mut is_result = vec![false; program.num_values()];
    for r in program.results() {
        is_result[r.value.index()] = true;
    }
    let mut out = Program::new();
    let mut map: Vec<Option<Value>> = vec![None; program.num_values()];
    for p in program.params() {
        map[p.value.index()] = Some(out.add_param(p.kind.clone(), program.meta(p.value).clone()));
    }
    let mut skip = vec![false; insts.len()];
    for (i, inst) in insts.iter().enumerate() {
        if skip[i] {
            continue;
        }
        let arg = |k: usize, map: &[Option<Value>]| mapped(map, inst.args[k]);
        let f32_out = inst.outs.first().is_some_and(|m| m.dtype == DType::F32);
        let f32_arg = |k: usize| inst.args.get(k).is_some_and(|&a| program.meta(a).dtype == DType::F32);
        // The op, and whether it may read a narrow first operand and round its first result.
        let folded = match &inst.op {
            Op::Rotary if f32_out && f32_arg(1) && f32_arg(2) => Some((Fold::Rotary, true, true)),
            Op::CrossEntropyBackward { smoothing } if f32_out && f32_arg(2) => {
                Some((Fold::CrossEntropyBackward { smoothing: *smoothing }, true, true))
            }
            Op::LogSumExp { dim } if f32_out => Some((Fold::LogSumExp { dim: *dim }, true, false)),
            Op::RmsNorm { eps } if f32_out && f32_arg(0) && f32_arg(1) => {
                Some((Fold::RmsNorm { eps: *eps }, false, true))
            }
            Op::Gather { .. } if f32_out => {
                if let Some((x, views)) = widened_source(program, inst.args[0]) {
                    let narrow = viewed(&mut out, mapped(&map, x)?, &views)?;
                    let picked = out.push(inst.op.clone(), &[narrow, arg(1, &map)?])?[0];
                    map[inst.first.index()] = Some(out.push(Op::Cast(DType::F32), &[picked])?[0]);
                    continue;
                }
                None
            }
            _ => None,
        };
        let Some((fold, reads, rounds)) = folded else {
            copy(&mut out, &mut map, inst)?;
            continue;
        };
        let source = if reads { widened_source(program, inst.args[0]) } else { None };
        let sink = if rounds { rounding_sink(program, &readers, &is_result, inst.first) } else { None };
        if source.is_none() && sink.is_none() {
            copy(&mut out, &mut map, inst)?;
            continue;
        }
        let x = match &source {
            Some((x, views)) => viewed(&mut out, mapped(&map, *x)?, views)?,
            None => arg(0, &map)?,
        };
        let mut args = vec![x];
        for k in 1..inst.args.len() {
            args.push(arg(k, &map)?);
        }
        let to = sink.as_ref().map_or(DType::F32, |s| s.dtype);
        let op = Op::Custom(CustomOpRef(Arc::new(Widened { fold, out: to })));
        let ys = out.push(op, &args)?;
        let y = ys[0];
        for (k, &v) in ys.iter().enumerate().skip(1) {
            map[inst.result(k).index()] = Some(v);
        }
        match sink {
            Some(s) => {
                map[s.last.index()] = Some(viewed(&mut out, y, &s.views)?);
                for j in s.insts {
                    skip[j] = true;
                }
            }
            None => map[inst.first.index()] = Some(y),
        }
    }
    for r in program.results() {
        out.add_result(mapped(&map, r.value)?, r.kind.clone())?;
    }
    Ok(out.dce())
}

/// `inst` as it is, on the new program's values.
fn copy(out: &mut Program, map: &mut [Option<Value>], inst: &Inst) -> Result<()> {
    let args = inst.args.iter().map(|&a| mapped(map, a)).collect::<Result<Vec<_>>>()?;
    for (old, new) in inst.results().zip(out.push_typed(inst.op.clone(), &args, inst.outs.clone())?) {
        map[old.index()] = Some(new);
    }
    Ok(())
}

fn mapped(map: &[Option<Value>], v: Value) -> Result<Value> {
    map[v.index()].ok_or_else(|| kiln_tensor::Error::backend("cpu", format!("folding casts lost {v}")))
}

/// `x` with `views` applied in order.
fn viewed(out: &mut Program, x: Value, views: &[ViewOp]) -> Result<Value> {
    views.iter().try_fold(x, |v, view| Ok(out.push(Op::View(view.clone()), &[v])?[0]))
}

/// Where `v` is a view (any number of views, innermost first) of a float32
/// cast of a bfloat16 or float16 value: that value and the views. A view of
/// a value sees its row-major elements (`as_strided` too, Note \[Programs\]),
/// which the cast keeps, so the views apply to the narrow value alike.
fn widened_source(program: &Program, v: Value) -> Option<(Value, Vec<ViewOp>)> {
    let mut views = vec![];
    let mut v = v;
    loop {
        let Def::Inst(i, 0) = program.def(v) else { return None };
        let inst = &program.insts()[i];
        match &inst.op {
            Op::View(view) => {
                views.push(view.clone());
                v = inst.args[0];
            }
            Op::Cast(DType::F32) if matches!(program.meta(inst.args[0]).dtype, DType::BF16 | DType::F16) => {
                views.reverse();
                return Some((inst.args[0], views));
            }
            _ => return None,
        }
    }
}

/// The single-reader chain from a float32 value to a cast to bfloat16 or
/// float16: the views on the way, the instructions of the chain, the cast's
/// value and dtype.
struct Sink {
    views: Vec<ViewOp>,
    insts: Vec<usize>,
    last: Value,
    dtype: DType,
}

fn rounding_sink(program: &Program, readers: &[Vec<usize>], is_result: &[bool], v: Value) -> Option<Sink> {
    let (mut views, mut insts, mut v) = (vec![], vec![], v);
    loop {
        let [j] = readers[v.index()][..] else { return None };
        if is_result[v.index()] {
            return None;
        }
        let inst = &program.insts()[j];
        insts.push(j);
        match &inst.op {
            Op::View(view) => {
                views.push(view.clone());
                v = inst.first;
            }
            Op::Cast(to @ (DType::BF16 | DType::F16)) => {
                return Some(Sink { views, insts, last: inst.first, dtype: *to });
            }
            _ => return None,
        }
    }
}

/// Which op a [`Widened`] computes.
#[derive(Debug, Clone, Copy)]
enum Fold {
    Rotary,
    LogSumExp { dim: usize },
    CrossEntropyBackward { smoothing: f64 },
    RmsNorm { eps: f64 },
}

/// An op of `Fold` computed in float32 on a first input of float32,
/// bfloat16 or float16 (widened as read), its result rounded once to `out`
/// (Note [Folded casts]).
struct Widened {
    fold: Fold,
    out: DType,
}

impl Widened {
    /// The float32 op it stands for.
    fn op(&self) -> Op {
        match self.fold {
            Fold::Rotary => Op::Rotary,
            Fold::LogSumExp { dim } => Op::LogSumExp { dim },
            Fold::CrossEntropyBackward { smoothing } => Op::CrossEntropyBackward { smoothing },
            Fold::RmsNorm { eps } => Op::RmsNorm { eps },
        }
    }
}

impl CustomOp for Widened {
    fn name(&self) -> &'static str {
        match self.fold {
            Fold::Rotary => "rotary_embedding (widened)",
            Fold::LogSumExp { .. } => "logsumexp (widened)",
            Fold::CrossEntropyBackward { .. } => "cross_entropy_backward (widened)",
            Fold::RmsNorm { .. } => "rms_norm (rounded)",
        }
    }

    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        let Some(x) = inputs.first() else {
            return Err(kiln_tensor::Error::invalid(self.name(), "takes its operand first"));
        };
        if !matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(kiln_tensor::Error::unsupported_dtype(self.name(), x.dtype));
        }
        let mut wide = inputs.to_vec();
        wide[0].dtype = DType::F32;
        let mut outs = self.op().infer(&wide)?.into_vec();
        if let Some(o) = outs.first_mut() {
            o.dtype = self.out;
        }
        Ok(outs)
    }

    fn cpu(&self, ins: &[HostInput<'_>], _outs: &[Meta]) -> Result<Vec<HostBuffer>> {
        if ins.len() != self.op().arity().unwrap_or(ins.len()) {
            return Err(kiln_tensor::Error::invalid(self.name(), format!("got {} inputs", ins.len())));
        }
        Ok(match self.fold {
            Fold::Rotary => vec![kernels::rotary_widened(&ins[0], &ins[1], &ins[2], self.out)?],
            Fold::LogSumExp { dim } => vec![kernels::logsumexp_widened(&ins[0], dim)?],
            Fold::CrossEntropyBackward { smoothing } => {
                vec![kernels::cross_entropy_backward_widened(&ins[0], &ins[1], &ins[2], smoothing, self.out)?]
            }
            Fold::RmsNorm { eps } => kernels::rms_norm_rounded(&ins[0], &ins[1], eps, self.out)?,
        })
    }
}

#[cfg(test)]
mod tests;
