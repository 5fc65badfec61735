//! `local_map`: per-device code over a device mesh (JAX's `shard_map`,
//! PyTorch's `local_map`), differentiable (see Note [Local regions] in
//! kiln-tensor's `collective.rs`).
use kiln_tensor::collective::all_reduce;
use kiln_tensor::{is_grad_enabled, CustomBackward, DeviceMesh, Error, Placement, Result, Tensor};
use std::sync::Arc;

/// Runs `f` on every device of `mesh` at once, each on its own block of the
/// inputs: input `i` is laid out with `in_placements[i]` (one placement per
/// mesh axis; `Shard(d)` gives each device its piece of dimension `d`,
/// `Replicate` the whole tensor), and `f`'s results are each device's blocks
/// of outputs laid out with `out_placements`. Inside `f`, the blocks talk to
/// each other only through the collectives of `kiln::tensor::collective`
/// (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `permute`)
/// over named mesh axes. Gradients flow through the region: backward runs a
/// second region that recomputes `f` and differentiates it per device.
///
/// Inside a function traced by `kiln::compile`, the region becomes part of
/// the captured program; it must then span the function's whole mesh, with
/// inputs on that mesh.
///
/// Blocks must be of one shape on every device (dimensions split evenly).
/// A `Replicate` output must really be equal on every device (after an
/// `all_reduce`, say): kiln takes the first device's block for it, and its
/// gradient treats it as the mean of the copies (a replicated input's
/// gradient is the sum of the devices' gradients), which is exact when the
/// copies are equal.
///
/// ```no_run
/// use kiln::prelude::*;
/// use kiln::tensor::collective::all_reduce;
/// use kiln::{init_device_mesh, local_map, DeviceKind, Placement::{Replicate, Shard}};
/// let mesh = init_device_mesh(DeviceKind::Tpu, &[4], &["tp"])?;
/// let x = Tensor::randn(&[8, 64], DType::F32)?;
/// let w = Tensor::randn(&[64, 16], DType::F32)?;
/// // A row-parallel matmul: each device multiplies its slice of the
/// // contraction, then the partial products are summed over "tp".
/// let y = local_map(
///     |b: &[Tensor]| Ok(vec![all_reduce(&b[0].matmul(&b[1])?, "tp")?]),
///     &mesh,
///     &[vec![Shard(1)], vec![Shard(0)]],
///     &[vec![Replicate]],
///     &[&x, &w],
/// )?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn local_map<F>(
    f: F,
    mesh: &DeviceMesh,
    in_placements: &[Vec<Placement>],
    out_placements: &[Vec<Placement>],
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    let backend = mesh.device().backend()?;
    let outputs = {
        let _g = crate::no_grad();
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        backend.local_map(mesh, &f, &detached, in_placements, out_placements)?
    };
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return Ok(outputs);
    }
    let f = Arc::new(f);
    let (mesh, in_p, out_p) = (mesh.clone(), in_placements.to_vec(), out_placements.to_vec());
    let out_meta: Vec<(Vec<usize>, kiln_tensor::DType)> =
        outputs.iter().map(|o| (o.shape().to_vec(), o.dtype())).collect();
    let backward: CustomBackward = Arc::new(move |grads, edges| {
        for e in edges {
            if e.value.version() != e.version {
                return Err(Error::inplace("local_map", "an input of local_map was modified in place before backward"));
            }
        }
        let xs: Vec<Tensor> = edges.iter().map(|e| e.value.detach()).collect();
        let wanted: Vec<usize> = (0..edges.len()).filter(|&i| edges[i].requires_grad).collect();
        let gs: Vec<Tensor> = grads
            .iter()
            .zip(&out_meta)
            .map(|(g, (shape, dtype))| match g {
                Some(g) => Ok(g.clone()),
                None => Tensor::zeros(shape, (*dtype, mesh.device())),
            })
            .collect::<Result<_>>()?;
        let n = xs.len();
        let (f, wanted_in) = (f.clone(), wanted.clone());
        // A replicated output counts as the mean of its copies, and a replicated
        // input's gradient is the sum of every copy's (see the Note).
        let copies: Vec<f64> = out_p.iter().map(|p| copies_of(&mesh, p).iter().map(|a| a.1 as f64).product()).collect();
        let summed: Vec<Vec<String>> =
            wanted.iter().map(|&i| copies_of(&mesh, &in_p[i]).into_iter().map(|a| a.0).collect()).collect();
        // Per device: recompute the blocks' outputs and pull their gradients back.
        let vjp = move |args: &[Tensor]| -> Result<Vec<Tensor>> {
            let _g = crate::enable_grad();
            let xs: Vec<Tensor> = args[..n].iter().map(|t| t.detach()).collect();
            for &i in &wanted_in {
                xs[i].requires_grad_(true)?;
            }
            let ys = f(&xs)?;
            let cots: Vec<Tensor> = args[n..]
                .iter()
                .zip(&copies)
                .map(|(g, &c)| if c > 1.0 { g.div(c) } else { Ok(g.clone()) })
                .collect::<Result<_>>()?;
            let pairs: Vec<(&Tensor, &Tensor)> = ys.iter().zip(&cots).filter(|(y, _)| y.requires_grad()).collect();
            let targets: Vec<&Tensor> = wanted_in.iter().map(|&i| &xs[i]).collect();
            let got = if pairs.is_empty() {
                vec![None; targets.len()]
            } else {
                let os: Vec<&Tensor> = pairs.iter().map(|p| p.0).collect();
                let gs: Vec<&Tensor> = pairs.iter().map(|p| p.1).collect();
                crate::grad(&os, &targets, Some(&gs), false, false)?
            };
            got.into_iter()
                .zip(&targets)
                .zip(&summed)
                .map(|((g, x), axes)| {
                    let mut g = g.map_or_else(|| x.zeros_like(), Ok)?;
                    for a in axes {
                        g = all_reduce(&g, a)?;
                    }
                    Ok(g)
                })
                .collect()
        };
        let mut args: Vec<Tensor> = xs.clone();
        args.extend(gs);
        let mut places = in_p.clone();
        places.extend(out_p.iter().cloned());
        let grad_places: Vec<Vec<Placement>> = wanted.iter().map(|&i| in_p[i].clone()).collect();
        let backend = mesh.device().backend()?;
        let got = {
            let _g = crate::no_grad();
            backend.local_map(&mesh, &vjp, &args, &places, &grad_places)?
        };
        let mut out = vec![None; edges.len()];
        for (i, g) in wanted.into_iter().zip(got) {
            // An input given whole (not on the mesh) gets its gradient whole, where it lives.
            let x = &edges[i].value;
            out[i] = Some(if x.is_distributed() { g } else { g.full_tensor()?.to_device(x.device())? });
        }
        Ok(out)
    });
    let out_refs: Vec<&Tensor> = outputs.iter().collect();
    Tensor::record_custom("local_map", inputs, &out_refs, backward);
    Ok(outputs)
}

/// The root mesh axes (name, size) a tensor placed on `mesh` with
/// `placements` is not split over: the axes along which it has copies.
fn copies_of(mesh: &DeviceMesh, placements: &[Placement]) -> Vec<(String, usize)> {
    let split: Vec<usize> = placements
        .iter()
        .enumerate()
        .filter(|(_, p)| matches!(p, Placement::Shard(_)))
        .map(|(i, _)| mesh.root_axis_of(i))
        .collect();
    mesh.root_axis_names()
        .iter()
        .zip(mesh.root_shape())
        .enumerate()
        .filter(|(a, _)| !split.contains(a))
        .map(|(_, (n, &s))| (n.to_string(), s))
        .collect()
}
