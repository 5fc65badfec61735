//! Local regions on the PJRT backend (`Backend::local_map`, see Note [Local
//! regions] in kiln-tensor's `collective.rs`): the function is traced once on
//! stand-ins for the first device's blocks, and the trace runs on every
//! device of the mesh as the body of one `sdy.manual_computation`: a program
//! of its own, or, inside a function `kiln::compile` traces, part of the
//! captured program.
use crate::backend::PjrtBackend;
use crate::graph::mesh::Shards;
use crate::graph::{self, Graph, PjrtBuffer};
use crate::lower::mesh::shard_arg;
use crate::lower::{self, Builder, Check, Sharding, Ty, Val};
use kiln_tensor::capture::{record_region, HostValues};
use kiln_tensor::collective::Collective;
use kiln_tensor::ir::{ParamKind, Program};
use kiln_tensor::{
    distribute_tensor, DType, Device, DeviceMesh, Error, Layout, LocalFn, Op, Placement, Result, Storage, StorageData,
    Tensor,
};
use std::sync::Arc;

fn local_err(msg: impl Into<String>) -> Error {
    Error::invalid("local_map", msg)
}

/// Checks one list of placements of a local region's inputs or outputs.
fn check_placements(what: &str, i: usize, p: &[Placement]) -> Result<()> {
    if p.iter().any(|p| matches!(p, Placement::Partial(_))) {
        return Err(local_err(format!(
            "{what} {i} is placed {p:?}: a local region takes and gives Shard and Replicate placements (reduce partial sums inside it with all_reduce or reduce_scatter)"
        )));
    }
    Ok(())
}

/// The global shape of blocks of shape `local` laid out with `s`.
fn global_shape(local: &[usize], s: &Sharding) -> Vec<usize> {
    local.iter().enumerate().map(|(d, &n)| n * s.splits(d)).collect()
}

impl PjrtBackend {
    /// `Backend::local_map`: run now (eagerly), or appended to the capture
    /// graph of the function `kiln::compile` is tracing.
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
        if graph::is_tracing() {
            return self.local_map_traced(mesh, f, inputs, &in_shardings, out_placements);
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
        let body = trace_body(mesh, f, &stand_ins, out_placements, HostValues::Constant)?;
        // The program: the inputs' shards and the trace's constants go in, the region's results come out.
        let root = mesh.root();
        let mut b = Builder::new(&[]).0;
        let mut args: Vec<Arc<Shards>> = vec![];
        let mut operands: Vec<Val> = vec![];
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
        let (out_shardings, out_tys) = body.out_types(mesh)?;
        let refs: Vec<&Val> = operands.iter().collect();
        let Body { builder, outs: body_outs, checks, n_outs, all_to_all_bytes: exchanged, .. } = body;
        let outs =
            lower::manual_computation(&mut b, &refs, &op_shardings, builder, &body_outs, &out_shardings, &out_tys)?;
        let text = b.finish_sharded(&outs, &out_shardings)?;
        let meta: Vec<_> = body_outs.iter().map(|v| (v.dtype(), v.shape().to_vec())).collect();
        let mut bufs = self.run_mesh("local_map", &text, &root, &args, &meta)?;
        self.count_all_to_all(exchanged * root.devices().len() as u64);
        for (flags, (c, name)) in bufs.split_off(n_outs).iter().zip(&checks) {
            for flag in flags {
                self.verify(flag, name, c, &[])?;
            }
        }
        bufs.into_iter()
            .zip(out_shardings)
            .zip(&out_tys)
            .map(|((bufs, sharding), ty)| {
                let shape = ty.shape.clone();
                let shards = Shards { bufs, sharding, shape: shape.clone(), view: mesh.clone() };
                let st = self.mesh_storage(Arc::new(shards), ty.dtype, mesh.device());
                Tensor::from_storage(st, Layout::contiguous(&shape))
            })
            .collect()
    }

    /// A local region inside a function `kiln::compile` is tracing: the body
    /// is traced on its own (on zero stand-ins of the first device's blocks)
    /// and appended to the capture graph as one `sdy.manual_computation`
    /// whose operands are the inputs' values in that graph; its results are
    /// new values of the graph, its checks the graph's checks.
    fn local_map_traced(
        &self,
        mesh: &DeviceMesh,
        f: &LocalFn<'_>,
        inputs: &[Tensor],
        in_shardings: &[Sharding],
        out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        let device = mesh.device();
        if *mesh != mesh.root() || graph::with_capture(device, |_| ()).is_none() {
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
        let policy = graph::with_capture(device, |g| g.host.as_ref().map(|h| h.policy))
            .flatten()
            .unwrap_or(HostValues::Constant);
        // The blocks' stand-ins: zeros uploaded to the first device (the trace reads no values).
        let first = Device::Tpu(mesh.devices()[0]);
        let stand_ins = inputs
            .iter()
            .zip(in_shardings)
            .map(|(t, s)| Tensor::zeros(&s.shard_shape(t.shape()), t.dtype())?.to_device(first))
            .collect::<Result<Vec<_>>>()?;
        self.flush(first)?;
        let body = trace_body(mesh, f, &stand_ins, out_placements, policy)?;
        graph::with_capture(device, |g| self.append_region(g, mesh, body, inputs, in_shardings))
            .ok_or_else(|| local_err("the capture graph was taken while tracing"))?
    }

    /// Appends a traced body to the capture graph `g` (see `local_map_traced`).
    #[allow(clippy::too_many_arguments)]
    fn append_region(
        &self,
        g: &mut Graph,
        mesh: &DeviceMesh,
        body: Body,
        inputs: &[Tensor],
        in_shardings: &[Sharding],
    ) -> Result<Vec<Tensor>> {
        let device = mesh.device();
        let mut operands: Vec<Val> = vec![];
        let mut op_shardings = vec![];
        for operand in body.operands()? {
            match operand {
                Operand::Block(i) => {
                    let t = &inputs[i];
                    let data = graph::data_of(t)?;
                    let flat = g.value_of(&data, t.storage())?;
                    let v = lower::read_view(&mut g.builder, &flat, t.layout())?;
                    operands.push(g.builder.reshard(&v, &in_shardings[i]));
                    op_shardings.push(in_shardings[i].clone());
                }
                Operand::Constant(bytes, dt) => {
                    let v = g.constant(bytes, dt, |b| self.upload_mesh_value(b, dt, device))?;
                    let s = Sharding::replicated(mesh, 1);
                    operands.push(g.builder.reshard(&v, &s));
                    op_shardings.push(s);
                }
            }
        }
        let (out_shardings, out_tys) = body.out_types(mesh)?;
        let Body { builder, outs: body_outs, checks, n_outs, undeclared, all_to_all_bytes, .. } = body;
        if let Some(h) = g.host.as_mut() {
            h.undeclared.extend(undeclared);
        }
        g.all_to_all_bytes += all_to_all_bytes * mesh.devices().len() as u64;
        let refs: Vec<&Val> = operands.iter().collect();
        let outs = lower::manual_computation(
            &mut g.builder,
            &refs,
            &op_shardings,
            builder,
            &body_outs,
            &out_shardings,
            &out_tys,
        )?;
        // Each check: every device's flag, all of them true.
        for (flags, (c, name)) in outs[n_outs..].iter().zip(checks) {
            let all = g.builder.reduce(flags, lower::Lit::B(true), &[0], "and");
            g.checks.push((all, c, name, vec![]));
        }
        outs[..n_outs]
            .iter()
            .zip(out_shardings)
            .map(|(v, s)| {
                let shape = v.shape().to_vec();
                let n = v.ty.numel();
                let flat = g.builder.reshape(v, &[n]);
                let slot = g.output(flat, Some((s, shape.clone())));
                let st = Arc::new(Storage::new(
                    StorageData::Device(Box::new(PjrtBuffer::Deferred(slot.clone()))),
                    v.dtype(),
                    n,
                    device,
                ));
                g.sinks[slot.index] = Arc::downgrade(&st);
                Tensor::from_storage(st, Layout::contiguous(&shape))
            })
            .collect()
    }
}

const OUTSIDE: &str =
    "the function read a tensor that is not one of its inputs (made outside it): pass it among the inputs, with its placements";

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

/// What feeds an argument of a region's body: input `usize`'s block, or a
/// creation value (bytes of a dtype, Note \[Shared constants\]).
enum Operand {
    Block(usize),
    Constant(Vec<u8>, DType),
}

/// A region's traced body: its program lowered into a function of its own
/// (arguments: the program's parameters, then its creation values), the
/// blocks it returns followed by one flag (`[1]`) per device-side check,
/// and the host values it did not declare.
struct Body {
    builder: Builder,
    /// The kind of each parameter of the body (`Input(i)`: input `i`'s block).
    params: Vec<ParamKind>,
    constants: Vec<(Vec<u8>, DType)>,
    outs: Vec<Val>,
    checks: Vec<(Check, &'static str)>,
    n_outs: usize,
    undeclared: Vec<String>,
    placements: Vec<Vec<Placement>>,
    /// The bytes one device sends to the others through the body's `all_to_all`s.
    all_to_all_bytes: u64,
}

impl Body {
    /// What feeds each argument of the body: a parameter is an input's
    /// block (anything else was made outside the function), then the
    /// creation values.
    fn operands(&self) -> Result<Vec<Operand>> {
        let mut ops = vec![];
        for kind in &self.params {
            match kind {
                ParamKind::Input(i) => ops.push(Operand::Block(*i)),
                _ => return Err(local_err(OUTSIDE)),
            }
        }
        ops.extend(self.constants.iter().map(|(b, dt)| Operand::Constant(b.clone(), *dt)));
        Ok(ops)
    }

    /// The results' shardings (the outputs', then every check's flag split
    /// over every axis) and global types.
    fn out_types(&self, mesh: &DeviceMesh) -> Result<(Vec<Sharding>, Vec<Ty>)> {
        let mut shardings = vec![];
        let mut tys = vec![];
        for (i, (v, p)) in self.outs.iter().zip(&self.placements).enumerate() {
            check_placements("output", i, p)?;
            let s = Sharding::from_placements(mesh, p, v.ty.rank())?;
            tys.push(Ty::new(&global_shape(v.shape(), &s), v.dtype()));
            shardings.push(s);
        }
        Ok((shardings, tys))
    }
}

/// The bytes one device sends to the others through `p`'s `all_to_all`s
/// (each keeps one of its block's `n` pieces and sends the others).
fn all_to_all_bytes(p: &Program) -> u64 {
    p.insts()
        .iter()
        .filter_map(|inst| match &inst.op {
            Op::Collective(c) if matches!(c.kind, Collective::AllToAll { .. }) => {
                let m = p.meta(inst.args[0]);
                let block = (m.shape.iter().product::<usize>() * m.dtype.size_in_bytes()) as u64;
                let n = c.group_size() as u64;
                Some(block / n.max(1) * n.saturating_sub(1))
            }
            _ => None,
        })
        .sum()
}

/// Records `f` on the stand-ins (on the mesh's first device) as a region
/// over `mesh` (see Note [Local regions]) and lowers it; writes into tensors
/// made outside are refused.
fn trace_body(
    mesh: &DeviceMesh,
    f: &LocalFn<'_>,
    stand_ins: &[Tensor],
    out_placements: &[Vec<Placement>],
    policy: HostValues,
) -> Result<Body> {
    let first = Device::Tpu(mesh.devices()[0]);
    let region = record_region(first, policy, stand_ins, &mut |blocks: &[Tensor]| {
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
    })?;
    let mut builder = Builder::new(&[]).0;
    let lowered = lower::lower_into(&mut builder, &region.program, lower::Constants::Arguments, None)?;
    let mut outs = lowered.results;
    // Each device's checks come out as one flag per device (every axis
    // splits them), read after the run like a single device's.
    let checks: Vec<(Check, &'static str)> = lowered.checks.iter().map(|(_, c, name)| (c.clone(), *name)).collect();
    let n_outs = outs.len();
    for (v, ..) in &lowered.checks {
        outs.push(builder.reshape(v, &[1]));
    }
    let mut placements = out_placements.to_vec();
    placements.extend(checks.iter().map(|_| vec![Placement::Shard(0); mesh.ndim()]));
    Ok(Body {
        builder,
        all_to_all_bytes: all_to_all_bytes(&region.program),
        params: region.program.params().iter().map(|p| p.kind.clone()).collect(),
        constants: lowered.constants,
        outs,
        checks,
        n_outs,
        undeclared: region.host_values,
        placements,
    })
}
