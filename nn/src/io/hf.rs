//! Hugging Face checkpoint directories: one `model.safetensors`, or shards
//! named in `model.safetensors.index.json` (`{"weight_map": {name: file}}`).
use super::safetensors::{pt_metadata, save_safetensors, write_atomic, SafetensorsFile};
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn dir_err(dir: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid("checkpoint", format!("{}: {msg}", dir.display()))
}

/// Reads the weights of a Hugging Face checkpoint directory: `model.safetensors`
/// if present, else every shard listed in `model.safetensors.index.json`.
/// Floating-point tensors are converted to `dtype` when given.
pub fn load_checkpoint_dir(
    dir: impl AsRef<Path>,
    dtype: Option<DType>,
    device: Device,
) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for (f, names) in open_checkpoint(dir.as_ref())? {
        for name in names {
            let t = f.tensor(&name, dtype, device)?;
            out.insert(name, t);
        }
    }
    Ok(out)
}

/// The files of the checkpoint in `dir`, opened, each with the names of the
/// tensors it holds: `model.safetensors` with all of its own, or the shards
/// of `model.safetensors.index.json` with the names the index maps to them
/// (checked to be there; a file name that is not in `dir` is an error).
pub(crate) fn open_checkpoint(dir: &Path) -> Result<Vec<(SafetensorsFile, Vec<String>)>> {
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        let f = SafetensorsFile::open(&single)?;
        let names = f.names();
        return Ok(vec![(f, names)]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        return Err(dir_err(dir, format!("no {SINGLE_FILE} and no {INDEX_FILE} in this directory")));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| dir_err(&index, format!("cannot read: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| dir_err(&index, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| dir_err(&index, "no \"weight_map\" object"))?;
    // file -> names it should hold
    let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| dir_err(&index, format!("weight_map[{name:?}] is not a string")))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(dir_err(
                &index,
                format!("weight_map[{name:?}] = {file:?} is not a file name in this directory"),
            ));
        }
        files.entry(file.to_string()).or_default().push(name.clone());
    }
    files
        .into_iter()
        .map(|(file, names)| {
            let f = SafetensorsFile::open(dir.join(&file))?;
            if let Some(name) = names.iter().find(|n| f.info(n).is_none()) {
                return Err(dir_err(&index, format!("{name:?} is mapped to {file}, which does not hold it")));
            }
            Ok((f, names))
        })
        .collect()
}

/// Writes `tensors` as a Hugging Face checkpoint into `dir` (created if
/// needed): one `model.safetensors`, or with `max_shard_bytes`, shards
/// `model-00001-of-0000N.safetensors` of at most that size (a larger tensor
/// gets a shard of its own) plus `model.safetensors.index.json`. Every file is
/// written atomically. A checkpoint of the other layout in `dir` is removed so
/// that loaders cannot pick up stale weights.
pub fn save_checkpoint_dir(
    dir: impl AsRef<Path>,
    tensors: &BTreeMap<String, Tensor>,
    max_shard_bytes: Option<usize>,
) -> Result<()> {
    let dir = dir.as_ref();
    let Some(max) = max_shard_bytes else {
        std::fs::create_dir_all(dir).map_err(|e| dir_err(dir, format!("cannot create: {e}")))?;
        save_safetensors(dir.join(SINGLE_FILE), tensors, Some(&pt_metadata()))?;
        return remove_stale(dir, INDEX_FILE);
    };
    save_checkpoint_files(dir, &split_by_size(tensors, max), None)
}

/// `tensors` in groups of at most `max` bytes each, in name order (a tensor
/// larger than `max` gets a group of its own).
pub fn split_by_size(tensors: &BTreeMap<String, Tensor>, max: usize) -> Vec<BTreeMap<String, Tensor>> {
    let mut groups: Vec<BTreeMap<String, Tensor>> = vec![];
    let mut size = 0usize;
    for (name, t) in tensors {
        let n = t.numel() * t.dtype().size_in_bytes();
        if groups.is_empty() || (size + n > max && size > 0) {
            groups.push(BTreeMap::new());
            size = 0;
        }
        groups.last_mut().expect("pushed above").insert(name.clone(), t.clone());
        size += n;
    }
    groups
}

/// Writes a Hugging Face checkpoint in the index layout into `dir` (created
/// if needed): group `i` of `files` as `model-0000{i+1}-of-0000N.safetensors`
/// and `model.safetensors.index.json` mapping every name to its file, whose
/// metadata records the mesh and placements of distributed tensors and
/// `extra` metadata when given (`kiln_` keys). A name in two groups is an
/// error; so is an empty group. Every file is written atomically, and a
/// stale `model.safetensors` in `dir` is removed.
pub fn save_checkpoint_files(
    dir: impl AsRef<Path>,
    files: &[BTreeMap<String, Tensor>],
    extra: Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<()> {
    let dir = dir.as_ref();
    if files.is_empty() {
        return Err(dir_err(dir, "a checkpoint of no files: give at least one group of tensors"));
    }
    if let Some(i) = files.iter().position(BTreeMap::is_empty) {
        return Err(dir_err(dir, format!("file {} of {} would hold no tensor", i + 1, files.len())));
    }
    let mut weight_map = serde_json::Map::new();
    for (i, group) in files.iter().enumerate() {
        for name in group.keys() {
            if weight_map.insert(name.clone(), serde_json::Value::from(i)).is_some() {
                return Err(dir_err(dir, format!("{name:?} is in two files of one checkpoint")));
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| dir_err(dir, format!("cannot create: {e}")))?;
    let meta = pt_metadata();
    let total = files.len();
    let file_name = |i: usize| format!("model-{:05}-of-{total:05}.safetensors", i + 1);
    let mut total_size = 0usize;
    for (i, group) in files.iter().enumerate() {
        save_safetensors(dir.join(file_name(i)), group, Some(&meta))?;
        total_size += group.values().map(|t| t.numel() * t.dtype().size_in_bytes()).sum::<usize>();
    }
    for file in weight_map.values_mut() {
        *file = serde_json::Value::String(file_name(file.as_u64().expect("an index, set above") as usize));
    }
    let mut metadata = serde_json::json!({ "total_size": total_size });
    // Where each distributed tensor was placed, for the reader's information
    // (a loader takes the placements of its own parameters).
    let placed: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .flatten()
        .filter(|(_, t)| t.is_distributed())
        .map(|(name, t)| Ok((name.clone(), serde_json::Value::String(placement_text(t)?))))
        .collect::<Result<_>>()?;
    if !placed.is_empty() {
        metadata["kiln_placements"] = serde_json::Value::Object(placed);
    }
    for (k, v) in extra.into_iter().flatten() {
        metadata[k] = v;
    }
    let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).map_err(|e| dir_err(dir, e))?;
    write_atomic(&dir.join(INDEX_FILE), |w| w.write_all(text.as_bytes()))?;
    remove_stale(dir, SINGLE_FILE)
}

/// Removes `dir/name` if it is a file (a checkpoint of the other layout).
fn remove_stale(dir: &Path, name: &str) -> Result<()> {
    let p = dir.join(name);
    if p.is_file() {
        std::fs::remove_file(&p).map_err(|e| dir_err(&p, format!("cannot remove the stale file: {e}")))
    } else {
        Ok(())
    }
}

/// `"dp=2,tp=2 [Shard(dim=0), Replicate()]"`: a distributed tensor's mesh and placements.
fn placement_text(t: &Tensor) -> Result<String> {
    let mesh = t.device_mesh()?;
    let axes: Vec<String> = mesh.axis_names().iter().zip(mesh.shape()).map(|(n, s)| format!("{n}={s}")).collect();
    let p: Vec<String> = t.placements()?.iter().map(|p| p.to_string()).collect();
    Ok(format!("{} [{}]", axes.join(","), p.join(", ")))
}
