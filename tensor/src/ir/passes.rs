//! Program passes: dead-code elimination and common-subexpression
//! elimination. Both return a new program, renumbered; parameters and
//! results are kept as they are (they are the program's signature).
use super::program::{Program, Value};
use smallvec::SmallVec;
use std::collections::HashMap;

impl Program {
    /// Removes the instructions no result depends on. Programs are pure
    /// (writes are values, Note \[Programs\]), so nothing else is observable.
    pub fn dce(&self) -> Program {
        let mut live = vec![false; self.num_values()];
        for r in &self.results {
            live[r.value.index()] = true;
        }
        let mut keep = vec![false; self.insts.len()];
        for (i, inst) in self.insts.iter().enumerate().rev() {
            if inst.results().any(|v| live[v.index()]) {
                keep[i] = true;
                for a in &inst.args {
                    live[a.index()] = true;
                }
            }
        }
        self.rebuild(|_, i, _| keep[i].then_some(None))
    }

    /// Merges instructions that apply an equal op to the same operands: the
    /// later one's outputs become the earlier one's. Random ops are pure
    /// functions of the generator state they read (Note \[Generators\]), so two
    /// draws from the same state are the same draw.
    pub fn cse(&self) -> Program {
        // (op name, operands) -> instructions of the new program with that key.
        let mut seen: HashMap<(&'static str, SmallVec<[Value; 4]>), Vec<usize>> = HashMap::new();
        self.rebuild(|out, _, inst| {
            let key = (inst.op.name(), inst.args.clone());
            let found = seen.get(&key).and_then(|cands| {
                cands
                    .iter()
                    .find(|&&j| super::program::same_op(&out.insts[j].op, &inst.op) && out.insts[j].outs == inst.outs)
                    .copied()
            });
            match found {
                Some(j) => Some(Some(out.insts[j].first)),
                None => {
                    seen.entry(key).or_default().push(out.insts.len());
                    Some(None)
                }
            }
        })
    }

    /// Copies the program instruction by instruction. `decide(new, i, inst)`
    /// sees the instruction with its operands already renumbered and says:
    /// `None` drop it, `Some(None)` keep it, `Some(Some(v))` replace its
    /// outputs by the values from `v` on.
    pub(super) fn rebuild(
        &self,
        mut decide: impl FnMut(&Program, usize, &super::program::Inst) -> Option<Option<Value>>,
    ) -> Program {
        let mut map = vec![Value(u32::MAX); self.num_values()];
        let mut out = Program::new();
        for p in &self.params {
            map[p.value.index()] = out.add_param(p.kind.clone(), self.meta(p.value).clone());
        }
        for (i, inst) in self.insts.iter().enumerate() {
            let mut renamed = inst.clone();
            renamed.args = inst.args.iter().map(|a| map[a.index()]).collect();
            match decide(&out, i, &renamed) {
                None => {}
                Some(Some(first)) => {
                    for (k, old) in inst.results().enumerate() {
                        map[old.index()] = Value(first.0 + k as u32);
                    }
                }
                Some(None) => {
                    let new = out.push_defined(renamed.op, &renamed.args, renamed.outs);
                    for (old, new) in inst.results().zip(new) {
                        map[old.index()] = new;
                    }
                }
            }
        }
        for r in &self.results {
            out.results.push(super::program::ProgramResult { value: map[r.value.index()], kind: r.kind.clone() });
        }
        out
    }
}
