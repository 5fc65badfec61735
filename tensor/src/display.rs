//! `Display` for `Tensor`: PyTorch's repr (`tensor([[1., 2.], [3., 4.]])`) with its
//! float formatting rules, summarisation of large tensors and dtype/device suffixes.
//!
//! This follows `torch/_tensor_str.py` with the default print options (precision 4,
//! threshold 1000, edge items 3, line width 80). A `{:.N}` precision in the format
//! string overrides the float precision.
use crate::{DType, Device, HostBuffer, Tensor};
use std::fmt;

const PRECISION: usize = 4;
/// Tensors with more elements than this are summarised with `...`.
const THRESHOLD: usize = 1000;
/// Items kept at each edge of a summarised dim.
const EDGE_ITEMS: usize = 3;
const LINE_WIDTH: usize = 80;
/// `tensor(`: the indent of continuation lines.
const PREFIX: &str = "tensor(";

/// Element values in row-major order, in the form they are printed from.
enum Values {
    /// Floating dtypes, widened to f64 (exact for every float dtype).
    Float(Vec<f64>),
    /// Integer dtypes (exact, also for i64 beyond 2^53).
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl Values {
    fn from_host(buf: &HostBuffer, dtype: DType) -> Values {
        let n = buf.len();
        if dtype.is_float() {
            Values::Float((0..n).map(|i| buf.get_f64(i)).collect())
        } else if dtype.is_bool() {
            Values::Bool((0..n).map(|i| buf.get_i64(i) != 0).collect())
        } else {
            Values::Int((0..n).map(|i| buf.get_i64(i)).collect())
        }
    }
}

/// Flat (row-major) positions of the elements that get printed: all of them, or
/// with `summarize` only the first and last `EDGE_ITEMS` along each dim longer
/// than `2 * EDGE_ITEMS` (PyTorch's `get_summarized_data`).
fn printed_positions(shape: &[usize], summarize: bool) -> Vec<usize> {
    fn walk(shape: &[usize], offset: usize, summarize: bool, out: &mut Vec<usize>) {
        let Some((&n, rest)) = shape.split_first() else {
            out.push(offset);
            return;
        };
        let stride: usize = rest.iter().product();
        for i in kept_indices(n, summarize).into_iter().flatten() {
            walk(rest, offset + i * stride, summarize, out);
        }
    }
    let mut out = vec![];
    walk(shape, 0, summarize, &mut out);
    out
}

/// Indices printed along a dim of size `n`: `[head, tail]`, where `None` for the tail
/// means no `...` separator.
fn kept_indices(n: usize, summarize: bool) -> [Vec<usize>; 2] {
    if summarize && n > 2 * EDGE_ITEMS {
        [(0..EDGE_ITEMS).collect(), (n - EDGE_ITEMS..n).collect()]
    } else {
        [(0..n).collect(), vec![]]
    }
}

/// PyTorch's `_Formatter`: one width and one notation for all printed elements.
struct ElemFormatter {
    int_mode: bool,
    sci_mode: bool,
    max_width: usize,
    precision: usize,
}

/// Python's `'{:.Ne}'.format(v)`: at least two exponent digits, with a sign.
fn fmt_sci(v: f64, precision: usize) -> String {
    if !v.is_finite() {
        return fmt_nonfinite(v);
    }
    let s = format!("{v:.precision$e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let e: i32 = exp.parse().unwrap_or(0);
            let sign = if e < 0 { '-' } else { '+' };
            format!("{mantissa}e{sign}{:02}", e.abs())
        }
        None => s,
    }
}

/// Python's `'{:.Nf}'.format(v)`.
fn fmt_fixed(v: f64, precision: usize) -> String {
    if !v.is_finite() {
        return fmt_nonfinite(v);
    }
    format!("{v:.precision$}")
}

fn fmt_nonfinite(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v > 0.0 {
        "inf".into()
    } else {
        "-inf".into()
    }
}

impl ElemFormatter {
    fn new(values: &Values, positions: &[usize], precision: usize) -> ElemFormatter {
        let mut f = ElemFormatter { int_mode: true, sci_mode: false, max_width: 1, precision };
        match values {
            Values::Int(v) => {
                f.max_width = positions.iter().map(|&i| v[i].to_string().len()).fold(1, usize::max);
            }
            Values::Bool(v) => {
                f.max_width = positions.iter().map(|&i| if v[i] { 4 } else { 5 }).fold(1, usize::max);
            }
            Values::Float(v) => {
                let vals: Vec<f64> = positions.iter().map(|&i| v[i]).filter(|x| x.is_finite() && *x != 0.0).collect();
                if vals.is_empty() {
                    return f;
                }
                let min = vals.iter().map(|x| x.abs()).fold(f64::INFINITY, f64::min);
                let max = vals.iter().map(|x| x.abs()).fold(0.0, f64::max);
                f.int_mode = vals.iter().all(|x| x.ceil() == *x);
                let width = |g: &dyn Fn(f64) -> usize| vals.iter().map(|&x| g(x)).fold(1, usize::max);
                if f.int_mode {
                    if max / min > 1000.0 || max > 1.0e8 {
                        f.sci_mode = true;
                        f.max_width = width(&|x| fmt_sci(x, precision).len());
                    } else {
                        f.max_width = width(&|x| format!("{x:.0}").len() + 1);
                    }
                } else if max / min > 1000.0 || max > 1.0e8 || min < 1.0e-4 {
                    f.sci_mode = true;
                    f.max_width = width(&|x| fmt_sci(x, precision).len());
                } else {
                    f.max_width = width(&|x| fmt_fixed(x, precision).len());
                }
            }
        }
        f
    }

    fn format(&self, values: &Values, i: usize) -> String {
        let s = match values {
            Values::Int(v) => v[i].to_string(),
            Values::Bool(v) => (if v[i] { "True" } else { "False" }).to_string(),
            Values::Float(v) => {
                let x = v[i];
                if self.sci_mode {
                    fmt_sci(x, self.precision)
                } else if self.int_mode {
                    if x.is_finite() {
                        format!("{x:.0}.")
                    } else {
                        fmt_nonfinite(x)
                    }
                } else {
                    fmt_fixed(x, self.precision)
                }
            }
        };
        format!("{s:>width$}", width = self.max_width)
    }
}

/// PyTorch's `_tensor_str_with_formatter`: the nested brackets of a tensor of
/// `shape` whose first element is at flat position `offset`.
fn tensor_str(
    values: &Values,
    f: &ElemFormatter,
    shape: &[usize],
    offset: usize,
    indent: usize,
    summarize: bool,
) -> String {
    let Some((&n, rest)) = shape.split_first() else {
        return f.format(values, offset);
    };
    let stride: usize = rest.iter().product();
    let [head, tail] = kept_indices(n, summarize);
    if rest.is_empty() {
        let mut items: Vec<String> = head.iter().map(|&i| f.format(values, offset + i)).collect();
        if !tail.is_empty() {
            items.push(" ...".into());
            items.extend(tail.iter().map(|&i| f.format(values, offset + i)));
        }
        let per_line = (LINE_WIDTH.saturating_sub(indent) / (f.max_width + 2)).max(1);
        let lines: Vec<String> = items.chunks(per_line).map(|c| c.join(", ")).collect();
        return format!("[{}]", lines.join(&format!(",\n{}", " ".repeat(indent + 1))));
    }
    let sub = |i: usize| tensor_str(values, f, rest, offset + i * stride, indent + 1, summarize);
    let mut slices: Vec<String> = head.iter().map(|&i| sub(i)).collect();
    if !tail.is_empty() {
        slices.push("...".into());
        slices.extend(tail.iter().map(|&i| sub(i)));
    }
    let sep = format!(",{}{}", "\n".repeat(shape.len() - 1), " ".repeat(indent + 1));
    format!("[{}]", slices.join(&sep))
}

/// Python's `str(tuple(shape))`: `(2, 0)`, `(0,)`.
fn fmt_size(shape: &[usize]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// `add` -> `AddBackward`, `log1p` -> `Log1pBackward`.
fn grad_fn_name(op: &str) -> String {
    let camel: String = op
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|h| h.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
        })
        .collect();
    format!("{camel}Backward")
}

/// PyTorch's `_add_suffixes`: `, suffix` on the last line, or on a new line when
/// it would pass the line width.
fn add_suffixes(body: String, suffixes: &[String]) -> String {
    let mut out = body;
    let mut last_line_len = match out.rfind('\n') {
        Some(p) => out.len() - p + 1,
        None => out.len() + 2,
    };
    for s in suffixes {
        if last_line_len + s.len() + 2 > LINE_WIDTH {
            out.push_str(&format!(",\n{}{s}", " ".repeat(PREFIX.len())));
            last_line_len = PREFIX.len() + s.len();
        } else {
            out.push_str(&format!(", {s}"));
            last_line_len += s.len() + 2;
        }
    }
    out.push(')');
    out
}

/// Prints like PyTorch's `repr`: `tensor([1., 2.])`, `tensor([1, 2], dtype=int32)`,
/// `tensor([True, False])`, `tensor(0.5000, device='tpu:0')`. Float32, int64 and bool
/// need no dtype suffix. More than 1000 elements are summarised with `...`. An error
/// while reading the data is printed as `<error: ...>` rather than panicking.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
/// assert_eq!(x.to_string(), "tensor([[1., 2.],\n        [3., 4.]])");
/// let y = Tensor::new([0.5f32, -1.25, 1e-5])?;
/// assert_eq!(y.to_string(), "tensor([ 5.0000e-01, -1.2500e+00,  1.0000e-05])");
/// let i = Tensor::new([1i32, -20, 3])?;
/// assert_eq!(format!("{i}"), "tensor([  1, -20,   3], dtype=int32)");
/// let b = Tensor::new([true, false])?;
/// assert_eq!(format!("{b}"), "tensor([ True, False])");
/// # Ok::<(), kiln::Error>(())
/// ```
impl fmt::Display for Tensor {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        let precision = out.precision().unwrap_or(PRECISION);
        let (shape, dtype) = (self.shape(), self.dtype());
        let mut suffixes = vec![];
        if self.device() != Device::Cpu {
            suffixes.push(format!("device='{}'", self.device()));
        }
        let body = if self.numel() == 0 {
            if shape.len() != 1 {
                suffixes.push(format!("size={}", fmt_size(shape)));
            }
            // No element shows whether the dtype is integral: print it unless float32.
            if dtype != DType::F32 {
                suffixes.push(format!("dtype={dtype}"));
            }
            "[]".to_string()
        } else {
            if !matches!(dtype, DType::F32 | DType::I64 | DType::Bool) {
                suffixes.push(format!("dtype={dtype}"));
            }
            match self.read_host("Display") {
                Ok(buf) => {
                    let values = Values::from_host(&buf, dtype);
                    let summarize = self.numel() > THRESHOLD;
                    let f = ElemFormatter::new(&values, &printed_positions(shape, summarize), precision);
                    tensor_str(&values, &f, shape, 0, PREFIX.len(), summarize)
                }
                Err(e) => format!("<error: {e}>"),
            }
        };
        if let Some(o) = self.origin() {
            suffixes.push(format!("grad_fn=<{}>", grad_fn_name(o.node.name())));
        } else if self.requires_grad() {
            suffixes.push("requires_grad=True".into());
        }
        out.write_str(&add_suffixes(format!("{PREFIX}{body}"), &suffixes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(v: Vec<f64>, shape: &[usize]) -> String {
        let values = Values::Float(v);
        let summarize = crate::numel(shape) > THRESHOLD;
        let f = ElemFormatter::new(&values, &printed_positions(shape, summarize), PRECISION);
        tensor_str(&values, &f, shape, 0, PREFIX.len(), summarize)
    }

    #[test]
    fn python_float_notation() {
        assert_eq!(fmt_sci(1e-5, 4), "1.0000e-05");
        assert_eq!(fmt_sci(-123456789.0, 4), "-1.2346e+08");
        assert_eq!(fmt_sci(1e100, 2), "1.00e+100");
        assert_eq!(fmt_sci(f64::NAN, 4), "nan");
        assert_eq!(fmt_fixed(f64::NEG_INFINITY, 4), "-inf");
        // Ties round to even on the exact binary value, like Python.
        assert_eq!(fmt_fixed(0.03125, 4), "0.0312");
    }

    #[test]
    fn float_modes() {
        assert_eq!(render(vec![1.0, 2.0], &[2]), "[1., 2.]");
        assert_eq!(render(vec![0.5, 10.25], &[2]), "[ 0.5000, 10.2500]");
        assert_eq!(render(vec![1.0, 1e4], &[2]), "[1.0000e+00, 1.0000e+04]");
        assert_eq!(render(vec![f64::NAN, 1.0, f64::NEG_INFINITY], &[3]), "[nan, 1., -inf]");
        assert_eq!(render(vec![0.0, 0.0], &[2]), "[0., 0.]");
        assert_eq!(render(vec![2.5], &[]), "2.5000");
    }

    #[test]
    fn nesting_and_wrapping() {
        assert_eq!(
            render(vec![1.0; 8], &[2, 2, 2]),
            "[[[1., 1.],\n         [1., 1.]],\n\n        [[1., 1.],\n         [1., 1.]]]"
        );
        // 14 items of width 3 (+2 for ", ") fit in 80 columns after the 7-column indent.
        let long = render((0..30).map(f64::from).collect(), &[30]);
        let want = "[ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n        \
                    14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n        \
                    28., 29.]";
        assert_eq!(long, want);
    }

    #[test]
    fn summarised() {
        let s = render((1000..3000).map(f64::from).collect(), &[2000]);
        assert_eq!(s, "[1000., 1001., 1002.,  ..., 2997., 2998., 2999.]");
        // Only the printed elements choose the notation: 1999 / 1 > 1000 is scientific.
        let s = render((0..2000).map(f64::from).collect(), &[2000]);
        assert_eq!(s, "[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n        1.9990e+03]");
        let s = render((100..1200).map(f64::from).collect(), &[100, 11]);
        assert!(s.starts_with("[[ 100.,  101.,  102.,  ...,  108.,  109.,  110.],\n        [ 111.,"), "{s}");
        assert!(s.contains("],\n        ...,\n        ["), "{s}");
    }

    #[test]
    fn suffixes_wrap_at_line_width() {
        assert_eq!(add_suffixes("tensor([1, 2]".into(), &["dtype=int32".into()]), "tensor([1, 2], dtype=int32)");
        let long = format!("tensor([{}]", "1".repeat(70));
        assert_eq!(add_suffixes(long.clone(), &["dtype=int32".into()]), format!("{long},\n       dtype=int32)"));
        assert_eq!(fmt_size(&[0, 4]), "(0, 4)");
        assert_eq!(grad_fn_name("log_softmax"), "LogSoftmaxBackward");
    }
}
