//! safetensors files: [`SafetensorsFile`] reads a memory-mapped file through
//! the `safetensors` crate's header parser; [`save_safetensors`] writes one
//! atomically (a temporary file in the same directory, then a rename).
use kiln_tensor::{DType, Device, Error, HostBuffer, Placement, Result, Tensor};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// An open, memory-mapped safetensors file whose header has been parsed and
/// validated (offsets inside the file, sizes matching dtypes and shapes).
///
/// ```no_run
/// use kiln::prelude::*;
/// use kiln::nn::io::SafetensorsFile;
/// let f = SafetensorsFile::open("model.safetensors")?;
/// for name in f.names() {
///     let t = f.tensor(&name, Some(DType::F32), Device::Cpu)?;
///     println!("{name}: {:?}", t.shape());
/// }
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SafetensorsFile({}, {} tensors)", self.path.display(), self.metadata.tensors().len())
    }
}

/// An error about the file at `path`.
fn file_err(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid("safetensors", format!("{}: {msg}", path.display()))
}

impl SafetensorsFile {
    /// Maps `path` and parses its header. A missing, truncated or malformed
    /// file is an error naming the file.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| file_err(&path, format!("cannot open: {e}")))?;
        let len = file.metadata().map_err(|e| file_err(&path, format!("cannot stat: {e}")))?.len();
        if len < 8 {
            return Err(file_err(
                &path,
                format!("not a safetensors file: {len} bytes, shorter than the 8-byte header length"),
            ));
        }
        // SAFETY: the map is read-only and private to this process. Its contents
        // are only read through bounds-checked slices of the header-validated
        // layout, and every tensor is copied out before use. Another process
        // truncating the file while it is mapped could fault; kiln itself never
        // writes a file in place (saves go to a temporary file and are renamed).
        let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }
            .map_err(|e| file_err(&path, format!("cannot memory-map: {e}")))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| {
            file_err(
                &path,
                format!("invalid or truncated safetensors file ({e}); the file may be incomplete or corrupt"),
            )
        })?;
        Ok(SafetensorsFile { path, mmap, header_len, metadata })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.metadata.tensors().into_keys().collect();
        n.sort();
        n
    }

    /// The `__metadata__` strings of the header (e.g. `{"format": "pt"}`).
    pub fn user_metadata(&self) -> BTreeMap<String, String> {
        self.metadata.metadata().as_ref().map(|m| m.clone().into_iter().collect()).unwrap_or_default()
    }

    /// The stored dtype and shape of `name`, if present.
    pub fn info(&self, name: &str) -> Option<(Dtype, Vec<usize>)> {
        self.metadata.info(name).map(|i| (i.dtype, i.shape.clone()))
    }

    /// Reads tensor `name` onto `device`. With `dtype`, floating-point tensors
    /// are converted to it (integer tensors keep an integer dtype); without,
    /// the stored dtype is kept. Unsigned 16/32/64-bit integers, which kiln
    /// has no dtype for, widen to int32 / int64 (an unsigned 64-bit value past
    /// int64 is an error); the packed and scale-only formats of quantized
    /// checkpoints (`F4`, `F6_*`, `F8_E8M0`) are read through [`SafetensorsFile::raw`].
    pub fn tensor(&self, name: &str, dtype: Option<DType>, device: Device) -> Result<Tensor> {
        let info = self.metadata.info(name).ok_or_else(|| file_err(&self.path, format!("no tensor named {name:?}")))?;
        let t = self.decode(name, info)?;
        let t = match dtype {
            Some(dt) if t.dtype().is_float() && dt.is_float() => t.to_dtype(dt)?,
            _ => t,
        };
        t.to_device(device)
    }

    /// The stored dtype, shape and bytes of `name`, as they are in the file
    /// (little-endian; sub-byte types packed as the format packs them).
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8])> {
        let info = self.metadata.info(name).ok_or_else(|| file_err(&self.path, format!("no tensor named {name:?}")))?;
        Ok((info.dtype, &info.shape, self.bytes_of(name, info)?))
    }

    fn bytes_of(&self, name: &str, info: &TensorInfo) -> Result<&[u8]> {
        let start = 8 + self.header_len;
        let (a, b) = info.data_offsets;
        self.mmap
            .get(start + a..start + b)
            .ok_or_else(|| file_err(&self.path, format!("tensor {name:?}: data offsets {a}..{b} outside the file")))
    }

    /// Reads every tensor (see [`SafetensorsFile::tensor`]).
    pub fn tensors(&self, dtype: Option<DType>, device: Device) -> Result<BTreeMap<String, Tensor>> {
        self.names().into_iter().map(|n| Ok((n.clone(), self.tensor(&n, dtype, device)?))).collect()
    }

    /// The bytes of one tensor, as a CPU tensor of its (decoded) dtype.
    fn decode(&self, name: &str, info: &TensorInfo) -> Result<Tensor> {
        let bytes = self.bytes_of(name, info)?;
        let bad = |e: Error| file_err(&self.path, format!("tensor {name:?}: {e}"));
        let buf = match info.dtype {
            Dtype::BOOL => HostBuffer::from_le_bytes(DType::Bool, bytes).map_err(bad)?,
            Dtype::U8 => HostBuffer::from_le_bytes(DType::U8, bytes).map_err(bad)?,
            Dtype::I8 => HostBuffer::from_le_bytes(DType::I8, bytes).map_err(bad)?,
            Dtype::I16 => HostBuffer::from_le_bytes(DType::I16, bytes).map_err(bad)?,
            Dtype::I32 => HostBuffer::from_le_bytes(DType::I32, bytes).map_err(bad)?,
            Dtype::I64 => HostBuffer::from_le_bytes(DType::I64, bytes).map_err(bad)?,
            Dtype::F16 => HostBuffer::from_le_bytes(DType::F16, bytes).map_err(bad)?,
            Dtype::BF16 => HostBuffer::from_le_bytes(DType::BF16, bytes).map_err(bad)?,
            Dtype::F32 => HostBuffer::from_le_bytes(DType::F32, bytes).map_err(bad)?,
            Dtype::F64 => HostBuffer::from_le_bytes(DType::F64, bytes).map_err(bad)?,
            Dtype::U16 => {
                HostBuffer::I32(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as i32).collect())
            }
            Dtype::U32 => HostBuffer::I64(
                bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
            ),
            Dtype::U64 => HostBuffer::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| {
                        let v = u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
                        i64::try_from(v).map_err(|_| {
                            file_err(&self.path, format!("tensor {name:?}: u64 value {v} does not fit int64"))
                        })
                    })
                    .collect::<Result<Vec<i64>>>()?,
            ),
            Dtype::F8_E5M2 => HostBuffer::from_le_bytes(DType::F8E5M2, bytes).map_err(bad)?,
            Dtype::F8_E4M3 => HostBuffer::from_le_bytes(DType::F8E4M3FN, bytes).map_err(bad)?,
            other => {
                return Err(file_err(
                    &self.path,
                    format!(
                        "tensor {name:?}: dtype {other:?} has no kiln dtype (a quantized checkpoint's packed or scale \
                         tensor loads through `from_pretrained`, which reads its quantization_config)"
                    ),
                ));
            }
        };
        Tensor::from_host(buf, &info.shape, Device::Cpu).map_err(bad)
    }
}

/// Reads every tensor of a safetensors file (CPU, stored dtypes).
///
/// ```no_run
/// let tensors = kiln::nn::io::load_safetensors("golden.safetensors")?;
/// let ids = &tensors["input_ids"];
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<BTreeMap<String, Tensor>> {
    SafetensorsFile::open(path)?.tensors(None, Device::Cpu)
}

fn st_dtype(dt: DType) -> Dtype {
    match dt {
        DType::Bool => Dtype::BOOL,
        DType::U8 => Dtype::U8,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::F8E4M3FN => Dtype::F8_E4M3,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
    }
}

/// Writes `bytes` to `path` atomically: into a temporary file in the same
/// directory (synced to disk), then renamed over `path`. A crash leaves
/// either the old file or the new one, never a partial one.
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    atomic_file(path, |w| write(&mut w.w).map_err(|e| file_err(path, format!("cannot write: {e}"))))
}

/// [`write_atomic`] with a writer that can also write at an offset.
fn atomic_file(path: &Path, write: impl FnOnce(&mut OffsetWriter) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path.file_name().ok_or_else(|| file_err(path, "not a file path"))?.to_string_lossy().to_string();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let io = |e: std::io::Error| file_err(path, format!("cannot write: {e}"));
    let result = (|| -> Result<()> {
        let f = File::create(&tmp).map_err(io)?;
        let mut w = OffsetWriter { w: std::io::BufWriter::with_capacity(1 << 20, f), pos: 0 };
        write(&mut w)?;
        let f = w.w.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A buffered file writer that writes at given offsets, seeking only when a
/// write does not continue the previous one.
struct OffsetWriter {
    w: std::io::BufWriter<File>,
    pos: u64,
}

impl OffsetWriter {
    fn write_at(&mut self, at: u64, bytes: &[u8]) -> std::io::Result<()> {
        if at != self.pos {
            self.w.seek(SeekFrom::Start(at))?;
        }
        self.w.write_all(bytes)?;
        self.pos = at + bytes.len() as u64;
        Ok(())
    }
}

// Note [Sharded checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor on a device mesh is saved without ever being whole on a device or
// on the host: each shard is read from its device and written into its place
// in the file (the runs of its rows inside the row-major tensor), and of the
// devices holding copies of one shard only the first writes it
// (`DeviceMesh::is_first_replica`). Partial sums are reduced on the devices
// first. The file is an ordinary safetensors file holding the whole tensor,
// so transformers, or kiln on any other mesh, reads it as written by a
// single device; a loader takes each tensor with the placements of the
// parameter it goes into (`Tensor::placed_like`), cutting it into that mesh's
// shards, which is resharding on load. Model files of a distributed model use
// the Hugging Face index layout (`model.safetensors.index.json`, whose
// metadata also records each tensor's mesh and placements), so that a process
// per host can write its own files; every file is written atomically and the
// checkpoint directory is renamed into place complete.

/// Writes `t`'s data at byte `at` of the file: an ordinary tensor whole, a
/// distributed one shard by shard (Note [Sharded checkpoints]).
fn write_tensor(w: &mut OffsetWriter, at: u64, t: &Tensor) -> Result<()> {
    let io = |e: std::io::Error| Error::invalid("safetensors", format!("cannot write: {e}"));
    if !t.is_distributed() {
        return w.write_at(at, &t.to_host()?.to_le_bytes()).map_err(io);
    }
    let (mesh, mut placements) = (t.device_mesh()?, t.placements()?);
    let partial = placements.iter().any(|p| matches!(p, Placement::Partial(_)));
    for p in placements.iter_mut().filter(|p| matches!(p, Placement::Partial(_))) {
        *p = Placement::Replicate;
    }
    let t = if partial { t.redistribute(&mesh, &placements)? } else { t.clone() };
    let elem = t.dtype().size_in_bytes() as u64;
    for (pos, local) in t.to_local()?.iter().enumerate() {
        if local.numel() == 0 || !mesh.is_first_replica(&placements, pos) {
            continue;
        }
        let region = mesh.local_region(t.shape(), &placements, pos)?;
        let bytes = local.to_host()?.to_le_bytes();
        let mut local_at = 0;
        for (global, n) in region_runs(t.shape(), &region) {
            let (a, b) = (local_at as usize * elem as usize, (local_at + n) as usize * elem as usize);
            w.write_at(at + global * elem, &bytes[a..b]).map_err(io)?;
            local_at += n;
        }
    }
    Ok(())
}

/// The contiguous runs (element offset in the row-major tensor of `shape`,
/// length) of the box `region`, in order: as few as the box allows (a box of
/// whole rows is one run).
fn region_runs(shape: &[usize], region: &[std::ops::Range<usize>]) -> Vec<(u64, u64)> {
    if region.iter().any(|r| r.is_empty()) {
        return vec![];
    }
    let nd = shape.len();
    // Dimensions k.. are covered whole after the first partial one: one run spans them.
    let mut k = nd;
    while k > 0 && region[k - 1] == (0..shape[k - 1]) {
        k -= 1;
    }
    if nd == 0 {
        return vec![(0, 1)];
    }
    let k = k.saturating_sub(1);
    let strides = kiln_tensor::contiguous_strides(shape);
    let run = region[k].len() * strides[k];
    let mut out = vec![];
    let mut idx: Vec<usize> = region[..k].iter().map(|r| r.start).collect();
    loop {
        let start: usize = idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>() + region[k].start * strides[k];
        out.push((start as u64, run as u64));
        // The next index of dimensions ..k, row-major.
        let mut d = k;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < region[d].end {
                break;
            }
            idx[d] = region[d].start;
        }
    }
}

/// Writes `tensors` to a safetensors file at `path` (atomically, see
/// [`write_atomic`]), with optional `__metadata__` strings (Hugging Face
/// writes `{"format": "pt"}`). Tensors are copied to the host one at a time;
/// distributed ones shard by shard (Note [Sharded checkpoints]).
///
/// ```no_run
/// use kiln::prelude::*;
/// use std::collections::BTreeMap;
/// let mut m = BTreeMap::new();
/// m.insert("x".to_string(), Tensor::ones(&[2, 2], DType::F32)?);
/// kiln::nn::io::save_safetensors("out.safetensors", &m, None)?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &BTreeMap<String, Tensor>,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    // Header: {"__metadata__": {...}, name: {dtype, shape, data_offsets}}, in name order.
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        let m: serde_json::Map<String, serde_json::Value> =
            m.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(m));
    }
    let mut offset = 0usize;
    let mut offsets = vec![];
    for (name, t) in tensors {
        let n = t.numel() * t.dtype().size_in_bytes();
        let dtype = serde_json::to_value(st_dtype(t.dtype())).map_err(|e| file_err(path, e))?;
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": t.shape(), "data_offsets": [offset, offset + n] }),
        );
        offsets.push(offset as u64);
        offset += n;
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header)).map_err(|e| file_err(path, e))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let data = 8 + header.len() as u64;
    atomic_file(path, |w| {
        let io = |e: std::io::Error| file_err(path, format!("cannot write: {e}"));
        w.write_at(0, &(header.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_at(8, &header).map_err(io)?;
        for ((name, t), at) in tensors.iter().zip(offsets) {
            write_tensor(w, data + at, t).map_err(|e| file_err(path, format!("tensor {name:?}: {e}")))?;
        }
        Ok(())
    })
}

/// The `__metadata__` Hugging Face writes into model files.
pub(crate) fn pt_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_string(), "pt".to_string())])
}
