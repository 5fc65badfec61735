//! How KV caches store keys and values: in the model's dtype, in bfloat16 or
//! float16 under a float32 model, or in float8 (e4m3fn, e5m2) with a float32
//! scale per row (Note [KV cache dtypes] in kiln-tensor). Both caches, the
//! contiguous one of incremental decoding ([`super::LayerKvCache`]) and the
//! serving engine's paged pool, store rows through [`store_rows`], so a
//! token's logits agree between them under any cache dtype.
use kiln_tensor::{f8e4m3fn, f8e5m2, DType, Error, Result, Tensor};

/// Whether a cache of `kv` can serve a model computing in `model`: the
/// model's own dtype, bfloat16 or float16 under float32, float8 under
/// float32, bfloat16 or float16.
pub fn check_kv_dtype(model: DType, kv: DType) -> Result<()> {
    let fits = match (model, kv) {
        (m, k) if m == k => m.is_float() && !m.is_float8(),
        (DType::F32, DType::BF16 | DType::F16) => true,
        (DType::F32 | DType::BF16 | DType::F16, DType::F8E4M3FN | DType::F8E5M2) => true,
        _ => false,
    };
    if fits {
        Ok(())
    } else {
        Err(Error::dtype(
            "kv_cache_dtype",
            format!(
                "a {model} model cannot keep its KV cache in {kv}: the cache holds the model's dtype, bfloat16 or \
                 float16 under float32, or float8 (e4m3fn, e5m2) under float32, bfloat16 or float16"
            ),
        ))
    }
}

/// The KV cache dtype a command-line or config value names, vLLM's names
/// (`auto` is the model's dtype: `None`): `auto`, `float32`, `bfloat16`,
/// `float16`, `fp8` (`fp8_e4m3`), `fp8_e5m2`.
pub fn parse_kv_cache_dtype(name: &str) -> Result<Option<DType>> {
    Ok(Some(match name {
        "auto" => return Ok(None),
        "float32" | "fp32" => DType::F32,
        "bfloat16" | "bf16" => DType::BF16,
        "float16" | "fp16" | "half" => DType::F16,
        "fp8" | "fp8_e4m3" => DType::F8E4M3FN,
        "fp8_e5m2" => DType::F8E5M2,
        other => {
            return Err(Error::invalid(
                "kv_cache_dtype",
                format!("unknown KV cache dtype {other:?}: expected auto, float32, bfloat16, float16, fp8 (fp8_e4m3) or fp8_e5m2"),
            ))
        }
    }))
}

/// The bytes a cached row of `width` elements takes in `kv`: its elements,
/// and a float8 row's float32 scale.
pub fn row_bytes(kv: DType, width: usize) -> usize {
    let scale = if kv.is_float8() { DType::F32.size_in_bytes() } else { 0 };
    width.saturating_mul(kv.size_in_bytes()).saturating_add(scale)
}

/// Rows `x [.., W]` as a cache of `kv` stores them: the elements in `kv`
/// and, for float8, each row's float32 scale `[..]`: the row divided by
/// `amax(|row|) / max` (`max` the format's largest finite value, so no
/// element overflows; an all-zero row gets scale 1) before rounding.
pub fn store_rows(x: &Tensor, kv: DType) -> Result<(Tensor, Option<Tensor>)> {
    let max = match kv {
        DType::F8E4M3FN => f8e4m3fn::MAX.to_f64(),
        DType::F8E5M2 => f8e5m2::MAX.to_f64(),
        _ => return Ok((x.to_dtype(kv)?, None)),
    };
    let xf = x.to_dtype(DType::F32)?;
    let amax = xf.abs()?.amax(vec![-1], true)?;
    let scales = Tensor::where_cond(&amax.eq(0.0)?, 1.0, &amax.div(max)?)?;
    let q = xf.div(&scales)?.to_dtype(kv)?;
    Ok((q, Some(scales.squeeze_dim(-1)?)))
}

/// Rows stored by [`store_rows`] back in `dtype`: the elements widened (times
/// their row's scale, one float32 product, for float8), then rounded to
/// `dtype` when it is narrower than float32.
pub fn load_rows(x: &Tensor, scales: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
    match scales {
        None => x.to_dtype(dtype),
        Some(s) => x.to_dtype(DType::F32)?.mul(&s.unsqueeze(-1)?)?.to_dtype(dtype),
    }
}
