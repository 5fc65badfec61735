//! The Python environments of the interoperability tests: the python a
//! `scripts/setup-*` script prints, run once per process (the script holds a
//! file lock, so tests and processes side by side wait for one setup). One
//! file, included by path by the test crates that use it.

/// The python of the environment `scripts/<script>` creates on first use
/// (from PyPI) and prints as its last line; panics with the script's output
/// when it fails.
pub fn python_from(script: &str) -> String {
    static PYTHONS: std::sync::Mutex<std::collections::BTreeMap<String, String>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let mut known = PYTHONS.lock().unwrap_or_else(|e| e.into_inner());
    known
        .entry(script.to_string())
        .or_insert_with(|| {
            let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
            let path = here
                .ancestors()
                .map(|d| d.join("scripts").join(script))
                .find(|s| s.is_file())
                .unwrap_or_else(|| panic!("no scripts/{script} above {}", here.display()));
            let out = std::process::Command::new(&path).output().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(out.status.success(), "{} failed:\n{}", path.display(), String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap().lines().last().unwrap_or_default().trim().to_string()
        })
        .clone()
}
