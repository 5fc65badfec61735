//! Llama and Qwen3 models in GGUF files: a file written the way llama.cpp's
//! converter writes one (names from the `gguf` package's `TensorNameMap`,
//! q/k rows permuted for `llama`) loads into the model transformers runs
//! (the fixtures' logits); kiln's own files hold every tensor where the
//! converter puts it; quantized files load within the format's step.
mod support;

use kiln::nn::io::gguf::{GgmlType, GgufFile, GgufValue};
use kiln::nn::io::load_safetensors;
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::module::Module;
use kiln::prelude::*;
use support::{assert_close, f32_bits, fixture_dir, gguf_reference, temp_dir, tolerance};

#[test]
fn files_converted_as_llama_cpp_does_load_into_the_fixture_models() {
    let dir = temp_dir("gguf-convert");
    for name in ["llama", "qwen3"] {
        let src = fixture_dir(name);
        let file = dir.join(format!("{name}.gguf"));
        gguf_reference(&["convert".as_ref(), src.as_os_str(), file.as_os_str()]);
        let model = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap();
        let hf = LlamaForCausalLM::from_pretrained(&src, DType::F32, Device::Cpu).unwrap();
        assert_eq!(model.config().tie_word_embeddings, hf.config().tie_word_embeddings, "{name}");
        assert_eq!(model.config().rms_norm_eps, hf.config().rms_norm_eps, "{name}: eps read as its decimal");
        assert_eq!(model.config().rope_theta, hf.config().rope_theta, "{name}");
        // The same weights as the checkpoint, bit for bit, under the HF names.
        let (a, b) = (model.state_dict(), hf.state_dict());
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{name}");
        for (k, t) in &a {
            assert!(f32_bits(t) == f32_bits(&b[k]), "{name}: {k} differs from the checkpoint");
        }
        let g = load_safetensors(src.join("golden.safetensors")).unwrap();
        let logits = model.forward(&g["input_ids"], None).unwrap();
        let (atol, rtol) = tolerance(name, "logits");
        assert_close(&format!("{name} from GGUF"), &logits, &g["logits"], atol, rtol);
    }
}

#[test]
fn files_kiln_writes_put_every_tensor_where_the_converter_does() {
    let dir = temp_dir("gguf-save-model");
    for name in ["llama", "qwen3"] {
        let src = fixture_dir(name);
        let model = LlamaForCausalLM::from_pretrained(&src, DType::F32, Device::Cpu).unwrap();
        let file = dir.join(format!("{name}-f32.gguf"));
        model.save_gguf(&file, GgmlType::F32, &[]).unwrap();
        assert_eq!(gguf_reference(&["check-model".as_ref(), file.as_os_str(), src.as_os_str()]).trim(), "ok");
        let f = GgufFile::open(&file).unwrap();
        assert_eq!(f.get("tokenizer.ggml.model").and_then(|v| v.as_str()), Some("none"));
        // And back: the same model.
        let back = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap();
        for (k, t) in back.state_dict() {
            assert!(f32_bits(&t) == f32_bits(&model.state_dict()[&k]), "{name}: {k} changed through GGUF");
        }
    }
}

#[test]
fn quantized_files_load_within_a_step_of_the_weights() {
    let dir = temp_dir("gguf-save-quantized");
    for name in ["llama", "qwen3"] {
        let model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
        let want = model.state_dict();
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::BF16] {
            let file = dir.join(format!("{name}-{ty}.gguf"));
            let meta = [("general.name".to_string(), GgufValue::String(format!("{name} {ty}")))];
            model.save_gguf(&file, ty, &meta).unwrap();
            let f = GgufFile::open(&file).unwrap();
            assert_eq!(f.info("blk.0.attn_q.weight").unwrap().ggml_type, ty);
            assert_eq!(f.info("blk.0.attn_norm.weight").unwrap().ggml_type, GgmlType::F32, "norms stay F32");
            assert_eq!(f.get("general.name").and_then(|v| v.as_str()), Some(format!("{name} {ty}").as_str()));
            let back = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap();
            for (k, t) in back.state_dict() {
                let (a, b) = (t.to_vec::<f32>().unwrap(), want[&k].to_vec::<f32>().unwrap());
                if want[&k].ndim() == 1 {
                    assert_eq!(a, b, "{name} {ty}: {k}");
                    continue;
                }
                // Rows come back in their own order (a wrong q/k permutation
                // would move whole rows): each block within its format's step
                // (Q4_0: a whole step of amax / 8, Q8_0 half of amax / 127,
                // both plus the scale's f16 rounding over the codes; BF16 half an ulp).
                for (x, y) in a.chunks(32).zip(b.chunks(32)) {
                    let amax = y.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (p, q) in x.iter().zip(y) {
                        let bound = match ty {
                            GgmlType::Q8_0 => amax / 254.0 + amax * 2f32.powi(-11),
                            GgmlType::Q4_0 => amax / 8.0 + amax * 2f32.powi(-11),
                            _ => q.abs() * 2f32.powi(-8),
                        };
                        assert!((p - q).abs() <= bound, "{name} {ty}: {k}: {p} vs {q}");
                    }
                }
            }
        }
    }
}

#[test]
fn what_kiln_does_not_map_is_an_error() {
    let dir = temp_dir("gguf-model-errors");
    let model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu).unwrap();
    let file = dir.join("m.gguf");
    let e = model.save_gguf(&file, GgmlType::Q4_K, &[]).unwrap_err().to_string();
    assert!(e.contains("not Q4_K"), "{e}");
    // An architecture kiln does not build.
    let arch = [("general.architecture".to_string(), GgufValue::String("gemma3".into()))];
    model.save_gguf(&file, GgmlType::F32, &arch).unwrap();
    let e = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("\"gemma3\" is not supported"), "{e}");
    // A missing setting is named.
    let f = GgufFile::open(&file).unwrap();
    let mut meta: Vec<(String, GgufValue)> =
        f.metadata().iter().filter(|(k, _)| k != "llama.block_count").cloned().collect();
    meta.retain(|(k, _)| k != "general.architecture");
    meta.insert(0, ("general.architecture".into(), GgufValue::String("llama".into())));
    let tensors: Vec<_> = f
        .tensor_infos()
        .iter()
        .map(|i| {
            kiln::nn::io::gguf::GgufTensor::new(&i.name, f.tensor(&i.name, None, Device::Cpu).unwrap(), GgmlType::F32)
        })
        .collect();
    let p2 = dir.join("no-blocks.gguf");
    kiln::nn::io::gguf::save_gguf(&p2, &meta, &tensors).unwrap();
    let e = LlamaForCausalLM::from_gguf(&p2, DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("no llama.block_count"), "{e}");
}

/// Q8_0 and Q4_0 matrices kept packed (`QuantizedLoad::Keep`) compute with
/// exactly the weights the dequantized load holds: on the CPU (codes decoded
/// in the registers) and through PJRT (the lowering of int8 / int4 codes).
#[test]
fn packed_q8_0_and_q4_0_weights_compute_as_their_dequantized_values() {
    use kiln::nn::models::{PretrainedOptions, QuantizedLoad};
    support::register_tpu();
    let dir = temp_dir("gguf-packed");
    for name in ["llama", "qwen3"] {
        let src = fixture_dir(name);
        let ids = load_safetensors(src.join("golden.safetensors")).unwrap()["input_ids"].clone();
        let model = LlamaForCausalLM::from_pretrained(&src, DType::F32, Device::Cpu).unwrap();
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let file = dir.join(format!("{name}-{ty}.gguf"));
            model.save_gguf(&file, ty, &[]).unwrap();
            let dense = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap();
            let want = dense.forward(&ids, None).unwrap();
            for device in [Device::Cpu, Device::Tpu(0)] {
                let opts = PretrainedOptions::new(DType::F32, device).with_quantized(QuantizedLoad::Keep);
                let mut kept = LlamaForCausalLM::from_gguf_with(&file, &opts).unwrap();
                let packed = kept.linears_mut().into_iter().filter(|(_, l)| l.is_quantized()).count();
                // 7 per layer and the head (a tied model's from the embedding table).
                assert_eq!(packed, 7 * 3 + 1, "{name} {ty}: packed Linear layers");
                let got = kept.forward(&ids.to_device(device).unwrap(), None).unwrap().to_device(Device::Cpu).unwrap();
                let (diff, _) = support::compare(&got, &want, 0.0, 0.0);
                println!("{name} {ty} {device}: max |kept - dequantized| = {diff:.2e}");
                assert!(diff <= 2e-5, "{name} {ty} on {device}: kept and dequantized differ by {diff}");
            }
        }
    }
}

/// `QuantizedLoad::Dequantize { round_to }` rounds a quantized type's
/// values to `round_to`, and leaves the float types (the norms) alone.
#[test]
fn round_to_rounds_the_dequantized_weights() {
    use kiln::nn::models::{PretrainedOptions, QuantizedLoad};
    let dir = temp_dir("gguf-round-to");
    let model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu).unwrap();
    let file = dir.join("llama-q8_0.gguf");
    model.save_gguf(&file, GgmlType::Q8_0, &[]).unwrap();
    let exact = LlamaForCausalLM::from_gguf(&file, DType::F32, Device::Cpu).unwrap().state_dict();
    let opts = PretrainedOptions::new(DType::F32, Device::Cpu)
        .with_quantized(QuantizedLoad::Dequantize { round_to: Some(DType::BF16) });
    let rounded = LlamaForCausalLM::from_gguf_with(&file, &opts).unwrap().state_dict();
    let mut changed = 0;
    for (k, t) in &exact {
        let want =
            if t.ndim() == 1 { t.clone() } else { t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap() };
        assert_eq!(rounded[k].to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap(), "{k}");
        changed += usize::from(want.to_vec::<f32>().unwrap() != t.to_vec::<f32>().unwrap());
    }
    assert!(changed > 0, "bfloat16 rounding changed no Q8_0 matrix");
}
