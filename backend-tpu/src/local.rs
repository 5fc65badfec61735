//! Local regions on the PJRT backend (`Backend::local_map`, see Note [Local
//! regions] in kiln-tensor's `collective.rs`): the function is recorded once
//! on stand-ins for the first device's blocks, and the recording runs on
//! every device of the mesh as the body of one `sdy.manual_computation`
//! (`lower/region.rs`): a program of its own, or, inside a function
//! `kiln::compile` traces on the mesh, an `Op::LocalMap` of its program.
use crate::backend::PjrtBackend;
use crate::buffer::PjrtBuffer;
use crate::buffer::Shards;
use crate::lower::mesh::shard_arg;
use crate::lower::region::{check_placements, global_shape, Body, Operand};
use crate::lower::{Builder, Sharding};
use kiln_tensor::capture::{
    is_recording, note_host_values, record_region, recording_policy, HostValues, RecordedRegion,
};
use kiln_tensor::op::region::LocalRegion;
use kiln_tensor::{
    distribute_tensor, Device, DeviceMesh, Error, Layout, LocalFn, Meta, Op, Placement, Result, Storage, StorageData,
    Tensor,
};
use std::sync::Arc;

fn local_err(msg: impl Into<String>) -> Error {
    Error::invalid("local_map", msg)
}

impl PjrtBackend {
    /// `Backend::local_map`: run now (eagerly), or recorded as one
    /// `Op::LocalMap` of the function `kiln::compile` is tracing on the mesh.
    pub(crate) fn run_local_map(
        &self,
        mesh: &DeviceMesh,
        f: &LocalFn<'_>,
        inputs: &[Tensor],
        in_placements: &[Vec<Placement>],
        out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        if inputs.len() != in_placements.len() {
            return Err(local_err(format!("{} inputs and {} lists of placements", inputs.len(), in_placements.len())));
        }
        if kiln_tensor::collective::local_region_mesh().is_some() {
            return Err(local_err(
                "the function of a local region called local_map: a region runs on the devices of a mesh, not inside another local region",
            ));
        }
        let in_shardings = inputs
            .iter()
            .zip(in_placements)
            .enumerate()
            .map(|(i, (t, p))| input_sharding(mesh, i, t, p))
            .collect::<Result<Vec<_>>>()?;
        if is_recording(mesh.device()) {
            return self.local_map_recorded(mesh, f, inputs, in_placements, &in_shardings, out_placements);
        }
        // Each input, laid out as the region wants it, with no padding.
        let mut shards: Vec<Arc<Shards>> = vec![];
        for (i, ((t, p), s)) in inputs.iter().zip(in_placements).zip(&in_shardings).enumerate() {
            let placed = match t.device() {
                Device::Mesh(_) => {
                    same_root(mesh, i, t)?;
                    self.materialize(t, s.clone(), mesh.clone())?
                }
                _ => self.shards(&distribute_tensor(t, mesh, p)?)?,
            };
            shards.push(placed);
        }
        // Stand-ins: the first device's blocks, on that device.
        let first = Device::Tpu(mesh.devices()[0]);
        let stand_ins: Vec<Tensor> = shards
            .iter()
            .zip(inputs)
            .map(|(s, t)| {
                let local = s.sharding.shard_shape(&s.shape);
                let buf = PjrtBuffer::Ready(s.bufs[0].clone());
                let st = Storage::new(StorageData::Device(Box::new(buf)), t.dtype(), local.iter().product(), first);
                Tensor::from_storage(Arc::new(st), Layout::contiguous(&local))
            })
            .collect::<Result<_>>()?;
        self.flush(first)?;
        let region = record_body(mesh, f, &stand_ins, out_placements, HostValues::Constant)?;
        let body = Body::new(&region.program, mesh, out_placements)?;
        // The program: the inputs' shards and the body's constants go in, the region's results come out.
        let root = mesh.root();
        let mut b = Builder::new(&[]).0;
        let mut args: Vec<Arc<Shards>> = vec![];
        let mut operands = vec![];
        let mut op_shardings = vec![];
        for operand in body.operands()? {
            let (s, dt) = match operand {
                Operand::Block(i) => (shards[i].clone(), inputs[i].dtype()),
                Operand::Constant(bytes, dt) => (self.replicated_shards(&bytes, dt, &[1], &root)?, dt),
            };
            operands.push(shard_arg(&mut b, &s.sharding, &s.shape, dt)?);
            op_shardings.push(s.sharding.clone());
            args.push(s);
        }
        let exchanged = body.all_to_all_bytes;
        let (mut outs, mut out_shardings, checks) = body.emit(&mut b, mesh, &operands, &op_shardings)?;
        let n_outs = outs.len();
        let mut meta: Vec<_> =
            outs.iter().zip(&out_shardings).map(|(v, s)| (v.dtype(), s.shard_shape(v.shape()))).collect();
        for (flag, ..) in &checks {
            outs.push(flag.clone());
            out_shardings.push(Sharding::replicated(&root, 0));
            meta.push((kiln_tensor::DType::Bool, vec![]));
        }
        let text = b.finish_sharded(&outs, &out_shardings)?;
        let mut bufs = self.run_mesh("local_map", &text, &root, &args, &meta)?;
        self.count_all_to_all(exchanged * root.devices().len() as u64);
        for (flags, (_, c, name)) in bufs.split_off(n_outs).iter().zip(&checks) {
            self.verify(&flags[0], name, c, &[])?;
        }
        bufs.into_iter()
            .zip(out_shardings)
            .zip(outs)
            .map(|((bufs, sharding), v)| {
                let shape = v.shape().to_vec();
                let shards = Shards { bufs, sharding, shape: shape.clone(), view: mesh.clone() };
                let st = self.mesh_storage(Arc::new(shards), v.dtype(), mesh.device());
                Tensor::from_storage(st, Layout::contiguous(&shape))
            })
            .collect()
    }

    /// A local region inside a function `kiln::compile` is tracing on the
    /// mesh: the body is recorded on its own (on zero stand-ins of the first
    /// device's blocks) and becomes one `Op::LocalMap` of the traced program,
    /// whose operands are the inputs and whose results are new values of it.
    fn local_map_recorded(
        &self,
        mesh: &DeviceMesh,
        f: &LocalFn<'_>,
        inputs: &[Tensor],
        in_placements: &[Vec<Placement>],
        in_shardings: &[Sharding],
        out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        if *mesh != mesh.root() {
            return Err(local_err(
                "inside a function traced by kiln::compile, a local region runs over the whole mesh the function runs on (not a sub-mesh, not inside another local region)",
            ));
        }
        for (i, t) in inputs.iter().enumerate() {
            if !t.is_distributed() {
                return Err(local_err(format!(
                    "input {i} is on {}: inside kiln::compile a local region's inputs are on its mesh (distribute them first)",
                    t.device()
                )));
            }
            same_root(mesh, i, t)?;
        }
        // The blocks' stand-ins: zeros uploaded to the first device (the recording reads no values).
        let first = Device::Tpu(mesh.devices()[0]);
        let stand_ins = inputs
            .iter()
            .zip(in_shardings)
            .map(|(t, s)| Tensor::zeros(&s.shard_shape(t.shape()), t.dtype())?.to_device(first))
            .collect::<Result<Vec<_>>>()?;
        self.flush(first)?;
        let policy = recording_policy(mesh.device()).unwrap_or(HostValues::Constant);
        let RecordedRegion { program, host_values, .. } = record_body(mesh, f, &stand_ins, out_placements, policy)?;
        // Refused here rather than where the region is lowered: the same error as a region run on its own.
        Body::new(&program, mesh, out_placements)?.operands()?;
        note_host_values(mesh.device(), host_values);
        let mut outs = vec![];
        for (i, (r, p)) in program.results().iter().zip(out_placements).enumerate() {
            check_placements("output", i, p)?;
            let block = program.meta(r.value);
            let s = Sharding::from_placements(mesh, p, block.shape.len())?;
            outs.push(Meta::new(&global_shape(&block.shape, &s), block.dtype));
        }
        let checks = program.insts().iter().any(|inst| {
            let metas: Vec<Meta> = inst.args.iter().map(|a| program.meta(*a).clone()).collect();
            inst.op.fails_on_data(&metas)
        });
        let text: Arc<str> = program.to_string().into();
        let region = LocalRegion {
            device: mesh.device().index(),
            ins: inputs.iter().map(|t| t.meta()).collect(),
            in_placements: in_placements.to_vec(),
            outs,
            out_placements: out_placements.to_vec(),
            checks,
            body: Arc::new(program),
            text,
        };
        // Outside autograd: `kiln::local_map` gives the region its gradient.
        let detached: Vec<Tensor> = inputs.iter().map(Tensor::detach).collect();
        let refs: Vec<&Tensor> = detached.iter().collect();
        Ok(Tensor::apply(Op::LocalMap(Arc::new(region)), &refs)?.into_vec())
    }
}

/// Input `i`'s sharding in the region, checked: Shard and Replicate only,
/// blocks of one shape on every device.
fn input_sharding(mesh: &DeviceMesh, i: usize, t: &Tensor, p: &[Placement]) -> Result<Sharding> {
    check_placements("input", i, p)?;
    let s = Sharding::from_placements(mesh, p, t.ndim())?;
    if s.padded_shape(t.shape()) != t.shape() {
        return Err(Error::shape(
            "local_map",
            format!(
                "input {i} of shape {:?} placed {p:?} does not split into equal blocks on {mesh}: every device of a local region gets a block of one shape",
                t.shape()
            ),
        ));
    }
    Ok(s)
}

/// Checks that input `i`, on a mesh, is on a view of the region's.
fn same_root(mesh: &DeviceMesh, i: usize, t: &Tensor) -> Result<()> {
    let tm = t.device_mesh()?;
    if !tm.same_root(mesh) {
        return Err(Error::device("local_map", format!("input {i} is on {tm}, the region runs on {mesh}")));
    }
    Ok(())
}

/// Records `f` on the stand-ins (on the mesh's first device) as a region
/// over `mesh` (see Note [Local regions]).
fn record_body(
    mesh: &DeviceMesh,
    f: &LocalFn<'_>,
    stand_ins: &[Tensor],
    out_placements: &[Vec<Placement>],
    policy: HostValues,
) -> Result<RecordedRegion> {
    let first = Device::Tpu(mesh.devices()[0]);
    record_region(first, policy, stand_ins, &mut |blocks: &[Tensor]| {
        let _region = kiln_tensor::collective::enter_local_region(mesh);
        let returned = f(blocks)?;
        if returned.len() != out_placements.len() {
            return Err(local_err(format!(
                "the function returned {} tensors for {} lists of output placements",
                returned.len(),
                out_placements.len()
            )));
        }
        Ok(returned)
    })
}
