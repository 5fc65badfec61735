//! Exported programs (`jax.export`'s role): [`export()`](crate::export())
//! writes a compiled function as a directory that runs without the
//! function's code, [`load`] runs it (Note \[Export\]).
use crate::nn::io::{load_safetensors, save_safetensors};
use crate::tensor::capture::{HostValues, TracedFn};
use crate::tensor::ir::{ParamKind, ResultKind as ProgramResultKind};
use crate::tpu::cache::{hex, sha256_hex};
use crate::tpu::{ArgKind, Compiled, ExportedProgram, Flat, Program, Refusal, ResultKind};
use crate::{DType, Device, DeviceKind, Error, Layout, Result, Tensor};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

// Note [Export]
// ~~~~~~~~~~~~~
// `kiln::export(&mut compiled, &inputs, dir)` traces a function compiled by
// `kiln::compile` on example inputs (the call's effects happen, as for any
// call) and writes a directory from which the function runs with no Rust
// code of its own. On any one device the function is recorded as a kiln
// `Program` (Note [Programs], Note [Recording]) and kiln lowers it
// (`lower::lower_program`), so a CPU trace loads no plugin, and the program
// runs on PJRT devices and in IREE as any other export:
//
// * `program.mlir`: the one-device StableHLO module, MLIR text in the generic
//   op form kiln emits (PJRT plugins and IREE parse it). Arguments and
//   results are flat (1-D) buffers, as every kiln program's are (Note [Views
//   of flat buffers]).
// * `program.mlirbc`: the same program as a StableHLO portable artifact (VHLO
//   in MLIR bytecode, Note [Portable artifacts] in kiln-tpu), which StableHLO
//   promises later versions read; `load` compiles it. A program with no
//   portable form (a custom op's function, MLIR text the op wrote) has
//   none, and the manifest says why.
// * `weights.safetensors`: what the program reads besides the inputs, flat:
//   `state.{k}` (parameters, caches: what they held before the call) and
//   `const.{k}` (the trace's constants), `k` the argument's position.
// * `manifest.json`: the format and kiln versions, the plugin and its
//   StableHLO version, the artifact's target StableHLO version, each argument
//   (input i, state or constant; dtype, shape), each result (computed, the
//   new value of state argument k, state the function creates without
//   reading it (a cache it fills, which the program computes on every call:
//   "discarded"), or a device-side check with its message),
//   each returned tensor (result, shape, strides, offset, dtype), the
//   inputs' shapes and dtypes, the placement (one device), and the SHA-256 of
//   the program, the artifact and the weights.
//
// `export::load(dir, device)` checks the format, the checksums and the
// manifest against the weights, uploads the weights and compiles the
// portable artifact when there is one, else the text (through the compile
// cache). `Exported::call` checks the inputs' shapes and dtypes, runs the
// program, fails on a false check, keeps the new values
// of state the function writes (a KV cache carries over to the next call)
// and returns the tensors. A function that writes its inputs, returns an
// input or state unchanged, or reads an undeclared host value is refused at
// export: the artifact could not reproduce it.

const FORMAT: &str = "kiln-export";
const FORMAT_VERSION: u64 = 1;
const PROGRAM: &str = "program.mlir";
const ARTIFACT: &str = "program.mlirbc";
const WEIGHTS: &str = "weights.safetensors";
const MANIFEST: &str = "manifest.json";
const OP: &str = "export";

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid(OP, msg.into())
}

fn io(path: &Path, e: std::io::Error) -> Error {
    invalid(format!("{}: {e}", path.display()))
}

/// The SHA-256 of a file, read in pieces (weights can be large).
fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|e| io(path, e))?;
    Ok(hex(&h.finalize()))
}

/// Exports `compiled` traced on `inputs` (whole contiguous tensors on its
/// device) to `dir` (created if needed; its three files are replaced), and
/// returns the call's results (Note \[Export\]).
pub fn export<F>(compiled: &mut Compiled<F>, inputs: &[Tensor], dir: impl AsRef<Path>) -> Result<Vec<Tensor>>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let dir = dir.as_ref();
    let on_pjrt = compiled.device().kind() == DeviceKind::Tpu;
    let (program, outs) = compiled.with_function(|f, device, policy| recorded(f, device, policy, inputs))?;
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let ExportedProgram { module, args: program_args, results: program_results, returns } = program;
    let program_text = module.text();
    let mut weights = BTreeMap::new();
    let mut args = vec![];
    for (k, a) in program_args.into_iter().enumerate() {
        // The values move into the weights (no second copy of every parameter).
        let (mut e, value) = match a.kind {
            ArgKind::Input(i) => (json!({"kind": "input", "index": i}), None),
            ArgKind::State(v) => (json!({"kind": "state", "name": format!("state.{k}")}), Some(v)),
            ArgKind::Constant(v) => (json!({"kind": "constant", "name": format!("const.{k}")}), Some(v)),
        };
        if let (Some(v), Some(name)) = (value, e["name"].as_str()) {
            weights.insert(name.to_string(), Tensor::from_host(v, &a.shape, Device::Cpu)?);
        }
        e["dtype"] = json!(a.dtype.to_string());
        e["shape"] = json!(a.shape);
        args.push(e);
    }
    let results: Vec<Value> = program_results
        .iter()
        .map(|r| {
            let mut e = match &r.kind {
                ResultKind::Fresh => json!({"kind": "computed"}),
                ResultKind::UpdatesArg(k) => json!({"kind": "updates", "argument": k}),
                ResultKind::Discarded => json!({"kind": "discarded"}),
                ResultKind::Check(msg) => json!({"kind": "check", "message": msg}),
            };
            e["dtype"] = json!(r.dtype.to_string());
            e["shape"] = json!(r.shape);
            e
        })
        .collect();
    let returns: Vec<Value> = returns
        .iter()
        .map(|(r, l)| {
            json!({"result": r, "shape": l.shape(), "strides": l.strides(), "offset": l.offset(), "dtype": program_results[*r].dtype.to_string()})
        })
        .collect();
    let input_meta: Vec<Value> =
        inputs.iter().map(|t| json!({"shape": t.shape(), "dtype": t.dtype().to_string()})).collect();
    let weights_path = dir.join(WEIGHTS);
    save_safetensors(&weights_path, &weights, None)?;
    let weights_sha = sha256_file(&weights_path)?;
    let (stablehlo, traced_on) = if on_pjrt {
        let backend = crate::tpu::backend()?;
        let client = backend.client();
        let plugin = crate::tpu::pjrt::describe(client.api());
        // The StableHLO version of the plugin that compiled the program (its `stablehlo_current_version`).
        let stablehlo = plugin
            .split(", ")
            .find_map(|kv| kv.strip_prefix("stablehlo_current_version="))
            .unwrap_or("unknown")
            .to_string();
        (
            stablehlo,
            json!({"platform": client.platform(), "platform_version": client.platform_version(), "plugin": plugin}),
        )
    } else {
        let device = compiled.device().to_string();
        (
            "unknown".to_string(),
            json!({"platform": device, "plugin": "none: recorded as a kiln program, lowered by kiln"}),
        )
    };
    // The portable artifact, when every op of the program has a VHLO form.
    let artifact = crate::tpu::portable::serialize(&module);
    let portable = match &artifact {
        Ok(bytes) => json!({
            "file": ARTIFACT,
            "sha256": sha256_hex(bytes),
            "form": "StableHLO portable artifact (VHLO, MLIR bytecode)",
            "stablehlo_target_version": crate::tpu::portable::TARGET,
        }),
        Err(why) => json!({"unavailable": why}),
    };
    let manifest = json!({
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kiln_version": env!("CARGO_PKG_VERSION"),
        "program": {"file": PROGRAM, "sha256": sha256_hex(program_text.as_bytes()), "form": "StableHLO, MLIR text (generic op form)", "stablehlo_version": stablehlo},
        "portable": portable,
        "weights": {"file": WEIGHTS, "sha256": weights_sha},
        "traced_on": traced_on,
        "placement": "one device",
        "inputs": input_meta,
        "arguments": args,
        "results": results,
        "outputs": returns,
    });
    crate::nn::io::write_atomic(&dir.join(PROGRAM), |w| w.write_all(program_text.as_bytes()))?;
    match &artifact {
        Ok(bytes) => crate::nn::io::write_atomic(&dir.join(ARTIFACT), |w| w.write_all(bytes))?,
        // An artifact of an earlier export of another function must not stay beside this one.
        Err(_) => match std::fs::remove_file(dir.join(ARTIFACT)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&dir.join(ARTIFACT), e)),
            _ => {}
        },
    }
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| invalid(e.to_string()))?;
    crate::nn::io::write_atomic(&dir.join(MANIFEST), |w| w.write_all(text.as_bytes()))?;
    Ok(outs)
}

/// [`export()`]'s trace: the function recorded into kiln's program (Note
/// \[Recording\]) on its device, lowered to StableHLO by kiln (so a CPU
/// trace needs no plugin).
fn recorded(
    f: &mut TracedFn<'_>,
    device: Device,
    policy: HostValues,
    inputs: &[Tensor],
) -> Result<(ExportedProgram, Vec<Tensor>)> {
    if let Device::Mesh(_) = device {
        return Err(invalid("programs over device meshes cannot be exported yet"));
    }
    kiln_tpu::check_inputs(device, inputs)?;
    let (t, outs) = crate::tensor::capture::trace_program(f, device, policy, inputs)?;
    if let Some(first) = t.host_values.first() {
        return Err(Refusal::HostValue(first).error());
    }
    let p = &t.program;
    let lowered = kiln_tpu::lower::lower_program(p, kiln_tpu::lower::Constants::Inline)?;
    let flat = |v| {
        let m = p.meta(v);
        (m.dtype, vec![m.shape.iter().product::<usize>()])
    };
    let mut args = vec![];
    for (param, value) in p.params().iter().zip(t.values) {
        let kind = match param.kind {
            ParamKind::Input(i) => ArgKind::Input(i),
            ParamKind::State | ParamKind::Generator => ArgKind::State(value),
            ParamKind::Constant => ArgKind::Constant(value),
        };
        let (dtype, shape) = flat(param.value);
        args.push(Flat { kind, dtype, shape });
    }
    let mut results = vec![];
    for r in p.results() {
        let kind = match &r.kind {
            ProgramResultKind::Fresh => ResultKind::Fresh,
            ProgramResultKind::Update(k) => match p.params()[*k].kind {
                ParamKind::Input(i) => return Err(Refusal::WritesInput(i).error()),
                _ => ResultKind::UpdatesArg(*k),
            },
            ProgramResultKind::State => ResultKind::Discarded,
            ProgramResultKind::Check(msg) => ResultKind::Check(msg.clone()),
        };
        let (dtype, shape) = flat(r.value);
        results.push(Flat { kind, dtype, shape });
    }
    for (c, name) in &lowered.checks {
        results.push(Flat {
            kind: ResultKind::Check(kiln_tpu::check_message(name, c)),
            dtype: DType::Bool,
            shape: vec![],
        });
    }
    let returns = t
        .returns
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.ok_or_else(|| Refusal::ReturnsUnchanged(i).error()))
        .collect::<Result<_>>()?;
    Ok((ExportedProgram { module: lowered.module, args, results, returns }, outs))
}

/// One argument of a loaded program.
enum LoadedArg {
    Input(usize),
    Weight(Tensor),
}

/// A returned tensor: a result viewed through a layout.
struct Output {
    result: usize,
    layout: Layout,
}

/// An exported program loaded on a device (see [`load`]).
pub struct Exported {
    program: Program,
    device: Device,
    args: Vec<LoadedArg>,
    inputs: Vec<(Vec<usize>, DType)>,
    results: Vec<ResultKind>,
    outputs: Vec<Output>,
    manifest: Value,
}

fn field<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a Value> {
    v.get(key).ok_or_else(|| invalid(format!("manifest: {what} has no {key:?}")))
}

fn usize_of(v: &Value, key: &str, what: &str) -> Result<usize> {
    field(v, key, what)?
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| invalid(format!("manifest: {what}'s {key:?} is not a count")))
}

fn str_of<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a str> {
    field(v, key, what)?.as_str().ok_or_else(|| invalid(format!("manifest: {what}'s {key:?} is not a string")))
}

fn dims_of(v: &Value, key: &str, what: &str) -> Result<Vec<usize>> {
    let a =
        field(v, key, what)?.as_array().ok_or_else(|| invalid(format!("manifest: {what}'s {key:?} is not a list")))?;
    a.iter()
        .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| invalid(format!("manifest: {what}'s {key:?} holds something else than counts")))
}

fn dtype_of(v: &Value, what: &str) -> Result<DType> {
    let s = str_of(v, "dtype", what)?;
    DType::from_name(s).ok_or_else(|| invalid(format!("manifest: {what} has an unknown dtype {s:?}")))
}

fn list<'a>(m: &'a Value, key: &str) -> Result<&'a Vec<Value>> {
    field(m, key, "the manifest")?.as_array().ok_or_else(|| invalid(format!("manifest: {key:?} is not a list")))
}

/// The path of the file `entry` names in `dir`.
fn entry_path(dir: &Path, entry: &Value, what: &str) -> Result<std::path::PathBuf> {
    let name = str_of(entry, "file", what)?;
    if name.contains(['/', '\\']) || name == ".." {
        return Err(invalid(format!("manifest: {what} file {name:?} is not a file name in the directory")));
    }
    Ok(dir.join(name))
}

/// Fails unless `digest` is the manifest's SHA-256 for `path`.
fn check_digest(path: &Path, digest: &str, entry: &Value, what: &str) -> Result<()> {
    if digest != str_of(entry, "sha256", what)? {
        return Err(invalid(format!(
            "{} does not match its checksum in the manifest (modified or corrupt)",
            path.display()
        )));
    }
    Ok(())
}

/// The path of the file `entry` names in `dir`, checked against the
/// manifest's SHA-256 reading it in pieces (the weights: read again by
/// their loader).
fn checked_file(dir: &Path, entry: &Value, what: &str) -> Result<std::path::PathBuf> {
    let path = entry_path(dir, entry, what)?;
    check_digest(&path, &sha256_file(&path)?, entry, what)?;
    Ok(path)
}

/// The bytes of the file `entry` names in `dir` (the program, the
/// artifact), read once and checked against the manifest's SHA-256.
fn checked_bytes(dir: &Path, entry: &Value, what: &str) -> Result<Vec<u8>> {
    let path = entry_path(dir, entry, what)?;
    let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
    check_digest(&path, &sha256_hex(&bytes), entry, what)?;
    Ok(bytes)
}

/// Loads an exported program from `dir` onto `device` (a PJRT device),
/// checking the manifest, the files' checksums and the weights against the
/// manifest (Note \[Export\]).
pub fn load(dir: impl AsRef<Path>, device: Device) -> Result<Exported> {
    let dir = dir.as_ref();
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    let m: Value = serde_json::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
    if m.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(invalid(format!("{} is not a kiln export manifest", path.display())));
    }
    let version = usize_of(&m, "format_version", "the manifest")?;
    if version as u64 != FORMAT_VERSION {
        return Err(invalid(format!("export format version {version}; this kiln reads version {FORMAT_VERSION}")));
    }
    let program_bytes = checked_bytes(dir, field(&m, "program", "the manifest")?, "the program")?;
    let program_text = String::from_utf8(program_bytes).map_err(|_| invalid("the program is not UTF-8 text"))?;
    let weights = load_safetensors(checked_file(dir, field(&m, "weights", "the manifest")?, "the weights")?)?;
    let inputs = list(&m, "inputs")?
        .iter()
        .enumerate()
        .map(|(i, v)| Ok((dims_of(v, "shape", &format!("input {i}"))?, dtype_of(v, &format!("input {i}"))?)))
        .collect::<Result<Vec<_>>>()?;
    let mut args = vec![];
    let mut arg_types = vec![];
    for (k, a) in list(&m, "arguments")?.iter().enumerate() {
        let what = format!("argument {k}");
        let (dtype, shape) = (dtype_of(a, &what)?, dims_of(a, "shape", &what)?);
        let len: usize = shape.iter().product();
        arg_types.push((dtype, shape.clone()));
        args.push(match str_of(a, "kind", &what)? {
            "input" => {
                let i = usize_of(a, "index", &what)?;
                let (shape, dt) = inputs
                    .get(i)
                    .ok_or_else(|| invalid(format!("manifest: {what} is input {i}, which is not listed")))?;
                if *dt != dtype || shape.iter().product::<usize>() != len {
                    return Err(invalid(format!("manifest: {what} does not match input {i}")));
                }
                LoadedArg::Input(i)
            }
            "state" | "constant" => {
                let name = str_of(a, "name", &what)?;
                let w = weights.get(name).ok_or_else(|| invalid(format!("the weights have no {name:?} ({what})")))?;
                if w.dtype() != dtype || w.shape() != shape.as_slice() {
                    return Err(invalid(format!(
                        "weight {name:?} is {} {:?}; the manifest says {dtype} {shape:?}",
                        w.dtype(),
                        w.shape()
                    )));
                }
                LoadedArg::Weight(w.to_device(device)?)
            }
            other => return Err(invalid(format!("manifest: {what} has an unknown kind {other:?}"))),
        });
    }
    let mut results = vec![];
    let mut result_types = vec![];
    for (k, r) in list(&m, "results")?.iter().enumerate() {
        let what = format!("result {k}");
        let (dtype, shape) = (dtype_of(r, &what)?, dims_of(r, "shape", &what)?);
        result_types.push((dtype, shape.clone()));
        results.push(match str_of(r, "kind", &what)? {
            "computed" => ResultKind::Fresh,
            "updates" => {
                let a = usize_of(r, "argument", &what)?;
                if !matches!(args.get(a), Some(LoadedArg::Weight(_))) || arg_types[a] != (dtype, shape) {
                    return Err(invalid(format!(
                        "manifest: {what} updates argument {a}, which is no state of its type"
                    )));
                }
                ResultKind::UpdatesArg(a)
            }
            "check" => ResultKind::Check(str_of(r, "message", &what)?.to_string()),
            "discarded" => ResultKind::Discarded,
            other => return Err(invalid(format!("manifest: {what} has an unknown kind {other:?}"))),
        });
    }
    let mut outputs = vec![];
    for (i, o) in list(&m, "outputs")?.iter().enumerate() {
        let what = format!("output {i}");
        let result = usize_of(o, "result", &what)?;
        let layout = Layout::new(
            dims_of(o, "shape", &what)?.into(),
            dims_of(o, "strides", &what)?.into(),
            usize_of(o, "offset", &what)?,
        );
        match results.get(result) {
            Some(ResultKind::Check(_)) | None => {
                return Err(invalid(format!("manifest: {what} is result {result}, which is not a value")))
            }
            Some(_) => layout.check_bounds("export", result_types[result].1.iter().product())?,
        }
        outputs.push(Output { result, layout });
    }
    // The portable artifact when there is one (a later plugin reads it as
    // this one did), else the text.
    let program = match m.get("portable").filter(|p| p.get("file").is_some()) {
        Some(entry) => {
            let bytes = checked_bytes(dir, entry, "the portable artifact")?;
            Program::compile_artifact(device, &bytes, &result_types)?
        }
        None => Program::compile(device, &program_text, &result_types)?,
    };
    Ok(Exported { program, device, args, inputs, results, outputs, manifest: m })
}

impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported").field("device", &self.device).field("inputs", &self.inputs).finish_non_exhaustive()
    }
}

impl Exported {
    /// The manifest (see Note \[Export\]).
    pub fn manifest(&self) -> &Value {
        &self.manifest
    }

    /// The inputs' shapes and dtypes.
    pub fn inputs(&self) -> &[(Vec<usize>, DType)] {
        &self.inputs
    }

    /// Runs the program on `inputs` (any device and layout; moved and made
    /// contiguous as needed), returning the function's outputs; state the
    /// function writes keeps its new value for the next call.
    pub fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        if inputs.len() != self.inputs.len() {
            return Err(invalid(format!(
                "the exported function takes {} inputs, got {}",
                self.inputs.len(),
                inputs.len()
            )));
        }
        let device = self.device;
        let mut flat = vec![];
        for (i, (t, (shape, dtype))) in inputs.iter().zip(&self.inputs).enumerate() {
            if t.shape() != shape.as_slice() || t.dtype() != *dtype {
                return Err(Error::shape(
                    OP,
                    format!(
                        "input {i} is {} {:?}; the exported function takes {dtype} {shape:?}",
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            let f = t.to_device(device)?.reshape(&[t.numel() as isize])?;
            // The program reads the whole storage: a view of a larger one is copied.
            let whole = f.layout().is_contiguous() && f.layout().offset() == 0 && f.storage().len() == f.numel();
            flat.push(if whole { f } else { f.deep_clone()? });
        }
        let args: Vec<&Tensor> = self
            .args
            .iter()
            .map(|a| match a {
                LoadedArg::Input(i) => &flat[*i],
                LoadedArg::Weight(w) => w,
            })
            .collect();
        let outs = self.program.run(&args)?;
        for (r, o) in self.results.iter().zip(&outs) {
            if let ResultKind::Check(msg) = r {
                if !o.to_vec::<bool>()?.first().copied().unwrap_or(false) {
                    return Err(invalid(msg.clone()));
                }
            }
        }
        for (r, o) in self.results.iter().zip(&outs) {
            if let ResultKind::UpdatesArg(a) = r {
                self.args[*a] = LoadedArg::Weight(o.clone());
            }
        }
        self.outputs.iter().map(|o| Tensor::from_storage(outs[o.result].storage().clone(), o.layout.clone())).collect()
    }
}
