//! Planned memory for compiled programs (Note \[Planned memory\]): the
//! buffers of a program's values, kept by the program between its
//! instructions and its runs, so a replay allocates nothing new.
use kiln_tensor::{with_host_buffer, HostBuffer, StorageData, Tensor};
use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

// Note [Planned memory]
// ~~~~~~~~~~~~~~~~~~~~~
// A compiled program runs the same instructions on the same shapes every
// time, so the buffers one run needs are the buffers the last run freed.
// Left to malloc, a run's frees and allocations interleave differently from
// the eager loop's, the heap fragments and grows, and outputs land in memory
// the process never touched: every page of it faults in, and on a virtual
// machine such a fault also asks the host for the page. Measured on a 2-vCPU
// VM, llama-16m's compiled training step took 25-45 ms instead of 10 in its
// cross-entropy backward, whose 67 MB output faulted 500-800 times per step.
//
// So each program the CPU backend compiles owns an `Arena`. While the program
// runs, the arena is this thread's current one: the interpreter hands back
// each value after its last use (`Backend::release`), and when no view or
// result still holds the storage its buffer goes into the arena; the kernels'
// output allocations (`elem::uninit` and the zero-filled buffers built on it)
// take a buffer of exactly their size and alignment from it before asking
// malloc. The first run fills the arena; later runs find their buffers there,
// the same memory in the same places (pages mapped, huge pages kept). The
// arena keeps, of each size, as many buffers as were out at once in the last
// run (not one per allocation), and returns buffers of sizes no kernel asked
// it for (a kernel's own `Vec`) to malloc.
//
// Buffers under `MIN_BYTES` (16 MiB) stay with malloc: a buffer the arena
// keeps cannot serve an allocation of another size, as a freed heap block
// can, so an arena of every size raised the peak memory of that training
// step by a fifth (760 to 920 MB) for no measurable time; the large outputs
// (logits and their gradients) are the ones whose fresh pages cost time. The
// arena keeps its memory between runs, as a training loop wants; dropping the
// compiled function frees it. A run on another thread while one is in
// progress starts with an empty arena, and the two are merged after.

/// Buffers smaller than this are left to malloc (Note [Planned memory]).
const MIN_BYTES: usize = 16 << 20;

/// One allocation of the global allocator, owned by an arena.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a `Block` is the sole owner of its allocation (nothing else points
// into it while it sits in an arena), so it may move to another thread.
unsafe impl Send for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by the global allocator with `layout` (a
        // `Vec`'s buffer, `give`) and is freed once, here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Freed buffers by (bytes, alignment), and how the runs use each size.
#[derive(Default)]
pub(crate) struct Arena {
    blocks: HashMap<(usize, usize), Vec<Block>>,
    uses: HashMap<(usize, usize), Uses>,
    /// Buffers taken from the arena, and asked for and allocated anew.
    hits: u64,
    misses: u64,
}

/// How the run in progress (and the one before) used buffers of one size.
#[derive(Default, Clone, Copy)]
struct Uses {
    /// Buffers asked for (taken, or allocated anew) and handed back, this run.
    asked: usize,
    given: usize,
    /// The most that were out at once, this run and the run before.
    most_out: usize,
    last_most_out: usize,
}

impl Uses {
    fn out(&self) -> usize {
        self.asked.saturating_sub(self.given)
    }
}

impl Arena {
    fn merge(&mut self, other: Arena) {
        for (k, v) in other.blocks {
            self.blocks.entry(k).or_default().extend(v);
        }
        for (k, u) in other.uses {
            let e = self.uses.entry(k).or_default();
            e.last_most_out = e.last_most_out.max(u.last_most_out);
        }
        self.hits += other.hits;
        self.misses += other.misses;
    }

    /// At the end of a run: of each size the arena keeps as many buffers as
    /// were out at once (what the next run needs); buffers of sizes no kernel
    /// asked for are freed.
    fn end_run(&mut self) {
        self.uses.retain(|k, u| {
            *u = Uses { last_most_out: u.most_out, ..Uses::default() };
            if let Some(v) = self.blocks.get_mut(k) {
                v.truncate(u.last_most_out);
            }
            u.last_most_out > 0
        });
        let uses = &self.uses;
        self.blocks.retain(|k, v| uses.contains_key(k) && !v.is_empty());
    }
    /// Bytes held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.blocks.iter().map(|((b, _), v)| b * v.len()).sum()
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Arena>> = const { RefCell::new(None) };
}

/// Puts the arena back in its slot on every exit, unwinding included.
struct Restore<'a> {
    slot: &'a Mutex<Arena>,
    outer: Option<Arena>,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        let mut mine = CURRENT.with(|c| c.replace(self.outer.take())).unwrap_or_default();
        mine.end_run();
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).merge(mine);
    }
}

/// Runs `f` with the arena in `slot` current on this thread.
pub(crate) fn with_arena<R>(slot: &Mutex<Arena>, f: impl FnOnce() -> R) -> R {
    let mine = std::mem::take(&mut *slot.lock().unwrap_or_else(|e| e.into_inner()));
    let outer = CURRENT.with(|c| c.replace(Some(mine)));
    let _restore = Restore { slot, outer };
    f()
}

/// A buffer of `n` elements from the current arena, if one is current and
/// holds a buffer of exactly that many bytes and `T`'s alignment.
pub(crate) fn take<T>(n: usize) -> Option<Vec<MaybeUninit<T>>> {
    let bytes = n.checked_mul(size_of::<T>())?;
    if bytes < MIN_BYTES {
        return None;
    }
    let block = CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let arena = c.as_mut()?;
        let key = (bytes, align_of::<T>());
        let u = arena.uses.entry(key).or_default();
        u.asked += 1;
        u.most_out = u.most_out.max(u.out());
        let b = arena.blocks.get_mut(&key).and_then(Vec::pop);
        match b {
            Some(_) => arena.hits += 1,
            None => arena.misses += 1,
        }
        b
    })?;
    let block = std::mem::ManuallyDrop::new(block);
    // SAFETY: the block was allocated by the global allocator with `layout`
    // = (`bytes`, `align_of::<T>()`) (`give`), which is the layout of `n`
    // `T`s: `n * size_of::<T>() == bytes` and the alignments are equal. The
    // `Vec` takes ownership (the block is not dropped); `MaybeUninit`
    // elements need no initialisation.
    Some(unsafe { Vec::from_raw_parts(block.ptr.as_ptr().cast::<MaybeUninit<T>>(), n, n) })
}

/// Whether an arena is current on this thread.
fn active() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// The buffer of `v` into the current arena (or freed, when none is current
/// or it is small).
fn give<T: Copy>(v: Vec<T>) {
    let Ok(layout) = Layout::array::<T>(v.capacity()) else { return };
    if layout.size() < MIN_BYTES {
        return;
    }
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: the elements are `Copy` (no drop glue), so forgetting them
    // leaks nothing; the buffer, allocated by the global allocator with
    // `layout` (a `Vec` of that capacity), is owned by the block from here on.
    unsafe { v.set_len(0) };
    let block = Block { ptr: NonNull::new(v.as_mut_ptr().cast::<u8>()).expect("a Vec's buffer"), layout };
    // A buffer is kept while fewer of its size are kept and out than were out
    // at once (this run or the last); the others go back to malloc.
    let rest = CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let Some(a) = c.as_mut() else { return Some(block) };
        let key = (layout.size(), layout.align());
        let u = a.uses.entry(key).or_default();
        u.given += 1;
        let room = u.most_out.max(u.last_most_out).saturating_sub(u.out());
        let kept = a.blocks.entry(key).or_default();
        if kept.len() >= room {
            return Some(block);
        }
        kept.push(block);
        None
    });
    drop(rest);
}

/// `Backend::release` on the CPU: the value's buffer goes into the current
/// arena when nothing else holds its storage.
pub(crate) fn release(value: Tensor) {
    if !active() {
        return;
    }
    let storage = Arc::clone(value.storage());
    drop(value);
    if let Ok(storage) = Arc::try_unwrap(storage) {
        if let StorageData::Host(buf) = storage.take_data() {
            let buf: HostBuffer = buf;
            with_host_buffer!(buf, v => give(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_tensor::ir::{Executable, Interpreter, ParamKind, Program, ResultKind};
    use kiln_tensor::{BinaryOp, DType, Device, Meta, Op, UnaryOp};

    /// `x [2048, 4]` and `y [4, 1024]` (int64, so products accumulate into
    /// zero-filled outputs; the products' copies of them are under
    /// `MIN_BYTES`): `2 x@y` as `x@y - neg(x@y)`, every value 16 MiB.
    fn program() -> Program {
        let mut p = Program::new();
        let x = p.add_param(ParamKind::Input(0), Meta::new(&[2048, 4], DType::I64));
        let y = p.add_param(ParamKind::Input(1), Meta::new(&[4, 1024], DType::I64));
        let a = p.push(Op::MatMul, &[x, y]).unwrap()[0];
        let n = p.push(Op::Unary(UnaryOp::Neg), &[a]).unwrap()[0];
        let b = p.push(Op::MatMul, &[x, y]).unwrap()[0];
        let r = p.push(Op::Binary(BinaryOp::Sub), &[b, n]).unwrap()[0];
        p.add_result(r, ResultKind::Fresh).unwrap();
        p
    }

    /// Note [Planned memory]: the second run takes every buffer but its fresh
    /// result from the arena, the arena holds the same memory after each run,
    /// and buffers that come back zero-filled are zero (else the product into
    /// a buffer of the first run would add the old values).
    #[test]
    fn replays_take_their_buffers_from_the_arena() -> kiln_tensor::Result<()> {
        let exe = Interpreter::new(program(), Device::Cpu)?;
        let x = Tensor::from_vec((0..2048 * 4).map(|i| i % 7 - 3).collect::<Vec<i64>>(), &[2048, 4])?;
        let y = Tensor::from_vec((0..4 * 1024).map(|i| i % 5 - 2).collect::<Vec<i64>>(), &[4, 1024])?;
        let want: Vec<i64> = x.matmul(&y)?.to_vec::<i64>()?.iter().map(|v| 2 * v).collect();
        let slot = Mutex::new(Arena::default());
        let mut held = vec![];
        let mut counts = vec![];
        for _ in 0..3 {
            let out = with_arena(&slot, || exe.run(&[x.clone(), y.clone()]))?;
            assert_eq!(out[0].to_vec::<i64>()?, want);
            let a = slot.lock().unwrap();
            held.push(a.bytes());
            counts.push((a.hits, a.misses));
        }
        // Later runs take the three values' buffers from the arena; only the
        // result (which the caller keeps) is new.
        let (h0, m0) = counts[0];
        assert!(m0 >= 3, "{counts:?}");
        assert_eq!(counts[1], (h0 + 3, m0 + 1), "{counts:?}");
        assert_eq!(counts[2], (h0 + 6, m0 + 2), "{counts:?}");
        assert_eq!(held[1], held[2], "the arena does not grow run after run");
        // Three values are out at once at the peak (`b`, `neg(a)` and the result); the caller keeps the result.
        assert_eq!(held[1], 2 * MIN_BYTES, "{held:?}");
        Ok(())
    }

    /// The arena keeps no more buffers of a size than were out at once, and
    /// none of a size nothing asked for: buffers made outside it (a kernel's
    /// own `Vec`) go back to malloc.
    #[test]
    fn the_arena_keeps_what_a_run_can_use() {
        const N: usize = MIN_BYTES / 4;
        let slot = Mutex::new(Arena::default());
        with_arena(&slot, || {
            let first = take::<f32>(N);
            assert!(first.is_none(), "an empty arena");
            give(vec![1f32; N]);
            give(vec![2f32; N]);
            give(vec![3f32; 3 * N]);
        });
        let a = slot.lock().unwrap();
        assert_eq!((a.hits, a.misses), (0, 1));
        assert_eq!(a.bytes(), N * 4, "one buffer of the size asked for once");
    }

    /// Outside a program's run, values are freed as usual and allocations
    /// take nothing from any arena.
    #[test]
    fn without_an_arena_nothing_is_kept() {
        assert!(take::<f32>(1 << 20).is_none());
        release(Tensor::zeros(&[1 << 20], DType::F32).unwrap());
        assert!(CURRENT.with(|c| c.borrow().is_none()));
    }
}
