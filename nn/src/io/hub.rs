//! Models in the Hugging Face cache: a repo id (`"Qwen/Qwen3-0.6B"`) resolved
//! to its snapshot directory in the cache `huggingface_hub` and `hf-hub`
//! maintain, with no network (Note [The Hugging Face cache]).
use kiln_tensor::{Error, Result};
use std::path::{Path, PathBuf};

// Note [The Hugging Face cache]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `huggingface_hub` keeps each model repository in
// `{cache}/models--{org}--{name}/`: `blobs/` holds the files by content hash,
// `snapshots/{commit}/` one directory per downloaded commit whose entries link
// into `blobs/`, and `refs/{revision}` (e.g. `refs/main`) the commit a branch
// or tag pointed at when it was last downloaded. The cache is
// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (as
// `huggingface_hub.constants` computes it; the older `HUGGINGFACE_HUB_CACHE`
// is honoured after `HF_HUB_CACHE`).
//
// kiln only reads the cache: a revision resolves through `refs/`, or is a
// commit hash with a snapshot directory. It never downloads, so it runs the
// same with `HF_HUB_OFFLINE=1` (which only changes what a missing model's
// error says): a model not in the cache is an error naming the command that
// downloads it.

/// The Hugging Face hub cache directory, from the environment as
/// `huggingface_hub` reads it (Note [The Hugging Face cache]); `None` when
/// neither an override nor a home directory is known.
pub fn hub_cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from), home_dir())
}

/// Whether `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) asks for no network,
/// with `huggingface_hub`'s truth values (`1`, `ON`, `YES`, `TRUE`).
pub fn hub_offline() -> bool {
    let on = |k: &str| {
        std::env::var(k).is_ok_and(|v| matches!(v.trim().to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"))
    };
    on("HF_HUB_OFFLINE") || on("TRANSFORMERS_OFFLINE")
}

fn home_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// [`hub_cache_dir`] with the environment and home directory given.
pub fn cache_dir_from(env: impl Fn(&str) -> Option<PathBuf>, home: Option<PathBuf>) -> Option<PathBuf> {
    if let Some(c) = env("HF_HUB_CACHE").or_else(|| env("HUGGINGFACE_HUB_CACHE")) {
        return Some(c);
    }
    let hf_home = match env("HF_HOME") {
        Some(h) => h,
        None => env("XDG_CACHE_HOME").or_else(|| home.map(|h| h.join(".cache")))?.join("huggingface"),
    };
    Some(hf_home.join("hub"))
}

/// Whether `s` has the form of a repo id: `name` or `org/name`, each part
/// made of ASCII letters, digits, `-`, `_` and `.`, not starting or ending
/// with `-` or `.`, and no `--` or `..` (as the Hub validates them).
pub fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !p.starts_with(['-', '.'])
            && !p.ends_with(['-', '.'])
            && !p.contains("--")
            && !p.contains("..")
    };
    match s.split_once('/') {
        Some((org, name)) => part(org) && part(name),
        None => part(s),
    }
}

/// The snapshot directory of model `repo_id` at `revision` (a branch or tag
/// name with a `refs/` entry, or a commit hash) in the cache `cache`.
pub fn resolve_in(cache: &Path, repo_id: &str, revision: &str) -> Result<PathBuf> {
    let err = |msg: String| Error::invalid("hub", msg);
    if !is_repo_id(repo_id) {
        return Err(err(format!("{repo_id:?} is not a Hugging Face repo id (`name` or `org/name`)")));
    }
    if revision.is_empty() || revision.contains("..") || revision.starts_with('/') {
        return Err(err(format!("{revision:?} is not a revision (a branch, tag or commit hash)")));
    }
    let repo = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let offline = if hub_offline() { " (HF_HUB_OFFLINE is set)" } else { "" };
    if !repo.is_dir() {
        return Err(err(format!(
            "model {repo_id} is not in the Hugging Face cache at {}{offline}; kiln reads the cache but does not \
             download: fetch it with `huggingface-cli download {repo_id}` (or `hf download {repo_id}`)",
            cache.display()
        )));
    }
    let is_commit = |s: &str| s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit());
    let commit = if is_commit(revision) {
        revision.to_string()
    } else {
        let r = repo.join("refs").join(revision);
        let text = std::fs::read_to_string(&r).map_err(|e| {
            err(format!("model {repo_id}: no revision {revision:?} in the cache ({}: {e}){offline}", r.display()))
        })?;
        let c = text.trim().to_string();
        if !is_commit(&c) {
            return Err(err(format!("{}: {c:?} is not a commit hash", r.display())));
        }
        c
    };
    let snap = repo.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err(err(format!(
            "model {repo_id}: revision {revision:?} (commit {commit}) has no snapshot at {}{offline}",
            snap.display()
        )));
    }
    Ok(snap)
}

/// The directory of a model named by a path or a repo id: `name_or_path`
/// itself when it is a directory, else the snapshot of repo id
/// `name_or_path` at `revision` in [`hub_cache_dir`]. An error says what
/// was looked for and where.
pub fn resolve_model(name_or_path: &Path, revision: &str) -> Result<PathBuf> {
    if name_or_path.is_dir() {
        return Ok(name_or_path.to_path_buf());
    }
    let id = name_or_path.to_str().filter(|s| is_repo_id(s));
    let Some(id) = id else {
        return Err(Error::invalid("from_pretrained", format!("{}: no such directory", name_or_path.display())));
    };
    let cache = hub_cache_dir().ok_or_else(|| {
        Error::invalid(
            "from_pretrained",
            format!("{id} is not a directory, and there is no Hugging Face cache to look in (HOME and HF_HOME unset)"),
        )
    })?;
    resolve_in(&cache, id, revision).map_err(|e| {
        Error::invalid("from_pretrained", format!("{id} is neither a directory nor a model in the cache: {e}"))
    })
}
