//! The CPU's elementwise fusion (Note \[Fused groups\] in kiln-tensor): a
//! group of float32 unary and binary ops runs as one pass over blocks of
//! `BLOCK` elements, each member computed with its eager kernel
//! (`elementwise::unary_slice` / `binary_slice`) into a block that stays in
//! the L1 cache, so replays give eager's numbers bit for bit; casts between
//! float32 and bfloat16 at its edges are read and written in the same pass
//! (Note [Casts at a group's edges]).
use super::elem::{assume_init, bf16_to_f32, f32_to_bf16, uninit, FloatElem};
use super::elementwise::{binary_cost, binary_slice, unary_cost, unary_slice};
use super::iter::par_ranges_by;
use super::simd::{dispatch, Kernel};
use super::Input;
use half::bf16;
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
/// slices (casts are `CpuFuser::fusible`'s own case). `pow` stays out: its
/// eager kernel takes shortcuts for a scalar exponent that a block of the
/// group cannot see. (Views and whole-storage
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

// Note [Casts at a group's edges]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autocast puts casts around the float32 ops between bfloat16 products: a
// product's bfloat16 result is cast to float32 to join the residual sum, and
// a float32 gradient is cast to bfloat16 for the next product. Run alone,
// each cast is a pass over memory. In a group, the members compute in
// float32 blocks as ever; a cast to float32 of a bfloat16 input is that
// input's block, widened (exactly) as the block is read; a cast to bfloat16
// of a member is a block of the member's values rounded as the cast rounds
// them (`f32_to_bf16`, the eager cast's rounding), which a cast back to
// float32 reads unchanged; and a bfloat16 output is the top half of each of
// its (rounded) values. So every value holds the bits its eager op gives, and
// the casts cost no pass of their own. Bfloat16 arithmetic itself stays out
// of groups: its exponentials and divisions make such a group bound by
// compute, not memory, and fusing it measured no faster.

impl Fuser for CpuFuser {
    fn fusible(&self, program: &Program, inst: &Inst) -> bool {
        if let Op::Cast(to) = inst.op {
            let from = program.meta(inst.args[0]).dtype;
            return matches!((from, to), (DType::BF16, DType::F32) | (DType::F32, DType::BF16));
        }
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
                // To float32 (of a bfloat16 value, so exact): the block as it is.
                Op::Cast(DType::F32) => {
                    block.insert(inst.first, src(inst.args[0])?);
                    continue;
                }
                Op::Cast(_) => Fused::Round,
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
        let dtype = |v: &Value| program.meta(*v).dtype;
        let (input_dtypes, output_dtypes) =
            (group.inputs.iter().map(dtype).collect(), group.outputs.iter().map(dtype).collect());
        Ok(Arc::new(CpuGroup { members, input_dtypes, outputs, output_dtypes, numel }))
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
    /// A cast to bfloat16: the operand's block, rounded (Note [Casts at a group's edges]).
    Round,
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
    input_dtypes: Vec<DType>,
    /// Each output's block.
    outputs: Vec<Src>,
    output_dtypes: Vec<DType>,
    numel: usize,
}

/// How a block reads one input.
#[derive(Clone, Copy)]
enum Operand {
    /// Contiguous elements from this pointer on (valid for the group's length).
    Elems(*const f32),
    /// Contiguous bfloat16 elements, widened block by block.
    Elems16(*const bf16),
    /// One value everywhere (a broadcast scalar).
    Splat(f32),
}

/// Where an output's elements go.
#[derive(Clone, Copy)]
enum Dest {
    F32(*mut f32),
    BF16(*mut bf16),
}

/// The operands and outputs, shared by the tasks (Note [Writing what a group reads]).
struct Buffers {
    ins: Vec<Operand>,
    outs: Vec<Dest>,
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
        if inputs.len() != self.input_dtypes.len() || dests.len() != self.outputs.len() {
            return Err(Error::backend("cpu", "a fused group got the wrong number of inputs or destinations"));
        }
        let n = self.numel;
        let splat = |t: &Tensor| t.layout().shape().iter().zip(t.layout().strides()).all(|(&d, &s)| d == 1 || s == 0);
        // A destination is kept when every input of its storage reads it element for element.
        let dests: Vec<Option<&Tensor>> = dests
            .iter()
            .zip(&self.output_dtypes)
            .map(|(d, &dt)| {
                d.filter(|d| {
                    // Whole, as the interpreter offers them: the outputs are written from element 0.
                    d.dtype() == dt
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
        // Each storage's elements (float32 or bfloat16) as bytes, and their count.
        let mut base: Vec<(*const Storage, *mut u8, usize)> = vec![];
        for ((s, _), g) in storages.iter().zip(&mut guards) {
            let (ptr, len) = match g {
                Guard::Write(g) => match g.host_mut("cpu")? {
                    HostBuffer::F32(v) => (v.as_mut_ptr().cast::<u8>(), v.len()),
                    HostBuffer::BF16(v) => (v.as_mut_ptr().cast::<u8>(), v.len()),
                    _ => return Err(not_a_block_dtype()),
                },
                Guard::Read(g) => match g.host("cpu")? {
                    HostBuffer::F32(v) => (v.as_ptr().cast_mut().cast::<u8>(), v.len()),
                    HostBuffer::BF16(v) => (v.as_ptr().cast_mut().cast::<u8>(), v.len()),
                    _ => return Err(not_a_block_dtype()),
                },
            };
            base.push((Arc::as_ptr(s), ptr, len));
        }
        let find = |t: &Tensor| {
            base.iter().find(|b| b.0 == Arc::as_ptr(t.storage())).map_or((std::ptr::null_mut(), 0), |b| (b.1, b.2))
        };
        // Inputs neither contiguous nor broadcast are copied now, before any write.
        let mut copies: Vec<HostBuffer> = vec![];
        let mut ins = Vec::with_capacity(inputs.len());
        for (t, &dt) in inputs.iter().zip(&self.input_dtypes) {
            if t.dtype() != dt {
                return Err(Error::backend("cpu", "a fused group's input has another dtype than its program says"));
            }
            let (ptr, len) = find(t);
            let l = t.layout();
            let elems = |p: *const u8| match dt {
                DType::BF16 => Operand::Elems16(p.cast::<bf16>()),
                _ => Operand::Elems(p.cast::<f32>()),
            };
            if t.is_contiguous() {
                if l.offset() + n > len {
                    return Err(Error::backend("cpu", "a fused group's input is shorter than the group"));
                }
                // SAFETY: `offset + n <= len` elements of the locked buffer, of `dt`.
                ins.push(elems(unsafe { ptr.add(l.offset() * dt.size_in_bytes()) }));
            } else if splat(t) {
                if l.offset() >= len {
                    return Err(Error::backend("cpu", "a broadcast input outside its buffer"));
                }
                // SAFETY: `offset < len`, an element of `dt`, and no output of this
                // run writes this storage yet.
                let v = unsafe {
                    match dt {
                        DType::BF16 => (*ptr.cast::<bf16>().add(l.offset())).to_f32(),
                        _ => *ptr.cast::<f32>().add(l.offset()),
                    }
                };
                ins.push(Operand::Splat(v));
            } else {
                // SAFETY: the buffer (of `len` elements of `dt`) stays locked and
                // unwritten while the copy is made.
                let host = unsafe {
                    match dt {
                        DType::BF16 => HostBuffer::BF16(std::slice::from_raw_parts(ptr.cast::<bf16>(), len).to_vec()),
                        _ => HostBuffer::F32(std::slice::from_raw_parts(ptr.cast::<f32>(), len).to_vec()),
                    }
                };
                let x = Input { buf: &host, layout: l };
                let c = match dt {
                    DType::BF16 => HostBuffer::BF16(x.contiguous::<bf16>()?.into_owned()),
                    _ => HostBuffer::F32(x.contiguous::<f32>()?.into_owned()),
                };
                let p = match &c {
                    HostBuffer::BF16(v) => v.as_ptr().cast::<u8>(),
                    HostBuffer::F32(v) => v.as_ptr().cast::<u8>(),
                    _ => return Err(not_a_block_dtype()),
                };
                ins.push(elems(p));
                copies.push(c);
            }
        }
        // Each output: into its destination, or a fresh buffer (uninitialised until the run).
        let mut written: Vec<Written<'_>> = vec![];
        let mut outs = vec![];
        for (d, &dt) in dests.iter().zip(&self.output_dtypes) {
            let (dest, w) = match (d, dt) {
                (Some(d), DType::BF16) => (Dest::BF16(find(d).0.cast::<bf16>()), Written::Into(d)),
                (Some(d), _) => (Dest::F32(find(d).0.cast::<f32>()), Written::Into(d)),
                (None, DType::BF16) => {
                    let mut v = uninit::<bf16>(n);
                    (Dest::BF16(v.as_mut_ptr().cast::<bf16>()), Written::Bf16(v))
                }
                (None, _) => {
                    let mut v = uninit::<f32>(n);
                    (Dest::F32(v.as_mut_ptr().cast::<f32>()), Written::F32(v))
                }
            };
            outs.push(dest);
            written.push(w);
        }
        let bufs = Buffers { ins, outs };
        par_ranges_by(n, 2 * self.members.len(), BLOCK, &|start, end| self.run_range(&bufs, start, end));
        drop(guards);
        drop(copies);
        let host = |b: HostBuffer| Arc::new(Storage::from_host(b, Device::Cpu));
        Ok(written
            .into_iter()
            .map(|w| match w {
                Written::Into(d) => d.storage().clone(),
                // SAFETY (both): `run_range` over ranges covering `0..n` wrote every
                // element of every fresh output.
                Written::F32(v) => host(HostBuffer::F32(unsafe { assume_init(v) })),
                Written::Bf16(v) => host(HostBuffer::BF16(unsafe { assume_init(v) })),
            })
            .collect())
    }
}

/// Where a group's output goes: the destination offered, or a buffer of its own.
enum Written<'a> {
    Into(&'a Tensor),
    F32(Vec<MaybeUninit<f32>>),
    Bf16(Vec<MaybeUninit<bf16>>),
}

/// A lock on one storage a group reads or writes.
enum Guard<'a> {
    Read(std::sync::RwLockReadGuard<'a, kiln_tensor::StorageData>),
    Write(std::sync::RwLockWriteGuard<'a, kiln_tensor::StorageData>),
}

fn not_a_block_dtype() -> Error {
    Error::backend("cpu", "a fused group's buffer is neither float32 nor bfloat16")
}

impl CpuGroup {
    /// Computes elements `start..end` block by block, then writes the outputs' elements there.
    fn run_range(&self, bufs: &Buffers, start: usize, end: usize) {
        let mut blocks = vec![MaybeUninit::<f32>::uninit(); self.members.len() * BLOCK];
        // Each broadcast input's value, and each bfloat16 input's block widened.
        let mut staged = vec![0f32; bufs.ins.len() * BLOCK];
        for (k, o) in bufs.ins.iter().enumerate() {
            if let Operand::Splat(v) = o {
                staged[k * BLOCK..(k + 1) * BLOCK].fill(*v);
            }
        }
        let mut b0 = start;
        while b0 < end {
            let n = (end - b0).min(BLOCK);
            for (k, o) in bufs.ins.iter().enumerate() {
                if let Operand::Elems16(p) = *o {
                    // SAFETY: as `read_block`'s: the input's elements b0..b0 + n, locked
                    // and not written before the block's outputs.
                    let src = unsafe { std::slice::from_raw_parts(p.add(b0), n) };
                    bf16::load(src, &mut staged[k * BLOCK..][..n]);
                }
            }
            for (m, member) in self.members.iter().enumerate() {
                let (done, rest) = blocks.split_at_mut(m * BLOCK);
                let read = |s: Src| -> &[f32] { read_block(s, bufs, &staged, done, b0, n) };
                let dst = &mut rest[..n];
                match member.op {
                    Fused::Unary(u) => unary_slice(u, read(member.args[0]), dst),
                    Fused::Binary(b) => binary_slice(b, read(member.args[0]), read(member.args[1]), dst),
                    Fused::Round => dispatch(RoundInto { src: read(member.args[0]), dst }),
                }
            }
            // Every member is computed: the block's inputs are read, so outputs may overwrite them.
            for (o, &src) in self.outputs.iter().enumerate() {
                let v = read_block(src, bufs, &staged, &blocks, b0, n);
                match bufs.outs[o] {
                    // SAFETY: output `o` has `numel >= end` elements and tasks write disjoint
                    // ranges; `v` is a block of this task's (or an input read at these very
                    // elements, copied onto itself), Note [Writing what a group reads].
                    Dest::F32(p) => unsafe { std::ptr::copy(v.as_ptr(), p.add(b0), n) },
                    Dest::BF16(p) => {
                        // SAFETY: as above; `v` is this task's block or staging, never the
                        // output's memory. Its values are bfloat16's (Note [Casts at a
                        // group's edges]): the top half of each is exact.
                        let out = unsafe { std::slice::from_raw_parts_mut(p.add(b0), n) };
                        dispatch(Narrow { src: v, dst: out });
                    }
                }
            }
            b0 += n;
        }
    }
}

/// `dst[i]` = `src[i]` rounded to bfloat16, as the eager cast rounds it.
struct RoundInto<'a> {
    src: &'a [f32],
    dst: &'a mut [MaybeUninit<f32>],
}

impl Kernel for RoundInto<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        for (d, x) in self.dst.iter_mut().zip(self.src) {
            d.write(bf16_to_f32(f32_to_bf16(*x)));
        }
    }
}

/// `dst[i]` = the top half of `src[i]`, a bfloat16 value (exact).
struct Narrow<'a> {
    src: &'a [f32],
    dst: &'a mut [bf16],
}

impl Kernel for Narrow<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        for (d, x) in self.dst.iter_mut().zip(self.src) {
            *d = bf16::from_bits((x.to_bits() >> 16) as u16);
        }
    }
}

/// Elements `b0..b0 + n` of `s`: an input's (float32 in place; broadcast or
/// bfloat16 from `staged`), or member `j`'s block in `done`.
fn read_block<'a>(
    s: Src,
    bufs: &Buffers,
    staged: &'a [f32],
    done: &'a [MaybeUninit<f32>],
    b0: usize,
    n: usize,
) -> &'a [f32] {
    match s {
        Src::Input(k) => match bufs.ins[k] {
            // SAFETY: the input holds the group's `numel >= b0 + n` elements from `p`, locked
            // for the run; nothing writes these elements before the block's outputs.
            Operand::Elems(p) => unsafe { std::slice::from_raw_parts(p.add(b0), n) },
            Operand::Splat(_) | Operand::Elems16(_) => &staged[k * BLOCK..k * BLOCK + n],
        },
        // SAFETY: member `j` wrote the first `n` elements of its block before they are read.
        Src::Member(j) => unsafe { &*(&done[j * BLOCK..j * BLOCK + n] as *const [MaybeUninit<f32>] as *const [f32]) },
    }
}
