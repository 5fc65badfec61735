//! The seedable global generator behind `rand`, `randn`, `randint` (and dropout
//! later): xoshiro256** seeded through splitmix64, like `torch.manual_seed`.
use std::sync::Mutex;

/// xoshiro256** seeded through splitmix64: the generator behind the global one,
/// public so that other seeded streams (a data loader's shuffling) use the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    /// A generator seeded with `seed`.
    pub fn seeded(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Xoshiro256 { s: [next(), next(), next(), next()] }
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }
    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// PyTorch's default seed, so that an unseeded program is still deterministic.
const DEFAULT_SEED: u64 = 67_280_421_310_721;

static GENERATOR: Mutex<Option<Xoshiro256>> = Mutex::new(None);

/// Seeds the global generator: the same seed gives the same `rand`/`randn`/`randint` sequence.
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
    *GENERATOR.lock().unwrap_or_else(|e| e.into_inner()) = Some(Xoshiro256::seeded(seed));
}

/// The generator's state as one seed-like value, for checkpoints: a fresh
/// generator seeded with it continues the same stream.
pub fn seed_for_checkpoint() -> u64 {
    let mut g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let gen = g.get_or_insert_with(|| Xoshiro256::seeded(DEFAULT_SEED));
    let s = gen.next_u64();
    *gen = Xoshiro256::seeded(s);
    s
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Distribution {
    Uniform,
    Normal,
    Int(i64, i64),
}

/// Draws `n` samples as f64 (ints as exact f64 below 2^53) or i64 for `Int`.
pub(crate) fn sample(d: Distribution, n: usize) -> Vec<f64> {
    let mut g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let gen = g.get_or_insert_with(|| Xoshiro256::seeded(DEFAULT_SEED));
    match d {
        Distribution::Uniform => (0..n).map(|_| gen.next_f64()).collect(),
        Distribution::Normal => {
            let mut out = Vec::with_capacity(n + 1);
            while out.len() < n {
                // Box-Muller: two normals from two uniforms; u1 in (0, 1] avoids log(0).
                let u1 = 1.0 - gen.next_f64();
                let u2 = gen.next_f64();
                let r = (-2.0 * u1.ln()).sqrt();
                let th = 2.0 * std::f64::consts::PI * u2;
                out.push(r * th.cos());
                out.push(r * th.sin());
            }
            out.truncate(n);
            out
        }
        Distribution::Int(lo, hi) => {
            let range = (hi - lo) as u64;
            (0..n).map(|_| (lo + (gen.next_u64() % range) as i64) as f64).collect()
        }
    }
}

/// The global generator's full state (for activation checkpointing and checkpoints).
pub fn get_state() -> [u64; 4] {
    let mut g = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(|| Xoshiro256::seeded(DEFAULT_SEED)).s
}

/// Restores a state returned by [`get_state`].
pub fn set_state(s: [u64; 4]) {
    *GENERATOR.lock().unwrap_or_else(|e| e.into_inner()) = Some(Xoshiro256 { s });
}
