//! GGUF files, llama.cpp's checkpoint format (Note [GGUF files]):
//! [`GgufFile`] reads one (memory-mapped; metadata, tensor infos, tensors
//! dequantized exactly, or Q8_0 / Q4_0 kept packed), [`save_gguf`] writes
//! one atomically;
//! [`tokenizer_json`] and [`tokenizer_metadata`] carry a tokenizer between
//! GGUF metadata and Hugging Face's `tokenizer.json`.
//!
// Note [GGUF files]
// ~~~~~~~~~~~~~~~~~
// A GGUF file (version 2 or 3, little-endian) is
//
//     "GGUF" u32:version u64:tensor_count u64:kv_count
//     kv_count × (string:key u32:value_type value)
//     tensor_count × (string:name u32:n_dims n_dims × u64:ne u32:ggml_type u64:offset)
//     padding to `general.alignment` (default 32), then the data section
//
// where a string is a u64 length and UTF-8 bytes, and a value is one of 13
// types (integers of 8 to 64 bits, f32, f64, bool, string, or an array: u32
// item type, u64 count, items). A tensor's `ne` lists its dimensions
// innermost first, so a weight `[out, in]` (PyTorch's order, which kiln
// reports) is stored as `ne = [in, out]`; its offset is relative to the data
// section and a multiple of the alignment. Block-quantized types run their
// blocks along `ne[0]` (Note [GGUF blocks]), which must be a multiple of the
// block size.
//
// The reader checks everything against the file before trusting it: counts
// against the bytes that remain (so a hostile count cannot allocate), every
// string's UTF-8, dimensions' products for overflow, tensor names for
// duplicates, each tensor's bytes inside the data section. Version 1 files
// (32-bit counts) and big-endian files are refused with the reason.
mod blocks;
mod packed;
mod tokenizer;
mod write;

pub use blocks::GgmlType;
pub use packed::{pack_blocks, packable};
pub use tokenizer::{tokenizer_json, tokenizer_metadata};
pub use write::{save_gguf, GgufTensor};

use kiln_tensor::{Device, Error, HostBuffer, Result, Tensor};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// The alignment of the data section and of every tensor when the file does
/// not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// The longest tensor name llama.cpp accepts (`GGML_MAX_NAME` - 1).
pub const MAX_NAME_LEN: usize = 63;
/// The most dimensions a GGUF tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// The type of a metadata value (GGUF's `gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// GGUF's id of the type.
    pub fn id(self) -> u32 {
        match self {
            GgufValueType::U8 => 0,
            GgufValueType::I8 => 1,
            GgufValueType::U16 => 2,
            GgufValueType::I16 => 3,
            GgufValueType::U32 => 4,
            GgufValueType::I32 => 5,
            GgufValueType::F32 => 6,
            GgufValueType::Bool => 7,
            GgufValueType::String => 8,
            GgufValueType::Array => 9,
            GgufValueType::U64 => 10,
            GgufValueType::I64 => 11,
            GgufValueType::F64 => 12,
        }
    }

    fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        [U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64].into_iter().find(|t| t.id() == id)
    }

    /// The fewest bytes a value of this type takes (for bounding counts).
    fn min_size(self) -> usize {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 | GgufValueType::String => 8,
            GgufValueType::Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// The items' type (kept, so that an empty array writes back as read) and the items.
    Array(GgufValueType, Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value's type.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(..) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// An array of strings.
    pub fn strings<S: Into<String>>(items: impl IntoIterator<Item = S>) -> GgufValue {
        GgufValue::Array(GgufValueType::String, items.into_iter().map(|s| GgufValue::String(s.into())).collect())
    }

    /// The value as an integer, if it is one (of any width and sign).
    pub fn as_i128(&self) -> Option<i128> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v.into()),
            GgufValue::F32(_)
            | GgufValue::F64(_)
            | GgufValue::Bool(_)
            | GgufValue::String(_)
            | GgufValue::Array(..) => None,
        }
    }

    /// The value as a non-negative integer that fits `usize`.
    pub fn as_usize(&self) -> Option<usize> {
        self.as_i128().and_then(|v| usize::try_from(v).ok())
    }

    /// The value as a float (either float type, or an integer).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// The string, if the value is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The bool, if the value is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The items, if the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(_, items) => Some(items),
            _ => None,
        }
    }
}

/// A tensor as the file describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// PyTorch's order: outermost first (the reverse of GGUF's `ne`).
    pub shape: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Bytes from the start of the data section.
    pub offset: usize,
    /// Bytes the tensor takes.
    pub nbytes: usize,
}

/// An open, memory-mapped GGUF file whose header has been parsed and checked
/// (Note [GGUF files]).
///
/// ```no_run
/// use kiln::prelude::*;
/// use kiln::nn::io::gguf::GgufFile;
/// let f = GgufFile::open("model.gguf")?;
/// println!("{:?}", f.get("general.architecture").and_then(|v| v.as_str()));
/// for info in f.tensor_infos() {
///     let t = f.tensor(&info.name, Some(DType::F32), Device::Cpu)?; // dequantized exactly
///     println!("{} {} {:?}", info.name, info.ggml_type, t.shape());
/// }
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct GgufFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    keys: BTreeMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    by_name: BTreeMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GgufFile({}, version {}, {} keys, {} tensors)",
            self.path.display(),
            self.version,
            self.metadata.len(),
            self.tensors.len()
        )
    }
}

/// An error about the GGUF file at `path`.
pub(crate) fn gguf_err(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid("gguf", format!("{}: {msg}", path.display()))
}

/// A bounds-checked little-endian reader over the header.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            format!("truncated header: {n} bytes wanted at offset {}, the file has {}", self.pos, self.bytes.len())
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// A count of items of at least `min_size` bytes each, checked against the bytes left.
    fn count(&mut self, what: &str, min_size: usize) -> std::result::Result<usize, String> {
        let n = self.u64()?;
        if n.saturating_mul(min_size as u64) > self.remaining() as u64 {
            return Err(format!("{what} count {n} cannot fit in the {} bytes that remain", self.remaining()));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> std::result::Result<String, String> {
        let n = self.count("string length", 1)?;
        let at = self.pos;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| format!("the string at offset {at} is not UTF-8"))
    }

    fn value(&mut self, ty: GgufValueType, depth: usize) -> std::result::Result<GgufValue, String> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>()?[0]),
            GgufValueType::I8 => GgufValue::I8(self.array::<1>()?[0] as i8),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            GgufValueType::U32 => GgufValue::U32(self.u32()?),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            GgufValueType::Bool => match self.array::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("bool value {b} at offset {}", self.pos - 1)),
            },
            GgufValueType::String => GgufValue::String(self.string()?),
            GgufValueType::Array => {
                if depth >= 4 {
                    return Err("arrays nested more than 4 deep".into());
                }
                let item = self.value_type()?;
                let n = self.count("array", item.min_size())?;
                let items = (0..n).map(|_| self.value(item, depth + 1)).collect::<std::result::Result<_, _>>()?;
                GgufValue::Array(item, items)
            }
            GgufValueType::U64 => GgufValue::U64(self.u64()?),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
        })
    }

    fn value_type(&mut self) -> std::result::Result<GgufValueType, String> {
        let id = self.u32()?;
        GgufValueType::from_id(id).ok_or_else(|| format!("unknown value type {id} at offset {}", self.pos - 4))
    }
}

impl GgufFile {
    /// Maps `path` and parses its header. A missing, truncated or malformed
    /// file is an error naming the file and what is wrong.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| gguf_err(&path, format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only and private to this process; it is
        // only read through bounds-checked slices of the checked layout, and
        // tensors are copied out before use. Another process truncating the
        // file while it is mapped could fault; kiln never writes a file in
        // place (saves go to a temporary file that is renamed).
        let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }
            .map_err(|e| gguf_err(&path, format!("cannot memory-map: {e}")))?;
        let parsed = parse(&mmap).map_err(|e| gguf_err(&path, e))?;
        let (version, metadata, tensors, data_start) = parsed;
        let keys = metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile { path, mmap, version, metadata, keys, tensors, by_name, data_start })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata, in the file's order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// The metadata value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The tensors, in the file's order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The description of tensor `name`, if present.
    pub fn info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The stored bytes of tensor `name` (blocks as Note [GGUF blocks] lays them out).
    pub fn raw(&self, name: &str) -> Result<(&GgufTensorInfo, &[u8])> {
        let info = self.info(name).ok_or_else(|| gguf_err(&self.path, format!("no tensor named {name:?}")))?;
        let start = self.data_start + info.offset;
        Ok((info, &self.mmap[start..start + info.nbytes]))
    }

    /// Reads tensor `name` onto `device`, in PyTorch's dimension order: the
    /// plain types as stored, the block-quantized ones dequantized exactly
    /// into float32 (Note [GGUF blocks]). With `dtype`, a floating-point
    /// result is converted to it. A type kiln cannot dequantize (the IQ and
    /// TQ families, MXFP4, NVFP4) is an error naming it.
    pub fn tensor(&self, name: &str, dtype: Option<kiln_tensor::DType>, device: Device) -> Result<Tensor> {
        let (info, bytes) = self.raw(name)?;
        let bad = |e: Error| gguf_err(&self.path, format!("tensor {name:?}: {e}"));
        let Some(read) = info.ggml_type.read_dtype() else {
            return Err(gguf_err(
                &self.path,
                format!("tensor {name:?} has type {}, which kiln cannot dequantize", info.ggml_type),
            ));
        };
        let buf = if info.ggml_type.is_quantized() {
            let mut out = vec![0f32; info.shape.iter().product()];
            info.ggml_type.dequantize(bytes, &mut out);
            HostBuffer::F32(out)
        } else {
            HostBuffer::from_le_bytes(read, bytes).map_err(bad)?
        };
        let t = Tensor::from_host(buf, &info.shape, Device::Cpu).map_err(bad)?;
        let t = match dtype {
            Some(dt) if t.dtype().is_float() && dt.is_float() => t.to_dtype(dt)?,
            _ => t,
        };
        t.to_device(device)
    }
}

type Parsed = (u32, Vec<(String, GgufValue)>, Vec<GgufTensorInfo>, usize);

/// Parses and checks the header of `bytes` (Note [GGUF files]).
fn parse(bytes: &[u8]) -> std::result::Result<Parsed, String> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.take(4).map_err(|_| format!("not a GGUF file: {} bytes", bytes.len()))?;
    if magic != GGUF_MAGIC {
        return Err(format!("not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""));
    }
    let version = c.u32()?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 (32-bit counts) is not supported: convert the model again".into()),
        v if v.swap_bytes() <= 3 => return Err("a big-endian GGUF file: kiln reads little-endian ones".into()),
        v => return Err(format!("unknown GGUF version {v}")),
    }
    // A tensor info takes at least 8 (name) + 4 + 8 (one dim) + 4 + 8 bytes.
    let n_tensors = c.count("tensor", 32)?;
    let n_kv = c.count("metadata", 12)?;
    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..n_kv {
        let key = c.string()?;
        let ty = c.value_type()?;
        let v = c.value(ty, 0).map_err(|e| format!("metadata {key:?}: {e}"))?;
        if !seen.insert(key.clone()) {
            return Err(format!("metadata key {key:?} appears twice"));
        }
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_usize() {
            Some(a) if a.is_power_of_two() => a,
            _ => return Err(format!("general.alignment must be a power of two, got {v:?}")),
        },
    };
    let mut infos = Vec::with_capacity(n_tensors);
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..n_tensors {
        let info = tensor_info(&mut c, alignment)?;
        if !names.insert(info.name.clone()) {
            return Err(format!("tensor {:?} appears twice", info.name));
        }
        infos.push(info);
    }
    let data_start = c.pos.next_multiple_of(alignment);
    let data_len = bytes.len().saturating_sub(data_start);
    for t in &infos {
        if t.offset.checked_add(t.nbytes).is_none_or(|end| end > data_len) {
            return Err(format!(
                "tensor {:?}: bytes {}..{} of the data section, which has {data_len}: the file is truncated or corrupt",
                t.name,
                t.offset,
                t.offset.saturating_add(t.nbytes)
            ));
        }
    }
    Ok((version, metadata, infos, data_start))
}

/// One tensor info, checked: dimensions, type, block alignment of `ne[0]`,
/// offset alignment, size without overflow.
fn tensor_info(c: &mut Cursor, alignment: usize) -> std::result::Result<GgufTensorInfo, String> {
    let name = c.string()?;
    let fail = |msg: String| format!("tensor {name:?}: {msg}");
    let n_dims = c.u32()? as usize;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(fail(format!("{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")));
    }
    let mut ne = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        let d = c.u64()?;
        ne.push(usize::try_from(d).map_err(|_| fail(format!("dimension {d} is too large")))?);
    }
    let id = c.u32()?;
    let ggml_type = GgmlType::from_id(id).ok_or_else(|| fail(format!("unknown ggml type {id}")))?;
    let offset = c.u64()?;
    let offset = usize::try_from(offset).map_err(|_| fail(format!("offset {offset} is too large")))?;
    if !offset.is_multiple_of(alignment) {
        return Err(fail(format!("offset {offset} is not a multiple of the alignment {alignment}")));
    }
    let bs = ggml_type.block_size();
    if !ne[0].is_multiple_of(bs) {
        return Err(fail(format!("{ggml_type} blocks hold {bs} elements; the innermost dimension is {}", ne[0])));
    }
    let numel = ne.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| fail("size overflows".into()))?;
    let nbytes = (numel / bs).checked_mul(ggml_type.type_size()).ok_or_else(|| fail("size overflows".into()))?;
    ne.reverse();
    Ok(GgufTensorInfo { name, shape: ne, ggml_type, offset, nbytes })
}
