//! A tape: the part of recording shared by capture's recorder (Note
//! \[Recording\]) and deferred programs (Note \[Deferred programs\]): a
//! [`Program`] being built, and what each storage it met holds in it.
use crate::ir::{ParamKind, Program, Value};
use crate::{Layout, Meta, Op, Result, Storage, Tensor, ViewOp};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// A storage the tape knows: the storage and its current value.
pub(crate) struct Known {
    pub storage: Weak<Storage>,
    pub value: Value,
    /// Whether the program made or wrote this storage (so it may be a result).
    pub written: bool,
    /// The storage's version when its data became a parameter: a write the
    /// tape did not record (an eager one) makes the parameter stale.
    pub version: u64,
}

/// A program being recorded over storages. Storages are tracked by identity:
/// the first time an op reads a storage the tape has not seen, its whole
/// content becomes a parameter; an op's outputs become the current values of
/// their storages, and a write makes the written storage's next value.
#[derive(Default)]
pub(crate) struct Tape {
    pub program: Program,
    /// Each parameter's source: the storage whose data the program reads.
    pub sources: Vec<Arc<Storage>>,
    /// Storages by address.
    pub known: HashMap<usize, Known>,
}

impl Tape {
    /// The current value of `st`'s whole content, when the tape knows it.
    pub fn current(&self, st: &Arc<Storage>) -> Option<Value> {
        let k = self.known.get(&st.addr())?;
        // An entry of a storage dropped since is not this one at its address,
        // and a parameter the storage was written over since is not its value.
        let same = std::ptr::eq(k.storage.as_ptr(), Arc::as_ptr(st)) && k.storage.strong_count() > 0;
        (same && (k.written || k.version == st.version())).then_some(k.value)
    }

    /// The current value of a storage's whole content: a new parameter the
    /// first time, read from the storage `source` gives.
    pub fn storage_value(
        &mut self,
        st: &Arc<Storage>,
        source: impl FnOnce(&Arc<Storage>) -> Result<Arc<Storage>>,
    ) -> Result<Value> {
        if let Some(v) = self.current(st) {
            return Ok(v);
        }
        // Read before the data: a write in between leaves the entry stale, never wrong.
        let version = st.version();
        let src = source(st)?;
        let v = self.program.add_param(ParamKind::State, Meta::new(&[st.len()], st.dtype()));
        self.sources.push(src);
        self.known.insert(st.addr(), Known { storage: Arc::downgrade(st), value: v, written: false, version });
        Ok(v)
    }

    /// The value of `t` as it reads its storage: the storage's value, or a view of it.
    pub fn read(&mut self, t: &Tensor, source: impl FnOnce(&Arc<Storage>) -> Result<Arc<Storage>>) -> Result<Value> {
        let base = self.storage_value(t.storage(), source)?;
        let l = t.layout();
        let whole = t.is_whole_storage();
        if whole && self.program.meta(base).shape[..] == l.shape()[..] {
            return Ok(base);
        }
        let view = if whole {
            ViewOp::Reshape(l.shape().into())
        } else {
            ViewOp::AsStrided { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() }
        };
        Ok(self.program.push(Op::View(view), &[base])?[0])
    }

    /// Records `op` on `args` with outputs `outs`, the values of `storages`.
    pub fn op(&mut self, op: &Op, args: &[Value], outs: &[Meta], storages: &[Arc<Storage>]) -> Result<()> {
        let values = self.program.push_typed(op.clone(), args, outs.iter().cloned().collect())?;
        for (st, v) in storages.iter().zip(values) {
            self.define(st, v);
        }
        Ok(())
    }

    /// Records the write of the value `src` into the memory `dst` views: the
    /// storage's next value (its current one, or a new parameter read from
    /// the storage `source` gives, with the write applied).
    pub fn assign(
        &mut self,
        dst: &Tensor,
        src: Value,
        source: impl FnOnce(&Arc<Storage>) -> Result<Arc<Storage>>,
    ) -> Result<()> {
        let base = self.storage_value(dst.storage(), source)?;
        let l = dst.layout();
        let op = Op::Assign { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() };
        let v = self.program.push(op, &[base, src])?[0];
        self.define(dst.storage(), v);
        Ok(())
    }

    fn define(&mut self, st: &Arc<Storage>, value: Value) {
        self.known.insert(st.addr(), Known { storage: Arc::downgrade(st), value, written: true, version: 0 });
    }
}

/// A layout reading the whole of a storage of `len` elements as `[len]`.
pub(crate) fn flat(len: usize) -> Layout {
    Layout::contiguous(&[len])
}
