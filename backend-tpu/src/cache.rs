//! The persistent compile cache: serialized executables on disk, keyed by the
//! program and everything that decides whether a compiled program is valid
//! (see Note [Compile cache keys]).
use crate::pjrt::{Client, CompileOptions, Executable};
use kiln_tensor::Result;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// Note [Compile cache keys]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A serialized executable is only valid for the plugin build that compiled it,
// the compile options, the device topology and the host CPU (XLA:CPU emits
// code for the features it finds). The key is the SHA-256 of all of these and
// the module text: the plugin file's path, size and modification time, its C
// API version, the platform name and version, the number and kind of devices,
// the compile options (for a program over a mesh: the number of partitions
// and the device assignment, so the same text on another mesh shape or on
// other devices is another entry), the CPU's feature flags, and `XLA_FLAGS`
// (the plugin reads its compiler flags from there; a program compiled under
// other flags is another program). An entry is
//     "KILNXEC1" | sha256(payload) | payload length (u64 le) | payload
// written to a temporary file in the cache directory and renamed into place,
// so a reader sees a whole entry or none, and two processes writing the same
// key each rename a complete file. A short, mis-tagged or mis-checksummed
// entry, or one the plugin refuses to load, is reported, compiled again and
// rewritten: never trusted. With a size cap, the least recently used entries
// (by modification time, refreshed on every hit) go first.

const MAGIC: &[u8; 8] = b"KILNXEC1";
const HEADER: usize = 8 + 32 + 8;

/// The on-disk executable cache of one client.
pub struct DiskCache {
    dir: PathBuf,
    identity: String,
    max_bytes: Option<u64>,
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) rebuilt: AtomicU64,
    pub(crate) load_ns: AtomicU64,
}

/// The cache directory: `KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln/xla`, else
/// `~/.cache/kiln/xla`; `None` when `KILN_CACHE_DIR=off`.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("KILN_CACHE_DIR") {
        Some(d) if d == "off" => None,
        Some(d) => Some(PathBuf::from(d)),
        None => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("kiln").join("xla"))
        }
    }
}

/// The host CPU's feature flags (XLA:CPU compiles for them).
fn cpu_features() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("flags")).map(|l| l.to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Bytes as lower-case hexadecimal.
pub fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes` in hexadecimal.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

impl DiskCache {
    /// The cache for `client` in `dir`, capped at `KILN_CACHE_MAX_MB` when set.
    pub fn new(dir: PathBuf, client: &Client) -> DiskCache {
        let api = client.api();
        let meta = std::fs::metadata(api.path()).ok();
        let kinds: Vec<String> =
            (0..client.device_count()).map(|i| client.device_kind(i).unwrap_or_default()).collect();
        let identity = format!(
            "plugin={} size={:?} mtime={:?} api={:?} platform={} {} devices={:?} cpu={} xla_flags={:?}",
            api.path().display(),
            meta.as_ref().map(|m| m.len()),
            meta.as_ref().and_then(|m| m.modified().ok()),
            api.version(),
            client.platform(),
            client.platform_version(),
            kinds,
            cpu_features(),
            std::env::var("XLA_FLAGS").unwrap_or_default()
        );
        let max_bytes = std::env::var("KILN_CACHE_MAX_MB").ok().and_then(|v| v.parse::<u64>().ok()).map(|mb| mb << 20);
        DiskCache {
            dir,
            identity,
            max_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            rebuilt: AtomicU64::new(0),
            load_ns: AtomicU64::new(0),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file holding `text`'s executable compiled with `options`.
    pub fn path_for(&self, text: &str, options: &CompileOptions) -> PathBuf {
        let mut h = Sha256::new();
        h.update(self.identity.as_bytes());
        h.update([0u8]);
        h.update(options.encode());
        h.update([0u8]);
        h.update(text.as_bytes());
        self.dir.join(format!("{}.kxe", hex(&h.finalize())))
    }

    /// Loads `text`'s executable from disk, or compiles it with `compile` and
    /// stores it. Write failures (a read-only directory) only cost the next
    /// process a compile.
    pub fn get_or_compile(
        &self,
        client: &Arc<Client>,
        text: &str,
        options: &CompileOptions,
        compile: impl FnOnce() -> Result<Executable>,
    ) -> Result<Executable> {
        let path = self.path_for(text, options);
        let t = std::time::Instant::now();
        if let Ok(bytes) = std::fs::read(&path) {
            let t_read = t.elapsed();
            match payload(&bytes).map(|p| client.deserialize(p)) {
                Some(Ok(exe)) => {
                    tracing::debug!(
                        target: "kiln::compile",
                        path = %path.display(),
                        bytes = bytes.len(),
                        read_ms = t_read.as_secs_f64() * 1e3,
                        deserialize_ms = (t.elapsed() - t_read).as_secs_f64() * 1e3,
                        "loaded an executable from the compile cache"
                    );
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    self.load_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    // Refresh the entry's age for the size cap (least recently used goes first).
                    if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                        let _ = f.set_modified(std::time::SystemTime::now());
                    }
                    return Ok(exe);
                }
                Some(Err(e)) => tracing::warn!(
                    target: "kiln::compile",
                    path = %path.display(),
                    error = %e,
                    "a compile cache entry is not loadable; compiling again"
                ),
                None => tracing::warn!(
                    target: "kiln::compile",
                    path = %path.display(),
                    "a compile cache entry is corrupt; compiling again"
                ),
            }
            self.rebuilt.fetch_add(1, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        let exe = compile()?;
        if let Ok(bytes) = exe.serialize() {
            if let Err(e) = self.store(&path, &bytes) {
                tracing::warn!(
                    target: "kiln::compile",
                    path = %path.display(),
                    error = %e,
                    "could not write a compile cache entry"
                );
            }
        }
        Ok(exe)
    }

    /// Writes an entry atomically (temporary file + rename), then applies the size cap.
    fn store(&self, path: &Path, payload: &[u8]) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            path.file_name().and_then(|n| n.to_str()).unwrap_or("entry")
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&Sha256::digest(payload))?;
            f.write_all(&(payload.len() as u64).to_le_bytes())?;
            f.write_all(payload)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        let r = write();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r?;
        if let Some(max) = self.max_bytes {
            self.evict(max);
        }
        Ok(())
    }

    /// Deletes the least recently used entries until the directory holds at most `max` bytes.
    fn evict(&self, max: u64) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "kxe"))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                Some((m.modified().ok()?, m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        entries.sort();
        for (_, len, p) in entries {
            if total <= max {
                break;
            }
            if std::fs::remove_file(&p).is_ok() {
                total -= len;
                tracing::debug!(
                    target: "kiln::compile",
                    path = %p.display(),
                    bytes = len,
                    max_bytes = max,
                    "evicted the least recently used compile cache entry"
                );
            }
        }
    }
}

/// The payload of a well-formed entry, or `None`.
fn payload(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(bytes[40..48].try_into().ok()?) as usize;
    let p = bytes.get(HEADER..)?;
    if p.len() != len || Sha256::digest(p).as_slice() != &bytes[8..40] {
        return None;
    }
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_cap_evicts_the_least_recently_used_entries() {
        let dir = std::env::temp_dir().join(format!("kiln-cache-evict-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cache = DiskCache {
            dir: dir.clone(),
            identity: String::new(),
            max_bytes: Some(2500),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            rebuilt: AtomicU64::new(0),
            load_ns: AtomicU64::new(0),
        };
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(100);
        for (i, name) in ["old", "mid", "new"].iter().enumerate() {
            let p = dir.join(format!("{name}.kxe"));
            std::fs::write(&p, vec![0u8; 1000]).unwrap();
            let f = std::fs::File::options().append(true).open(&p).unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(10 * i as u64)).unwrap();
        }
        cache.evict(2500);
        let left: Vec<bool> = ["old", "mid", "new"].iter().map(|n| dir.join(format!("{n}.kxe")).exists()).collect();
        assert_eq!(left, vec![false, true, true], "the oldest entry goes first, until the cap holds");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn entries_are_checked_before_use() {
        let p = b"an executable".to_vec();
        let mut e = MAGIC.to_vec();
        e.extend_from_slice(&Sha256::digest(&p));
        e.extend_from_slice(&(p.len() as u64).to_le_bytes());
        e.extend_from_slice(&p);
        assert_eq!(payload(&e), Some(&p[..]));
        let mut flipped = e.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(payload(&flipped), None, "a changed byte fails the checksum");
        assert_eq!(payload(&e[..e.len() - 1]), None, "a truncated entry is refused");
        let mut foreign = e.clone();
        foreign[0] = b'X';
        assert_eq!(payload(&foreign), None, "another format is refused");
    }
}
