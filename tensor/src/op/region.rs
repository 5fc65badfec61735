//! The payload of `Op::LocalMap`: a local region (Note \[Local regions\] in
//! `collective.rs`) as one primitive of a program over a mesh, so that a
//! function traced by `kiln::compile` on a mesh holds its regions. The body
//! is a program recorded once on stand-ins for one device's blocks; it is
//! held behind [`RegionBody`] (programs are built from primitives, so the
//! primitive cannot name them) and the backend that lowers the region takes
//! it back with `as_any`.
use super::placement::Placement;
use crate::{Error, Meta, Result};
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A region's body: a program (`ir::Program` implements this).
pub trait RegionBody: fmt::Debug + Send + Sync {
    /// The body's text, which identifies it (printing, `same_as`, `cse`).
    fn text(&self) -> String;
    fn as_any(&self) -> &dyn Any;
}

/// A local region: `body` runs on every device of the mesh device
/// `device`, each on its blocks of the inputs (placed with
/// `in_placements`), its results' blocks making outputs placed with
/// `out_placements`.
#[derive(Debug, Clone)]
pub struct LocalRegion {
    /// The mesh device (`Device::Mesh(device)`): the region runs over its whole mesh.
    pub device: usize,
    /// The inputs' types (whole tensors) and placements.
    pub ins: Vec<Meta>,
    pub in_placements: Vec<Vec<Placement>>,
    /// The outputs' types (whole tensors) and placements.
    pub outs: Vec<Meta>,
    pub out_placements: Vec<Vec<Placement>>,
    /// Whether the body has ops that fail on some values (`Op::fails_on_data`).
    pub checks: bool,
    pub body: Arc<dyn RegionBody>,
    /// The body's text, kept for identity.
    pub text: Arc<str>,
}

impl PartialEq for LocalRegion {
    fn eq(&self, other: &LocalRegion) -> bool {
        self.device == other.device
            && self.ins == other.ins
            && self.in_placements == other.in_placements
            && self.outs == other.outs
            && self.out_placements == other.out_placements
            && self.text == other.text
    }
}

impl LocalRegion {
    /// The outputs' types, once the inputs are the ones the region was recorded for.
    pub fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        if self.in_placements.len() != self.ins.len() || self.out_placements.len() != self.outs.len() {
            return Err(Error::invalid(
                "local_map",
                format!(
                    "a region of {} inputs and {} outputs needs as many lists of placements, got {} and {}",
                    self.ins.len(),
                    self.outs.len(),
                    self.in_placements.len(),
                    self.out_placements.len()
                ),
            ));
        }
        if inputs != self.ins.as_slice() {
            let fmt =
                |ms: &[Meta]| ms.iter().map(|m| format!("{:?} {}", m.shape.as_slice(), m.dtype)).collect::<Vec<_>>();
            return Err(Error::invalid(
                "local_map",
                format!("the region was recorded for inputs {:?}, not {:?}", fmt(&self.ins), fmt(inputs)),
            ));
        }
        Ok(self.outs.clone())
    }
}
