//! `CpuBackend`: the `Backend` implementation for host memory: locking, dispatch
//! to the kernels, transfers and the in-place `assign` primitive.
use crate::kernels::{self, Input};
use crate::plan::{with_arena, Arena};
use kiln_tensor::ir::{Executable, Interpreter, Program};
use kiln_tensor::{Backend, Device, Error, HostBuffer, Meta, Op, Result, Storage, StorageData, Tensor};
use smallvec::SmallVec;
use std::sync::{Arc, Mutex, RwLockReadGuard};

/// Read guards of the distinct storages of an op's inputs (inline for up to four).
type Guards<'a> = SmallVec<[(usize, RwLockReadGuard<'a, StorageData>); 4]>;

/// The CPU backend. Stateless: storage is plain host memory (`HostBuffer`).
#[derive(Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

/// Read-locks each distinct storage of `inputs` once, in address order
/// (see Note [Storage mutability] in kiln-tensor).
pub(crate) fn lock_inputs<'a>(inputs: &[&'a Tensor]) -> Guards<'a> {
    let mut addrs: SmallVec<[(usize, &'a Storage); 4]> =
        inputs.iter().map(|t| (t.storage().addr(), &**t.storage())).collect();
    addrs.sort_by_key(|a| a.0);
    addrs.dedup_by_key(|a| a.0);
    addrs.into_iter().map(|(a, s)| (a, s.read())).collect()
}

pub(crate) fn host<'a>(guards: &'a [(usize, RwLockReadGuard<'_, StorageData>)], t: &Tensor) -> Result<&'a HostBuffer> {
    let addr = t.storage().addr();
    let g = guards.iter().find(|g| g.0 == addr).expect("storage was locked");
    g.1.host("cpu")
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// On a thread of rayon's global pool, where the kernels fork (Note
    /// [Loops on the compute threads] in kiln-tensor), as the leader of a team
    /// of the pool's threads (Note [Teams of compute threads]).
    fn run_on_compute_threads(&self, f: &mut (dyn FnMut() + Send)) {
        if rayon::current_thread_index().is_some() {
            return crate::team::lead(f);
        }
        // From outside the pool, `join` runs both closures on its threads and
        // waits: `f` runs on a pool thread, the empty one beside it.
        rayon::join(|| crate::team::lead(f), || ());
    }

    fn from_host(&self, buf: HostBuffer, device: Device) -> Result<Arc<Storage>> {
        if device != Device::Cpu {
            return Err(Error::device("from_host", format!("the CPU backend cannot allocate on {device}")));
        }
        Ok(Arc::new(Storage::from_host(buf, Device::Cpu)))
    }

    fn to_host(&self, t: &Tensor) -> Result<HostBuffer> {
        let guards = lock_inputs(&[t]);
        let buf = host(&guards, t)?;
        kernels::materialize(&Input { buf, layout: t.layout() })
    }

    fn exec(&self, op: &Op, inputs: &[&Tensor], outs: &[Meta], _device: Device) -> Result<Vec<Arc<Storage>>> {
        // An output the machine cannot hold is an error, not an abort in the kernel's allocation.
        for m in outs {
            kiln_tensor::alloc::reserve(op.name(), &m.shape, m.dtype)?;
        }
        let guards = lock_inputs(inputs);
        let ins: SmallVec<[Input<'_>; 4]> =
            inputs.iter().map(|t| Ok(Input { buf: host(&guards, t)?, layout: t.layout() })).collect::<Result<_>>()?;
        let bufs = kernels::exec(op, &ins, outs)?;
        drop(ins);
        drop(guards);
        Ok(bufs.into_iter().map(|b| Arc::new(Storage::from_host(b, Device::Cpu))).collect())
    }

    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        kiln_tensor::check_assign(dst, src)?;
        if src.shares_storage(dst) {
            // Snapshot the source first, so reading and writing never alias.
            let vals = self.to_host(src)?;
            let layout = kiln_tensor::Layout::contiguous(src.shape());
            let mut g = dst.storage().write();
            let dst_buf = g.as_host_mut().ok_or_else(|| Error::backend("cpu", "a CPU tensor holds a device buffer"))?;
            return kernels::assign(dst_buf, dst.layout(), &Input { buf: &vals, layout: &layout });
        }
        // Two distinct storages: lock them in address order (deadlock freedom).
        let (src_guard, mut dst_guard) = if src.storage().addr() < dst.storage().addr() {
            let s = src.storage().read();
            (s, dst.storage().write())
        } else {
            let d = dst.storage().write();
            (src.storage().read(), d)
        };
        let dst_buf = dst_guard.host_mut("cpu")?;
        let src_buf = src_guard.host("cpu")?;
        kernels::assign(dst_buf, dst.layout(), &Input { buf: src_buf, layout: src.layout() })
    }

    /// The interpreter with the CPU's folded casts and elementwise fusion
    /// (Note \[Folded casts\] in fold.rs, Note \[Fused groups\] in kiln-tensor;
    /// `KILN_CPU_FUSE=0` runs every instruction alone, as written), run on the
    /// compute threads as a loop of eager ops is.
    fn compile(&self, program: &Program, device: Device) -> Result<Arc<dyn Executable>> {
        let interp = if std::env::var("KILN_CPU_FUSE").is_ok_and(|v| v == "0") {
            Interpreter::new(program.clone(), device)?
        } else {
            program.verify()?;
            Interpreter::with_fuser(crate::fold::fold_casts(program)?, device, &kernels::CpuFuser)?
        };
        Ok(Arc::new(OnComputeThreads { interp, arena: Default::default() }))
    }

    /// Note \[Planned memory\] in plan.rs.
    fn release(&self, value: Tensor) {
        crate::plan::release(value)
    }

    fn nonzero(&self, t: &Tensor) -> Result<Tensor> {
        let guards = lock_inputs(&[t]);
        let buf = host(&guards, t)?;
        let (v, n) = kernels::nonzero(&Input { buf, layout: t.layout() })?;
        drop(guards);
        Tensor::from_vec(v, &[n, t.ndim()])
    }
}

/// A program whose runs go to the compute threads (`on_compute_threads`,
/// where the caller's thread may not run it: recording, ...), so that its
/// instructions fork to a team instead of waking rayon's threads one by one
/// (Note [Teams of compute threads]), with its memory planned: its values'
/// buffers kept in its arena for its next run (Note [Planned memory]).
struct OnComputeThreads {
    interp: Interpreter,
    arena: Mutex<Arena>,
}

impl Executable for OnComputeThreads {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        kiln_tensor::on_compute_threads(Device::Cpu, || with_arena(&self.arena, || self.interp.run(args)))
    }

    fn run_then_check(&self, args: &[Tensor]) -> Result<(Vec<Tensor>, Result<()>)> {
        kiln_tensor::on_compute_threads(Device::Cpu, || with_arena(&self.arena, || self.interp.run_then_check(args)))
    }
}
