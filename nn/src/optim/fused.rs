//! Fused optimizer updates over host memory: one pass over the parameter, its
//! gradient and the optimizer state, writing in place, with no temporaries.
//! Used when every tensor is a contiguous f32/f64 CPU tensor; the optimizers
//! fall back to tensor ops (any backend) otherwise, with the same arithmetic.
use super::adamw::AdamWParamState;
use kiln_tensor::{DType, Error, HostElement, Result, StorageData, Tensor};
use std::ops::{Add, Div, Mul, Sub};
use std::sync::{RwLockReadGuard, RwLockWriteGuard};

/// The per-step scalars of an AdamW update, computed in f64 like PyTorch's
/// Python-side arithmetic, applied in the parameter's dtype.
pub(crate) struct AdamWScalars {
    pub decay: f64,
    pub apply_decay: bool,
    pub weight1: f64,
    pub beta2: f64,
    pub one_minus_beta2: f64,
    pub bias_correction2_sqrt: f64,
    pub eps: f64,
    pub neg_step_size: f64,
}

/// PyTorch's `lerp` picks its formula by `|weight| < 0.5` (so both ends are exact).
pub(crate) fn lerp_weight_is_small(w: f64) -> bool {
    w.abs() < 0.5
}

/// `1 - w` computed in the dtype's arithmetic type (f64 for f64, else f32), as PyTorch's `lerp` does.
pub(crate) fn lerp_complement(w: f64, dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1.0 - w
    } else {
        (1.0f32 - w as f32) as f64
    }
}

/// The float types the fused kernels run on.
trait HostFloat: HostElement + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self> {
    fn sqrt(self) -> Self;
    fn is_nan(self) -> bool;
}
impl HostFloat for f32 {
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}
impl HostFloat for f64 {
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// `torch.maximum`: NaN wins.
#[inline(always)]
fn maximum<T: HostFloat>(a: T, b: T) -> T {
    if a.is_nan() || a > b {
        a
    } else {
        b
    }
}

enum Guard<'a> {
    Read(RwLockReadGuard<'a, StorageData>),
    Write(RwLockWriteGuard<'a, StorageData>),
}

/// Locks the storages of `tensors` (write access where asked) in address order
/// (see Note [Storage mutability] in kiln-tensor), returning the guards in the
/// order of `tensors`. `None` when two tensors share a storage, or one is not
/// a contiguous tensor in host memory, or while a function is traced: the
/// caller then takes the generic path.
fn lock_host<'a>(tensors: &[(&'a Tensor, bool)]) -> Option<Vec<Guard<'a>>> {
    // A traced function's program sees only ops: writes straight into memory would be left out of it.
    if kiln_tensor::trace::is_tracing() {
        return None;
    }
    for (i, (a, _)) in tensors.iter().enumerate() {
        if a.device() != kiln_tensor::Device::Cpu || !a.is_contiguous() {
            return None;
        }
        if tensors[..i].iter().any(|(b, _)| a.shares_storage(b)) {
            return None;
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].0.storage().addr());
    let mut slots: Vec<Option<Guard<'a>>> = (0..tensors.len()).map(|_| None).collect();
    for i in order {
        let (t, write) = tensors[i];
        let g = if write { Guard::Write(t.storage().write()) } else { Guard::Read(t.storage().read()) };
        let host = match &g {
            Guard::Read(r) => r.as_host().is_some(),
            Guard::Write(w) => w.as_host().is_some(),
        };
        if !host {
            return None;
        }
        slots[i] = Some(g);
    }
    slots.into_iter().collect()
}

fn elems<'g, T: HostFloat>(g: &'g Guard<'_>, t: &Tensor) -> Result<&'g [T]> {
    let buf = match g {
        Guard::Read(r) => r.as_host(),
        Guard::Write(w) => w.as_host(),
    };
    let s = buf.and_then(|b| b.as_slice::<T>()).ok_or_else(|| Error::backend("cpu", "storage is not host memory"))?;
    let o = t.storage_offset();
    Ok(&s[o..o + t.numel()])
}

fn elems_mut<'g, T: HostFloat>(g: &'g mut Guard<'_>, t: &Tensor) -> Result<&'g mut [T]> {
    let Guard::Write(w) = g else { return Err(Error::backend("cpu", "fused update: storage not locked for writing")) };
    let s = w
        .as_host_mut()
        .and_then(|b| b.as_mut_slice::<T>())
        .ok_or_else(|| Error::backend("cpu", "storage is not host memory"))?;
    let o = t.storage_offset();
    Ok(&mut s[o..o + t.numel()])
}

/// The fused AdamW update of one parameter. Returns `Ok(false)` (nothing done)
/// when the tensors do not qualify (not contiguous f32/f64 CPU tensors, or aliased).
pub(crate) fn adamw_host(p: &Tensor, g: &Tensor, st: &AdamWParamState, s: &AdamWScalars) -> Result<bool> {
    match p.dtype() {
        DType::F32 => adamw_typed::<f32>(p, g, st, s),
        DType::F64 => adamw_typed::<f64>(p, g, st, s),
        _ => Ok(false),
    }
}

fn adamw_typed<T: HostFloat>(p: &Tensor, g: &Tensor, st: &AdamWParamState, s: &AdamWScalars) -> Result<bool> {
    let all = [Some(p), Some(g), Some(&st.exp_avg), Some(&st.exp_avg_sq), st.max_exp_avg_sq.as_ref()];
    if all.iter().flatten().any(|t| t.dtype() != T::DTYPE) {
        return Ok(false);
    }
    let mut spec = vec![(p, true), (g, false), (&st.exp_avg, true), (&st.exp_avg_sq, true)];
    if let Some(mx) = &st.max_exp_avg_sq {
        spec.push((mx, true));
    }
    let Some(mut guards) = lock_host(&spec) else { return Ok(false) };
    let c = |x: f64| T::from_f64(x);
    let k = Consts {
        decay: c(if s.apply_decay { s.decay } else { 1.0 }),
        w: c(s.weight1),
        omw: c(lerp_complement(s.weight1, T::DTYPE)),
        b2: c(s.beta2),
        omb2: c(s.one_minus_beta2),
        bc2: c(s.bias_correction2_sqrt),
        eps: c(s.eps),
        nss: c(s.neg_step_size),
    };
    let small = lerp_weight_is_small(s.weight1);
    {
        let (first, rest) = guards.split_at_mut(2);
        let (pg, gg) = first.split_at_mut(1);
        let pv = elems_mut::<T>(&mut pg[0], p)?;
        let gv = elems::<T>(&gg[0], g)?;
        let (mg, rest) = rest.split_at_mut(1);
        let (vg, rest) = rest.split_at_mut(1);
        let mv = elems_mut::<T>(&mut mg[0], &st.exp_avg)?;
        let vv = elems_mut::<T>(&mut vg[0], &st.exp_avg_sq)?;
        match (rest.first_mut(), &st.max_exp_avg_sq, small) {
            (Some(xg), Some(mx), true) => adamw_loop::<T, true, true>(&k, pv, gv, mv, vv, Some(elems_mut(xg, mx)?)),
            (Some(xg), Some(mx), false) => adamw_loop::<T, false, true>(&k, pv, gv, mv, vv, Some(elems_mut(xg, mx)?)),
            (_, _, true) => adamw_loop::<T, true, false>(&k, pv, gv, mv, vv, None),
            (_, _, false) => adamw_loop::<T, false, false>(&k, pv, gv, mv, vv, None),
        }
    }
    drop(guards);
    for t in spec.iter().filter(|(_, w)| *w) {
        t.0.storage().bump_version();
    }
    Ok(true)
}

struct Consts<T> {
    decay: T,
    w: T,
    omw: T,
    b2: T,
    omb2: T,
    bc2: T,
    eps: T,
    nss: T,
}

/// The element loop: the same operations, in the same order, as the op-by-op
/// path in `adamw.rs` (so both round identically).
#[inline(always)]
fn adamw_loop<T: HostFloat, const SMALL: bool, const AMS: bool>(
    k: &Consts<T>,
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    mut mx: Option<&mut [T]>,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i];
        let d = gi - m[i];
        let mi = if SMALL { m[i] + d * k.w } else { gi - d * k.omw };
        m[i] = mi;
        let vi = v[i] * k.b2 + gi * k.omb2 * gi;
        v[i] = vi;
        let second = if AMS {
            let x = mx.as_deref_mut().map_or(vi, |x| {
                let y = maximum(x[i], vi);
                x[i] = y;
                y
            });
            x
        } else {
            vi
        };
        let denom = second.sqrt() / k.bc2 + k.eps;
        p[i] = p[i] * k.decay + mi * k.nss / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn lerp_complement_rounds_in_f32() {
        assert_eq!(lerp_complement(0.75, DType::F32), 0.25);
        assert_eq!(lerp_complement(0.1, DType::F64), 0.9);
        assert!(lerp_weight_is_small(0.1) && !lerp_weight_is_small(0.5));
        assert!(maximum(f32::NAN, 1.0).is_nan());
        assert!(maximum(1.0f32, f32::NAN).is_nan());
    }
}
