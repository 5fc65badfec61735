//! Errors: each names the op and the shapes or dtypes involved, has the variant a
//! caller can match on, and leaves the inputs untouched.
use crate::{iota, on_devices, t};
use kiln::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Shape,
    DType,
    Index,
    InPlace,
    Invalid,
}

fn kind(e: &Error) -> Option<Kind> {
    Some(match e {
        Error::Shape { .. } => Kind::Shape,
        Error::DType { .. } => Kind::DType,
        Error::Index { .. } => Kind::Index,
        Error::InPlace { .. } => Kind::InPlace,
        Error::Invalid { .. } => Kind::Invalid,
        _ => return None,
    })
}

#[track_caller]
fn check<T: std::fmt::Debug>(r: Result<T>, want: Kind, prefix: &str, parts: &[&str]) {
    let e = match r {
        Ok(v) => panic!("expected a {want:?} error from {prefix}, got Ok({v:?})"),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert_eq!(kind(&e), Some(want), "variant of {msg:?}");
    // An in-place op may report the error of its out-of-place part (`add` for `add_`).
    let named = msg.starts_with(&format!("{prefix}: ")) || msg.starts_with(&format!("{prefix}_: "));
    assert!(named, "{msg:?} should start with the op name {prefix:?}");
    for p in parts {
        assert!(msg.contains(p), "{msg:?} does not contain {p:?}");
    }
}

#[test]
fn errors_name_the_op_and_the_operands() {
    on_devices(|dev| {
        let a = iota(&[2, 3], dev);
        let b = iota(&[4], dev);
        check(a.add(&b), Kind::Shape, "add", &["[2, 3]", "[4]"]);
        check(a.maximum(&b), Kind::Shape, "maximum", &["[2, 3]", "[4]"]);
        check(a.t()?.view(&[6]), Kind::Shape, "view", &["[3, 2]", "[6]"]);
        check(a.reshape(&[4, 2]), Kind::Shape, "reshape", &["[4, 2]", "6"]);
        check(a.expand(&[3, 3]), Kind::Shape, "expand", &["[3, 3]", "[2, 3]"]);
        check(a.narrow(0, 1, 2), Kind::Index, "narrow", &["dim 0"]);
        check(a.select(1, 3), Kind::Index, "select", &["dimension 1", "size 3"]);
        check(a.sum_dim(2, false), Kind::Index, "sum", &["[-2, 1]", "2"]);
        check(a.softmax(-3), Kind::Index, "softmax", &["[-2, 1]", "-3"]);
        check(a.matmul(&a), Kind::Shape, "matmul", &["2x3", "2x3"]);
        check(a.matmul(&a.to_dtype(DType::F64)?), Kind::DType, "matmul", &["float32", "float64"]);
        check(a.masked_fill(&a, 0.0), Kind::DType, "masked_fill", &["bool", "float32"]);
        check(a.masked_fill(&t([true, false], dev), 0.0), Kind::Shape, "masked_fill", &["[2]", "[2, 3]"]);
        check(Tensor::where_cond(&a, 1.0, 0.0), Kind::DType, "where", &["float32"]);
        check(a.to_vec::<i64>(), Kind::DType, "to_vec", &["int64", "float32"]);
        check(a.item::<f32>(), Kind::Invalid, "item", &["6 elements"]);
        check(a.i(t([0.5f32], dev)), Kind::Index, "index", &["float32"]); // IndexError in PyTorch
        check(a.gather(1, &t([[0i32]], dev)), Kind::DType, "gather", &["int64", "int32"]);
        check(t([1i64], dev).requires_grad_(true).map(|_| ()), Kind::DType, "requires_grad_", &["int64"]);
        check(a.expand(&[2, 2, 3])?.add_(1.0).map(|_| ()), Kind::InPlace, "add_", &["single memory location"]);
        check(t([1i64], dev).add_(0.5).map(|_| ()), Kind::DType, "add_", &["can't be cast"]);
        check(a.add_(&b).map(|_| ()), Kind::Shape, "add", &["[2, 3]", "[4]"]);
        check(Tensor::stack(&[&a, &b], 0), Kind::Shape, "stack", &["[2, 3]", "[4]"]);
        check(Tensor::cat(&[&a, &b.unsqueeze(0)?], 0), Kind::Shape, "cat", &["[2, 3]", "[1, 4]"]);
        check(t([1i64], dev).floor_divide(0), Kind::Invalid, "floor_divide", &["ZeroDivisionError"]);
        check(Tensor::from_vec(vec![1.0f32; 5], &[2, 3]), Kind::Shape, "from_vec", &["[2, 3]", "5"]);
        check(Tensor::arange(0.0, 1.0, 0.0, (DType::F32, dev)), Kind::Invalid, "arange", &["step"]);
        check(t([true], dev).neg(), Kind::DType, "neg", &["bool"]);
        check(a.permute(&[0]), Kind::Shape, "permute", &["2 dims"]);
        check(a.diagonal(0, 0, 0), Kind::Invalid, "diagonal", &["0, 0"]);
        Ok(())
    });
}

#[test]
fn a_failed_op_leaves_its_inputs_alone() {
    on_devices(|dev| {
        let a = iota(&[2, 3], dev);
        let v = a.version();
        assert!(a.add_(&iota(&[4], dev)).is_err());
        assert!(a.expand(&[2, 2, 3])?.mul_(2.0).is_err());
        assert!(a.masked_fill_(&t([1.0f32], dev), 1.0).is_err());
        assert_eq!(a.version(), v);
        assert_eq!(a.to_vec::<f32>()?, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        Ok(())
    });
}
