//! Elementwise fusion for interpreted programs: which instructions run
//! together as one pass over their elements, and the order the interpreter
//! runs instructions and fused groups in (Note \[Fused groups\]).
use super::program::{Def, Inst, Program, Value};
use crate::{contiguous_strides, Op, Result, Storage, Tensor, ViewOp};
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
// number of elements, which they hold in row-major order. Besides the
// elementwise ops a backend fuses, a view of a member that keeps that order
// (a reshape) is the member, and a `copy_` of a member over a whole storage
// (Note [Programs]: the storage's next value) is too; such an output may be
// written straight into the storage (`Group::dests`, below). An instruction
// between the members that reads no member (the `full` and broadcasting view
// by which a scalar enters a chain, an optimizer's scalar step counts, a
// product) runs in its place, before the group, which runs where its last
// member stood; one that reads a member ends the group first, and a fusible
// one of another size (a scalar aside) starts the next group. So every input of a member is defined before the group runs, and
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
//
// An output that is a storage's next value names the group input holding
// the storage's current value; the interpreter offers that storage to the
// group when the run may write it (it made it, or the program updates the
// parameter holding it), the value covers it whole, and nothing read after
// the group aliases it, as for an in-place `copy_`. The backend writes it
// there only where that is safe (CPU: Note [Writing what a group reads]), so
// an optimizer's update reads its state and writes the next state in one
// pass. Of several outputs into one storage, the last one written gets it.

/// Instructions run as one pass (Note \[Fused groups\]).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The member instructions (indices into the program), in order.
    pub members: Vec<usize>,
    /// Values read by members and defined outside the group, in first-use order.
    pub inputs: Vec<Value>,
    /// Members' values read outside the group or returned, in definition order.
    pub outputs: Vec<Value>,
    /// For each output, the input whose storage it may be written into: an
    /// output that is a storage's next value (`copy_` of a whole storage)
    /// names the storage's current value (Note \[Fused groups\]).
    pub dests: Vec<Option<usize>>,
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
    /// per [`Group::outputs`]: `dests[k]`'s storage where the interpreter
    /// offers one (a whole, contiguous storage it may overwrite) and the
    /// kernel can write it safely, else a fresh one.
    fn run(&self, inputs: &[&Tensor], dests: &[Option<&Tensor>]) -> Result<Vec<Arc<Storage>>>;
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
                groups.push(Group { members: open.clone(), inputs: vec![], outputs: vec![], dests: vec![] });
            }
        }
        for &i in open.iter() {
            in_open[i] = false;
        }
        open.clear();
    };
    let numel = |v: Value| program.meta(v).shape.iter().product::<usize>();
    for (i, inst) in insts.iter().enumerate() {
        let reads_open = inst.args.iter().any(|&a| member_of(a, &in_open));
        let joins = match &inst.op {
            // A view of a member that keeps its elements' order is the member.
            Op::View(v) => member_of(inst.args[0], &in_open) && keeps_order(v, numel(inst.args[0])),
            // A member written over a whole storage is that storage's next value.
            Op::Assign { shape, strides, offset } => {
                let (base, src) = (inst.args[0], inst.args[1]);
                let chained = match program.def(base) {
                    Def::Inst(j, _) => !in_open[j] || matches!(insts[j].op, Op::Assign { .. }),
                    Def::Param(_) => true,
                };
                member_of(src, &in_open)
                    && chained
                    && *offset == 0
                    && strides[..] == contiguous_strides(shape)[..]
                    && shape.iter().product::<usize>() == numel(base)
            }
            _ => fuser.fusible(program, inst) && inst.outs.len() == 1,
        };
        if joins {
            let same = open.first().is_none_or(|&j| numel(insts[j].first) == numel(inst.first));
            // Scalar arithmetic between members (an optimizer's step counts) passes the group.
            if same || reads_open || numel(inst.first) > 1 {
                if !same {
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
                grp.dests.push(storage_root(program, &grp.inputs, v, &|x| in_group(x, g)));
            }
        }
        // One output per storage: the last one written keeps it.
        for k in 0..grp.dests.len() {
            if grp.dests[k].is_some() && grp.dests[k + 1..].contains(&grp.dests[k]) {
                grp.dests[k] = None;
            }
        }
    }
    (steps, groups)
}

/// Whether view `v` of a value of `n` elements keeps them, in row-major order.
fn keeps_order(v: &ViewOp, n: usize) -> bool {
    match v {
        ViewOp::Reshape(_) | ViewOp::Unsqueeze(_) | ViewOp::Squeeze(_) => true,
        ViewOp::AsStrided { shape, strides, offset } => {
            *offset == 0 && strides[..] == contiguous_strides(shape)[..] && shape.iter().product::<usize>() == n
        }
        ViewOp::Permute(_)
        | ViewOp::Expand(_)
        | ViewOp::Slice { .. }
        | ViewOp::Select { .. }
        | ViewOp::Diagonal { .. } => false,
    }
}

/// For a member `v` that is a storage's next value (a `copy_` member, maybe
/// after others into the same storage), the group input holding the
/// storage's current value.
fn storage_root(program: &Program, inputs: &[Value], v: Value, member: &dyn Fn(Value) -> bool) -> Option<usize> {
    let mut v = v;
    loop {
        let Def::Inst(i, _) = program.def(v) else { return None };
        let inst = &program.insts()[i];
        if !matches!(inst.op, Op::Assign { .. }) {
            return None;
        }
        let base = inst.args[0];
        if !member(base) {
            return inputs.iter().position(|&x| x == base);
        }
        v = base;
    }
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
