//! The recorder: while a function is traced on a device whose backend has no
//! capture of its own, every op, in-place write and upload on that device is
//! recorded into a [`Program`] instead of running (Note \[Recording\]).
use super::tape::{flat, Tape};
use super::HostLog;
use crate::ir::Value;
use crate::{Device, Error, Meta, Op, Result, Storage, StorageData, Tensor};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

// Note [Recording]
// ~~~~~~~~~~~~~~~~
// The recorder runs the function without running its ops: each op on the
// traced device is written down and gives fresh storages that hold no data
// yet (`StorageData::Traced`), and nothing on the device is computed or
// written while tracing. Storages are tracked by identity: the first time an
// op reads a storage the recorder has not seen, its whole content becomes a
// parameter (kept alive until the trace is built, so a storage dropped
// inside the function is still there to be a constant); an op's outputs
// become the current values of its fresh storages; `copy_` makes the
// written storage's next value, leaving its data as it was. When the
// function returns, each parameter is classified by its storage (an input's,
// state that outlives the call, or a constant) and each storage the function
// made or wrote that is still alive gives a result (a returned tensor's,
// state updated in place, or state the function created), exactly as capture
// on a compiling backend classifies its graph (Note [Capture]). The traced
// call then runs the program (interpreted, or compiled by the backend) on the
// call's inputs: its results are the call's, and it writes the state, fills
// the storages the function created and kept, as every replay does.
//
// So a trace that fails has written nothing (the storages it made and kept
// stay without data, and using them is an error that says so), a trace costs
// no device work and no memory for its values, and a first call computes
// exactly what every replay computes.
//
// Host values are marked as they enter (Note [Host values]): the values of
// creation ops and uploads made outside a constant scope are recorded in the
// trace's `HostLog`. Reading tensor data on the traced device is an error,
// as on every backend: a replay cannot repeat what the host did with it.

/// The storages of values recorded on `device`: no data until the program runs.
fn traced_storages(outs: &[Meta], device: Device) -> SmallVec<[Arc<Storage>; 2]> {
    outs.iter()
        .map(|m| Arc::new(Storage::new(StorageData::Traced, m.dtype, m.shape.iter().product(), device)))
        .collect()
}

/// What a trace on the recorder collected.
pub(super) struct Recording {
    /// This recording among all of the process's (for a backend that follows one).
    pub id: u64,
    pub device: Device,
    pub tape: Tape,
    pub host: HostLog,
    /// With `Some`, each parameter's value when first read (for export).
    pub snapshots: Option<Vec<crate::HostBuffer>>,
}

static NEXT_RECORDING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// The device of the innermost recording.
    static DEVICE: Cell<Option<Device>> = const { Cell::new(None) };
    /// The recordings of this thread, innermost last: a local region's body
    /// is recorded while the function around it may be recorded too.
    static RECORDING: RefCell<Vec<Recording>> = const { RefCell::new(Vec::new()) };
}

/// Starts recording ops on `device` on this thread (inside any recording
/// already going on, which resumes at `end`); with `snapshot`, keeping each
/// parameter's value as the function first reads it.
pub(super) fn begin(device: Device, host: HostLog, snapshot: bool) {
    RECORDING.with(|r| {
        let id = NEXT_RECORDING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let snapshots = snapshot.then(Vec::new);
        r.borrow_mut().push(Recording { id, device, tape: Tape::default(), host, snapshots })
    });
    DEVICE.with(|d| d.set(Some(device)));
}

/// Stops the innermost recording; what it recorded.
pub(super) fn end() -> Option<Recording> {
    RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        let rec = r.pop();
        DEVICE.with(|d| d.set(r.last().map(|o| o.device)));
        rec
    })
}

/// Whether any device's ops are being recorded on this thread.
pub(crate) fn any_recording() -> bool {
    DEVICE.with(|d| d.get()).is_some()
}

/// Whether ops on `device` are being recorded on this thread (a function
/// `kiln::compile` traces there): a backend refuses what a recorded program
/// cannot hold, and records what it would otherwise run.
pub fn is_recording(device: Device) -> bool {
    DEVICE.with(|d| d.get()) == Some(device)
}

/// What a backend sees of a recording in progress ([`inspect_recording`]).
pub struct RecordingView<'a> {
    /// The recording among all of the process's: its program only grows
    /// (parameters and instructions are appended), so a backend may follow
    /// it, handling only what was added since it last looked.
    pub id: u64,
    pub program: &'a crate::ir::Program,
    /// The storage each parameter reads.
    pub sources: &'a [Arc<Storage>],
}

/// Runs `f` on what this thread has recorded on `device` so far and on the
/// current value of `st` in it (`None` when the program never met it). A
/// backend answers questions about a traced value from it, such as where a
/// value of a program over a mesh will lie. `None` when nothing records on `device`.
pub fn inspect_recording<R>(
    device: Device,
    st: &Arc<Storage>,
    f: impl FnOnce(RecordingView<'_>, Option<Value>) -> R,
) -> Option<R> {
    if !is_recording(device) {
        return None;
    }
    RECORDING.with(|r| {
        r.borrow().last().map(|rec| {
            let view = RecordingView { id: rec.id, program: &rec.tape.program, sources: &rec.tape.sources };
            f(view, rec.tape.current(st))
        })
    })
}

/// How the trace on `device` treats host values (for a nested trace of its own).
pub fn recording_policy(device: Device) -> Option<super::HostValues> {
    with(device, |r| Ok(r.host.policy)).and_then(Result::ok)
}

/// Adds host values a nested trace (a local region's body) took in without
/// declaring them to the record of the trace on `device`.
pub fn note_host_values(device: Device, values: Vec<String>) {
    let _ = with(device, |r| {
        r.host.undeclared.extend(values);
        Ok(())
    });
}

fn with<R>(device: Device, f: impl FnOnce(&mut Recording) -> Result<R>) -> Option<Result<R>> {
    if !is_recording(device) {
        return None;
    }
    RECORDING.with(|r| r.borrow_mut().last_mut().map(f))
}

impl Recording {
    /// The value of `t` in the trace: a storage first read becomes a
    /// parameter read from the storage itself (snapshotted for export).
    pub(super) fn read(&mut self, t: &Tensor) -> Result<Value> {
        self.tape.read(t, snapshot_source(&mut self.snapshots))
    }
}

/// Where the recorder's parameters read: the storage itself, its value kept
/// for export when `snaps` collects them.
fn snapshot_source(
    snaps: &mut Option<Vec<crate::HostBuffer>>,
) -> impl FnOnce(&Arc<Storage>) -> Result<Arc<Storage>> + '_ {
    move |st| {
        if let Some(snaps) = snaps {
            let w = whole(st)?;
            snaps.push(w.backend().to_host(&w)?);
        }
        Ok(st.clone())
    }
}

/// Records `op` applied to `inputs` with outputs of types `outs`, when
/// recording on `device`: the outputs' storages (holding no data yet), or
/// `None` when nothing records there (the op then runs).
pub(crate) fn op(
    op: &Op,
    inputs: &[&Tensor],
    outs: &[Meta],
    device: Device,
) -> Option<Result<SmallVec<[Arc<Storage>; 2]>>> {
    with(device, |r| {
        if matches!(op, Op::Full { .. } | Op::Arange { .. }) {
            r.host.value(crate::trace::in_constant_scope(), || super::describe_creation(op))?;
        }
        let args: Vec<Value> = inputs.iter().map(|t| r.read(t)).collect::<Result<_>>()?;
        let storages = traced_storages(outs, device);
        r.tape.op(op, &args, outs, &storages)?;
        Ok(storages)
    })
}

/// Records the write of `src` into the memory `dst` views, when recording
/// on `dst`'s device: `true` when recorded (the write then does not run).
pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<bool> {
    with(dst.device(), |r| {
        let s = r.read(src)?;
        r.tape.assign(dst, s, snapshot_source(&mut r.snapshots))?;
        Ok(true)
    })
    .unwrap_or(Ok(false))
}

/// Notes data uploaded to `t`'s device while recording (a host value unless declared).
pub(crate) fn upload(t: &Tensor) {
    let _ = with(t.device(), |r| {
        let what = format!("data of shape {:?} uploaded from the host", t.shape());
        r.host.upload(t.storage().addr(), crate::trace::in_constant_scope(), what);
        Ok(())
    });
}

/// The error for reading the data of `t` while its device is recorded.
pub(crate) fn check_read(t: &Tensor, what: &str) -> Result<()> {
    if !is_recording(t.device()) {
        return Ok(());
    }
    Err(Error::invalid(
        "compile",
        format!(
            "{what}() of a tensor of shape {:?} inside a function traced by kiln::compile reads its data, which a replay of the program cannot do; return the tensor from the function and read it after the call",
            t.shape()
        ),
    ))
}

/// `st` read whole, flat.
pub(super) fn whole(st: &Arc<Storage>) -> Result<Tensor> {
    Tensor::from_storage(st.clone(), flat(st.len()))
}
