//! Local regions on the PJRT backend (`Backend::local_map`, see Note [Local
//! regions] in kiln-tensor's `collective.rs`): the function is traced once on
//! stand-ins for the first device's blocks, and the trace runs on every
//! device of the mesh as the body of one `sdy.manual_computation`.
use crate::backend::PjrtBackend;
use crate::dist::{shard_arg, Shards};
use crate::graph::{self, Arg, Graph, ParamSrc, PjrtBuffer};
use crate::host_values::HostValues;
use crate::lower::{self, Builder, Check, Sharding, Ty, Val};
use kiln_tensor::{
    distribute_tensor, Device, DeviceMesh, Error, Layout, LocalFn, Placement, Result, Storage, StorageData, Tensor,
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
    /// `Backend::local_map`.
    pub(crate) fn run_local_map(
        &self,
        mesh: &DeviceMesh,
        f: &LocalFn<'_>,
        inputs: &[Tensor],
        in_placements: &[Vec<Placement>],
        out_placements: &[Vec<Placement>],
    ) -> Result<Vec<Tensor>> {
        if graph::is_tracing() {
            return Err(local_err(
                "local_map inside a function traced by kiln::compile (or inside another local_map) is not supported yet: call it outside",
            ));
        }
        if inputs.len() != in_placements.len() {
            return Err(local_err(format!("{} inputs and {} lists of placements", inputs.len(), in_placements.len())));
        }
        // Each input, laid out as the region wants it, with no padding.
        let mut shards: Vec<Arc<Shards>> = vec![];
        let mut in_shardings = vec![];
        for (i, (t, p)) in inputs.iter().zip(in_placements).enumerate() {
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
            let placed = match t.device() {
                Device::Mesh(_) => {
                    let tm = t.device_mesh()?;
                    if !tm.same_root(mesh) {
                        return Err(Error::device(
                            "local_map",
                            format!("input {i} is on {tm}, the region runs on {mesh}"),
                        ));
                    }
                    self.materialize(t, s.clone(), mesh.clone())?
                }
                _ => self.shards(&distribute_tensor(t, mesh, p)?)?,
            };
            shards.push(placed);
            in_shardings.push(s);
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
        // Ends the trace if `f` panics, putting back what it wrote.
        struct Trace;
        impl Drop for Trace {
            fn drop(&mut self) {
                for (w, data) in graph::end_capture().map(|g| g.saved).unwrap_or_default() {
                    if let Some(st) = w.upgrade() {
                        st.replace(StorageData::Device(Box::new(data)));
                    }
                }
            }
        }
        graph::begin_capture(Graph::new_capture(first, HostValues::Constant));
        let trace = Trace;
        let returned = {
            let _region = kiln_tensor::collective::enter_local_region(mesh);
            f(&stand_ins)
        };
        let mut g = graph::end_capture().ok_or_else(|| local_err("the trace's graph was taken while tracing"))?;
        drop(trace);
        // Writes into tensors made outside are undone (the trace never runs as such), and refused.
        let wrote_outside = !g.saved.is_empty();
        for (w, data) in std::mem::take(&mut g.saved) {
            if let Some(st) = w.upgrade() {
                st.replace(StorageData::Device(Box::new(data)));
            }
        }
        let returned = returned?;
        if wrote_outside {
            return Err(local_err(
                "the function wrote in place into a tensor made outside it (an input): return the new value instead",
            ));
        }
        if returned.len() != out_placements.len() {
            return Err(local_err(format!(
                "the function returned {} tensors for {} lists of output placements",
                returned.len(),
                out_placements.len()
            )));
        }
        // The blocks the body returns: each returned view read from its storage's value.
        let mut body_outs = vec![];
        for (i, t) in returned.iter().enumerate() {
            let data = graph::data_in(&t.storage().read(), t.device())?;
            let flat = match &data {
                PjrtBuffer::Deferred(slot) if slot.graph == g.id => g.outs[slot.index].0.clone(),
                PjrtBuffer::Ready(b) if stand_ins.iter().any(|s| Arc::ptr_eq(s.storage(), t.storage())) => {
                    g.param(&Arg::One(b.clone()), t.dtype(), ParamSrc::Storage(Arc::downgrade(t.storage())))?
                }
                _ => {
                    return Err(local_err(format!(
                        "output {i} is not a block computed by the function from its inputs (a tensor on {}, made outside it?)",
                        t.device()
                    )))
                }
            };
            body_outs.push(lower::read_view(&mut g.builder, &flat, t.layout())?);
        }
        // Each device's checks come out as one flag per device (every axis
        // splits them), read after the run like a single device's.
        let checks: Vec<(Check, &'static str)> = g.checks.iter().map(|(_, c, name, _)| (c.clone(), *name)).collect();
        let flags: Vec<Val> = g.checks.iter().map(|(v, ..)| g.builder.reshape(v, &[1])).collect();
        let (n_outs, exchanged) = (body_outs.len(), g.all_to_all_bytes);
        body_outs.extend(flags);
        let mut out_placements = out_placements.to_vec();
        out_placements.extend(checks.iter().map(|_| vec![Placement::Shard(0); mesh.ndim()]));
        // The program: the inputs' shards and the trace's constants go in, the region's results come out.
        let root = mesh.root();
        let mut b = Builder::new(&[]).0;
        let mut args: Vec<Arc<Shards>> = vec![];
        let mut operands: Vec<Val> = vec![];
        let mut op_shardings = vec![];
        for (arg, val, src) in &g.params {
            let input = stand_ins.iter().position(|s| {
                let held = graph::data_in(&s.storage().read(), first).ok().and_then(|d| d.ready());
                matches!((arg, held), (Arg::One(a), Some(b)) if Arc::ptr_eq(a, &b))
            });
            let s = match (input, src) {
                (Some(i), _) => shards[i].clone(),
                (None, ParamSrc::Constant(bytes)) => self.replicated_shards(bytes, val.dtype(), val.shape(), &root)?,
                _ => {
                    return Err(local_err(
                        "the function read a tensor that is not one of its inputs (made outside it): pass it among the inputs, with its placements",
                    ))
                }
            };
            operands.push(shard_arg(&mut b, &s, val.dtype())?);
            op_shardings.push(s.sharding.clone());
            args.push(s);
        }
        let mut out_shardings = vec![];
        let mut out_tys = vec![];
        for (i, (v, p)) in body_outs.iter().zip(&out_placements).enumerate() {
            check_placements("output", i, p)?;
            let s = Sharding::from_placements(mesh, p, v.ty.rank())?;
            out_tys.push(Ty::new(&global_shape(v.shape(), &s), v.dtype()));
            out_shardings.push(s);
        }
        let refs: Vec<&Val> = operands.iter().collect();
        let Graph { builder: body, .. } = g;
        let outs = lower::manual_computation(&mut b, &refs, &op_shardings, body, &body_outs, &out_shardings, &out_tys)?;
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
}
