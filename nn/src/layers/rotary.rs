//! Rotary position embeddings (RoPE) in the `rotate_half` convention of
//! Hugging Face Llama/Qwen, with the `default`, `linear` and `llama3`
//! frequency schemes.
use kiln_tensor::{DType, Device, Error, Result, Tensor};

/// How the rotary frequencies are derived from `rope_theta` (Hugging Face's
/// `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Position interpolation: the default frequencies divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's scheme: long wavelengths divided by `factor`, short ones
    /// kept, the band between interpolated smoothly.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was first trained with.
        original_max_position_embeddings: usize,
    },
}

/// The cosine and sine tables for a run of positions, in the compute
/// dtype: `cos` and `sin` are `[T, head_dim]` (see [`RotaryEmbedding::apply`]).
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `cos(pos * inv_freq)`, the half-dim frequencies repeated twice: `[T, d]`.
    pub cos: Tensor,
    /// `sin(pos * inv_freq)`, likewise: `[T, d]`.
    pub sin: Tensor,
}

/// Rotary embeddings: `x * cos + rotate_half(x) * sin` on the last dim of
/// queries and keys, with `rotate_half(x) = cat(-x[d/2:], x[:d/2])`.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::{RotaryEmbedding, RopeScaling};
/// let rope = RotaryEmbedding::new(4, 10000.0, &RopeScaling::Default)?;
/// let t = rope.tables(0, 3, DType::F32, Device::Cpu)?;
/// let q = Tensor::ones(&[1, 1, 3, 4], DType::F32)?;
/// let r = rope.apply(&q, &t)?;
/// // position 0 is not rotated
/// assert_eq!(r.select(2, 0)?.to_vec::<f32>()?, vec![1.0; 4]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl RotaryEmbedding {
    /// Frequencies for `head_dim` (even) with base `theta`, computed in float32
    /// as transformers computes them.
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Result<RotaryEmbedding> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::invalid(
                "RotaryEmbedding",
                format!("head_dim must be even and positive, got {head_dim}"),
            ));
        }
        kiln_tensor::alloc::reserve("RotaryEmbedding", &[head_dim / 2], DType::F32)?;
        // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all in float32.
        let base = theta as f32;
        let default: Vec<f32> =
            (0..head_dim / 2).map(|i| 1.0f32 / base.powf((2 * i) as f32 / head_dim as f32)).collect();
        let inv_freq = match scaling {
            RopeScaling::Default => default,
            RopeScaling::Linear { factor } => default.iter().map(|f| f / *factor as f32).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                llama3_inv_freq(
                    &default,
                    *factor,
                    *low_freq_factor,
                    *high_freq_factor,
                    *original_max_position_embeddings,
                )?
            }
        };
        Ok(RotaryEmbedding { inv_freq, head_dim })
    }

    /// The inverse frequencies (`head_dim / 2` of them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rounds the inverse frequencies through `dtype` (bf16, f16) and back, as
    /// PyTorch's `module.to(dtype)` rounds transformers' `inv_freq` buffer. kiln
    /// keeps them in float32 (as transformers' `from_pretrained(dtype=...)`
    /// does); this reproduces the outputs of a model that was cast with `.to()`.
    pub fn round_inv_freq(&mut self, dtype: DType) {
        let round: fn(f32) -> f32 = match dtype {
            DType::BF16 => |x| kiln_tensor::half::bf16::from_f32(x).to_f32(),
            DType::F16 => |x| kiln_tensor::half::f16::from_f32(x).to_f32(),
            _ => |x| x,
        };
        for f in &mut self.inv_freq {
            *f = round(*f);
        }
    }

    /// The rotated dim.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The tables for positions `start .. start + len`, in `dtype` on `device`.
    /// Angles are `pos * inv_freq` in float32 (as transformers computes them).
    pub fn tables(&self, start: usize, len: usize, dtype: DType, device: Device) -> Result<RopeTables> {
        self.tables_at(start..start + len, dtype, device)
    }

    /// The tables for any positions, one row each in order (the packed
    /// sequences of a serving step): row `i` is the row [`Self::tables`]
    /// gives position `positions[i]`, bit for bit.
    pub fn tables_at(
        &self,
        positions: impl ExactSizeIterator<Item = usize>,
        dtype: DType,
        device: Device,
    ) -> Result<RopeTables> {
        let (d, h, len) = (self.head_dim, self.head_dim / 2, positions.len());
        let mut cos = Vec::with_capacity(len * d);
        let mut sin = Vec::with_capacity(len * d);
        let mut c_row = vec![0f32; h];
        let mut s_row = vec![0f32; h];
        for p in positions {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let angle = (p as f32 * f) as f64;
                c_row[i] = angle.cos() as f32;
                s_row[i] = angle.sin() as f32;
            }
            cos.extend_from_slice(&c_row);
            cos.extend_from_slice(&c_row);
            sin.extend_from_slice(&s_row);
            sin.extend_from_slice(&s_row);
        }
        let to = |v: Vec<f32>| -> Result<Tensor> { Tensor::from_vec(v, &[len, d])?.to_dtype(dtype)?.to_device(device) };
        Ok(RopeTables { cos: to(cos)?, sin: to(sin)? })
    }

    /// Rotates `x: [..., T, head_dim]` with tables for its `T` positions (see [`RopeTables::apply`]).
    pub fn apply(&self, x: &Tensor, t: &RopeTables) -> Result<Tensor> {
        t.apply(x)
    }
}

impl RopeTables {
    /// Rotates `x: [..., T, d]` (`T` and `d` those of the tables):
    /// `x * cos + rotate_half(x) * sin`, fused ([`Tensor::rotary_embedding`]) with
    /// the rounding of the unfused expression.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (len, d) = (self.cos.shape()[0], self.cos.shape()[1]);
        let n = x.ndim();
        if n < 2 || x.shape()[n - 1] != d || x.shape()[n - 2] != len {
            return Err(Error::shape(
                "rotary",
                format!("expected [..., {len}, {d}] for tables of {len} positions, got {:?}", x.shape()),
            ));
        }
        x.rotary_embedding(&self.cos, &self.sin)
    }
}

/// transformers' `rotate_half`: `cat(-x[..., d/2:], x[..., :d/2])`.
pub fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim_size(-1)?;
    let h = d / 2;
    Tensor::cat(&[&x.narrow(-1, h as isize, d - h)?.neg()?, &x.narrow(-1, 0, h)?], -1)
}

/// transformers' `_compute_llama3_parameters`, step for step in float32.
fn llama3_inv_freq(inv: &[f32], factor: f64, low: f64, high: f64, original: usize) -> Result<Vec<f32>> {
    if high == low {
        return Err(Error::invalid("RotaryEmbedding", "llama3 rope scaling needs high_freq_factor != low_freq_factor"));
    }
    let (factor, low, high, old) = (factor as f32, low as f32, high as f32, original as f32);
    let low_wavelen = old / low;
    let high_wavelen = old / high;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    Ok(inv
        .iter()
        .map(|&f| {
            let wavelen = two_pi / f;
            let scaled = if wavelen > low_wavelen { f / factor } else { f };
            let smooth = (old / wavelen - low) / (high - low);
            let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            if medium {
                smoothed
            } else {
                scaled
            }
        })
        .collect())
}
