//! A custom op in one place: `softplus(x) = max(x, 0) + log1p(exp(-|x|))`,
//! its CPU kernel, its StableHLO lowering and its gradient (the README's
//! "Custom ops" section). `cargo run --release --example custom_op`
use kiln::prelude::*;
use kiln::tensor::custom::mlir_type;
use kiln::{CustomOp, HostBuffer, HostInput, Lowering, Meta};
use std::sync::Arc;

struct Softplus;

impl CustomOp for Softplus {
    fn name(&self) -> &'static str {
        "softplus"
    }
    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        match inputs {
            [x] if x.dtype == DType::F32 => Ok(vec![x.clone()]),
            _ => Err(kiln::Error::invalid("softplus", "takes one float32 tensor")),
        }
    }
    fn cpu(&self, inputs: &[HostInput<'_>], _outputs: &[Meta]) -> Result<Vec<HostBuffer>> {
        let x = inputs[0].contiguous::<f32>()?; // row-major values (copied only from a strided view)
        Ok(vec![HostBuffer::F32(x.iter().map(|v| v.max(0.0) + (-v.abs()).exp().ln_1p()).collect())])
    }
    fn stablehlo(&self, inputs: &[Meta], _outputs: &[Meta]) -> Result<Lowering> {
        let t = mlir_type(&inputs[0].shape, DType::F32); // tensor<1x4xf32>
        Ok(Lowering::Function(format!(
            "%a = stablehlo.abs %arg0 : {t}\n%n = stablehlo.negate %a : {t}\n%e = stablehlo.exponential %n : {t}
             %l = stablehlo.log_plus_one %e : {t}\n%zero = stablehlo.constant dense<0.0> : {t}
             %m = stablehlo.maximum %arg0, %zero : {t}\n%y = stablehlo.add %m, %l : {t}\nreturn %y : {t}"
        )))
    }
    fn backward(
        &self,
        inputs: &[Tensor],
        _outputs: &[Tensor],
        grads: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![grads[0].as_ref().map(|g| g.mul(&inputs[0].sigmoid()?)).transpose()?])
    }
}

pub fn main() -> Result<()> {
    let op: Arc<dyn CustomOp> = Arc::new(Softplus);
    let x = Tensor::new([[-30.0f32, -1.0, 0.5, 40.0]])?;
    x.requires_grad_(true)?;
    let y = Tensor::apply_custom(&op, &[&x])?.remove(0);
    y.sum()?.backward()?;
    let (want, dwant) = (x.detach().exp()?.log1p()?, x.detach().sigmoid()?);
    println!("softplus {:?}, gradient {:?}", y.to_vec::<f32>()?, x.grad().map(|g| g.to_vec::<f32>()).transpose()?);
    // The same op on a PJRT device (the XLA:CPU plugin here), in a compiled function.
    kiln::init_device(Device::Tpu(0))?;
    let mut f = kiln::compile(Device::Tpu(0), move |t: &[Tensor]| Tensor::apply_custom(&op, &[&t[0]]));
    let z = f.call(&[x.detach().to_device(Device::Tpu(0))?])?.remove(0);
    println!("on tpu:0 {:?}", z.to_vec::<f32>()?);
    let close = |a: &Tensor, b: &Tensor| -> Result<bool> { Ok(a.sub(b)?.abs()?.max()?.item::<f32>()? < 1e-5) };
    if !close(&y, &want)? || !close(&z.to_device(Device::Cpu)?, &want)? || !close(&x.grad().unwrap(), &dwant)? {
        return Err(kiln::Error::invalid("softplus", "the custom op disagrees with exp().log1p()"));
    }
    Ok(())
}
