//! The CPU's elementwise fusion (Note \[Fused groups\] in kiln-tensor): a
//! group of float32 unary and binary ops runs as one pass over blocks of
//! `BLOCK` elements, each member computed with its eager kernel
//! (`elementwise::unary_slice` / `binary_slice`) into a block that stays in
//! the L1 cache, so replays give eager's numbers bit for bit.
use super::elem::assume_init;
use super::elementwise::{binary_cost, binary_slice, unary_cost, unary_slice};
use super::iter::{par_ranges_by, OutPtr};
use super::Input;
use crate::backend::{host, lock_inputs};
use kiln_tensor::ir::{FusedKernel, Fuser, Group, Inst, Program, Value};
use kiln_tensor::{BinaryOp, DType, Device, Error, HostBuffer, Op, Result, Storage, Tensor, UnaryOp};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Elements per block: a member's block is 4 KiB, so a group's blocks stay in L1.
const BLOCK: usize = 1024;

/// The CPU backend's [`Fuser`].
pub(crate) struct CpuFuser;

/// Whether the CPU runs `op` inside a fused group (given float32 operands):
/// the float unary and binary ops, whose eager kernels work on slices. `pow`
/// stays out: its eager kernel takes shortcuts for a scalar exponent that a
/// block of the group cannot see.
fn fuses(op: &Op) -> bool {
    match op {
        Op::Unary(u) => unary_cost(*u).is_some(),
        Op::Binary(b) => *b != BinaryOp::Pow && binary_cost(*b).is_some(),
        Op::Full { .. }
        | Op::Arange { .. }
        | Op::RandomBits { .. }
        | Op::Compare(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Copy
        | Op::View(_)
        | Op::Assign { .. }
        | Op::Reduce { .. }
        | Op::ArgReduce { .. }
        | Op::Softmax { .. }
        | Op::Rotary
        | Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::CrossEntropyBackward { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormBackward { .. }
        | Op::LogSumExp { .. }
        | Op::Cumsum { .. }
        | Op::MatMul
        | Op::GroupedMatMul
        | Op::Cat { .. }
        | Op::Scatter { .. }
        | Op::IndexAdd { .. }
        | Op::IndexSelect { .. }
        | Op::Gather { .. }
        | Op::Sort { .. }
        | Op::TopK { .. }
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::Collective(_)
        | Op::Redistribute(_)
        | Op::LocalMap(_)
        | Op::PagedAttention { .. }
        | Op::Custom(_) => false,
    }
}

impl Fuser for CpuFuser {
    fn fusible(&self, program: &Program, inst: &Inst) -> bool {
        let f32s = inst.outs.iter().all(|m| m.dtype == DType::F32)
            && inst.args.iter().all(|&a| program.meta(a).dtype == DType::F32);
        f32s && fuses(&inst.op)
    }

    fn compile(&self, program: &Program, group: &Group) -> Result<Arc<dyn FusedKernel>> {
        let first = program.insts()[group.members[0]].first;
        let numel = program.meta(first).shape.iter().product();
        let slot_of = |v: Value| -> Src {
            if let Some(k) = group.inputs.iter().position(|&x| x == v) {
                return Src::Input(k);
            }
            let m = group.members.iter().position(|&i| program.insts()[i].first == v).unwrap_or(usize::MAX);
            Src::Member(m)
        };
        let steps = group
            .members
            .iter()
            .map(|&i| {
                let inst = &program.insts()[i];
                let args = [slot_of(inst.args[0]), inst.args.get(1).map_or(Src::Input(usize::MAX), |&a| slot_of(a))];
                let out = group.outputs.iter().position(|&o| o == inst.first);
                match inst.op {
                    Op::Unary(u) => Ok(Member { op: Fused::Unary(u), args, out }),
                    Op::Binary(b) => Ok(Member { op: Fused::Binary(b), args, out }),
                    ref op => Err(Error::backend("cpu", format!("{} cannot run in a fused group", op.name()))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(CpuGroup { members: steps, inputs: group.inputs.len(), outputs: group.outputs.len(), numel }))
    }
}

/// Where a member reads an operand: a group input or an earlier member's block.
#[derive(Debug, Clone, Copy)]
enum Src {
    Input(usize),
    Member(usize),
}

#[derive(Debug, Clone, Copy)]
enum Fused {
    Unary(UnaryOp),
    Binary(BinaryOp),
}

#[derive(Debug)]
struct Member {
    op: Fused,
    args: [Src; 2],
    /// The group output it is, if any.
    out: Option<usize>,
}

/// A compiled group.
struct CpuGroup {
    members: Vec<Member>,
    inputs: usize,
    outputs: usize,
    numel: usize,
}

/// How a block reads one input.
enum Operand<'a> {
    /// Contiguous elements.
    Slice(&'a [f32]),
    /// One value everywhere (a broadcast scalar).
    Splat(f32),
}

impl FusedKernel for CpuGroup {
    fn run(&self, inputs: &[&Tensor]) -> Result<Vec<Arc<Storage>>> {
        if inputs.len() != self.inputs {
            return Err(Error::backend("cpu", format!("a fused group of {} inputs got {}", self.inputs, inputs.len())));
        }
        let guards = lock_inputs(inputs);
        // Inputs that are neither contiguous nor one broadcast value are copied first.
        let copies: Vec<Option<Vec<f32>>> = inputs
            .iter()
            .map(|t| {
                let l = t.layout();
                let splat = l.shape().iter().zip(l.strides()).all(|(&d, &s)| d == 1 || s == 0);
                if t.is_contiguous() || splat {
                    return Ok(None);
                }
                let x = Input { buf: host(&guards, t)?, layout: l };
                Ok(Some(x.contiguous::<f32>()?.into_owned()))
            })
            .collect::<Result<_>>()?;
        let operands: Vec<Operand<'_>> = inputs
            .iter()
            .zip(&copies)
            .map(|(t, c)| {
                if let Some(c) = c {
                    return Ok(Operand::Slice(&c[..]));
                }
                let x = Input { buf: host(&guards, t)?, layout: t.layout() };
                let v = x.slice::<f32>()?;
                let off = t.layout().offset();
                Ok(if t.is_contiguous() { Operand::Slice(&v[off..off + self.numel]) } else { Operand::Splat(v[off]) })
            })
            .collect::<Result<_>>()?;
        for o in &operands {
            if let Operand::Slice(s) = o {
                if s.len() != self.numel {
                    return Err(Error::backend("cpu", "a fused group's input has another length than the group"));
                }
            }
        }
        let mut outs: Vec<Vec<MaybeUninit<f32>>> =
            (0..self.outputs).map(|_| Box::<[f32]>::new_uninit_slice(self.numel).into_vec()).collect();
        let ptrs: Vec<OutPtr<MaybeUninit<f32>>> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
        let cost = 2 * self.members.len();
        par_ranges_by(self.numel, cost, BLOCK, &|start, end| self.run_range(&operands, &ptrs, start, end));
        drop(operands);
        drop(guards);
        Ok(outs
            .into_iter()
            .map(|o| {
                // SAFETY: `run_range` over ranges covering `0..numel` wrote every element of every
                // output: each output is some member's, and every member runs on every block.
                let v = unsafe { assume_init(o) };
                Arc::new(Storage::from_host(HostBuffer::F32(v), Device::Cpu))
            })
            .collect())
    }
}

impl CpuGroup {
    /// Computes elements `start..end` block by block, writing the outputs' elements there.
    fn run_range(&self, ins: &[Operand<'_>], outs: &[OutPtr<MaybeUninit<f32>>], start: usize, end: usize) {
        let mut blocks = vec![MaybeUninit::<f32>::uninit(); self.members.len() * BLOCK];
        let mut splats = vec![0f32; ins.len() * BLOCK];
        for (k, o) in ins.iter().enumerate() {
            if let Operand::Splat(v) = o {
                splats[k * BLOCK..(k + 1) * BLOCK].fill(*v);
            }
        }
        let mut b0 = start;
        while b0 < end {
            let n = (end - b0).min(BLOCK);
            for (m, member) in self.members.iter().enumerate() {
                let (done, rest) = blocks.split_at_mut(m * BLOCK);
                let dst = &mut rest[..n];
                let read = |s: Src| -> &[f32] {
                    match s {
                        Src::Input(k) => match &ins[k] {
                            Operand::Slice(v) => &v[b0..b0 + n],
                            Operand::Splat(_) => &splats[k * BLOCK..k * BLOCK + n],
                        },
                        // SAFETY: member `j < m` wrote its first `n` elements of this block above.
                        Src::Member(j) => unsafe {
                            &*(&done[j * BLOCK..j * BLOCK + n] as *const [MaybeUninit<f32>] as *const [f32])
                        },
                    }
                };
                match member.op {
                    Fused::Unary(u) => unary_slice(u, read(member.args[0]), dst),
                    Fused::Binary(b) => binary_slice(b, read(member.args[0]), read(member.args[1]), dst),
                }
                if let Some(o) = member.out {
                    // SAFETY: ranges given to `run_range` are disjoint, so no other task writes
                    // `b0..b0 + n` of this output, which has `numel >= end` elements.
                    unsafe { std::ptr::copy_nonoverlapping(dst.as_ptr(), outs[o].get().add(b0), n) };
                }
            }
            b0 += n;
        }
    }
}
