//! What a trace records of the host values entering a traced function's
//! program, and the policy for those the function's own code made (see Note
//! \[Host values\] in `trace.rs`).
use crate::{Error, Op, Result};

/// What a compiled function does with host values of its own code: scalar
/// operands and creation values (`x * scale`, `Tensor::full(.., v, ..)`) and
/// host data uploaded inside it, made outside `kiln::constant` and not read
/// through a `kiln::HostScalar` (see Note \[Host values\]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostValues {
    /// Trace the function on every call, never replaying it (the default):
    /// each call's values reach the program. The program itself is compiled
    /// once, since creation values are its arguments; the tracing costs the
    /// function's host time on every call. `CaptureStats::last_host_value`
    /// names the first such value.
    #[default]
    Retrace,
    /// Fail the trace with an error naming the op and the value.
    Refuse,
    /// Treat them all as constants (JAX's semantics for values a jitted
    /// function closes over): the caller promises they never change, and
    /// replays reuse the traced values.
    Constant,
}

/// The host values a trace saw.
#[derive(Debug, Default)]
pub struct HostLog {
    pub policy: HostValues,
    /// Descriptions of the undeclared host values that entered the program.
    pub undeclared: Vec<String>,
    /// Buffers uploaded while tracing: address, whether declared constant, description.
    pub uploads: Vec<(usize, bool, String)>,
}

fn refused(what: &str) -> Error {
    Error::invalid(
        "compile",
        format!(
            "{what} inside a function traced by kiln::compile would be frozen into its program (a replay does not run the function), and the function refuses host values (HostValues::Refuse); pass it as an input tensor, keep it on the device, read it through a kiln::HostScalar, or declare it constant with kiln::constant(|| ...)"
        ),
    )
}

impl HostLog {
    pub fn new(policy: HostValues) -> HostLog {
        HostLog { policy, ..Default::default() }
    }

    /// A creation value (`what` describes it) entered the program.
    pub fn value(&mut self, declared: bool, what: impl FnOnce() -> String) -> Result<()> {
        if declared || self.policy == HostValues::Constant {
            return Ok(());
        }
        let what = what();
        if self.policy == HostValues::Refuse {
            return Err(refused(&what));
        }
        self.undeclared.push(what);
        Ok(())
    }

    /// Host data was uploaded to the device (into the buffer at `addr`).
    pub fn upload(&mut self, addr: usize, declared: bool, what: String) {
        self.uploads.push((addr, declared || self.policy == HostValues::Constant, what));
    }

    /// A buffer the program reads that no storage holds after the trace: an
    /// upload made while tracing, or a tensor dropped during it. Returns an
    /// error under `Refuse` for one that is not a declared constant.
    pub fn orphan(&mut self, addr: usize) -> Result<()> {
        let (declared, what) = match self.uploads.iter().find(|u| u.0 == addr) {
            Some((_, d, w)) => (*d, w.clone()),
            None => (
                self.policy == HostValues::Constant,
                "a tensor that existed before the call and was dropped inside it".to_string(),
            ),
        };
        self.value(declared, || what)
    }
}

/// What a creation op's value is, for the messages about host values.
pub fn describe_creation(op: &Op) -> String {
    let user = crate::trace::current_scalar_use().unwrap_or(op.name());
    match op {
        Op::Full { value, dtype, .. } => format!("{user}: the host scalar {} ({dtype})", value.to_f64()),
        Op::Arange { start, step, .. } => format!("{user}: the host values start {start} and step {step}"),
        _ => format!("{user}: a host value"),
    }
}
