//! Quantizing a model's weights: [`quantize_weight`] turns a dense weight into
//! codes and block scales in one of four schemes, [`quantize_model`] keeps a
//! model's decoder Linear layers quantized in memory, and [`save_quantized`]
//! writes a compressed-tensors checkpoint that transformers (with
//! compressed-tensors) and kiln's own loader read.
//!
// Note [Quantizing]
// ~~~~~~~~~~~~~~~~~
// Scales come from the largest magnitude of each block (amax), computed in
// float32, as llm-compressor's and transformers' quantizers do:
//
// * FP8 (block, channel): `s = amax / 448`, codes `e4m3(clamp(w / s, ±448))`
//   rounded to nearest even; float32 scales.
// * NVFP4: a per-tensor `global = 448 * 6 / amax(W)`, group scales (16
//   elements) `e4m3(global * amax16 / 6)`, codes `e2m1(clamp(w / (s /
//   global), ±6))`; the global divides, compressed-tensors' convention.
// * MXFP4: one power of two per 32 elements, `2^(floor(log2(amax32)) - 2)`
//   (E2M1's largest exponent is 2, the OCP MX rule), stored as its E8M0
//   exponent; codes `e2m1(clamp(w / s, ±6))`.
//
// E2M1 rounding is to the nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the
// even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4); negative values, down to
// -0, set the sign bit. A block of zeros gets scale 1 (its codes are 0 anyway).
// Weights are dequantized for the forward exactly as they load
// (Note [Quantized weights] in kiln-tensor), so a saved and reloaded model
// computes what the in-memory quantized one does.
use crate::io::gguf::{pack_blocks, GgmlType};
use crate::io::{save_safetensors, write_atomic, QuantizedWeight};
use crate::layers::Linear;
use crate::models::LlamaForCausalLM;
use crate::module::Module;
use kiln_tensor::quant::{Activations, Codes, Global, QuantSpec};
use kiln_tensor::{f8e4m3fn, DType, Device, Error, HostBuffer, Result, Tensor};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

/// A weight quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// FP8 E4M3 with one float32 scale per `block` (rows x columns), e.g.
    /// DeepSeek's `[128, 128]`.
    Fp8Block([usize; 2]),
    /// FP8 E4M3 with one float32 scale per output channel (row).
    Fp8Channel,
    /// NVFP4: E2M1 codes, an E4M3 scale per 16 elements, a float32 global.
    Nvfp4,
    /// MXFP4: E2M1 codes, an E8M0 power of two per 32 elements.
    Mxfp4,
    /// GGUF's Q8_0: int8 codes and a scale per 32 elements (ggml's rounding).
    Q8_0,
    /// GGUF's Q4_0: 4-bit integer codes and a scale per 32 elements (ggml's rounding).
    Q4_0,
}

impl QuantScheme {
    /// Parses `fp8-block`, `fp8-block:64x64`, `fp8-channel`, `nvfp4`, `mxfp4`, `q8_0`, `q4_0`.
    pub fn parse(s: &str) -> Result<QuantScheme> {
        let bad = || {
            Error::invalid(
                "QuantScheme",
                format!("{s:?}: expected fp8-block, fp8-block:RxC, fp8-channel, nvfp4, mxfp4, q8_0 or q4_0"),
            )
        };
        Ok(match s {
            "fp8-block" | "fp8" => QuantScheme::Fp8Block([128, 128]),
            "fp8-channel" => QuantScheme::Fp8Channel,
            "nvfp4" => QuantScheme::Nvfp4,
            "mxfp4" => QuantScheme::Mxfp4,
            "q8_0" => QuantScheme::Q8_0,
            "q4_0" => QuantScheme::Q4_0,
            _ => {
                let (r, c) = s.strip_prefix("fp8-block:").and_then(|b| b.split_once('x')).ok_or_else(bad)?;
                let (r, c) = (r.parse().map_err(|_| bad())?, c.parse().map_err(|_| bad())?);
                if r == 0 || c == 0 {
                    return Err(bad());
                }
                QuantScheme::Fp8Block([r, c])
            }
        })
    }
}

/// The E2M1 code nearest to `x` (ties to the even code), clamped to ±6.
fn e2m1_code(x: f32) -> u8 {
    let a = x.abs();
    // NaN is refused before quantizing; it would fail every comparison and land on 7.
    let idx = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if x.is_sign_negative() {
        idx | 8
    } else {
        idx
    }
}

fn amax(v: impl Iterator<Item = f32>) -> f32 {
    v.fold(0f32, |m, x| m.max(x.abs()))
}

/// Quantizes a dense weight `[out, in]` (any float dtype, any device) into
/// `scheme` (Note \[Quantizing\]); the codes and scales are on the CPU. FP4
/// schemes need `in` to be even. Non-finite weights are an error.
pub fn quantize_weight(w: &Tensor, scheme: QuantScheme) -> Result<QuantizedWeight> {
    if w.ndim() != 2 || !w.dtype().is_float() {
        return Err(Error::shape(
            "quantize_weight",
            format!("expected a 2-D float weight [out, in], got {} {:?}", w.dtype(), w.shape()),
        ));
    }
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let v: Vec<f32> = w.detach().to_dtype(DType::F32)?.to_device(Device::Cpu)?.to_vec()?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::invalid("quantize_weight", format!("element {i} of the weight is {}", v[i])));
    }
    let ggml = match scheme {
        QuantScheme::Q8_0 => Some(GgmlType::Q8_0),
        QuantScheme::Q4_0 => Some(GgmlType::Q4_0),
        QuantScheme::Fp8Block(_) | QuantScheme::Fp8Channel | QuantScheme::Nvfp4 | QuantScheme::Mxfp4 => None,
    };
    if let Some(ty) = ggml {
        // ggml's reference quantizer, blocks of 32 along each row.
        if !inp.is_multiple_of(32) {
            return Err(Error::shape("quantize_weight", format!("{ty} blocks hold 32 columns; in = {inp}")));
        }
        return pack_blocks(ty, &ty.quantize(&v), out, inp);
    }
    let fp4 = matches!(scheme, QuantScheme::Nvfp4 | QuantScheme::Mxfp4);
    if fp4 && inp % 2 != 0 {
        return Err(Error::shape("quantize_weight", format!("FP4 packs two columns per byte; in = {inp} is odd")));
    }
    let (block, global) = match scheme {
        QuantScheme::Fp8Block(b) => (b, None),
        QuantScheme::Fp8Channel => ([1, inp.max(1)], None),
        QuantScheme::Nvfp4 => {
            let a = amax(v.iter().copied());
            // A weight so small that the global overflows gets the largest finite one.
            ([1, 16], Some(Global::Div(if a > 0.0 { (448.0 * 6.0 / a).min(f32::MAX) } else { 1.0 })))
        }
        QuantScheme::Mxfp4 => ([1, 32], None),
        QuantScheme::Q8_0 | QuantScheme::Q4_0 => unreachable!("returned above"),
    };
    let codes = if fp4 { Codes::E2M1 } else { Codes::E4M3 };
    let spec = QuantSpec::new(codes, block, global);
    let [rows, cols] = spec.scales_shape(out, inp);
    let block_amax = |r: usize, c: usize| {
        let (r0, c0) = (r * block[0], c * block[1]);
        let (r1, c1) = ((r0 + block[0]).min(out), (c0 + block[1]).min(inp));
        amax((r0..r1).flat_map(|i| v[i * inp + c0..i * inp + c1].iter().copied()))
    };
    // Stored scales.
    let scales: Tensor = match scheme {
        QuantScheme::Fp8Block(_) | QuantScheme::Fp8Channel => {
            let s: Vec<f32> = (0..rows * cols)
                .map(|k| {
                    let a = block_amax(k / cols, k % cols);
                    if a > 0.0 {
                        a / 448.0
                    } else {
                        1.0
                    }
                })
                .collect();
            Tensor::from_vec(s, &[rows, cols])?
        }
        QuantScheme::Nvfp4 => {
            let Some(Global::Div(g)) = global else { unreachable!("set above") };
            let s: Vec<f8e4m3fn> = (0..rows * cols)
                .map(|k| f8e4m3fn::from_f32((g * (block_amax(k / cols, k % cols) / 6.0)).clamp(-448.0, 448.0)))
                .collect();
            Tensor::from_host(HostBuffer::F8E4M3FN(s), &[rows, cols], Device::Cpu)?
        }
        QuantScheme::Mxfp4 => {
            let s: Vec<u8> = (0..rows * cols)
                .map(|k| {
                    let a = block_amax(k / cols, k % cols);
                    if a > 0.0 {
                        (a.log2().floor() as i32 - 2 + 127).clamp(0, 254) as u8
                    } else {
                        127
                    }
                })
                .collect();
            Tensor::from_host(HostBuffer::U8(s), &[rows, cols], Device::Cpu)?
        }
        QuantScheme::Q8_0 | QuantScheme::Q4_0 => unreachable!("returned above"),
    };
    // The effective scales the loader will multiply by, to divide by here.
    let eff = crate::io::quant::scale_values(&spec, &scales)?;
    let scaled = |i: usize, j: usize| {
        let s = eff[(i / block[0]) * cols + j / block[1]];
        if s > 0.0 {
            v[i * inp + j] / s
        } else {
            0.0
        }
    };
    let codes = if fp4 {
        let mut b = vec![0u8; out * inp / 2];
        for i in 0..out {
            for j in (0..inp).step_by(2) {
                b[(i * inp + j) / 2] = e2m1_code(scaled(i, j)) | (e2m1_code(scaled(i, j + 1)) << 4);
            }
        }
        Tensor::from_host(HostBuffer::U8(b), &[out, inp / 2], Device::Cpu)?
    } else {
        let c: Vec<f8e4m3fn> =
            (0..out * inp).map(|k| f8e4m3fn::from_f32(scaled(k / inp, k % inp).clamp(-448.0, 448.0))).collect();
        Tensor::from_host(HostBuffer::F8E4M3FN(c), &[out, inp], Device::Cpu)?
    };
    QuantizedWeight::new(spec, codes, scales)
}

/// The decoder Linear layers a scheme quantizes: `lm_head` and a
/// mixture-of-experts router (`mlp.gate`) stay dense, as quantized
/// checkpoints leave them (compressed-tensors' recipes ignore both; the
/// router is small and its top-k is sensitive to rounding).
fn decoder_linears(model: &mut LlamaForCausalLM) -> Vec<(String, &mut crate::layers::Linear)> {
    model.linears_mut().into_iter().filter(|(n, _)| n != "lm_head" && !n.ends_with(".mlp.gate")).collect()
}

/// Quantizes every decoder Linear of `model` (not `lm_head`) and keeps it
/// quantized on the model's device (see `Linear::quantize_weight`): the
/// in-memory form of a quantized checkpoint.
pub fn quantize_model(model: &mut LlamaForCausalLM, scheme: QuantScheme) -> Result<()> {
    let device = model.device();
    let mut q = BTreeMap::new();
    for (name, lin) in decoder_linears(model) {
        if lin.is_quantized() {
            return Err(Error::invalid("quantize_model", format!("{name} is already quantized")));
        }
        if lin.adapter().is_some_and(|a| a.magnitude().is_some() || a.is_merged()) {
            return Err(Error::invalid(
                "quantize_model",
                format!("{name} has a DoRA adapter or a merged one: its weight cannot be quantized"),
            ));
        }
        q.insert(name, quantize_weight(&lin.weight, scheme)?);
    }
    model.keep_quantized(&q, device)
}

/// Sets how every kept-quantized Linear of `model` (decoder layers and a
/// quantized head alike) treats its input: `Activations::Int8` rounds each
/// input row to 8-bit integers per block of 32 first, llama.cpp's way for its
/// integer formats (Note [Int8 activations] in kiln-tensor), so that integer
/// products serve them; inference only. Returns how many layers it set; an
/// error when the model keeps no weight quantized.
pub fn set_quantized_activations(model: &mut LlamaForCausalLM, activations: Activations) -> Result<usize> {
    let mut set = 0;
    for (_, lin) in model.linears_mut() {
        if lin.is_quantized() {
            lin.set_activations(activations)?;
            set += 1;
        }
    }
    if set == 0 {
        return Err(Error::invalid(
            "set_quantized_activations",
            "the model keeps no weight quantized (quantize_model, or QuantizedLoad::Keep when loading)",
        ));
    }
    Ok(set)
}

/// Keeps the output projection (the LM head) quantized in `scheme` too,
/// as llama.cpp's quantized files carry an `output.weight` of their own
/// type: a batch-1 decoding step reads the whole head for every token, and
/// with tied embeddings it is a quarter of Qwen3-0.6B's weights. A tied
/// model gets an `lm_head` Linear of its own holding the quantized matrix,
/// while the embedding lookup keeps the dense table. Checkpoints in the
/// compressed-tensors and ModelOpt formats leave the head dense; a model
/// whose head is quantized this way is not saved by `save_pretrained`.
pub fn quantize_lm_head(model: &mut LlamaForCausalLM, scheme: QuantScheme) -> Result<()> {
    let device = model.device();
    let w = model
        .output_weight()
        .ok_or_else(|| Error::invalid("quantize_lm_head", "the LM head is already quantized"))?
        .clone();
    let q = quantize_weight(&w, scheme)?;
    if model.lm_head.is_none() {
        model.lm_head = Some(Linear::from_weights(w.detach(), None)?);
    }
    model.keep_quantized(&BTreeMap::from([("lm_head".to_string(), q)]), device)
}

/// Writes `model` (dense) to `dir` as a compressed-tensors checkpoint of
/// `scheme`: `config.json` with its `quantization_config`, and
/// `model.safetensors` with each decoder Linear's codes and scales under
/// compressed-tensors' names (`weight` + `weight_scale` for FP8,
/// `weight_packed` + `weight_scale` (+ `weight_global_scale`) for FP4);
/// embeddings, norms and `lm_head` as they are. Files are written atomically.
pub fn save_quantized(model: &LlamaForCausalLM, dir: impl AsRef<Path>, scheme: QuantScheme) -> Result<()> {
    let dir = dir.as_ref();
    if let QuantScheme::Q8_0 | QuantScheme::Q4_0 = scheme {
        return Err(Error::invalid(
            "save_quantized",
            format!("{scheme:?} is a GGUF format: write it with LlamaForCausalLM::save_gguf"),
        ));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::invalid("save_quantized", format!("{}: cannot create: {e}", dir.display())))?;
    let mut dense = model.clone();
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut quantized = vec![];
    for (name, lin) in decoder_linears(&mut dense) {
        if lin.is_quantized() {
            return Err(Error::invalid("save_quantized", format!("{name} is kept quantized; save a dense model")));
        }
        let q = quantize_weight(&lin.weight, scheme)?;
        let code_name = if q.spec.codes == Codes::E2M1 { "weight_packed" } else { "weight" };
        tensors.insert(format!("{name}.{code_name}"), q.codes.clone());
        tensors.insert(format!("{name}.weight_scale"), q.scales.clone());
        if let Some(Global::Div(g)) = q.spec.global {
            tensors.insert(format!("{name}.weight_global_scale"), Tensor::from_vec(vec![g], &[1])?);
        }
        quantized.push(name);
    }
    for (k, t) in model.state_dict() {
        if !quantized.iter().any(|q| k == format!("{q}.weight")) {
            tensors.insert(k, t.detach().to_device(Device::Cpu)?);
        }
    }
    let weights = match scheme {
        QuantScheme::Fp8Block(b) => json!({"num_bits": 8, "type": "float", "strategy": "block", "symmetric": true,
            "dynamic": false, "group_size": null, "block_structure": [b[0], b[1]]}),
        QuantScheme::Fp8Channel => json!({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true,
            "dynamic": false, "group_size": null}),
        QuantScheme::Nvfp4 => json!({"num_bits": 4, "type": "float", "strategy": "tensor_group", "symmetric": true,
            "dynamic": false, "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"}),
        QuantScheme::Mxfp4 => json!({"num_bits": 4, "type": "float", "strategy": "group", "symmetric": true,
            "dynamic": false, "group_size": 32, "scale_dtype": "torch.uint8"}),
        QuantScheme::Q8_0 | QuantScheme::Q4_0 => unreachable!("refused above"),
    };
    let format = match scheme {
        QuantScheme::Fp8Block(_) | QuantScheme::Fp8Channel => "float-quantized",
        QuantScheme::Nvfp4 => "nvfp4-pack-quantized",
        QuantScheme::Mxfp4 => "mxfp4-pack-quantized",
        QuantScheme::Q8_0 | QuantScheme::Q4_0 => unreachable!("refused above"),
    };
    let mut ignore = vec![json!("lm_head")];
    if model.config().moe.is_some() {
        ignore.push(json!("re:.*mlp[.]gate$"));
    }
    let mut cfg = model.config().to_json(model.dtype());
    cfg["quantization_config"] = json!({
        "quant_method": "compressed-tensors",
        "format": format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": format, "weights": weights,
            "input_activations": null, "output_activations": null}},
        "ignore": ignore,
        "kv_cache_scheme": null,
    });
    save_safetensors(dir.join(crate::io::SINGLE_FILE), &tensors, Some(&pt_format()))?;
    let stale = dir.join(crate::io::INDEX_FILE);
    if stale.is_file() {
        std::fs::remove_file(&stale)
            .map_err(|e| Error::invalid("save_quantized", format!("{}: cannot remove: {e}", stale.display())))?;
    }
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| Error::invalid("save_quantized", e.to_string()))?;
    write_atomic(&dir.join("config.json"), |w| w.write_all(text.as_bytes()))
}

fn pt_format() -> BTreeMap<String, String> {
    [("format".to_string(), "pt".to_string())].into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounds_to_nearest_even_code() {
        let cases = [
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (100.0, 7),
            (-0.1, 8),
            (-3.0, 13),
        ];
        for (x, c) in cases {
            assert_eq!(e2m1_code(x), c, "{x}");
        }
    }

    #[test]
    fn schemes_parse() {
        assert_eq!(QuantScheme::parse("fp8-block:64x32").unwrap(), QuantScheme::Fp8Block([64, 32]));
        assert_eq!(QuantScheme::parse("nvfp4").unwrap(), QuantScheme::Nvfp4);
        assert_eq!(QuantScheme::parse("q4_0").unwrap(), QuantScheme::Q4_0);
        assert!(QuantScheme::parse("fp8-block:0x4").is_err() && QuantScheme::parse("int4").is_err());
    }
}
