//! Optimizer, LR schedule and gradient clipping tests: SGD and AdamW against
//! numbers computed by PyTorch 2.15 (`torch.optim.SGD` / `AdamW`, default
//! single-tensor implementation, f32), the fused CPU path against the op-by-op
//! path (bit for bit), state save/restore, parameter groups, and errors.
use kiln::nn::clip::{clip_grad_norm_, clip_grad_norm_checked_, clip_grad_value_, grad_norm, GradAccumulation};
use kiln::nn::optim::{decay_groups, AdamW, AdamWConfig, IntoParamGroups, Optimizer, ParamGroup, SgdConfig, SGD};
use kiln::nn::schedule::LrSchedule;
use kiln::prelude::*;

mod support;

// ---- PyTorch reference values ----------------------------------------------------------------
// Generated with this script (PyTorch 2.15.0, CPU, one thread); each row is the
// parameter after one more step:
//
//   p0 = torch.tensor([0.5, -1.25, 2.0, 0.0, -0.75, 3.5])
//   grads = GRADS (below), one per step
//   p = p0.clone().requires_grad_(); opt = Cls([p], **kw)
//   for k in range(5): p.grad = grads[k].clone(); opt.step(); record(p)
//
// configs: sgd_plain SGD(lr=0.1); sgd_momentum SGD(lr=0.1, momentum=0.9);
// sgd_dampening_wd SGD(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01);
// sgd_nesterov_wd SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1);
// adamw_default AdamW(lr=1e-3); adamw_llm AdamW(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1);
// adamw_amsgrad AdamW(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True);
// adamw_big_lerp AdamW(lr=0.05, betas=(0.3, 0.5), weight_decay=0) (lerp weight >= 0.5);
// adamw_lr_changes AdamW(lr=0.1, weight_decay=0.01) with param_groups[0]['lr'] set to
// [0.0, 0.05, 0.1, 0.075, 0.01] before each step;
// adamw_groups AdamW([{params: [p[:3]]}, {params: [p[3:]], lr: 0.5, weight_decay: 0}], lr=0.1,
// weight_decay=0.2), 3 steps, the two halves concatenated.

const P0: [f32; 6] = [0.5, -1.25, 2.0, 0.0, -0.75, 3.5];
const GRADS: [[f32; 6]; 5] = [
    [0.1, -0.2, 0.3, -0.4, 0.5, 1e-3],
    [-0.3, 0.25, 0.05, 0.0, -1.5, 2.0],
    [0.7, -0.1, -0.2, 0.3, 0.05, -0.5],
    [0.2, 0.2, 0.2, -0.2, -0.2, -0.2],
    [1e-4, -2.0, 0.9, 0.01, 0.3, 0.0],
];
const SGD_PLAIN: [[f32; 6]; 5] = [
    [0.49, -1.23, 1.97, 0.040000003, -0.8, 3.4999],
    [0.52000004, -1.255, 1.965, 0.040000003, -0.65000004, 3.2999],
    [0.45000005, -1.245, 1.985, 0.010000002, -0.65500003, 3.3499],
    [0.43000004, -1.265, 1.965, 0.030000003, -0.63500005, 3.3699],
    [0.42999002, -1.0649999, 1.875, 0.029000003, -0.6650001, 3.3699],
];
const SGD_MOMENTUM: [[f32; 6]; 5] = [
    [0.49, -1.23, 1.97, 0.040000003, -0.8, 3.4999],
    [0.51100004, -1.237, 1.9380001, 0.076000005, -0.695, 3.2998102],
    [0.45990005, -1.2333, 1.9292, 0.0784, -0.6055, 3.1697292],
    [0.39391005, -1.24997, 1.90128, 0.100559995, -0.50495, 3.0726564],
    [0.33450904, -1.064973, 1.786152, 0.11950399, -0.444455, 2.9852908],
];
const SGD_DAMPENING_WD: [[f32; 6]; 5] = [
    [0.49475, -1.239375, 1.984, 0.020000001, -0.774625, 3.4982],
    [0.50087684, -1.2391912, 1.9687556, 0.035993002, -0.7415539, 3.4255357],
    [0.481103, -1.2351104, 1.9628711, 0.038274806, -0.7165875, 3.3837051],
    [0.45811555, -1.2384136, 1.9504764, 0.047086854, -0.68936354, 3.3560565],
    [0.43956175, -1.1706226, 1.908378, 0.05377001, -0.6778431, 3.332763],
];
const SGD_DAMPENING_WD_MOMENTUM_BUFFER: [f32; 6] =
    [0.3710761, -1.355819, 0.8419681, -0.13366313, -0.23040886, 0.46587074];
const SGD_NESTEROV_WD: [[f32; 6]; 5] = [
    [0.4715, -1.18825, 1.905, 0.076, -0.83075, 3.43331],
    [0.5073915, -1.1868482, 1.818805, 0.106956, -0.5643907, 2.9596462],
    [0.37429693, -1.1322308, 1.7663171, 0.07646823, -0.46592072, 2.7830153],
    [0.2769667, -1.1192443, 1.6458874, 0.11353894, -0.33102474, 2.590807],
    [0.20545678, -0.69848096, 1.3691256, 0.12553357, -0.28252217, 2.3756413],
];
const ADAMW_DEFAULT: [[f32; 6]; 5] = [
    [0.498995, -1.2489874, 1.9989799, 0.0009999999, -0.7509925, 3.498965],
    [0.49948418, -1.2491376, 1.9981766, 0.0016700482, -0.7504908, 3.4981854],
    [0.49905416, -1.2490546, 1.998002, 0.0017007141, -0.75012165, 3.4977472],
    [0.49856573, -1.2492903, 1.997591, 0.0019400672, -0.74974734, 3.4974396],
    [0.49815205, -1.2487826, 1.9969373, 0.0021321923, -0.74953616, 3.4971743],
];
const ADAMW_LLM: [[f32; 6]; 5] = [
    [0.48950002, -1.23875, 1.988, 0.010000001, -0.75925, 3.4865],
    [0.49390346, -1.2391341, 1.978084, 0.01677648, -0.7535978, 3.4756608],
    [0.4892441, -1.237185, 1.974546, 0.017068645, -0.7492177, 3.4681568],
    [0.48396462, -1.2384413, 1.9686302, 0.019473184, -0.74474484, 3.4619312],
    [0.47937787, -1.2324764, 1.9605569, 0.021423068, -0.7419113, 3.456108],
];
const ADAMW_AMSGRAD: [[f32; 6]; 5] = [
    [0.4795002, -1.2287501, 1.978, 0.019999951, -0.76925, 3.47652],
    [0.48993066, -1.2319362, 1.9610034, 0.03251923, -0.75757074, 3.4573634],
    [0.479795, -1.2295176, 1.957792, 0.031235615, -0.74939406, 3.4463284],
    [0.4687649, -1.2344558, 1.9484621, 0.03536075, -0.741292, 3.4384217],
    [0.46002844, -1.2212068, 1.9321209, 0.038334854, -0.7373274, 3.4314885],
];
const ADAMW_AMSGRAD_EXP_AVG: [f32; 6] = [0.09909201, -0.37158403, 0.216096, -0.024368, -0.07824, 0.10888191];
const ADAMW_AMSGRAD_EXP_AVG_SQ: [f32; 6] =
    [0.006167819, 0.041484684, 0.0097768335, 0.0028160438, 0.025553722, 0.041658223];
const ADAMW_AMSGRAD_MAX_EXP_AVG_SQ: [f32; 6] =
    [0.00623012, 0.041484684, 0.0097768335, 0.0028434785, 0.025553722, 0.042100012];
const ADAMW_BIG_LERP: [[f32; 6]; 5] = [
    [0.45, -1.2, 1.95, 0.05, -0.8, 3.4500005],
    [0.49126428, -1.2311602, 1.9197412, 0.0699852, -0.7587357, 3.4028878],
    [0.45108745, -1.2221217, 1.9495188, 0.035142932, -0.7432501, 3.3997126],
    [0.4175487, -1.2574108, 1.9220166, 0.053155392, -0.7246658, 3.4073215],
    [0.40315396, -1.2101382, 1.8717978, 0.058742877, -0.7405824, 3.4105842],
];
const ADAMW_LR_CHANGES: [[f32; 6]; 5] = [
    [0.5, -1.25, 2.0, 0.0, -0.75, 3.5],
    [0.5244595, -1.2575116, 1.9598336, 0.033502914, -0.7249155, 3.4610264],
    [0.481433, -1.2492027, 1.9424195, 0.03653768, -0.6880289, 3.4172382],
    [0.4448157, -1.2668866, 1.9116368, 0.05446303, -0.66000015, 3.3942287],
    [0.44068453, -1.2618074, 1.9051082, 0.056379028, -0.6578973, 3.3915849],
];
const ADAMW_GROUPS: [[f32; 6]; 3] = [
    [0.39000002, -1.125, 1.86, 0.5, -1.25, 3.000005],
    [0.43161902, -1.1187732, 1.7444673, 0.8350291, -1.0029051, 2.6277692],
    [0.38048464, -1.0893464, 1.6941236, 0.85037047, -0.82209665, 2.4261332],
];
const CLIP_NORM: f32 = 13.202746;
const CLIP_X: [f32; 3] = [0.5680636, -0.75741816, 2.2722545];
const CLIP_Y: [f32; 4] = [0.18935454, -0.37870908, 0.09467727, 0.047338635];
const CLIP_SMALL_NORM: f32 = 0.3;

/// Element-wise `|got - want| <= atol + rtol * |want|`, with a readable failure.
#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w} (all: {got:?})");
    }
}

fn param(values: &[f32]) -> Tensor {
    let p = Tensor::from_slice(values, &[values.len()]).unwrap();
    p.requires_grad_(true).unwrap();
    p
}

fn set_grad(p: &Tensor, g: &[f32]) {
    p.set_grad(Some(Tensor::from_slice(g, p.shape()).unwrap()));
}

/// Runs `steps` steps of `opt` on a parameter initialised to `P0` with the
/// reference gradients, returning the parameter after each step.
fn run(make: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer>, lrs: Option<&[f64]>) -> (Tensor, Vec<Vec<f32>>) {
    let p = param(&P0);
    let mut opt = make(vec![("p".to_string(), p.clone())]);
    let mut hist = vec![];
    for (k, g) in GRADS.iter().enumerate() {
        if let Some(lrs) = lrs {
            opt.set_lr(lrs[k]);
        }
        set_grad(&p, g);
        opt.step().unwrap();
        hist.push(p.to_vec::<f32>().unwrap());
    }
    (p, hist)
}

#[track_caller]
fn check_history(name: &str, got: &[Vec<f32>], want: &[[f32; 6]]) {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(&format!("{name} step {}", k + 1), g, w, 1e-6, 1e-6);
    }
}

fn sgd(c: SgdConfig) -> impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer> {
    move |p| Box::new(SGD::new(p, c).unwrap())
}

fn adamw(c: AdamWConfig) -> impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer> {
    move |p| Box::new(AdamW::new(p, c).unwrap())
}

#[test]
fn sgd_matches_pytorch() {
    let base = SgdConfig::default();
    let (_, h) = run(sgd(SgdConfig { lr: 0.1, ..base }), None);
    check_history("sgd_plain", &h, &SGD_PLAIN);
    let (_, h) = run(sgd(SgdConfig { lr: 0.1, momentum: 0.9, ..base }), None);
    check_history("sgd_momentum", &h, &SGD_MOMENTUM);
    let c = SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.3, weight_decay: 0.01, ..base };
    let (_, h) = run(sgd(c), None);
    check_history("sgd_dampening_wd", &h, &SGD_DAMPENING_WD);
    let c = SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.1, ..base };
    let (_, h) = run(sgd(c), None);
    check_history("sgd_nesterov_wd", &h, &SGD_NESTEROV_WD);
}

#[test]
fn sgd_momentum_buffer_matches_pytorch() {
    let p = param(&P0);
    let c = SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.3, weight_decay: 0.01, ..Default::default() };
    let mut opt = SGD::new(vec![("w".to_string(), p.clone())], c).unwrap();
    assert!(opt.momentum_buffer("w").is_none());
    for g in &GRADS {
        set_grad(&p, g);
        opt.step().unwrap();
    }
    let buf = opt.momentum_buffer("w").unwrap().to_vec::<f32>().unwrap();
    assert_close("momentum_buffer", &buf, &SGD_DAMPENING_WD_MOMENTUM_BUFFER, 1e-6, 1e-6);
}

#[test]
fn adamw_matches_pytorch() {
    let d = AdamWConfig::default();
    assert_eq!((d.lr, d.betas, d.eps, d.weight_decay, d.amsgrad), (1e-3, (0.9, 0.999), 1e-8, 1e-2, false));
    let (_, h) = run(adamw(d), None);
    check_history("adamw_default", &h, &ADAMW_DEFAULT);
    let (_, h) = run(adamw(AdamWConfig { lr: 0.01, betas: (0.9, 0.95), weight_decay: 0.1, ..d }), None);
    check_history("adamw_llm", &h, &ADAMW_LLM);
    let c = AdamWConfig { lr: 0.02, betas: (0.8, 0.99), eps: 1e-6, weight_decay: 0.05, amsgrad: true };
    let (_, h) = run(adamw(c), None);
    check_history("adamw_amsgrad", &h, &ADAMW_AMSGRAD);
    let (_, h) = run(adamw(AdamWConfig { lr: 0.05, betas: (0.3, 0.5), weight_decay: 0.0, ..d }), None);
    check_history("adamw_big_lerp", &h, &ADAMW_BIG_LERP);
    let lrs = [0.0, 0.05, 0.1, 0.075, 0.01];
    let (_, h) = run(adamw(AdamWConfig { lr: 0.1, weight_decay: 0.01, ..d }), Some(&lrs));
    check_history("adamw_lr_changes", &h, &ADAMW_LR_CHANGES);
}

#[test]
fn adamw_state_matches_pytorch() {
    let p = param(&P0);
    let c = AdamWConfig { lr: 0.02, betas: (0.8, 0.99), eps: 1e-6, weight_decay: 0.05, amsgrad: true };
    let mut opt = AdamW::new(vec![("w".to_string(), p.clone())], c).unwrap();
    assert!(opt.state("w").is_none());
    for g in &GRADS {
        set_grad(&p, g);
        opt.step().unwrap();
    }
    let st = opt.state("w").unwrap();
    assert_eq!(st.step, 5);
    let v = |t: &Tensor| t.to_vec::<f32>().unwrap();
    assert_close("exp_avg", &v(&st.exp_avg), &ADAMW_AMSGRAD_EXP_AVG, 1e-7, 1e-6);
    assert_close("exp_avg_sq", &v(&st.exp_avg_sq), &ADAMW_AMSGRAD_EXP_AVG_SQ, 1e-9, 1e-6);
    let mx = v(st.max_exp_avg_sq.as_ref().unwrap());
    assert_close("max_exp_avg_sq", &mx, &ADAMW_AMSGRAD_MAX_EXP_AVG_SQ, 1e-9, 1e-6);
    assert_eq!(st.exp_avg.dtype(), DType::F32);
}

#[test]
fn param_groups_have_their_own_lr_and_weight_decay() {
    let a = param(&P0[..3]);
    let b = param(&P0[3..]);
    let groups = vec![
        ParamGroup::new([("a".to_string(), a.clone())]),
        ParamGroup::new([("b".to_string(), b.clone())]).with_lr(0.5).with_weight_decay(0.0),
    ];
    let mut opt = AdamW::new(groups, AdamWConfig { lr: 0.1, weight_decay: 0.2, ..Default::default() }).unwrap();
    let lrs: Vec<f64> = opt.param_groups().iter().map(ParamGroup::lr).collect();
    assert_eq!(lrs, [0.1, 0.5]);
    assert_eq!(opt.param_groups()[0].weight_decay, Some(0.2));
    assert_eq!(opt.initial_lrs(), [0.1, 0.5]);
    for (k, g) in GRADS[..3].iter().enumerate() {
        set_grad(&a, &g[..3]);
        set_grad(&b, &g[3..]);
        opt.step().unwrap();
        let mut got = a.to_vec::<f32>().unwrap();
        got.extend(b.to_vec::<f32>().unwrap());
        assert_close(&format!("groups step {}", k + 1), &got, &ADAMW_GROUPS[k], 1e-6, 1e-6);
    }
    // A schedule scales each group's own initial learning rate.
    opt.set_lr_factor(0.5);
    let lrs: Vec<f64> = opt.param_groups().iter().map(ParamGroup::lr).collect();
    assert_eq!(lrs, [0.05, 0.25]);
    opt.param_groups_mut()[1].lr = Some(0.01);
    assert_eq!(opt.param_groups()[1].lr(), 0.01);
    assert_eq!(opt.lr(), 0.05);
}

#[test]
fn decay_groups_exempt_norms_and_biases() {
    let named = vec![
        ("model.embed_tokens.weight".to_string(), Tensor::zeros(&[4, 2], DType::F32).unwrap()),
        ("model.layers.0.input_layernorm.weight".to_string(), Tensor::ones(&[2], DType::F32).unwrap()),
        ("model.layers.0.self_attn.q_proj.weight".to_string(), Tensor::zeros(&[2, 2], DType::F32).unwrap()),
        ("model.layers.0.self_attn.q_proj.bias".to_string(), Tensor::zeros(&[2], DType::F32).unwrap()),
        ("model.layers.0.self_attn.q_norm.weight".to_string(), Tensor::ones(&[2], DType::F32).unwrap()),
    ];
    let groups = decay_groups(named.clone(), 0.1);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].names, ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]);
    assert_eq!(groups[0].weight_decay, Some(0.1));
    assert_eq!(groups[1].names.len(), 3);
    assert_eq!(groups[1].weight_decay, Some(0.0));
    assert_eq!(groups[0].numel(), 12);
    // Only matrices: one group.
    assert_eq!(decay_groups(named[..1].to_vec(), 0.1).len(), 1);
    // Groups of the split feed an optimizer directly.
    for p in named.iter().map(|(_, p)| p) {
        p.requires_grad_(true).unwrap();
    }
    let opt = AdamW::new(decay_groups(named, 0.1), AdamWConfig::default()).unwrap();
    assert_eq!(opt.params().len(), 5);
}

/// A parameter with the same values as `P0` viewed as `[2, 3]`, but stored
/// transposed (a non-contiguous leaf), which takes the op-by-op path.
fn non_contiguous_param(dtype: DType) -> Tensor {
    let stored = Tensor::from_slice(&P0, &[2, 3]).unwrap().t().unwrap().contiguous().unwrap().to_dtype(dtype).unwrap();
    let p = stored.t().unwrap().detach();
    assert!(!p.is_contiguous());
    p.requires_grad_(true).unwrap();
    p
}

#[test]
fn fused_and_op_by_op_updates_agree_bitwise() {
    let d = AdamWConfig::default();
    let configs = [
        AdamWConfig { lr: 0.01, betas: (0.9, 0.95), weight_decay: 0.1, ..d },
        AdamWConfig { lr: 0.02, betas: (0.8, 0.99), eps: 1e-6, weight_decay: 0.05, amsgrad: true },
        AdamWConfig { lr: 0.05, betas: (0.3, 0.5), weight_decay: 0.0, ..d },
    ];
    for dtype in [DType::F32, DType::F64] {
        for c in configs {
            let fused = Tensor::from_slice(&P0, &[2, 3]).unwrap().to_dtype(dtype).unwrap().detach();
            fused.requires_grad_(true).unwrap();
            let strided = non_contiguous_param(dtype);
            let mut o1 = AdamW::new(vec![fused.clone()], c).unwrap();
            let mut o2 = AdamW::new(vec![strided.clone()], c).unwrap();
            for g in &GRADS {
                let g = Tensor::from_slice(g, &[2, 3]).unwrap().to_dtype(dtype).unwrap();
                fused.set_grad(Some(g.clone()));
                strided.set_grad(Some(g));
                let v0 = fused.version();
                o1.step().unwrap();
                o2.step().unwrap();
                // The fused path writes each parameter once per step (the op-by-op one
                // writes twice when it decays): evidence that it ran.
                if c.weight_decay != 0.0 {
                    assert_eq!(fused.version(), v0 + 1, "{dtype} {c:?}: fused path not taken");
                }
            }
            let (a, b) = (fused.to_vec_f64().unwrap(), strided.to_vec_f64().unwrap());
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{dtype} {c:?}: fused {a:?} vs op-by-op {b:?}");
            let (s1, s2) = (o1.state_dict().unwrap(), o2.state_dict().unwrap());
            for ((k1, t1), (k2, t2)) in s1.iter().zip(&s2) {
                assert_eq!(k1, k2);
                assert_eq!(t1.to_vec_f64().unwrap(), t2.to_vec_f64().unwrap(), "{dtype} {c:?}: state {k1}");
            }
        }
    }
}

#[test]
fn bf16_parameters_use_bf16_state() {
    let p = Tensor::from_slice(&P0, &[6]).unwrap().to_dtype(DType::BF16).unwrap();
    p.requires_grad_(true).unwrap();
    let mut opt =
        AdamW::new(vec![("p".to_string(), p.clone())], AdamWConfig { lr: 0.01, ..Default::default() }).unwrap();
    p.set_grad(Some(Tensor::from_slice(&GRADS[0], &[6]).unwrap().to_dtype(DType::BF16).unwrap()));
    opt.step().unwrap();
    let st = opt.state("p").unwrap();
    assert_eq!((st.exp_avg.dtype(), st.exp_avg_sq.dtype(), p.dtype()), (DType::BF16, DType::BF16, DType::BF16));
    // First step: every element moves by about lr * sign(g) (bf16 rounding aside).
    let after = p.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    for ((a, b), g) in after.iter().zip(P0).zip(GRADS[0]) {
        let want = b * (1.0 - 0.01 * 0.01) - 0.01 * g.signum();
        assert!((a - want).abs() < 0.02, "{a} vs {want}");
    }
}

#[test]
fn updates_are_in_place_and_seen_by_views() {
    // Two parameters that share one flat buffer (at offsets 0 and 3), plus a view taken before the step.
    let flat = Tensor::from_slice(&P0, &[6]).unwrap();
    let a = flat.narrow(0, 0, 3).unwrap().detach();
    let b = flat.narrow(0, 3, 3).unwrap().detach();
    a.requires_grad_(true).unwrap();
    b.requires_grad_(true).unwrap();
    let view = a.narrow(0, 1, 2).unwrap();
    let mut opt = SGD::new(vec![a.clone(), b.clone()], SgdConfig { lr: 1.0, ..Default::default() }).unwrap();
    set_grad(&a, &[1.0, 2.0, 3.0]);
    set_grad(&b, &[0.5, 0.5, 0.5]);
    opt.step().unwrap();
    assert_eq!(flat.to_vec::<f32>().unwrap(), [-0.5, -3.25, -1.0, -0.5, -1.25, 3.0]);
    assert_eq!(view.to_vec::<f32>().unwrap(), [-3.25, -1.0]);
    // The same through the fused AdamW path (contiguous parameters at a storage offset).
    let mut opt =
        AdamW::new(vec![a.clone(), b.clone()], AdamWConfig { lr: 0.1, weight_decay: 0.0, ..Default::default() })
            .unwrap();
    set_grad(&a, &[1.0, -1.0, 1.0]);
    set_grad(&b, &[-1.0, 1.0, 0.0]);
    opt.step().unwrap();
    assert_close("flat", &flat.to_vec::<f32>().unwrap(), &[-0.6, -3.15, -1.1, -0.4, -1.35, 3.0], 1e-6, 1e-6);
    assert_close("view", &view.to_vec::<f32>().unwrap(), &[-3.15, -1.1], 1e-6, 1e-6);
    // Parameters stay leaves that require grad, and the step recorded nothing.
    assert!(a.is_leaf() && a.requires_grad());
    assert!(kiln::is_grad_enabled());
}

#[test]
fn parameters_without_gradient_are_skipped() {
    let a = param(&[1.0, 2.0]);
    let b = param(&[3.0, 4.0]);
    let named = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
    let mut opt = AdamW::new(named, AdamWConfig { lr: 0.1, weight_decay: 0.5, ..Default::default() }).unwrap();
    set_grad(&a, &[1.0, 1.0]);
    opt.step().unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), [3.0, 4.0], "no grad: no decay, no update");
    assert!(opt.state("b").is_none());
    assert_eq!(opt.state("a").unwrap().step, 1);
    opt.zero_grad();
    assert!(a.grad().is_none());
}

#[test]
fn state_dict_round_trip_continues_bit_for_bit() {
    let c = AdamWConfig { lr: 0.02, betas: (0.8, 0.99), eps: 1e-6, weight_decay: 0.05, amsgrad: true };
    // Uninterrupted: 5 steps.
    let (_, full) = run(adamw(c), None);
    // 3 steps, then the state goes into a new optimizer over a new parameter with the same values.
    let p = param(&P0);
    let mut opt = AdamW::new(vec![("w".to_string(), p.clone())], c).unwrap();
    for g in &GRADS[..3] {
        set_grad(&p, g);
        opt.step().unwrap();
    }
    let state = opt.state_dict().unwrap();
    let keys: Vec<&str> = state.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["w.step", "w.exp_avg", "w.exp_avg_sq", "w.max_exp_avg_sq"]);
    assert_eq!(state[0].1.dtype(), DType::I64);
    let p2 = param(&p.to_vec::<f32>().unwrap());
    let mut opt2 = AdamW::new(vec![("w".to_string(), p2.clone())], c).unwrap();
    opt2.load_state_dict(state).unwrap();
    for g in &GRADS[3..] {
        set_grad(&p2, g);
        opt2.step().unwrap();
    }
    assert_eq!(p2.to_vec::<f32>().unwrap(), full[4]);

    // SGD with momentum likewise.
    let sc = SgdConfig { lr: 0.1, momentum: 0.9, nesterov: true, ..Default::default() };
    let (_, full) = run(sgd(sc), None);
    let p = param(&P0);
    let mut opt = SGD::new(vec![("w".to_string(), p.clone())], sc).unwrap();
    for g in &GRADS[..2] {
        set_grad(&p, g);
        opt.step().unwrap();
    }
    let p2 = param(&p.to_vec::<f32>().unwrap());
    let mut opt2 = SGD::new(vec![("w".to_string(), p2.clone())], sc).unwrap();
    opt2.load_state_dict(opt.state_dict().unwrap()).unwrap();
    for g in &GRADS[2..] {
        set_grad(&p2, g);
        opt2.step().unwrap();
    }
    assert_eq!(p2.to_vec::<f32>().unwrap(), full[4]);
}

#[test]
fn load_state_dict_refuses_mismatches() {
    let p = param(&P0);
    let mut opt = AdamW::new(vec![("w".to_string(), p.clone())], AdamWConfig::default()).unwrap();
    let z = Tensor::zeros(&[6], DType::F32).unwrap();
    let step = Tensor::scalar(3i64, DType::I64).unwrap();
    let err = |r: Result<()>| r.unwrap_err().to_string();
    let e = err(opt.load_state_dict(vec![("v.exp_avg".into(), z.clone())]));
    assert!(e.contains("\"v.exp_avg\" names no parameter"), "{e}");
    let e = err(opt.load_state_dict(vec![
        ("w.step".into(), step.clone()),
        ("w.exp_avg".into(), Tensor::zeros(&[5], DType::F32).unwrap()),
        ("w.exp_avg_sq".into(), z.clone()),
    ]));
    assert!(e.contains("w.exp_avg has shape [5], but the parameter has shape [6]"), "{e}");
    let e = err(opt.load_state_dict(vec![("w.exp_avg".into(), z.clone()), ("w.exp_avg_sq".into(), z.clone())]));
    assert!(e.contains("has no step entry"), "{e}");
    let e = err(opt.load_state_dict(vec![
        ("w.step".into(), step.clone()),
        ("w.exp_avg".into(), z.clone()),
        ("w.exp_avg_sq".into(), z.clone()),
        ("w.max_exp_avg_sq".into(), z.clone()),
    ]));
    assert!(e.contains("does not use AMSGrad"), "{e}");
    // A good one, in another dtype: converted to the parameter's.
    opt.load_state_dict(vec![
        ("w.step".into(), step),
        ("w.exp_avg".into(), z.to_dtype(DType::F64).unwrap()),
        ("w.exp_avg_sq".into(), z.clone()),
    ])
    .unwrap();
    let st = opt.state("w").unwrap();
    assert_eq!((st.step, st.exp_avg.dtype()), (3, DType::F32));
}

#[test]
fn invalid_configurations_are_refused() {
    let p = || vec![param(&[1.0])];
    let msg = |r: Result<AdamW>| r.err().unwrap().to_string();
    assert!(msg(AdamW::new(p(), AdamWConfig { lr: -1.0, ..Default::default() })).contains("invalid learning rate: -1"));
    assert!(msg(AdamW::new(p(), AdamWConfig { betas: (0.9, 1.0), ..Default::default() }))
        .contains("invalid beta parameter at index 1: 1"));
    assert!(msg(AdamW::new(p(), AdamWConfig { eps: -1e-8, ..Default::default() })).contains("invalid epsilon"));
    let w = param(&[1.0]);
    let e = msg(AdamW::new(vec![w.clone(), w], AdamWConfig::default()));
    assert!(e.contains("appears more than once"), "{e}");
    let e = msg(AdamW::new(
        vec![("a".to_string(), param(&[1.0])), ("a".to_string(), param(&[2.0]))],
        AdamWConfig::default(),
    ));
    assert!(e.contains("two parameters are named a"), "{e}");
    let ints = vec![Tensor::new([1i64, 2]).unwrap()];
    assert!(msg(AdamW::new(ints, AdamWConfig::default())).contains("optimizers need floats"));
    let bad_names =
        ParamGroup { names: vec!["x".into()], params: vec![param(&[1.0]), param(&[2.0])], ..Default::default() };
    assert!(msg(AdamW::new(bad_names, AdamWConfig::default())).contains("1 names for 2 parameters"));
    let e = SGD::new(p(), SgdConfig { nesterov: true, ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("Nesterov momentum requires a momentum and zero dampening"), "{e}");
    let e = SGD::new(p(), SgdConfig { momentum: -0.1, ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("invalid momentum value"), "{e}");
    // A gradient of the wrong shape is reported by name.
    let w = param(&[1.0, 2.0]);
    let mut opt = SGD::new(vec![("w".to_string(), w.clone())], SgdConfig::default()).unwrap();
    w.set_grad(Some(Tensor::zeros(&[3], DType::F32).unwrap()));
    let e = opt.step().unwrap_err().to_string();
    assert!(e.contains("the gradient of w has shape [3], but the parameter has shape [2]"), "{e}");
}

#[test]
fn params_are_accepted_in_every_form() {
    let t = param(&[1.0]);
    assert_eq!(vec![t.clone()].into_param_groups()[0].params.len(), 1);
    let slice: &[Tensor] = std::slice::from_ref(&t);
    assert_eq!(slice.into_param_groups().len(), 1);
    let opt = SGD::new(ParamGroup::from_tensors([t]), SgdConfig::default()).unwrap();
    assert_eq!(opt.param_groups()[0].names, ["param_groups.0.0"]);
}

// ---- schedules -------------------------------------------------------------------------------

#[test]
fn schedules_match_the_transformers_formulas() {
    // Values of transformers' lr lambdas (optimization.py), computed by hand.
    let lin = LrSchedule::Linear { warmup: 4, total: 20 };
    let want = [(0, 0.0), (1, 0.25), (3, 0.75), (4, 1.0), (12, 0.5), (19, 1.0 / 16.0), (20, 0.0), (30, 0.0)];
    for (s, f) in want {
        assert!((lin.factor(s) - f).abs() < 1e-15, "linear({s}) = {} want {f}", lin.factor(s));
    }
    let cos = LrSchedule::Cosine { warmup: 10, total: 110, min_lr_ratio: 0.0 };
    for (s, f) in
        [(0, 0.0), (5, 0.5), (10, 1.0), (35, 0.5 * (1.0 + (0.25 * std::f64::consts::PI).cos())), (60, 0.5), (110, 0.0)]
    {
        assert!((cos.factor(s) - f).abs() < 1e-12, "cosine({s}) = {} want {f}", cos.factor(s));
    }
    // Past the end the cosine climbs again (transformers' formula does the same for num_cycles=0.5).
    assert!(cos.factor(210) > 0.99);
    let cmin = LrSchedule::Cosine { warmup: 0, total: 100, min_lr_ratio: 0.1 };
    assert!((cmin.factor(0) - 1.0).abs() < 1e-15);
    assert!((cmin.factor(50) - 0.55).abs() < 1e-12);
    assert!((cmin.factor(100) - 0.1).abs() < 1e-12);
    let cw = LrSchedule::ConstantWithWarmup { warmup: 2 };
    assert_eq!([cw.factor(0), cw.factor(1), cw.factor(2), cw.factor(1000)], [0.0, 0.5, 1.0, 1.0]);
    assert_eq!(LrSchedule::Constant.factor(7), 1.0);
    // Zero warmup and zero length never divide by zero.
    assert_eq!(LrSchedule::Linear { warmup: 0, total: 0 }.factor(0), 0.0);
    assert_eq!(
        LrSchedule::from_name("cosine", 1, 2, 0.0).unwrap(),
        LrSchedule::Cosine { warmup: 1, total: 2, min_lr_ratio: 0.0 }
    );
    let e = LrSchedule::from_name("exp", 0, 0, 0.0).unwrap_err().to_string();
    assert!(e.contains("unknown schedule \"exp\""), "{e}");
}

#[test]
fn schedule_sets_each_groups_lr() {
    let groups =
        vec![ParamGroup::from_tensors([param(&[1.0])]), ParamGroup::from_tensors([param(&[1.0])]).with_lr(0.2)];
    let mut opt = SGD::new(groups, SgdConfig { lr: 0.1, ..Default::default() }).unwrap();
    let s = LrSchedule::Linear { warmup: 2, total: 10 };
    assert_eq!(s.apply(&mut opt, 1), 0.5);
    let lrs: Vec<f64> = opt.param_groups().iter().map(ParamGroup::lr).collect();
    assert_eq!(lrs, [0.05, 0.1]);
    s.apply(&mut opt, 6);
    let lrs: Vec<f64> = opt.param_groups().iter().map(ParamGroup::lr).collect();
    assert!((lrs[0] - 0.05).abs() < 1e-15 && (lrs[1] - 0.1).abs() < 1e-15, "{lrs:?}");
}

// ---- clipping and accumulation ----------------------------------------------------------------

#[test]
fn clip_grad_norm_matches_pytorch() {
    // torch.nn.utils.clip_grad_norm_([x, y], 2.5) with x.grad = [3, -4, 12], y.grad = [[1, -2], [0.5, 0.25]].
    let x = param(&[0.0; 3]);
    let y = Tensor::zeros(&[2, 2], DType::F32).unwrap();
    y.requires_grad_(true).unwrap();
    let idle = param(&[0.0]); // no gradient: ignored
    set_grad(&x, &[3.0, -4.0, 12.0]);
    set_grad(&y, &[1.0, -2.0, 0.5, 0.25]);
    let params = [x.clone(), y.clone(), idle];
    assert_close("grad_norm", &[grad_norm(&params).unwrap().item::<f32>().unwrap()], &[CLIP_NORM], 0.0, 1e-6);
    let n = clip_grad_norm_(&params, 2.5).unwrap();
    assert_eq!(n.shape(), &[] as &[usize]);
    assert_close("norm", &[n.item::<f32>().unwrap()], &[CLIP_NORM], 0.0, 1e-6);
    assert_close("x.grad", &x.grad().unwrap().to_vec::<f32>().unwrap(), &CLIP_X, 1e-7, 1e-6);
    assert_close("y.grad", &y.grad().unwrap().to_vec::<f32>().unwrap(), &CLIP_Y, 1e-7, 1e-6);
    // Below the limit: unchanged (multiplied by exactly 1).
    set_grad(&x, &[0.1, 0.2, 0.2]);
    y.set_grad(None);
    let n = clip_grad_norm_(&[x.clone(), y.clone()], 2.5).unwrap();
    assert_close("small norm", &[n.item::<f32>().unwrap()], &[CLIP_SMALL_NORM], 0.0, 1e-6);
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [0.1, 0.2, 0.2]);
    // No gradients at all: norm 0.
    x.set_grad(None);
    assert_eq!(clip_grad_norm_(std::slice::from_ref(&x), 1.0).unwrap().item::<f32>().unwrap(), 0.0);
}

#[test]
fn clip_grad_norm_nonfinite_and_value_clipping() {
    let x = param(&[0.0; 2]);
    set_grad(&x, &[f32::INFINITY, 1.0]);
    let e = clip_grad_norm_checked_(std::slice::from_ref(&x), 1.0).unwrap_err().to_string();
    assert!(e.contains("non-finite (inf)"), "{e}");
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [f32::INFINITY, 1.0], "left unchanged");
    assert!(clip_grad_norm_(std::slice::from_ref(&x), 1.0).unwrap().item::<f32>().unwrap().is_infinite());
    set_grad(&x, &[-3.0, 0.5]);
    clip_grad_value_(std::slice::from_ref(&x), 1.0).unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [-1.0, 0.5]);
    assert!(clip_grad_norm_(std::slice::from_ref(&x), -1.0).is_err());
}

#[test]
fn accumulated_gradient_equals_the_big_batch_gradient() {
    let w = param(&[0.5, -1.0, 2.0]);
    let data = Tensor::from_slice(&[1.0f32, 2.0, 3.0, -1.0, 0.5, 0.0, 2.0, 2.0, -2.0, 0.1, 0.2, 0.3], &[4, 3]).unwrap();
    let loss_of = |x: &Tensor| x.matmul(&w).unwrap().square().unwrap().mean().unwrap();
    loss_of(&data).backward().unwrap();
    let big = w.grad().unwrap().to_vec::<f32>().unwrap();
    w.set_grad(None);
    let mut acc = GradAccumulation::new(4);
    let mut stepped = vec![];
    for i in 0..4 {
        stepped.push(acc.backward(&loss_of(&data.narrow(0, i, 1).unwrap())).unwrap());
        assert_eq!(acc.pending(), (i as usize + 1) % 4);
    }
    assert_eq!(stepped, [false, false, false, true]);
    assert_close("accumulated", &w.grad().unwrap().to_vec::<f32>().unwrap(), &big, 1e-6, 1e-6);
    assert_eq!(GradAccumulation::new(0).steps(), 1);
}

// ---- the golden fixtures -----------------------------------------------------------------------

/// One AdamW step from the golden gradients (same settings as the fixtures:
/// lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter)
/// lands on PyTorch's `adamw_step1` parameters. With the same gradients the
/// only differences are rounding, so the tolerance is far below the fixture's.
#[test]
fn adamw_step_from_golden_gradients_matches_pytorch() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    let load = |p: std::path::PathBuf| {
        kiln::nn::io::load_safetensors(&p).unwrap_or_else(|e| panic!("the golden fixture {}: {e}", p.display()))
    };
    for model in ["llama", "qwen3"] {
        let weights = load(root.join(model).join("model.safetensors"));
        let golden = load(root.join(model).join("golden.safetensors"));
        let named: Vec<(String, Tensor)> = weights
            .into_iter()
            .map(|(n, t)| {
                t.requires_grad_(true).unwrap();
                (n, t)
            })
            .collect();
        for (n, p) in &named {
            p.set_grad(Some(golden[&format!("grad.{n}")].clone()));
        }
        let c = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
        let mut opt = AdamW::new(named.clone(), c).unwrap();
        opt.step().unwrap();
        let mut worst = 0.0f32;
        for (n, p) in &named {
            let want = golden[&format!("adamw_step1.{n}")].to_vec::<f32>().unwrap();
            let got = p.to_vec::<f32>().unwrap();
            for (g, w) in got.iter().zip(&want) {
                worst = worst.max((g - w).abs());
            }
            assert_close(&format!("{model} {n}"), &got, &want, 1e-6, 1e-6);
        }
        eprintln!("{model}: max |kiln - torch| after one AdamW step from the golden gradients: {worst:e}");
    }
}

/// Capturable AdamW (device step count and learning rate, in-place state) follows
/// the host one, learning-rate changes included.
#[test]
fn capturable_adamw_follows_the_host_one_and_its_learning_rate() {
    use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
    let make = || {
        let w = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], &[3]).unwrap();
        w.requires_grad_(true).unwrap();
        w
    };
    let (a, b) = (make(), make());
    let cfg = AdamWConfig { lr: 0.1, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut host = AdamW::new(vec![a.clone()], cfg).unwrap();
    let mut dev = AdamW::new(vec![b.clone()], cfg).unwrap();
    dev.set_capturable(true).unwrap();
    assert!(dev.is_capturable());
    for (i, lr) in [0.1, 0.01, 0.003].into_iter().enumerate() {
        if i > 0 {
            host.set_lr(lr);
            dev.set_lr_factor(lr / 0.1);
        }
        for (w, opt) in [(&a, &mut host), (&b, &mut dev)] {
            opt.zero_grad();
            w.mul(w).unwrap().mul(3.0).unwrap().sum().unwrap().backward().unwrap();
            opt.step().unwrap();
        }
        let (x, y) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        for (p, q) in x.iter().zip(&y) {
            assert!((p - q).abs() < 1e-6, "step {i}: {x:?} vs {y:?}");
        }
    }
}

/// Under kiln::compile a learning-rate schedule set between calls reaches the
/// captured steps: `set_lr_factor` writes the device learning rate outside the
/// function, so its trace stays stable and replays, and the parameters follow
/// the same steps run eagerly.
#[test]
fn a_schedule_reaches_captured_capturable_adamw_steps() {
    support::register_tpu();
    for dev in [Device::Cpu, Device::Tpu(0)] {
        schedule_reaches_captured_steps(dev);
    }
}

fn schedule_reaches_captured_steps(dev: Device) {
    use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
    let make = || {
        let w = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], &[3]).unwrap().to_device(dev).unwrap();
        w.requires_grad_(true).unwrap();
        w
    };
    let cfg = AdamWConfig { lr: 0.1, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let (a, b) = (make(), make());
    let mut eager = AdamW::new(vec![a.clone()], cfg).unwrap();
    eager.set_capturable(true).unwrap();
    let compiled_opt = std::cell::RefCell::new(AdamW::new(vec![b.clone()], cfg).unwrap());
    compiled_opt.borrow_mut().set_capturable(true).unwrap();
    let step = |w: &Tensor, opt: &mut AdamW| -> Result<Vec<Tensor>> {
        opt.zero_grad();
        kiln::constant(|| w.mul(w)?.mul(3.0))?.sum()?.backward()?;
        opt.step()?;
        Ok(vec![])
    };
    let mut compiled = kiln::compile(dev, |_: &[Tensor]| step(&b, &mut compiled_opt.borrow_mut()));
    for i in 0..8 {
        let factor = 1.0 / (1.0 + i as f64);
        eager.set_lr_factor(factor);
        compiled_opt.borrow_mut().set_lr_factor(factor);
        step(&a, &mut eager).unwrap();
        compiled.call(&[]).unwrap();
        let (x, y) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        for (p, q) in x.iter().zip(&y) {
            assert!((p - q).abs() < 1e-5, "{dev} step {i}: {x:?} vs {y:?}");
        }
    }
    // set_capturable made the state before the first call, so the first trace
    // is already the steady program: two traces agree, then every call replays.
    assert_eq!((compiled.stats().traces, compiled.stats().replays), (2, 6), "{dev}: {:?}", compiled.stats());
}

/// The fused CPU update writes memory directly, which a traced function's
/// program would not see: while tracing, AdamW takes the op-by-op path, so
/// the program of a compiled step updates the parameter. (A plain AdamW step
/// replaces its moment tensors every call, so it is traced every call and
/// equals the eager step; the program is what a replay would run.)
#[test]
fn a_compiled_cpu_adamw_step_records_its_update() {
    let cfg = AdamWConfig { lr: 0.05, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let (a, b) = (param(&P0), param(&P0));
    let mut eager = AdamW::new(vec![a.clone()], cfg).unwrap();
    let compiled_opt = std::cell::RefCell::new(AdamW::new(vec![b.clone()], cfg).unwrap());
    let step = |w: &Tensor, opt: &mut AdamW| -> Result<Vec<Tensor>> {
        opt.zero_grad();
        kiln::constant(|| w.mul(w)?.mul(3.0))?.sum()?.backward()?;
        opt.step()?;
        Ok(vec![])
    };
    let mut compiled = kiln::compile(Device::Cpu, |_: &[Tensor]| step(&b, &mut compiled_opt.borrow_mut()));
    for i in 0..4 {
        step(&a, &mut eager).unwrap();
        compiled.call(&[]).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap(), "step {i}");
        let text = compiled.program().unwrap().to_string();
        let sqrt = text.lines().filter(|l| l.contains(" = sqrt(")).count();
        assert!(sqrt >= 1 && text.contains("updates %"), "step {i}: the update is in the program:\n{text}");
    }
}

/// Capturable mode makes the state up front (step 0, zero moments: a fresh
/// state), and again after loading a checkpoint, whose step counts it keeps.
#[test]
fn capturable_adamw_makes_its_state_up_front() {
    let w = Tensor::from_vec(vec![0.5f32, -1.0], &[2]).unwrap();
    w.requires_grad_(true).unwrap();
    let frozen = Tensor::from_vec(vec![1.0f32], &[1]).unwrap();
    let mut opt = AdamW::new(vec![w.clone(), frozen], AdamWConfig::default()).unwrap();
    assert!(opt.state("param_groups.0.0").is_none());
    opt.set_capturable(true).unwrap();
    let st = opt.state("param_groups.0.0").expect("state made by set_capturable");
    assert_eq!(st.step, 0);
    assert_eq!(st.exp_avg.to_vec::<f32>().unwrap(), [0.0, 0.0]);
    assert!(opt.state("param_groups.0.1").is_none(), "no state for a parameter that needs no gradient");
    let grad_step = |o: &mut AdamW| {
        o.zero_grad();
        w.mul(&w).unwrap().sum().unwrap().backward().unwrap();
        o.step().unwrap();
    };
    grad_step(&mut opt);
    grad_step(&mut opt);
    // A fresh capturable optimizer loading the checkpoint takes the same third step.
    let mut twin = AdamW::new(vec![w.clone()], AdamWConfig::default()).unwrap();
    twin.set_capturable(true).unwrap();
    twin.load_state_dict(opt.state_dict().unwrap()).unwrap();
    assert_eq!(twin.state("param_groups.0.0").unwrap().step, 2);
    let before = w.to_vec::<f32>().unwrap();
    grad_step(&mut opt);
    let by_opt = w.to_vec::<f32>().unwrap();
    {
        let _ng = kiln::autograd::no_grad();
        w.copy_(&Tensor::from_vec(before, &[2]).unwrap()).unwrap();
    }
    grad_step(&mut twin);
    assert_eq!(twin.state("param_groups.0.0").unwrap().step, 3);
    let by_twin = w.to_vec::<f32>().unwrap();
    for (a, b) in by_opt.iter().zip(&by_twin) {
        assert!((a - b).abs() < 1e-7, "{by_opt:?} vs {by_twin:?}");
    }
}
