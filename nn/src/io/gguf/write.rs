//! Writing GGUF files ([`save_gguf`]): version 3, the layout Note [GGUF
//! files] describes, tensors stored as F32, F16, BF16, Q8_0 or Q4_0 with
//! ggml's reference rounding (Note [GGUF blocks]), written atomically.
use super::{gguf_err, GgmlType, GgufValue, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, MAX_NAME_LEN};
use crate::io::write_atomic;
use kiln_tensor::{DType, Result, Tensor};
use std::collections::BTreeSet;
use std::path::Path;

/// A tensor to write: its GGUF name, its value (any float dtype, PyTorch's
/// dimension order) and the type to store it as.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    pub tensor: Tensor,
    pub ggml_type: GgmlType,
}

impl GgufTensor {
    pub fn new(name: impl Into<String>, tensor: Tensor, ggml_type: GgmlType) -> GgufTensor {
        GgufTensor { name: name.into(), tensor, ggml_type }
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Appends `v`'s payload (without its type id).
fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.push(*x as u8),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_string(out, s),
        GgufValue::Array(item, items) => {
            out.extend(item.id().to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
    }
}

/// Checks that every item of every array has the array's item type.
fn check_value(key: &str, v: &GgufValue) -> std::result::Result<(), String> {
    if let GgufValue::Array(item, items) = v {
        if let Some(bad) = items.iter().find(|i| i.value_type() != *item) {
            return Err(format!("metadata {key:?}: an array of {item:?} holds a {:?}", bad.value_type()));
        }
        for i in items {
            check_value(key, i)?;
        }
    }
    Ok(())
}

/// Checks one tensor against what GGUF and its type allow; returns its byte size.
fn check_tensor(t: &GgufTensor) -> std::result::Result<usize, String> {
    let fail = |msg: String| format!("tensor {:?}: {msg}", t.name);
    if t.name.len() > MAX_NAME_LEN {
        return Err(fail(format!("names are at most {MAX_NAME_LEN} bytes in GGUF (llama.cpp's limit)")));
    }
    let shape = t.tensor.shape();
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(fail(format!("shape {shape:?}: GGUF tensors have 1 to {MAX_DIMS} dimensions")));
    }
    if !t.ggml_type.writable() {
        return Err(fail(format!("kiln writes F32, F16, BF16, Q8_0 and Q4_0 tensors, not {}", t.ggml_type)));
    }
    if !t.tensor.dtype().is_float() {
        return Err(fail(format!(
            "dtype {}: only floating-point tensors are stored as {}",
            t.tensor.dtype(),
            t.ggml_type
        )));
    }
    if t.tensor.is_distributed() {
        return Err(fail("a distributed tensor: gather it first (`full_tensor`)".into()));
    }
    let bs = t.ggml_type.block_size();
    let inner = shape[shape.len() - 1];
    if !inner.is_multiple_of(bs) {
        return Err(fail(format!(
            "{} blocks hold {bs} elements along the last dimension; shape {shape:?} has {inner}",
            t.ggml_type
        )));
    }
    Ok(t.tensor.numel() / bs * t.ggml_type.type_size())
}

/// The bytes of `t` stored as its type.
fn encode(t: &GgufTensor) -> Result<Vec<u8>> {
    let x = t.tensor.to_dtype(DType::F32)?.to_vec::<f32>()?;
    Ok(t.ggml_type.quantize(&x))
}

/// Writes a GGUF file (version 3) at `path`, atomically: `metadata` in the
/// given order (`general.alignment`, when given, sets the alignment; 32
/// otherwise), then `tensors` in the given order, each converted to its
/// type with ggml's reference rounding (Note [GGUF blocks]). Problems with
/// the input (a name over 63 bytes, a repeated name or key, a type kiln
/// does not write, a last dimension that is not a multiple of the block, a
/// mistyped array) are reported before anything is written.
///
/// ```no_run
/// use kiln::prelude::*;
/// use kiln::nn::io::gguf::{save_gguf, GgmlType, GgufTensor, GgufValue};
/// let w = Tensor::randn(&[64, 32], DType::F32)?;
/// let meta = vec![("general.architecture".to_string(), GgufValue::String("llama".into()))];
/// save_gguf("w.gguf", &meta, &[GgufTensor::new("w", w, GgmlType::Q8_0)])?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn save_gguf(path: impl AsRef<Path>, metadata: &[(String, GgufValue)], tensors: &[GgufTensor]) -> Result<()> {
    let path = path.as_ref();
    let bad = |msg: String| gguf_err(path, msg);
    let mut keys = BTreeSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for (k, v) in metadata {
        if !keys.insert(k.as_str()) {
            return Err(bad(format!("metadata key {k:?} given twice")));
        }
        check_value(k, v).map_err(bad)?;
        if k == "general.alignment" {
            alignment = match v {
                GgufValue::U32(a) if a.is_power_of_two() => *a as usize,
                _ => return Err(bad(format!("general.alignment must be a u32 power of two, got {v:?}"))),
            };
        }
    }
    let mut names = BTreeSet::new();
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(bad(format!("tensor {:?} given twice", t.name)));
        }
        sizes.push(check_tensor(t).map_err(bad)?);
    }

    let mut header = GGUF_MAGIC.to_vec();
    header.extend(3u32.to_le_bytes());
    header.extend((tensors.len() as u64).to_le_bytes());
    header.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_string(&mut header, k);
        header.extend(v.value_type().id().to_le_bytes());
        put_value(&mut header, v);
    }
    let mut offset = 0usize;
    for (t, &n) in tensors.iter().zip(&sizes) {
        put_string(&mut header, &t.name);
        let shape = t.tensor.shape();
        header.extend((shape.len() as u32).to_le_bytes());
        for &d in shape.iter().rev() {
            header.extend((d as u64).to_le_bytes());
        }
        header.extend(t.ggml_type.id().to_le_bytes());
        header.extend((offset as u64).to_le_bytes());
        offset = (offset + n).next_multiple_of(alignment);
    }
    header.resize(header.len().next_multiple_of(alignment), 0);

    // Conversion errors inside the writer come back as io errors; keep the
    // first one to report it as it was.
    let mut failed = None;
    let written = write_atomic(path, |w| {
        w.write_all(&header)?;
        for (t, &n) in tensors.iter().zip(&sizes) {
            let bytes = encode(t).map_err(|e| {
                let msg = format!("tensor {:?}: {e}", t.name);
                failed = Some(msg.clone());
                std::io::Error::other(msg)
            })?;
            debug_assert_eq!(bytes.len(), n);
            w.write_all(&bytes)?;
            w.write_all(&vec![0u8; n.next_multiple_of(alignment) - n])?;
        }
        Ok(())
    });
    match failed {
        Some(msg) => Err(bad(msg)),
        None => written,
    }
}
