//! A finite-difference gradient checker in f64 (like `torch.autograd.gradcheck`).
use kiln_tensor::{DType, Error, Result, Tensor};

/// Tolerances and step of [`gradcheck`].
#[derive(Debug, Clone, Copy)]
pub struct GradcheckOptions {
    pub eps: f64,
    pub atol: f64,
    pub rtol: f64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions { eps: 1e-6, atol: 1e-5, rtol: 1e-3 }
    }
}

/// Checks the analytical gradients of `f` against central finite differences.
///
/// Float inputs are converted to f64 and differentiated; other inputs (indices,
/// masks) are passed through unchanged. The output is projected on a fixed
/// random direction, so one backward checks the whole Jacobian-vector product.
/// Returns an error describing the first mismatch.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], opts: GradcheckOptions) -> Result<()> {
    let xs: Vec<Tensor> = inputs
        .iter()
        .map(|t| if t.dtype().is_float() { t.to_dtype(DType::F64)?.deep_clone() } else { Ok(t.clone()) })
        .collect::<Result<_>>()?;
    let probe = {
        let _g = crate::no_grad();
        f(&xs)?
    };
    // A deterministic direction with no symmetric structure.
    let n = probe.numel();
    let dir: Vec<f64> = (0..n).map(|i| 0.5 + ((i * 7919 + 13) % 101) as f64 / 101.0).collect();
    let dir = Tensor::from_vec(dir, probe.shape())?.to_device(probe.device())?;
    let project = |xs: &[Tensor]| -> Result<f64> {
        let y = f(xs)?;
        y.to_dtype(DType::F64)?.mul(&dir)?.sum()?.item_f64()
    };

    let leaves: Vec<Tensor> = xs.iter().map(|t| t.detach()).collect();
    for t in &leaves {
        if t.dtype().is_float() {
            t.requires_grad_(true)?;
        }
    }
    let y = f(&leaves)?;
    let s = y.to_dtype(DType::F64)?.mul(&dir)?.sum()?;
    let wanted: Vec<&Tensor> = leaves.iter().filter(|t| t.requires_grad()).collect();
    if wanted.is_empty() {
        return Err(Error::invalid("gradcheck", "no floating-point input to differentiate"));
    }
    let analytic = crate::grad(&[&s], &wanted, None, false, false)?;

    let _g = crate::no_grad();
    let mut k = 0;
    for (i, x) in xs.iter().enumerate() {
        if !x.dtype().is_float() {
            continue;
        }
        let a = match &analytic[k] {
            Some(g) => g.to_vec_f64()?,
            None => vec![0.0; x.numel()],
        };
        k += 1;
        let base = x.to_vec_f64()?;
        for j in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut args = xs.clone();
                args[i] = Tensor::from_vec(v, x.shape())?.to_device(x.device())?;
                project(&args)
            };
            let numeric = (eval(opts.eps)? - eval(-opts.eps)?) / (2.0 * opts.eps);
            if (a[j] - numeric).abs() > opts.atol + opts.rtol * numeric.abs() {
                return Err(Error::invalid(
                    "gradcheck",
                    format!("Jacobian mismatch for input {i}, element {j}: analytical {} vs numerical {numeric}", a[j]),
                ));
            }
        }
    }
    Ok(())
}
