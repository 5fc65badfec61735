//! The typing rule of `Op::GroupedMatMul` and the group arithmetic every
//! backend shares (Note [Grouped products] in `grouped.rs`).
use crate::error::fmt_shape;
use crate::{DType, Error, Meta, Result};
use smallvec::{smallvec, SmallVec};

const OP: &str = "grouped_mm";
const SHAPES: &str = "expected a [M, K] with mat2 [G, K, N], or a [K, M] with mat2 [M, N]";

/// The typing rule of `Op::GroupedMatMul`.
pub(crate) fn grouped_mm_meta(inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
    let [a, b, sizes] = inputs else {
        return Err(Error::invalid(OP, format!("expects 3 inputs, got {}", inputs.len())));
    };
    if a.dtype != b.dtype {
        return Err(Error::dtype(
            OP,
            format!("expected both matrices to have the same dtype, but got {} and {}", a.dtype, b.dtype),
        ));
    }
    if a.dtype == DType::Bool {
        return Err(Error::unsupported_dtype(OP, a.dtype));
    }
    if sizes.dtype != DType::I64 || sizes.shape.len() != 1 {
        return Err(Error::dtype(
            OP,
            format!(
                "expected group_sizes of dtype int64 and shape [G], got {} {}",
                sizes.dtype,
                fmt_shape(&sizes.shape)
            ),
        ));
    }
    let g = sizes.shape[0];
    let (sa, sb) = (&a.shape, &b.shape);
    let shape: crate::Shape = match (sa.len(), sb.len()) {
        // [M, K] x [G, K, N] -> [M, N]
        (2, 3) if sb[0] == g && sb[1] == sa[1] => [sa[0], sb[2]].as_slice().into(),
        // [K, M] x [M, N] -> [G, K, N]
        (2, 2) if sa[1] == sb[0] => [g, sa[0], sb[1]].as_slice().into(),
        _ => {
            return Err(Error::shape(
                OP,
                format!("{SHAPES}, for {g} groups; got {} and {}", fmt_shape(sa), fmt_shape(sb)),
            ))
        }
    };
    Ok(smallvec![Meta { shape, dtype: a.dtype }])
}

/// The length of the grouped dimension of checked operands of shapes `a`
/// and `b`: `a`'s rows when `b` is `[G, K, N]`, its columns when `b` is
/// `[M, N]`.
pub fn grouped_dim(a: &[usize], b: &[usize]) -> usize {
    if b.len() == 3 {
        a[0]
    } else {
        a[1]
    }
}

/// The rows `(start, len)` of each group, from the sizes read on the host,
/// checked against the `rows` of the ragged dimension (Note [Grouped
/// products]).
pub fn group_offsets(sizes: &[i64], rows: usize) -> Result<Vec<(usize, usize)>> {
    let mut start = 0usize;
    let mut out = Vec::with_capacity(sizes.len());
    for (g, &s) in sizes.iter().enumerate() {
        let len = usize::try_from(s)
            .map_err(|_| Error::invalid(OP, format!("group_sizes[{g}] is {s}; group sizes must be non-negative")))?;
        let end = start.checked_add(len).filter(|&e| e <= rows).ok_or_else(|| {
            Error::invalid(OP, format!("group sizes sum past the {rows} rows of the grouped dimension (at group {g})"))
        })?;
        out.push((start, len));
        start = end;
    }
    Ok(out)
}
