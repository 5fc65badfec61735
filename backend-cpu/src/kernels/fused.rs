//! The CPU's elementwise fusion (Note \[Fused groups\] in kiln-tensor): a
//! group of float32 unary and binary ops runs as one pass over blocks of
//! `BLOCK` elements, each member computed with its eager kernel
//! (`elementwise::unary_slice` / `binary_slice`) into a block that stays in
//! the L1 cache, so replays give eager's numbers bit for bit.
use super::elem::{assume_init, uninit};
use super::elementwise::{binary_cost, binary_slice, unary_cost, unary_slice};
use super::iter::par_ranges_by;
use super::Input;
use kiln_tensor::ir::{FusedKernel, Fuser, Group, Inst, Program, Value};
use kiln_tensor::{BinaryOp, DType, Device, Error, HostBuffer, Op, Result, Storage, Tensor, UnaryOp};
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Elements per block: a member's block is 4 KiB, so a group's blocks stay in L1.
const BLOCK: usize = 1024;

/// The CPU backend's [`Fuser`].
pub(crate) struct CpuFuser;

/// Whether the CPU computes `op` inside a fused group (given float32
/// operands): the float unary and binary ops, whose eager kernels work on
/// slices. `pow` stays out: its eager kernel takes shortcuts for a scalar
/// exponent that a block of the group cannot see. (Views and whole-storage
/// copies of members join groups by the scheduler's own rules and compute
/// nothing: they name a member's block.)
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
        let insts = program.insts();
        let numel = program.meta(insts[group.members[0]].first).shape.iter().product();
        // Each value's block: an input's, or a computing member's; a view or a
        // whole-storage `copy_` of a member is that member's block.
        let mut block: HashMap<Value, Src> =
            group.inputs.iter().enumerate().map(|(k, &v)| (v, Src::Input(k))).collect();
        let mut members = vec![];
        for &i in &group.members {
            let inst = &insts[i];
            let src =
                |a: Value| block.get(&a).copied().ok_or_else(|| Error::backend("cpu", format!("{a} has no block")));
            let op = match inst.op {
                Op::Unary(u) => Fused::Unary(u),
                Op::Binary(b) => Fused::Binary(b),
                Op::View(_) => {
                    block.insert(inst.first, src(inst.args[0])?);
                    continue;
                }
                Op::Assign { .. } => {
                    block.insert(inst.first, src(inst.args[1])?);
                    continue;
                }
                ref op => return Err(Error::backend("cpu", format!("{} cannot run in a fused group", op.name()))),
            };
            let args = [src(inst.args[0])?, inst.args.get(1).map_or(Ok(Src::Input(usize::MAX)), |&a| src(a))?];
            block.insert(inst.first, Src::Member(members.len()));
            members.push(Member { op, args });
        }
        let outputs = group
            .outputs
            .iter()
            .map(|v| block.get(v).copied().ok_or_else(|| Error::backend("cpu", format!("{v} has no block"))))
            .collect::<Result<_>>()?;
        Ok(Arc::new(CpuGroup { members, inputs: group.inputs.len(), outputs, numel }))
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
}

/// A compiled group.
struct CpuGroup {
    /// The members that compute, in order.
    members: Vec<Member>,
    inputs: usize,
    /// Each output's block.
    outputs: Vec<Src>,
    numel: usize,
}

/// How a block reads one input.
#[derive(Clone, Copy)]
enum Operand {
    /// Contiguous elements from this pointer on (valid for the group's length).
    Elems(*const f32),
    /// One value everywhere (a broadcast scalar).
    Splat(f32),
}

/// The operands and outputs, shared by the tasks (Note [Writing what a group reads]).
struct Buffers {
    ins: Vec<Operand>,
    outs: Vec<*mut f32>,
}

// SAFETY: the pointers are into buffers that outlive the parallel loop and
// whose locks the run holds; tasks read and write disjoint ranges of them
// (Note [Writing what a group reads]).
unsafe impl Sync for Buffers {}

// Note [Writing what a group reads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An output written into a storage (an optimizer state's next value goes
// into the state) may be a storage the group also reads: `m` is read and
// its next value written. Each task owns a range of elements; within a
// block it computes every member before writing any output, and an input
// sharing an output's storage is read at the same elements as written (same
// offset, contiguous), so each element is read before it is overwritten and
// no task touches another's elements. A destination that an input reads any
// other way (a broadcast element, another offset) is refused, and that
// output gets a fresh buffer; inputs that are neither contiguous nor
// broadcast are copied before anything is written. The inputs are read
// through raw pointers so that no shared slice covers memory being written.

impl FusedKernel for CpuGroup {
    fn run(&self, inputs: &[&Tensor], dests: &[Option<&Tensor>]) -> Result<Vec<Arc<Storage>>> {
        if inputs.len() != self.inputs || dests.len() != self.outputs.len() {
            return Err(Error::backend("cpu", "a fused group got the wrong number of inputs or destinations"));
        }
        let n = self.numel;
        let splat = |t: &Tensor| t.layout().shape().iter().zip(t.layout().strides()).all(|(&d, &s)| d == 1 || s == 0);
        // A destination is kept when every input of its storage reads it element for element.
        let dests: Vec<Option<&Tensor>> = dests
            .iter()
            .map(|d| {
                d.filter(|d| {
                    // Whole, as the interpreter offers them: the outputs are written from element 0.
                    d.dtype() == DType::F32
                        && d.is_contiguous()
                        && d.layout().offset() == 0
                        && d.numel() == n
                        && d.storage().len() == n
                        && inputs.iter().all(|t| {
                            !t.shares_storage(d)
                                || (t.is_contiguous() && t.layout().offset() == d.layout().offset())
                                || !(splat(t) || t.is_contiguous())
                        })
                })
            })
            .collect();
        // Locks in address order: written storages for writing, the others for reading.
        let mut storages: Vec<(&Arc<Storage>, bool)> = vec![];
        for t in inputs.iter().copied().chain(dests.iter().flatten().copied()) {
            let w = dests.iter().flatten().any(|d| d.shares_storage(t));
            if !storages.iter().any(|(s, _)| Arc::ptr_eq(s, t.storage())) {
                storages.push((t.storage(), w));
            }
        }
        storages.sort_by_key(|(s, _)| s.addr());
        let mut guards: Vec<Guard<'_>> =
            storages.iter().map(|&(s, w)| if w { Guard::Write(s.write()) } else { Guard::Read(s.read()) }).collect();
        let mut base: Vec<(*const Storage, *mut f32, usize)> = vec![];
        for ((s, _), g) in storages.iter().zip(&mut guards) {
            let (ptr, len) = match g {
                Guard::Write(g) => {
                    let v = g.host_mut("cpu")?.as_mut_slice::<f32>().ok_or_else(not_f32)?;
                    (v.as_mut_ptr(), v.len())
                }
                Guard::Read(g) => {
                    let v = g.host("cpu")?.as_slice::<f32>().ok_or_else(not_f32)?;
                    (v.as_ptr().cast_mut(), v.len())
                }
            };
            base.push((Arc::as_ptr(s), ptr, len));
        }
        let find = |t: &Tensor| {
            base.iter().find(|b| b.0 == Arc::as_ptr(t.storage())).map_or((std::ptr::null_mut(), 0), |b| (b.1, b.2))
        };
        // Inputs neither contiguous nor broadcast are copied now, before any write.
        let mut copies: Vec<Vec<f32>> = vec![];
        let mut ins = Vec::with_capacity(inputs.len());
        for t in inputs {
            let (ptr, len) = find(t);
            let l = t.layout();
            if t.is_contiguous() {
                if l.offset() + n > len {
                    return Err(Error::backend("cpu", "a fused group's input is shorter than the group"));
                }
                // SAFETY: `offset + n <= len` elements of the locked buffer.
                ins.push(Operand::Elems(unsafe { ptr.add(l.offset()) }));
            } else if splat(t) {
                if l.offset() >= len {
                    return Err(Error::backend("cpu", "a broadcast input outside its buffer"));
                }
                // SAFETY: `offset < len`, and no output of this run writes this storage yet.
                ins.push(Operand::Splat(unsafe { *ptr.add(l.offset()) }));
            } else {
                // SAFETY: the buffer stays locked and unwritten while the copy is made.
                let all = unsafe { std::slice::from_raw_parts(ptr.cast_const(), len) };
                let host = HostBuffer::F32(all.to_vec());
                copies.push(Input { buf: &host, layout: l }.contiguous::<f32>()?.into_owned());
                let c = copies.last().map_or(std::ptr::null(), |c| c.as_ptr());
                ins.push(Operand::Elems(c));
            }
        }
        let mut fresh: Vec<Option<Vec<MaybeUninit<f32>>>> =
            dests.iter().map(|d| d.is_none().then(|| uninit::<f32>(n))).collect();
        let outs = dests
            .iter()
            .zip(&mut fresh)
            .map(|(d, f)| match (d, f) {
                (Some(d), _) => find(d).0,
                (None, Some(f)) => f.as_mut_ptr().cast::<f32>(),
                (None, None) => std::ptr::null_mut(),
            })
            .collect();
        let bufs = Buffers { ins, outs };
        par_ranges_by(n, 2 * self.members.len(), BLOCK, &|start, end| self.run_range(&bufs, start, end));
        drop(guards);
        drop(copies);
        Ok(dests
            .iter()
            .zip(fresh)
            .map(|(d, f)| match (d, f) {
                (Some(d), _) => d.storage().clone(),
                (None, f) => {
                    // SAFETY: `run_range` over ranges covering `0..n` wrote every element of
                    // every fresh output.
                    let v = unsafe { assume_init(f.unwrap_or_default()) };
                    Arc::new(Storage::from_host(HostBuffer::F32(v), Device::Cpu))
                }
            })
            .collect())
    }
}

/// A lock on one storage a group reads or writes.
enum Guard<'a> {
    Read(std::sync::RwLockReadGuard<'a, kiln_tensor::StorageData>),
    Write(std::sync::RwLockWriteGuard<'a, kiln_tensor::StorageData>),
}

fn not_f32() -> Error {
    Error::backend("cpu", "a fused group's buffer is not float32")
}

impl CpuGroup {
    /// Computes elements `start..end` block by block, then writes the outputs' elements there.
    fn run_range(&self, bufs: &Buffers, start: usize, end: usize) {
        let mut blocks = vec![MaybeUninit::<f32>::uninit(); self.members.len() * BLOCK];
        let mut splats = vec![0f32; bufs.ins.len() * BLOCK];
        for (k, o) in bufs.ins.iter().enumerate() {
            if let Operand::Splat(v) = o {
                splats[k * BLOCK..(k + 1) * BLOCK].fill(*v);
            }
        }
        let mut b0 = start;
        while b0 < end {
            let n = (end - b0).min(BLOCK);
            for (m, member) in self.members.iter().enumerate() {
                let (done, rest) = blocks.split_at_mut(m * BLOCK);
                let read = |s: Src| -> &[f32] { read_block(s, bufs, &splats, done, b0, n) };
                let dst = &mut rest[..n];
                match member.op {
                    Fused::Unary(u) => unary_slice(u, read(member.args[0]), dst),
                    Fused::Binary(b) => binary_slice(b, read(member.args[0]), read(member.args[1]), dst),
                }
            }
            // Every member is computed: the block's inputs are read, so outputs may overwrite them.
            for (o, &src) in self.outputs.iter().enumerate() {
                let v = read_block(src, bufs, &splats, &blocks, b0, n);
                // SAFETY: output `o` has `numel >= end` elements and tasks write disjoint
                // ranges; `v` is a block of this task's (or an input read at these very
                // elements, copied onto itself), Note [Writing what a group reads].
                unsafe { std::ptr::copy(v.as_ptr(), bufs.outs[o].add(b0), n) };
            }
            b0 += n;
        }
    }
}

/// Elements `b0..b0 + n` of `s`: an input's, or member `j`'s block in `done`.
fn read_block<'a>(
    s: Src,
    bufs: &Buffers,
    splats: &'a [f32],
    done: &'a [MaybeUninit<f32>],
    b0: usize,
    n: usize,
) -> &'a [f32] {
    match s {
        Src::Input(k) => match bufs.ins[k] {
            // SAFETY: the input holds the group's `numel >= b0 + n` elements from `p`, locked
            // for the run; nothing writes these elements before the block's outputs.
            Operand::Elems(p) => unsafe { std::slice::from_raw_parts(p.add(b0), n) },
            Operand::Splat(_) => &splats[k * BLOCK..k * BLOCK + n],
        },
        // SAFETY: member `j` wrote the first `n` elements of its block before they are read.
        Src::Member(j) => unsafe { &*(&done[j * BLOCK..j * BLOCK + n] as *const [MaybeUninit<f32>] as *const [f32]) },
    }
}
