//! GGUF's integer types (Q8_0, Q5_0, Q6_K, Q3_K as int8 codes, Q4_0 as
//! int4: `Codes::I8`, `Codes::I4`, one float32 scale per group of 32 or 16,
//! Note [Quantized weights] in kiln-tensor) as resident quantized weights,
//! repacked once and exactly: the product computes with the weights llama.cpp
//! dequantizes to. The types with a per-block minimum (Q4_K, Q5_K, Q2_K,
//! Q4_1, Q5_1) load dequantized.
use super::{GgmlType, GgufFile};
use crate::io::QuantizedWeight;
use kiln_tensor::quant::{Codes, QuantSpec};
use kiln_tensor::{Error, Result, Tensor};

/// Whether a tensor of type `ty` can stay packed.
pub fn packable(ty: GgmlType) -> bool {
    ty.integer_group().is_some()
}

/// The blocks of a weight `[out, inp]` of an integer type as codes and scales.
pub fn pack_blocks(ty: GgmlType, bytes: &[u8], out: usize, inp: usize) -> Result<QuantizedWeight> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let fits = out.checked_mul(inp).and_then(|n| (n / bs).checked_mul(ts)).is_some_and(|n| n == bytes.len());
    let Some(g) = ty.integer_group().filter(|_| inp.is_multiple_of(bs) && fits) else {
        return Err(Error::invalid(
            "gguf",
            format!(
                "cannot pack {} bytes of {ty} as a weight [{out}, {inp}] (Q8_0, Q5_0, Q4_0, Q6_K and Q3_K stay packed)",
                bytes.len()
            ),
        ));
    };
    let mut codes = vec![0i8; out * inp];
    let mut scales = vec![0f32; out * inp / g];
    for ((b, q), s) in bytes.chunks_exact(ts).zip(codes.chunks_exact_mut(bs)).zip(scales.chunks_exact_mut(bs / g)) {
        ty.integer_block(b, q, s);
    }
    let scales = Tensor::from_vec(scales, &[out, inp / g])?;
    if ty == GgmlType::Q4_0 {
        // Codes -8..7 as nibbles q + 8, element 2t low and 2t + 1 high in byte t.
        let packed: Vec<u8> = codes.chunks_exact(2).map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4)).collect();
        let spec = QuantSpec::new(Codes::I4, [1, g], None);
        return QuantizedWeight::new(spec, Tensor::from_vec(packed, &[out, inp / 2])?, scales);
    }
    let spec = QuantSpec::new(Codes::I8, [1, g], None);
    QuantizedWeight::new(spec, Tensor::from_vec(codes, &[out, inp])?, scales)
}

impl GgufFile {
    /// Tensor `name` as a resident quantized weight when it is a matrix of
    /// an integer type ([`packable`]); `None` for other types.
    pub fn packed_weight(&self, name: &str) -> Result<Option<QuantizedWeight>> {
        let (info, bytes) = self.raw(name)?;
        if !packable(info.ggml_type) || info.shape.len() != 2 {
            return Ok(None);
        }
        pack_blocks(info.ggml_type, bytes, info.shape[0], info.shape[1]).map(Some)
    }
}
