//! Golden-text tests of the emitter: no device needed.
use super::*;
use kiln_tensor::{Layout, Op, UnaryOp};

fn lay(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
    Layout::new(shape.into(), strides.iter().copied().collect(), offset)
}

#[test]
fn literals_are_exact_bit_patterns_with_pytorch_casts() {
    assert_eq!(literal(Lit::F(1.0), DType::F32), "0x3F800000");
    assert_eq!(literal(Lit::F(-0.0), DType::F32), "0x80000000");
    assert_eq!(literal(Lit::F(f64::NEG_INFINITY), DType::F64), "0xFFF0000000000000");
    assert_eq!(literal(Lit::F(1.0), DType::BF16), "0x3F80");
    assert_eq!(literal(Lit::F(1.0), DType::F16), "0x3C00");
    assert_eq!(literal(Lit::F(-2.7), DType::I32), "-2"); // truncation
    assert_eq!(literal(Lit::I(300), DType::U8), "44"); // wraps
    assert_eq!(literal(Lit::F(f64::NAN), DType::Bool), "true");
    assert_eq!(literal(Lit::I(0), DType::Bool), "false");
}

#[test]
fn a_one_op_module_in_generic_form() {
    let x = Layout::contiguous(&[2, 3]);
    let (text, checks) = exec_module(
        &Op::Unary(UnaryOp::Exp),
        &[ArgView { layout: &x, len: 6, dtype: DType::F32 }],
        &[Meta { shape: [2, 3].as_slice().into(), dtype: DType::F32 }],
    )
    .unwrap();
    let text = text.text();
    assert!(checks.is_empty());
    let want = "module @kiln attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a0: tensor<6xf32>) -> (tensor<6xf32>) {
    %v1 = \"stablehlo.reshape\"(%a0) : (tensor<6xf32>) -> tensor<2x3xf32>
    %v2 = \"stablehlo.exponential\"(%v1) : (tensor<2x3xf32>) -> tensor<2x3xf32>
    %v3 = \"stablehlo.reshape\"(%v2) : (tensor<2x3xf32>) -> tensor<6xf32>
    \"func.return\"(%v3) : (tensor<6xf32>) -> ()
  }
}
";
    assert_eq!(text, want);
}

#[test]
fn half_precision_math_runs_in_float32_and_rounds_once() {
    let x = Layout::contiguous(&[4]);
    let (text, _) = exec_module(
        &Op::Unary(UnaryOp::Tanh),
        &[ArgView { layout: &x, len: 4, dtype: DType::BF16 }],
        &[Meta { shape: [4].as_slice().into(), dtype: DType::BF16 }],
    )
    .unwrap();
    let text = text.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.trim_start().starts_with("%v")).collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].contains("stablehlo.convert") && lines[0].ends_with("-> tensor<4xf32>"), "{text}");
    assert!(lines[1].contains("stablehlo.tanh") && lines[1].contains("tensor<4xf32>"), "{text}");
    assert!(lines[2].contains("stablehlo.convert") && lines[2].ends_with("-> tensor<4xbf16>"), "{text}");
}

fn read_ops(layout: &Layout, len: usize) -> Vec<String> {
    let text = read_module(layout, len, DType::F32).unwrap().text();
    text.lines()
        .filter_map(|l| l.split('"').nth(1).filter(|s| s.starts_with("stablehlo.")).map(|s| s.to_string()))
        .collect()
}

#[test]
fn views_lower_to_slices_transposes_and_broadcasts() {
    // The whole contiguous storage: a reshape.
    assert_eq!(read_ops(&Layout::contiguous(&[2, 3]), 6), ["stablehlo.reshape"; 2]);
    // A transpose of [2, 3]: a window, then a transpose.
    let t = read_ops(&lay(&[3, 2], &[1, 3], 0), 6);
    assert!(t.contains(&"stablehlo.transpose".to_string()) && !t.contains(&"stablehlo.gather".to_string()), "{t:?}");
    // narrow(1, 1, 2) of [2, 4]: a slice of the window, no gather.
    let n = read_ops(&lay(&[2, 2], &[4, 1], 1), 8);
    assert!(n.contains(&"stablehlo.slice".to_string()) && !n.contains(&"stablehlo.gather".to_string()), "{n:?}");
    // `x[:, 1:]` of [8, 256]: cut on the storage's grid, so rows split over
    // devices are read in place (no shifted flat run, no padding).
    let w = read_ops(&lay(&[8, 255], &[256, 1], 1), 2048);
    assert_eq!(w, ["stablehlo.reshape", "stablehlo.slice", "stablehlo.reshape", "stablehlo.reshape"], "{w:?}");
    // The diagonal of [3, 3] runs past the storage: padded, never gathered.
    let d = read_ops(&lay(&[3], &[4], 0), 9);
    assert!(d.contains(&"stablehlo.pad".to_string()) && !d.contains(&"stablehlo.gather".to_string()), "{d:?}");
    // expand: a broadcast of the stored values.
    let e = read_ops(&lay(&[4, 3], &[0, 1], 0), 3);
    assert!(e.contains(&"stablehlo.broadcast_in_dim".to_string()), "{e:?}");
    // An overlapping as_strided (windows of 3 sliding by 1): a gather of flat indices.
    let g = read_ops(&lay(&[3, 3], &[1, 1], 0), 5);
    assert!(g.contains(&"stablehlo.gather".to_string()), "{g:?}");
}

#[test]
fn writes_use_dynamic_update_slice_or_scatter() {
    let src = Layout::contiguous(&[2]);
    let run = assign_module(&lay(&[2], &[1], 3), 8, ArgView { layout: &src, len: 2, dtype: DType::F32 }, false, false)
        .unwrap()
        .text();
    assert!(run.contains("stablehlo.dynamic_update_slice") && !run.contains("stablehlo.scatter"), "{run}");
    let strided =
        assign_module(&lay(&[2], &[4], 1), 8, ArgView { layout: &src, len: 2, dtype: DType::F32 }, false, true)
            .unwrap()
            .text();
    assert!(strided.contains("stablehlo.scatter"), "{strided}");
    assert!(
        strided.contains("%a0: tensor<8xf32> {tf.aliasing_output = 0 : i32}"),
        "the destination is donated: {strided}"
    );
    // Source and destination in one storage: one argument.
    let same = assign_module(
        &lay(&[2], &[1], 0),
        4,
        ArgView { layout: &lay(&[2], &[1], 2), len: 4, dtype: DType::F32 },
        true,
        false,
    )
    .unwrap()
    .text();
    assert!(same.contains("@main(%a0: tensor<4xf32>) ->"), "{same}");
}

#[test]
fn index_ops_and_integer_division_carry_checks() {
    let x = Layout::contiguous(&[3, 4]);
    let i = Layout::contiguous(&[3, 2]);
    let (text, checks) = exec_module(
        &Op::Gather { dim: 1 },
        &[ArgView { layout: &x, len: 12, dtype: DType::F32 }, ArgView { layout: &i, len: 6, dtype: DType::I64 }],
        &[Meta { shape: [3, 2].as_slice().into(), dtype: DType::F32 }],
    )
    .unwrap();
    let text = text.text();
    assert_eq!(checks, vec![Check::Index { input: 1, dim: 1, size: 4 }]);
    assert!(text.contains("-> (tensor<6xf32>, tensor<i1>)"), "{text}");
    let v = Layout::contiguous(&[3]);
    let (_, checks) = exec_module(
        &Op::Binary(kiln_tensor::BinaryOp::FloorDiv),
        &[ArgView { layout: &v, len: 3, dtype: DType::I64 }, ArgView { layout: &v, len: 3, dtype: DType::I64 }],
        &[Meta { shape: [3].as_slice().into(), dtype: DType::I64 }],
    )
    .unwrap();
    assert_eq!(checks, vec![Check::ZeroDivision]);
}

#[test]
fn creation_values_are_arguments_not_constants() {
    let a = Op::Full { shape: [2, 2].as_slice().into(), value: kiln_tensor::Scalar::Float(0.25), dtype: DType::BF16 };
    let b = Op::Full { shape: [2, 2].as_slice().into(), value: kiln_tensor::Scalar::Float(-3.0), dtype: DType::BF16 };
    assert_eq!(creation_module(&a).unwrap(), creation_module(&b).unwrap(), "one executable for every fill value");
    assert_eq!(creation_args(&a).unwrap(), vec![(half::bf16::from_f32(0.25).to_le_bytes().to_vec(), DType::BF16)]);
    assert_eq!(literal_bytes(Lit::F(-2.9), DType::I16), (-2i16).to_le_bytes().to_vec());
    assert_eq!(literal_bytes(Lit::F(f64::NAN), DType::Bool), vec![1]);
    assert_eq!(literal_bytes(Lit::I(-1), DType::U8), vec![255]);
}

#[test]
fn literal_bytes_are_the_literal_text_as_little_endian_bytes() {
    // The bytes uploaded for a scalar argument and the text of a constant are
    // one conversion: reading the text back (here, in the test) gives the bytes.
    let values = [Lit::F(-2.9), Lit::F(1e10), Lit::F(f64::NAN), Lit::F(-0.0), Lit::I(-1), Lit::I(300), Lit::B(true)];
    for dtype in DType::ALL {
        for v in values {
            let text = literal(v, dtype);
            let want = match text.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).unwrap().to_le_bytes()[..dtype.size_in_bytes()].to_vec(),
                None if dtype == DType::Bool => vec![(text == "true") as u8],
                None => text.parse::<i64>().unwrap().to_le_bytes()[..dtype.size_in_bytes()].to_vec(),
            };
            assert_eq!(literal_bytes(v, dtype), want, "{v:?} as {dtype}: {text}");
        }
    }
}

/// The checks `op`'s one-op module carries, on contiguous inputs of types `inputs`.
fn checks_of(op: &Op, inputs: &[Meta]) -> Vec<Check> {
    let layouts: Vec<Layout> = inputs.iter().map(|m| Layout::contiguous(&m.shape)).collect();
    let views: Vec<ArgView<'_>> = inputs
        .iter()
        .zip(&layouts)
        .map(|(m, l)| ArgView { layout: l, len: m.shape.iter().product(), dtype: m.dtype })
        .collect();
    let outs = op.infer(inputs).unwrap();
    exec_module(op, &views, &outs).unwrap().1
}

#[test]
fn ops_that_fail_on_data_are_those_whose_lowering_checks_it() {
    use kiln_tensor::{BinaryOp, ScatterReduce};
    let m = |shape: &[usize], dtype: DType| Meta::new(shape, dtype);
    let (f, i) = (DType::F32, DType::I64);
    let cases: Vec<(Op, Vec<Meta>)> = vec![
        (Op::Gather { dim: 1 }, vec![m(&[3, 4], f), m(&[3, 2], i)]),
        (Op::Scatter { dim: 1, reduce: ScatterReduce::Add }, vec![m(&[3, 4], f), m(&[3, 2], i), m(&[3, 2], f)]),
        (Op::IndexSelect { dim: 0 }, vec![m(&[3, 4], f), m(&[2], i)]),
        (Op::IndexAdd { dim: 0 }, vec![m(&[3, 4], f), m(&[2], i), m(&[2, 4], f)]),
        (Op::CrossEntropyBackward { smoothing: 0.0 }, vec![m(&[3, 5], f), m(&[3], i), m(&[3], f)]),
        (Op::GroupedMatMul, vec![m(&[4, 3], f), m(&[2, 3, 5], f), m(&[2], i)]),
        (
            Op::PagedAttention { scale: 0.5, kv_scales: false },
            vec![m(&[2, 2, 4], f), m(&[3, 2, 1, 4], f), m(&[3, 2, 1, 4], f), m(&[1, 2], i), m(&[1], i), m(&[2], i)],
        ),
        (Op::Binary(BinaryOp::Div), vec![m(&[3], i), m(&[3], i)]),
        (Op::Binary(BinaryOp::Div), vec![m(&[3], f), m(&[3], f)]),
        (Op::Binary(BinaryOp::Remainder), vec![m(&[3], DType::U8), m(&[3], DType::U8)]),
        (Op::Binary(BinaryOp::Fmod), vec![m(&[3], DType::I32), m(&[3], DType::I32)]),
        (Op::Binary(BinaryOp::Pow), vec![m(&[3], i), m(&[3], i)]),
        (Op::Binary(BinaryOp::Pow), vec![m(&[3], DType::U8), m(&[3], DType::U8)]),
        (Op::Binary(BinaryOp::Pow), vec![m(&[3], f), m(&[3], f)]),
        (Op::Binary(BinaryOp::Mul), vec![m(&[3], i), m(&[3], i)]),
        (Op::MatMul, vec![m(&[2, 3], f), m(&[3, 2], f)]),
        (Op::Unary(UnaryOp::Exp), vec![m(&[3], f)]),
    ];
    for (op, inputs) in cases {
        let checks = checks_of(&op, &inputs);
        assert_eq!(op.fails_on_data(&inputs), !checks.is_empty(), "{} on {inputs:?}: {checks:?}", op.name());
    }
}
