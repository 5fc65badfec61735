//! Device meshes and placements, DTensor's vocabulary: a `DeviceMesh` names an
//! n-dimensional grid of devices of one kind, and a `Placement` per mesh axis
//! says how a tensor is laid over that axis (see Note [Device meshes]).
use crate::{Device, DeviceKind, Error, Result};
use smallvec::SmallVec;
use std::fmt;
use std::sync::{Arc, OnceLock, RwLock};

// Note [Device meshes]
// ~~~~~~~~~~~~~~~~~~~~
// A mesh is a grid of devices with named axes (`init_device_mesh(Tpu, &[2, 2],
// &["dp", "tp"])`: devices 0 1 / 2 3, rows along "dp"). kiln is one
// controller driving every device of the mesh, as JAX is, so a sub-mesh
// (`mesh["tp"]`) is not "the slice holding my rank" as in PyTorch's
// one-process-per-device model: it is a view of the whole grid that exposes
// only some axes. A tensor placed on `mesh["tp"]` with `[Shard(0)]` still lives
// on all four devices, split over "tp" and replicated over "dp". This is what
// makes 2-D recipes compose: FSDP places parameters on `mesh["dp"]`, tensor
// parallelism on `mesh["tp"]`, and both placements apply to one tensor on the
// root mesh.
//
// A mesh is also a device: `mesh.device()` is `Device::Mesh(id)`, where every
// tensor placed on the mesh (or any sub-mesh of it) lives, as torch_xla's SPMD
// mode puts every tensor on one virtual device. So ops on distributed tensors
// go through the ordinary dispatch (all inputs on one device), and creation
// ops and `to_device` on a mesh device make tensors replicated over it.
// Meshes are registered once per distinct (kind, shape, names, devices): the
// same mesh made twice is the same device.
//
// Devices are kept row-major (the last axis varies fastest). Programs over a
// mesh are compiled with the root's devices as their device assignment, in
// that order, so partition i of an SPMD program runs on the mesh's i-th
// device, and the StableHLO mesh (`sdy.mesh`) needs no device list.

/// Every root mesh made so far, by id (meshes are few and live for the process).
static MESHES: RwLock<Vec<Arc<Root>>> = RwLock::new(Vec::new());

/// The device kind of mesh `id`, if it exists.
pub(crate) fn mesh_kind(id: usize) -> Option<DeviceKind> {
    MESHES.read().unwrap_or_else(|e| e.into_inner()).get(id).map(|r| r.kind)
}

/// A named grid of devices of one kind (PyTorch's `DeviceMesh`). Cheap to clone.
#[derive(Clone)]
pub struct DeviceMesh {
    root: Arc<Root>,
    /// The root axes this mesh exposes, in order (all of them for a root mesh).
    axes: SmallVec<[usize; 4]>,
    /// The one-axis sub-meshes `mesh["name"]` returns, made on first use.
    singles: Arc<OnceLock<Vec<DeviceMesh>>>,
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct Root {
    /// The mesh's id: `Device::Mesh(id)` (equal meshes share one).
    id: usize,
    kind: DeviceKind,
    shape: Vec<usize>,
    names: Vec<String>,
    devices: Vec<usize>,
}

pub use crate::op::placement::{PartialOp, Placement, Redistribution};

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A mesh over the first `shape.iter().product()` devices of `kind`, row-major,
/// with one name per axis (PyTorch's `init_device_mesh`):
///
/// ```no_run
/// # use kiln_tensor::{mesh::init_device_mesh, DeviceKind};
/// let mesh = init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "tp"])?;
/// assert_eq!(mesh["tp"].shape(), vec![2]);
/// # Ok::<(), kiln_tensor::Error>(())
/// ```
pub fn init_device_mesh(kind: DeviceKind, shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
    // Checked before the device list is made: a huge shape is an error, not an allocation.
    let (_, n) = check_mesh_shape(kind, shape, names)?;
    DeviceMesh::new(kind, &(0..n).collect::<Vec<_>>(), shape, names)
}

const OP: &str = "init_device_mesh";

/// Checks a mesh's shape and axis names against the backend of `kind`; returns
/// the backend and the number of devices the mesh needs (at most the backend's).
fn check_mesh_shape(kind: DeviceKind, shape: &[usize], names: &[&str]) -> Result<(&'static dyn crate::Backend, usize)> {
    if shape.is_empty() || shape.contains(&0) {
        return Err(Error::invalid(
            OP,
            format!("a mesh needs at least one axis and no empty axis, got shape {shape:?}"),
        ));
    }
    if names.len() != shape.len() {
        return Err(Error::invalid(OP, format!("{} axis names {names:?} for a mesh of shape {shape:?}", names.len())));
    }
    for (i, n) in names.iter().enumerate() {
        if !valid_name(n) {
            return Err(Error::invalid(OP, format!("mesh axis name {n:?} is not an identifier")));
        }
        if names[..i].contains(n) {
            return Err(Error::invalid(OP, format!("mesh axis name {n:?} appears twice in {names:?}")));
        }
    }
    let backend = crate::backend_for(kind).ok_or_else(|| {
        Error::device(OP, format!("no backend is registered for {kind:?} devices; register it before making a mesh"))
    })?;
    if !backend.supports_meshes() {
        return Err(Error::device(OP, format!("the {} backend has no device meshes", backend.name())));
    }
    let have = backend.device_count();
    let hint = if kind == DeviceKind::Tpu {
        " (KILN_PJRT_CPU_DEVICES or kiln::tpu::register_with_cpu_devices sets the number of XLA:CPU devices)"
    } else {
        ""
    };
    match shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s)) {
        Some(n) if n <= have => Ok((backend, n)),
        n => Err(Error::device(
            OP,
            format!(
                "a mesh of shape {shape:?} needs {} devices of kind {kind:?}, but the {} backend has {have}{hint}",
                n.map_or("more than usize::MAX".to_string(), |n| n.to_string()),
                backend.name()
            ),
        )),
    }
}

impl DeviceMesh {
    /// A mesh over the given devices (indices of `kind`, row-major over `shape`).
    pub fn new(kind: DeviceKind, devices: &[usize], shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        let (backend, want) = check_mesh_shape(kind, shape, names)?;
        if want != devices.len() {
            return Err(Error::invalid(
                OP,
                format!("a mesh of shape {shape:?} needs {want} devices, {} were given", devices.len()),
            ));
        }
        let have = backend.device_count();
        if let Some(d) = devices.iter().find(|&&d| d >= have) {
            return Err(Error::device(
                OP,
                format!(
                    "device {d} of kind {kind:?} does not exist: the {} backend has {have} device(s)",
                    backend.name()
                ),
            ));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::invalid(OP, format!("device {d} appears twice in the mesh's devices {devices:?}")));
            }
        }
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut reg = MESHES.write().unwrap_or_else(|e| e.into_inner());
        let found = reg
            .iter()
            .find(|r| r.kind == kind && r.shape == shape && r.names == names && r.devices == devices)
            .cloned();
        let root = match found {
            Some(r) => r,
            None => {
                let r = Arc::new(Root { id: reg.len(), kind, shape: shape.to_vec(), names, devices: devices.to_vec() });
                reg.push(r.clone());
                r
            }
        };
        Ok(DeviceMesh::view(root, (0..shape.len()).collect()))
    }

    /// The device a tensor placed on this mesh (or on any view of its root) is on.
    pub fn device(&self) -> Device {
        Device::Mesh(self.root.id)
    }

    /// The root mesh behind a mesh device.
    pub fn of_device(device: Device) -> Result<DeviceMesh> {
        let Device::Mesh(id) = device else {
            return Err(Error::device("device_mesh", format!("{device} is not a device mesh")));
        };
        let root = MESHES.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned();
        let root = root.ok_or_else(|| Error::device("device_mesh", format!("no mesh has id {id}")))?;
        let n = root.shape.len();
        Ok(DeviceMesh::view(root, (0..n).collect()))
    }

    /// The kind of the mesh's devices.
    pub fn device_kind(&self) -> DeviceKind {
        self.root.kind
    }

    /// The sizes of this mesh's axes.
    pub fn shape(&self) -> Vec<usize> {
        self.axes.iter().map(|&a| self.root.shape[a]).collect()
    }

    /// The number of axes.
    pub fn ndim(&self) -> usize {
        self.axes.len()
    }

    /// The number of devices along this mesh's axes (the whole mesh for a root mesh).
    pub fn size(&self) -> usize {
        self.shape().iter().product()
    }

    /// The axis names, in order (PyTorch's `mesh_dim_names`).
    pub fn axis_names(&self) -> Vec<&str> {
        self.axes.iter().map(|&a| self.root.names[a].as_str()).collect()
    }

    /// The size of the axis called `name`.
    pub fn axis_size(&self, name: &str) -> Result<usize> {
        Ok(self.root.shape[self.root_axis(name)?])
    }

    /// The payload of `Op::Redistribute` placing a tensor on this mesh with `placements`.
    pub fn redistribution(&self, placements: &[Placement]) -> Redistribution {
        Redistribution {
            device: self.root.id,
            axes: self.axis_names().into_iter().map(String::from).collect(),
            placements: placements.iter().copied().collect(),
        }
    }

    /// The mesh a redistribution places its result on.
    pub fn of_redistribution(r: &Redistribution) -> Result<DeviceMesh> {
        let root = DeviceMesh::of_device(Device::Mesh(r.device))?;
        if r.axes.len() == root.ndim() && r.axes.iter().zip(root.axis_names()).all(|(a, b)| a == b) {
            return Ok(root);
        }
        let names: Vec<&str> = r.axes.iter().map(String::as_str).collect();
        root.sub(&names)
    }

    /// The sub-mesh exposing the named axes, in the given order (PyTorch's
    /// `mesh["dp"]` and `mesh["dp", "tp"]`); see Note [Device meshes].
    pub fn sub(&self, names: &[&str]) -> Result<DeviceMesh> {
        let mut axes = SmallVec::new();
        for n in names {
            let a = self.root_axis(n)?;
            if !self.axes.contains(&a) {
                return Err(Error::invalid(
                    "DeviceMesh",
                    format!("axis {n:?} is not an axis of this mesh ({:?})", self.axis_names()),
                ));
            }
            if axes.contains(&a) {
                return Err(Error::invalid("DeviceMesh", format!("axis {n:?} is named twice")));
            }
            axes.push(a);
        }
        if axes.is_empty() {
            return Err(Error::invalid("DeviceMesh", "a sub-mesh needs at least one axis"));
        }
        Ok(DeviceMesh::view(self.root.clone(), axes))
    }

    fn view(root: Arc<Root>, axes: SmallVec<[usize; 4]>) -> DeviceMesh {
        DeviceMesh { root, axes, singles: Arc::new(OnceLock::new()) }
    }

    /// The root mesh this one is a view of (itself for a root mesh).
    pub fn root(&self) -> DeviceMesh {
        DeviceMesh::view(self.root.clone(), (0..self.root.shape.len()).collect())
    }

    /// The index of axis `name` in the root mesh.
    fn root_axis(&self, name: &str) -> Result<usize> {
        self.root.names.iter().position(|n| n == name).ok_or_else(|| {
            Error::invalid("DeviceMesh", format!("the mesh has no axis {name:?}; its axes are {:?}", self.root.names))
        })
    }

    /// The root axis behind this mesh's axis `i`.
    pub fn root_axis_of(&self, i: usize) -> usize {
        self.axes[i]
    }

    /// The root mesh's shape.
    pub fn root_shape(&self) -> &[usize] {
        &self.root.shape
    }

    /// The root mesh's axis names.
    pub fn root_axis_names(&self) -> Vec<&str> {
        self.root.names.iter().map(|s| s.as_str()).collect()
    }

    /// Every device of the root mesh, row-major (see Note [Device meshes]).
    pub fn devices(&self) -> &[usize] {
        &self.root.devices
    }

    /// The coordinates of the mesh's `i`-th device (row-major position) along every root axis.
    pub fn coordinates(&self, i: usize) -> Vec<usize> {
        let mut c = vec![0; self.root.shape.len()];
        let mut r = i;
        for a in (0..c.len()).rev() {
            c[a] = r % self.root.shape[a];
            r /= self.root.shape[a];
        }
        c
    }

    /// Whether two meshes have the same root (same devices, shape and names).
    pub fn same_root(&self, other: &DeviceMesh) -> bool {
        self.root.id == other.root.id
    }

    /// The part of a tensor of `shape`, placed on this mesh with `placements`,
    /// that the mesh's `pos`-th device (row-major, as [`DeviceMesh::devices`])
    /// holds: a range per dimension (PyTorch's
    /// `compute_local_shape_and_global_offset`). A dimension split over
    /// several axes is cut into the product of their sizes, the earlier axis
    /// outer; pieces have `ceil(n / pieces)` elements, so the last ones are
    /// shorter or empty. This is the shard [`Tensor::to_local`] gives.
    ///
    /// [`Tensor::to_local`]: crate::Tensor::to_local
    pub fn local_region(
        &self,
        shape: &[usize],
        placements: &[Placement],
        pos: usize,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        self.check_placements(placements, shape.len())?;
        if pos >= self.root.devices.len() {
            return Err(Error::index(
                "local_region",
                format!("device position {pos} on a mesh of {} devices", self.root.devices.len()),
            ));
        }
        let c = self.coordinates(pos);
        Ok((0..shape.len())
            .map(|d| {
                let (mut pieces, mut idx) = (1, 0);
                for (i, p) in placements.iter().enumerate() {
                    if *p == Placement::Shard(d) {
                        let a = self.axes[i];
                        pieces *= self.root.shape[a];
                        idx = idx * self.root.shape[a] + c[a];
                    }
                }
                let len = shape[d].div_ceil(pieces);
                let start = (idx * len).min(shape[d]);
                start..(start + len).min(shape[d])
            })
            .collect())
    }

    /// Whether the mesh's `pos`-th device holds the first copy of its shard of
    /// a tensor placed with `placements`: its coordinate is 0 on every root axis
    /// the tensor is not split over. Exactly one device per shard does, which
    /// is how shard-wise writers (sharded checkpoints) skip the replicas. A
    /// position off the mesh holds nothing: `false`.
    pub fn is_first_replica(&self, placements: &[Placement], pos: usize) -> bool {
        if pos >= self.root.devices.len() {
            return false;
        }
        let c = self.coordinates(pos);
        (0..self.root.shape.len()).all(|a| {
            c[a] == 0
                || placements.iter().enumerate().any(|(i, p)| self.axes[i] == a && matches!(p, Placement::Shard(_)))
        })
    }

    /// Checks `placements` (one per axis of this mesh) for a tensor of `ndim` dimensions.
    pub fn check_placements(&self, placements: &[Placement], ndim: usize) -> Result<()> {
        if placements.len() != self.ndim() {
            return Err(Error::invalid(
                "distribute_tensor",
                format!(
                    "{} placements for a mesh of {} axes ({:?}): give one per axis",
                    placements.len(),
                    self.ndim(),
                    self.axis_names()
                ),
            ));
        }
        for p in placements {
            if let Placement::Shard(d) = p {
                if *d >= ndim {
                    return Err(Error::index("distribute_tensor", format!("{p} of a tensor with {ndim} dimension(s)")));
                }
            }
        }
        Ok(())
    }
}

impl PartialEq for DeviceMesh {
    fn eq(&self, other: &DeviceMesh) -> bool {
        self.same_root(other) && self.axes == other.axes
    }
}

impl Eq for DeviceMesh {}

impl std::hash::Hash for DeviceMesh {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.root.hash(h);
        self.axes.hash(h);
    }
}

impl std::ops::Index<&str> for DeviceMesh {
    type Output = DeviceMesh;
    /// `mesh["dp"]`: the one-axis sub-mesh (see [`DeviceMesh::sub`]). Panics on
    /// an unknown axis, as indexing does; `sub` returns the error instead.
    fn index(&self, name: &str) -> &DeviceMesh {
        let singles = self.singles.get_or_init(|| {
            self.axes.iter().map(|&a| DeviceMesh::view(self.root.clone(), SmallVec::from_slice(&[a]))).collect()
        });
        let found =
            self.root.names.iter().position(|n| n == name).and_then(|a| singles.iter().find(|m| m.axes[0] == a));
        match found {
            Some(m) => m,
            None => panic!("the mesh {self} has no axis {name:?}"),
        }
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for DeviceMesh {
    /// `DeviceMesh(tpu, [dp=2, tp=2], devices [0, 1, 2, 3])`; a sub-mesh names its root too.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.root.kind {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Tpu => "tpu",
            DeviceKind::PrivateUse1 => "privateuse1",
        };
        let axes: Vec<String> =
            self.axes.iter().map(|&a| format!("{}={}", self.root.names[a], self.root.shape[a])).collect();
        write!(f, "DeviceMesh({kind}, [{}], devices {:?}", axes.join(", "), self.root.devices)?;
        if self.axes.len() != self.root.shape.len() {
            let root: Vec<String> =
                self.root.names.iter().zip(&self.root.shape).map(|(n, s)| format!("{n}={s}")).collect();
            write!(f, ", of [{}]", root.join(", "))?;
        }
        write!(f, ")")
    }
}
