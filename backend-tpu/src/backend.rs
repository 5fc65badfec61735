//! `PjrtBackend`: the `Backend` for `Device::Tpu(n)`. Each primitive becomes a
//! one-op StableHLO program (views read inside it), compiled once per distinct
//! program text and cached, and dispatched asynchronously (Strict) or waited
//! for and checked (Debug); under DeferAndFuse a device's ops, on one device
//! or a mesh, are recorded by kiln-tensor into a pending program
//! (`Backend::deferral`) that runs as one (`program.rs`).
pub use crate::buffer::PjrtBuffer;
use crate::buffer::{data_in, data_of};
use crate::cache::{self, DiskCache};
use crate::lower::{self, ArgView, Check};
use crate::mode::{mode, nan_trap, Mode};
use crate::pjrt::{Buffer, Client, CompileOptions, Event, Executable, Upload};
use crate::stablehlo::Module;
use kiln_tensor::{
    Backend, DType, Device, DeviceMesh, Error, HostBuffer, Meta, Op, Placement, Result, Storage, StorageData, Tensor,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Work dispatched in Strict mode that nobody has waited for yet: a program
/// and its completion event, or a host-to-device copy and the bytes it reads.
enum Pending {
    Program {
        op: &'static str,
        event: Event,
    },
    /// A program over several devices: waited for at most `collective_timeout`.
    Collective {
        op: &'static str,
        event: Event,
    },
    Upload(Upload),
}

impl Pending {
    fn is_ready(&self) -> bool {
        match self {
            Pending::Program { event, .. } | Pending::Collective { event, .. } => event.is_ready().unwrap_or(false),
            Pending::Upload(u) => u.is_done(),
        }
    }
}

/// Counters of the executable cache and dispatches (see [`PjrtBackend::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Programs compiled (cache misses).
    pub compiles: u64,
    /// Dispatches served by a cached executable.
    pub hits: u64,
    /// Programs executed.
    pub executions: u64,
    /// Deferred programs run (DeferAndFuse), counted in `executions` too.
    pub graphs: u64,
    /// Executables loaded from the on-disk cache instead of compiled.
    pub disk_hits: u64,
    /// Programs not found on disk (compiled, then stored).
    pub disk_misses: u64,
    /// Corrupt or foreign disk entries, compiled again and rewritten.
    pub disk_rebuilt: u64,
    /// Time spent compiling, in seconds.
    pub compile_secs: f64,
    /// Time spent loading executables from disk, in seconds.
    pub load_secs: f64,
    /// Bytes the `all_to_all` collectives of local regions sent from one
    /// device to another (each device's block less the piece it keeps,
    /// summed over the devices), over every region run.
    pub all_to_all_bytes: u64,
    /// Bytes copied from one device to another without the host
    /// (`Tensor::to_device` between devices of the client).
    pub device_copy_bytes: u64,
}

/// Executables by program text, then by the options they were compiled with.
type ExecutableCache = HashMap<String, Vec<(CompileOptions, Arc<Executable>)>>;

/// The PJRT backend: one client, its executable cache and the queue of
/// asynchronous work whose errors have not been collected yet.
pub struct PjrtBackend {
    client: Arc<Client>,
    /// Executables by program text, then by compile options (one entry for a
    /// one-device program; one per mesh shape and device assignment for a
    /// program over a mesh).
    cache: Mutex<ExecutableCache>,
    pending: Mutex<Vec<Pending>>,
    max_ops: usize,
    compiles: AtomicU64,
    hits: AtomicU64,
    executions: AtomicU64,
    all_to_all_bytes: AtomicU64,
    device_copy_bytes: AtomicU64,
    compile_ns: AtomicU64,
    disk: Option<DiskCache>,
}

impl std::fmt::Debug for PjrtBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtBackend({:?})", self.client)
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::backend("pjrt", msg)
}

/// The default number of ops after which a pending program runs (`KILN_TPU_DEFER_MAX_OPS`).
pub const DEFAULT_MAX_OPS: usize = 4096;

/// The number of pending dispatches after which finished ones are collected.
const REAP_AT: usize = 64;

impl PjrtBackend {
    pub fn new(client: Arc<Client>) -> PjrtBackend {
        PjrtBackend {
            cache: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
            max_ops: std::env::var("KILN_TPU_DEFER_MAX_OPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&n: &usize| n > 0)
                .unwrap_or(DEFAULT_MAX_OPS),
            compiles: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            executions: AtomicU64::new(0),
            all_to_all_bytes: AtomicU64::new(0),
            device_copy_bytes: AtomicU64::new(0),
            compile_ns: AtomicU64::new(0),
            disk: cache::cache_dir().map(|d| DiskCache::new(d, &client)),
            client,
        }
    }

    /// The device buffer behind a tensor's storage, running its pending
    /// program first when the storage waits for it.
    pub(crate) fn buffer_of(&self, t: &Tensor) -> Result<Arc<Buffer>> {
        self.ready_data(data_of(t)?)
    }

    /// `t`'s elements copied to PJRT device `j` (`PJRT_Buffer_CopyToDevice`):
    /// a view is first made a contiguous buffer on its own device.
    fn copy_between_devices(&self, t: &Tensor, j: usize) -> Result<Arc<Storage>> {
        let buf = self.buffer_of(t)?;
        let (l, dtype) = (t.layout(), t.dtype());
        let whole = l.is_contiguous() && l.offset() == 0 && l.numel() == buf.numel();
        let src = if whole {
            buf
        } else {
            let text = lower::read_module(l, buf.numel(), dtype)?;
            let meta = Meta { shape: [l.numel()].as_slice().into(), dtype };
            Arc::new(self.run("to_device", &text, &[&buf], &[meta], &[], &[], t.device())?.remove(0))
        };
        let copy = src.copy_to_device(j)?;
        let n = copy.numel();
        self.device_copy_bytes.fetch_add((n * dtype.size_in_bytes()) as u64, Ordering::Relaxed);
        Ok(Arc::new(Storage::new(
            StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(copy)))),
            dtype,
            n,
            Device::Tpu(j),
        )))
    }

    /// One value of a creation op (see `lower::creation_args`) as a one-element buffer on `device`.
    pub(crate) fn upload_scalar(&self, bytes: &[u8], dtype: DType, device: Device) -> Result<Arc<Buffer>> {
        Ok(Arc::new(self.client.buffer_from_host(bytes, dtype, &[1], device.index())?))
    }

    /// Reads one device-side check flag (see Note [Checks on the device]); false is the check's error.
    pub(crate) fn verify(&self, flag: &Buffer, name: &'static str, c: &Check, inputs: &[&Tensor]) -> Result<()> {
        let mut byte = [0u8; 1];
        flag.copy_to_host(&mut byte).map_err(|e| err(format!("{name} failed: {e}")))?;
        if byte[0] == 0 {
            return Err(check_error(name, c, inputs));
        }
        Ok(())
    }

    /// Counts the bytes a region's `all_to_all`s sent between devices (see [`Stats`]).
    pub(crate) fn count_all_to_all(&self, bytes: u64) {
        self.all_to_all_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn count_execution(&self) {
        self.executions.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn queue_event(&self, op: &'static str, event: Event) -> Result<()> {
        self.queue(Pending::Program { op, event })
    }

    /// Queues the completion event of one device of a program over a mesh.
    pub(crate) fn queue_collective(&self, op: &'static str, event: Event) -> Result<()> {
        self.queue(Pending::Collective { op, event })
    }

    pub(crate) fn ready_data(&self, data: PjrtBuffer) -> Result<Arc<Buffer>> {
        match data {
            PjrtBuffer::Ready(b) => Ok(b),
            PjrtBuffer::Sharded(s) => Err(err(format!("a tensor on a device mesh ({}) has no single buffer", s.view))),
        }
    }

    /// Runs the pending program of `device` (DeferAndFuse), if any.
    pub fn flush(&self, device: Device) -> Result<()> {
        kiln_tensor::defer::flush(device)
    }

    /// Runs every pending program.
    pub fn flush_all(&self) -> Result<()> {
        kiln_tensor::defer::flush_all()
    }

    /// `Backend::deferral`: a device's ops, on one device or a mesh, are
    /// deferred in DeferAndFuse mode (Note \[Deferred programs\] in kiln-tensor).
    pub(crate) fn deferral(&self, device: Device) -> Option<usize> {
        let defers = match device {
            Device::Tpu(_) | Device::Mesh(_) => true,
            Device::Cpu | Device::PrivateUse1(_) => false,
        };
        (mode() == Mode::Defer && defers).then_some(self.max_ops)
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    pub fn stats(&self) -> Stats {
        Stats {
            compiles: self.compiles.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            executions: self.executions.load(Ordering::Relaxed),
            graphs: kiln_tensor::defer::programs_run(),
            disk_hits: self.disk.as_ref().map_or(0, |d| d.hits.load(Ordering::Relaxed)),
            disk_misses: self.disk.as_ref().map_or(0, |d| d.misses.load(Ordering::Relaxed)),
            disk_rebuilt: self.disk.as_ref().map_or(0, |d| d.rebuilt.load(Ordering::Relaxed)),
            compile_secs: self.compile_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            load_secs: self.disk.as_ref().map_or(0, |d| d.load_ns.load(Ordering::Relaxed)) as f64 * 1e-9,
            all_to_all_bytes: self.all_to_all_bytes.load(Ordering::Relaxed),
            device_copy_bytes: self.device_copy_bytes.load(Ordering::Relaxed),
        }
    }

    /// The executable for a one-device module: from the cache, or compiled and cached.
    pub fn executable(&self, m: &Module) -> Result<Arc<Executable>> {
        self.executable_with(m, &CompileOptions::single())
    }

    /// The executable for a module compiled with `options` (a program over a
    /// mesh: `CompileOptions::spmd`), from the cache or compiled; the module's
    /// text is its key.
    pub fn executable_with(&self, m: &Module, options: &CompileOptions) -> Result<Arc<Executable>> {
        self.executable_of_text(&m.text(), options)
    }

    /// The executable for a module's text (a program loaded back from an
    /// export), compiled with `options`, from the cache or compiled.
    pub fn executable_of_text(&self, text: &str, options: &CompileOptions) -> Result<Arc<Executable>> {
        self.executable_keyed(text, options, || {
            self.client.compile_with(text, options).map_err(|e| err(format!("{e}\nprogram:\n{text}")))
        })
    }

    /// The executable of a StableHLO portable artifact (MLIR bytecode) for
    /// one device, cached under a key naming the artifact's SHA-256.
    pub fn executable_of_artifact(&self, bytes: &[u8]) -> Result<Arc<Executable>> {
        let key = format!("// StableHLO portable artifact, sha256 {}", cache::sha256_hex(bytes));
        let options = CompileOptions::single();
        self.executable_keyed(&key, &options, || {
            self.client.compile_code(bytes, &options).map_err(|e| err(format!("{e} (a portable artifact)")))
        })
    }

    /// The executable cached under `key` (a program's text) with `options`,
    /// or `compile`d and cached in memory and on disk.
    fn executable_keyed(
        &self,
        key: &str,
        options: &CompileOptions,
        compile: impl FnOnce() -> Result<Executable>,
    ) -> Result<Arc<Executable>> {
        let found =
            |c: &ExecutableCache| c.get(key).and_then(|v| v.iter().find(|(o, _)| o == options).map(|(_, e)| e.clone()));
        if let Some(e) = found(&self.cache.lock().unwrap_or_else(|e| e.into_inner())) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(target: "kiln::compile", bytes = key.len(), "executable cache hit");
            return Ok(e);
        }
        let compile = || {
            let t = std::time::Instant::now();
            let exe = compile()?;
            let dt = t.elapsed();
            self.compiles.fetch_add(1, Ordering::Relaxed);
            self.compile_ns.fetch_add(dt.as_nanos() as u64, Ordering::Relaxed);
            tracing::debug!(
                target: "kiln::compile",
                bytes = key.len(),
                partitions = options.partitions,
                ms = dt.as_secs_f64() * 1e3,
                "compiled a program"
            );
            Ok(exe)
        };
        let exe = Arc::new(match &self.disk {
            Some(d) => d.get_or_compile(&self.client, key, options, compile)?,
            None => compile()?,
        });
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = found(&c) {
            // Another thread compiled it meanwhile: keep one executable per key.
            return Ok(e);
        }
        c.entry(key.to_string()).or_default().push((options.clone(), exe.clone()));
        Ok(exe)
    }

    /// Runs a program on `device`: waits for it in Debug mode, else queues its
    /// event. The trailing outputs are the bool `checks` of the lowering, read
    /// before returning in every mode (see Note [Checks on the device]).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        name: &'static str,
        module: &Module,
        args: &[&Buffer],
        outs: &[Meta],
        checks: &[Check],
        inputs: &[&Tensor],
        device: Device,
    ) -> Result<Vec<Buffer>> {
        let exe = self.executable(module)?;
        let mut metas: Vec<(DType, Vec<usize>)> =
            outs.iter().map(|m| (m.dtype, vec![m.shape.iter().product()])).collect();
        metas.extend(checks.iter().map(|_| (DType::Bool, vec![])));
        let (mut bufs, event) = exe.execute(args, device.index(), &metas)?;
        self.executions.fetch_add(1, Ordering::Relaxed);
        let flags = bufs.split_off(outs.len());
        for (flag, c) in flags.iter().zip(checks) {
            self.verify(flag, name, c, inputs)?;
        }
        match mode() {
            Mode::Debug => {
                event.wait(name).map_err(|e| err(format!("{name} failed on {device}: {e}")))?;
                if nan_trap() {
                    for (b, m) in bufs.iter().zip(outs) {
                        if m.dtype.is_float() {
                            self.trap_nonfinite(name, b, m.dtype, device)?;
                        }
                    }
                }
            }
            Mode::Strict | Mode::Defer => self.queue(Pending::Program { op: name, event })?,
        }
        Ok(bufs)
    }

    fn queue(&self, p: Pending) -> Result<()> {
        let mut q = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        q.push(p);
        if q.len() < REAP_AT {
            return Ok(());
        }
        // Collect the finished ones; the first failure surfaces now.
        let mut keep = Vec::with_capacity(q.len());
        let mut first_err = None;
        for p in q.drain(..) {
            if first_err.is_none() && p.is_ready() {
                if let Err(e) = settle(p) {
                    first_err = Some(e);
                }
            } else {
                keep.push(p);
            }
        }
        *q = keep;
        first_err.map_or(Ok(()), Err)
    }

    /// Waits for every queued dispatch and surfaces the first asynchronous failure.
    pub fn drain(&self) -> Result<()> {
        let pending: Vec<Pending> = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        let mut first = Ok(());
        for p in pending {
            let r = settle(p);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Debug mode's NaN/Inf trap: fails when a float output holds a non-finite value.
    fn trap_nonfinite(&self, name: &'static str, b: &Buffer, dtype: DType, device: Device) -> Result<()> {
        let n = b.numel();
        let ty = lower::Ty::new(&[n], dtype);
        let (mut bl, args) = lower::Builder::new(&[ty]);
        // |x| < inf is false exactly for NaN and the infinities, in any float type.
        let a = bl.unary("abs", &args[0]);
        let finite = bl.compare_lit("LT", &a, lower::Lit::F(f64::INFINITY));
        let all = bl.reduce(&finite, lower::Lit::B(true), &[0], "and");
        let text = bl.finish(&[all]);
        let exe = self.executable(&text)?;
        let (outs, ev) = exe.execute(&[b], device.index(), &[(DType::Bool, vec![])])?;
        ev.wait("the NaN/Inf trap")?;
        let mut byte = [0u8; 1];
        outs[0].copy_to_host(&mut byte)?;
        if byte[0] == 0 {
            return Err(Error::invalid(
                "nan_trap",
                format!("{name} produced a NaN or infinite value on {device} (KILN_TPU_NAN_TRAP is on)"),
            ));
        }
        Ok(())
    }

    fn storage(&self, buf: Buffer, dtype: DType, device: Device) -> Arc<Storage> {
        let len = buf.numel();
        Arc::new(Storage::new(StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(buf)))), dtype, len, device))
    }
}

// Note [Checks on the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// XLA clamps out-of-range gather/scatter indices and returns garbage for an
// integer division by zero, where the CPU backend (and PyTorch) raise an
// error. A silent wrong answer is not acceptable, so the lowering of those ops
// also computes one bool per condition (every index in range, no zero
// divisor, no negative integer exponent), and the backend reads these flags
// before the op returns, in Strict mode too: the wait covers only the
// program producing one byte, and only ops with a condition pay it (index
// ops, integer division and integer pow). On failure the offending value is
// read back so the error names it, like the CPU's.

/// Waits for one dispatch.
fn settle(p: Pending) -> Result<()> {
    match p {
        Pending::Program { op, event } => {
            event.wait(op).map_err(|e| err(format!("{op} (dispatched asynchronously) failed: {e}")))
        }
        Pending::Collective { op, event } => event
            .wait_within(op, crate::pjrt::collective_timeout())
            .map_err(|e| err(format!("{op} (dispatched asynchronously over a mesh) failed: {e}"))),
        Pending::Upload(u) => u.wait(),
    }
}

impl Backend for PjrtBackend {
    fn name(&self) -> &'static str {
        "pjrt"
    }

    fn device_count(&self) -> usize {
        self.client.device_count()
    }

    fn from_host(&self, buf: HostBuffer, device: Device) -> Result<Arc<Storage>> {
        if let Device::Mesh(_) = device {
            return self.upload_mesh(buf, device);
        }
        let dtype = buf.dtype();
        let len = buf.len();
        let bytes = buf.to_le_bytes();
        let (b, upload) = self.client.buffer_from_host_async(bytes, dtype, &[len], device.index())?;
        match mode() {
            Mode::Debug => upload.wait()?,
            Mode::Strict | Mode::Defer => self.queue(Pending::Upload(upload))?,
        }
        let st = Storage::new(StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(b)))), dtype, len, device);
        Ok(Arc::new(st))
    }

    fn to_host(&self, t: &Tensor) -> Result<HostBuffer> {
        if let Device::Mesh(_) = t.device() {
            return self.to_host_mesh(t);
        }
        let buf = self.buffer_of(t)?;
        self.drain()?;
        let l = t.layout();
        let whole = l.is_contiguous() && l.offset() == 0 && l.numel() == buf.numel();
        let dtype = t.dtype();
        let out = if whole {
            buf
        } else {
            let text = lower::read_module(l, buf.numel(), dtype)?;
            let meta = Meta { shape: [l.numel()].as_slice().into(), dtype };
            Arc::new(self.run("to_host", &text, &[&buf], &[meta], &[], &[], t.device())?.remove(0))
        };
        let mut bytes = kiln_tensor::alloc::try_vec("to_host", &[out.numel() * dtype.size_in_bytes()], DType::U8, 0u8)?;
        out.copy_to_host(&mut bytes)?;
        HostBuffer::from_le_bytes(dtype, &bytes)
    }

    fn copy_to_device(&self, t: &Tensor, device: Device) -> Option<Result<Arc<Storage>>> {
        match (t.device(), device) {
            (Device::Tpu(_), Device::Tpu(j)) => Some(self.copy_between_devices(t, j)),
            _ => None,
        }
    }

    fn exec(&self, op: &Op, inputs: &[&Tensor], outs: &[Meta], device: Device) -> Result<Vec<Arc<Storage>>> {
        if let Device::Mesh(_) = device {
            return self.exec_mesh(op, inputs, outs, device);
        }
        if let Some(values) = lower::creation_args(op) {
            let text = lower::creation_module(op)?;
            let args: Vec<Arc<Buffer>> =
                values.iter().map(|(bytes, dt)| self.upload_scalar(bytes, *dt, device)).collect::<Result<_>>()?;
            let refs: Vec<&Buffer> = args.iter().map(|b| &**b).collect();
            let out = self.run(op.name(), &text, &refs, outs, &[], &[], device)?;
            return Ok(out.into_iter().zip(outs).map(|(b, m)| self.storage(b, m.dtype, device)).collect());
        }
        let bufs: Vec<Arc<Buffer>> = inputs.iter().map(|t| self.buffer_of(t)).collect::<Result<_>>()?;
        let views: Vec<ArgView<'_>> = inputs
            .iter()
            .zip(&bufs)
            .map(|(t, b)| ArgView { layout: t.layout(), len: b.numel(), dtype: t.dtype() })
            .collect();
        let (text, checks) = lower::exec_module(op, &views, outs)?;
        let args: Vec<&Buffer> = bufs.iter().map(|b| &**b).collect();
        let out = self.run(op.name(), &text, &args, outs, &checks, inputs, device)?;
        Ok(out.into_iter().zip(outs).map(|(b, m)| self.storage(b, m.dtype, device)).collect())
    }

    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        kiln_tensor::check_assign(dst, src)?;
        if let Device::Mesh(_) = dst.device() {
            return self.assign_mesh(dst, src);
        }
        let same = Arc::ptr_eq(dst.storage(), src.storage());
        // The write holds the destination's lock from reading its buffer to
        // replacing it (Note [Storage mutability]); the source is read first, and a
        // deferred destination is computed before the lock is taken (running a
        // pending program takes its lock, which deferred writes take before storage locks).
        let src_buf = if same { None } else { Some(self.buffer_of(src)?) };
        let (mut g, dst_buf) = loop {
            self.buffer_of(dst)?;
            let g = dst.storage().write();
            if matches!(*g, StorageData::Pending) {
                // Written by a deferred op of another thread since: compute it first.
                continue;
            }
            let b = self.ready_data(data_in(&g, dst.device())?)?;
            break (g, b);
        };
        let src_view = ArgView {
            layout: src.layout(),
            len: src_buf.as_ref().map_or(dst_buf.numel(), |b| b.numel()),
            dtype: src.dtype(),
        };
        // Nobody else holds the destination's buffer (the storage and this
        // clone): donate it, so the write happens in place instead of into a copy.
        let donate = Arc::strong_count(&dst_buf) == 2;
        let text = lower::assign_module(dst.layout(), dst_buf.numel(), src_view, same, donate)?;
        let mut args: Vec<&Buffer> = vec![&dst_buf];
        if let Some(s) = &src_buf {
            args.push(s);
        }
        let meta = Meta { shape: [dst_buf.numel()].as_slice().into(), dtype: dst.dtype() };
        let new = self.run("copy_", &text, &args, &[meta], &[], &[], dst.device())?.remove(0);
        *g = StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(new))));
        Ok(())
    }

    fn nonzero(&self, t: &Tensor) -> Result<Tensor> {
        let host = self.to_host(t)?;
        let shape = t.shape().to_vec();
        // (On a mesh device, the indices come back replicated over the mesh, as `to_device` makes them.)
        let strides = kiln_tensor::contiguous_strides(&shape);
        let mut idx = vec![];
        let mut n = 0;
        for i in 0..host.len() {
            if host.get_f64(i) != 0.0 {
                let mut r = i;
                for s in strides.iter() {
                    idx.push((r / s) as i64);
                    r %= s;
                }
                n += 1;
            }
        }
        Tensor::from_vec(idx, &[n, shape.len()])?.to_device(t.device())
    }

    fn synchronize(&self, _device: Device) -> Result<()> {
        let r = self.flush_all();
        self.drain().and(r)
    }

    fn supports_meshes(&self) -> bool {
        true
    }

    fn distribute(&self, t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
        self.distribute_tensor(t, mesh, placements)
    }

    fn placements(&self, t: &Tensor) -> Result<(DeviceMesh, Vec<Placement>)> {
        self.placements_of(t)
    }

    fn local_map(
        &self,
        mesh: &DeviceMesh,
        f: &kiln_tensor::LocalFn<'_>,
        inputs: &[Tensor],
        in_placements: &[Vec<Placement>],
        out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        self.run_local_map(mesh, f, inputs, in_placements, out_placements)
    }

    fn redistribute(&self, t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
        self.redistribute_tensor(t, mesh, placements)
    }

    fn local_shards(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.local_shards_of(t)
    }

    fn from_local(
        &self,
        shards: &[Tensor],
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: &[usize],
    ) -> Result<Tensor> {
        self.assemble_shards(shards, mesh, placements, shape)
    }
}

/// The CPU backend's error for a failed check, naming the offending value.
pub(crate) fn check_error(name: &'static str, c: &Check, inputs: &[&Tensor]) -> Error {
    match c {
        Check::ZeroDivision => Error::invalid(name, "ZeroDivisionError: integer division or modulo by zero"),
        Check::NegativePower => Error::invalid(name, "Integers to negative integer powers are not allowed."),
        Check::GroupSizes => {
            // The CPU backend's message, from the sizes read back.
            let sizes = inputs.get(2).and_then(|t| t.to_host().ok());
            let rows = match (inputs.first(), inputs.get(1)) {
                (Some(a), Some(w)) => Some(kiln_tensor::grouped::grouped_dim(a.shape(), w.shape())),
                _ => None,
            };
            match (sizes, rows) {
                (Some(h), Some(rows)) => {
                    let s: Vec<i64> = (0..h.len()).map(|j| h.get_i64(j)).collect();
                    match kiln_tensor::grouped::group_offsets(&s, rows) {
                        Err(e) => e,
                        Ok(_) => Error::invalid(name, "invalid group sizes"),
                    }
                }
                _ => Error::invalid(name, "invalid group sizes"),
            }
        }
        Check::PagedMetadata => {
            // The CPU backend's message, from the metadata read back.
            let ints = |i: usize| -> Option<Vec<i64>> {
                let h = inputs.get(i)?.to_host().ok()?;
                Some((0..h.len()).map(|j| h.get_i64(j)).collect())
            };
            let (n, k) = (inputs.first().map(|q| q.shape()[0]), inputs.get(1).map(|k| k.shape().to_vec()));
            match (ints(5), ints(4), ints(3), n, k) {
                (Some(st), Some(ls), Some(tb), Some(n), Some(k)) => {
                    match kiln_tensor::paged::PagedLayout::new(&st, &ls, &tb, n, k[0], k[1]) {
                        Err(e) => e,
                        Ok(_) => Error::index(name, "inconsistent paged attention metadata"),
                    }
                }
                _ => Error::index(name, "inconsistent paged attention metadata"),
            }
        }
        Check::Index { input, dim, size } => {
            let bad = inputs
                .get(*input)
                .and_then(|t| t.to_host().ok())
                .and_then(|h| (0..h.len()).map(|i| h.get_i64(i)).find(|&v| v < 0 || v >= *size as i64));
            match bad {
                Some(v) => {
                    Error::index(name, format!("index {v} is out of bounds for dimension {dim} with size {size}"))
                }
                None => Error::index(name, format!("an index is out of bounds for dimension {dim} with size {size}")),
            }
        }
    }
}
