//! `Device` and the backend registry: devices are runtime values resolved to a
//! registered `Backend`, so out-of-tree backends plug in (PyTorch's PrivateUse1 idea).
use crate::ir::{Executable, Interpreter, Program};
pub use crate::op::Meta;
use crate::{DeviceMesh, Error, HostBuffer, Layout, Op, Placement, Result, Storage, Tensor};
use std::fmt;
use std::sync::{Arc, RwLock};

/// Where a tensor lives. `Tpu(n)` is served by the PJRT backend once it is registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Tpu(usize),
    /// A device of an out-of-tree backend registered under [`DeviceKind::PrivateUse1`].
    PrivateUse1(usize),
    /// A device mesh (`DeviceMesh::device`, see Note \[Device meshes\]): a
    /// tensor on it is distributed over the mesh's devices, one shard each.
    Mesh(usize),
}

/// The kind of a device, the key of the backend registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Tpu,
    PrivateUse1,
}

impl Device {
    pub fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Tpu(_) => DeviceKind::Tpu,
            Device::PrivateUse1(_) => DeviceKind::PrivateUse1,
            Device::Mesh(id) => crate::mesh::mesh_kind(id).unwrap_or(DeviceKind::Tpu),
        }
    }
    /// The device's index among its kind's devices; a mesh's id for a mesh.
    pub fn index(self) -> usize {
        match self {
            Device::Cpu => 0,
            Device::Tpu(i) | Device::PrivateUse1(i) | Device::Mesh(i) => i,
        }
    }
    /// The backend serving this device, or an error saying how to register one.
    pub fn backend(self) -> Result<&'static dyn Backend> {
        let b = backend_for(self.kind()).ok_or_else(|| {
            Error::device(
                "device",
                format!(
                    "no backend is registered for device {self}; use the `kiln` crate (it registers the CPU backend) or the crate of the backend for {self} and call its `register()`"
                ),
            )
        })?;
        if let Device::Mesh(id) = self {
            if crate::mesh::mesh_kind(id).is_none() {
                return Err(Error::device("device", format!("device {self} does not exist: no mesh has id {id}")));
            }
            return Ok(b);
        }
        let n = b.device_count();
        if self.index() >= n {
            return Err(Error::device(
                "device",
                format!("device {self} does not exist: the {} backend has {n} device(s)", b.name()),
            ));
        }
        Ok(b)
    }
    /// Parses `cpu`, `tpu`, `tpu:1`.
    pub fn parse(s: &str) -> Result<Device> {
        let (k, i) = match s.split_once(':') {
            Some((k, i)) => {
                (k, i.parse::<usize>().map_err(|_| Error::invalid("device", format!("bad device index in {s:?}")))?)
            }
            None => (s, 0),
        };
        match k {
            "cpu" if i == 0 => Ok(Device::Cpu),
            "tpu" => Ok(Device::Tpu(i)),
            "privateuse1" => Ok(Device::PrivateUse1(i)),
            "mesh" => Ok(Device::Mesh(i)),
            _ => Err(Error::invalid("device", format!("unknown device {s:?} (expected cpu, tpu or tpu:N)"))),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Tpu(i) => write!(f, "tpu:{i}"),
            Device::PrivateUse1(i) => write!(f, "privateuse1:{i}"),
            Device::Mesh(i) => write!(f, "mesh:{i}"),
        }
    }
}

/// A backend executes primitive ops on its devices. View ops never reach it:
/// they are `Layout` transforms, so every backend reads strided inputs
/// (`Tensor::layout()` over `Tensor::storage()`).
pub trait Backend: Send + Sync + 'static {
    /// Short name used in errors (`cpu`, `pjrt`).
    fn name(&self) -> &'static str;
    /// Number of devices of this kind.
    fn device_count(&self) -> usize {
        1
    }
    /// Moves host data onto `device` as a new storage.
    // The name mirrors `to_host`; it is a constructor-like method of the backend.
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, buf: HostBuffer, device: Device) -> Result<Arc<Storage>>;
    /// Reads the elements of `t` (any layout) into a contiguous host buffer, row-major.
    fn to_host(&self, t: &Tensor) -> Result<HostBuffer>;
    /// Copies the elements of `t` (on one of this backend's devices, any
    /// layout) to `device` without going through the host, as a contiguous
    /// storage, when the backend can (devices of one PJRT client); `None`
    /// sends [`Tensor::to_device`] through the host.
    fn copy_to_device(&self, _t: &Tensor, _device: Device) -> Option<Result<Arc<Storage>>> {
        None
    }
    /// Runs a non-view primitive on `inputs` (all on `device`), returning one
    /// fresh contiguous storage per output, each of the shape and dtype in `outs`.
    fn exec(&self, op: &Op, inputs: &[&Tensor], outs: &[Meta], device: Device) -> Result<Vec<Arc<Storage>>>;
    /// Writes `src` into the memory `dst` views (same shape and dtype): the one
    /// in-place primitive. `src` may alias `dst`'s storage.
    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// Indices of the non-zero elements, shape `[n, ndim]` (int64): the one op
    /// whose output shape depends on the data.
    fn nonzero(&self, t: &Tensor) -> Result<Tensor>;
    /// Waits until all queued work on `device` is done (a no-op for synchronous backends).
    fn synchronize(&self, _device: Device) -> Result<()> {
        Ok(())
    }
    /// Whether ops on `device` are deferred on the calling thread now (Note
    /// \[Deferred programs\] in `defer.rs`): `Some(limit)` records them into
    /// the device's pending program, which runs when a value is needed or
    /// after `limit` ops. The default runs every op at once.
    fn deferral(&self, _device: Device) -> Option<usize> {
        None
    }
    /// Runs `f` once on a thread this backend computes on, when a loop of
    /// ops run from there saves cross-thread wake-ups (Note \[Loops on the
    /// compute threads\] in `compute_threads.rs`); the default runs it on the
    /// calling thread. Called through [`crate::on_compute_threads`], which
    /// carries the caller's thread state.
    fn run_on_compute_threads(&self, f: &mut (dyn FnMut() + Send)) {
        f()
    }
    /// `f` captured into programs of this backend on `device` (`kiln::compile`
    /// on PJRT), for library code that knows no backend crate, such as the
    /// serving engine's decode step; `None` where ops run one by one anyway.
    fn capture(&self, _device: Device, _f: CaptureFn) -> Option<Box<dyn Captured>> {
        None
    }
    /// How functions traced by `kiln::compile` on `device` are recorded and
    /// replayed. The default records a [`Program`] as the ops run (Note
    /// \[Recording\]) and runs it through [`Backend::compile`].
    fn tracer(&self, device: Device) -> Result<Box<dyn crate::capture::Tracer>> {
        Ok(Box::new(crate::capture::RecordingTracer::new(device)))
    }
    /// `program` readied to run on `device` (Note \[Programs\] in `ir/mod.rs`).
    /// The default interprets it instruction by instruction through
    /// [`Backend::exec`] and [`Backend::assign`]; a backend with a compiler
    /// of its own lowers it instead.
    fn compile(&self, program: &Program, device: Device) -> Result<Arc<dyn Executable>> {
        Ok(Arc::new(Interpreter::new(program.clone(), device)?))
    }
    /// Takes back a value an interpreted program will not read again (its
    /// last use has run). The default drops it; a backend that keeps the
    /// memory of a program's values for its later instructions and runs
    /// (the CPU's planned memory) keeps the storage when nothing else holds it.
    fn release(&self, value: Tensor) {
        drop(value)
    }

    // ---- distributed tensors (see `distributed.rs`); backends without meshes keep the defaults.

    /// Whether tensors of this backend can be placed on device meshes.
    fn supports_meshes(&self) -> bool {
        false
    }
    /// `t` (a whole tensor on any device) placed on `mesh` with `placements`.
    fn distribute(&self, _t: &Tensor, mesh: &DeviceMesh, _placements: &[Placement]) -> Result<Tensor> {
        Err(no_meshes(self.name(), mesh))
    }
    /// Runs `f` on every device of `mesh` as SPMD code on the device's block of
    /// each input (placed with `in_placements`), the results carrying
    /// `out_placements` (Note \[Local regions\] in `collective.rs`). Not differentiable
    /// itself: `kiln::local_map` adds the gradient.
    fn local_map(
        &self,
        mesh: &DeviceMesh,
        _f: &LocalFn<'_>,
        _inputs: &[Tensor],
        _in_placements: &[Vec<Placement>],
        _out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        Err(no_meshes(self.name(), mesh))
    }
    /// The mesh and placements of a tensor on a mesh device.
    fn placements(&self, t: &Tensor) -> Result<(DeviceMesh, Vec<Placement>)> {
        Err(Error::device("placements", format!("{} is not a device mesh", t.device())))
    }
    /// `t` (on a mesh device) with other placements, on `mesh` (a view of its root mesh).
    fn redistribute(&self, _t: &Tensor, mesh: &DeviceMesh, _placements: &[Placement]) -> Result<Tensor> {
        Err(no_meshes(self.name(), mesh))
    }
    /// Each mesh device's shard of `t`, in mesh order, each a tensor on its device.
    fn local_shards(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        Err(Error::device("to_local", format!("{} is not a device mesh", t.device())))
    }
    /// The distributed tensor of `shape` whose shards (one per mesh device, in mesh order) are `shards`.
    #[allow(clippy::wrong_self_convention)]
    fn from_local(
        &self,
        _shards: &[Tensor],
        mesh: &DeviceMesh,
        _placements: &[Placement],
        _shape: &[usize],
    ) -> Result<Tensor> {
        Err(no_meshes(self.name(), mesh))
    }
}

/// A function a backend captures (see [`Backend::capture`]).
pub type CaptureFn = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

/// A captured function: called like the function, it traces it once per
/// input signature and replays the program afterwards.
pub trait Captured: Send {
    /// Runs the function (its program) on `inputs`.
    fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    /// `(traces, replays)` so far.
    fn counts(&self) -> (u64, u64);
}

/// `f` captured on `device` by its backend, or `None` when the backend runs
/// op by op (the CPU) or `device` has no backend.
pub fn capture(device: Device, f: CaptureFn) -> Option<Box<dyn Captured>> {
    device.backend().ok()?.capture(device, f)
}

/// The function of a local region: each device's blocks in, its blocks out.
pub type LocalFn<'a> = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'a;

fn no_meshes(backend: &str, mesh: &DeviceMesh) -> Error {
    Error::device("distribute_tensor", format!("the {backend} backend has no device meshes ({mesh})"))
}

type Registry = RwLock<Vec<(DeviceKind, &'static dyn Backend)>>;
static REGISTRY: Registry = RwLock::new(Vec::new());

/// Registers (or replaces) the backend for a device kind. Backends live for the
/// whole process, so registration leaks one small allocation per call.
pub fn register_backend(kind: DeviceKind, backend: Box<dyn Backend>) {
    let b: &'static dyn Backend = Box::leak(backend);
    let mut reg = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    reg.retain(|(k, _)| *k != kind);
    reg.push((kind, b));
}

/// The backend registered for `kind`, if any.
pub fn backend_for(kind: DeviceKind) -> Option<&'static dyn Backend> {
    let reg = REGISTRY.read().unwrap_or_else(|e| e.into_inner());
    reg.iter().find(|(k, _)| *k == kind).map(|(_, b)| *b)
}

/// Whether a backend is registered for `kind`.
pub fn is_registered(kind: DeviceKind) -> bool {
    backend_for(kind).is_some()
}

/// The first device of every registered backend: the devices the conformance
/// suite runs on (the other devices of a backend run the same code).
pub fn registered_devices() -> Vec<Device> {
    let reg = REGISTRY.read().unwrap_or_else(|e| e.into_inner());
    reg.iter()
        .filter(|(_, b)| b.device_count() > 0)
        .map(|(k, _)| match k {
            DeviceKind::Cpu => Device::Cpu,
            DeviceKind::Tpu => Device::Tpu(0),
            DeviceKind::PrivateUse1 => Device::PrivateUse1(0),
        })
        .collect()
}

/// The check of [`Backend::assign`]'s operands every backend makes: equal shapes and dtypes.
pub fn check_assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dtype() != src.dtype() || dst.shape() != src.shape() {
        return Err(Error::invalid(
            "assign",
            format!(
                "needs equal shapes and dtypes, got {:?} {} and {:?} {}",
                dst.shape(),
                dst.dtype(),
                src.shape(),
                src.dtype()
            ),
        ));
    }
    Ok(())
}

/// Makes the layout check every backend needs before touching memory.
pub fn check_layout(op: &'static str, layout: &Layout, storage: &Storage) -> Result<()> {
    layout.check_bounds(op, storage.len())
}
