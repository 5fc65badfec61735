//! Training checkpoints: the model in the Hugging Face layout (`config.json` +
//! `model.safetensors`), the optimizer state (`optimizer.safetensors`), and
//! `trainer_state.json` (step, the state of every default random generator,
//! data loader position, free fields), written atomically into one directory, so that a resumed run
//! continues exactly as the uninterrupted one would have.
//!
//! ```no_run
//! use kiln::nn::checkpoint::{checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint, TrainerState};
//! # fn demo(model: &mut dyn kiln::nn::module::Module, opt: &mut dyn kiln::nn::optim::Optimizer,
//! #         loader: &mut kiln::nn::data::TokenLoader) -> kiln::Result<()> {
//! // Saving, every N steps:
//! let state = TrainerState::capture(100, Some(loader.state()))?;
//! save_checkpoint(checkpoint_dir("out", 100), model, None, opt, &state)?;
//! // Resuming:
//! if let Some(dir) = latest_checkpoint("out")? {
//!     let ckpt = load_checkpoint(dir)?;
//!     ckpt.restore(model, opt)?; // weights, optimizer state, generators
//!     if let Some(l) = ckpt.state.loader { loader.set_state(l)?; }
//! }
//! # Ok(()) }
//! ```
use crate::data::LoaderState;
use crate::io::{
    load_checkpoint_dir, load_safetensors, save_checkpoint_dir, save_checkpoint_files, save_safetensors, split_by_size,
    write_atomic,
};
use crate::module::Module;
use crate::optim::Optimizer;
use kiln_tensor::generator::{default_generator, default_generators};
use kiln_tensor::{is_registered, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The optimizer state file of a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The training-state file of a checkpoint.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// The model configuration file (Hugging Face layout).
pub const CONFIG_FILE: &str = "config.json";
/// The file written last into a checkpoint: the name and size of every other
/// file. A directory without it, or whose files do not match it, is not a checkpoint.
pub const MANIFEST_FILE: &str = "checkpoint_manifest.json";
const MANIFEST_FORMAT: &str = "kiln-checkpoint-1";
/// The largest model file of a distributed model's checkpoint (Hugging Face's
/// default `max_shard_size`, 5 GB); larger tensors get a file of their own.
pub const SHARDED_FILE_BYTES: usize = 5_000_000_000;

const FORMAT: &str = "kiln-trainer-state-2";

/// Everything besides the weights and the optimizer state that a resumed run needs.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: u64,
    /// The state (`[key, offset]`) of the default generator of each device that
    /// has one (dropout masks, sampling, random initialisation).
    pub generators: Vec<(Device, [i64; 2])>,
    /// The training data loader's position.
    pub loader: Option<LoaderState>,
    /// Free-form fields of the training program (loss history, arguments, ...).
    pub extra: serde_json::Value,
}

impl TrainerState {
    /// The state now: `step`, the default generators' states (read from their
    /// devices) and the loader position.
    pub fn capture(step: u64, loader: Option<LoaderState>) -> Result<TrainerState> {
        let mut generators = vec![];
        for g in default_generators() {
            let v = g.get_state()?.to_vec::<i64>()?;
            generators.push((g.device(), [v[0], v[1]]));
        }
        Ok(TrainerState { step, generators, loader, extra: serde_json::Value::Null })
    }
    /// Adds free-form fields.
    pub fn with_extra(mut self, extra: serde_json::Value) -> TrainerState {
        self.extra = extra;
        self
    }
    /// Puts the default generators back where they were when the state was
    /// captured (those of devices with no registered backend are left alone:
    /// nothing can draw from them).
    pub fn restore_rng(&self) -> Result<()> {
        for (device, st) in &self.generators {
            if is_registered(device.kind()) {
                default_generator(*device)?.set_state(&Tensor::from_vec(st.to_vec(), &[2])?)?;
            }
        }
        Ok(())
    }
    /// The JSON of `trainer_state.json` (64-bit values as strings).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "format": FORMAT,
            "global_step": self.step,
            "generators": self
                .generators
                .iter()
                .map(|(d, st)| (d.to_string(), serde_json::json!(st.map(|w| format!("{:016x}", w as u64)))))
                .collect::<serde_json::Map<_, _>>(),
            "loader": self.loader.map(|l| l.to_json()),
            "extra": self.extra,
        })
    }
    /// Reads [`TrainerState::to_json`].
    pub fn from_json(v: &serde_json::Value) -> Result<TrainerState> {
        let bad = |what: &str| Error::invalid("TrainerState", format!("{TRAINER_STATE_FILE}: {what}"));
        if v["format"] == "kiln-trainer-state-1" {
            return Err(bad(
                "written by an older kiln whose random generator this version does not have (format kiln-trainer-state-1); a resumed run would not continue its random stream",
            ));
        }
        if v["format"] != FORMAT {
            return Err(bad(&format!("unknown format {} (expected {FORMAT:?})", v["format"])));
        }
        let step = v["global_step"].as_u64().ok_or_else(|| bad("global_step is missing"))?;
        let map = v["generators"].as_object().ok_or_else(|| bad("generators is missing"))?;
        let mut generators = vec![];
        for (name, words) in map {
            let device = Device::parse(name).map_err(|_| bad(&format!("unknown device {name:?} in generators")))?;
            let words =
                words.as_array().filter(|a| a.len() == 2).ok_or_else(|| bad("a generator state needs 2 words"))?;
            let mut st = [0i64; 2];
            for (w, s) in st.iter_mut().zip(words) {
                *w =
                    s.as_str().and_then(|s| u64::from_str_radix(s, 16).ok()).ok_or_else(|| bad("bad generator word"))?
                        as i64;
            }
            generators.push((device, st));
        }
        let loader = match &v["loader"] {
            serde_json::Value::Null => None,
            l => Some(LoaderState::from_json(l)?),
        };
        Ok(TrainerState { step, generators, loader, extra: v["extra"].clone() })
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::invalid("checkpoint", format!("{}: {e}", path.display()))
}

/// `out/checkpoint-{step}`: where the checkpoint of a step goes (Hugging Face `Trainer`'s naming).
pub fn checkpoint_dir(out: impl AsRef<Path>, step: u64) -> PathBuf {
    out.as_ref().join(format!("checkpoint-{step}"))
}

/// The `checkpoint-{N}` directories of `out` with their steps, oldest first.
pub fn list_checkpoints(out: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    let out = out.as_ref();
    if !out.is_dir() {
        return Ok(vec![]);
    }
    let mut found = vec![];
    for entry in std::fs::read_dir(out).map_err(|e| io_err(out, e))? {
        let entry = entry.map_err(|e| io_err(out, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix("checkpoint-").and_then(|s| s.parse::<u64>().ok()) else { continue };
        // Directories get this name by a rename of a complete one, and leave it by a
        // rename before they are deleted; the manifest also covers copies made by hand.
        if is_complete(&entry.path()) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The checkpoint of the highest step in `out`, if any.
pub fn latest_checkpoint(out: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(out)?.pop().map(|(_, p)| p))
}

/// Deletes all but the `keep` most recent checkpoints of `out`. Each is first
/// renamed aside (to a name `list_checkpoints` ignores), so a process killed
/// while deleting leaves no half-deleted checkpoint behind, only a leftover
/// that the next save removes.
pub fn prune_checkpoints(out: impl AsRef<Path>, keep: usize) -> Result<()> {
    let all = list_checkpoints(&out)?;
    let n = all.len().saturating_sub(keep);
    for (_, p) in &all[..n] {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let aside = out.as_ref().join(format!(".{name}.deleting-{}", std::process::id()));
        std::fs::rename(p, &aside).map_err(|e| io_err(p, format!("cannot move aside before deleting: {e}")))?;
        std::fs::remove_dir_all(&aside).map_err(|e| io_err(&aside, e))?;
    }
    Ok(())
}

/// Writes the manifest of the files in `dir` (the last file of a checkpoint).
fn write_manifest(dir: &Path) -> Result<()> {
    let mut files = serde_json::Map::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let len = entry.metadata().map_err(|e| io_err(&entry.path(), e))?.len();
        files.insert(entry.file_name().to_string_lossy().into_owned(), serde_json::json!(len));
    }
    let text = serde_json::to_string_pretty(&serde_json::json!({"format": MANIFEST_FORMAT, "files": files}))
        .map_err(|e| io_err(dir, e))?;
    write_atomic(&dir.join(MANIFEST_FILE), |w| w.write_all(text.as_bytes()))
}

/// Whether `dir` holds a manifest whose files are all there, at their sizes.
fn is_complete(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(MANIFEST_FILE)) else { return false };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return false };
    let Some(files) = v["files"].as_object().filter(|_| v["format"] == MANIFEST_FORMAT) else { return false };
    files.contains_key(TRAINER_STATE_FILE)
        && files.iter().all(|(name, len)| {
            std::fs::metadata(dir.join(name)).is_ok_and(|m| m.is_file() && Some(m.len()) == len.as_u64())
        })
}

/// Removes what interrupted saves and prunes left in `out`: the temporary and
/// set-aside directories (`.checkpoint-N.tmp-PID`, `.old-PID`, `.deleting-PID`)
/// of this process or of processes that no longer run.
fn remove_leftovers(out: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".checkpoint-") else { continue };
        let pid = [".tmp-", ".old-", ".deleting-"]
            .iter()
            .find_map(|tag| rest.rsplit_once(tag).and_then(|(_, pid)| pid.parse::<u32>().ok()));
        let Some(pid) = pid else { continue };
        if pid == std::process::id() || !process_alive(pid) {
            let p = entry.path();
            std::fs::remove_dir_all(&p).map_err(|e| io_err(&p, format!("cannot remove a leftover: {e}")))?;
        }
    }
    Ok(())
}

/// Whether process `pid` exists (Linux: `/proc/PID`; elsewhere assumed alive).
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// Fills a directory atomically: `fill` writes into a fresh temporary sibling
/// directory, which then replaces `dir` by a rename. A crash leaves the old
/// `dir` (or none) plus a stray temporary directory, never a partial `dir`.
pub fn write_dir_atomic(dir: impl AsRef<Path>, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = dir.as_ref();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dir.file_name().ok_or_else(|| io_err(dir, "not a directory path"))?.to_string_lossy().into_owned();
    std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, format!("cannot create: {e}")))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp, format!("cannot create: {e}")))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    let replacing = dir.exists();
    if replacing {
        std::fs::rename(dir, &old).map_err(|e| io_err(dir, format!("cannot move the old directory aside: {e}")))?;
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        if replacing {
            let _ = std::fs::rename(&old, dir);
        }
        return Err(io_err(dir, format!("cannot rename the new directory into place: {e}")));
    }
    if replacing {
        std::fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))?;
    }
    // Make the renames durable.
    if let Ok(d) = std::fs::File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Saves a training checkpoint into `dir` (atomically, replacing an older one):
/// `model.safetensors` (the model's `state_dict()`, Hugging Face names, stacked
/// experts split into the Hub's per-expert ones; for a
/// model on a device mesh, written shard by shard without gathering it, as
/// `model-0000k-of-0000n.safetensors` files and their index
/// `model.safetensors.index.json`, see Note [Sharded checkpoints]),
/// `config.json` when `model_config` (its JSON text) is given, so that the
/// directory loads as a pretrained model, `optimizer.safetensors` (the
/// optimizer's `state_dict()`), `trainer_state.json`, and last the manifest
/// ([`MANIFEST_FILE`]) that makes it a complete checkpoint. Leftovers of
/// interrupted saves and prunes in the parent directory are removed first.
pub fn save_checkpoint(
    dir: impl AsRef<Path>,
    model: &dyn Module,
    model_config: Option<&str>,
    optimizer: &dyn Optimizer,
    state: &TrainerState,
) -> Result<()> {
    let weights = crate::layers::to_hub_layout(model.state_dict())?;
    let opt_state: BTreeMap<String, Tensor> = optimizer.state_dict()?.into_iter().collect();
    save_checkpoint_parts(dir.as_ref(), std::slice::from_ref(&weights), model_config, &opt_state, state)
}

/// [`save_checkpoint`] from its parts: the weights (in the Hub's layout) and
/// the optimizer state by name, for runs whose model or optimizer is in
/// pieces (a pipeline's stages, see [`crate::pipeline::save_pipeline_checkpoint`]).
///
/// `weights` holds one map per piece. One piece is written as
/// [`save_checkpoint`] writes a model; several (a pipeline's stages, each
/// parameter in one of them) each get files of their own in the index layout
/// (Note [Sharded checkpoints]), piece `s` in the files the index's
/// `kiln_pieces[s]` lists, so that each could be written where its piece
/// lives; a loader reads them as one model.
pub fn save_checkpoint_parts(
    dir: &Path,
    weights: &[BTreeMap<String, Tensor>],
    model_config: Option<&str>,
    opt_state: &BTreeMap<String, Tensor>,
    state: &TrainerState,
) -> Result<()> {
    let t = std::time::Instant::now();
    let trainer =
        serde_json::to_string_pretty(&state.to_json()).map_err(|e| io_err(Path::new(TRAINER_STATE_FILE), e))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        remove_leftovers(parent)?;
    }
    write_dir_atomic(dir, |tmp| {
        // A distributed model is written shard by shard into the index layout
        // (Note [Sharded checkpoints]); its files can then be written per host.
        save_model_files(tmp, weights)?;
        if let Some(cfg) = model_config {
            write_atomic(&tmp.join(CONFIG_FILE), |w| w.write_all(cfg.as_bytes()))?;
        }
        save_safetensors(tmp.join(OPTIMIZER_FILE), opt_state, None)?;
        write_atomic(&tmp.join(TRAINER_STATE_FILE), |w| w.write_all(trainer.as_bytes()))?;
        write_manifest(tmp)
    })?;
    tracing::info!(
        target: "kiln::train",
        dir = %dir.display(),
        step = state.step,
        ms = t.elapsed().as_secs_f64() * 1e3,
        "saved a training checkpoint"
    );
    Ok(())
}

/// The model files of a checkpoint from the weights of its pieces (see
/// [`save_checkpoint_parts`]).
fn save_model_files(dir: &Path, pieces: &[BTreeMap<String, Tensor>]) -> Result<()> {
    let distributed = pieces.iter().flat_map(BTreeMap::values).any(Tensor::is_distributed);
    match pieces {
        [] => Err(Error::invalid("save_checkpoint_parts", "no weights: one map per piece of the model")),
        // A distributed model is written shard by shard into the index layout
        // (Note [Sharded checkpoints]); its files can then be written per host.
        [whole] => save_checkpoint_dir(dir, whole, distributed.then_some(SHARDED_FILE_BYTES)),
        _ => {
            let mut files = vec![];
            let mut listed = vec![];
            for piece in pieces {
                let own = split_by_size(piece, SHARDED_FILE_BYTES);
                let names: Vec<serde_json::Value> =
                    (files.len()..files.len() + own.len()).map(|i| serde_json::Value::from(i + 1)).collect();
                listed.push(serde_json::Value::Array(names));
                files.extend(own);
            }
            let n = files.len();
            for l in &mut listed {
                for v in l.as_array_mut().expect("an array, made above") {
                    let i = v.as_u64().expect("a file number, set above");
                    *v = serde_json::Value::String(format!("model-{i:05}-of-{n:05}.safetensors"));
                }
            }
            let extra = serde_json::Map::from_iter([("kiln_pieces".to_string(), serde_json::Value::Array(listed))]);
            save_checkpoint_files(dir, &files, Some(extra))
        }
    }
}

/// A checkpoint directory, read back: its [`TrainerState`], and the files for
/// the model and optimizer, loaded on request.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The checkpoint directory (also a Hugging Face model directory).
    pub dir: PathBuf,
    /// The training state saved with it.
    pub state: TrainerState,
}

/// Opens a checkpoint written by [`save_checkpoint`] (reads `trainer_state.json`).
pub fn load_checkpoint(dir: impl AsRef<Path>) -> Result<Checkpoint> {
    let dir = dir.as_ref().to_path_buf();
    if dir.is_dir() && !is_complete(&dir) {
        return Err(io_err(
            &dir,
            format!("not a complete checkpoint: {MANIFEST_FILE} is missing or names files that are not there"),
        ));
    }
    let path = dir.join(TRAINER_STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| io_err(&path, e))?;
    let state = TrainerState::from_json(&v)?;
    tracing::info!(target: "kiln::train", dir = %dir.display(), step = state.step, "opened a training checkpoint");
    Ok(Checkpoint { state, dir })
}

impl Checkpoint {
    /// The model weights by name (CPU, stored dtypes).
    pub fn model_state(&self) -> Result<BTreeMap<String, Tensor>> {
        load_checkpoint_dir(&self.dir, None, Device::Cpu)
    }
    /// The optimizer state entries (for [`Optimizer::load_state_dict`]).
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(load_safetensors(self.dir.join(OPTIMIZER_FILE))?.into_iter().collect())
    }
    /// Restores a training run: copies the weights into `model`'s parameters (strict:
    /// every name must match; the parameters keep their identity, so `optimizer`
    /// still holds them), loads `optimizer`'s state, and restores the default
    /// generators. The data loader position is in `self.state.loader`.
    ///
    /// The model may be placed differently from the one saved (another mesh,
    /// other parallelism, one device): weights and optimizer state take the
    /// placements of the parameters they go into (resharding on load).
    pub fn restore(&self, model: &mut dyn Module, optimizer: &mut dyn Optimizer) -> Result<()> {
        let state = crate::layers::from_hub_layout(self.model_state()?, &model.state_dict())?;
        model.load_state_dict(&state, true)?;
        optimizer.load_state_dict(self.optimizer_state()?)?;
        self.state.restore_rng()
    }
}
