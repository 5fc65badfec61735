//! Random-number generators as PyTorch has them: [`Generator`] objects with
//! `manual_seed` / `get_state` / `set_state`, one default generator per
//! device, and [`manual_seed`] seeding them all. A generator's state is a
//! tensor on its device and every draw is the `Op::RandomBits` primitive (see
//! Note \[Generators\]); the distributions built on it are in `random.rs`.
use crate::trace::ConstantScope;
use crate::{DType, Device, Error, GradModeGuard, Op, Result, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

// Note [Generators]
// ~~~~~~~~~~~~~~~~~
// A generator is a state tensor, int64 `[2]` = `[key, offset]`, on its
// device. A draw of `n` numbers runs `Op::RandomBits` on the state, which
// returns the bits and the state advanced by `ceil(n / 4)` Philox blocks; the
// generator's own state tensor moves on by as many blocks, in place. Three
// things follow:
//
// - a draw never leaves the device: on a PJRT device the bits are computed
//   there and the state stays there, so drawing costs no host round trip;
// - the stream is a pure function of the state, computed bit for bit the same
//   by the CPU kernel and the StableHLO lowering: the same seed gives the same
//   bits, uniforms, masks and permutations on `cpu` and on `tpu:0`, in every
//   mode (normals go through `log`, `sqrt`, `cos` and `sin`, whose last bits may
//   differ between backends);
// - under `kiln::compile` the state is ordinary state of the program, read and
//   written (and donated), so every replay draws fresh numbers and advances the
//   generator exactly as eager execution would; under DeferAndFuse the draws
//   fuse with the ops that use them.
//
// A draw takes its range of counters under the generator's lock: it copies
// the state and advances the state's offset by the draw's blocks, two ops on
// two elements, so threads sharing a generator get disjoint numbers. The
// kernel then runs on the copy with the lock released: a kernel may fork
// into the thread pool, and a lock held across it would wait on pool threads
// that may themselves be waiting for the lock (a thread outside the pool
// drawing while the pool's tasks draw too). The key is the seed; a fresh or
// reseeded generator starts at offset 0.

/// PyTorch's default seed, so that an unseeded program is still deterministic.
pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

/// A counter-based random-number generator on one device (`torch.Generator`).
/// Clones share the generator.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::Generator;
/// let g = Generator::new(Device::Cpu)?.manual_seed(42)?;
/// let a = g.rand(&[3], DType::F32)?;
/// g.manual_seed(42)?;
/// assert_eq!(g.rand(&[3], DType::F32)?.to_vec::<f32>()?, a.to_vec::<f32>()?);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct Generator(Arc<Inner>);

struct Inner {
    device: Device,
    /// The state tensor (int64 `[2]` on `device`), written in place by every draw.
    state: Mutex<Tensor>,
    initial_seed: AtomicU64,
    /// A failed write of `kiln::manual_seed`, reported by the next draw.
    failed_seed: Mutex<Option<Error>>,
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Generator(device={}, initial_seed={})", self.0.device, self.initial_seed())
    }
}

fn state_tensor(seed: u64, device: Device) -> Result<Tensor> {
    let _c = ConstantScope::enter();
    Tensor::from_vec(vec![seed as i64, 0], &[2])?.to_device(device)
}

impl Generator {
    /// A generator on `device` seeded with [`DEFAULT_SEED`].
    pub fn new(device: Device) -> Result<Generator> {
        Generator::seeded(DEFAULT_SEED, device)
    }

    fn seeded(seed: u64, device: Device) -> Result<Generator> {
        Ok(Generator(Arc::new(Inner {
            device,
            state: Mutex::new(state_tensor(seed, device)?),
            initial_seed: AtomicU64::new(seed),
            failed_seed: Mutex::new(None),
        })))
    }

    /// The device it draws on.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// The seed it was last seeded with.
    pub fn initial_seed(&self) -> u64 {
        self.0.initial_seed.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tensor> {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Seeds it: the stream starts again from `seed`. Returns the generator,
    /// so `Generator::new(dev)?.manual_seed(s)?` makes a seeded one.
    pub fn manual_seed(&self, seed: u64) -> Result<Generator> {
        let st = self.lock();
        self.write_state(&st, &state_tensor(seed, Device::Cpu)?)?;
        self.0.initial_seed.store(seed, Ordering::SeqCst);
        *self.0.failed_seed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(self.clone())
    }

    fn write_state(&self, st: &Tensor, value: &Tensor) -> Result<()> {
        let _ng = GradModeGuard::set(false);
        let _c = ConstantScope::enter();
        st.copy_(value)?;
        Ok(())
    }

    /// A copy of the state (int64 `[2]`: key and offset) on the generator's
    /// device; [`Generator::set_state`] puts it back.
    pub fn get_state(&self) -> Result<Tensor> {
        let _ng = GradModeGuard::set(false);
        self.lock().deep_clone()
    }

    /// Restores a state returned by [`Generator::get_state`] (from any device).
    pub fn set_state(&self, state: &Tensor) -> Result<()> {
        if state.dtype() != DType::I64 || state.shape() != [2] {
            return Err(Error::invalid(
                "Generator.set_state",
                format!("expected a state of shape [2] and dtype int64, got {:?} {}", state.shape(), state.dtype()),
            ));
        }
        let st = self.lock();
        self.write_state(&st, state)
    }

    /// `n = shape.product()` random 32-bit values (int64 in `[0, 2^32)`), the
    /// primitive every distribution is made of; the state moves on by
    /// `ceil(n / 4)` Philox blocks.
    pub fn random_bits(&self, shape: &[usize]) -> Result<Tensor> {
        if let Some(e) = self.0.failed_seed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e);
        }
        let _ng = GradModeGuard::set(false);
        // The draw's range of counters, taken under the lock; the kernel runs
        // after it is released (Note [Generators]).
        let start = {
            let st = self.lock();
            let start = st.deep_clone()?;
            let blocks = shape.iter().product::<usize>().div_ceil(4);
            let advance = {
                let _c = ConstantScope::enter();
                Tensor::from_vec(vec![0i64, blocks as i64], &[2])?.to_device(self.0.device)?
            };
            st.add_(&advance)?;
            start
        };
        let mut outs = Tensor::apply_on(Op::RandomBits { shape: shape.into() }, &[&start], self.0.device)?;
        Ok(outs.swap_remove(0))
    }
}

static DEFAULTS: Mutex<Vec<Generator>> = Mutex::new(Vec::new());
static SEED: AtomicU64 = AtomicU64::new(DEFAULT_SEED);

/// The default generator of `device` (`torch.cuda.default_generators[i]`'s
/// role), made on first use with the seed of the last [`manual_seed`]. The
/// random creation ops, dropout and sampling draw from it unless given a
/// generator.
pub fn default_generator(device: Device) -> Result<Generator> {
    let mut all = DEFAULTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = all.iter().find(|g| g.device() == device) {
        return Ok(g.clone());
    }
    let g = Generator::seeded(SEED.load(Ordering::SeqCst), device)?;
    all.push(g.clone());
    Ok(g)
}

/// The default generators made so far, one per device that has drawn numbers.
pub fn default_generators() -> Vec<Generator> {
    DEFAULTS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Seeds the default generator of every device (`torch.manual_seed`): the same
/// seed gives the same random numbers, on each device, from then on.
///
/// ```
/// kiln::manual_seed(0);
/// let a = kiln::Tensor::rand(&[3], kiln::DType::F32)?;
/// kiln::manual_seed(0);
/// let b = kiln::Tensor::rand(&[3], kiln::DType::F32)?;
/// assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn manual_seed(seed: u64) {
    SEED.store(seed, Ordering::SeqCst);
    for g in default_generators() {
        if let Err(e) = g.manual_seed(seed) {
            // A device that cannot take the write reports it at its next draw.
            let msg = format!("kiln::manual_seed({seed}) could not reseed the generator of {}: {e}", g.device());
            *g.0.failed_seed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Error::backend("generator", msg));
        }
    }
}
