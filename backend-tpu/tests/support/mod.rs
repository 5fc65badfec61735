//! Setup shared by the PJRT backend's tests.
#![allow(dead_code)] // each test binary uses a different subset

/// Registers the CPU backend and the PJRT backend on the XLA:CPU plugin,
/// fetching the plugin first (`scripts/fetch-pjrt-plugin`) when neither
/// `KILN_PJRT_PLUGIN` nor the cache directory provides one.
pub fn setup() {
    kiln_cpu::register();
    fetch_plugin();
    kiln_tpu::register().expect("registering the PJRT backend");
}

/// Runs `scripts/fetch-pjrt-plugin` when no plugin is found.
pub fn fetch_plugin() {
    if kiln_tpu::pjrt::find_plugin().is_err() {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-pjrt-plugin");
        let out = std::process::Command::new(&script).output().expect("running fetch-pjrt-plugin");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}
