//! kiln-tpu: the PJRT backend for `Device::Tpu(n)`. Primitives lower to
//! StableHLO (`lower/`) and run through a PJRT plugin (`pjrt/`): libtpu on
//! TPUs, the CUDA plugin on GPUs, the XLA:CPU plugin anywhere.
//!
//! ```no_run
//! use kiln_tensor::{Device, DType, Tensor};
//! kiln_tpu::register()?; // finds the plugin: KILN_PJRT_PLUGIN, else the fetched XLA:CPU one
//! let x = Tensor::ones(&[2, 3], (DType::F32, Device::Tpu(0)))?;
//! let y = (&x + &x).exp()?;
//! assert_eq!(y.to_vec::<f32>()?.len(), 6);
//! # Ok::<(), kiln_tensor::Error>(())
//! ```
mod backend;
mod buffer;
pub mod cache;
mod dist;
mod export;
mod local;
pub mod lower;
mod mode;
pub mod pjrt;
pub mod portable;
mod process_group;
mod program;
pub mod stablehlo;
pub mod store;

pub use backend::{PjrtBackend, PjrtBuffer, Stats};
pub use export::{check_inputs, ArgKind, ExportedProgram, Flat, Program, Refusal, ResultKind};
pub use kiln_tensor::capture::{compile, Compiled};

/// The message a failed device-side check of op `name` gives when no
/// inputs are at hand to name the offending value (an exported program's
/// manifest carries it).
pub fn check_message(name: &'static str, c: &lower::Check) -> String {
    backend::check_error(name, c, &[]).to_string()
}
pub use kiln_tensor::capture::{CaptureStats, HostValues};
pub use mode::{mode, nan_trap, set_mode, set_nan_trap, with_mode, Mode};
pub use process_group::{init_process_group, process_group, ProcessGroup, ProcessGroupOptions};

use kiln_tensor::{DeviceKind, Error, Result};
use std::sync::{Arc, Mutex, OnceLock};

static BACKEND: OnceLock<&'static PjrtBackend> = OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

/// Loads the PJRT plugin ([`pjrt::find_plugin`]), creates a client and
/// registers the backend for `Device::Tpu(n)`. Idempotent: later calls return
/// the first registration's result without loading anything.
///
/// `KILN_PJRT_CPU_DEVICES=N` sets the number of devices of the XLA:CPU plugin
/// (its `cpu_device_count` option; other plugins ignore the variable).
pub fn register() -> Result<()> {
    start(None, None)
}

/// [`register`] with `n` devices on the XLA:CPU plugin (in place of
/// `KILN_PJRT_CPU_DEVICES`, which a multi-threaded program cannot set
/// safely); other plugins ignore the count. A later call asking for another
/// count than the registered backend has is an error (the count is fixed
/// when the client starts).
pub fn register_with_cpu_devices(n: usize) -> Result<()> {
    if n == 0 {
        return Err(Error::invalid("register", "the number of XLA:CPU devices must be positive, got 0"));
    }
    start(None, Some(n))?;
    let b = backend()?;
    let have = b.client().device_count();
    if b.client().platform().eq_ignore_ascii_case("cpu") && have != n {
        return Err(Error::invalid(
            "register",
            format!("the PJRT backend already started with {have} XLA:CPU devices; {n} were asked for"),
        ));
    }
    Ok(())
}

/// Loads the plugin and registers the backend (once), as one process of a
/// process group when `group` is given (see `process_group.rs`), with
/// `cpu_devices` XLA:CPU devices when given (else `KILN_PJRT_CPU_DEVICES`).
fn start(group: Option<&process_group::Joined>, cpu_devices: Option<usize>) -> Result<()> {
    if BACKEND.get().is_some() {
        return match group {
            None => Ok(()),
            Some(_) => Err(Error::invalid(
                "init_process_group",
                "the PJRT backend has already started: call init_process_group before kiln_tpu::register and before any tensor is made on a Tpu device",
            )),
        };
    }
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if BACKEND.get().is_some() {
        return Ok(());
    }
    let path = pjrt::find_plugin()?;
    let t = std::time::Instant::now();
    let api = pjrt::Api::load(&path)?;
    let xla_cpu = path.to_string_lossy().contains("cpu");
    let mut opts = vec![];
    let count: Option<i64> = match cpu_devices {
        Some(n) => Some(i64::try_from(n).map_err(|_| {
            Error::invalid("register", format!("{n} XLA:CPU devices is more than the plugin's count can hold"))
        })?),
        None => match std::env::var("KILN_PJRT_CPU_DEVICES") {
            Ok(n) => Some(
                n.parse()
                    .map_err(|_| Error::invalid("register", format!("KILN_PJRT_CPU_DEVICES={n:?} is not a number")))?,
            ),
            Err(_) => None,
        },
    };
    if let (Some(n), true) = (count, xla_cpu) {
        opts.push(("cpu_device_count", pjrt::OptionValue::Int(n)));
    }
    let store = group.map(|g| {
        opts.extend(process_group::client_options(g, xla_cpu));
        g.store
    });
    let client = Arc::new(pjrt::Client::new(api, &opts, store)?);
    tracing::info!(
        target: "kiln::pjrt",
        plugin = %path.display(),
        api_version = ?client.api().version(),
        platform = %client.platform(),
        devices = client.device_count(),
        process = group.map(|g| g.rank),
        ms = t.elapsed().as_secs_f64() * 1e3,
        "loaded the PJRT plugin and created a client"
    );
    let b: &'static PjrtBackend = Box::leak(Box::new(PjrtBackend::new(client)));
    kiln_tensor::register_backend(DeviceKind::Tpu, Box::new(Registered(b)));
    let _ = BACKEND.set(b);
    Ok(())
}

/// The registered backend (after [`register`]).
pub fn backend() -> Result<&'static PjrtBackend> {
    BACKEND
        .get()
        .copied()
        .ok_or_else(|| Error::device("tpu", "the PJRT backend is not registered: call kiln_tpu::register()"))
}

/// Executable-cache and dispatch counters of the registered backend.
pub fn stats() -> Result<Stats> {
    Ok(backend()?.stats())
}

/// Waits for all work dispatched to PJRT devices and surfaces the first
/// asynchronous failure.
pub fn sync() -> Result<()> {
    let b = backend()?;
    let r = b.flush_all();
    b.drain().and(r)
}

/// The registry owns a `Box<dyn Backend>`; the backend itself is shared with
/// [`backend()`], so the registry gets this forwarding handle.
struct Registered(&'static PjrtBackend);

impl kiln_tensor::Backend for Registered {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn device_count(&self) -> usize {
        self.0.device_count()
    }
    fn from_host(
        &self,
        buf: kiln_tensor::HostBuffer,
        device: kiln_tensor::Device,
    ) -> Result<Arc<kiln_tensor::Storage>> {
        self.0.from_host(buf, device)
    }
    fn to_host(&self, t: &kiln_tensor::Tensor) -> Result<kiln_tensor::HostBuffer> {
        self.0.to_host(t)
    }
    fn copy_to_device(
        &self,
        t: &kiln_tensor::Tensor,
        device: kiln_tensor::Device,
    ) -> Option<Result<Arc<kiln_tensor::Storage>>> {
        self.0.copy_to_device(t, device)
    }
    fn exec(
        &self,
        op: &kiln_tensor::Op,
        inputs: &[&kiln_tensor::Tensor],
        outs: &[kiln_tensor::Meta],
        device: kiln_tensor::Device,
    ) -> Result<Vec<Arc<kiln_tensor::Storage>>> {
        self.0.exec(op, inputs, outs, device)
    }
    fn assign(&self, dst: &kiln_tensor::Tensor, src: &kiln_tensor::Tensor) -> Result<()> {
        self.0.assign(dst, src)
    }
    fn nonzero(&self, t: &kiln_tensor::Tensor) -> Result<kiln_tensor::Tensor> {
        self.0.nonzero(t)
    }
    fn synchronize(&self, device: kiln_tensor::Device) -> Result<()> {
        self.0.synchronize(device)
    }
    // Programs sit above the backend (`program.rs` uses it), so the
    // registered backend, not `PjrtBackend`, hands them out.
    fn capture(
        &self,
        device: kiln_tensor::Device,
        f: kiln_tensor::CaptureFn,
    ) -> Option<Box<dyn kiln_tensor::Captured>> {
        Some(Box::new(kiln_tensor::capture::compile(device, f)))
    }
    fn tracer(&self, device: kiln_tensor::Device) -> Result<Box<dyn kiln_tensor::capture::Tracer>> {
        // The backend-free recorder on one device and on meshes, its programs lowered by `compile`.
        Ok(Box::new(kiln_tensor::capture::RecordingTracer::new(device)))
    }
    fn deferral(&self, device: kiln_tensor::Device) -> Option<usize> {
        self.0.deferral(device)
    }
    fn compile(
        &self,
        program: &kiln_tensor::ir::Program,
        device: kiln_tensor::Device,
    ) -> Result<Arc<dyn kiln_tensor::ir::Executable>> {
        program::compile(program, device)
    }
    fn supports_meshes(&self) -> bool {
        self.0.supports_meshes()
    }
    fn distribute(
        &self,
        t: &kiln_tensor::Tensor,
        mesh: &kiln_tensor::DeviceMesh,
        placements: &[kiln_tensor::Placement],
    ) -> Result<kiln_tensor::Tensor> {
        self.0.distribute(t, mesh, placements)
    }
    fn placements(&self, t: &kiln_tensor::Tensor) -> Result<(kiln_tensor::DeviceMesh, Vec<kiln_tensor::Placement>)> {
        self.0.placements(t)
    }
    fn local_map(
        &self,
        mesh: &kiln_tensor::DeviceMesh,
        f: &kiln_tensor::LocalFn<'_>,
        inputs: &[kiln_tensor::Tensor],
        in_placements: &[Vec<kiln_tensor::Placement>],
        out_placements: &[Vec<kiln_tensor::Placement>],
    ) -> Result<Vec<kiln_tensor::Tensor>> {
        self.0.local_map(mesh, f, inputs, in_placements, out_placements)
    }
    fn redistribute(
        &self,
        t: &kiln_tensor::Tensor,
        mesh: &kiln_tensor::DeviceMesh,
        placements: &[kiln_tensor::Placement],
    ) -> Result<kiln_tensor::Tensor> {
        self.0.redistribute(t, mesh, placements)
    }
    fn local_shards(&self, t: &kiln_tensor::Tensor) -> Result<Vec<kiln_tensor::Tensor>> {
        self.0.local_shards(t)
    }
    #[allow(clippy::wrong_self_convention)]
    fn from_local(
        &self,
        shards: &[kiln_tensor::Tensor],
        mesh: &kiln_tensor::DeviceMesh,
        placements: &[kiln_tensor::Placement],
        shape: &[usize],
    ) -> Result<kiln_tensor::Tensor> {
        self.0.from_local(shards, mesh, placements, shape)
    }
}
