//! Random distributions, each a composite on `Op::RandomBits` drawn from a
//! [`Generator`] (see Note \[Generators\] in `generator.rs`): uniform, normal,
//! randint, randperm, bernoulli, multinomial and dropout, as methods of the
//! generator and, from the device's default generator, of `Tensor`. Also
//! [`Xoshiro256`], the host-side generator of data loaders.
use crate::generator::{default_generator, Generator};
use crate::trace::{self, ConstantScope};
use crate::{DType, Device, Error, Result, Tensor, TensorOptions};

/// xoshiro256** seeded through splitmix64: a small seeded host generator for
/// streams that never reach a device (a data loader's shuffling).
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
}

fn float_dtype(op: &'static str, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::dtype(op, format!("expected a floating point dtype, got {dtype}")));
    }
    Ok(())
}

/// The generator's device must be the tensor's (PyTorch's check).
fn same_device(op: &'static str, g: &Generator, device: Device) -> Result<()> {
    if g.device() != device {
        return Err(Error::device(op, format!("expected a generator on {device}, but found one on {}", g.device())));
    }
    Ok(())
}

/// 63 random bits per element (int64 in `[0, 2^63)`), from two 32-bit draws.
fn bits63(g: &Generator, n: usize) -> Result<Tensor> {
    let w = g.random_bits(&[n, 2])?;
    let hi = w.select(1, 0)?.bitwise_and(0x7FFF_FFFFi64)?;
    hi.bitwise_left_shift(32i64)?.bitwise_or(&w.select(1, 1)?)
}

impl Generator {
    /// Uniform samples in `[0, 1)` (`torch.rand`). Each element takes as many
    /// random bits as its dtype's significand holds (24 for float32, 53 for
    /// float64, 8 for bfloat16, 11 for float16), so every value is exact and
    /// below 1.
    pub fn rand(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        float_dtype("rand", dtype)?;
        let _c = ConstantScope::enter();
        if dtype == DType::F64 {
            let n = crate::numel(shape);
            let b = bits63(self, n)?.bitwise_right_shift(10i64)?; // 53 bits
            return b.to_dtype(DType::F64)?.mul(2f64.powi(-53))?.reshape_to(shape);
        }
        let m = match dtype {
            DType::BF16 => 8,
            DType::F16 => 11,
            _ => 24,
        };
        let b = self.random_bits(shape)?.bitwise_right_shift(32 - m as i64)?;
        b.to_dtype(DType::F32)?.mul(2f64.powi(-m))?.to_dtype(dtype)
    }

    /// Standard normal samples (`torch.randn`), by the Box-Muller transform of
    /// pairs of uniforms (computed in float32, float64 for float64).
    pub fn randn(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        float_dtype("randn", dtype)?;
        let _c = ConstantScope::enter();
        let n = crate::numel(shape);
        let compute = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let pairs = n.div_ceil(2);
        let u = self.rand(&[pairs, 2], compute)?;
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let r = u.select(1, 0)?.neg()?.add(1.0)?.log()?.mul(-2.0)?.sqrt()?;
        let theta = u.select(1, 1)?.mul(2.0 * std::f64::consts::PI)?;
        let z = Tensor::stack(&[&r.mul(&theta.cos()?)?, &r.mul(&theta.sin()?)?], 1)?;
        z.reshape_to(&[pairs * 2])?.narrow(0, 0, n)?.reshape_to(shape)?.to_dtype(dtype)
    }

    /// Integers uniform in `[low, high)` (`torch.randint`): 32 random bits per
    /// element modulo the range when it fits 32 bits, 63 bits otherwise.
    pub fn randint(&self, low: i64, high: i64, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if high <= low {
            return Err(Error::invalid(
                "randint",
                format!("random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"),
            ));
        }
        let range = high as i128 - low as i128;
        if range > i64::MAX as i128 {
            return Err(Error::invalid("randint", format!("the range [{low}, {high}) is wider than 2^63 - 1")));
        }
        let _c = ConstantScope::enter();
        let bits = if range <= 1 << 32 {
            self.random_bits(shape)?
        } else {
            bits63(self, crate::numel(shape))?.reshape_to(shape)?
        };
        bits.remainder(range as i64)?.add(low)?.to_dtype(dtype)
    }

    /// A random permutation of `0..n` (`torch.randperm`): the order that sorts
    /// `n` random 63-bit keys (ties, with probability about `n^2 / 2^64`, keep
    /// index order).
    pub fn randperm(&self, n: usize, dtype: DType) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let keys = bits63(self, n)?;
        let (_, order) = keys.sort_stable(0, false)?;
        order.to_dtype(dtype)
    }

    /// Zeros and ones drawn with the probabilities in `p` (`torch.bernoulli`),
    /// in `p`'s dtype. Outside a traced function, probabilities outside
    /// `[0, 1]` (or NaN) are an error.
    pub fn bernoulli(&self, p: &Tensor) -> Result<Tensor> {
        same_device("bernoulli", self, p.device())?;
        float_dtype("bernoulli", p.dtype())?;
        if !trace::is_tracing() {
            let bad = p.isnan()?.logical_or(&p.lt(0.0)?)?.logical_or(&p.gt(1.0)?)?.any()?;
            if bad.item::<bool>()? {
                return Err(Error::invalid("bernoulli", "Expected p_in >= 0 && p_in <= 1 to be true"));
            }
        }
        let _c = ConstantScope::enter();
        let compute = if p.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        self.rand(p.shape(), compute)?.lt(&p.to_dtype(compute)?)?.to_dtype(p.dtype())
    }

    /// `num_samples` category indices per row of `probs` (`[C]` or `[B, C]`,
    /// non-negative weights, not necessarily normalised), int64, as
    /// `torch.multinomial`: with replacement by inverting each row's
    /// cumulative sum at uniform points, without replacement by the largest
    /// `log(p) + Gumbel` keys. Outside a traced function, invalid rows (a NaN,
    /// an infinity or a negative weight, a zero sum, fewer non-zero weights
    /// than samples without replacement) are errors with PyTorch's messages.
    pub fn multinomial(&self, probs: &Tensor, num_samples: usize, replacement: bool) -> Result<Tensor> {
        const OP: &str = "multinomial";
        same_device(OP, self, probs.device())?;
        float_dtype(OP, probs.dtype())?;
        if probs.ndim() == 0 || probs.ndim() > 2 {
            return Err(Error::shape(OP, format!("prob_dist must be 1 or 2 dim, got {:?}", probs.shape())));
        }
        let c = probs.shape()[probs.ndim() - 1];
        if c == 0 {
            return Err(Error::shape(OP, "the number of categories cannot be zero"));
        }
        if num_samples == 0 {
            return Err(Error::invalid(OP, "cannot sample n_sample <= 0 samples"));
        }
        if !replacement && num_samples > c {
            return Err(Error::invalid(OP, "cannot sample n_sample > prob_dist.size(-1) samples without replacement"));
        }
        let rows = if probs.ndim() == 1 { probs.unsqueeze(0)? } else { probs.clone() };
        let compute = if probs.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let p = rows.to_dtype(compute)?;
        if !trace::is_tracing() {
            check_distribution(&p, num_samples, replacement)?;
        }
        let _c = ConstantScope::enter();
        let b = p.shape()[0];
        let picked = if replacement || num_samples == 1 {
            // Category k is chosen when cdf[k-1] <= u * total < cdf[k]: the number of
            // cdf entries <= u * total. Counting only entries below the total keeps a
            // product rounded up to the total on the last category with weight.
            let cdf = p.cumsum(1)?; // [B, C]
            let total = cdf.narrow(1, c as isize - 1, 1)?; // [B, 1]
            let target = self.rand(&[b, num_samples], compute)?.mul(&total)?; // [B, n]
            let cdf3 = cdf.unsqueeze(1)?; // [B, 1, C]
            let below = cdf3.le(&target.unsqueeze(2)?)?.logical_and(&cdf3.lt(&total.unsqueeze(2)?)?)?;
            below.sum_dim(2, false)?
        } else {
            // Gumbel top-k: log(p) - log(e) with e ~ Exp(1); zero weights never win.
            let u = self.rand(&[b, c], compute)?;
            let e = u.neg()?.log1p()?.neg()?;
            let keys = p.log()?.sub(&e.log()?)?;
            let keys = Tensor::where_cond(&p.gt(0.0)?, &keys, f64::NEG_INFINITY)?;
            keys.topk(num_samples, 1, true, true)?.1
        };
        if probs.ndim() == 1 {
            picked.squeeze_dim(0)
        } else {
            Ok(picked)
        }
    }
}

/// PyTorch's checks of a multinomial distribution `[B, C]`, read in one transfer.
fn check_distribution(p: &Tensor, num_samples: usize, replacement: bool) -> Result<()> {
    const OP: &str = "multinomial";
    let bad = p.isnan()?.logical_or(&p.isinf()?)?.logical_or(&p.lt(0.0)?)?.any()?.to_dtype(DType::F64)?;
    let min_sum = p.sum_dim(1, false)?.amin(0, false)?.to_dtype(DType::F64)?;
    let min_nonzero = p.gt(0.0)?.sum_dim(1, false)?.amin(0, false)?.to_dtype(DType::F64)?;
    let v = Tensor::stack(&[&bad, &min_sum, &min_nonzero], 0)?.to_vec::<f64>()?;
    if v[0] != 0.0 {
        return Err(Error::invalid(OP, "probability tensor contains either `inf`, `nan` or element < 0"));
    }
    if v[1] <= 0.0 {
        return Err(Error::invalid(OP, "invalid multinomial distribution (sum of probabilities <= 0)"));
    }
    if !replacement && v[2] < num_samples as f64 {
        return Err(Error::invalid(
            OP,
            "invalid multinomial distribution (with replacement=False, not enough non-negative category to sample)",
        ));
    }
    Ok(())
}

impl Tensor {
    /// Uniform samples in `[0, 1)` from the default generator of the device
    /// (see [`crate::manual_seed`] and [`Generator::rand`]).
    pub fn rand(shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        default_generator(o.device)?.rand(shape, o.dtype)
    }
    /// Standard normal samples from the default generator of the device.
    pub fn randn(shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        default_generator(o.device)?.randn(shape, o.dtype)
    }
    /// Integers uniform in `[low, high)` from the default generator of the
    /// device. Default dtype of PyTorch's randint is int64: pass `DType::I64` for it.
    pub fn randint(low: i64, high: i64, shape: &[usize], opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        default_generator(o.device)?.randint(low, high, shape, o.dtype)
    }
    /// A random permutation of `0..n` from the default generator of the device.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let mut p = Tensor::randperm(5, DType::I64)?.to_vec::<i64>()?;
    /// p.sort();
    /// assert_eq!(p, vec![0, 1, 2, 3, 4]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn randperm(n: usize, opts: impl Into<TensorOptions>) -> Result<Tensor> {
        let o = opts.into();
        default_generator(o.device)?.randperm(n, o.dtype)
    }
    pub fn rand_like(&self) -> Result<Tensor> {
        Tensor::rand(self.shape(), self)
    }
    pub fn randn_like(&self) -> Result<Tensor> {
        Tensor::randn(self.shape(), self)
    }
    /// Zeros and ones with the probabilities in `self` (`torch.bernoulli`), from
    /// the default generator of the device.
    pub fn bernoulli(&self) -> Result<Tensor> {
        default_generator(self.device())?.bernoulli(self)
    }
    /// Category indices drawn from the rows of `self` (`torch.multinomial`),
    /// from the default generator of the device; see [`Generator::multinomial`].
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let p = Tensor::new([[0.0f32, 1.0, 0.0], [0.0, 0.0, 2.0]])?;
    /// assert_eq!(p.multinomial(3, true)?.to_vec::<i64>()?, vec![1, 1, 1, 2, 2, 2]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn multinomial(&self, num_samples: usize, replacement: bool) -> Result<Tensor> {
        default_generator(self.device())?.multinomial(self, num_samples, replacement)
    }

    /// Dropout: in training, zeroes each element with probability `p` and scales
    /// the others by `1 / (1 - p)`; otherwise returns `self`. The mask comes from
    /// the default generator of the device (see [`crate::manual_seed`]);
    /// [`Tensor::dropout_with`] takes a generator.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::ones(&[1000], DType::F32)?;
    /// assert!(x.dropout(0.5, false)?.same(&x));
    /// let y = x.dropout(0.5, true)?.to_vec::<f32>()?;
    /// assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn dropout(&self, p: f64, train: bool) -> Result<Tensor> {
        if !train || p == 0.0 {
            check_dropout(self, p)?;
            return Ok(self.clone());
        }
        self.dropout_with(p, train, &default_generator(self.device())?)
    }

    /// [`Tensor::dropout`] with the mask drawn from `generator`.
    pub fn dropout_with(&self, p: f64, train: bool, generator: &Generator) -> Result<Tensor> {
        check_dropout(self, p)?;
        same_device("dropout", generator, self.device())?;
        if !train || p == 0.0 {
            return Ok(self.clone());
        }
        if p == 1.0 {
            // PyTorch multiplies by zero (NaN stays NaN).
            return self.mul(&Tensor::zeros(&[], (self.dtype(), self.device()))?);
        }
        // An element is kept when its uniform draw is below 1 - p.
        let keep = generator.rand(self.shape(), DType::F32)?.lt(1.0 - p)?;
        let noise = keep.to_dtype(self.dtype())?.div(1.0 - p)?;
        self.mul(&noise)
    }
}

fn check_dropout(x: &Tensor, p: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid("dropout", format!("dropout probability has to be between 0 and 1, but got {p}")));
    }
    if !x.dtype().is_float() {
        return Err(Error::unsupported_dtype("dropout", x.dtype()));
    }
    Ok(())
}
