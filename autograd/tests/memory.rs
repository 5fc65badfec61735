//! Flat memory over repeated forward + backward steps (its own test binary, so
//! no other test allocates concurrently while the live-storage count is read).
use kiln::autograd::no_grad;
use kiln::prelude::*;

#[test]
fn memory_is_flat_over_training_steps() -> Result<()> {
    let w = Tensor::randn(&[16, 16], DType::F32)?;
    w.requires_grad_(true)?;
    let x = Tensor::randn(&[8, 16], DType::F32)?;
    let step = || -> Result<()> {
        let loss = x.matmul(&w)?.tanh()?.mul(&x.matmul(&w)?)?.mean()?;
        loss.backward()?;
        let _g = no_grad();
        w.sub_(&w.grad().unwrap().mul(0.01)?)?;
        w.zero_grad();
        Ok(())
    };
    for _ in 0..20 {
        step()?;
    }
    let before = kiln::tensor::storage::live_storages();
    for _ in 0..2000 {
        step()?;
    }
    let after = kiln::tensor::storage::live_storages();
    assert!(after <= before, "live storages grew from {before} to {after}");
    Ok(())
}
