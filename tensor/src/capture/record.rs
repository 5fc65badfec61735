//! The recorder: while a function is traced on a device whose backend has no
//! capture of its own, every op, in-place write and upload on that device is
//! recorded into a [`Program`] instead of running (Note \[Recording\]).
use super::HostLog;
use crate::ir::{ParamKind, Program, Value};
use crate::{Device, Error, Layout, Meta, Op, Result, Storage, StorageData, Tensor, ViewOp};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

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

/// A storage the recorder knows: the storage and its current value.
pub(super) struct Known {
    pub storage: Weak<Storage>,
    pub value: Value,
    /// Whether the trace made or wrote this storage (so it may be a result).
    pub written: bool,
}

/// What a trace on the recorder collected.
pub(super) struct Recording {
    pub device: Device,
    pub program: Program,
    /// Each parameter's storage, held until the trace is built.
    pub sources: Vec<Arc<Storage>>,
    /// Storages by address.
    pub known: HashMap<usize, Known>,
    pub host: HostLog,
    /// With `Some`, each parameter's value when first read (for export).
    pub snapshots: Option<Vec<crate::HostBuffer>>,
}

thread_local! {
    static DEVICE: Cell<Option<Device>> = const { Cell::new(None) };
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// Starts recording ops on `device` on this thread; with `snapshot`, keeping
/// each parameter's value as the function first reads it.
pub(super) fn begin(device: Device, host: HostLog, snapshot: bool) {
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            device,
            program: Program::new(),
            sources: vec![],
            known: HashMap::new(),
            host,
            snapshots: snapshot.then(Vec::new),
        })
    });
    DEVICE.with(|d| d.set(Some(device)));
}

/// Stops recording; what was recorded.
pub(super) fn end() -> Option<Recording> {
    DEVICE.with(|d| d.set(None));
    RECORDING.with(|r| r.borrow_mut().take())
}

/// Whether ops on `device` are being recorded on this thread.
pub(crate) fn is_recording(device: Device) -> bool {
    DEVICE.with(|d| d.get()) == Some(device)
}

fn with<R>(device: Device, f: impl FnOnce(&mut Recording) -> Result<R>) -> Option<Result<R>> {
    if !is_recording(device) {
        return None;
    }
    RECORDING.with(|r| r.borrow_mut().as_mut().map(f))
}

impl Recording {
    /// The current value of a storage's whole content (a new parameter the first time).
    fn storage_value(&mut self, st: &Arc<Storage>) -> Result<Value> {
        // An entry of a storage dropped since is not this one at its address.
        if let Some(k) = self.known.get(&st.addr()).filter(|k| std::ptr::eq(k.storage.as_ptr(), Arc::as_ptr(st))) {
            if k.storage.strong_count() > 0 {
                return Ok(k.value);
            }
        }
        if let Some(snaps) = &mut self.snapshots {
            let whole = Tensor::from_storage(st.clone(), flat(st.len()))?;
            snaps.push(whole.backend().to_host(&whole)?);
        }
        let v = self.program.add_param(ParamKind::State, Meta::new(&[st.len()], st.dtype()));
        self.sources.push(st.clone());
        self.known.insert(st.addr(), Known { storage: Arc::downgrade(st), value: v, written: false });
        Ok(v)
    }

    /// The value of `t` as it reads its storage: the storage's value, or a view of it.
    fn read(&mut self, t: &Tensor) -> Result<Value> {
        let base = self.storage_value(t.storage())?;
        let l = t.layout();
        let whole = t.is_whole_storage();
        if whole && self.program.meta(base).shape[..] == l.shape()[..] {
            return Ok(base);
        }
        let view = if whole {
            ViewOp::Reshape(l.shape().into())
        } else {
            ViewOp::AsStrided { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() }
        };
        Ok(self.program.push(Op::View(view), &[base])?[0])
    }

    fn define(&mut self, st: &Arc<Storage>, value: Value) {
        self.known.insert(st.addr(), Known { storage: Arc::downgrade(st), value, written: true });
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
        let values = r.program.push_typed(op.clone(), &args, outs.iter().cloned().collect())?;
        let storages = traced_storages(outs, device);
        for (st, v) in storages.iter().zip(values) {
            r.define(st, v);
        }
        Ok(storages)
    })
}

/// Records the write of `src` into the memory `dst` views, when recording
/// on `dst`'s device: `true` when recorded (the write then does not run).
pub(crate) fn assign(dst: &Tensor, src: &Tensor) -> Result<bool> {
    with(dst.device(), |r| {
        let s = r.read(src)?;
        let base = r.storage_value(dst.storage())?;
        let l = dst.layout();
        let op = Op::Assign { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() };
        let v = r.program.push(op, &[base, s])?[0];
        r.define(dst.storage(), v);
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

/// A layout reading the whole of a storage of `len` elements as `[len]`.
pub(super) fn flat(len: usize) -> Layout {
    Layout::contiguous(&[len])
}
