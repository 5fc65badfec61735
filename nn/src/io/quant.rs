//! Quantized Hugging Face checkpoints: transformers' FP8 block format
//! (`quant_method: "fp8"`, DeepSeek-V3 / Qwen3-FP8), compressed-tensors FP8
//! (tensor, channel, block), MXFP4 and NVFP4, and NVIDIA ModelOpt NVFP4 / FP8.
//! [`QuantizationConfig::from_dir`] reads which method a directory uses;
//! [`load_quantized`] reads its weights, each quantized Linear as a
//! [`QuantizedWeight`] (codes and scales, Note [Quantized weights] in
//! kiln-tensor) and everything else as stored.
//!
// Note [Reading quantized checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The config names the method; the tensors of each module name its format:
//
// | tensors of module X                                   | format                 |
// |-------------------------------------------------------|------------------------|
// | X.weight F8_E4M3, X.weight_scale_inv                  | FP8 block (fp8)        |
// | X.weight F8_E4M3, X.weight_scale                      | FP8 tensor/channel/block (compressed-tensors, ModelOpt FP8) |
// | X.weight_packed U8, X.weight_scale U8 / F8_E8M0       | MXFP4 (E8M0 exponent per group) |
// | X.weight_packed U8, X.weight_scale F8_E4M3, X.weight_global_scale | NVFP4, global divides |
// | X.weight U8, X.weight_scale F8_E4M3, X.weight_scale_2 | ModelOpt NVFP4, global multiplies |
//
// The FP8 scale's shape says its granularity: one element is tensor-wise,
// `[out, 1]` channel-wise, otherwise blocks, whose size comes from the config
// (`weight_block_size`, compressed-tensors' `block_structure`) or, when the
// config gives none, 128 x 128; a block size that does not produce the
// stored scale shape is an error (never a guess). Block counts round up
// (`ceil(out / 128)`), so dims that are not multiples of the block work.
// FP4 group sizes come from the config (16 for NVFP4, 32 for MXFP4 by
// default) and are checked the same way. `input_scale`,
// `input_global_scale`, `weight_shape`, `k_scale` / `v_scale` belong to
// activation or KV-cache quantization: a weight-only loader reads past them.
// A config that quantizes activations (compressed-tensors' `input_activations`,
// ModelOpt's NVFP4 and FP8, which are W4A4 and W8A8) is recorded in
// `QuantizationConfig::activations`: kiln computes with float activations, so
// its forward is not the one transformers runs for such a checkpoint, and
// `from_pretrained` refuses it unless asked for the weights alone.
// Modules the config leaves unquantized (`ignore`, `exclude_modules`,
// embeddings, norms, `lm_head`) are plain tensors and load as stored.
mod gpt_oss;
pub use gpt_oss::{gpt_oss_mxfp4_experts, split_interleaved_gate_up};

use super::safetensors::SafetensorsFile;
use kiln_tensor::quant::{effective_scales, Codes, Global, QuantSpec, ScaleData};
use kiln_tensor::{DType, Device, Error, HostBuffer, Result, Tensor};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The quantization method of a checkpoint directory.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantMethod {
    /// transformers' FineGrainedFP8 (`quant_method: "fp8"`): `weight_scale_inv` per block.
    Fp8 { block: Option<[usize; 2]> },
    /// compressed-tensors (`float-quantized`, `mxfp4-pack-quantized`, `nvfp4-pack-quantized`).
    CompressedTensors { block: Option<[usize; 2]>, group: Option<usize> },
    /// NVIDIA ModelOpt (`quant_algo` NVFP4 or FP8).
    ModelOpt { algo: String, group: Option<usize> },
}

/// A checkpoint's quantization: `config.json`'s `quantization_config`, or
/// ModelOpt's `hf_quant_config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizationConfig {
    pub method: QuantMethod,
    /// Module names left unquantized, as the config lists them.
    pub ignore: Vec<String>,
    /// What the config says of activation quantization, when it quantizes
    /// activations too (e.g. `compressed-tensors input_activations {num_bits: 8, ...}`).
    pub activations: Option<String>,
}

fn qerr(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid("quantized checkpoint", format!("{}: {msg}", path.display()))
}

fn usize_pair(v: Option<&Value>) -> Option<[usize; 2]> {
    let a = v?.as_array()?;
    match a.as_slice() {
        [r, c] => Some([r.as_u64()? as usize, c.as_u64()? as usize]),
        _ => None,
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

impl QuantizationConfig {
    /// Reads the quantization of the checkpoint in `dir`; `None` for an
    /// unquantized one. An unknown method or format is an error naming it.
    pub fn from_dir(dir: &Path) -> Result<Option<QuantizationConfig>> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| qerr(&cfg_path, format!("cannot read: {e}")))?;
        let cfg: Value = serde_json::from_str(&text).map_err(|e| qerr(&cfg_path, format!("invalid JSON: {e}")))?;
        if let Some(q) = cfg.get("quantization_config") {
            return QuantizationConfig::from_json(q).map(Some).map_err(|m| qerr(&cfg_path, m));
        }
        let hf = dir.join("hf_quant_config.json");
        if hf.is_file() {
            let text = std::fs::read_to_string(&hf).map_err(|e| qerr(&hf, format!("cannot read: {e}")))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| qerr(&hf, format!("invalid JSON: {e}")))?;
            let q = v.get("quantization").ok_or_else(|| qerr(&hf, "no \"quantization\" object"))?;
            let algo = q.get("quant_algo").and_then(|a| a.as_str()).unwrap_or("");
            return modelopt(algo, q.get("group_size"), strings(q.get("exclude_modules")))
                .map(Some)
                .map_err(|m| qerr(&hf, m));
        }
        Ok(None)
    }

    /// Parses a `quantization_config` object.
    pub fn from_json(q: &Value) -> std::result::Result<QuantizationConfig, String> {
        let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
        match method {
            "fp8" => {
                if let Some(f) = q.get("fmt").and_then(|f| f.as_str()) {
                    if f != "e4m3" {
                        return Err(format!("fp8 format {f:?} is not supported (supported: e4m3)"));
                    }
                }
                let block = usize_pair(q.get("weight_block_size"));
                let ignore = strings(q.get("modules_to_not_convert"));
                Ok(QuantizationConfig { method: QuantMethod::Fp8 { block }, ignore, activations: None })
            }
            "compressed-tensors" => {
                let mut block = None;
                let mut group = None;
                let mut activations = None;
                let groups = q.get("config_groups").and_then(|g| g.as_object());
                for (name, g) in groups.into_iter().flatten() {
                    let format = g.get("format").or(q.get("format")).and_then(|f| f.as_str()).unwrap_or("");
                    if !matches!(format, "float-quantized" | "mxfp4-pack-quantized" | "nvfp4-pack-quantized") {
                        return Err(format!(
                            "compressed-tensors format {format:?} (group {name}) is not supported \
                             (supported: float-quantized, mxfp4-pack-quantized, nvfp4-pack-quantized)"
                        ));
                    }
                    let w = g.get("weights").ok_or_else(|| format!("config group {name} has no \"weights\""))?;
                    let ty = w.get("type").and_then(|t| t.as_str()).unwrap_or("");
                    let bits = w.get("num_bits").and_then(|b| b.as_u64()).unwrap_or(0);
                    if ty != "float" || !matches!(bits, 4 | 8) {
                        return Err(format!(
                            "compressed-tensors weights of type {ty:?} with {bits} bits (group {name}) are not \
                             supported (supported: float 8 and float 4)"
                        ));
                    }
                    if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
                        activations = Some(format!("compressed-tensors input_activations {a} (config group {name})"));
                    }
                    block = block.or(usize_pair(w.get("block_structure")));
                    group = group.or(w.get("group_size").and_then(|g| g.as_u64()).map(|g| g as usize));
                }
                Ok(QuantizationConfig {
                    method: QuantMethod::CompressedTensors { block, group },
                    ignore: strings(q.get("ignore")),
                    activations,
                })
            }
            "modelopt" => {
                let algo = q.get("quant_algo").and_then(|a| a.as_str()).unwrap_or("");
                let group = q.pointer("/config_groups/group_0/weights/group_size");
                let mut ignore = strings(q.get("ignore"));
                ignore.extend(strings(q.get("exclude_modules")));
                modelopt(algo, group, ignore)
            }
            "" => Err("quantization_config has no quant_method".into()),
            other => Err(format!(
                "quantization method {other:?} is not supported (supported: fp8, compressed-tensors, modelopt)"
            )),
        }
    }
}

fn modelopt(algo: &str, group: Option<&Value>, ignore: Vec<String>) -> std::result::Result<QuantizationConfig, String> {
    if !matches!(algo, "NVFP4" | "FP8") {
        return Err(format!("ModelOpt quant_algo {algo:?} is not supported (supported: NVFP4, FP8)"));
    }
    let group = group.and_then(|g| g.as_u64()).map(|g| g as usize);
    let activations = Some(format!(
        "ModelOpt {algo}, which quantizes activations ({})",
        if algo == "NVFP4" { "W4A4" } else { "W8A8" }
    ));
    Ok(QuantizationConfig { method: QuantMethod::ModelOpt { algo: algo.to_string(), group }, ignore, activations })
}

/// One quantized Linear weight `[out, in]`: codes and block scales on the
/// CPU (Note [Quantized weights] in kiln-tensor).
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    pub spec: QuantSpec,
    /// float8_e4m3fn `[out, in]` or packed FP4 uint8 `[out, in / 2]`.
    pub codes: Tensor,
    /// float32, float8_e4m3fn or uint8 (E8M0).
    pub scales: Tensor,
    /// `[out, in]`.
    pub shape: [usize; 2],
}

impl QuantizedWeight {
    /// Checks codes and scales against `spec` and builds the weight.
    pub fn new(spec: QuantSpec, codes: Tensor, scales: Tensor) -> Result<QuantizedWeight> {
        let shape = spec.check("QuantizedWeight", (codes.dtype(), codes.shape()), (scales.dtype(), scales.shape()))?;
        Ok(QuantizedWeight { spec, codes, scales, shape })
    }

    /// The block scales with the global one applied, float32.
    pub fn effective_scales(&self) -> Result<Vec<f32>> {
        scale_values(&self.spec, &self.scales)
    }

    /// The exact float32 weight `[out, in]` (each element `code * scale`, in
    /// the order of Note [Quantized weights]), on the CPU.
    pub fn dequantize(&self) -> Result<Tensor> {
        Tensor::dequantize(&self.codes, &self.scales, &self.spec)
    }

    /// Resident bytes of codes and scales.
    pub fn nbytes(&self) -> usize {
        self.codes.numel() * self.codes.dtype().size_in_bytes()
            + self.scales.numel() * self.scales.dtype().size_in_bytes()
    }
}

/// Block scales (a float32, float8_e4m3fn or uint8 E8M0 tensor) decoded and
/// combined with `spec`'s global scale, on the host.
pub(crate) fn scale_values(spec: &QuantSpec, scales: &Tensor) -> Result<Vec<f32>> {
    Ok(match scales.to_host()? {
        HostBuffer::F32(v) => effective_scales(spec, ScaleData::F32(&v)),
        HostBuffer::F8E4M3FN(v) => {
            effective_scales(spec, ScaleData::E4M3(&v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()))
        }
        HostBuffer::U8(v) => effective_scales(spec, ScaleData::E8M0(&v)),
        other => return Err(Error::dtype("QuantizedWeight", format!("scales of dtype {}", other.dtype()))),
    })
}

/// A quantized checkpoint's weights: quantized Linear weights by module name
/// (`model.layers.0.self_attn.q_proj`), every other tensor by its own name.
#[derive(Debug, Default)]
pub struct QuantizedCheckpoint {
    pub quantized: BTreeMap<String, QuantizedWeight>,
    pub plain: BTreeMap<String, Tensor>,
}

impl QuantizedCheckpoint {
    /// All weights as plain tensors: each quantized one dequantized exactly
    /// in float32 (optionally rounded to `round_to`, e.g. bfloat16 as
    /// compressed-tensors decompresses), under `<module>.weight`.
    pub fn dequantized(&self, round_to: Option<DType>) -> Result<BTreeMap<String, Tensor>> {
        let mut out = self.plain.clone();
        for (module, q) in &self.quantized {
            let mut w = q.dequantize()?;
            if let Some(dt) = round_to {
                w = w.to_dtype(dt)?;
            }
            out.insert(format!("{module}.weight"), w);
        }
        Ok(out)
    }
}

/// Tensors that belong to activation / KV-cache quantization.
const READ_PAST: [&str; 6] =
    [".input_scale", ".input_global_scale", ".weight_shape", ".k_scale", ".v_scale", ".output_scale"];

/// Reads the checkpoint in `dir` quantized by `config` (Note [Reading
/// quantized checkpoints]). Plain tensors are read as stored (floats
/// converted to `dtype` when given); quantized weights stay codes and scales.
pub fn load_quantized(dir: &Path, config: &QuantizationConfig, dtype: Option<DType>) -> Result<QuantizedCheckpoint> {
    let opened = super::hf::open_checkpoint(dir)?;
    let mut where_: BTreeMap<String, usize> = BTreeMap::new();
    for (i, (_, names)) in opened.iter().enumerate() {
        for n in names {
            where_.insert(n.clone(), i);
        }
    }
    let files: Vec<SafetensorsFile> = opened.into_iter().map(|(f, _)| f).collect();
    let get = |name: &str| where_.get(name).map(|&i| &files[i]);
    let mut ck = QuantizedCheckpoint::default();
    let mut consumed: std::collections::BTreeSet<String> = Default::default();
    for name in where_.keys() {
        let module = ["weight_scale_inv", "weight_packed", "weight_scale"]
            .iter()
            .find_map(|s| name.strip_suffix(&format!(".{s}")));
        let Some(module) = module else { continue };
        if ck.quantized.contains_key(module) {
            continue;
        }
        let q = read_module(module, &get, config).map_err(|m| {
            let file = get(name).map(|f| f.path().display().to_string()).unwrap_or_default();
            Error::invalid("quantized checkpoint", format!("{file}: module {module:?}: {m}"))
        })?;
        for s in
            ["weight", "weight_scale_inv", "weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2"]
        {
            consumed.insert(format!("{module}.{s}"));
        }
        // A scale that is NaN, infinite or (E8M0) 255 would make whole blocks NaN.
        let scales = q.effective_scales()?;
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            let cols = q.spec.scales_shape(q.shape[0], q.shape[1])[1];
            return Err(Error::invalid(
                "quantized checkpoint",
                format!(
                    "module {module:?}: block scale [{}, {}] is {} (from {module}.weight_scale*): a malformed scale tensor",
                    i / cols,
                    i % cols,
                    scales[i]
                ),
            ));
        }
        ck.quantized.insert(module.to_string(), q);
    }
    for (name, &i) in &where_ {
        if consumed.contains(name) {
            continue;
        }
        let module_quantized = READ_PAST.iter().any(|s| {
            name.strip_suffix(s).is_some_and(|m| ck.quantized.contains_key(m) || matches!(*s, ".k_scale" | ".v_scale"))
        });
        if module_quantized {
            continue;
        }
        let (st, _, _) = files[i].raw(name)?;
        if matches!(st, Dtype::U8 | Dtype::F8_E4M3) && name.ends_with(".weight") {
            return Err(Error::invalid(
                "quantized checkpoint",
                format!("{}: {name:?} is {st:?} but has no scale tensor", files[i].path().display()),
            ));
        }
        ck.plain.insert(name.clone(), files[i].tensor(name, dtype, Device::Cpu)?);
    }
    Ok(ck)
}

/// A stored tensor read as a CPU tensor, with its safetensors dtype.
fn read<'a>(
    name: &str,
    get: &impl Fn(&str) -> Option<&'a SafetensorsFile>,
) -> std::result::Result<Option<(Dtype, Tensor)>, String> {
    let Some(f) = get(name) else { return Ok(None) };
    let (st, shape, bytes) = f.raw(name).map_err(|e| e.to_string())?;
    let t = match st {
        // E8M0 exponents are bytes.
        Dtype::F8_E8M0 | Dtype::U8 => Tensor::from_host(HostBuffer::U8(bytes.to_vec()), shape, Device::Cpu),
        _ => f.tensor(name, None, Device::Cpu),
    }
    .map_err(|e| e.to_string())?;
    Ok(Some((st, t)))
}

/// One float32 scalar (shape `[]` or `[1]`).
fn scalar(name: &str, t: &Tensor) -> std::result::Result<f32, String> {
    if t.numel() != 1 || !t.dtype().is_float() {
        return Err(format!("{name} must be one float, got {} {:?}", t.dtype(), t.shape()));
    }
    let v =
        t.to_dtype(DType::F32).and_then(|t| t.reshape(&[]).and_then(|t| t.item::<f32>())).map_err(|e| e.to_string())?;
    if !(v.is_finite() && v != 0.0) {
        return Err(format!("{name} is {v}, not a finite nonzero scale"));
    }
    Ok(v)
}

fn read_module<'a>(
    module: &str,
    get: &impl Fn(&str) -> Option<&'a SafetensorsFile>,
    config: &QuantizationConfig,
) -> std::result::Result<QuantizedWeight, String> {
    let need = |suffix: &str| -> std::result::Result<(Dtype, Tensor), String> {
        read(&format!("{module}.{suffix}"), get)?.ok_or_else(|| format!("missing {module}.{suffix}"))
    };
    let opt = |suffix: &str| read(&format!("{module}.{suffix}"), get);
    let float_scales = |t: Tensor| t.to_dtype(DType::F32).map_err(|e| e.to_string());
    let (block_cfg, group_cfg) = match &config.method {
        QuantMethod::Fp8 { block } => (*block, None),
        QuantMethod::CompressedTensors { block, group } => (*block, *group),
        QuantMethod::ModelOpt { group, .. } => (None, *group),
    };
    // FP8 codes, with a scale multiplying per tensor, channel or block.
    let fp8 = |scale_name: &str| -> std::result::Result<QuantizedWeight, String> {
        let (wdt, w) = need("weight")?;
        if wdt != Dtype::F8_E4M3 {
            return Err(format!("{module}.weight is {wdt:?}, expected F8_E4M3 next to {scale_name}"));
        }
        let (_, s) = need(scale_name)?;
        if !s.dtype().is_float() {
            return Err(format!("{module}.{scale_name} is {}, expected a float scale", s.dtype()));
        }
        let (out, inp) = (w.shape()[0], w.shape()[1]);
        let block = if s.numel() == 1 && s.ndim() <= 1 {
            [out.max(1), inp.max(1)]
        } else if s.shape() == [out, 1] {
            [1, inp.max(1)]
        } else {
            let b = block_cfg.unwrap_or([128, 128]);
            let want = [out.div_ceil(b[0].max(1)), inp.div_ceil(b[1].max(1))];
            if s.shape() != want {
                return Err(format!(
                    "{module}.{scale_name} has shape {:?}; a weight [{out}, {inp}] in blocks of {b:?} needs {want:?}",
                    s.shape()
                ));
            }
            b
        };
        let s = float_scales(s)?.reshape(&[out.div_ceil(block[0]) as isize, inp.div_ceil(block[1]) as isize]);
        let spec = QuantSpec::new(Codes::E4M3, block, None);
        QuantizedWeight::new(spec, w, s.map_err(|e| e.to_string())?).map_err(|e| e.to_string())
    };
    // Packed FP4 codes with group scales.
    let fp4 = |codes: Tensor, scales: (Dtype, Tensor), global: Option<Global>| {
        let (sdt, s) = scales;
        if codes.dtype() != DType::U8 || codes.ndim() != 2 {
            return Err(format!("packed FP4 codes must be 2-D uint8, got {} {:?}", codes.dtype(), codes.shape()));
        }
        let (out, inp) = (codes.shape()[0], codes.shape()[1] * 2);
        let (s, default_group) = match sdt {
            Dtype::F8_E4M3 => (s, 16),
            Dtype::U8 | Dtype::F8_E8M0 => (s, 32),
            other => return Err(format!("{module}.weight_scale is {other:?}; FP4 group scales are F8_E4M3 or E8M0")),
        };
        let g = group_cfg.unwrap_or(default_group);
        if g == 0 || g % 2 != 0 || s.shape() != [out, inp.div_ceil(g)] {
            return Err(format!(
                "{module}.weight_scale has shape {:?}; a weight [{out}, {inp}] in groups of {g} needs [{out}, {}]",
                s.shape(),
                inp.div_ceil(g.max(1))
            ));
        }
        let spec = QuantSpec::new(Codes::E2M1, [1, g], global);
        QuantizedWeight::new(spec, codes, s).map_err(|e| e.to_string())
    };
    if opt("weight_scale_inv")?.is_some() {
        return fp8("weight_scale_inv");
    }
    if let Some((_, packed)) = opt("weight_packed")? {
        let scales = need("weight_scale")?;
        let global = match opt("weight_global_scale")? {
            Some((_, g)) => Some(Global::Div(scalar(&format!("{module}.weight_global_scale"), &g)?)),
            None if scales.0 == Dtype::F8_E4M3 => {
                return Err(format!("missing {module}.weight_global_scale (NVFP4 needs its global scale)"))
            }
            None => None,
        };
        return fp4(packed, scales, global);
    }
    if let Some((_, s2)) = opt("weight_scale_2")? {
        let (wdt, w) = need("weight")?;
        if wdt != Dtype::U8 {
            return Err(format!("{module}.weight is {wdt:?}; ModelOpt NVFP4 packs its codes in U8"));
        }
        let g = Global::Mul(scalar(&format!("{module}.weight_scale_2"), &s2)?);
        return fp4(w, need("weight_scale")?, Some(g));
    }
    if let QuantMethod::ModelOpt { algo, .. } = &config.method {
        if algo == "NVFP4" {
            return Err(format!("missing {module}.weight_scale_2 (ModelOpt NVFP4 needs its second-level scale)"));
        }
    }
    fp8("weight_scale")
}
