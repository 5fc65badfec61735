//! What a function traced by `kiln::compile` may take from the host: declared
//! constants ([`constant`]), and watched values ([`Watch`], [`HostScalar`])
//! whose changes make the next call trace again (see Note [Host values]).
//! The tensor crate only marks and records; the PJRT backend's capture
//! classifies what enters a program by these marks.
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// Note [Host values]
// ~~~~~~~~~~~~~~~~~~
// A replay of a captured function does not run the function: it runs the
// program the trace recorded. Whatever the program took from the host while
// tracing is therefore frozen into it: a scalar operand (`x * scale`, a
// `full`'s fill value, `arange`'s bounds: the creation ops' values) and data
// uploaded inside the function (a host tensor moved to the device). If the
// function would compute such a value differently on a later call, a replay
// returns a stale result without a word. So every host value entering a
// traced program is classified when it enters:
//
// - declared constant: created inside a constant scope (`kiln::constant(||
//   ...)`). kiln's own layers, models, losses, optimizers and the autograd
//   engine create theirs in such a scope: their values are settings of kiln
//   objects (a layer's eps, AdamW's betas) or literals, and the settings that
//   can change between calls (training mode, a dropout probability, an
//   optimizer's parameter groups) are watched (below);
// - watched: a value read through a `Watch` / `HostScalar` while tracing. The
//   trace records each watch and the value it read; a call whose watches hold
//   other values traces again (with the reason logged and counted) instead of
//   replaying;
// - anything else is a host value of the function's own code. What a compiled
//   function does with those is its `HostValues` policy (`capture::HostValues`):
//   by default such a function is traced on every call and never replayed
//   (correct: each call's values reach the program, whose compiled form is
//   cached, since creation values are program arguments); it can refuse them
//   with an error naming the op, or treat them all as constants (JAX's
//   semantics, where the user promises they never change).
//
// What the classification cannot see is the function's control flow and the
// arguments baked into its program text (shapes, dims, an eps passed to an
// op): they must depend only on the inputs' shapes (guarded) and on kiln's
// settings. `Compiled::verify(true)` traces every call and compares, to check
// a function against this rule.

thread_local! {
    static CONSTANT_DEPTH: Cell<usize> = const { Cell::new(0) };
    static SCALAR_USE: Cell<Option<&'static str>> = const { Cell::new(None) };
    static WATCHED: RefCell<Option<Vec<WatchRead>>> = const { RefCell::new(None) };
}

/// Runs `f` with every host value it creates declared constant for
/// `kiln::compile`: a replay of the traced program reuses them as they were
/// when traced (see Note [Host values] in `trace.rs`). Outside a traced
/// function this changes nothing.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::ones(&[2], DType::F32)?;
/// // Inside a compiled function: `0.5` never changes, so the trace may reuse it.
/// let y = kiln::constant(|| x.mul(0.5))?;
/// assert_eq!(y.to_vec::<f32>()?, vec![0.5, 0.5]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn constant<R>(f: impl FnOnce() -> R) -> R {
    let _scope = ConstantScope::enter();
    f()
}

/// An RAII constant scope (what [`constant`] enters): kiln's own library code
/// holds one while it creates the scalars and tables of its layers, losses and
/// optimizers.
#[must_use = "the scope ends when this value is dropped"]
pub struct ConstantScope(());

impl ConstantScope {
    /// Enters a constant scope until the returned value is dropped.
    pub fn enter() -> ConstantScope {
        CONSTANT_DEPTH.with(|d| d.set(d.get() + 1));
        ConstantScope(())
    }
}

impl Drop for ConstantScope {
    fn drop(&mut self) {
        CONSTANT_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Whether the current thread is inside a constant scope.
pub fn in_constant_scope() -> bool {
    CONSTANT_DEPTH.with(|d| d.get() > 0)
}

/// Runs `f` naming `op` as the consumer of the scalars it materialises (for
/// the messages about host values).
pub(crate) fn scalar_use<R>(op: &'static str, f: impl FnOnce() -> R) -> R {
    let prev = SCALAR_USE.with(|s| s.replace(Some(op)));
    let r = f();
    SCALAR_USE.with(|s| s.set(prev));
    r
}

/// The op whose scalar operand is being materialised, if any.
pub fn current_scalar_use() -> Option<&'static str> {
    SCALAR_USE.with(|s| s.get())
}

/// A 64-bit host value that traced functions watch: reading it (`get`) while
/// tracing records it, and a later call of the compiled function finding
/// another value traces again instead of replaying. kiln's modules and
/// optimizers keep their changeable settings in watches.
#[derive(Debug, Clone)]
pub struct Watch {
    cell: Arc<AtomicU64>,
    name: Arc<str>,
}

impl Watch {
    /// A watch named `name` (for messages) holding `value`.
    pub fn new(name: &str, value: u64) -> Watch {
        Watch { cell: Arc::new(AtomicU64::new(value)), name: name.into() }
    }
    /// Sets the value.
    pub fn set(&self, value: u64) {
        self.cell.store(value, Ordering::SeqCst);
    }
    /// Adds one to the value (a generation count).
    pub fn bump(&self) {
        self.cell.fetch_add(1, Ordering::SeqCst);
    }
    /// The value; while tracing, the trace records that it depends on it.
    pub fn get(&self) -> u64 {
        let v = self.cell.load(Ordering::SeqCst);
        WATCHED.with(|w| {
            if let Some(list) = w.borrow_mut().as_mut() {
                if !list.iter().any(|r| Arc::ptr_eq(&r.cell, &self.cell)) {
                    list.push(WatchRead { cell: self.cell.clone(), value: v, name: self.name.to_string() });
                }
            }
        });
        v
    }
    /// The value, without recording it.
    pub fn peek(&self) -> u64 {
        self.cell.load(Ordering::SeqCst)
    }
}

/// One watch a trace read, and the value it saw.
#[derive(Debug, Clone)]
pub struct WatchRead {
    cell: Arc<AtomicU64>,
    /// The value when traced.
    pub value: u64,
    /// The watch's name.
    pub name: String,
}

impl WatchRead {
    /// The watch's value now.
    pub fn current(&self) -> u64 {
        self.cell.load(Ordering::SeqCst)
    }
}

/// Starts recording the watches read on this thread (a trace begins).
pub fn begin_watching() {
    WATCHED.with(|w| *w.borrow_mut() = Some(vec![]));
}

/// Whether this thread is tracing a function (between [`begin_watching`] and
/// [`end_watching`]): its tensors hold no data yet.
pub fn is_tracing() -> bool {
    WATCHED.with(|w| w.borrow().is_some())
}

/// Stops recording and returns the watches read since [`begin_watching`].
pub fn end_watching() -> Vec<WatchRead> {
    WATCHED.with(|w| w.borrow_mut().take()).unwrap_or_default()
}

/// A float on the host that a compiled function may read and the program
/// around it may change between calls (a learning rate, a temperature, a
/// loss scale): used as an operand (`x.mul(&scale)`), it enters the program
/// as a declared constant and the trace watches it, so after
/// `scale.set(3.0)` the next call traces again instead of replaying the old
/// value (see Note [Host values] in `trace.rs`). Clones share the value.
///
/// ```
/// use kiln::prelude::*;
/// let scale = kiln::HostScalar::new("scale", 1.0);
/// let x = Tensor::ones(&[2], DType::F32)?;
/// scale.set(3.0);
/// assert_eq!(x.mul(&scale)?.to_vec::<f32>()?, vec![3.0, 3.0]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct HostScalar(Watch);

impl HostScalar {
    /// A value named `name` (for messages).
    pub fn new(name: &str, value: f64) -> HostScalar {
        HostScalar(Watch::new(name, value.to_bits()))
    }
    /// The value; while tracing, the trace records that it depends on it.
    /// Using the returned `f64` in an op makes it a host value of the caller:
    /// use the `HostScalar` itself as the operand, or `kiln::constant`.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.get())
    }
    /// Changes the value; compiled functions that read it trace again on their next call.
    pub fn set(&self, value: f64) {
        self.0.set(value.to_bits());
    }
}
