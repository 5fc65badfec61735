//! Autograd semantics against PyTorch: gradients, views and in-place, version
//! counters, graph lifetime, hooks, checkpointing, long chains, memory.
use kiln::autograd::{self, no_grad};
use kiln::prelude::*;

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, &[v.len()]).unwrap()
}
fn leaf(v: &[f32]) -> Tensor {
    let x = t(v);
    x.requires_grad_(true).unwrap();
    x
}
fn grad(x: &Tensor) -> Vec<f32> {
    x.grad().expect("a gradient").to_vec::<f32>().unwrap()
}
fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{a:?} vs {b:?}");
    }
}

#[test]
fn elementwise_and_broadcasting() -> Result<()> {
    let x = leaf(&[1.0, 2.0, 3.0]);
    x.mul(&x)?.add(&x.exp()?)?.sum()?.backward()?;
    close(&grad(&x), &[2.0 + 1f32.exp(), 4.0 + 2f32.exp(), 6.0 + 3f32.exp()]);

    let a = Tensor::new([[1.0f32], [2.0]])?;
    a.requires_grad_(true)?;
    let b = leaf(&[10.0, 20.0, 30.0]);
    a.mul(&b)?.sum()?.backward()?;
    close(&grad(&a), &[60.0, 60.0]);
    close(&grad(&b), &[3.0, 3.0, 3.0]);
    Ok(())
}

#[test]
fn inplace_on_view_of_non_leaf_matches_pytorch() -> Result<()> {
    // w = [1,2,3,4]; h = 2w; h[1:3] *= w[0:2]; sum(h*h).backward()
    let w = leaf(&[1.0, 2.0, 3.0, 4.0]);
    let h = w.mul(2.0)?;
    h.narrow(0, 1, 2)?.mul_(&w.narrow(0, 0, 2)?)?;
    assert_eq!(h.to_vec::<f32>()?, vec![2.0, 4.0, 12.0, 8.0]);
    h.mul(&h)?.sum()?.backward()?;
    close(&grad(&w), &[40.0, 160.0, 96.0, 32.0]);
    Ok(())
}

#[test]
fn views_replay_after_base_is_modified() -> Result<()> {
    // b = x*1; v = b[:2]; b.mul_(3); sum(v*v).backward() -> v now reads 3x.
    let x = leaf(&[1.0, 2.0, 3.0]);
    let b = x.mul(1.0)?;
    let v = b.narrow(0, 0, 2)?;
    b.mul_(3.0)?;
    v.mul(&v)?.sum()?.backward()?;
    close(&grad(&x), &[18.0, 36.0, 0.0]);
    Ok(())
}

#[test]
fn modified_saved_tensor_is_an_error() -> Result<()> {
    let p = leaf(&[1.0, 2.0]);
    let q = p.mul(1.0)?;
    let r = q.mul(&q)?;
    q.add_(1.0)?;
    let e = r.sum()?.backward().unwrap_err().to_string();
    assert!(e.contains("modified by an inplace operation"), "{e}");
    assert!(e.contains("is at version 1; expected version 0"), "{e}");
    // An op that saves nothing is not affected: add's gradient does not read its inputs.
    let p = leaf(&[1.0, 2.0]);
    let q = p.mul(1.0)?;
    let r = q.add(1.0)?;
    q.add_(1.0)?;
    r.sum()?.backward()?;
    close(&grad(&p), &[1.0, 1.0]);
    Ok(())
}

#[test]
fn leaf_inplace_rules() -> Result<()> {
    let w = leaf(&[1.0, 2.0]);
    let e = w.add_(1.0).unwrap_err().to_string();
    assert!(e.contains("a leaf Variable that requires grad is being used in an in-place operation"), "{e}");
    let e = w.narrow(0, 0, 1)?.add_(1.0).unwrap_err().to_string();
    assert!(e.contains("a view of a leaf Variable"), "{e}");
    {
        let _g = no_grad();
        w.sub_(0.5)?;
    }
    assert_eq!(w.to_vec::<f32>()?, vec![0.5, 1.5]);
    assert!(w.is_leaf() && w.requires_grad());
    Ok(())
}

#[test]
fn copy_into_a_tensor_that_did_not_require_grad() -> Result<()> {
    // buf = zeros(4); buf[1:3] = 2*x; sum(buf * [1,2,3,4]) -> dx = [4, 6]
    let x = leaf(&[1.0, 2.0]);
    let buf = Tensor::zeros(&[4], DType::F32)?;
    buf.narrow(0, 1, 2)?.copy_(&x.mul(2.0)?)?;
    assert!(buf.requires_grad());
    buf.mul(&t(&[1.0, 2.0, 3.0, 4.0]))?.sum()?.backward()?;
    close(&grad(&x), &[4.0, 6.0]);
    Ok(())
}

#[test]
fn reductions_with_ties_and_zeros() -> Result<()> {
    let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
    x.requires_grad_(true)?;
    x.prod()?.backward()?;
    close(&grad(&x), &[24.0, 12.0, 8.0, 6.0]);

    let x = Tensor::new([[1.0f32, 0.0], [3.0, 4.0]])?;
    x.requires_grad_(true)?;
    x.prod_dim(1, false)?.sum()?.backward()?;
    close(&grad(&x), &[0.0, 1.0, 4.0, 3.0]);

    let x = Tensor::new([[0.0f32, 0.0], [3.0, 4.0]])?;
    x.requires_grad_(true)?;
    x.prod()?.backward()?;
    close(&grad(&x), &[0.0, 0.0, 0.0, 0.0]);

    let x = leaf(&[1.0, 5.0, 5.0, 2.0]);
    x.amax(0, false)?.backward()?;
    close(&grad(&x), &[0.0, 0.5, 0.5, 0.0]);

    let x = leaf(&[1.0, 5.0, 5.0, 2.0]);
    x.maximum(&t(&[5.0, 1.0, 5.0, 3.0]))?.sum()?.backward()?;
    close(&grad(&x), &[0.0, 1.0, 0.5, 0.0]);
    Ok(())
}

#[test]
fn accumulation_and_zero_grad() -> Result<()> {
    let x = leaf(&[1.0, 2.0]);
    x.mul(3.0)?.sum()?.backward()?;
    x.mul(3.0)?.sum()?.backward()?;
    close(&grad(&x), &[6.0, 6.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    Ok(())
}

#[test]
fn graph_is_freed_unless_retained() -> Result<()> {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul(&x)?.sum()?;
    y.backward()?;
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("backward through the graph a second time"), "{e}");

    let x = leaf(&[1.0, 2.0]);
    let y = x.mul(&x)?.sum()?;
    autograd::backward_with(&y, &Tensor::ones(&[], DType::F32)?, true)?;
    y.backward()?;
    close(&grad(&x), &[4.0, 8.0]);
    Ok(())
}

#[test]
fn functional_grad_and_double_backward() -> Result<()> {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul(&x)?.mul(&x)?.sum()?; // sum x^3
    let g = autograd::grad(&[&y], &[&x], None, false, true)?;
    let g = g[0].clone().unwrap();
    close(&g.to_vec::<f32>()?, &[3.0, 12.0]);
    assert!(x.grad().is_none(), "grad() must not accumulate into .grad");
    let gg = autograd::grad(&[&g.sum()?], &[&x], None, false, false)?;
    close(&gg[0].clone().unwrap().to_vec::<f32>()?, &[6.0, 12.0]);
    Ok(())
}

#[test]
fn hooks_see_and_replace_gradients() -> Result<()> {
    let x = leaf(&[1.0, 2.0]);
    x.register_hook(|g| Ok(Some(g.mul(10.0)?)))?;
    let h = x.mul(2.0)?;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![]));
    let s2 = seen.clone();
    h.register_hook(move |g| {
        s2.lock().unwrap().extend(g.to_vec::<f32>()?);
        Ok(None)
    })?;
    h.mul(&t(&[1.0, 3.0]))?.sum()?.backward()?;
    assert_eq!(*seen.lock().unwrap(), vec![1.0, 3.0]);
    close(&grad(&x), &[20.0, 60.0]);
    Ok(())
}

#[test]
fn checkpoint_matches_plain_backward() -> Result<()> {
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![xs[0].tanh()?.mul(&xs[1])?.exp()?]) };
    let a = leaf(&[0.1, -0.2, 0.3]);
    let b = leaf(&[1.0, 2.0, -1.0]);
    f(&[a.clone(), b.clone()])?[0].sum()?.backward()?;
    let (ga, gb) = (grad(&a), grad(&b));
    let a2 = leaf(&[0.1, -0.2, 0.3]);
    let b2 = leaf(&[1.0, 2.0, -1.0]);
    let y = autograd::checkpoint(f, &[&a2, &b2])?;
    y[0].sum()?.backward()?;
    close(&grad(&a2), &ga);
    close(&grad(&b2), &gb);
    Ok(())
}

#[test]
fn chain_of_100k_ops() -> Result<()> {
    let x = leaf(&[1.0]);
    let mut y = x.clone();
    for _ in 0..100_000 {
        y = y.add(1.0)?;
    }
    y.sum()?.backward()?;
    close(&grad(&x), &[1.0]);
    // Dropping a long unreleased graph must not overflow the stack either.
    let mut y = x.clone();
    for _ in 0..100_000 {
        y = y.mul(1.0)?;
    }
    drop(y);
    Ok(())
}

#[test]
fn grad_never_aliases_tensors_the_caller_holds() -> Result<()> {
    // The upstream gradient flows unchanged to the leaf: .grad must be a copy of it.
    let x = leaf(&[1.0, 2.0]);
    let y = x.add(0.0)?;
    let up = t(&[5.0, 7.0]);
    autograd::backward_with(&y, &up, false)?;
    let g = x.grad().expect("a gradient");
    g.add_(1.0)?;
    assert_eq!(up.to_vec::<f32>()?, vec![5.0, 7.0]);
    // A gradient that is a kernel's fresh output becomes .grad itself, and is still
    // independent of everything else.
    let z = leaf(&[1.0, 2.0]);
    let w = t(&[3.0, 4.0]);
    z.mul(&w)?.sum()?.backward()?;
    let gz = z.grad().expect("a gradient");
    assert_eq!(gz.to_vec::<f32>()?, vec![3.0, 4.0]);
    gz.mul_(2.0)?;
    assert_eq!(w.to_vec::<f32>()?, vec![3.0, 4.0]);
    assert_eq!(z.grad().expect("a gradient").to_vec::<f32>()?, vec![6.0, 8.0]);
    Ok(())
}
