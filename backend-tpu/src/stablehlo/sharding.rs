//! Shardings: a mesh and per-axis placements as Shardy's annotations
//! (`sdy.mesh`, `#sdy.sharding`, attributes of a module), and how a tensor of
//! a given sharding is cut into the shards each device holds (see Note
//! \[Shardings\]).
use kiln_tensor::{DeviceMesh, Error, PartialOp, Placement, Result};

// Note [Shardings]
// ~~~~~~~~~~~~~~~~
// A program over a mesh is one SPMD module: its arguments and results carry
// `#sdy.sharding<@mesh, [{"dp"}, {}]>` (per tensor dimension, the mesh axes it
// is split over, major to minor), and XLA's partitioner (Shardy) turns it into
// one program per device, inserting the collectives. The mesh is declared once
// per module, `sdy.mesh @mesh = <["dp"=2, "tp"=2]>`, always the root mesh
// (Note [Device meshes]): a placement on a sub-mesh only names its axes, and
// every other axis of the root replicates.
//
// Placements map to a sharding as PyTorch's DTensor defines them: `Shard(d)`
// on mesh axis a adds a to dimension d's axes, in mesh-axis order (so
// `[Shard(0), Shard(0)]` on ("dp", "tp") splits dim 0 over dp then tp, the
// major one first); `Partial(sum)` is Shardy's `unreduced` axis (each device
// holds a partial sum); `Replicate` names nothing.
//
// Each device holds a shard of the same shape: dimension d of size n over
// axes of total size k is cut into chunks of ceil(n / k), and the last chunks
// are padded (f32[10] over 4 devices is f32[3] on each, the last holding one
// real element). kiln pads the global value itself: a sharded program value
// has the padded shape (ceil(n / k) k), so the partitioner always splits
// evenly, and the program slices the logical value out of it and pads its
// results back. (Left to Shardy, an uneven dimension may be split over a
// sub-axis instead: f32[10] over 4 devices came back as f32[5] shards.) The
// device at mesh coordinates c holds chunk index sum over d's axes of c[a]
// times the sizes of the axes after a.

/// A tensor's sharding over a root mesh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sharding {
    pub mesh: DeviceMesh,
    /// Per tensor dimension, the root-mesh axes it is split over, major to minor.
    pub dims: Vec<Vec<usize>>,
    /// Root-mesh axes over which the value is a partial sum.
    pub unreduced: Vec<usize>,
}

impl Sharding {
    /// The sharding of `placements` (one per axis of `mesh`, which may be a
    /// sub-mesh) for a tensor of `ndim` dimensions.
    pub fn from_placements(mesh: &DeviceMesh, placements: &[Placement], ndim: usize) -> Result<Sharding> {
        mesh.check_placements(placements, ndim)?;
        let mut dims = vec![vec![]; ndim];
        let mut unreduced = vec![];
        for (i, p) in placements.iter().enumerate() {
            let a = mesh.root_axis_of(i);
            match p {
                Placement::Shard(d) => dims[*d].push(a),
                Placement::Partial(_) => unreduced.push(a),
                Placement::Replicate => {}
            }
        }
        Ok(Sharding { mesh: mesh.root(), dims, unreduced })
    }

    /// A value replicated on every device of `mesh`.
    pub fn replicated(mesh: &DeviceMesh, ndim: usize) -> Sharding {
        Sharding { mesh: mesh.root(), dims: vec![vec![]; ndim], unreduced: vec![] }
    }

    /// The number of pieces dimension `d` is cut into.
    pub fn splits(&self, d: usize) -> usize {
        self.dims[d].iter().map(|&a| self.mesh.root_shape()[a]).product()
    }

    /// The shape of each device's shard of a tensor of `shape` (padded, see the Note).
    pub fn shard_shape(&self, shape: &[usize]) -> Vec<usize> {
        shape.iter().enumerate().map(|(d, &n)| n.div_ceil(self.splits(d))).collect()
    }

    /// The global shape a program carries for a tensor of `shape`: each
    /// dimension padded to a multiple of its number of pieces (see the Note).
    pub fn padded_shape(&self, shape: &[usize]) -> Vec<usize> {
        shape.iter().enumerate().map(|(d, &n)| n.div_ceil(self.splits(d)) * self.splits(d)).collect()
    }

    /// The chunk of each dimension the mesh's `device`-th device (row-major) holds.
    pub fn chunk_index(&self, device: usize) -> Vec<usize> {
        let c = self.mesh.coordinates(device);
        let sizes = self.mesh.root_shape();
        self.dims.iter().map(|axes| axes.iter().fold(0, |idx, &a| idx * sizes[a] + c[a])).collect()
    }

    /// The bytes of the mesh's `device`-th device's shard of a row-major tensor
    /// of `shape` (`bytes`, elements of `elem` bytes): the chunk it holds of
    /// every dimension, padded with zeros to the shard shape.
    pub fn shard_bytes(&self, bytes: &[u8], elem: usize, shape: &[usize], device: usize) -> Vec<u8> {
        let local = self.shard_shape(shape);
        let mut out = vec![0u8; local.iter().product::<usize>() * elem];
        self.walk(shape, device, |g, l, n| {
            out[l * elem..(l + n) * elem].copy_from_slice(&bytes[g * elem..(g + n) * elem]);
        });
        out
    }

    /// Writes the mesh's `device`-th device's shard (`shard`, of the shard
    /// shape) into its place in the row-major tensor `out` of `shape`; the
    /// padding is dropped.
    pub fn unshard_into(&self, shard: &[u8], elem: usize, shape: &[usize], device: usize, out: &mut [u8]) {
        self.walk(shape, device, |g, l, n| {
            out[g * elem..(g + n) * elem].copy_from_slice(&shard[l * elem..(l + n) * elem]);
        });
    }

    /// Calls `f(global offset, local offset, run length)` for every run of the
    /// last dimension inside device `device`'s chunk (offsets in elements).
    fn walk(&self, shape: &[usize], device: usize, mut f: impl FnMut(usize, usize, usize)) {
        let local = self.shard_shape(shape);
        let chunk = self.chunk_index(device);
        let nd = shape.len();
        // The part of each dimension's chunk inside the tensor: [start, start + len).
        let start: Vec<usize> = (0..nd).map(|d| (chunk[d] * local[d]).min(shape[d])).collect();
        let len: Vec<usize> = (0..nd).map(|d| (shape[d] - start[d]).min(local[d])).collect();
        if len.contains(&0) {
            return;
        }
        if nd == 0 {
            f(0, 0, 1);
            return;
        }
        let gstr = kiln_tensor::contiguous_strides(shape);
        let lstr = kiln_tensor::contiguous_strides(&local);
        let mut idx = vec![0usize; nd - 1];
        loop {
            let (mut g, mut l) = (start[nd - 1], 0);
            for d in 0..nd - 1 {
                g += (start[d] + idx[d]) * gstr[d];
                l += idx[d] * lstr[d];
            }
            f(g, l, len[nd - 1]);
            // Odometer over the outer dimensions.
            let mut d = nd - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < len[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// `#sdy.sharding<@mesh, [{"dp"}, {}]>` (with `unreduced={...}` for partial sums).
    pub fn attr(&self) -> String {
        format!("#sdy.sharding<{}>", self.body())
    }

    /// The sharding without its `#sdy.sharding` wrapper, as `sdy.sharding_constraint` takes it.
    pub fn body(&self) -> String {
        let names = self.mesh.root_axis_names();
        let axes = |v: &[usize]| v.iter().map(|&a| format!("\"{}\"", names[a])).collect::<Vec<_>>().join(", ");
        let dims: Vec<String> = self.dims.iter().map(|d| format!("{{{}}}", axes(d))).collect();
        let mut s = format!("@mesh, [{}]", dims.join(", "));
        if !self.unreduced.is_empty() {
            let mut u = self.unreduced.clone();
            u.sort_unstable();
            s.push_str(&format!(", unreduced={{{}}}", axes(&u)));
        }
        s
    }

    /// Whether every device holds the whole value.
    pub fn is_replicated(&self) -> bool {
        self.dims.iter().all(|d| d.is_empty()) && self.unreduced.is_empty()
    }
}

/// The module-level mesh declaration of a program over `mesh`'s root.
pub fn mesh_decl(mesh: &DeviceMesh) -> String {
    let axes: Vec<String> =
        mesh.root_axis_names().iter().zip(mesh.root_shape()).map(|(n, s)| format!("\"{n}\"={s}")).collect();
    format!("sdy.mesh @mesh = <[{}]>", axes.join(", "))
}

/// Checks that a sharding is over `mesh`'s root (every value of one program is on one mesh).
pub fn check_mesh(s: &Sharding, mesh: &DeviceMesh) -> Result<()> {
    if s.mesh.same_root(mesh) {
        return Ok(());
    }
    Err(Error::device(
        "pjrt",
        format!("expected all tensors to be on the same device mesh, but found {} and {}", s.mesh, mesh.root()),
    ))
}

impl Sharding {
    /// The placements of this sharding on `mesh` (a view of its root), or
    /// `None` when it uses an axis the view does not expose.
    pub fn placements_on(&self, mesh: &DeviceMesh) -> Option<Vec<Placement>> {
        let view: Vec<usize> = (0..mesh.ndim()).map(|i| mesh.root_axis_of(i)).collect();
        let used = self.dims.iter().flatten().chain(&self.unreduced);
        if used.clone().any(|a| !view.contains(a)) {
            return None;
        }
        Some(
            view.iter()
                .map(|a| {
                    if self.unreduced.contains(a) {
                        return Placement::Partial(PartialOp::Sum);
                    }
                    match self.dims.iter().position(|d| d.contains(a)) {
                        Some(d) => Placement::Shard(d),
                        None => Placement::Replicate,
                    }
                })
                .collect(),
        )
    }

    /// The same split without partial sums (what a value becomes once reduced).
    pub fn reduced(&self) -> Sharding {
        Sharding { mesh: self.mesh.clone(), dims: self.dims.clone(), unreduced: vec![] }
    }

    /// The real (unpadded) shape of the mesh's `device`-th device's shard of a tensor of `shape`.
    pub fn real_shard_shape(&self, shape: &[usize], device: usize) -> Vec<usize> {
        let local = self.shard_shape(shape);
        let chunk = self.chunk_index(device);
        (0..shape.len()).map(|d| shape[d].saturating_sub(chunk[d] * local[d]).min(local[d])).collect()
    }
}
