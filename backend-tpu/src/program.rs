//! Programs on a PJRT device (`Backend::compile`): kiln's `Program` lowered
//! to one StableHLO module (`lower::lower_program`), compiled through the
//! compile cache, run on flat buffers with updated parameters donated. On a
//! mesh (`PjrtMeshProgram`), the program is lowered over the mesh for the
//! shardings its arguments carry (`lower::lower_mesh_program`), once per
//! set of shardings, and runs as one SPMD program on their shards.
use crate::buffer::Shards;
use crate::buffer::{data_in, PjrtBuffer};
use crate::lower::mesh::ShardedShape;
use crate::lower::{lower_mesh_program, lower_program, Constants, LoweredProgram};
use crate::pjrt::{Buffer, Executable};
use kiln_tensor::ir::{Executable as ProgramExecutable, Program, ResultKind};
use kiln_tensor::{Device, DeviceMesh, Error, Layout, Result, Storage, StorageData, Tensor};
use std::sync::{Arc, Mutex};

/// `program` readied for `device`: one PJRT device, or a mesh of them.
pub(crate) fn compile(program: &Program, device: Device) -> Result<Arc<dyn ProgramExecutable>> {
    match device {
        Device::Mesh(_) => Ok(Arc::new(PjrtMeshProgram::new(program, device)?)),
        _ => Ok(Arc::new(PjrtProgram::new(program, device)?)),
    }
}

/// The arguments that must not be donated, as PJRT takes them: all but
/// those a result updates, read whole, whose buffer only their storage and
/// the caller's list reach (`held` counts the holders of the argument's buffer).
fn non_donatable(p: &Program, args: &[Tensor], held: impl Fn(usize) -> usize, device: Device) -> Vec<i64> {
    let mut updated = vec![false; args.len()];
    for r in p.results() {
        if let ResultKind::Update(k) = r.kind {
            updated[k] = true;
        }
    }
    (0..args.len())
        .filter(|&k| {
            let donate = updated[k]
                && args[k].is_whole_storage()
                && held(k) <= 2
                && data_in(&args[k].storage().read(), device).is_ok();
            !donate
        })
        .map(|k| k as i64)
        .collect()
}

/// Gives each result of `p` its data: an update is written into its
/// argument's storage (which is returned), any other result is a new tensor.
fn place_results(p: &Program, args: &[Tensor], datas: Vec<StorageData>, device: Device) -> Result<Vec<Tensor>> {
    let mut results = Vec::with_capacity(datas.len());
    for (r, data) in p.results().iter().zip(datas) {
        let m = p.meta(r.value);
        let st = Arc::new(Storage::new(data, m.dtype, m.shape.iter().product(), device));
        let value = Tensor::from_storage(st, Layout::contiguous(&m.shape))?;
        results.push(match r.kind {
            ResultKind::Update(k) => {
                let dst = &args[k];
                if dst.is_whole_storage() {
                    dst.storage().replace(value.storage().take_data());
                } else {
                    kiln_tensor::Backend::assign(crate::backend()?, dst, &value)?;
                }
                dst.storage().bump_version();
                dst.clone()
            }
            ResultKind::Fresh | ResultKind::State | ResultKind::Check(_) => value,
        });
    }
    Ok(results)
}

/// Each argument as a whole storage (a view is copied first).
fn whole(args: &[Tensor]) -> Result<Vec<Tensor>> {
    args.iter().map(|a| if a.is_whole_storage() { Ok(a.clone()) } else { a.contiguous() }).collect()
}

/// A program compiled for one PJRT device.
pub(crate) struct PjrtProgram {
    exe: Arc<Executable>,
    program: Program,
    lowered: LoweredProgram,
    /// The buffers of the creation values, passed after the parameters (Note \[Shared constants\]).
    constants: Vec<Arc<Buffer>>,
    device: Device,
}

impl PjrtProgram {
    /// Lowers and compiles `program` for `device`.
    pub(crate) fn new(program: &Program, device: Device) -> Result<PjrtProgram> {
        if !matches!(device, Device::Tpu(_)) {
            return Err(Error::device(
                "compile",
                format!("programs of kiln's representation run on one PJRT device, not {device}"),
            ));
        }
        let lowered = lower_program(program, Constants::Arguments)?;
        let backend = crate::backend()?;
        let exe = backend.executable(&lowered.module)?;
        let constants = lowered
            .constants
            .iter()
            .map(|(bytes, dt)| backend.upload_scalar(bytes, *dt, device))
            .collect::<Result<_>>()?;
        Ok(PjrtProgram { exe, program: program.clone(), lowered, constants, device })
    }
}

impl ProgramExecutable for PjrtProgram {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let (results, checked) = self.run_then_check(args)?;
        checked.map(|()| results)
    }

    fn run_then_check(&self, args: &[Tensor]) -> Result<(Vec<Tensor>, Result<()>)> {
        let backend = crate::backend()?;
        let p = &self.program;
        p.check_args(args, self.device)?;
        let flat = whole(args)?;
        let bufs: Vec<Arc<Buffer>> = flat.iter().map(|a| backend.buffer_of(a)).collect::<Result<_>>()?;
        let non_donatable = non_donatable(p, args, |k| Arc::strong_count(&bufs[k]), self.device);
        let refs: Vec<&Buffer> = bufs.iter().chain(&self.constants).map(|b| &**b).collect();
        let (mut outs, event) =
            self.exe.execute_with(&refs, self.device.index(), &self.lowered.outputs, &non_donatable)?;
        drop(refs);
        drop(bufs);
        backend.count_execution();
        backend.queue_event("a program", event)?;
        let flags = outs.split_off(p.results().len());
        let datas = outs.into_iter().map(|b| StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(b))))).collect();
        let results = place_results(p, args, datas, self.device)?;
        let checked =
            flags.iter().zip(&self.lowered.checks).try_for_each(|(flag, (c, name))| backend.verify(flag, name, c, &[]));
        Ok((results, checked))
    }
}

/// A program compiled for a mesh: lowered for each set of argument
/// shardings it has met (Note \[Distributed storages\] in `dist.rs`).
pub(crate) struct PjrtMeshProgram {
    program: Program,
    mesh: DeviceMesh,
    device: Device,
    lowerings: Mutex<Vec<(Vec<ShardedShape>, Arc<MeshLowering>)>>,
}

/// A program lowered and compiled for one set of argument shardings.
struct MeshLowering {
    exe: Arc<Executable>,
    lowered: LoweredProgram,
    /// The creation values, replicated (Note \[Shared constants\]).
    constants: Vec<Arc<Shards>>,
}

impl PjrtMeshProgram {
    fn new(program: &Program, device: Device) -> Result<PjrtMeshProgram> {
        program.verify()?;
        let mesh = DeviceMesh::of_device(device)?;
        Ok(PjrtMeshProgram { program: program.clone(), mesh, device, lowerings: Mutex::new(vec![]) })
    }

    /// The program lowered for arguments of `placements` (made on first use).
    fn lowering(&self, placements: Vec<ShardedShape>) -> Result<Arc<MeshLowering>> {
        let mut all = self.lowerings.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, l)) = all.iter().find(|(k, _)| *k == placements) {
            return Ok(l.clone());
        }
        let backend = crate::backend()?;
        let lowered = lower_mesh_program(&self.program, &self.mesh, placements.clone())?;
        let exe = backend.mesh_executable(&lowered.module, &self.mesh)?;
        let constants = lowered
            .constants
            .iter()
            .map(|(bytes, dt)| backend.replicated_shards(bytes, *dt, &[1], &self.mesh))
            .collect::<Result<_>>()?;
        let l = Arc::new(MeshLowering { exe, lowered, constants });
        all.push((placements, l.clone()));
        Ok(l)
    }
}

impl ProgramExecutable for PjrtMeshProgram {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let (results, checked) = self.run_then_check(args)?;
        checked.map(|()| results)
    }

    fn run_then_check(&self, args: &[Tensor]) -> Result<(Vec<Tensor>, Result<()>)> {
        let backend = crate::backend()?;
        let p = &self.program;
        p.check_args(args, self.device)?;
        let flat = whole(args)?;
        let shards: Vec<Arc<Shards>> = flat.iter().map(|a| backend.shards(a)).collect::<Result<_>>()?;
        let l = self.lowering(shards.iter().map(|s| (s.sharding.clone(), s.shape.clone())).collect())?;
        let non_donatable = non_donatable(p, args, |k| Arc::strong_count(&shards[k]), self.device);
        let all: Vec<Arc<Shards>> = shards.iter().chain(&l.constants).cloned().collect();
        drop(shards);
        drop(flat);
        let mut bufs =
            backend.launch_mesh(&l.exe, "a program", &self.mesh, &all, &l.lowered.outputs, &non_donatable)?;
        drop(all);
        backend.count_all_to_all(l.lowered.all_to_all_bytes);
        let flags = bufs.split_off(p.results().len());
        // A storage written in place keeps the mesh it was placed on.
        let view_of = |k: usize| match data_in(&args[k].storage().read(), self.device) {
            Ok(PjrtBuffer::Sharded(s)) => s.view.clone(),
            _ => self.mesh.clone(),
        };
        let datas = p
            .results()
            .iter()
            .zip(bufs)
            .zip(&l.lowered.placements)
            .map(|((r, bufs), out)| {
                let view = match (r.kind.clone(), &out.view) {
                    (ResultKind::Update(k), _) => view_of(k),
                    (_, Some(v)) => v.clone(),
                    (_, None) => self.mesh.clone(),
                };
                let shards = Shards { bufs, sharding: out.sharding.clone(), shape: out.shape.clone(), view };
                StorageData::Device(Box::new(PjrtBuffer::Sharded(Arc::new(shards))))
            })
            .collect();
        let results = place_results(p, args, datas, self.device)?;
        let checked = flags
            .iter()
            .zip(&l.lowered.checks)
            .try_for_each(|(flag, (c, name))| backend.verify(&flag[0], name, c, &[]));
        Ok((results, checked))
    }
}
