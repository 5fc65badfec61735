//! kiln-cpu: the CPU backend. Kernels for every primitive of `kiln_tensor::Op`,
//! working directly on strided views of host memory.
mod backend;
mod fold;
mod kernels;
mod plan;
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
// threshold glibc accepts, 32 MiB), raises the trim threshold to 1 GiB, so
// freed blocks stay in the heap for the next step, and keeps every thread on
// the main heap (`M_ARENA_MAX = 1`): a thread's own arena holds at most 64 MiB
// and serves larger blocks with mmap whatever `M_MMAP_MAX` says, and training
// steps run on the pool's threads (Note [Loops on the compute threads]), where
// the f32 logits of llama-16m's step (67 MB) faulted in anew every step, ~17K
// faults (small allocations still come from each thread's cache without a lock). The process's resident memory
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
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes the struct it is given; RUSAGE_THREAD is valid on Linux.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut u), 0);
            u.ru_minflt
        }
    }

    /// Note [Keeping freed memory]: a block larger than a thread arena, freed
    /// and allocated again on a thread other than the main one, comes back
    /// from the heap without faulting its pages in again.
    #[test]
    fn large_blocks_freed_on_other_threads_are_reused() {
        super::register();
        let faults = std::thread::spawn(|| {
            let n = 80 << 20;
            drop(std::hint::black_box(vec![1u8; n]));
            let before = thread_faults();
            for _ in 0..5 {
                drop(std::hint::black_box(vec![1u8; n]));
            }
            thread_faults() - before
        })
        .join()
        .unwrap();
        // Mapped anew, each 80 MiB block faults 40 times with 2 MiB pages, 20K with 4 KiB ones.
        assert!(faults < 16, "{faults} page faults in 5 reallocations of 80 MiB");
    }
}

// Registers at program start so `Tensor::zeros(..)` works without an explicit call.
#[ctor::ctor]
fn auto_register() {
    register();
}
