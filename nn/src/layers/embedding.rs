//! `Embedding`: a lookup table of rows, indexed by integer ids.
use super::normal_param;
use crate::module::Module;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{Error, Result, Tensor, TensorOptions};

/// A lookup table (`torch.nn.Embedding`): `weight` is `[num_embeddings, dim]`
/// and `forward(ids)` returns `weight[ids]` with shape `ids.shape + [dim]`.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::Embedding;
/// let emb = Embedding::new(10, 4, DType::F32)?;
/// let out = emb.forward(&Tensor::new([[1i64, 2, 3]])?)?;
/// assert_eq!(out.shape(), &[1, 3, 4]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table initialised like PyTorch's: `N(0, 1)` from the global generator.
    pub fn new(num_embeddings: usize, dim: usize, opts: impl Into<TensorOptions>) -> Result<Embedding> {
        Embedding::new_normal(num_embeddings, dim, 1.0, opts)
    }

    /// A table drawn from `N(0, std²)`.
    pub fn new_normal(
        num_embeddings: usize,
        dim: usize,
        std: f64,
        opts: impl Into<TensorOptions>,
    ) -> Result<Embedding> {
        Ok(Embedding { weight: normal_param(&[num_embeddings, dim], std, opts.into())? })
    }

    /// A table around an existing `[num_embeddings, dim]` tensor.
    pub fn from_weight(weight: Tensor) -> Result<Embedding> {
        if weight.ndim() != 2 {
            return Err(Error::shape("Embedding", format!("weight must be 2-D, got shape {:?}", weight.shape())));
        }
        Ok(Embedding { weight })
    }

    /// `num_embeddings`.
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `embedding_dim`.
    pub fn embedding_dim(&self) -> usize {
        self.weight.shape()[1]
    }

    /// The rows at `ids` (an integer tensor of any shape).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        Tensor::embedding(&self.weight, ids)
    }
}
