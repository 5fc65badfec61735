//! What `kiln::export` needs of the backend (Note \[Export\] in the facade's
//! `export.rs`): the form of an exported program (the meaning of each of its
//! arguments and results), what export refuses, and programs loaded back
//! from their text or artifact.
use crate::buffer::PjrtBuffer;
use crate::pjrt::CompileOptions;
use crate::stablehlo::Module;
use kiln_tensor::{DType, Device, Error, HostBuffer, Layout, Result, Storage, StorageData, Tensor};
use std::sync::Arc;

/// What an argument of an exported program is.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgKind {
    /// Input `usize` of the function (its whole, contiguous storage).
    Input(usize),
    /// State the function reads (a parameter, a cache): its value when traced.
    State(HostBuffer),
    /// A constant of the trace.
    Constant(HostBuffer),
}

/// What a result of an exported program is.
#[derive(Debug, Clone, PartialEq)]
pub enum ResultKind {
    /// A value the function computes (see [`ExportedProgram::returns`] for
    /// the returned ones).
    Fresh,
    /// The new value of state argument `usize`, which the function writes in place.
    UpdatesArg(usize),
    /// State the function creates without reading it (a cache it fills): the
    /// program computes it on every call, so its value is not kept.
    Discarded,
    /// A device-side check (a bool): false fails the call with this message.
    Check(String),
}

/// An argument or result (flat: 1-D, or a scalar): its kind, dtype and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Flat<K> {
    pub kind: K,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// A function traced for export: its one-device StableHLO program, whose
/// arguments and results are flat (1-D) buffers, and the function's returned
/// tensors as views of the results.
#[derive(Debug, Clone)]
pub struct ExportedProgram {
    pub module: Module,
    pub args: Vec<Flat<ArgKind>>,
    pub results: Vec<Flat<ResultKind>>,
    /// Returned tensor `i` is result `returns[i].0` viewed through `returns[i].1`.
    pub returns: Vec<(usize, Layout)>,
}

const EXPORT: &str = "export";

/// Export takes whole contiguous tensors on the traced device.
pub fn check_inputs(device: Device, inputs: &[Tensor]) -> Result<()> {
    for (i, t) in inputs.iter().enumerate() {
        if t.device() != device {
            return Err(Error::device(EXPORT, format!("input {i} is on {}, not {device}", t.device())));
        }
        if !t.is_whole_storage() {
            return Err(Error::invalid(
                EXPORT,
                format!("input {i} is a view; export takes whole contiguous tensors (call .contiguous() on a copy)"),
            ));
        }
    }
    Ok(())
}

/// What an export refuses: a function the artifact could not reproduce.
pub enum Refusal<'a> {
    /// A host value of the function's own code (its description).
    HostValue(&'a str),
    /// A write into input `usize` in place.
    WritesInput(usize),
    /// Returned tensor `usize` is an input or state, not a computed value.
    ReturnsUnchanged(usize),
}

impl Refusal<'_> {
    /// The error saying why and what to do.
    pub fn error(&self) -> Error {
        Error::invalid(
            EXPORT,
            match self {
                Refusal::HostValue(first) => format!("the function reads a host value of its own code ({first}), which an exported program would freeze; declare it with kiln::constant or pass it as an input"),
                Refusal::WritesInput(k) => format!("the function writes its input {k} in place; an exported function returns its results"),
                Refusal::ReturnsUnchanged(i) => format!("output {i} of the function is one of its inputs or state, not a value it computes; return a computed value (a copy)"),
            },
        )
    }
}

/// A program loaded back from its text (an exported one), compiled for one
/// device; it runs on flat tensors and returns flat tensors.
pub struct Program {
    exe: Arc<crate::pjrt::Executable>,
    device: Device,
    results: Vec<(DType, Vec<usize>)>,
}

impl Program {
    /// Compiles `text` (through the compile cache) for `device`; `results`
    /// are the dtype and shape of each result.
    pub fn compile(device: Device, text: &str, results: &[(DType, Vec<usize>)]) -> Result<Program> {
        Self::on(device, results, |backend| backend.executable_of_text(text, &CompileOptions::single()))
    }

    /// [`Program::compile`] of a StableHLO portable artifact (MLIR bytecode,
    /// see [`crate::portable`]) instead of text.
    pub fn compile_artifact(device: Device, bytes: &[u8], results: &[(DType, Vec<usize>)]) -> Result<Program> {
        Self::on(device, results, |backend| backend.executable_of_artifact(bytes))
    }

    fn on(
        device: Device,
        results: &[(DType, Vec<usize>)],
        exe: impl FnOnce(&crate::PjrtBackend) -> Result<Arc<crate::pjrt::Executable>>,
    ) -> Result<Program> {
        let backend = crate::backend()?;
        if !matches!(device, Device::Tpu(_)) {
            return Err(Error::device(EXPORT, format!("exported programs run on PJRT devices, not {device}")));
        }
        Ok(Program { exe: exe(backend)?, device, results: results.to_vec() })
    }

    /// Runs the program on `args` (whole flat tensors on the program's
    /// device, of its argument types); nothing is donated.
    pub fn run(&self, args: &[&Tensor]) -> Result<Vec<Tensor>> {
        let backend = crate::backend()?;
        let mut bufs = vec![];
        for (i, t) in args.iter().enumerate() {
            if t.device() != self.device {
                return Err(Error::device(EXPORT, format!("argument {i} is on {}, not {}", t.device(), self.device)));
            }
            if !t.is_whole_storage() {
                return Err(Error::invalid(EXPORT, format!("argument {i} is not a whole contiguous tensor")));
            }
            bufs.push(backend.buffer_of(t)?);
        }
        let refs: Vec<&crate::pjrt::Buffer> = bufs.iter().map(|b| &**b).collect();
        let keep: Vec<i64> = (0..refs.len() as i64).collect();
        let (outs, event) = self.exe.execute_with(&refs, self.device.index(), &self.results, &keep)?;
        backend.count_execution();
        backend.queue_event("an exported program", event)?;
        for (i, b) in outs.iter().enumerate() {
            b.check_described().map_err(|e| {
                Error::invalid(EXPORT, format!("result {i} of the program does not match the manifest: {e}"))
            })?;
        }
        outs.into_iter()
            .zip(&self.results)
            .map(|(b, (dtype, shape))| {
                let data = StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(b))));
                let st = Storage::new(data, *dtype, shape.iter().product(), self.device);
                Tensor::from_storage(Arc::new(st), Layout::contiguous(shape))
            })
            .collect()
    }
}
