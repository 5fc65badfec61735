//! Reading and writing checkpoints.
