//! gpt-oss's MXFP4 experts read into kiln's quantized weight type. gpt-oss
//! stores each expert stack as `*_blocks` (`[experts, out, in / 32, 16]`
//! uint8: 32 E2M1 codes per block, two per byte, the low nibble first) and
//! `*_scales` (`[experts, out, in / 32]` uint8 E8M0 exponents): the bytes of
//! compressed-tensors' MXFP4 (`weight_packed` `[out, in / 2]`, `weight_scale`
//! `[out, in / 32]`, blocks of 1 x 32), regrouped per expert. Its fused
//! `gate_up_proj` interleaves the output rows (gate, up, gate, up, ...), as
//! its forward splits them (`gate_up[..., ::2]`, `gate_up[..., 1::2]`).
use super::QuantizedWeight;
use kiln_tensor::quant::{Codes, QuantSpec};
use kiln_tensor::{DType, Error, Result, Tensor};

fn bad(msg: String) -> Error {
    Error::invalid("gpt_oss_mxfp4_experts", msg)
}

/// One [`QuantizedWeight`] `[out, in]` per expert from gpt-oss's `*_blocks`
/// and `*_scales` tensors (no copy of the codes beyond the per-expert views
/// made contiguous).
pub fn gpt_oss_mxfp4_experts(blocks: &Tensor, scales: &Tensor) -> Result<Vec<QuantizedWeight>> {
    if blocks.dtype() != DType::U8 || blocks.ndim() != 4 || blocks.shape()[3] != 16 {
        return Err(bad(format!(
            "blocks must be uint8 [experts, out, in / 32, 16], got {} {:?}",
            blocks.dtype(),
            blocks.shape()
        )));
    }
    if scales.dtype() != DType::U8 || scales.shape() != &blocks.shape()[..3] {
        return Err(bad(format!(
            "scales must be uint8 {:?} (the blocks' first three dims), got {} {:?}",
            &blocks.shape()[..3],
            scales.dtype(),
            scales.shape()
        )));
    }
    let [experts, out, groups] = [blocks.shape()[0], blocks.shape()[1], blocks.shape()[2]];
    let spec = QuantSpec::new(Codes::E2M1, [1, 32], None);
    (0..experts as isize)
        .map(|e| {
            let codes = blocks.select(0, e)?.reshape_to(&[out, groups * 16])?.contiguous()?;
            let s = scales.select(0, e)?.contiguous()?;
            QuantizedWeight::new(spec.clone(), codes, s)
        })
        .collect()
}

/// gpt-oss's fused `gate_up_proj` of one expert (`[2 * intermediate, in]`,
/// rows interleaved gate, up, gate, up, ...) as its `(gate, up)` weights.
pub fn split_interleaved_gate_up(w: &QuantizedWeight) -> Result<(QuantizedWeight, QuantizedWeight)> {
    let rows = w.shape[0];
    if !rows.is_multiple_of(2) || w.spec.block[0] != 1 {
        return Err(Error::invalid(
            "split_interleaved_gate_up",
            format!("a fused gate_up weight needs an even number of rows, each its own scale row; got {:?} in blocks of {:?}", w.shape, w.spec.block),
        ));
    }
    let pick = |first: i64| -> Result<QuantizedWeight> {
        let idx = Tensor::from_vec((0..rows as i64 / 2).map(|i| 2 * i + first).collect(), &[rows / 2])?;
        QuantizedWeight::new(w.spec.clone(), w.codes.index_select(0, &idx)?, w.scales.index_select(0, &idx)?)
    };
    Ok((pick(0)?, pick(1)?))
}
