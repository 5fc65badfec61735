//! Quantized checkpoints (FP8 block / channel / tensor, MXFP4, NVFP4 from
//! transformers, compressed-tensors and ModelOpt; `shared/fixtures/quant`)
//! against transformers' logits, dequantized on load and kept quantized, on the
//! CPU and PJRT; the quantized product against the dequantized weight; and
//! malformed checkpoints, each a clear error naming the tensor; and what
//! kiln quantizes, as numpy and as transformers + compressed-tensors read it.
mod support;

use kiln::nn::io::{load_quantized, load_safetensors, QuantizationConfig};
use kiln::nn::models::{LlamaForCausalLM, PretrainedOptions, QuantizedLoad};
use kiln::nn::module::Module;
use kiln::prelude::*;
use kiln::tensor::quant::{Codes, Global, QuantSpec};
use std::collections::BTreeMap;
use std::path::Path;
use support::{assert_close, fixture_dir, temp_dir};

const FOLDERS: [&str; 8] = [
    "fp8_block",
    "fp8_block_bf16scale",
    "ct_fp8_channel",
    "ct_fp8_tensor",
    "ct_mxfp4",
    "ct_nvfp4",
    "ct_nvfp4_w4a4",
    "modelopt_nvfp4",
];

fn golden(dir: &Path) -> BTreeMap<String, Tensor> {
    load_safetensors(dir.join("golden.safetensors")).expect("golden.safetensors")
}

/// `(atol, rtol)` golden.json suggests for `key`.
fn tol(dir: &Path, key: &str) -> (f64, f64) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let t = &v["suggested_tolerance"][key];
    (t["atol"].as_f64().unwrap(), t["rtol"].as_f64().unwrap())
}

fn logits(dir: &Path, quantized: QuantizedLoad, dev: Device) -> Tensor {
    // Activation-quantized fixtures (W8A8, W4A4) are checked here against
    // transformers' weight-only dequantization: asked for explicitly.
    let opts = PretrainedOptions::new(DType::F32, dev).with_quantized(quantized).with_weights_only(true);
    let model = LlamaForCausalLM::from_pretrained_with(dir, &opts).expect("from_pretrained_with");
    let ids = golden(dir)["input_ids"].to_device(dev).unwrap();
    let _g = kiln::autograd::no_grad();
    model.forward(&ids, None).unwrap().to_device(Device::Cpu).unwrap()
}

#[test]
fn every_fixture_reproduces_transformers_dequantized_on_load_and_kept_quantized() {
    for name in FOLDERS {
        let dir = fixture_dir("quant").join(name);
        let g = golden(&dir);
        let (a, r) = tol(&dir, "logits_dequant_f32_exact");
        let exact = &g["logits_dequant_f32_exact"];
        let dq = logits(&dir, QuantizedLoad::Dequantize { round_to: None }, Device::Cpu);
        assert_close(&format!("{name} dequantized"), &dq, exact, a, r);
        let kept = logits(&dir, QuantizedLoad::Keep, Device::Cpu);
        assert_close(&format!("{name} kept quantized"), &kept, exact, a, r);
        // compressed-tensors and ModelOpt decompress to bf16; transformers' fp8 keeps f32.
        let (a, r) = tol(&dir, "logits_dequant_f32");
        let round_to = if name.starts_with("fp8_block") { None } else { Some(DType::BF16) };
        let bf = logits(&dir, QuantizedLoad::Dequantize { round_to }, Device::Cpu);
        assert_close(&format!("{name} dequantized as transformers does"), &bf, &g["logits_dequant_f32"], a, r);
    }
}

#[test]
fn dequantized_weights_are_bit_exact() {
    for name in FOLDERS {
        let dir = fixture_dir("quant").join(name);
        let q = QuantizationConfig::from_dir(&dir).unwrap().expect("a quantized checkpoint");
        let ck = load_quantized(&dir, &q, None).unwrap();
        assert_eq!(ck.quantized.len(), 14, "{name}: 7 Linear layers in each of 2 decoder layers");
        assert!(ck.plain.contains_key("lm_head.weight") && ck.plain.contains_key("model.embed_tokens.weight"));
        let w = ck.dequantized(None).unwrap();
        for (k, want) in golden(&dir).iter().filter_map(|(k, v)| Some((k.strip_prefix("ref_weights.")?, v))) {
            let got: Vec<u32> = w[k].to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            let want: Vec<u32> = want.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            assert!(got == want, "{name}: {k} differs from the reference bits");
        }
        // Resident size of the kept form: 8 bits per weight (+ scales) for FP8, about 4.5 for FP4.
        let (bytes, n): (usize, usize) =
            ck.quantized.values().fold((0, 0), |(b, n), q| (b + q.nbytes(), n + q.shape[0] * q.shape[1]));
        let bits = 8.0 * bytes as f64 / n as f64;
        let want = if name.contains("fp4") { 4.25..=4.5 } else { 8.0..=8.25 };
        assert!(want.contains(&bits), "{name}: {bits} bits per weight");
    }
}

#[test]
fn kept_quantized_runs_on_pjrt_in_every_mode() {
    support::register_tpu();
    for name in ["fp8_block", "ct_mxfp4", "ct_nvfp4", "modelopt_nvfp4"] {
        let dir = fixture_dir("quant").join(name);
        let (a, r) = tol(&dir, "logits_dequant_f32_exact");
        let exact = &golden(&dir)["logits_dequant_f32_exact"];
        for mode in [kiln::tpu::Mode::Strict, kiln::tpu::Mode::Debug, kiln::tpu::Mode::Defer] {
            kiln::tpu::set_mode(mode);
            let got = logits(&dir, QuantizedLoad::Keep, Device::Tpu(0));
            assert_close(&format!("{name} on tpu:0 {}", mode.name()), &got, exact, a, r);
        }
        kiln::tpu::set_mode(kiln::tpu::Mode::Strict);
        // Captured: one program, replayed.
        let opts = PretrainedOptions::new(DType::F32, Device::Tpu(0))
            .with_quantized(QuantizedLoad::Keep)
            .with_weights_only(true);
        let model = LlamaForCausalLM::from_pretrained_with(&dir, &opts).unwrap();
        let ids = golden(&dir)["input_ids"].to_device(Device::Tpu(0)).unwrap();
        let mut f = kiln::compile(Device::Tpu(0), |x: &[Tensor]| {
            let _g = kiln::autograd::no_grad();
            Ok(vec![model.forward(&x[0], None)?])
        });
        for call in 0..2 {
            let out = f.call(std::slice::from_ref(&ids)).unwrap();
            assert_close(
                &format!("{name} compiled, call {call}"),
                &out[0].to_device(Device::Cpu).unwrap(),
                exact,
                a,
                r,
            );
        }
    }
}

/// A random quantized weight in each layout, with partial blocks.
fn random_weights(dev: Device) -> Vec<(QuantSpec, Tensor, Tensor, [usize; 2])> {
    kiln::manual_seed(3);
    let (out, inp) = (37usize, 48usize);
    let codes8 =
        || Tensor::randn(&[out, inp], DType::F32).unwrap().mul(40.0).unwrap().to_dtype(DType::F8E4M3FN).unwrap();
    let packed = || Tensor::randint(0, 256, &[out, inp / 2], DType::U8).unwrap();
    let pos = |shape: &[usize]| Tensor::rand(shape, DType::F32).unwrap().add(0.25).unwrap();
    let fp8 = |block: [usize; 2]| {
        let spec = QuantSpec::new(Codes::E4M3, block, None);
        let s = spec.scales_shape(out, inp);
        (spec, codes8(), pos(&s), [out, inp])
    };
    let nv = QuantSpec::new(Codes::E2M1, [1, 16], Some(Global::Div(3.0)));
    let nv_scales = pos(&nv.scales_shape(out, inp)).mul(100.0).unwrap().to_dtype(DType::F8E4M3FN).unwrap();
    let mo = QuantSpec::new(Codes::E2M1, [1, 16], Some(Global::Mul(0.01)));
    let mo_scales = pos(&mo.scales_shape(out, inp)).mul(100.0).unwrap().to_dtype(DType::F8E4M3FN).unwrap();
    let mx = QuantSpec::new(Codes::E2M1, [1, 32], None);
    let mx_scales = Tensor::randint(110, 140, &mx.scales_shape(out, inp), DType::U8).unwrap();
    let all = vec![
        fp8([16, 32]),
        fp8([1, inp]),
        fp8([out, inp]),
        (nv.clone(), packed(), nv_scales, [out, inp]),
        (mo.clone(), packed(), mo_scales, [out, inp]),
        (mx.clone(), packed(), mx_scales, [out, inp]),
    ];
    all.into_iter().map(|(s, c, sc, sh)| (s, c.to_device(dev).unwrap(), sc.to_device(dev).unwrap(), sh)).collect()
}

#[test]
fn the_quantized_product_equals_the_dequantized_one_with_its_gradient() {
    support::register_tpu();
    let cpu_w: Vec<Tensor> =
        random_weights(Device::Cpu).iter().map(|(spec, c, s, _)| Tensor::dequantize(c, s, spec).unwrap()).collect();
    for dev in [Device::Cpu, Device::Tpu(0)] {
        for (i, (spec, codes, scales, [_, inp])) in random_weights(dev).into_iter().enumerate() {
            let w = Tensor::dequantize(&codes, &scales, &spec).unwrap();
            let same: Vec<u32> = w.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            let cpu: Vec<u32> = cpu_w[i].to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            assert!(same == cpu, "{dev}: layout {i}: the dequantized weight differs from the CPU's");
            for rows in [1usize, 3, 20] {
                let x = Tensor::randn(&[2, rows, inp], DType::F32).unwrap().to_device(dev).unwrap();
                x.requires_grad_(true).unwrap();
                let y = x.quant_matmul(&codes, &scales, &spec).unwrap();
                let want = x.detach().matmul(&w.t().unwrap()).unwrap();
                assert_close(&format!("{dev} layout {i}, {rows} rows"), &y, &want, 1e-4, 1e-5);
                y.sum().unwrap().backward().unwrap();
                let gx = x.grad().expect("the input's gradient");
                let want = Tensor::ones(y.shape(), (DType::F32, dev)).unwrap().matmul(&w).unwrap();
                assert_close(&format!("{dev} layout {i} gradient"), &gx, &want, 1e-4, 1e-5);
                let yb = x.detach().to_dtype(DType::BF16).unwrap().quant_matmul(&codes, &scales, &spec).unwrap();
                assert_eq!(yb.dtype(), DType::BF16);
            }
        }
    }
    let (spec, codes, scales, _) = &random_weights(Device::Cpu)[0];
    let x = Tensor::ones(&[2, 47], DType::F32).unwrap();
    let e = x.quant_matmul(codes, scales, spec).unwrap_err().to_string();
    assert!(e.contains("cannot be multiplied"), "{e}");
    let e = x.to_dtype(DType::I64).unwrap().quant_matmul(codes, scales, spec).unwrap_err().to_string();
    assert!(e.contains("float32, bfloat16 or float16"), "{e}");
    let wrong = QuantSpec { block: [16, 16], ..spec.clone() };
    let e = Tensor::ones(&[2, 48], DType::F32).unwrap().quant_matmul(codes, scales, &wrong).unwrap_err().to_string();
    assert!(e.contains("needs scales of shape [3, 3]"), "{e}");
}

/// A weight larger than one dequantized chunk of the backward (1M float32
/// elements): the input's gradient, summed over row chunks of whole scale
/// blocks (a partial last block included), is the dense one.
#[test]
fn the_gradient_through_a_large_quantized_weight_is_taken_by_row_chunks() {
    support::register_tpu();
    kiln::manual_seed(5);
    let (out, inp) = (3000usize, 512usize);
    let fp8 = QuantSpec::new(Codes::E4M3, [128, 128], None);
    let nv = QuantSpec::new(Codes::E2M1, [1, 16], Some(Global::Div(3.0)));
    let layouts = [
        (
            fp8.clone(),
            Tensor::randn(&[out, inp], DType::F32).unwrap().mul(40.0).unwrap().to_dtype(DType::F8E4M3FN).unwrap(),
            Tensor::rand(&fp8.scales_shape(out, inp), DType::F32).unwrap().add(0.25).unwrap(),
        ),
        (
            nv.clone(),
            Tensor::randint(0, 256, &[out, inp / 2], DType::U8).unwrap(),
            Tensor::rand(&nv.scales_shape(out, inp), DType::F32)
                .unwrap()
                .mul(100.0)
                .unwrap()
                .to_dtype(DType::F8E4M3FN)
                .unwrap(),
        ),
    ];
    for dev in [Device::Cpu, Device::Tpu(0)] {
        for (i, (spec, codes, scales)) in layouts.iter().enumerate() {
            let (codes, scales) = (codes.to_device(dev).unwrap(), scales.to_device(dev).unwrap());
            let w = Tensor::dequantize(&codes, &scales, spec).unwrap();
            let x = Tensor::randn(&[3, inp], DType::F32).unwrap().to_device(dev).unwrap();
            x.requires_grad_(true).unwrap();
            let g = Tensor::randn(&[3, out], DType::F32).unwrap().to_device(dev).unwrap();
            x.quant_matmul(&codes, &scales, spec).unwrap().mul(&g).unwrap().sum().unwrap().backward().unwrap();
            let want = g.matmul(&w).unwrap();
            // Float32 sums of 3000 products in another order: a few roundings of |g| |W| sqrt(out).
            let scale = want.abs().unwrap().to_vec::<f32>().unwrap().iter().fold(0f32, |m, v| m.max(*v)) as f64;
            assert_close(&format!("{dev} layout {i}"), &x.grad().unwrap(), &want, 1e-5 * scale, 1e-5);
        }
    }
}

/// Note [Int8 activations]: with `Activations::Int8`, the CPU (integer
/// products for a few rows, float products of the rounded rows for more) and
/// PJRT (the rounding lowered to StableHLO) both compute the rounded rows
/// times the dequantized weight, for FP4 and FP8 layouts and 4- and 8-bit
/// integers; the input gets no gradient; a dense Linear refuses the setting.
#[test]
fn int8_activations_round_the_rows_on_every_device() {
    use kiln::tensor::quant::{round_activation_block, Activations, ACTIVATION_BLOCK};
    support::register_tpu();
    let (out, inp) = (37usize, 48usize);
    let ints = |codes: Codes, block: [usize; 2]| {
        let spec = QuantSpec::new(codes, block, None);
        let c = match codes {
            Codes::I8 => Tensor::randint(-128, 128, &[out, inp], DType::I8).unwrap(),
            _ => Tensor::randint(0, 256, &[out, inp / 2], DType::U8).unwrap(),
        };
        let s = Tensor::rand(&spec.scales_shape(out, inp), DType::F32).unwrap().add(0.25).unwrap();
        (spec, c, s, [out, inp])
    };
    let mut layouts = random_weights(Device::Cpu);
    layouts.push(ints(Codes::I4, [1, 16]));
    layouts.push(ints(Codes::I8, [1, 32]));
    for (i, (spec, codes, scales, _)) in layouts.into_iter().enumerate() {
        let int8 = spec.clone().with_activations(Activations::Int8);
        let w = Tensor::dequantize(&codes, &scales, &spec).unwrap().to_vec::<f32>().unwrap();
        for rows in [1usize, 20] {
            // Rows whose blocks differ in magnitude.
            let x = Tensor::randn(&[rows, inp], DType::F32).unwrap();
            let x = x
                .mul(&Tensor::arange(0.0, inp as f64, 1.0, DType::F32).unwrap().div(8.0).unwrap().exp().unwrap())
                .unwrap();
            let xv = x.to_vec::<f32>().unwrap();
            let mut xr = vec![];
            for b in xv.chunks(inp).flat_map(|row| row.chunks(ACTIVATION_BLOCK)) {
                let mut q = vec![0i8; b.len()];
                let d = round_activation_block(b, &mut q);
                xr.extend(q.iter().map(|&q| q as f32 * d));
            }
            for dev in [Device::Cpu, Device::Tpu(0)] {
                let (c, s) = (codes.to_device(dev).unwrap(), scales.to_device(dev).unwrap());
                let y = x.to_device(dev).unwrap().quant_matmul(&c, &s, &int8).unwrap().to_vec::<f32>().unwrap();
                let exact = x.to_device(dev).unwrap().quant_matmul(&c, &s, &spec).unwrap().to_vec::<f32>().unwrap();
                let mut moved = false;
                for (e, (&got, &ex)) in y.iter().zip(&exact).enumerate() {
                    let (r, j) = (e / out, e % out);
                    let terms = (0..inp).map(|p| xr[r * inp + p] as f64 * w[j * inp + p] as f64);
                    let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                    // The float32 sums of `inp` terms (Note [Integer products of int8
                    // activations]: at most inp + 8 roundings).
                    let bound = (inp + 8) as f64 * 2f64.powi(-24) * abs;
                    assert!(
                        (got as f64 - want).abs() <= bound,
                        "{dev} layout {i}, {rows} rows, ({r}, {j}): {got} vs {want}"
                    );
                    moved |= (ex as f64 - want).abs() > bound;
                }
                assert!(moved, "{dev} layout {i}, {rows} rows: the rounding changed nothing");
            }
        }
        let x = Tensor::randn(&[2, inp], DType::F32).unwrap();
        x.requires_grad_(true).unwrap();
        let e = x.quant_matmul(&codes, &scales, &int8).unwrap().sum().unwrap().backward().unwrap_err().to_string();
        assert!(e.contains("int8 activations has no gradient"), "{e}");
    }
    let mut dense = kiln::nn::layers::Linear::new(4, 3, false, DType::F32).unwrap();
    let e = dense.set_activations(Activations::Int8).unwrap_err().to_string();
    assert!(e.contains("the weight is dense"), "{e}");
}

/// Copies a fixture folder, then lets `edit` rewrite its config and tensors.
fn altered(
    name: &str,
    tag: &str,
    edit: impl FnOnce(&mut serde_json::Value, &mut BTreeMap<String, Tensor>),
) -> std::path::PathBuf {
    let src = fixture_dir("quant").join(name);
    let dir = temp_dir(tag);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut t = load_safetensors(src.join("model.safetensors")).unwrap();
    edit(&mut cfg, &mut t);
    std::fs::write(dir.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    kiln::nn::io::save_safetensors(dir.join("model.safetensors"), &t, None).unwrap();
    dir
}

/// A checkpoint that quantizes activations (W8A8, W4A4) is refused by
/// default, naming the scheme: kiln's forward would not be transformers'
/// (whose `logits_fake_quant_activations` differ from the weight-only
/// logits); `weights_only` loads it explicitly. Weight-only checkpoints load
/// without it.
#[test]
fn activation_quantized_checkpoints_need_weights_only() {
    for (name, what) in [
        ("ct_fp8_channel", "\"strategy\":\"token\""),
        ("ct_fp8_tensor", "\"strategy\":\"tensor\""),
        ("ct_nvfp4_w4a4", "\"group_size\":16"),
        ("modelopt_nvfp4", "W4A4"),
    ] {
        let dir = fixture_dir("quant").join(name);
        let g = golden(&dir);
        if let Some(fq) = g.get("logits_fake_quant_activations") {
            let (worst, _) = support::compare(fq, &g["logits_dequant_f32_exact"], 0.0, 0.0);
            assert!(worst > 1e-3, "{name}: weight-only and W+A logits differ ({worst})");
        }
        for quantized in [QuantizedLoad::Dequantize { round_to: None }, QuantizedLoad::Keep] {
            let opts = PretrainedOptions::new(DType::F32, Device::Cpu).with_quantized(quantized);
            let e = LlamaForCausalLM::from_pretrained_with(&dir, &opts).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains("quantizes activations too") && e.contains(what) && e.contains("weights_only"), "{e}");
            LlamaForCausalLM::from_pretrained_with(&dir, &opts.with_weights_only(true)).unwrap();
        }
    }
    for name in ["fp8_block", "ct_mxfp4", "ct_nvfp4"] {
        LlamaForCausalLM::from_pretrained(fixture_dir("quant").join(name), DType::F32, Device::Cpu).unwrap();
    }
}

#[test]
fn malformed_quantized_checkpoints_are_clear_errors() {
    // Weights only: the malformed weights are what is checked (a ModelOpt checkpoint quantizes activations).
    let opts = PretrainedOptions::new(DType::F32, Device::Cpu).with_weights_only(true);
    let load = |dir: &Path| LlamaForCausalLM::from_pretrained_with(dir, &opts).map(|_| ()).unwrap_err().to_string();
    let dir = altered("ct_nvfp4", "q-method", |c, _| c["quantization_config"]["quant_method"] = "awq".into());
    let e = load(&dir);
    assert!(e.contains("\"awq\" is not supported") && e.contains("compressed-tensors"), "{e}");
    let dir = altered("ct_nvfp4", "q-format", |c, _| {
        c["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized".into()
    });
    assert!(load(&dir).contains("format \"pack-quantized\""), "{}", load(&dir));
    let k = "model.layers.1.mlp.up_proj";
    let dir = altered("ct_nvfp4", "q-scale", |_, t| {
        let s = t[&format!("{k}.weight_scale")].narrow(1, 0, 7).unwrap().contiguous().unwrap();
        t.insert(format!("{k}.weight_scale"), s);
    });
    let e = load(&dir);
    assert!(e.contains(k) && e.contains("[256, 7]") && e.contains("groups of 16"), "{e}");
    let dir = altered("ct_nvfp4", "q-global", |_, t| {
        t.remove(&format!("{k}.weight_global_scale"));
    });
    let e = load(&dir);
    assert!(e.contains(&format!("missing {k}.weight_global_scale")), "{e}");
    let dir = altered("fp8_block", "q-block", |_, t| {
        let s = Tensor::ones(&[3, 1], DType::F32).unwrap();
        t.insert(format!("{k}.weight_scale_inv"), s);
    });
    let e = load(&dir);
    assert!(e.contains(&format!("{k}.weight_scale_inv")) && e.contains("[3, 1]") && e.contains("[2, 1]"), "{e}");
    let dir = altered("modelopt_nvfp4", "q-scale2", |_, t| {
        t.insert(format!("{k}.weight_scale_2"), Tensor::zeros(&[], DType::F32).unwrap());
    });
    assert!(load(&dir).contains("not a finite nonzero scale"), "{}", load(&dir));
    let dir = altered("ct_mxfp4", "q-nan-scale", |_, t| {
        let mut s: Vec<u8> = t[&format!("{k}.weight_scale")].to_vec().unwrap();
        s[5] = 255; // E8M0's NaN
        t.insert(format!("{k}.weight_scale"), Tensor::from_vec(s, &[256, 4]).unwrap());
    });
    let e = load(&dir);
    assert!(e.contains(k) && e.contains("block scale [1, 1] is NaN"), "{e}");
    let dir = altered("fp8_block", "q-noscale", |_, t| {
        t.remove(&format!("{k}.weight_scale_inv"));
    });
    let e = load(&dir);
    assert!(e.contains(&format!("{k}.weight")) && e.contains("no scale"), "{e}");
    let e = LlamaForCausalLM::from_pretrained(fixture_dir("quant").join("fp8_block"), DType::F8E4M3FN, Device::Cpu)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("not float8_e4m3fn"), "{e}");
    // A kept-quantized model refuses to save as a dense checkpoint.
    let opts = PretrainedOptions::new(DType::F32, Device::Cpu).with_quantized(QuantizedLoad::Keep);
    let m = LlamaForCausalLM::from_pretrained_with(fixture_dir("quant").join("ct_mxfp4"), &opts).unwrap();
    assert_eq!(m.named_parameters().len(), 3 + 2 * 2, "only embeddings, lm_head and norms stay parameters");
    let e = m.save_pretrained(temp_dir("q-save")).unwrap_err().to_string();
    assert!(e.contains("keeps some weights quantized"), "{e}");
}

fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let num: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// kiln writes compressed-tensors checkpoints of other architectures and
/// dims (Qwen3, blocks that do not divide the dims); an independent numpy
/// dequantization reads the same weights bit for bit, kiln reads them back
/// dequantized and kept quantized with the logits of the dense model holding
/// those weights, and the in-memory quantized model computes the same.
#[test]
fn checkpoints_kiln_quantizes_read_back_everywhere() {
    use kiln::nn::quantize::{quantize_model, save_quantized, QuantScheme};
    let python = support::python_with_safetensors();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_quantized_checkpoint.py");
    for fixture in ["qwen3", "llama", "qwen3_moe"] {
        let src = fixture_dir(fixture);
        let dense = LlamaForCausalLM::from_pretrained(&src, DType::F32, Device::Cpu).unwrap();
        let ids = golden(&src)["input_ids"].clone();
        let state = dense.state_dict();
        let schemes =
            [QuantScheme::Fp8Block([48, 20]), QuantScheme::Fp8Channel, QuantScheme::Nvfp4, QuantScheme::Mxfp4];
        for scheme in schemes {
            let what = format!("{fixture} {scheme:?}");
            let dir = temp_dir(&format!("q-out-{fixture}-{scheme:?}").replace([' ', '[', ']', ','], ""));
            save_quantized(&dense, &dir, scheme).unwrap();
            let py_out = dir.join("numpy_dequantized.safetensors");
            let out = std::process::Command::new(&python).arg(&script).arg(&dir).arg(&py_out).output().unwrap();
            assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
            let numpy = load_safetensors(&py_out).unwrap();
            let q = QuantizationConfig::from_dir(&dir).unwrap().expect("quantized");
            let ck = load_quantized(&dir, &q, None).unwrap();
            assert_eq!(numpy.len(), ck.quantized.len(), "{what}");
            let mine = ck.dequantized(None).unwrap();
            let mut weights = state.clone();
            for (k, w) in &numpy {
                let a: Vec<u32> = w.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
                let b: Vec<u32> = mine[k].to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
                assert!(a == b, "{what}: {k}: numpy and kiln dequantize differently");
                let err = rel_l2(w, &state[k]);
                let bound = if matches!(scheme, QuantScheme::Nvfp4 | QuantScheme::Mxfp4) { 0.2 } else { 0.04 };
                assert!(err < bound, "{what}: {k}: quantization error {err}");
                weights.insert(k.clone(), w.clone());
            }
            let cfg = dense.config().clone();
            let reference = LlamaForCausalLM::from_weights(&cfg, &weights, DType::F32, Device::Cpu).unwrap();
            let _g = kiln::autograd::no_grad();
            let want = reference.forward(&ids, None).unwrap();
            let dq = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
            assert_close(&format!("{what} dequantized"), &dq.forward(&ids, None).unwrap(), &want, 1e-5, 1e-5);
            let opts = PretrainedOptions::new(DType::F32, Device::Cpu).with_quantized(QuantizedLoad::Keep);
            let kept = LlamaForCausalLM::from_pretrained_with(&dir, &opts).unwrap();
            let got = kept.forward(&ids, None).unwrap();
            assert_close(&format!("{what} kept quantized"), &got, &want, 1e-4, 1e-5);
            let mut in_memory = dense.clone();
            quantize_model(&mut in_memory, scheme).unwrap();
            let same = in_memory.forward(&ids, None).unwrap();
            assert_close(&format!("{what} quantized in memory"), &same, &got, 0.0, 0.0);
        }
    }
}

/// transformers with compressed-tensors loads what kiln writes: every
/// quantized weight it decompresses (to bf16) is kiln's exact dequantization
/// rounded to bf16, within one bf16 ulp; the dense tensors come back as kiln
/// saved them. A mixture of experts included (transformers fuses its experts
/// in memory: `experts.gate_up_proj[e]` is expert `e`'s gate and up weights
/// stacked, `experts.down_proj[e]` its down weight) in FP8 per channel: the
/// one scheme transformers 5.24 decompresses into fused experts. It refuses
/// block FP8 there (it multiplies the stacked weights by the stacked block
/// scales without expanding the blocks: "The size of tensor a (48) must
/// match the size of tensor b (3)") and MXFP4, and decompresses NVFP4
/// experts to other values than the file holds (most elements beyond one
/// bf16 ulp), while the same formats match on the dense models' Linears, and
/// the MoE files in every scheme match the numpy reader of
/// `checkpoints_kiln_quantizes_read_back_everywhere`.
/// gpt-oss's MXFP4 expert layout (`*_blocks`, `*_scales`) read into kiln's
/// quantized weights: every expert's weight, and the gate and up halves of
/// its interleaved `gate_up_proj`, dequantize to exactly what transformers'
/// `convert_moe_packed_tensors` gives (random codes over every E2M1 value and
/// a range of E8M0 exponents); malformed tensors are refused.
#[test]
fn gpt_oss_mxfp4_experts_read_as_transformers_dequantizes_them() {
    use kiln::nn::io::quant::{gpt_oss_mxfp4_experts, split_interleaved_gate_up};
    let python = support::python_with_transformers();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/make_gpt_oss_experts.py");
    let file = temp_dir("gpt-oss-experts").join("experts.safetensors");
    let out = std::process::Command::new(&python).arg(&script).arg(&file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t = load_safetensors(&file).unwrap();
    let bits =
        |x: &Tensor| x.contiguous().unwrap().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();

    let down = gpt_oss_mxfp4_experts(&t["down_proj_blocks"], &t["down_proj_scales"]).unwrap();
    let gate_up = gpt_oss_mxfp4_experts(&t["gate_up_proj_blocks"], &t["gate_up_proj_scales"]).unwrap();
    assert_eq!((down.len(), gate_up.len()), (3, 3));
    for e in 0..3 {
        // transformers' tensors are [in, out]: kiln's weights [out, in] transposed.
        let theirs_down = t["down_proj"].select(0, e as isize).unwrap().t().unwrap();
        assert_eq!(down[e].shape, [64, 96]);
        assert!(bits(&down[e].dequantize().unwrap()) == bits(&theirs_down), "expert {e}: down_proj");
        let theirs_gu = t["gate_up_proj"].select(0, e as isize).unwrap().t().unwrap();
        assert!(bits(&gate_up[e].dequantize().unwrap()) == bits(&theirs_gu), "expert {e}: gate_up_proj");
        let (gate, up) = split_interleaved_gate_up(&gate_up[e]).unwrap();
        let every_other = |first: isize| {
            let idx = Tensor::from_vec((0..96i64).map(|i| 2 * i + first as i64).collect(), &[96]).unwrap();
            theirs_gu.index_select(0, &idx).unwrap()
        };
        assert_eq!(gate.shape, [96, 64]);
        assert!(bits(&gate.dequantize().unwrap()) == bits(&every_other(0)), "expert {e}: gate rows");
        assert!(bits(&up.dequantize().unwrap()) == bits(&every_other(1)), "expert {e}: up rows");
    }

    let blocks = &t["down_proj_blocks"];
    let e = gpt_oss_mxfp4_experts(&blocks.narrow(3, 0, 8).unwrap(), &t["down_proj_scales"]).unwrap_err();
    assert!(e.to_string().contains("blocks must be uint8 [experts, out, in / 32, 16]"), "{e}");
    let e = gpt_oss_mxfp4_experts(blocks, &t["down_proj_scales"].narrow(2, 0, 2).unwrap()).unwrap_err();
    assert!(e.to_string().contains("scales must be uint8 [3, 64, 3]"), "{e}");
    let e = gpt_oss_mxfp4_experts(&blocks.to_dtype(DType::I64).unwrap(), &t["down_proj_scales"]).unwrap_err();
    assert!(e.to_string().contains("blocks must be uint8"), "{e}");
}

/// Expert `e`'s weight `name` (`...mlp.experts.{e}.{gate,up,down}_proj.weight`)
/// cut out of transformers' fused expert tensors, if `name` is one.
fn fused_expert(theirs: &BTreeMap<String, Tensor>, name: &str) -> Option<Tensor> {
    let (layer, rest) = name.split_once(".mlp.experts.")?;
    let (e, proj) = rest.split_once('.')?;
    let e: isize = e.parse().ok()?;
    let fused = |n: &str| theirs.get(&format!("{layer}.mlp.experts.{n}")).expect("transformers' fused experts");
    let t = match proj {
        "gate_proj.weight" | "up_proj.weight" => {
            let gu = fused("gate_up_proj").select(0, e).ok()?;
            let half = gu.shape()[0] as isize / 2;
            gu.narrow(0, if proj == "gate_proj.weight" { 0 } else { half }, half as usize).ok()?
        }
        "down_proj.weight" => fused("down_proj").select(0, e).ok()?,
        _ => return None,
    };
    Some(t)
}

#[test]
fn transformers_loads_what_kiln_quantizes() {
    use kiln::nn::quantize::{save_quantized, QuantScheme};
    let python = support::python_with_transformers();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_quantized_with_transformers.py");
    for fixture in ["qwen3", "llama", "qwen3_moe"] {
        let dense = LlamaForCausalLM::from_pretrained(fixture_dir(fixture), DType::F32, Device::Cpu).unwrap();
        let state = dense.state_dict();
        let schemes =
            [QuantScheme::Fp8Block([48, 20]), QuantScheme::Fp8Channel, QuantScheme::Nvfp4, QuantScheme::Mxfp4];
        for scheme in schemes {
            if fixture == "qwen3_moe" && !matches!(scheme, QuantScheme::Fp8Channel) {
                continue;
            }
            let what = format!("{fixture} {scheme:?}");
            let dir = temp_dir(&format!("q-tf-{fixture}-{scheme:?}").replace([' ', '[', ']', ','], ""));
            save_quantized(&dense, &dir, scheme).unwrap();
            let out_file = dir.join("transformers_weights.safetensors");
            let out = std::process::Command::new(&python).arg(&script).arg(&dir).arg(&out_file).output().unwrap();
            assert!(out.status.success(), "{what}: transformers refused it:\n{}", String::from_utf8_lossy(&out.stderr));
            let theirs = load_safetensors(&out_file).unwrap();
            let q = QuantizationConfig::from_dir(&dir).unwrap().expect("quantized");
            let ck = load_quantized(&dir, &q, None).unwrap();
            let mine = ck.dequantized(None).unwrap();
            assert_eq!(mine.len(), state.len(), "{what}: kiln's weights");
            for (k, want) in &mine {
                let t = match fused_expert(&theirs, k) {
                    Some(t) => t,
                    None => theirs.get(k).unwrap_or_else(|| panic!("{what}: transformers has no {k}")).clone(),
                };
                let want: Vec<f32> =
                    want.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec().unwrap();
                let got: Vec<f32> = t.to_vec().unwrap();
                let bad = got.iter().zip(&want).filter(|(g, w)| (*g - *w).abs() > w.abs() * 2f32.powi(-7)).count();
                assert_eq!(bad, 0, "{what}: {k}: {bad} elements beyond one bf16 ulp of kiln's");
            }
        }
    }
}

/// A one-layer Llama of hidden size 32 (so its products sum 32 terms).
fn tiny_lm(tied: bool) -> kiln::nn::LlamaConfig {
    kiln::nn::LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": {tied}}}"#
    ))
    .unwrap()
}

/// A kept-quantized `lm_head` (an untied model whose checkpoint quantizes it)
/// gives the logits of its dequantized weight, as the decoder's Linears do.
#[test]
fn a_quantized_lm_head_gives_the_logits_of_its_dequantized_weight() {
    use kiln::nn::quantize::{quantize_weight, QuantScheme};
    let cfg = tiny_lm(false);
    kiln::manual_seed(3);
    let mut model = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let head = model.lm_head.as_ref().unwrap().weight.clone();
    let q = quantize_weight(&head, QuantScheme::Fp8Channel).unwrap();
    let dense = Tensor::dequantize(&q.codes, &q.scales, &q.spec).unwrap();
    let ids = Tensor::new([[1i64, 5, 9, 2]]).unwrap();
    let mut reference = model.clone();
    reference.lm_head.as_mut().unwrap().weight = dense;
    let want = reference.forward(&ids, None).unwrap();
    model.keep_quantized(&BTreeMap::from([("lm_head".to_string(), q)]), Device::Cpu).unwrap();
    assert!(model.output_weight().is_none(), "a quantized head has no dense weight to hand out");
    let got = model.forward(&ids, None).unwrap();
    // The two products sum 32 terms in f32, maybe in different orders: within
    // 32 * 2^-24 of the terms' magnitudes, whose sums stay below 1 here.
    assert!(want.abs().unwrap().max().unwrap().item_f64().unwrap() > 0.05, "logits too small to tell");
    assert_close("logits", &got, &want, 32.0 * 2f64.powi(-24), 0.0);
}

/// `quantize_lm_head` on a tied model: the head becomes a quantized Linear of
/// its own (logits of the dequantized embedding matrix), the lookup keeps
/// the dense table, and a second call is an error.
#[test]
fn a_tied_head_quantizes_into_a_linear_of_its_own() {
    use kiln::nn::quantize::{quantize_lm_head, quantize_weight, QuantScheme};
    let cfg = tiny_lm(true);
    kiln::manual_seed(4);
    let mut model = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let table = model.model.embed_tokens.weight.clone();
    let q = quantize_weight(&table, QuantScheme::Nvfp4).unwrap();
    let mut reference = model.clone();
    reference.lm_head = Some(
        kiln::nn::layers::Linear::from_weights(Tensor::dequantize(&q.codes, &q.scales, &q.spec).unwrap(), None)
            .unwrap(),
    );
    quantize_lm_head(&mut model, QuantScheme::Nvfp4).unwrap();
    assert!(model.lm_head.as_ref().unwrap().is_quantized());
    assert!(model.model.embed_tokens.weight.same(&table), "the lookup keeps the dense table");
    let ids = Tensor::new([[3i64, 60, 7]]).unwrap();
    let (got, want) = (model.forward(&ids, None).unwrap(), reference.forward(&ids, None).unwrap());
    assert!(want.abs().unwrap().max().unwrap().item_f64().unwrap() > 0.05, "logits too small to tell");
    // Sums of 32 terms in f32, maybe in different orders (see above).
    assert_close("logits", &got, &want, 32.0 * 2f64.powi(-24), 0.0);
    assert!(quantize_lm_head(&mut model, QuantScheme::Nvfp4).is_err(), "a quantized head quantized again");
}
