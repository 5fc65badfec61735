//! Distributed tensors on the PJRT backend: a storage on a mesh device holds
//! one shard per mesh device (`Shards`), and every op, in-place write and read
//! on such tensors runs as one SPMD program over the mesh (see Note
//! [Distributed storages]).
use crate::backend::PjrtBackend;
use crate::buffer::PjrtBuffer;
use crate::buffer::Shards;
use crate::lower::mesh::{constrain, flat_value, padded, result_sharding, shard_arg, write_view};
use crate::lower::{self, shard, Builder, Sharding, Val};
use crate::mode::{mode, Mode};
use crate::pjrt::{Buffer, CompileOptions, Executable};
use crate::stablehlo::Module;
use kiln_tensor::capture::is_recording;
use kiln_tensor::{
    DType, Device, DeviceMesh, Error, HostBuffer, Layout, Meta, Op, Placement, Result, Storage, StorageData, Tensor,
};
use std::sync::Arc;

// Note [Distributed storages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor on a mesh device (`Device::Mesh`, Note [Device meshes]) has an
// ordinary layout over an ordinary storage, whose data is `Shards`: the
// storage's logical n-d shape, its sharding over the root mesh (Note
// [Shardings]), and one buffer per mesh device holding that device's shard of
// the padded value. Views stay layout transforms of the storage, as on one
// device.
//
// Every primitive on such tensors is one SPMD program over the mesh, built as
// a one-device program is: each input storage is an argument of its padded
// global type carrying its sharding (a partial sum is resharded to reduced
// first), sliced to its logical shape and flattened, and the input's view is
// read from it (Note [Views of flat buffers]); the op's lowering follows;
// each result is padded and annotated with the sharding kiln chooses (Note
// [Placements of results]). The partitioner turns the program into one per
// device with the collectives it needs, so results are right whatever the
// annotations; the annotations decide where data lives and what moves. An
// in-place write is a program that writes the view into the destination
// storage's value and returns it with the storage's sharding, then swaps the
// new shards in. Reading data gathers the view replicated and copies the first
// device's buffer. `redistribute` is a program whose result carries the new
// sharding. Under DeferAndFuse, ops and writes are recorded into the mesh's
// pending `Program` (Note [Deferred programs] in kiln-tensor), which is
// lowered the same way (`lower_mesh_program`): its parameters are shards
// (read by `flat_value`), each value remembers the storage it reads and the
// sharding kiln's rules give it, and each result is returned padded with its
// storage's sharding; a parameter a result updates with the same sharding is
// donated. Capture (`kiln::compile` on a mesh device) records a `Program`
// the same way and runs it lowered for the shardings its inputs and state
// have at each call (one lowering per set, so a replay never reads shards
// laid out for another program); an input's placements are part of the
// guard. While tracing, a recorded value lies where the program so far,
// lowered over the mesh, puts it (`storage_placement`). `redistribute`
// under DeferAndFuse and in traced functions is an `Op::Redistribute`,
// whose result the lowering reshards to the target (outside autograd, as
// the eager move is), and a local region an `Op::LocalMap`. An op
// whose result is a partial sum gets its inputs' shardings spelled out in a
// program of many ops: the partitioner must compute it on the split inputs,
// not on what a later use of an input gathers. `to_local` and `from_local`
// inside a traced function are an error for now.

fn err(msg: impl Into<String>) -> Error {
    Error::backend("pjrt", msg)
}

/// The error for what a function traced by kiln::compile cannot do with distributed tensors yet.
pub(crate) fn unsupported_mode(device: Device) -> Error {
    Error::invalid(
        "pjrt",
        format!(
            "inside a function traced by kiln::compile, tensors on {device} (a device mesh) take ops, in-place writes and redistribute; to_local, from_local and reading data are not traced yet: call them outside the function"
        ),
    )
}

/// A program over a mesh being built: its arguments' shards and values.
struct MeshProgram {
    b: Builder,
    args: Vec<Arc<Shards>>,
    vals: Vec<Val>,
}

impl MeshProgram {
    fn new() -> MeshProgram {
        MeshProgram { b: Builder::new(&[]).0, args: vec![], vals: vec![] }
    }

    /// The flat logical value of a storage's shards (an argument, added once).
    fn storage_value(&mut self, s: &Arc<Shards>, dtype: DType) -> Result<Val> {
        let arg = match self.args.iter().position(|a| Arc::ptr_eq(a, s)) {
            Some(i) => self.vals[i].clone(),
            None => {
                let v = shard_arg(&mut self.b, &s.sharding, &s.shape, dtype)?;
                self.args.push(s.clone());
                self.vals.push(v.clone());
                v
            }
        };
        Ok(flat_value(&mut self.b, &arg, &s.sharding, &s.shape))
    }
}

impl PjrtBackend {
    /// The shards behind a tensor on a mesh device, running its pending
    /// program first when the storage waits for it.
    pub(crate) fn shards(&self, t: &Tensor) -> Result<Arc<Shards>> {
        let data = crate::buffer::data_of(t)?;
        self.shards_from(data, t.device())
    }

    pub(crate) fn shards_from(&self, data: PjrtBuffer, device: Device) -> Result<Arc<Shards>> {
        match data {
            PjrtBuffer::Sharded(s) => Ok(s),
            _ => Err(err(format!("a tensor on {device} holds a one-device buffer"))),
        }
    }

    /// Compiles `text` for `mesh` and runs it over every mesh device with
    /// `args` (each storage's shards); returns each output's buffers in mesh order.
    pub(crate) fn run_mesh(
        &self,
        name: &'static str,
        module: &Module,
        mesh: &DeviceMesh,
        args: &[Arc<Shards>],
        out_meta: &[(DType, Vec<usize>)],
    ) -> Result<Vec<Vec<Arc<Buffer>>>> {
        let exe = self.mesh_executable(module, mesh)?;
        self.launch_mesh(&exe, name, mesh, args, out_meta, &[])
    }

    /// The executable of a program over `mesh` (compiled for its devices, in mesh order).
    pub(crate) fn mesh_executable(&self, module: &Module, mesh: &DeviceMesh) -> Result<Arc<Executable>> {
        let client = self.client();
        let ids: Vec<i64> = mesh.devices().iter().map(|&d| client.device_id(d)).collect::<Result<_>>()?;
        self.executable_with(module, &CompileOptions::spmd(&ids))
    }

    /// Runs a program over `mesh` once over every device (each argument's
    /// shards in the executable's device order); returns each output's
    /// buffers in mesh order. Debug mode waits for every device.
    pub(crate) fn launch_mesh(
        &self,
        exe: &Executable,
        name: &'static str,
        mesh: &DeviceMesh,
        args: &[Arc<Shards>],
        out_meta: &[(DType, Vec<usize>)],
        non_donatable: &[i64],
    ) -> Result<Vec<Vec<Arc<Buffer>>>> {
        let order = exe.addressable_devices()?;
        let pos: Vec<usize> = order
            .iter()
            .map(|d| mesh.devices().iter().position(|m| m == d).ok_or_else(|| err("an executable device off the mesh")))
            .collect::<Result<_>>()?;
        let lists: Vec<Vec<&Buffer>> = pos.iter().map(|&p| args.iter().map(|a| &*a.bufs[p]).collect()).collect();
        let (outs, events) = exe.execute_spmd(&lists, out_meta, non_donatable, 0)?;
        self.count_execution();
        for e in events {
            match mode() {
                Mode::Debug => e
                    .wait_within(name, crate::pjrt::collective_timeout())
                    .map_err(|e| err(format!("{name} failed on {mesh}: {e}")))?,
                _ => self.queue_collective(name, e)?,
            }
        }
        let mut by_out: Vec<Vec<Option<Arc<Buffer>>>> = vec![vec![None; pos.len()]; out_meta.len()];
        for (dev_outs, &p) in outs.into_iter().zip(&pos) {
            for (o, b) in dev_outs.into_iter().enumerate() {
                by_out[o][p] = Some(Arc::new(b));
            }
        }
        by_out
            .into_iter()
            .map(|v| v.into_iter().map(|b| b.ok_or_else(|| err("a mesh device returned no output"))).collect())
            .collect()
    }

    pub(crate) fn mesh_storage(&self, shards: Arc<Shards>, dtype: DType, device: Device) -> Arc<Storage> {
        let len = shards.shape.iter().product();
        Arc::new(Storage::new(StorageData::Device(Box::new(PjrtBuffer::Sharded(shards))), dtype, len, device))
    }

    /// `Backend::exec` for inputs on a mesh device (Note [Distributed storages]).
    pub(crate) fn exec_mesh(
        &self,
        op: &Op,
        inputs: &[&Tensor],
        outs: &[Meta],
        device: Device,
    ) -> Result<Vec<Arc<Storage>>> {
        let mesh = DeviceMesh::of_device(device)?;
        let mut p = MeshProgram::new();
        let mut in_shardings = vec![];
        let (results, checks) = if let Some(values) = lower::creation_args(op) {
            let mut args = vec![];
            for (bytes, dt) in values {
                let s = self.replicated_shards(&bytes, dt, &[1], &mesh)?;
                args.push(p.storage_value(&s, dt)?);
            }
            (vec![lower::creation_lower(&mut p.b, op, &args)?], vec![])
        } else {
            let mut vals = vec![];
            for (i, t) in inputs.iter().enumerate() {
                let s = self.shards(t)?;
                let flat = p.storage_value(&s, t.dtype())?;
                let v = lower::read_view(&mut p.b, &flat, t.layout())?;
                let (v, need) = constrain(&mut p.b, op, i, v, &s.sharding, &s.shape, t.layout(), false);
                vals.push(v);
                in_shardings.push((t.shape().to_vec(), need));
            }
            lower::lower_op(&mut p.b, op, &vals, outs)?
        };
        lower::check_results(op, &results, outs)?;
        let mut values = vec![];
        let mut shardings = vec![];
        let mut meta = vec![];
        for (i, (r, m)) in results.iter().zip(outs).enumerate() {
            let s = result_sharding(&p.b, op, &in_shardings, i, r, &m.shape, &mesh);
            values.push(padded(&mut p.b, r, &m.shape, &s));
            meta.push((m.dtype, s.shard_shape(&m.shape)));
            shardings.push(s);
        }
        for (v, _) in &checks {
            values.push(v.clone());
            shardings.push(Sharding::replicated(&mesh, 0));
            meta.push((DType::Bool, vec![]));
        }
        let MeshProgram { b, args, .. } = p;
        let text = b.finish_sharded(&values, &shardings)?;
        let mut bufs = self.run_mesh(op.name(), &text, &mesh, &args, &meta)?;
        let flags = bufs.split_off(outs.len());
        for (flag, (_, c)) in flags.iter().zip(&checks) {
            self.verify(&flag[0], op.name(), c, inputs)?;
        }
        Ok(bufs
            .into_iter()
            .zip(outs)
            .zip(shardings)
            .map(|((bufs, m), sharding)| {
                let shards = Shards { bufs, sharding, shape: m.shape.to_vec(), view: mesh.clone() };
                self.mesh_storage(Arc::new(shards), m.dtype, device)
            })
            .collect())
    }

    /// `bytes` (a row-major value of `shape`) copied to every device of `mesh`.
    pub(crate) fn replicated_shards(
        &self,
        bytes: &[u8],
        dtype: DType,
        shape: &[usize],
        mesh: &DeviceMesh,
    ) -> Result<Arc<Shards>> {
        let sharding = Sharding::replicated(mesh, shape.len());
        self.sharded_from_bytes(bytes, dtype, shape, sharding, mesh.root())
    }

    /// Each mesh device's shard of the row-major `bytes`, uploaded to it.
    fn sharded_from_bytes(
        &self,
        bytes: &[u8],
        dtype: DType,
        shape: &[usize],
        sharding: Sharding,
        view: DeviceMesh,
    ) -> Result<Arc<Shards>> {
        let elem = dtype.size_in_bytes();
        let local = sharding.shard_shape(shape);
        let mut bufs = vec![];
        for (pos, &d) in sharding.mesh.devices().iter().enumerate() {
            let b = if sharding.is_replicated() {
                self.client().buffer_from_host(bytes, dtype, &local, d)?
            } else {
                self.client().buffer_from_host(&sharding.shard_bytes(bytes, elem, shape, pos), dtype, &local, d)?
            };
            bufs.push(Arc::new(b));
        }
        Ok(Arc::new(Shards { bufs, sharding, shape: shape.to_vec(), view }))
    }

    /// `Backend::from_host` on a mesh device: the data replicated on every device.
    pub(crate) fn upload_mesh(&self, buf: HostBuffer, device: Device) -> Result<Arc<Storage>> {
        let mesh = DeviceMesh::of_device(device)?;
        let dtype = buf.dtype();
        let s = self.replicated_shards(&buf.to_le_bytes(), dtype, &[buf.len()], &mesh)?;
        let len = buf.len();
        Ok(Arc::new(Storage::new(StorageData::Device(Box::new(PjrtBuffer::Sharded(s))), dtype, len, device)))
    }

    /// The view of `t` as a fresh storage of its shape with `sharding` (a
    /// program whose result carries it): redistribution, and the gather reads use.
    pub(crate) fn materialize(&self, t: &Tensor, sharding: Sharding, view: DeviceMesh) -> Result<Arc<Shards>> {
        if is_recording(t.device()) {
            return Err(unsupported_mode(t.device()));
        }
        let mesh = sharding.mesh.clone();
        let s = self.shards(t)?;
        let mut p = MeshProgram::new();
        let flat = p.storage_value(&s, t.dtype())?;
        let v = lower::read_view(&mut p.b, &flat, t.layout())?;
        let out = padded(&mut p.b, &v, t.shape(), &sharding);
        let MeshProgram { b, args, .. } = p;
        let text = b.finish_sharded(&[out], std::slice::from_ref(&sharding))?;
        let meta = [(t.dtype(), sharding.shard_shape(t.shape()))];
        let bufs = self.run_mesh("redistribute", &text, &mesh, &args, &meta)?.remove(0);
        Ok(Arc::new(Shards { bufs, sharding, shape: t.shape().to_vec(), view }))
    }

    /// `Backend::to_host` for a tensor on a mesh device: its view gathered.
    pub(crate) fn to_host_mesh(&self, t: &Tensor) -> Result<HostBuffer> {
        let mesh = DeviceMesh::of_device(t.device())?;
        let s = self.materialize(t, Sharding::replicated(&mesh, t.ndim()), mesh)?;
        self.drain()?;
        let buf = &s.bufs[0];
        let mut bytes =
            kiln_tensor::alloc::try_vec("to_host", &[buf.numel() * t.dtype().size_in_bytes()], DType::U8, 0u8)?;
        buf.copy_to_host(&mut bytes)?;
        HostBuffer::from_le_bytes(t.dtype(), &bytes)
    }

    /// `Backend::assign` on a mesh device: the write's program returns the
    /// destination storage's new value with its sharding.
    pub(crate) fn assign_mesh(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let mesh = DeviceMesh::of_device(dst.device())?;
        let src_shards = self.shards(src)?;
        // The destination's lock is held from reading its shards to swapping in
        // the new ones; a deferred destination is computed before it is taken.
        let (mut w, d) = loop {
            self.shards(dst)?;
            let w = dst.storage().write();
            if matches!(*w, StorageData::Pending) {
                // Written by a deferred op of another thread since: compute it first.
                continue;
            }
            match crate::buffer::data_in(&w, dst.device())? {
                PjrtBuffer::Sharded(d) => break (w, d),
                _ => return Err(err(format!("a tensor on {} without shards", dst.device()))),
            }
        };
        let mut p = MeshProgram::new();
        let flat = p.storage_value(&d, dst.dtype())?;
        let sflat = p.storage_value(&src_shards, src.dtype())?;
        let s = lower::read_view(&mut p.b, &sflat, src.layout())?;
        let new = write_view(&mut p.b, &flat, dst.layout(), &s, &mesh)?;
        let sharding = d.sharding.reduced();
        let out = padded(&mut p.b, &new, &d.shape, &sharding);
        let MeshProgram { b, args, .. } = p;
        let text = b.finish_sharded(&[out], std::slice::from_ref(&sharding))?;
        let meta = [(dst.dtype(), sharding.shard_shape(&d.shape))];
        let bufs = self.run_mesh("copy_", &text, &mesh, &args, &meta)?.remove(0);
        let shards = Shards { bufs, sharding, shape: d.shape.clone(), view: d.view.clone() };
        *w = StorageData::Device(Box::new(PjrtBuffer::Sharded(Arc::new(shards))));
        Ok(())
    }

    /// `Backend::distribute`: `t`'s data cut into shards, one upload per device.
    pub(crate) fn distribute_tensor(&self, t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
        if placements.iter().any(|p| matches!(p, Placement::Partial(_))) {
            return Err(Error::invalid(
                "distribute_tensor",
                "a whole tensor has no partial values: place it with Shard or Replicate (Partial placements come from ops, or from Tensor::from_local)",
            ));
        }
        let sharding = Sharding::from_placements(mesh, placements, t.ndim())?;
        let host = t.to_host()?;
        let s = self.sharded_from_bytes(&host.to_le_bytes(), t.dtype(), t.shape(), sharding, mesh.clone())?;
        let st = self.mesh_storage(s, t.dtype(), mesh.device());
        Tensor::from_storage(st, Layout::contiguous(t.shape()))
    }

    /// `Backend::placements` of a tensor on a mesh device.
    pub(crate) fn placements_of(&self, t: &Tensor) -> Result<(DeviceMesh, Vec<Placement>)> {
        if !matches!(t.device(), Device::Mesh(_)) {
            return Err(Error::device("placements", format!("{} is not a device mesh", t.device())));
        }
        let (sharding, shape, placed_on) = self.storage_placement(t)?;
        let view = shard::view_sharding(&sharding, &shape, t.layout());
        if let Some(p) = view.placements_on(&placed_on) {
            return Ok((placed_on, p));
        }
        let root = placed_on.root();
        let p = view.placements_on(&root).ok_or_else(|| err("a sharding off its own mesh"))?;
        Ok((root, p))
    }

    /// Where the storage of `t` (on a mesh device) lies: its sharding, n-d
    /// shape and the view of the mesh it was placed on. A value that a trace
    /// on the mesh recorded (it has no data yet) lies where its program,
    /// lowered over the mesh, puts it; a deferred one is computed first.
    fn storage_placement(&self, t: &Tensor) -> Result<(Sharding, Vec<usize>, DeviceMesh)> {
        if matches!(*t.storage().read(), StorageData::Traced) {
            return self.recorded_placement(t);
        }
        match crate::buffer::data_of(t)? {
            PjrtBuffer::Sharded(s) => Ok((s.sharding.clone(), s.shape.clone(), s.view.clone())),
            PjrtBuffer::Ready(_) => Err(err(format!("a tensor on {} holds a one-device buffer", t.device()))),
        }
    }

    /// Where a value recorded by this thread's trace on `t`'s mesh lies: the
    /// recorded program, lowered over the mesh for the shardings of the
    /// storages it reads, places it. The lowering follows the recording
    /// (`lower::Follower`), lowering only what was recorded since the last question.
    fn recorded_placement(&self, t: &Tensor) -> Result<(Sharding, Vec<usize>, DeviceMesh)> {
        thread_local! {
            static FOLLOWER: std::cell::RefCell<Option<lower::Follower>> = const { std::cell::RefCell::new(None) };
        }
        let mesh = DeviceMesh::of_device(t.device())?;
        let found = kiln_tensor::capture::inspect_recording(t.device(), t.storage(), |rec, v| {
            let v = v.ok_or_else(|| StorageData::Traced.not_here("pjrt"))?;
            FOLLOWER.with(|f| {
                let mut f = f.borrow_mut();
                let mut follower = match f.take() {
                    Some(fl) if fl.recording == rec.id => fl,
                    _ => lower::Follower::new(rec.id, mesh.clone()),
                };
                follower.advance(rec.program, |i| {
                    let st = &rec.sources[i];
                    let s = self.shards(&Tensor::from_storage(st.clone(), Layout::contiguous(&[st.len()]))?)?;
                    Ok((s.sharding.clone(), s.shape.clone()))
                })?;
                let out = follower.placed(v)?;
                // Kept only after a success: a failed step leaves nothing half followed.
                *f = Some(follower);
                Ok((out.sharding, out.shape, out.view.unwrap_or_else(|| mesh.clone())))
            })
        });
        found.unwrap_or_else(|| Err(StorageData::Traced.not_here("pjrt")))
    }

    /// `Backend::redistribute`.
    pub(crate) fn redistribute_tensor(
        &self,
        t: &Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
    ) -> Result<Tensor> {
        let target = Sharding::from_placements(mesh, placements, t.ndim())?;
        shard::check_mesh(&target, &DeviceMesh::of_device(t.device())?)?;
        if !target.unreduced.is_empty() {
            // A partial sum cannot be made, only kept: the current placements decide.
            let (sharding, shape, _) = self.storage_placement(t)?;
            let current = shard::view_sharding(&sharding, &shape, t.layout());
            if target.unreduced != current.unreduced {
                return Err(Error::invalid(
                    "redistribute",
                    format!(
                        "cannot make a Partial placement from {:?}: Partial placements come from ops (sum, matmul) or from Tensor::from_local",
                        current.placements_on(&mesh.root())
                    ),
                ));
            }
        }
        if self.deferral(t.device()).is_some() || is_recording(t.device()) {
            // Deferred or traced: an op of the program whose result carries the
            // target placements (outside autograd, as the eager move is).
            let op = Op::Redistribute(Arc::new(mesh.redistribution(placements)));
            return Tensor::apply1(op, &[&t.detach()]);
        }
        let shards = self.materialize(t, target, mesh.clone())?;
        let st = self.mesh_storage(shards, t.dtype(), t.device());
        Tensor::from_storage(st, Layout::contiguous(t.shape()))
    }

    /// `Backend::local_shards`: each device's real (unpadded) shard of `t`'s view.
    pub(crate) fn local_shards_of(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        if is_recording(t.device()) {
            return Err(unsupported_mode(t.device()));
        }
        let (mesh, placements) = self.placements_of(t)?;
        let s = self.shards(t)?;
        // A view other than the storage itself is materialized with its placements first.
        let s = if t.layout().is_contiguous() && t.layout().offset() == 0 && t.shape() == s.shape.as_slice() {
            s
        } else {
            let sharding = Sharding::from_placements(&mesh, &placements, t.ndim())?;
            self.materialize(t, sharding, mesh)?
        };
        let local = s.sharding.shard_shape(&s.shape);
        let strides = kiln_tensor::contiguous_strides(&local);
        let mut out = vec![];
        for (pos, &d) in s.sharding.mesh.devices().iter().enumerate() {
            let buf = s.bufs[pos].clone();
            let len = buf.numel();
            let st =
                Storage::new(StorageData::Device(Box::new(PjrtBuffer::Ready(buf))), t.dtype(), len, Device::Tpu(d));
            let real = s.sharding.real_shard_shape(&s.shape, pos);
            out.push(Tensor::from_storage(Arc::new(st), Layout::new(real.as_slice().into(), strides.clone(), 0))?);
        }
        Ok(out)
    }

    /// `Backend::from_local`: shards (one per mesh device, each on its device
    /// and of its real shard shape) as one distributed tensor.
    pub(crate) fn assemble_shards(
        &self,
        shards: &[Tensor],
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: &[usize],
    ) -> Result<Tensor> {
        if is_recording(mesh.device()) {
            return Err(unsupported_mode(mesh.device()));
        }
        let sharding = Sharding::from_placements(mesh, placements, shape.len())?;
        let local = sharding.shard_shape(shape);
        let dtype = shards[0].dtype();
        let mut bufs = vec![];
        for (pos, (t, &d)) in shards.iter().zip(mesh.devices()).enumerate() {
            let real = sharding.real_shard_shape(shape, pos);
            if t.shape() != real.as_slice() || t.dtype() != dtype {
                return Err(Error::shape(
                    "from_local",
                    format!(
                        "the shard for mesh device {pos} (tpu:{d}) of a {shape:?} tensor placed {placements:?} must be {real:?} {dtype}, got {:?} {}",
                        t.shape(),
                        t.dtype()
                    ),
                ));
            }
            let t = t.to_device(Device::Tpu(d))?;
            let full = if real == local {
                t.contiguous()?
            } else {
                let z = Tensor::zeros(&local, (dtype, Device::Tpu(d)))?;
                let mut v = z.clone();
                for (dim, &n) in real.iter().enumerate() {
                    v = v.narrow(dim as isize, 0, n)?;
                }
                v.copy_(&t)?;
                z
            };
            bufs.push(self.buffer_of(&full)?);
        }
        let shards = Shards { bufs, sharding, shape: shape.to_vec(), view: mesh.clone() };
        let st = self.mesh_storage(Arc::new(shards), dtype, mesh.device());
        Tensor::from_storage(st, Layout::contiguous(shape))
    }
}
