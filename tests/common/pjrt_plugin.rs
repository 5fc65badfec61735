//! Makes sure the XLA:CPU PJRT plugin is there before a test registers the PJRT
//! backend, so the suite never skips the device: runs `scripts/fetch-pjrt-plugin`
//! when neither `KILN_PJRT_PLUGIN` nor the plugin cache provides one. One file,
//! included by path by every test crate that uses the PJRT device.

/// Runs `scripts/fetch-pjrt-plugin` unless `found` (whether kiln's
/// `pjrt::find_plugin` already finds a plugin); panics if the script fails.
pub fn fetch_pjrt_plugin_unless(found: bool) {
    if found {
        return;
    }
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = here
        .ancestors()
        .map(|d| d.join("scripts/fetch-pjrt-plugin"))
        .find(|s| s.is_file())
        .unwrap_or_else(|| panic!("no scripts/fetch-pjrt-plugin above {}", here.display()));
    let out =
        std::process::Command::new(&script).output().unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
}
