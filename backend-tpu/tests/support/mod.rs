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

/// A float32 vector on `dev`.
pub fn vec_on(v: Vec<f32>, dev: kiln_tensor::Device) -> kiln_tensor::Tensor {
    let n = v.len();
    kiln_tensor::Tensor::from_vec(v, &[n]).unwrap().to_device(dev).unwrap()
}

#[path = "../../../tests/common/pjrt_plugin.rs"]
mod pjrt_plugin;

/// Runs `scripts/fetch-pjrt-plugin` when no plugin is found.
pub fn fetch_plugin() {
    pjrt_plugin::fetch_pjrt_plugin_unless(kiln_tpu::pjrt::find_plugin().is_ok());
}
