//! Indexing: `x.i((.., 1..3))`, gather, scatter, index_select, index_add,
//! masked_select, index_put_.

/// One item of an index expression (see `Tensor::i`).
#[derive(Debug, Clone)]
pub enum IndexItem {}

/// Types usable as an index expression.
pub trait TensorIndex {}
