//! Elementwise fusion for interpreted programs: which instructions run
//! together as one pass over their elements, and the order the interpreter
//! runs instructions and fused groups in (Note \[Fused groups\]).
use super::program::{Def, Inst, Program, Value};
use crate::{Result, Storage, Tensor};
use std::sync::Arc;

// Note [Fused groups]
// ~~~~~~~~~~~~~~~~~~~
// A chain of elementwise ops run one by one reads and writes every
// intermediate array in memory; run as one pass, each element of the
// chain's inputs is read once, the chain is computed on a small block that
// stays in cache, and only the values something else needs are written. A
// backend that can run such chains (the CPU) gives the interpreter a `Fuser`:
// it says which instructions it can run in a group (`Fuser::fusible`) and
// readies a group to run (`Fuser::compile`); `schedule` forms the groups.
//
// A group is a run of fusible instructions in program order, all with one
// output shape. An instruction between its members that reads no member
// (the `full` and broadcasting view by which a scalar enters a chain, the
// scalar arithmetic of an optimizer, a product) runs in its place, before
// the group, which runs where its last member stood; one that reads a member
// ends the group first (a fusible one of another shape starts the next
// group). So every input of a member is defined before the group runs, and
// an instruction reading a member's value runs after it. Programs are pure
// (Note [Programs]), so the order changes nothing but when memory is freed:
// an in-place write the interpreter would make into a storage a waiting
// group still reads becomes a copy, as the last uses below say. A group's `outputs` are the members' values
// read outside it (or returned); the rest are never written to memory. The
// interpreter counts a value's last use in these steps, so a group's inputs
// stay live (and unwritten) until it has run.
//
// A fused group computes what its instructions compute one by one: the
// backend evaluates each member with its eager kernel's arithmetic, rounding
// as the eager op rounds, so replays give the eager numbers.

/// Instructions run as one pass (Note \[Fused groups\]).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The member instructions (indices into the program), in order.
    pub members: Vec<usize>,
    /// Values read by members and defined outside the group, in first-use order.
    pub inputs: Vec<Value>,
    /// Members' values read outside the group or returned, in definition order.
    pub outputs: Vec<Value>,
}

/// A backend's elementwise fusion (Note \[Fused groups\]).
pub trait Fuser: Send + Sync {
    /// Whether `inst` of `program` can be a member of a group.
    fn fusible(&self, program: &Program, inst: &Inst) -> bool;
    /// `group` of `program` readied to run.
    fn compile(&self, program: &Program, group: &Group) -> Result<Arc<dyn FusedKernel>>;
}

/// A group ready to run.
pub trait FusedKernel: Send + Sync {
    /// Runs the group on its inputs (one tensor per [`Group::inputs`], as the
    /// interpreter holds them: any layout), returning one contiguous storage
    /// per [`Group::outputs`].
    fn run(&self, inputs: &[&Tensor]) -> Result<Vec<Arc<Storage>>>;
}

/// One step of a run: an instruction, or a fused group (an index into the groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Inst(usize),
    Group(usize),
}

/// The steps `program` runs in and its groups of two or more members (Note
/// \[Fused groups\]); an instruction in no group is a step of its own.
pub fn schedule(program: &Program, fuser: &dyn Fuser) -> (Vec<Step>, Vec<Group>) {
    let insts = program.insts();
    let mut steps = Vec::with_capacity(insts.len());
    let mut groups: Vec<Group> = vec![];
    // Which instruction's group (by member list) each value comes from, while open.
    let mut open: Vec<usize> = vec![];
    let mut in_open = vec![false; insts.len()];
    let member_of = |v: Value, in_open: &[bool]| match program.def(v) {
        Def::Inst(i, _) => in_open[i],
        Def::Param(_) => false,
    };
    let mut close = |open: &mut Vec<usize>, in_open: &mut Vec<bool>, steps: &mut Vec<Step>| {
        match open.len() {
            0 => {}
            1 => steps.push(Step::Inst(open[0])),
            _ => {
                steps.push(Step::Group(groups.len()));
                groups.push(Group { members: open.clone(), inputs: vec![], outputs: vec![] });
            }
        }
        for &i in open.iter() {
            in_open[i] = false;
        }
        open.clear();
    };
    for (i, inst) in insts.iter().enumerate() {
        let reads_open = inst.args.iter().any(|&a| member_of(a, &in_open));
        if fuser.fusible(program, inst) && inst.outs.len() == 1 {
            let same_shape = open.first().is_none_or(|&j| insts[j].outs[0].shape == inst.outs[0].shape);
            if same_shape || reads_open {
                if !same_shape {
                    close(&mut open, &mut in_open, &mut steps);
                }
                open.push(i);
                in_open[i] = true;
                continue;
            }
        }
        if reads_open {
            close(&mut open, &mut in_open, &mut steps);
        }
        steps.push(Step::Inst(i));
    }
    close(&mut open, &mut in_open, &mut steps);
    // Inputs and outputs of each group.
    let mut group_of = vec![usize::MAX; insts.len()];
    for (g, grp) in groups.iter().enumerate() {
        for &i in &grp.members {
            group_of[i] = g;
        }
    }
    let in_group = |v: Value, g: usize| matches!(program.def(v), Def::Inst(i, _) if group_of[i] == g);
    let mut read_outside = vec![false; program.num_values()];
    for (i, inst) in insts.iter().enumerate() {
        for &a in &inst.args {
            if let Def::Inst(j, _) = program.def(a) {
                if group_of[j] != usize::MAX && group_of[j] != group_of[i] {
                    read_outside[a.index()] = true;
                }
            }
        }
    }
    for r in program.results() {
        read_outside[r.value.index()] = true;
    }
    for (g, grp) in groups.iter_mut().enumerate() {
        for &i in &grp.members {
            for &a in &insts[i].args {
                if !in_group(a, g) && !grp.inputs.contains(&a) {
                    grp.inputs.push(a);
                }
            }
            let v = insts[i].first;
            if read_outside[v.index()] {
                grp.outputs.push(v);
            }
        }
    }
    (steps, groups)
}

/// For each value, the last step reading it (`steps.len()` for a result,
/// `None` when nothing reads it): [`Program::last_uses`] over a schedule.
pub fn last_uses_in(program: &Program, steps: &[Step], groups: &[Group]) -> Vec<Option<usize>> {
    let mut last = vec![None; program.num_values()];
    for (s, step) in steps.iter().enumerate() {
        match *step {
            Step::Inst(i) => {
                for a in &program.insts()[i].args {
                    last[a.index()] = Some(s);
                }
            }
            Step::Group(g) => {
                for a in &groups[g].inputs {
                    last[a.index()] = Some(s);
                }
            }
        }
    }
    for r in program.results() {
        last[r.value.index()] = Some(steps.len());
    }
    last
}
