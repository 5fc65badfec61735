//! GGUF's Q8_0 and Q4_0 blocks as resident quantized weights (`Codes::I8`,
//! `Codes::I4`, one float32 scale per 32 elements: Note [Quantized weights]
//! in kiln-tensor), repacked once and exactly: the product computes with the
//! weights llama.cpp dequantizes to.
use super::{GgmlType, GgufFile};
use crate::io::QuantizedWeight;
use kiln_tensor::half::f16;
use kiln_tensor::quant::{Codes, QuantSpec};
use kiln_tensor::{Error, Result, Tensor};

/// Whether a tensor of type `ty` can stay packed (Q8_0, Q4_0).
pub fn packable(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// Q8_0 or Q4_0 blocks of a weight `[out, inp]` as codes and scales.
pub fn pack_blocks(ty: GgmlType, bytes: &[u8], out: usize, inp: usize) -> Result<QuantizedWeight> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if !packable(ty) || !inp.is_multiple_of(bs) || bytes.len() != out * inp / bs * ts {
        return Err(Error::invalid(
            "gguf",
            format!("cannot pack {} bytes of {ty} as a weight [{out}, {inp}] (Q8_0 and Q4_0 stay packed)", bytes.len()),
        ));
    }
    let blocks = bytes.chunks_exact(ts);
    let scales: Vec<f32> = blocks.clone().map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
    let (codes, spec) = match ty {
        GgmlType::Q8_0 => {
            let c: Vec<i8> = blocks.flat_map(|b| b[2..34].iter().map(|&q| q as i8)).collect();
            (Tensor::from_vec(c, &[out, inp])?, QuantSpec { codes: Codes::I8, block: [1, 32], global: None })
        }
        _ => {
            // GGUF: element j in the low nibble of byte j, j + 16 in its
            // high nibble; kiln: element 2t low, 2t + 1 high, in byte t.
            let c: Vec<u8> = blocks
                .flat_map(|b| {
                    let n = |e: usize| if e < 16 { b[2 + e] & 0x0F } else { b[2 + e - 16] >> 4 };
                    (0..16).map(move |t| n(2 * t) | (n(2 * t + 1) << 4))
                })
                .collect();
            (Tensor::from_vec(c, &[out, inp / 2])?, QuantSpec { codes: Codes::I4, block: [1, 32], global: None })
        }
    };
    QuantizedWeight::new(spec, codes, Tensor::from_vec(scales, &[out, inp / 32])?)
}

impl GgufFile {
    /// Tensor `name` as a resident quantized weight when it is a Q8_0 or
    /// Q4_0 matrix; `None` for other types.
    pub fn packed_weight(&self, name: &str) -> Result<Option<QuantizedWeight>> {
        let (info, bytes) = self.raw(name)?;
        if !packable(info.ggml_type) || info.shape.len() != 2 {
            return Ok(None);
        }
        pack_blocks(info.ggml_type, bytes, info.shape[0], info.shape[1]).map(Some)
    }
}
