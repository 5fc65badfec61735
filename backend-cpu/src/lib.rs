//! kiln-cpu: the CPU backend. Kernels for every primitive of `kiln_tensor::Op`,
//! working directly on strided views of host memory.
mod backend;
mod kernels;
mod team;

pub use backend::CpuBackend;

use kiln_tensor::DeviceKind;
use std::sync::Once;

static REGISTER: Once = Once::new();

/// Registers the CPU backend for `Device::Cpu` (idempotent).
pub fn register() {
    REGISTER.call_once(|| {
        tune_allocator();
        kiln_tensor::register_backend(DeviceKind::Cpu, Box::new(CpuBackend::new()))
    });
}

// Note [Keeping freed memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every kernel output is a fresh buffer, and a training step frees hundreds of
// megabytes of activations and gradients that the next step allocates again.
// glibc's malloc serves large blocks with mmap (each page then faults in and is
// zeroed by the kernel on first touch) and returns free memory at the top of the
// heap to the OS once it exceeds the trim threshold, so by default a step pays
// its page faults again and again: measured here, a fifth of a small Llama's
// training step. At registration the CPU backend therefore turns off mmap for
// the main heap (`M_MMAP_MAX = 0`: blocks of any size come from the heap, which
// matters for the 64 MiB logits of a language model, above the largest
// threshold glibc accepts, 32 MiB; threads' own arenas still fall back to mmap
// for blocks larger than an arena) and raises the trim threshold to 1 GiB, so
// freed blocks stay in the heap for the next step. The process's resident memory
// then stays near its peak instead of shrinking between steps (measured: the
// peak itself went down, as freed blocks are reused instead of mapped anew).
// Other allocators and platforms are left alone; `KILN_KEEP_MALLOC_DEFAULTS=1`
// opts out.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("KILN_KEEP_MALLOC_DEFAULTS").is_some() {
            return;
        }
        // SAFETY: mallopt only changes glibc malloc's tuning parameters; it is
        // thread-safe (it takes the arena locks) and any value is valid input
        // (glibc rejects out-of-range ones by returning 0, which is harmless).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

// Registers at program start so `Tensor::zeros(..)` works without an explicit call.
#[ctor::ctor]
fn auto_register() {
    register();
}
