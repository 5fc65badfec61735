//! Deferred execution for any backend (DeferAndFuse): ops on a device whose
//! backend defers them ([`Backend::deferral`]) are recorded into the device's
//! pending [`Program`](crate::ir::Program), which runs through
//! [`Backend::compile`] when a value is needed (Note \[Deferred programs\]).
use crate::capture::tape::{flat, Tape};
use crate::ir::ResultKind;
use crate::{Backend, Device, Error, Meta, Op, Result, Storage, StorageData, Tensor};
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

// Note [Deferred programs]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A backend defers the ops of a device when it says so (`Backend::deferral`:
// PJRT's DeferAndFuse mode). Each op on that device is then written on the
// device's pending program's tape (`capture/tape.rs`, shared with capture's
// recorder) and gives storages holding `StorageData::Pending`; an in-place
// write is recorded and makes the written storage pending, so every view of
// it sees the write. A storage the program reads before writing becomes a
// parameter that reads a second handle on the storage's data
// (`StorageData::share`), so a later write to the storage, deferred or eager,
// does not change what the program reads.
//
// The program runs when a value is needed: a backend asked for the data of a
// pending storage (`settle`: reading data, an eager op in another mode, a
// copy to another device), `synchronize`, or the backend's limit of ops, and
// right after an op that fails on some input values (`Op::fails_on_data`: an
// index out of range, an integer division by zero), so that its error
// surfaces at the call as in the eager modes. Such an op is recorded and its
// program run under one hold of the lock, so that no other thread's read runs
// the program and takes the error in its place. A failed check still writes the
// program's values (`Executable::run_then_check`), and the op then runs again
// on its inputs, eagerly, for the backend's error naming the offending value.
// The program's results are the storages it made or wrote that
// are still alive (everything else is dead code, removed by `dce`); a storage
// it read first and then wrote is an update of that parameter, whose buffer
// the backend may donate, since nothing else holds it any more (the storage
// itself is pending). After the run each live storage takes its result's data.
//
// Creation values (a `full`'s fill, `arange`'s start and step) stay in the
// program; a compiling backend passes them as arguments (PJRT: Note [Shared
// constants]), so a scalar that changes every step never recompiles.
//
// Pending programs are per device and shared by threads: a tensor deferred on
// one thread may be read on another. One lock guards them, and it is held
// while a program runs, so a reader on another thread waits for the values
// instead of finding them pending. A program's run never defers or settles
// (its ops run through the backend directly, its arguments are never
// pending), so the lock is not taken twice.

/// A device's pending program.
struct Pending {
    device: Device,
    tape: Tape,
    /// The storage each parameter was read from.
    origins: Vec<Weak<Storage>>,
    /// Ops and writes recorded.
    ops: usize,
}

static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());
static PROGRAMS_RUN: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether this thread is running a pending program.
    static RUNNING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is running a pending program.
pub(crate) fn running_program() -> bool {
    RUNNING.with(|r| r.get())
}

fn lock() -> MutexGuard<'static, Vec<Pending>> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many deferred programs have run in this process.
pub fn programs_run() -> u64 {
    PROGRAMS_RUN.load(Ordering::Relaxed)
}

/// The op limit of `device` when its ops are deferred on this thread now.
fn deferral(backend: &dyn Backend, device: Device) -> Option<usize> {
    if RUNNING.with(|r| r.get()) {
        return None;
    }
    backend.deferral(device)
}

fn pending(all: &mut Vec<Pending>, device: Device) -> &mut Pending {
    let i = match all.iter().position(|p| p.device == device) {
        Some(i) => i,
        None => {
            all.push(Pending { device, tape: Tape::default(), origins: vec![], ops: 0 });
            all.len() - 1
        }
    };
    &mut all[i]
}

impl Pending {
    /// The value of `t` in the program (a storage first read becomes a
    /// parameter reading a second handle on its data).
    fn read(&mut self, t: &Tensor) -> Result<crate::ir::Value> {
        self.tape.read(t, shared_source(&mut self.origins))
    }
}

/// Where a deferred program's parameters read: a second handle on the
/// storage's data, in a storage of its own (the original noted in `origins`).
fn shared_source(origins: &mut Vec<Weak<Storage>>) -> impl FnOnce(&Arc<Storage>) -> Result<Arc<Storage>> + '_ {
    move |st| {
        let shared = match &*st.read() {
            StorageData::Pending => None,
            data => Some(data.share().ok_or_else(|| {
                Error::backend(
                    "defer",
                    format!("the backend of {} cannot share its buffers, which deferred programs read", st.device()),
                )
            })?),
        };
        // Pending, yet not in this program: its program failed.
        let shared = shared.ok_or_else(|| StorageData::Pending.not_here("defer"))?;
        origins.push(Arc::downgrade(st));
        Ok(Arc::new(Storage::new(shared, st.dtype(), st.len(), st.device())))
    }
}

/// Records `op` on `inputs` (of types `metas`) with outputs of types `outs`
/// when `device`'s ops are deferred: the outputs' storages (pending), or
/// `None` when the op runs now.
pub(crate) fn op(
    op: &Op,
    inputs: &[&Tensor],
    metas: &[Meta],
    outs: &[Meta],
    device: Device,
    backend: &dyn Backend,
) -> Option<Result<SmallVec<[Arc<Storage>; 2]>>> {
    let limit = deferral(backend, device)?;
    // An op that fails on some input values runs its program before the lock
    // is let go: another thread's read must not run it and take its error.
    let check = op.fails_on_data(metas);
    let recorded = record(limit, device, check, |p| {
        let args: Vec<_> = inputs.iter().map(|t| p.read(t)).collect::<Result<_>>()?;
        let storages: SmallVec<[Arc<Storage>; 2]> = outs
            .iter()
            .map(|m| Arc::new(Storage::new(StorageData::Pending, m.dtype, m.shape.iter().product(), device)))
            .collect();
        p.tape.op(op, &args, outs, &storages)?;
        Ok(storages)
    });
    let (storages, ran) = match recorded {
        Ok(r) => r,
        Err(e) => return Some(Err(e)),
    };
    // When the check failed, the program's values are written all the same,
    // so the op runs again on its inputs, eagerly, for the error that names
    // the offending value.
    Some(match ran {
        Ok(()) => Ok(storages),
        Err(e) if !check => Err(e),
        Err(e) => {
            let ready = inputs.iter().all(|t| !matches!(*t.storage().read(), StorageData::Pending));
            match ready.then(|| backend.exec(op, inputs, outs, device)) {
                Some(Err(named)) => Err(named),
                Some(Ok(_)) | None => Err(e),
            }
        }
    })
}

/// Records the write of `src` into the memory `dst` views when `dst`'s
/// device defers ops: `true` when recorded (the write then does not run).
pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<bool> {
    let device = dst.device();
    let Some(limit) = deferral(dst.backend(), device) else { return Ok(false) };
    if src.device() != device {
        return Ok(false);
    }
    let (recorded, ran) = record(limit, device, false, |p| {
        let s = p.read(src)?;
        p.tape.assign(dst, s, shared_source(&mut p.origins))?;
        dst.storage().replace(StorageData::Pending);
        Ok(true)
    })?;
    ran.map(|()| recorded)
}

/// Records on `device`'s pending program, and runs the program, under the same
/// hold of the lock, when `run_now` or when it reaches `limit` ops: what `f`
/// made, and how that run went.
fn record<R>(
    limit: usize,
    device: Device,
    run_now: bool,
    f: impl FnOnce(&mut Pending) -> Result<R>,
) -> Result<(R, Result<()>)> {
    let mut all = lock();
    let p = pending(&mut all, device);
    let r = f(p)?;
    p.ops += 1;
    let ran = if run_now || p.ops >= limit { run_pending(&mut all, device) } else { Ok(()) };
    Ok((r, ran))
}

/// Runs `device`'s pending program, if any.
pub fn flush(device: Device) -> Result<()> {
    if RUNNING.with(|r| r.get()) {
        return Err(Error::invalid("defer", "a deferred program's run needed the value of another deferred op"));
    }
    run_pending(&mut lock(), device)
}

/// Runs every device's pending program.
pub fn flush_all() -> Result<()> {
    let devices: Vec<Device> = lock().iter().map(|p| p.device).collect();
    let mut first = Ok(());
    for d in devices {
        let r = flush(d);
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// Runs the pending program of `st`'s device when `st` waits for it, so that
/// its data exists (a backend calls this before reading a storage's data).
pub fn settle(st: &Storage) -> Result<()> {
    if matches!(*st.read(), StorageData::Pending) {
        flush(st.device())?;
    }
    Ok(())
}

fn run_pending(all: &mut Vec<Pending>, device: Device) -> Result<()> {
    let Some(i) = all.iter().position(|p| p.device == device) else { return Ok(()) };
    let p = all.swap_remove(i);
    struct Running;
    impl Drop for Running {
        fn drop(&mut self) {
            RUNNING.with(|r| r.set(false));
        }
    }
    RUNNING.with(|r| r.set(true));
    let _running = Running;
    run(p)
}

/// Runs a pending program and gives each live storage it made or wrote its value.
fn run(p: Pending) -> Result<()> {
    let Pending { device, tape: Tape { mut program, sources, known }, origins, .. } = p;
    let mut written: Vec<_> = known.values().filter(|k| k.written).collect();
    written.sort_by_key(|k| k.value);
    let mut sinks = vec![];
    for k in written {
        let Some(st) = k.storage.upgrade() else { continue };
        let origin = origins.iter().position(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&st)));
        program.add_result(k.value, origin.map_or(ResultKind::Fresh, ResultKind::Update))?;
        sinks.push(st);
    }
    if sinks.is_empty() {
        return Ok(());
    }
    let program = program.dce();
    let exe = device.backend()?.compile(&program, device)?;
    let args: Vec<Tensor> = sources
        .into_iter()
        .map(|st| {
            let l = flat(st.len());
            Tensor::from_storage(st, l)
        })
        .collect::<Result<_>>()?;
    let (outs, checked) = exe.run_then_check(&args)?;
    drop(args);
    PROGRAMS_RUN.fetch_add(1, Ordering::Relaxed);
    for (st, out) in sinks.iter().zip(outs) {
        st.replace(out.storage().take_data());
    }
    checked
}
