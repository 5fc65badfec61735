//! The verifier: a program is well formed when every instruction reads values
//! defined before it and its outputs are what [`Op::infer`](crate::Op::infer)
//! gives for its operands' types, and its results are typed as their kinds need.
use super::program::{Def, ParamKind, Program, ResultKind};
use crate::{DType, Error, Result};

fn bad(msg: String) -> Error {
    Error::invalid("program", msg)
}

impl Program {
    /// Checks the program: operands defined before use, outputs as
    /// `Op::infer` types them (re-run on every instruction), results defined,
    /// updates of the type of their parameter, checks bool scalars, inputs
    /// bound once. The error names the instruction and what is wrong.
    pub fn verify(&self) -> Result<()> {
        let mut inputs = std::collections::HashSet::new();
        for (k, p) in self.params.iter().enumerate() {
            if self.def(p.value) != Def::Param(k) {
                return Err(bad(format!("parameter {k} ({}) is not defined as parameter {k}", p.value)));
            }
            if let ParamKind::Input(i) = p.kind {
                if !inputs.insert(i) {
                    return Err(bad(format!("input {i} is bound to two parameters")));
                }
            }
        }
        for (i, inst) in self.insts.iter().enumerate() {
            let at = || format!("instruction {i} ({} = {})", inst.first, inst.op.name());
            let mut metas = Vec::with_capacity(inst.args.len());
            for a in &inst.args {
                let m = self.checked_meta(*a).map_err(|_| bad(format!("{}: reads {a}, which is not defined", at())))?;
                match self.def(*a) {
                    Def::Inst(j, _) if j >= i => {
                        return Err(bad(format!("{}: reads {a}, defined by a later instruction", at())));
                    }
                    _ => {}
                }
                metas.push(m.clone());
            }
            for (k, v) in inst.results().enumerate() {
                if self.checked_meta(v).is_err() || self.def(v) != Def::Inst(i, k) {
                    return Err(bad(format!("{}: output {k} is not numbered {v}", at())));
                }
            }
            let inferred = inst.op.infer(&metas).map_err(|e| bad(format!("{}: {e}", at())))?;
            if inferred.as_slice() != inst.outs.as_slice() {
                let t = |ms: &[crate::Meta]| ms.iter().map(super::print::type_text).collect::<Vec<_>>().join(", ");
                return Err(bad(format!(
                    "{}: declares outputs {} but its operands give {}",
                    at(),
                    t(&inst.outs),
                    t(&inferred)
                )));
            }
        }
        let mut updated = std::collections::HashSet::new();
        for (k, r) in self.results.iter().enumerate() {
            if let ResultKind::Update(p) = r.kind {
                if !updated.insert(p) {
                    return Err(bad(format!("result {k} updates parameter {p}, which another result updates")));
                }
            }
            let m = self.checked_meta(r.value).map_err(|_| bad(format!("result {k} ({}) is not defined", r.value)))?;
            match &r.kind {
                ResultKind::Update(p) => {
                    let param = self
                        .params
                        .get(*p)
                        .ok_or_else(|| bad(format!("result {k} updates parameter {p}, which does not exist")))?;
                    if matches!(param.kind, ParamKind::Constant) {
                        return Err(bad(format!("result {k} updates the constant {}", param.value)));
                    }
                    if self.meta(param.value) != m {
                        return Err(bad(format!(
                            "result {k} ({}) updates {} of another type",
                            super::print::type_text(m),
                            param.value
                        )));
                    }
                }
                ResultKind::Check(_) if !(m.dtype == DType::Bool && m.shape.is_empty()) => {
                    return Err(bad(format!("result {k} is a check but not a bool scalar")));
                }
                ResultKind::Fresh | ResultKind::State | ResultKind::Check(_) => {}
            }
        }
        Ok(())
    }
}
